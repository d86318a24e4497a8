"""Batch-invariant numerics (``PD_BATCH_INVARIANT``): a token's logits do not depend on what
else is in the engine step.

What changes with the batch, and what this module does about it (the approach of SGLang's
deterministic mode and of "Defeating Nondeterminism in LLM Inference", He & Thinking Machines
Lab, 2025: each row's reductions in a fixed order with fixed split sizes):

* **Linear layers.** A GEMM's blocking, and so each output's order of accumulation, is
  chosen from the matrix shape: torch's float32 CPU matmul takes a GEMV path at one row and
  a blocked GEMM from two (results differ in the last bits), and the C++ small-batch kernel
  (``kernels.cpu.accelerate_linears``) serves one row but not two. Here float32 linears run
  through the block kernel's per-row loops (:func:`float32_linear`: one accumulator chain per
  output, no padding, so a one-row step costs what a GEMV does); other float linears (bf16
  weights) as calls of exactly :data:`LINEAR_ROWS` rows (the last one zero-padded), so the
  library sees one shape whatever the step holds. Either way a row's result is independent of
  its position in the call and of its neighbours (checked in
  ``tests/unit/test_batch_invariance.py``).
* **Quantized linears** (``engine.model.quant.BlockLinear``): the block kernel computes each row
  with the same code whatever the number of rows, but above 64 rows the layer used to
  de-quantize and call a GEMM. Here it always runs the kernel, in chunks of at most
  :data:`QUANT_ROWS` rows (on AMX tiles all rows in one call).
* **Attention.** Prefill used a flash kernel over the chunk (no cached prefix) or split the
  keys into prefix + chunk and merged by log-sum-exp (with a cached prefix), while decode
  used the C++ paged kernel: the same token got three different reduction orders depending
  on prefix hits and chunking. Here every query token, prefill or decode, is one query of
  the paged decode kernel over its own context in the KV cache (positions ``0..p``): one
  order per token, whatever the chunking, the prefix cache or the batch. Where the linears round
  to bf16 (``PD_BLOCK_DOT`` resolved to ``bf16`` or ``amx``) and the cache is bfloat16, q.k and
  p.v are bf16 dot products too (the kernels' ``bf16=True``: the same per-query order in decode and prefill).
* **RMSNorm**: the one-pass C++ kernel, per row (float32 math as transformers does).
* **Softmax and sampling** were per row already (``engine.sampler``: per-request seeded
  draws, ``(seed, output index)``).

Element-wise operations (RoPE, SiLU, residual adds) do not reduce and need nothing.

Only the CPU is handled; on other devices :func:`apply` does nothing and says so.
"""

from __future__ import annotations

import torch

from engine.model.quant import KERNEL_MAX_ROWS, BlockLinear, _kernel
from shared.logging import get_logger

log = get_logger(__name__)

#: Rows of every float linear call in this mode (inputs are split and the last chunk padded).
#: 32 keeps a 512-token prefill at 16 calls of a size GEMM libraries run efficiently.
LINEAR_ROWS = 32
#: Most rows of one quantized-kernel call (the kernel's own limit).
QUANT_ROWS = KERNEL_MAX_ROWS


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     rows: int = LINEAR_ROWS) -> torch.Tensor:
    """``x W^T + b`` computed in calls of exactly ``rows`` rows.

    Args:
        x: ``[..., in_features]``; weight: ``[out_features, in_features]``; bias: ``[out]`` or None.

    Returns:
        ``[..., out_features]`` in ``x``'s dtype, each row bit-identical whatever the other rows.
    """
    k = weight.shape[1]
    flat = x.reshape(-1, k)
    m = flat.shape[0]
    pad = (-m) % rows
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, k)])
    out = torch.cat([torch.nn.functional.linear(chunk, weight, bias) for chunk in flat.split(rows)])
    return out[:m].view(*x.shape[:-1], weight.shape[0])


