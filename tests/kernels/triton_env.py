"""Running the Triton kernel tests: compiled on a CUDA GPU, else under Triton's interpreter on
CPU tensors.

``TRITON_INTERPRET=1`` only works when set before ``triton`` is first imported (its standard
library functions are decorated then), and other tests may import it first (``torch._dynamo``
does). So on a machine without a GPU, each ``test_triton_*.py`` runs its cases file
(``triton_cases_*.py``) in a child pytest with the variable set, and fails when the child does;
this process's environment is never changed. The child's skips are reported here (one warning
each, in this run's warnings summary, and returned, so a caller can refuse unexpected ones): a
case skipped inside the child is otherwise invisible. With a GPU, or inside that child, the
cases run in-process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def in_process() -> bool:
    """Whether the cases run here: a usable GPU, or the interpreter already switched on."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return torch.cuda.is_available() and os.environ.get("PD_TRITON_INTERPRET") != "1"


def device() -> torch.device:
    return torch.device("cpu") if os.environ.get("TRITON_INTERPRET") == "1" else torch.device("cuda")


def load_kernels():
    """``kernels.triton`` with its kernels imported (compiled or interpreted)."""
    pytest.importorskip("triton")
    import kernels.triton as tk
    from kernels.triton import _jit  # noqa: F401  (decorate the kernels now)

    return tk


class ChildSkip(UserWarning):
    """A case skipped inside the interpreter's child pytest."""


def run_cases_in_interpreter(cases: str, timeout_s: float = 240) -> tuple[str, list[str]]:
    """Run ``tests/kernels/<cases>`` in a child pytest with ``TRITON_INTERPRET=1``.

    Returns the child's output and the reasons of the cases it skipped (one entry per skipped
    case), each also warned here as :class:`ChildSkip`; fails the calling test (with that
    output) when the child fails or passes nothing.
    """
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
           str(REPO / "tests" / "kernels" / cases)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    out = proc.stdout + proc.stderr
    print(out[-3000:])
    assert proc.returncode == 0, f"interpreted Triton cases failed:\n{out[-8000:]}"
    assert re.search(r"\b[1-9]\d* passed\b", out) and " failed" not in out, out[-3000:]
    skips = child_skips(out)
    for reason in skips:
        warnings.warn(f"{cases}: a case skipped in the interpreter's child pytest: {reason}", ChildSkip, stacklevel=2)
    return out, skips


def child_skips(out: str) -> list[str]:
    """Skip reasons from a pytest ``-rs`` summary (``SKIPPED [n] path:line: reason``), one per case."""
    reasons = []
    for count, reason in re.findall(r"^SKIPPED \[(\d+)\] [^\n]*?:\d+: ([^\n]*)$", out, flags=re.M):
        reasons.extend([reason] * int(count))
    total = re.search(r"\b(\d+) skipped\b", out)
    assert len(reasons) == (int(total.group(1)) if total else 0), out[-3000:]  # every skip has its line
    return reasons
