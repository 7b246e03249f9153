"""The FlashMLA benchmark peer (perf/peers.py): the logical -> physical index translation against a loop, the
library's lookup and its absence, its C ABI loading without a GPU; on an sm_90 GPU with the library present, its
dense bf16 and sparse V3.2 / V4 FP8 outputs and LSE against the fp64 contract reference (dispatch/reference)."""

from __future__ import annotations

import math
import shutil
import subprocess

import numpy as np
import pytest
import torch

from dispatch import ops
from dispatch.reference.attention import mla_decode as mla_reference
from perf import peers
from tests.helpers import assert_attention_close, random_block_table

WIDTH = {"bf16": 576, "v32": 576, "v4": 512}


def _library_or_skip():
    if not peers.flashmla_library_path().is_file():
        pytest.skip(f"FlashMLA library not built ({peers.flashmla_library_path()})")


def _expected_slots(indices, table, seqused, page, causal):
    bsz, sq, topk = indices.shape
    out = torch.full_like(indices, -1)
    for b in range(bsz):
        for s in range(sq):
            limit = int(seqused[b]) - (sq - 1 - s if causal else 0)
            for k in range(topk):
                p = int(indices[b, s, k])
                if 0 <= p < limit and p < table.shape[1] * page:
                    out[b, s, k] = int(table[b, p // page]) * page + p % page
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_physical_indices_match_loop(seed, causal):
    g = np.random.default_rng(seed)
    bsz, sq, topk, page, max_blocks = 3, int(g.integers(1, 4)), 37, 16, 4
    lens = [int(g.integers(0, page * max_blocks + 1)) for _ in range(bsz)]
    table = random_block_table(g, bsz, max_blocks, bsz * max_blocks + 2, lens, page)
    idx = torch.from_numpy(g.integers(-3, page * max_blocks + 20, (bsz, sq, topk)).astype(np.int32))
    seqused = torch.tensor(lens, dtype=torch.int32)
    got = peers.flashmla_physical_indices(idx, table, seqused, page, causal)
    assert got.dtype == torch.int32 and got.is_contiguous()
    assert torch.equal(got, _expected_slots(idx, table, seqused, page, causal))


def test_missing_library_omits_the_peer(monkeypatch, tmp_path):
    monkeypatch.setenv(peers.FLASHMLA_ENV, str(tmp_path / "absent.so"))
    monkeypatch.setattr(peers, "_FLASHMLA", {})
    assert peers.flashmla_mla_decode("bf16", 512, 0.1) is None
    assert "not found" in peers.unavailable_reasons()[peers._FLASHMLA_KEY]
    assert peers.flashmla_version() is None


def test_not_a_library_omits_the_peer(monkeypatch, tmp_path):
    bad = tmp_path / "libflashmla_lowbit.so"
    bad.write_bytes(b"not an ELF file")
    monkeypatch.setenv(peers.FLASHMLA_ENV, str(bad))
    monkeypatch.setattr(peers, "_FLASHMLA", {})
    assert peers.flashmla_mla_decode("bf16", 512, 0.1) is None
    assert "OSError" in peers.unavailable_reasons()[peers._FLASHMLA_KEY]


def test_library_loads_and_rejects_without_crashing(monkeypatch):
    """The C ABI loads with ctypes without a GPU (CUDA runtime linked statically, libcuda opened lazily); bad
    arguments and a missing device come back as error codes with a message, not as a process exit."""
    _library_or_skip()
    monkeypatch.setattr(peers, "_FLASHMLA", {})
    lib = peers._flashmla_lib()
    assert lib is not None, peers.unavailable_reasons()
    assert peers.flashmla_version() is not None
    assert lib.flashmla_dense_num_sm_parts(1, 128, 1, 132) == 66
    assert lib.flashmla_sparse_num_sm_parts(1, 128, 132) == 66
    assert lib.flashmla_get_metadata(2, 1, 0, None, None, None, 66, None) != 0
    assert b"seqlens_k" in lib.flashmla_last_error()
    rc = lib.flashmla_decode_bf16(*([None] * 6), 2, 1, 128, 1, 576, 512, 4, 32, 4, 0, 0, 0, 0.1, 1, None, None,
                                  66, None, None, None)
    assert rc != 0 and b"page must be 64" in lib.flashmla_last_error()
    rc = lib.flashmla_decode_sparse_fp8(*([None] * 5), 2, 1, 128, 576, 512, 4, 64, 100, 656 * 64, 656, 0.1, None,
                                        None, 66, None, None, None)
    assert rc != 0 and b"multiple of 64" in lib.flashmla_last_error()


def test_library_abi_and_partitions(monkeypatch):
    """The built library (perf/peers_src/build_flashmla.sh) through peers.py: ABI 1, 8-int scheduler rows, a positive
    partition count for every shape the mla_decode cases use and 0 with a message for a head count it lacks."""
    _library_or_skip()
    monkeypatch.setattr(peers, "_FLASHMLA", {})
    lib = peers._flashmla_lib()
    assert lib is not None, peers.unavailable_reasons()
    assert lib.flashmla_abi_version() == 1
    assert lib.flashmla_sched_meta_ints() == 8
    for sq in (1, 2, 4):
        for sms in (78, 132):
            assert lib.flashmla_dense_num_sm_parts(sq, 128, 1, sms) > 0
            assert lib.flashmla_sparse_num_sm_parts(sq, 128, sms) > 0
    assert lib.flashmla_sparse_num_sm_parts(1, 64, 132) == 0
    assert b"h must be 128" in lib.flashmla_last_error()


def test_library_without_a_gpu_reports_the_device(monkeypatch):
    """Arguments that pass every check reach the device check: without a GPU that is an error code and a message,
    never a launch (the pointers are placeholders the library must not touch)."""
    _library_or_skip()
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: these placeholder pointers would be launched on")
    monkeypatch.setattr(peers, "_FLASHMLA", {})
    lib = peers._flashmla_lib()
    assert lib is not None, peers.unavailable_reasons()
    fake = 256
    assert lib.flashmla_get_metadata(2, 1, 128, None, fake, fake, 66, None) != 0
    assert b"CUDA device" in lib.flashmla_last_error()
    rc = lib.flashmla_decode_sparse_fp8(*([fake] * 5), 2, 1, 128, 512, 512, 4, 64, 128, 584 * 64, 584, 0.1, fake,
                                        fake, 66, fake, fake, None)
    assert rc != 0 and b"CUDA device" in lib.flashmla_last_error()


def _dynamic_symbols(path, *flags) -> set[str]:
    out = subprocess.run(["nm", "-D", *flags, str(path)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def test_library_exports_the_c_abi_and_hides_its_cuda_runtime():
    """Exactly the functions peers.py binds are exported under their C names; the CUDA runtime is linked in and
    hidden (no cuda* symbol exported or imported), so it cannot bind to another runtime loaded in the process."""
    _library_or_skip()
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) not installed")
    path = peers.flashmla_library_path()
    defined = _dynamic_symbols(path, "--defined-only")
    assert {s for s in defined if s.startswith("flashmla_")} == set(peers._FLASHMLA_SIGS)
    undefined = _dynamic_symbols(path, "--undefined-only")
    assert not {s for s in defined | undefined if s.startswith(("cuda", "__cuda"))}


# ------------------------------------------------------------------------------------------------------ GPU


def _case(layout, lens, topk, sq, seed, device):
    """Every cache slot written (FlashMLA reads whole pages and keys a query does not see, masked after the
    product), each sequence its own random pages, the table's tail garbage; sparse lists over [-1, max len + 3)."""
    g = np.random.default_rng(seed)
    d, page, bsz = WIDTH[layout], 64, len(lens)
    max_blocks = -(-max(lens) // page) + 1
    nb = bsz * max_blocks + 3
    table = random_block_table(g, bsz, max_blocks, nb, lens, page).to(device)
    kv = torch.from_numpy(g.standard_normal((nb * page, d)).astype(np.float32)).to(device) * 2
    if layout == "bf16":
        cache = kv.to(torch.bfloat16).view(nb, page, 1, d)
    else:
        cache = ops.ds_kv_cache_empty(nb, page, layout, device)
        ops.ds_kv_write(kv, torch.arange(nb * page, device=device, dtype=torch.int32), cache, layout=layout)
    q = torch.from_numpy(g.standard_normal((bsz, sq, 128, d)).astype(np.float32)).to(torch.bfloat16).to(device)
    idx = None
    if topk:
        idx = torch.from_numpy(g.integers(-1, max(lens) + 3, (bsz, sq, topk)).astype(np.int32)).to(device)
    seqused = torch.tensor(lens, dtype=torch.int32, device=device)
    return {"q": q, "cache": cache, "table": table, "seqused": seqused, "indices": idx}


@pytest.mark.gpu
@pytest.mark.parametrize("layout,topk,v_dim", [("bf16", 0, 512), ("v32", 128, 512), ("v4", 128, 512),
                                                ("v4", 128, 448), ("v32", 2048, 512), ("v4", 1024, 448)])
@pytest.mark.parametrize("sq", [1, 2])
def test_gpu_peer_matches_reference(layout, topk, v_dim, sq):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("FlashMLA library is sm_90a only")
    _library_or_skip()
    d = WIDTH[layout]
    scale = 1.0 / math.sqrt(192)
    # dense: every query sees a key (len >= Sq); sparse: every list names some valid position
    lens = [700, 2100, 4096] if topk else [2, 63, 64, 65, 700, 2100]
    i = _case(layout, lens, topk, sq, 7, torch.device("cuda"))
    fn = peers.flashmla_mla_decode(layout, v_dim, scale)
    assert fn is not None, peers.unavailable_reasons()
    assert fn.probe(i) is None
    out, lse = fn.run(i)
    want = mla_reference(i["q"], i["cache"], i["table"], i["seqused"], i["indices"], layout, v_dim, scale, True, -1, 0)
    assert_attention_close(out, lse, *want, f"flashmla {layout} d={d} v={v_dim} topk={topk} Sq={sq}")