def float32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ext) -> torch.Tensor:
    """``x W^T + b`` for float32 ``x`` and ``weight`` through the block kernel's per-row loops
    (``ext.float_linear``, kernels/cpu/quant_linear.cpp) in calls of at most
    :data:`QUANT_ROWS` rows: each row bit-identical whatever the other rows, with no padding (a
    one-row decode step reads the weights once, as a GEMV; :func:`invariant_linear`'s padded
    calls cost 32x the FLOPs there). Shapes as :func:`invariant_linear`."""
    k = weight.shape[1]
    flat = x.reshape(-1, k)
    out = torch.cat([ext.float_linear(c, weight) for c in flat.split(QUANT_ROWS)])
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _route_linears(model: torch.nn.Module) -> int:
    ext = _kernel()
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            if (ext is not None and module.weight.dtype == torch.float32
                    and module.weight.device.type == "cpu" and module.in_features % 16 == 0):
                module.forward = lambda x, m=module: (float32_linear(x, m.weight, m.bias, ext)
                                                      if x.dtype == torch.float32 else invariant_linear(x, m.weight, m.bias))
            else:
                module.forward = lambda x, m=module: invariant_linear(x, m.weight, m.bias)
        elif isinstance(module, BlockLinear):
            module.forward = lambda x, m=module: _quant_forward(m, x)
        else:
            continue
        count += 1
    return count


def _quant_forward(layer, x: torch.Tensor) -> torch.Tensor:
    """A BlockLinear through its kernel in chunks of at most :data:`QUANT_ROWS` rows (the
    kernel's per-row code is the same for any row count); on AMX tiles (``layer.amx``) all rows
    in one call: above 64 rows the kernel widens the weights once for all of them (1.2-1.4x the
    same rows in 64-row calls at 512 rows, kernels/cpu/quant_block.h, block_rows_amx)."""
    ext = _kernel()
    flat = x.reshape(-1, layer.in_features).float()
    if ext is None:  # no kernel: de-quantized GEMM in fixed-size calls
        out = invariant_linear(flat, layer.dequantized(), layer.bias)
    elif layer.amx:
        out = layer.kernel_rows(flat, ext)
    else:
        out = torch.cat([layer.kernel_rows(c, ext) for c in flat.split(QUANT_ROWS)])
    return out.to(x.dtype).view(*x.shape[:-1], layer.out_features)


def _route_norms(model: torch.nn.Module, ext) -> int:
    """RMSNorm modules of Llama's formula (checked on a probe, like
    ``kernels.cpu.accelerate_norms``) to the per-row C++ kernel."""
    count = 0
    for module in model.modules():
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        weight = getattr(module, "weight", None)
        if (not type(module).__name__.endswith("RMSNorm") or not isinstance(eps, float)
                or not isinstance(weight, torch.Tensor) or weight.dim() != 1):
            continue
        ones = torch.ones(weight.shape[0], dtype=torch.float32)

        def forward(x: torch.Tensor, weight=weight, eps=eps, ones=ones) -> torch.Tensor:
            # transformers' Llama: normalize in float32, cast back, then scale by the weight
            y = ext.rms_norm(x.reshape(-1, ones.shape[0]).float(), ones, eps).to(x.dtype)
            return (weight * y).view(x.shape)

        probe = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        with torch.no_grad():
            if not torch.allclose(module(probe).float(), forward(probe).float(), rtol=2e-2, atol=2e-2):
                continue
        module.forward = forward
        count += 1
    return count


class InvariantAttention:
    """The attention backend of this mode: the wrapped backend's ``write_kv``, and every query
    (decode or prefill) as one query of the paged decode kernel over its own context.

    Args:
        base: the selected attention module (``kernels.cpu`` or the reference).
        bf16: q.k and p.v as bf16 dot products (``kernels/cpu/paged_attention.cpp``, ``bfa``),
            for a bfloat16 cache on a build with them (``has_bf16``); see :func:`attention_bf16`.
        amx: the same roundings with q.k and p.v on AMX tiles (``amxa``: its own bits, the same in
            decode and prefill), where the block kernels use them; see :func:`attention_amx`.
    """

    #: tells ``engine.model_runner.paged_attention_forward`` to send chunks without a cached
    #: prefix here too (not to its dense causal path)
    always_paged = True

    def __init__(self, base, bf16: bool = False, amx: bool = False):
        self.base = base
        self._per_token = base.__name__ != "kernels.cpu"  # the reference batches: call it per query
        self._ext = None if self._per_token else base.load()
        self.amx = bool(amx) and not self._per_token
        self.bf16 = bool(bf16) and not self._per_token and not self.amx
        self.__name__ = f"{base.__name__}+batch_invariant" + ("+amx" if self.amx else "+bf16" if self.bf16 else "")
        self.write_kv = base.write_kv
        self.gather_kv = getattr(base, "gather_kv", None)

    def paged_decode_attention(self, query, k_cache, v_cache, block_tables, context_lens, scale):
        """Same contract as :func:`kernels.attention.paged_decode_attention`."""
        if not self._per_token:
            return self._ext.paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, float(scale),
                                                    self.bf16, self.amx)
        return torch.cat([self.base.paged_decode_attention(query[i:i + 1], k_cache, v_cache, block_tables[i:i + 1],
                                                           context_lens[i:i + 1], scale)
                          for i in range(query.shape[0])])

    def paged_prefill_attention(self, query, k_cache, v_cache, block_table, context_len, scale):
        """Same contract as :func:`kernels.attention.paged_prefill_attention`: ``query [n, H, D]``
        are the last ``n`` positions of a context of ``context_len`` tokens already written to
        the cache; query ``i`` attends over positions ``0 .. context_len - n + i``.

        With the C++ kernels this is ``paged_prefill_attention_tiled`` (kernels/cpu/paged_attention.cpp):
        each query reduced exactly as one decode query over the same context, with K and V read
        once per tile of queries instead of once per query; otherwise one decode query per token."""
        if not self._per_token:  # the C++ kernels: the tiled kernel, same per-query arithmetic
            return self._ext.paged_prefill_attention_tiled(query, k_cache, v_cache, block_table, int(context_len),
                                                           float(scale), 0, self.bf16, self.amx)
        n = query.shape[0]
        tables = block_table.unsqueeze(0).expand(n, -1)
        lens = torch.arange(context_len - n + 1, context_len + 1, dtype=torch.long)
        return self.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale)


