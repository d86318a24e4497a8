"""Attention kernels over the paged KV cache.

``kernels.attention`` is the pure-PyTorch reference (runs anywhere, defines the semantics).
Accelerated implementations keep the same signatures; :func:`select` picks one per device.
"""

from __future__ import annotations

from types import ModuleType


def select(device_type: str) -> ModuleType:
    """The attention implementation for a device type ("cpu" or "cuda")."""
    from kernels import attention

    return attention
