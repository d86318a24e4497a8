"""Linear layers over GGUF's 4- and 8-bit blocks as stored (``quant_linear.cpp``, AVX2 + FMA),
built on first use like the attention extension (cached per source, flags and CPU under
``$TORCH_EXTENSIONS_DIR``).

torch's own packed-weight ops (``_weight_int4pack_mm_for_cpu``, ``_weight_int8pack_mm``) have
vectorized paths for AVX-512 only; on an AVX2-only CPU they measured 15-50x slower than a
float32 GEMV, so this kernel exists for CPUs where that gap is measured (docs/decisions.md).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import sys
from pathlib import Path

import torch

from kernels.cpu import _cpu_flags

__all__ = ["load", "available"]


@functools.cache
def load():
    """The compiled extension (``q4_linear``, ``q8_linear``, ``q4_dequantize``, ``q8_dequantize``).

    Raises:
        RuntimeError: no C++ compiler, the build failed, or the CPU lacks AVX2/FMA.
    """
    from torch.utils.cpp_extension import _get_build_directory
    from torch.utils.cpp_extension import load as build

    if not available():
        raise RuntimeError("the quantized linear kernel needs a CPU with AVX2 and FMA")
    source = Path(__file__).with_name("quant_linear.cpp")
    flags = ["-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c"]
    if os.environ.get("PD_KERNEL_MARCH_NATIVE", "1") == "1":
        flags.append("-march=native")
    key = hashlib.sha256("\0".join([source.read_text(), *flags, sys.executable, torch.__version__,
                                     _cpu_flags()]).encode()).hexdigest()[:12]
    name = f"pdserve_cpu_quant_linear_{key}"
    folder = Path(_get_build_directory(name, verbose=False))
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "pdserve.build.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (folder / "lock").unlink(missing_ok=True)  # stale: no other builder holds the flock
        return build(name=name, sources=[str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                     build_directory=str(folder), verbose=False)


def available() -> bool:
    """True on an x86 CPU with AVX2 and FMA (the kernel's instructions)."""
    flags = _cpu_flags().split()
    return "avx2" in flags and "fma" in flags
