"""Checks and fake outputs shared by the ops that end in a quantized store (rmsnorm, swiglu): the x / block /
global-scale checks and the shapes of FP8-group / MXFP4 / NVFP4 outputs."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from triton_ops.contract import checks as C
from triton_ops.contract.formats import MX_ROUNDINGS, MXFP4_BLOCK, NVFP4_BLOCK, fp8_scale_storage, round_up


def _check_x(op: str, x: Tensor) -> None:
    C.check_tensor(op, "x", x)
    C.check_dtype(op, "x", x, C.FLOAT_INPUTS)
    C.check_min_dims(op, "x", x, 1)
    C.rows_view(op, "x", x)


def _check_block(op: str, arg: str, x: Tensor, k: int, block: int, what: str) -> None:
    if k % block:
        C.fail(op, arg, f"output row length {k} is not a multiple of {block} ({what})")


def _check_gs(op: str, gs: Tensor | None, x: Tensor, groups: int | None) -> None:
    if gs is None:
        return
    C.check_tensor(op, "global_scale", gs)
    C.check_same_device(op, "x", x, "global_scale", gs)
    if groups is None or gs.numel() == 1:
        C.check_scalar_tensor(op, "global_scale", gs)
    else:
        C.check_dtype(op, "global_scale", gs, (torch.float32,))
        if gs.dim() != 1:
            C.fail(op, "global_scale", f"expected a scalar or one scale per expert [E], got shape {tuple(gs.shape)}")
        if groups > 0 and gs.numel() < groups:
            C.fail(op, "global_scale", f"holds {gs.numel()} scales but masked_m has {groups} groups")


def _check_quant_args(op: str, x: Tensor, k: int, quant: str, qargs: tuple, groups: int | None = None) -> None:
    if quant == "fp8_group":
        group_size, quant_eps = qargs[0], qargs[1]
        if group_size <= 0:
            C.fail(op, "group_size", f"must be positive, got {group_size}")
        _check_block(op, "x", x, k, group_size, f"group_size={group_size}")
        if not quant_eps > 0:
            C.fail(op, "quant_eps", f"must be > 0 (it keeps all-zero groups finite), got {quant_eps}")
    elif quant == "mxfp4":
        _check_block(op, "x", x, k, MXFP4_BLOCK, "MXFP4 blocks are 32 elements")
        if qargs[0] not in MX_ROUNDINGS:
            C.fail(op, "rounding", f"{qargs[0]!r} is not one of {', '.join(MX_ROUNDINGS)}")
    elif quant == "nvfp4":
        _check_block(op, "x", x, k, NVFP4_BLOCK, "NVFP4 blocks are 16 elements")
        _check_gs(op, qargs[0], x, groups)


def _fake_quant(x: Tensor, lead: tuple, k: int, quant: str, qargs: tuple):
    if quant == "fp8_group":
        group_size, _, _, column_major = qargs
        return (x.new_empty(*lead, k, dtype=torch.float8_e4m3fn),
                fp8_scale_storage(lead, k // group_size, column_major, x.device))
    block = MXFP4_BLOCK if quant == "mxfp4" else NVFP4_BLOCK
    swizzle = qargs[-1]
    rows = math.prod(lead)
    sdt = torch.uint8 if quant == "mxfp4" else torch.float8_e4m3fn
    scales = (x.new_empty(round_up(rows, 128), round_up(k // block, 4), dtype=sdt) if swizzle
              else x.new_empty(*lead, k // block, dtype=sdt))
    codes = x.new_empty(*lead, k // 2, dtype=torch.uint8)
    if quant == "mxfp4":
        return codes, scales
    gs = qargs[0]
    return codes, scales, x.new_empty(() if gs is None or gs.numel() == 1 else (gs.numel(),), dtype=torch.float32)
