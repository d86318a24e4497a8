"""Attention kernels over the paged KV cache.

``kernels.attention`` is the pure-PyTorch reference (runs anywhere, defines the semantics);
``kernels.cpu`` is a C++ decode kernel for CPUs and ``kernels.triton`` Triton kernels for
CUDA GPUs, with the same signatures. :func:`select` picks one per device and setting.
"""

from __future__ import annotations

from types import ModuleType

from shared.logging import get_logger

log = get_logger(__name__)


def select(device_type: str, backend: str = "auto") -> ModuleType:
    """The attention implementation for a device type ("cpu" or "cuda").

    ``backend``: "reference", "cpu" (the C++ kernel; raises if it cannot be built), "triton"
    (CUDA only; raises without CUDA or triton) or "auto" (on CPU the C++ kernel when it
    builds, on CUDA the Triton kernels when triton is installed, else the reference).

    Raises:
        RuntimeError: the backend asked for cannot run on this device.
    """
    from kernels import attention

    if backend == "triton" or (backend == "auto" and device_type == "cuda"):
        return _triton_or(attention, device_type, required=backend == "triton")
    if backend == "reference" or device_type != "cpu":
        return attention
    from kernels import cpu

    try:
        cpu.load()
        return cpu
    except Exception as exc:
        if backend == "cpu":
            raise
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
