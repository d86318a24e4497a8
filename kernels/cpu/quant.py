"""Linear layers over GGUF's 4- and 8-bit blocks as stored (``quant_linear.cpp``, AVX2 + FMA),
built on first use like the attention extension (cached per source, flags and CPU under
``$TORCH_EXTENSIONS_DIR``).

torch's own packed-weight ops (``_weight_int4pack_mm_for_cpu``, ``_weight_int8pack_mm``) have
vectorized paths for AVX-512 only; on an AVX2-only CPU they measured 15-50x slower than a
float32 GEMV, so this kernel exists for CPUs where that gap is measured (docs/decisions.md).
"""

from __future__ import annotations

import functools

from kernels.cpu import _cpu_flags, build_extension

__all__ = ["load", "load_fused", "available"]


_FLAGS = ["-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c"]
#: Test builds: the bf16 dot-product loops over a scalar model of the AVX512-BF16 instructions
#: (``PDQ_BF16_EMULATE`` in quant_block.h), so their tiling and row independence are tested on
#: any CPU. Slow; never used for serving.
_EMULATE_BF16 = ["-DPDQ_BF16_EMULATE"]


@functools.cache
def load(emulate_bf16: bool = False):
    """The compiled extension (``q4_linear``, ``q8_linear``, ``q4_dequantize``, ``q8_dequantize``;
    ``has_bf16``: the linears accept ``bf16=True``, bf16 dot products).

    Args:
        emulate_bf16: the test build (bf16 path emulated in scalar code, ``has_bf16`` True).

    Raises:
        RuntimeError: no C++ compiler, the build failed, or the CPU lacks AVX2/FMA.
    """
    if not available():
        raise RuntimeError("the quantized linear kernel needs a CPU with AVX2 and FMA")
    flags = _FLAGS + (_EMULATE_BF16 if emulate_bf16 else [])
    return build_extension("quant_linear.cpp", "pdserve_cpu_quant_linear", flags)


@functools.cache
def load_fused(emulate_bf16: bool = False):
    """The fused decode-layer extension (``fused_decode.cpp``: ``Blocks``, ``DecodeLayer``,
    ``rms_norm``; ``has_bf16``: ``Blocks(..., bf16=True)`` uses bf16 dot products), same build
    and flags as :func:`load`.

    Args:
        emulate_bf16: the test build (bf16 path emulated in scalar code, ``has_bf16`` True).

    Raises:
        RuntimeError: no C++ compiler, the build failed, or the CPU lacks AVX2/FMA.
    """
    if not available():
        raise RuntimeError("the fused decode kernel needs a CPU with AVX2 and FMA")
    flags = _FLAGS + (_EMULATE_BF16 if emulate_bf16 else [])
    return build_extension("fused_decode.cpp", "pdserve_cpu_fused_decode", flags)


def available() -> bool:
    """True on an x86 CPU with AVX2 and FMA (the kernel's instructions)."""
    flags = _cpu_flags().split()
    return "avx2" in flags and "fma" in flags
