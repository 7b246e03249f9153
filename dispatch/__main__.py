"""`python -m dispatch [--arch sm_100] [--markdown]`: print the dispatch table.
`python -m dispatch check [--ops OP ...] [--json PATH]`: the self-check (dispatch/selfcheck.py: every op
through auto dispatch vs the reference)."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dispatch", description=__doc__)
    parser.add_argument("command", nargs="?", default="table", choices=("table", "check"))
    parser.add_argument("--arch", help="describe another arch (e.g. sm_100); default: this machine")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--json", help="check: also write results as JSON to this path")
    parser.add_argument("--ops", nargs="+", help="check: only these ops (e.g. under compute-sanitizer)")
    args = parser.parse_args(argv)

    import torch

    if args.command == "check":
        if not torch.cuda.is_available():
            # Must be set before any Triton kernel module is imported (triton.jit reads it then).
            os.environ.setdefault("TRITON_INTERPRET", "1")
        from .selfcheck import run_selfcheck

        return run_selfcheck(json_path=args.json, ops=args.ops)

    from triton_ops.contract.arch import ARCH_ENV, KNOWN_ARCHS, normalize_arch, resolve_arch

    from .describe import format_table
    from .registry import unsupported_arch_message

    try:
        arch = normalize_arch(args.arch) if args.arch else resolve_arch()
    except ValueError:  # a bad --arch or LOWBIT_ARCH: one line, no traceback
        source = f"--arch {args.arch!r}" if args.arch else f"{ARCH_ENV}={os.environ.get(ARCH_ENV)!r}"
        print(f"{parser.prog}: cannot parse {source}; valid archs: {', '.join(KNOWN_ARCHS)} (or e.g. sm_90a, 100a)",
              file=sys.stderr)
        return 2
    if arch not in KNOWN_ARCHS:  # e.g. sm_75: say so, rather than a table of "not built" rows
        print(f"{parser.prog}: {unsupported_arch_message(arch)}", file=sys.stderr)
        return 2
    print(f"lowbit dispatch table for {arch}  (AUTO = what backend='auto' picks when the input is supported)")
    print(format_table(arch, markdown=args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
