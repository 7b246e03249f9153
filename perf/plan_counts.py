"""What each eager case's launch plan replays per call, counted on the CPU: allocations (and bytes), zero-fills,
copies and launches of the Triton backend (the per-call host work the native replay does; docs/perf.md).

    TRITON_INTERPRET=1 python -m perf.plan_counts [--ops nvfp4_quantize,moe_align] [--json out.json]

Each case of `dispatch.selfcheck.all_cases()` (small shapes) runs its Triton backend once under the Triton
interpreter while the plan recorder watches (dispatch/launch_plan.py `census`): the counts are those of the
plan a GPU call records for the same case, shapes aside (a case whose Triton row is not the one `auto` takes on
the GPU, e.g. a CuTe or Gluon row, is counted for the plain Triton row: `impl` in the JSON names the row counted).
On a GPU, perf.eager's breakdowns give the same counts from the recorded plans themselves.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os


def case_counts(case, device) -> dict:
    """The census of one case's Triton backend call (or why there is none)."""
    from dispatch.launch_plan import census
    from dispatch.registry import select
    from dispatch.table import TABLE
    from triton_ops.contract.recording import recording_launches

    args = case.make_args(device, True)
    rows = [e for e in TABLE[case.op] if e.backend == "triton" and device.type in e.archs]
    if not rows:
        return dict(op=case.op, label=case.label, skipped=f"no Triton row for {device.type}")
    try:
        entry = select(TABLE[case.op], case.op, "triton", args, {})
    except Exception as exc:  # the Triton rows refuse this case here: say so
        return dict(op=case.op, label=case.label, skipped=f"{type(exc).__name__}: {str(exc)[:120]}")
    impl = entry.resolve_impl()
    with recording_launches() as launches, _HostOps(launches) as oplog, _kernels_unrecorded(oplog):
        impl(*args)
    return dict(op=case.op, label=case.label, impl=entry.impl, **census(oplog.ops, launches))


def _host_ops_class():
    from dispatch.launch_plan import _OpLog

    class HostOps(_OpLog):
        """The op log, paused while the interpreter runs a kernel (its own copies are no host work of a GPU call)."""
        paused = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.paused:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    return HostOps


def _HostOps(launches):  # noqa: N802 - a class, built lazily (dispatch imports torch)
    return _host_ops_class()(launches)


@contextlib.contextmanager
def _kernels_unrecorded(oplog):
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def paused_run(self, *args, **kwargs):
        oplog.paused = True
        try:
            return run(self, *args, **kwargs)
        finally:
            oplog.paused = False

    InterpretedFunction.run = paused_run
    try:
        yield
    finally:
        InterpretedFunction.run = run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", help="comma-separated op names (default: every op with a self-check case)")
    p.add_argument("--json", help="also write the counts here")
    a = p.parse_args()
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from dispatch.selfcheck import all_cases

    ops = set(a.ops.split(",")) if a.ops else None
    rows = [case_counts(c, torch.device("cpu")) for c in all_cases() if ops is None or c.op in ops]
    print(f"{'op':<26} {'case':<44} allocs  bytes    zero copy launch other")
    for r in rows:
        if "skipped" in r:
            print(f"{r['op']:<26} {r['label'][:44]:<44} -- {r['skipped']}")
            continue
        print(f"{r['op']:<26} {r['label'][:44]:<44} {r['allocs']:>6} {r['alloc_bytes']:>8} {r['zero_fills']:>4} "
              f"{r['copies']:>4} {r['launches']:>6} {','.join(r['other_ops'])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