def attention_bf16(runner, ext) -> bool:
    """Whether this mode's attention runs q.k and p.v as bf16 dot products: where the runner's
    block kernels round to bf16 (``runner.block_dot`` ``bf16``, a bfloat16 model on an AVX512-BF16
    CPU without AMX, or ``amx``, the same roundings on AMX tiles;
    :func:`engine.model.quant.resolve_block_dot`), with a bfloat16 KV cache, head_dim 64 or 128 and
    an extension built with them (``ext.has_bf16``).

    Measured (``pdserve bench attention``; docs/decisions.md, "Attention as bf16 dot products where
    the linears use them" and "Block matmuls on AMX tiles"), one 512-token chunk at the end of a
    2,048-token context, SmolLM2's 9 heads over 3 KV heads, 1 / 2 threads, against the float32
    kernel: AMD EPYC Zen 4 (no AMX) 2.05x / 1.77x, one decode query 1.49x / 1.45x; the AMX Xeon
    1.55x / 1.36x, one decode query 1.25x / 1.12x."""
    cache = runner.kv_cache
    return (getattr(runner, "block_dot", "float32") in ("bf16", "amx") and cache.dtype == torch.bfloat16
            and bool(getattr(ext, "has_bf16", False)) and cache.head_dim in (64, 128))


def attention_amx(runner, ext) -> bool:
    """Whether this mode's attention runs its bf16 dot products on AMX tiles
    (``kernels/cpu/paged_attention.cpp``, ``amxa``): where :func:`attention_bf16` holds, the
    runner's block kernels run on the tiles (``runner.block_dot == "amx"``) and the extension was
    granted them (``ext.has_amx``). Decode and prefill then share these bits, which differ from the
    ``bf16`` kernels' (the products' order inside a tile step is the hardware's).

    Measured on the AMX Xeon (2 vCPU sharing one AMX unit; ``pdserve bench attention``; docs/decisions.md,
    "Attention on AMX tiles"): a 512-token chunk at the end of a 2,048-token context, SmolLM2's 9
    heads over 3 KV heads, 2.95x / 3.03x the ``bf16`` kernel on 1 / 2 threads (at the end of a
    512-token context 2.07x / 2.58x); one decode query 0.81-1.02x."""
    return (attention_bf16(runner, ext) and getattr(runner, "block_dot", "float32") == "amx"
            and bool(getattr(ext, "has_amx", False)))


def apply(runner) -> bool:
    """Switch a :class:`engine.model_runner.ModelRunner` (its model and attention) to this
    mode. Returns False (and changes nothing) off the CPU or without the C++ extension."""
    if runner.device.type != "cpu":
        log.warning("batch_invariant_cpu_only", device=str(runner.device))
        return False
    from kernels import cpu

    try:
        ext = cpu.load()
    except Exception as exc:
        log.warning("batch_invariant_unavailable", error=str(exc)[:300])
        return False
    linears = _route_linears(runner.model)
    norms = _route_norms(runner.model, ext)
    runner.attention = InvariantAttention(runner.attention, attention_bf16(runner, ext), attention_amx(runner, ext))
    log.info("batch_invariant_on", linears=linears, norms=norms, attention=runner.attention.__name__)
    return True
