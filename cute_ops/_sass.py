"""Compile a CuTeDSL kernel for an arch, keep its PTX and cubin, and disassemble the cubin (tests assert on SASS).

Works on a machine without a GPU: the compile target comes from the config (`--gpu-arch`), and the
disassembler is the `cuobjdump`/`nvdisasm` shipped in the Triton wheel (triton/backends/nvidia/bin) or the
nvidia-cuda-nvdisasm wheel, else one on PATH. This bypasses the compile cache (it needs the artifacts).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path


@dataclasses.dataclass
class Dump:
    ptx: str
    sass: str
    usage: str = ""  # `cuobjdump -res-usage` of the cubin(s)

    def resources(self) -> dict[str, int]:
        """The first kernel's resource line: {'REG': registers per thread at launch, 'STACK', 'SHARED' (static
        bytes), 'LOCAL', ...}; empty when no usage was recorded."""
        m = re.search(r"REG:\d+.*", self.usage)
        return {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", m.group(0))} if m else {}

    def max_register(self) -> int:
        """The highest general register index the SASS names (+1: the registers the busiest branch touches)."""
        return max((int(r) for r in re.findall(r"\bR(\d+)\b", self.sass)), default=-1) + 1

    def opcodes(self) -> collections.Counter:
        """SASS opcode (with modifiers, e.g. 'LDG.E.128') -> count."""
        ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)", self.sass)
        return collections.Counter(ops)

    def count(self, prefix: str) -> int:
        return sum(n for op, n in self.opcodes().items() if op == prefix or op.startswith(prefix + "."))


def find_tool(name: str) -> str | None:
    """cuobjdump / nvdisasm: Triton's bundled copy, the nvidia-cuda-nvdisasm wheel, then PATH."""
    candidates = []
    try:
        import triton

        candidates.append(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)
    except Exception:  # noqa: BLE001 - triton is optional here
        pass
    try:
        import nvidia.cuda_nvdisasm as nd  # type: ignore[import-not-found]

        candidates.append(Path(next(iter(nd.__path__))) / "bin" / name)
    except Exception:  # noqa: BLE001 - wheel not installed
        pass
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return shutil.which(name)


def disassemble(cubin: Path) -> str:
    tool = find_tool("cuobjdump")
    if tool:
        return subprocess.run([tool, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    tool = find_tool("nvdisasm")
    if tool:
        return subprocess.run([tool, str(cubin)], check=True, capture_output=True, text=True).stdout
    raise RuntimeError("no cuobjdump/nvdisasm found (install triton or nvidia-cuda-nvdisasm)")


def resource_usage(cubin: Path) -> str:
    """`cuobjdump -res-usage` of a cubin ('' without cuobjdump)."""
    tool = find_tool("cuobjdump")
    if not tool:
        return ""
    return subprocess.run([tool, "-res-usage", str(cubin)], check=True, capture_output=True, text=True).stdout


def compile_and_dump(compile_fn: Callable[[str], object]) -> Dump:
    """`compile_fn(extra_options)` must call cute.compile with `extra_options` appended to its options."""
    with tempfile.TemporaryDirectory(prefix="lowbit-cute-dump-") as d:
        compile_fn(f"--keep-ptx --keep-cubin --dump-dir {d}")
        cubins = sorted(Path(d).rglob("*.cubin"))
        ptxs = sorted(Path(d).rglob("*.ptx"))
        if not cubins:
            raise RuntimeError(f"cute.compile kept no cubin in {d}: {sorted(p.name for p in Path(d).rglob('*'))}")
        sass = "\n".join(disassemble(c) for c in cubins)
        ptx = "\n".join(p.read_text() for p in ptxs)
        usage = "\n".join(resource_usage(c) for c in cubins)
    return Dump(ptx=ptx, sass=sass, usage=usage)
