"""Eager launch plans: the host path of a Triton op reduced to its allocations and its compiled launches.

A Triton backend function does its Python work on every call: views and strides, the config choice, output
allocation, and Triton's `JITFunction.run` (argument binding, specialization key, cache lookup). Given one call
signature (tensor metadata and plain arguments: dispatch/ops/_common.py `_signature`), all of that is fixed
except the data pointers. So the first eager call of a signature runs the backend once under a recorder that
sees every aten op and every `triton_ops._launch.launch`, and derives a plan:

* allocations: the tensors the call created (shape, strides, dtype), re-created per call with torch.empty_strided,
  zero-filled where the call zeroed them whole, or filled by a copy of a view of an input where the call did that
  before its first launch (e.g. a given scale returned as a copy);
* launches: each compiled kernel with its grid and its arguments, where a tensor argument becomes "the data
  pointer of input i / allocation j plus a byte offset" (raw pointers: Triton's launcher takes ints), a host
  tensor descriptor (Gluon / Triton `TensorDescriptor`) over an input or allocation becomes a copy of it with
  that tensor as its base (its shape, strides and block are fixed by the signature; Triton's launcher encodes
  it), and every other argument a constant;
* outputs: which allocation (or input) each returned tensor is, as a view with its shape, strides and dtype.

CuTe calls are recorded the same way: each call of a compiled TVM-FFI function (every one goes through
`cute_ops._compile.launch`) becomes a launch whose arguments are tensors ("input i / allocation j + byte offset"
with the view's shape, strides and dtype fixed by the signature), None and scalars, in order with the call's Triton
launches (attention_prefill_paged: a Triton gather, the CuTe forward, a Triton fixup). Such plans replay only
natively (dispatch/native_replay.py calls the function through the TVM-FFI C ABI); where the extension cannot take
one, the row's prepared launcher, or else its general entry, serves the signature (`native_only`).

The plan is used only when it reproduces the recorded call exactly: rebuilt from the recorded call's own tensors,
every pointer and every output must come out identical, and the call must have done nothing but allocate, zero,
take views and launch (no recorded launch at all, any other aten op, a launch argument of another kind, or a Triton
launch hook -> no plan; the backend function then runs as usual). Plans with tensor descriptors replay in Python
only. Plans replay on the current device's current stream, as Triton's own launch does, so CUDA-graph capture works
unchanged.

The first eager call of a signature on CUDA is recorded for every row but the reference's: the kernels hand the
scope their records, so dispatch keeps no list of ops or backends that get plans. The contract that makes this
sound is the kernels': every launch goes through one of the two launchers (a kernel run outside them is invisible
to the plan). PLANS_ENV=0 turns plans off (every call then runs the backend function). A plan the C++ extension
can run is also registered there (dispatch/native_replay.py): later calls with its signature then replay in one
Python-to-C++ call. The replay of every op's self-check case is checked against the reference on the GPU, natively
and in Python (tests/test_launch_plan.py).
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from triton_ops.contract.recording import CuteCall, recording_launches

log = logging.getLogger("lowbit.dispatch")
PLANS_ENV = "LOWBIT_EAGER_PLANS"
aten = torch.ops.aten

# Ops that create fresh memory (their result becomes an allocation of the plan).
_FACTORIES = {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
              aten.new_empty_strided.default, aten.empty_like.default}
_ZEROING = {aten.zero_.default, aten.fill_.Scalar}
# Triton launch options: keyword arguments of a launch that are not kernel parameters.
_PLAIN = (int, float, bool, str, type(None), torch.dtype)
CUTE = "cute"  # the `run` field of a CuTe call's launch tuple


class _OpLog(TorchDispatchMode):
    """Runs every aten op and remembers (op, args, kwargs, result, launches made before it)."""

    def __init__(self, launches: list | None = None):
        super().__init__()
        self.ops: list = []
        self._launches = launches if launches is not None else []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out, len(self._launches)))
        return out


def _is_view_op(func, args, out) -> bool:
    """An op whose result only aliases one of its tensor inputs (no data written or copied)."""
    if not isinstance(out, torch.Tensor) or func._schema.name.endswith("_") or "copy" in func._schema.name:
        return False
    base = out.untyped_storage().data_ptr()
    return any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == base for a in args)


@dataclasses.dataclass
class _Alloc:
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    zero: bool = False
    copy_from: tuple | None = None  # (input index, (shape, stride, storage offset relative to the input, dtype))


@dataclasses.dataclass
class LaunchPlan:
    device: torch.device
    allocs: list  # [_Alloc]
    launches: list  # [(run, function, packed_metadata, grid3, [arg spec])]; a CuTe call: (CUTE, fn, None, None, specs)
    outputs: object  # spec tree of the returned value
    keep: list  # tensors the launches read that the call did not create (the backend's persistent buffers)
    kernels: list = dataclasses.field(default_factory=list)  # the CompiledKernel of each launch (native replay)

    def __post_init__(self):
        # What a call does, pre-resolved: each launch's argument list with the constants in place, and the
        # positions whose value is a data pointer (input or allocation, plus a byte offset). A call copies the list
        # and fills only those (~1 us per launch less than resolving every spec on every call).
        self._replay = []
        self.native_only = any(launch[0] == CUTE for launch in self.launches)  # no Python replay of a CuTe call
        for run, function, metadata, grid, specs in self.launches:
            if run == CUTE:
                continue
            template = [s[1] if s[0] == "const" else 0 for s in specs]
            slots = tuple((pos, s[0] == "input", s[1], s[2]) for pos, s in enumerate(specs)
                          if s[0] in ("input", "alloc"))
            descs = tuple((pos, s[1] == "input", s[2], s[3], s[4]) for pos, s in enumerate(specs) if s[0] == "desc")
            self._replay.append((run, function, metadata, grid[0], grid[1], grid[2], template, slots, descs))

    def census(self) -> dict:
        """What one replay does: allocations (and their bytes), zero-fills, copies and launches."""
        nbytes = [_alloc_bytes(a) for a in self.allocs]
        return dict(allocs=len(self.allocs), alloc_bytes=sum(nbytes), zero_fills=sum(a.zero for a in self.allocs),
                    copies=sum(a.copy_from is not None for a in self.allocs), launches=len(self.launches))

    def __call__(self, *args):
        if self.native_only:
            raise RuntimeError("a plan with a CuTe call replays natively only")
        dev = self.device
        allocs = []
        for a in self.allocs:
            t = torch.empty_strided(a.shape, a.stride, dtype=a.dtype, device=dev)
            if a.zero:
                t.zero_()
            elif a.copy_from is not None:
                t.copy_(_input_view(args[a.copy_from[0]], a.copy_from[1]))
            allocs.append(t)
        stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice()) if dev.type == "cuda" else 0
        for run, function, metadata, gx, gy, gz, template, slots, descs in self._replay:
            values = template.copy()
            for pos, from_input, index, offset in slots:
                values[pos] = (args[index] if from_input else allocs[index]).data_ptr() + offset
            for pos, from_input, index, desc, view in descs:
                values[pos] = _rebased(desc, _descriptor_base(args[index] if from_input else allocs[index], view))
            run(gx, gy, gz, stream, function, metadata, None, None, None, *values)
        return _rebuild(self.outputs, args, allocs)


def _alloc_bytes(a: _Alloc) -> int:
    """Bytes an allocation of this shape and these strides spans (0 when empty)."""
    if any(d == 0 for d in a.shape):
        return 0
    return (1 + sum((d - 1) * s for d, s in zip(a.shape, a.stride, strict=True))) * a.dtype.itemsize


def _rebased(desc, base: torch.Tensor):
    """A copy of a host tensor descriptor with another base tensor (same metadata: the signature fixes it)."""
    out = copy.copy(desc)
    out.base = base
    return out


def _is_descriptor(v) -> bool:
    """A host tensor descriptor (triton.tools.tensor_descriptor / Gluon's TensorDescriptor): a tensor base with a
    block shape."""
    return isinstance(getattr(v, "base", None), torch.Tensor) and hasattr(v, "block_shape")


def _descriptor_spec(v, inputs: dict, allocs: list) -> tuple:
    """("desc", "input" | "alloc", index, template without its base, view) for a descriptor over an input or an
    allocation of the call, or over a view of one: view None for the root itself, else (shape, strides, storage
    offset relative to the root's, dtype) of the base."""
    where = _locate(v.base, inputs, allocs)
    if where is None:
        raise NoPlan("a tensor descriptor over a tensor that is not an input or an allocation of the call")
    root, base = (inputs[where[1]] if where[0] == "input" else allocs[where[1]]), v.base
    view = None
    if (root.data_ptr(), root.shape, root.stride(), root.dtype) != (base.data_ptr(), base.shape, base.stride(),
                                                                    base.dtype):
        if where[2] % base.element_size() or (root.storage_offset() * root.element_size()) % base.element_size():
            raise NoPlan("a tensor descriptor's base is not element-aligned in its root")
        rel = base.storage_offset() - root.storage_offset() * root.element_size() // base.element_size()
        view = (tuple(base.shape), base.stride(), rel, base.dtype)
    return ("desc", where[0], where[1], _rebased(v, None), view)


def _descriptor_base(root: torch.Tensor, view):
    if view is None:
        return root
    shape, stride, rel, dtype = view
    if root.dtype != dtype:
        root = root.view(dtype)
    return root.as_strided(shape, stride, root.storage_offset() + rel)


def _value(spec, args, allocs):
    kind = spec[0]
    if kind == "const":
        return spec[1]
    root = args[spec[1]] if kind == "input" else allocs[spec[1]]
    return root.data_ptr() + spec[2]


def _rebuild(spec, args, allocs):
    kind = spec[0]
    if kind == "tuple":
        return tuple(_rebuild(s, args, allocs) for s in spec[1])
    if kind == "const":
        return spec[1]
    root = args[spec[1]] if kind == "input" else allocs[spec[1]]
    if spec[2] is None:  # the root itself
        return root
    shape, stride, offset, dtype = spec[2]
    base = root if root.dtype == dtype else root.view(dtype)
    return base.as_strided(shape, stride, offset)


def _input_view(root: torch.Tensor, view: tuple) -> torch.Tensor:
    shape, stride, rel_offset, _ = view
    return root.as_strided(shape, stride, root.storage_offset() + rel_offset)


def _bound_values(record) -> list | None:
    """[(value, is_constexpr)] of the kernel's parameters in order, as Triton's launch passes them."""
    from triton_ops._launch import bound_values  # on first use: `import dispatch` imports no Triton

    return bound_values(record.kernel, record.args, record.kwargs)


def _locate(t: torch.Tensor, inputs: dict, allocs: list):
    """("input", i, byte offset) / ("alloc", j, byte offset) of the root holding t's data, else None."""
    base = t.untyped_storage().data_ptr()
    for j, a in enumerate(allocs):
        if a.untyped_storage().data_ptr() == base:
            return ("alloc", j, t.data_ptr() - a.data_ptr())
    for i, x in inputs.items():
        if x.untyped_storage().data_ptr() == base:
            return ("input", i, t.data_ptr() - x.data_ptr())
    return None


def _output_spec(value, inputs: dict, allocs: list):
    if isinstance(value, (tuple, list)):
        parts = [_output_spec(v, inputs, allocs) for v in value]
        return None if any(p is None for p in parts) else ("tuple", parts)
    if not isinstance(value, torch.Tensor):
        return ("const", value) if isinstance(value, _PLAIN) else None
    for j, a in enumerate(allocs):
        if value is a:
            return ("alloc", j, None)
    for i, x in inputs.items():
        if value is x:
            return ("input", i, None)
    where = _locate(value, inputs, allocs)
    if where is None or where[0] == "input":
        return None
    return (where[0], where[1], (tuple(value.shape), value.stride(), value.storage_offset(), value.dtype))


def census(ops: list, launches: list) -> dict:
    """What a recorded call did, counted as a plan would replay it: allocations (and their bytes), whole
    zero-fills, copies, launches, and aten ops that are none of these (any of those: no plan)."""
    out = dict(allocs=0, alloc_bytes=0, zero_fills=0, copies=0, launches=len(launches), other_ops=[])
    for func, fargs, _, res, _ in ops:
        if func in _FACTORIES:
            out["allocs"] += 1
            out["alloc_bytes"] += res.untyped_storage().nbytes()
        elif func in _ZEROING:
            out["zero_fills"] += 1
        elif func is aten.copy_.default:
            out["copies"] += 1
        elif not _is_view_op(func, fargs, res):
            out["other_ops"].append(str(func))
    return out


class NoPlan(Exception):
    """Why a call cannot be replayed from a plan (the backend function then runs as usual)."""


def record(impl, args: tuple):
    """Run impl(*args) once while recording; return (its result, a LaunchPlan or None, why not)."""
    from triton import knobs

    with recording_launches() as launches, _OpLog(launches) as oplog:
        out = impl(*args)
    try:
        return out, _derive(out, args, launches, oplog.ops, knobs), None
    except Exception as exc:  # a plan only speeds up a call that already ran correctly: say why, run as usual
        reason = str(exc) if isinstance(exc, NoPlan) else f"{type(exc).__name__}: {exc}"
        log.debug("lowbit launch plan: none for %s: %s", getattr(impl, "__qualname__", impl), reason)
        return out, None, reason


def _derive(out, args, launches, ops, knobs, device_type: str = "cuda"):
    if not launches:
        raise NoPlan("the call made no launch through triton_ops._launch.launch or cute_ops._compile.launch")
    from triton_ops._launch import launch_hooks_set

    if launch_hooks_set(knobs):
        raise NoPlan("a Triton launch hook is set (profilers need the full launch path)")
    inputs = {i: a for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    devices = {a.device for a in inputs.values()}
    if len(devices) != 1 or next(iter(devices)).type != device_type:
        raise NoPlan(f"inputs on {devices}, not one {device_type} device")
    device = next(iter(devices))
    allocs, alloc_meta = [], []
    for func, fargs, _, res, launched in ops:
        if func in _FACTORIES:
            allocs.append(res)
            alloc_meta.append(_Alloc(tuple(res.shape), res.stride(), res.dtype))
        elif func in _ZEROING or func is aten.copy_.default:
            target = fargs[0]
            if func is aten.fill_.Scalar and fargs[1] != 0:
                raise NoPlan(f"fill_ with {fargs[1]}")
            hit = [j for j, a in enumerate(allocs) if a.data_ptr() == target.data_ptr()
                   and a.numel() == target.numel() and target.is_contiguous() and a.is_contiguous()]
            if not hit:
                raise NoPlan(f"{func} on a tensor that is not a whole allocation of the call")
            if func is aten.copy_.default:
                alloc_meta[hit[0]].copy_from = _copy_source(fargs[1], target, inputs, launched)
            else:
                alloc_meta[hit[0]].zero = True
        elif not _is_view_op(func, fargs, res):
            raise NoPlan(f"runs {func} (only allocations, zeroing and views are replayed)")
    keep, plan_launches = [], []
    for rec in launches:
        if isinstance(rec, CuteCall):
            plan_launches.append((CUTE, rec.fn, None, None, [_cute_spec(v, inputs, allocs) for v in rec.args]))
            continue
        values = _bound_values(rec)
        if values is None or rec.compiled is None:
            raise NoPlan("no compiled kernel or signature for a launch")
        specs = []
        for v, is_constexpr in values:
            if is_constexpr:  # compiled into the kernel; passed only to keep the launcher's argument positions
                specs.append(("const", v))
            elif isinstance(v, torch.Tensor):
                where = _locate(v, inputs, allocs)
                if where is None:  # a buffer the backend keeps across calls: its address is a constant
                    keep.append(v)
                    where = ("const", v.data_ptr())
                specs.append(where)
            elif isinstance(v, _PLAIN):
                specs.append(("const", v))
            elif _is_descriptor(v):
                specs.append(_descriptor_spec(v, inputs, allocs))
            else:
                raise NoPlan(f"a launch argument of type {type(v).__name__}")
        grid = tuple(rec.grid) + (1,) * (3 - len(rec.grid))
        compiled = rec.compiled
        plan_launches.append((compiled.run, compiled.function, compiled.packed_metadata, grid, specs))
    outputs = _output_spec(out, inputs, allocs)
    if outputs is None:
        raise NoPlan("an output is neither an allocation of the call nor an input")
    plan = LaunchPlan(device, alloc_meta, plan_launches, outputs, keep,
                      [getattr(rec, "compiled", None) for rec in launches])
    # Self-check against the recorded call: rebuilt from its own tensors, every pointer and output must match.
    for (run, _, _, _, specs), rec in zip(plan_launches, launches, strict=True):
        values = [(v, False) for v in rec.args] if run == CUTE else _bound_values(rec)
        for spec, (v, _) in zip(specs, values, strict=True):
            if isinstance(v, torch.Tensor) and spec[0] != "const" and _value(spec, args, allocs) != v.data_ptr():
                raise NoPlan("a rebuilt pointer differs from the recorded one")
            if spec[0] == "desc":
                base = _descriptor_base((args if spec[1] == "input" else allocs)[spec[2]], spec[4])
                if (base.data_ptr(), base.shape, base.stride(), base.dtype) != (v.base.data_ptr(), v.base.shape,
                                                                                v.base.stride(), v.base.dtype):
                    raise NoPlan("a rebuilt descriptor's base differs from the recorded one")
    rebuilt = _rebuild(outputs, args, allocs)
    if not _same_tree(rebuilt, out):
        raise NoPlan("the rebuilt outputs differ from the recorded ones")
    return plan


def _cute_spec(v, inputs: dict, allocs: list) -> tuple:
    """The spec of one argument of a CuTe call: ("input" | "alloc", index, byte offset, (shape, strides, dtype)) for
    a tensor (a view of an input or an allocation of the call), ("const", value) for None, bool, int and float."""
    if isinstance(v, torch.Tensor):
        where = _locate(v, inputs, allocs)
        if where is None:
            raise NoPlan("a CuTe call's tensor is neither an input nor an allocation of the call")
        return (*where, (tuple(v.shape), tuple(v.stride()), v.dtype))
    if v is None or type(v) in (bool, int, float):
        return ("const", v)
    raise NoPlan(f"a CuTe call argument of type {type(v).__name__}")


def _copy_source(src, dst, inputs: dict, launched: int) -> tuple:
    """(input index, view) of a copy into a whole allocation that a plan can repeat: the source must be a view of
    an input with the destination's dtype and shape, copied before the call's first launch."""
    if launched:
        raise NoPlan("a copy after a launch")
    for i, x in inputs.items():
        if (x.untyped_storage().data_ptr() == src.untyped_storage().data_ptr() and src.dtype == x.dtype == dst.dtype
                and src.shape == dst.shape):
            return i, (tuple(src.shape), src.stride(), src.storage_offset() - x.storage_offset(), src.dtype)
    raise NoPlan("a copy whose source is not a view of an input")


def _same_tree(a, b) -> bool:
    if isinstance(b, (tuple, list)):
        return isinstance(a, tuple) and len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and a.data_ptr() == b.data_ptr() and a.shape == b.shape
                and a.stride() == b.stride() and a.dtype == b.dtype)
    return a is b or a == b
