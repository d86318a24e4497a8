"""Checks of :class:`shared.config.Settings` values, run at start so that a setting that
cannot work is refused with a message naming it (never a ready system whose every request fails).

The ground floor of the settings: it imports nothing of pdserve's (``shared.config`` imports it).

New settings with a fixed set of values add a row to :data:`CHOICES`; other checks go in
:func:`validate_settings`.
"""

from __future__ import annotations

import typing


class SettingsError(ValueError):
    """A ``PD_*`` environment variable holds a value of the wrong type or out of range."""


CHOICES: dict[str, tuple[str, ...]] = {
    "kv_failure_policy": ("recompute", "fail"),
    "kv_prefetch": ("auto", "all", "off"),
    "kv_store": ("shm", "redis"),
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "weights": ("auto", "float", "int8"),
    "block_dot": ("auto", "float32", "int8", "bf16", "amx"),
    "speculative_method": ("off", "ngram"),
    "routing": ("disaggregated", "aggregated", "conditional"),
    "kv_cache_dtype": ("auto", "float32", "bfloat16", "float16"),
    "attention_backend": ("auto", "reference", "cpu", "triton"),
    "device": ("auto", "cpu", "cuda"),
    "rate_limit_store": ("redis", "local"),
    "rate_limit_failure_policy": ("open", "closed"),
}
"""The accepted values of each setting with a fixed set, by field name."""


def parse_cpus(spec: str) -> set[int]:
    """``"0"``, ``"0,2"``, ``"0-3"`` → a set of CPU ids.

    Raises:
        ValueError: not a CPU list.
    """
    cpus: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    if not cpus:
        raise ValueError(f"empty CPU list {spec!r}")
    return cpus


def parse_batch_sizes(spec: str) -> list[int]:
    """``"1,2,4"`` → ``[1, 2, 4]`` (sorted, unique); ``[]`` when any entry is not a positive integer."""
    try:
        sizes = sorted({int(part) for part in spec.split(",") if part.strip()})
    except ValueError:
        return []
    return sizes if sizes and sizes[0] > 0 else []


def validate_settings(settings: typing.Any) -> None:
    """Raise SettingsError on values that cannot work.

    Args:
        settings: a :class:`shared.config.Settings` (typed loosely: this module sits below it).

    Raises:
        SettingsError: the first setting found wrong, named as its ``PD_*`` variable.
    """
    for name, accepted in CHOICES.items():
        value = getattr(settings, name)
        if value not in accepted:
            listed = ", ".join(accepted[:-1]) + " or " + accepted[-1]
            raise SettingsError(f"PD_{name.upper()} must be {listed}, not {value!r}")
    if settings.cpu_affinity:
        try:
            parse_cpus(settings.cpu_affinity)
        except ValueError:
            raise SettingsError(f"PD_CPU_AFFINITY must be a CPU list like 0 or 0-3, not {settings.cpu_affinity!r}") from None
    if not parse_batch_sizes(settings.cuda_graph_batch_sizes):
        raise SettingsError(
            f"PD_CUDA_GRAPH_BATCH_SIZES must be positive integers like 1,2,4,8, not {settings.cuda_graph_batch_sizes!r}")
    if settings.kv_pinned_buffer_bytes <= 0:
        raise SettingsError(f"PD_KV_PINNED_BUFFER_BYTES must be > 0, not {settings.kv_pinned_buffer_bytes}")
    kv_dtype = settings.dtype if settings.kv_cache_dtype == "auto" else settings.kv_cache_dtype
    if settings.attention_backend == "cpu" and kv_dtype == "float16":
        # the C++ kernel reads float32 and bfloat16 caches only (kernels.CPU_KERNEL_KV_DTYPES)
        raise SettingsError("PD_ATTENTION_BACKEND=cpu reads a float32 or bfloat16 KV cache, not float16 "
                            f"(PD_DTYPE={settings.dtype}, PD_KV_CACHE_DTYPE={settings.kv_cache_dtype}); use "
                            "PD_ATTENTION_BACKEND=auto or reference, or PD_KV_CACHE_DTYPE=float32 or bfloat16")
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes", "nats_replicas"):
        if getattr(settings, name) <= 0:
            raise SettingsError(f"PD_{name.upper()} must be positive")
    if settings.speculative_num_tokens < 1 or not 1 <= settings.speculative_ngram_min <= settings.speculative_ngram_max:
        raise SettingsError("PD_SPECULATIVE_NUM_TOKENS must be >= 1 and 1 <= PD_SPECULATIVE_NGRAM_MIN <= "
                            "PD_SPECULATIVE_NGRAM_MAX")
    if settings.speculative_max_batch < 0 or not settings.speculative_row_cost > 0:
        raise SettingsError("PD_SPECULATIVE_MAX_BATCH must be >= 0 and PD_SPECULATIVE_ROW_COST > 0")
    for name in ("rate_limit_window_s", "rate_limit_lease_s", "keys_reload_interval_s"):
        if getattr(settings, name) <= 0:
            raise SettingsError(f"PD_{name.upper()} must be positive")
    if settings.max_queue_time_s < 0:
        raise SettingsError(f"PD_MAX_QUEUE_TIME_S must be >= 0 (0 = only the deadline), not {settings.max_queue_time_s}")
    if not settings.namespace.replace("_", "").replace("-", "").isalnum():
        raise SettingsError("PD_NAMESPACE may hold letters, digits, '-' and '_' only")
