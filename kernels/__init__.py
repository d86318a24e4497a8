"""Attention kernels over the paged KV cache.

``kernels.attention`` is the pure-PyTorch reference (runs anywhere, defines the semantics);
``kernels.cpu`` is a C++ decode kernel for CPUs and ``kernels.triton`` Triton kernels for
CUDA GPUs, with the same signatures. :func:`select` picks one per device and setting.
"""

from __future__ import annotations

from types import ModuleType

from shared.logging import get_logger

log = get_logger(__name__)


#: KV cache dtypes the C++ CPU kernel reads (float16 is not among them: it goes to the reference)
CPU_KERNEL_KV_DTYPES = ("float32", "bfloat16")


def select(device_type: str, backend: str = "auto", kv_dtype: str | None = None) -> ModuleType:
    """The attention implementation for a device type ("cpu" or "cuda").

    ``backend``: "reference", "cpu" (the C++ kernel), "triton" (CUDA only) or "auto" (on CPU
    the C++ kernel when it builds and reads ``kv_dtype``, on CUDA the Triton kernels when triton
    is installed, else the reference). ``kv_dtype``: the KV cache's dtype name ("float32",
    "bfloat16", "float16"; None: not known, assumed readable).

    Raises:
        ValueError: ``backend="cpu"`` with a KV dtype the kernel does not read.
        RuntimeError: the backend asked for cannot run on this device (``cpu`` that does not
            build, ``triton`` without CUDA or triton).
    """
    from kernels import attention

    if backend == "triton" or (backend == "auto" and device_type == "cuda"):
        return _triton_or(attention, device_type, required=backend == "triton")
    if backend == "reference" or device_type != "cpu":
        return attention
    if kv_dtype is not None and kv_dtype not in CPU_KERNEL_KV_DTYPES:
        if backend == "cpu":
            raise ValueError(f"PD_ATTENTION_BACKEND=cpu reads a {' or '.join(CPU_KERNEL_KV_DTYPES)} KV cache, "
                             f"not {kv_dtype}; use PD_ATTENTION_BACKEND=auto or reference")
        log.info("cpu_kernel_skipped_for_kv_dtype", kv_dtype=kv_dtype)
        return attention
    from kernels import cpu

    try:
        cpu.load()
        return cpu
    except Exception as exc:
        if backend == "cpu":
            raise RuntimeError(f"PD_ATTENTION_BACKEND=cpu but the C++ kernel does not build ({str(exc)[:500]}); "
                               "use PD_ATTENTION_BACKEND=auto or reference") from exc
        log.warning("cpu_kernel_unavailable_using_reference", error=str(exc)[:500])
        return attention


def _triton_or(fallback: ModuleType, device_type: str, required: bool) -> ModuleType:
    import importlib.util

    if device_type == "cuda" and importlib.util.find_spec("triton") is not None:
        from kernels import triton as triton_kernels

        return triton_kernels
    if required:
        raise RuntimeError("PD_ATTENTION_BACKEND=triton needs a CUDA device and the triton package")
    log.warning("triton_unavailable_using_reference")
    return fallback
