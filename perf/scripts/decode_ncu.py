"""Paged decode under Nsight Compute: the rule's kernels on a bf16 and an FP8 E4M3 cache, and cuDNN SDPA on the
dense bf16 copy, at one shape (Llama 32/8 heads, hd 128, page 64). Run under ncu, e.g.

    ncu --csv --page details --section SpeedOfLight --section WarpStateStats ... \
        python -m perf.scripts.decode_ncu --batch 16 --context 8192
"""

from __future__ import annotations

import argparse

import torch

from dispatch import ops

from ..cases.attention import _decode_case


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=2)
    args = ap.parse_args()
    dev = torch.device("cuda")
    for kv in ("bf16", "fp8"):
        case = _decode_case("llama", args.batch, args.context, 32, 8, 128, kv=kv)
        i = case.make(dev)
        for _ in range(args.calls):
            ops.attention_decode(i["q"], i["k_cache"], i["v_cache"], i["table"], i["seqused"], k_scale=i["k_scale"],
                                 v_scale=i["v_scale"], backend="triton")
        if kv == "bf16":
            for _ in range(args.calls):
                case.peers["sdpa-cudnn"](i)
        torch.cuda.synchronize()
        print(f"{kv}: KV bytes {case.bytes_moved / 1e6:.1f} MB", flush=True)
        i.clear()


if __name__ == "__main__":
    main()
