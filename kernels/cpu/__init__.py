"""Accelerated attention for CPUs: a C++ paged decode kernel (``paged_attention.cpp``), built
on first use with the machine's compiler (``torch.utils.cpp_extension``, cached in
``~/.cache/torch_extensions``), with the reference implementation's signatures.

It reads K and V in place from the paged cache instead of gathering a contiguous copy per
sequence, which at batch 64 and 512 tokens of context cuts the memory traffic of attention
about threefold, and it reads bfloat16 caches directly. Prefill over a cached prefix splits
the keys into the prefix (no mask) and the new chunk (causal) and merges the two partial
results by their log-sum-exp, instead of one masked product over the whole context.

:func:`accelerate_model` also routes the model's linear layers, when a step has at most
``SMALL_BATCH_ROWS`` token rows (decode at small batch), to a weight-streaming kernel that
reads the weights at close to the machine's bandwidth (measured here: 20 GB/s against
11 GB/s for torch's matmul at one row), and its RMSNorm modules to a one-pass kernel.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from kernels import attention as reference
from kernels.attention import dense_causal_attention, gather_kv, write_kv

__all__ = ["load", "paged_decode_attention", "paged_prefill_attention", "write_kv", "gather_kv",
           "dense_causal_attention", "accelerate_linears", "accelerate_norms", "accelerate_model"]

#: Token rows up to which linear layers use the weight-streaming kernel (above it, torch's
#: matmul catches up: measured here 2.3× faster at 1 row, 4× at 4, 2.7× at 8, 2.1× at 16).
SMALL_BATCH_ROWS = 16
#: The same for bfloat16 weights: on a CPU with AMX, torch's bf16 matmul is faster from two rows
#: (measured at 1 row: 89 vs 124 µs for 1536×576, 2.5 vs 3.5 ms for the 49152×576 LM head;
#: at 2 rows: 157 vs 107 µs).
SMALL_BATCH_ROWS_BF16 = 1


@functools.cache
def load(emulate_bf16: bool = False):
    """The compiled extension module (``has_bf16``: its attention kernels accept ``bf16=True``,
    q.k and p.v as bf16 dot products over a bfloat16 cache; built where the CPU has AVX512-BF16).

    The build lives in its own folder per (source, flags, interpreter, torch version, CPU
    flags) under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), so two
    checkouts or virtual environments never rebuild over each other. Builders serialise on an
    ``flock`` (released by the kernel when a builder dies), and a ``lock`` file that torch's
    own build step left behind in a killed process is removed under it, so a killed build
    never makes later starts wait forever.

    Args:
        emulate_bf16: the test build: the bf16 path's instructions modelled in scalar code
            (``kernels/cpu/quant_block.h``), so it runs, more slowly, on any AVX2 CPU.

    Raises:
        RuntimeError: no C++ compiler, or the build failed.
    """
    # -fopenmp: at::parallel_for is OpenMP inside torch; without the flag it runs serially
    flags = ["-O3", "-fopenmp", "-ffp-contract=fast"] + (["-DPDQ_BF16_EMULATE"] if emulate_bf16 else [])
    return build_extension("paged_attention.cpp", "pdserve_cpu_paged_attention", flags)


def build_extension(source_name: str, name: str, flags: list[str]):
    """Build (or load the cached build of) the C++ source ``source_name`` beside this file as
    the torch extension ``<name>_<key>``, with ``flags`` (+ ``-march=native`` unless
    ``PD_KERNEL_MARCH_NATIVE=0``); the key hashes the source (its path and text), the ``*.h`` headers beside it,
    flags, interpreter, torch version and CPU flags, so each combination has its own folder. Builders serialise on an ``flock``.

    Raises:
        RuntimeError: no C++ compiler, or the build failed.
    """
    import fcntl
    import hashlib
    import sys

    from torch.utils.cpp_extension import _get_build_directory
    from torch.utils.cpp_extension import load as build

    source = Path(__file__).with_name(source_name)
    flags = [*flags, "-march=native"] if os.environ.get("PD_KERNEL_MARCH_NATIVE", "1") == "1" else list(flags)
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # included by the sources
    # the source's path too: torch's ninja file records it, so two checkouts sharing a folder
    # would rebuild it over each other at every start
    key = hashlib.sha256("\0".join([str(source.resolve()), source.read_text(), *headers, *flags, sys.executable,
                                     torch.__version__, _cpu_flags()]).encode()).hexdigest()[:12]
    name = f"{name}_{key}"
    folder = Path(_get_build_directory(name, verbose=False))
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "pdserve.build.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        # holding the flock means no other builder is alive: any torch lock is stale
        (folder / "lock").unlink(missing_ok=True)
        return build(name=name, sources=[str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                     build_directory=str(folder), verbose=False)


def _cpuinfo_line(key: str) -> str:
    """The first line of ``/proc/cpuinfo`` that starts with ``key`` (``""`` where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(key):
                return line
    except OSError:
        pass
    return ""


def _cpu_vendor() -> str:
    """The CPU's ``vendor_id`` (``GenuineIntel``, ``AuthenticAMD``; ``""`` where unknown)."""
    return _cpuinfo_line("vendor_id").partition(":")[2].strip()


def _cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` builds differ between machines)."""
    line = _cpuinfo_line("flags")
    if line:
        return line
    import platform

    return platform.processor()


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """See :func:`kernels.attention.paged_decode_attention` (same shapes and meaning)."""
    return load().paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, float(scale))


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """See :func:`kernels.attention.paged_prefill_attention` (same shapes and meaning).

    The ``n`` queries sit after a cached prefix of ``P = context_len - n`` tokens. Every query
    sees the whole prefix, so that part needs no mask, and grouped-query heads fold into the
    query rows (``[num_kv_heads, group * n, head_dim]`` against ``[num_kv_heads, P,
    head_dim]``, no copy of K or V per query head); the chunk's own keys are plain causal
    attention. The two partial results are merged by their log-sum-exp, the split-KV
    combination of FlashAttention / Flash-Decoding (Dao et al., 2022–2023). torch's CPU flash
    kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``) returns the log-sum-exp
    with the output; a torch build without it falls back to the reference.

    Measured here (2048-token context, 1792 cached, 9 heads over 3 KV heads, fp32): about
    twice as fast as the reference's masked product (``pdserve bench engine`` shows the
    effect on TTFT).
    """
    n = query.shape[0]
    prefix = context_len - n
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if prefix <= 0 or flash is None or query.device.type != "cpu":
        return reference.paged_prefill_attention(query, k_cache, v_cache, block_table, context_len, scale)
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    k, v = gather_kv(k_cache, v_cache, block_table, context_len)  # [L, KVH, D]
    k = k.to(query.dtype).transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
    v = v.to(query.dtype).transpose(0, 1).unsqueeze(0)
    # [H, n, D]; contiguous because the flash op assumes a unit stride in the last dimension
    q = query.transpose(0, 1).contiguous()
    # prefix: each KV head serves its `group` query heads as group * n rows
    q_fold = q.reshape(1, num_kv_heads, group * n, head_dim)
    out_p, lse_p = flash(q_fold, k[:, :, :prefix], v[:, :, :prefix], 0.0, False, scale=scale)[:2]
    # the chunk's own keys, causal (square, so top-left and bottom-right alignment agree)
    k_new = k[:, :, prefix:].repeat_interleave(group, dim=1)
    v_new = v[:, :, prefix:].repeat_interleave(group, dim=1)
    out_n, lse_n = flash(q.unsqueeze(0), k_new, v_new, 0.0, True, scale=scale)[:2]
    lse_p = lse_p.reshape(num_heads, n, 1)
    lse_n = lse_n.reshape(num_heads, n, 1)
    lse = torch.logaddexp(lse_p, lse_n)
    out = out_p.reshape(num_heads, n, head_dim).float() * torch.exp(lse_p - lse)
    out += out_n.reshape(num_heads, n, head_dim).float() * torch.exp(lse_n - lse)
    return out.to(query.dtype).transpose(0, 1)


def accelerate_linears(model: torch.nn.Module, max_rows: int = SMALL_BATCH_ROWS) -> int:
    """Route every float32 or bfloat16 ``nn.Linear`` of ``model`` to the small-batch kernel
    when its input has at most ``max_rows`` rows; larger inputs keep
    ``torch.nn.functional.linear``. bf16 weights are widened to float32 in registers as they
    stream (the activations are converted to float32 and the result back to their dtype).
    Returns the number of layers routed.

    The routed forward holds the layer's weight and bias, so it assumes they are not
    replaced afterwards (in-place updates are seen).

    Raises:
        RuntimeError: the extension cannot be built.
    """
    ext = load()
    empty = torch.empty(0)
    count = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or module.weight.dtype not in (torch.float32, torch.bfloat16):
            continue
        weight = module.weight
        limit = max_rows if weight.dtype == torch.float32 else min(max_rows, SMALL_BATCH_ROWS_BF16)
        bias = module.bias
        kernel_bias = bias if bias is not None else empty  # the kernel widens a bf16 bias per call

        # kept lean: at batch 1 this runs ~200 times a step, and every tensor op here costs
        # microseconds against ~100 µs of kernel
        def forward(x: torch.Tensor, weight=weight, bias=bias, kernel_bias=kernel_bias, limit=limit,
                    in_features=module.in_features, dtype=weight.dtype) -> torch.Tensor:
            rows = x.numel() // in_features
            if rows > limit or x.dtype != dtype or x.device.type != "cpu":
                return torch.nn.functional.linear(x, weight, bias)
            out = ext.linear_small_batch(x.reshape(rows, in_features).float(), weight, kernel_bias)
            if dtype != torch.float32:
                out = out.to(dtype)
            return out.view(*x.shape[:-1], out.shape[-1])

        module.forward = forward
        count += 1
    return count


def accelerate_norms(model: torch.nn.Module) -> int:
    """Replace the forward of each float32 RMSNorm module of ``model`` that computes
    ``weight * x / sqrt(mean(x²) + eps)`` (Llama's definition, shared by Mistral, Qwen2/3,
    Phi-3 and others) with the one-pass kernel. A module is routed only after its own forward
    and the kernel agree on a random input, so variants with another formula (Gemma's
    ``1 + weight``, say) keep theirs. Returns the number of modules routed.

    Raises:
        RuntimeError: the extension cannot be built.
    """
    ext = load()
    count = 0
    for module in model.modules():
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        weight = getattr(module, "weight", None)
        if (not type(module).__name__.endswith("RMSNorm") or not isinstance(eps, float)
                or not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32 or weight.dim() != 1):
            continue
        probe = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            if not torch.allclose(module(probe), ext.rms_norm(probe, weight, eps), rtol=1e-5, atol=1e-5):
                continue

        def forward(x: torch.Tensor, weight=weight, eps=eps, size=weight.shape[0],
                    original=module.forward) -> torch.Tensor:
            if x.dtype != torch.float32 or x.device.type != "cpu":
                return original(x)
            return ext.rms_norm(x.reshape(-1, size), weight, eps).view(x.shape)

        module.forward = forward
        count += 1
    return count


def accelerate_model(model: torch.nn.Module) -> dict[str, int]:
    """Apply :func:`accelerate_linears` and :func:`accelerate_norms`; returns their counts."""
    return {"linears": accelerate_linears(model), "norms": accelerate_norms(model)}
