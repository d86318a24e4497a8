"""``pdserve bench amx-probe``: build and run ``kernels/cpu/experiments/amx_probe.cpp`` on a CPU
with AMX (``amx_tile`` and ``amx_bf16`` in ``/proc/cpuinfo``) — whether a row's ``TDPBF16PS``
result is independent of the tile's row count, whether a ``VDPBF16PS`` register loop or a scalar
model reproduces its bits, and the tiles' FLOP/cycle at 1 and 16 rows (issue 29, item 2 on AMX:
what a batch-invariant block kernel on tiles could rely on; docs/decisions.md, "Issue 29's
figures by machine class"). Needs g++ 11 or newer; prints why it cannot run elsewhere.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "kernels" / "cpu" / "experiments" / "amx_probe.cpp"
FLAGS = ["-O2", "-mamx-tile", "-mamx-bf16", "-mavx512f", "-mavx512bf16", "-mavx512bw", "-mavx512vl"]


def main(argv: list[str] | None = None) -> int:
    from kernels.cpu import _cpu_flags

    flags = set(_cpu_flags().split())
    if not {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags:
        print("amx-probe: this CPU has no AMX-BF16 (amx_tile, amx_bf16, avx512_bf16): nothing to probe")
        return 0
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        print("amx-probe: no C++ compiler (g++) found", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "amx_probe"
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(binary)], check=True)
        return subprocess.run([str(binary)]).returncode


if __name__ == "__main__":
    raise SystemExit(main())
