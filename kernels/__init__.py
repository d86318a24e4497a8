"""Attention kernels over the paged KV cache.

``kernels.attention`` is the pure-PyTorch reference (runs anywhere, defines the semantics);
``kernels.cpu`` is a C++ decode kernel for CPUs with the same signatures. :func:`select`
picks one per device and setting.
"""

from __future__ import annotations

from types import ModuleType

from shared.logging import get_logger

log = get_logger(__name__)


def select(device_type: str, backend: str = "auto") -> ModuleType:
    """The attention implementation for a device type ("cpu" or "cuda").

    ``backend``: "reference", "cpu" (the C++ kernel; raises if it cannot be built) or "auto"
    (the C++ kernel on CPU when it builds, else the reference).
    """
    from kernels import attention

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
