"""GPU-class worker profiles built from published figures — NOT measured here.

Every number below is a cited figure or is derived from cited figures by the arithmetic shown;
each profile's ``sources`` field says which. ``python -m sim.cited docs/profiles`` writes them.

* ``a100-llama2-7b``: one NVIDIA A100 80GB SXM4 serving Llama-2-7B in 16-bit, TP 1.
* ``a100x4-llama2-70b-tp4``: four A100 80GB serving Llama-2-70B in 16-bit with tensor
  parallelism 4 — one worker is the four GPUs.
* ``a100x4-llama2-70b-32k-tp4``: the long-context profile — the same four GPUs serving a
  Llama-2-70B whose window is stretched to 32,768 tokens (LongLoRA's ``Llama-2-70b-longlora-32k``
  [LONGLORA] keeps Llama-2-70B's architecture, so its per-step weight costs are [LMD]'s 70B
  rows); prompts of 8-32k tokens, tabulated to 32,768.

Sources:
  [LMD]   LMDeploy "Benchmark on A100 (FP16)" (InternLM/lmdeploy, docs/en/benchmark/a100_fp16.md,
          lmdeploy v0.1.0a1, A100-80G, CUDA 11.8), static inference tables:
          llama2-7b, TP1, prompt 1 / output 128, per-token latency p50: 0.009 / 0.010 / 0.011 /
          0.012 s at batch 1 / 16 / 32 / 64; first-token latency at batch 1: 0.011 / 0.022 /
          0.139 s for prompts of 1 / 128 / 2048 tokens.
          llama2-70b, TP4, prompt 1 / output 128, per-token latency p50: 0.029 / 0.030 / 0.032 /
          0.037 s at batch 1 / 16 / 32 / 64; first-token latency at batch 1: 0.031 / 0.074 /
          0.402 s for prompts of 1 / 128 / 2048 tokens.
          Per-token latency p50 at prompt 2048 / output 2048 (contexts of 2,048-4,096 tokens, mean
          3,072): llama2-7b 0.025 / 0.04 s at batch 16 / 32; llama2-70b 0.036 / 0.043 s at batch
          16 / 32 (the batch-1 rows move by one 1-2 ms rounding step, too little to read a slope from).
  [LONGLORA] Chen et al., "LongLoRA: Efficient Fine-tuning of Long-Context Large Language
          Models", ICLR 2024: Llama-2 7B-70B extended to 32k (70B) contexts with position
          interpolation, architecture unchanged.
  [A100]  NVIDIA A100 Tensor Core GPU datasheet: 312 TFLOP/s dense BF16/FP16, 2,039 GB/s HBM2e (80GB SXM).
  [LLAMA] Touvron et al., "Llama 2", 2023: 7B = 6.74e9 parameters, 32 layers, hidden 4096, 32 heads
          (no GQA); 70B = 68.98e9 parameters, 80 layers, hidden 8192, 64 query heads and 8 KV heads
          (GQA), head dim 128.
  [DGX]   NVIDIA DGX A100 datasheet: 8× 200 Gb/s HDR InfiniBand (one per GPU) for the KV hand-off.
  [FACTS] this project's ../shared/design/FACTS.md: JetStream publish awaiting its ack ≈ 0.85 ms.

Derived, not cited (each marked [DERIVED] in ``sources``): decode steps above batch 64 continue
the cited 32→64 slope, floored by the compute the batch needs at the prefill's implied
utilization; prefill above 2,048 tokens continues the cited 128→2,048 slope plus the
self-attention the longer prompt adds (``prefill_attn_s · (n² − 2048²) / 2``). The decode step's
cost per context token (``decode_ctx_s``) is fitted to [LMD]'s prompt-2048 rows: (p50 at prompt
2048 − p50 at prompt 1, same batch) / (batch × the 3,008 more context tokens a sequence holds on
average), the mean over batch 16 and 32.

Not found: no published first-token latency of these models on A100s for prompts above 2,048
tokens, and no per-token latency at 8-32k contexts; the long-context profile's costs there are
the [DERIVED] extrapolations above, not measurements. No published MoE latency table by batch
and prompt length was found (throughput-only tables, e.g. LMDeploy's DeepSeek-V3 page, do not
give step costs), so there is no MoE profile.

An earlier version of the 7B profile took decode from NVIDIA NeMo's end-to-end latencies
(dividing by 20 output tokens where 19 are decode steps), drew batches above 8 on an uncited
straight line, and assumed a prefill utilization of 0.5 (25-35 % below [LMD]'s first-token
latencies); its prefill of under ~127 tokens cost less than one decode step, so a mixed step
with a short chunk came out cheaper than the decode step alone.

Sensitivity: ``mfu`` rescales the compute-bound part of prefill to that model-FLOPs
utilization (default: the one [LMD]'s first-token latencies imply); ``mbu`` rescales the
memory-bound part of decode likewise (default: the one [LMD]'s batch-1 latency implies).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.profile import Profile

PEAK_FLOPS = 312e12  # [A100]
HBM_BYTES_S = 2.039e12  # [A100]
IB_BYTES_S = 200e9 / 8  # [DGX], one HDR link per GPU
HOP_S = 0.00085  # [FACTS]
GPU_MEMORY_BYTES = 80e9  # [A100]


@dataclass(frozen=True)
class Cited:
    """One model on A100s as [LMD] measured it (latencies in seconds)."""

    name: str
    model: str
    params: float  # [LLAMA]
    layers: int  # [LLAMA]
    kv_heads: int  # [LLAMA]
    head_dim: int  # [LLAMA]
    hidden: int  # [LLAMA]
    tp: int  # GPUs per worker
    decode_p50: dict  # batch → per-token latency p50 [LMD]
    first_token: dict  # prompt tokens → first-token latency at batch 1 [LMD]
    decode_p50_ctx: dict  # batch → per-token latency p50 at prompt 2048 / output 2048 [LMD]
    max_prompt: int = 8192  # prefill tabulated up to here
    suffix: str = ""  # the model name's long-context note


LLAMA2_7B = Cited("a100-llama2-7b", "Llama-2-7B", 6.74e9, 32, 32, 128, 4096, 1,
                  {1: 0.009, 16: 0.010, 32: 0.011, 64: 0.012}, {1: 0.011, 128: 0.022, 2048: 0.139},
                  {16: 0.025, 32: 0.04})
LLAMA2_70B = Cited("a100x4-llama2-70b-tp4", "Llama-2-70B", 68.98e9, 80, 8, 128, 8192, 4,
                   {1: 0.029, 16: 0.030, 32: 0.032, 64: 0.037}, {1: 0.031, 128: 0.074, 2048: 0.402},
                   {16: 0.036, 32: 0.043})
LLAMA2_70B_32K = Cited("a100x4-llama2-70b-32k-tp4", "Llama-2-70B", 68.98e9, 80, 8, 128, 8192, 4,
                       LLAMA2_70B.decode_p50, LLAMA2_70B.first_token, LLAMA2_70B.decode_p50_ctx, 32768,
                       " with a 32k window (LongLoRA Llama-2-70b-longlora-32k: the same architecture)")
#: Context tokens a sequence of [LMD]'s prompt-2048 / output-2048 rows holds on average beyond
#: one of its prompt-1 / output-128 rows: (2048 + 2048/2) − (1 + 128/2).
CTX_EXTRA_TOKENS = 3072 - 64


def build(c: Cited, mfu: float | None = None, mbu: float | None = None) -> Profile:
    """The profile of ``c`` (see module doc); ``mfu`` / ``mbu`` override the implied
    utilizations for sensitivity rows."""
    flops_per_token = 2 * c.params  # forward pass ≈ 2 FLOPs per parameter per token
    peak, hbm = PEAK_FLOPS * c.tp, HBM_BYTES_S * c.tp
    weights_s = 2 * c.params / hbm  # one read of the 16-bit weights across the worker's GPUs
    pts = sorted(c.first_token.items())
    (n1, t1), (n2, t2) = pts[-2], pts[-1]
    slope = (t2 - t1) / (n2 - n1)  # seconds per prompt token, compute-bound [LMD]
    implied_mfu = flops_per_token / (slope * peak)
    prefill_scale = implied_mfu / mfu if mfu else 1.0
    floor = pts[0][1]  # a one-token forward: a step's fixed cost, weights read once

    attn_s = 4 * c.layers * c.hidden / (peak * (mfu or implied_mfu))

    def prefill(n: int) -> float:
        if n <= n2:
            base = float(np.interp(n, [p for p, _ in pts], [t for _, t in pts]))
        else:  # [DERIVED] the cited slope, and the self-attention the table's prompts did not have
            base = t2 + slope * (n - n2) + attn_s * (n * n - n2 * n2) / 2 * (mfu or implied_mfu) / implied_mfu
        return floor + (base - floor) * prefill_scale

    implied_mbu = weights_s / c.decode_p50[1]
    decode_scale = implied_mbu / mbu if mbu else 1.0
    dec = sorted(c.decode_p50.items())
    (b1, d1), (b2, d2) = dec[-2], dec[-1]
    tail = (d2 - d1) / (b2 - b1)
    compute_per_seq = flops_per_token / (peak * implied_mfu)
    batches = [b for b, _ in dec] + [128, 256]
    decode_s = [c.decode_p50[b] if b in c.decode_p50 else max(d2 + tail * (b - b2), b * compute_per_seq)
                for b in batches]
    decode_s = [d * decode_scale for d in decode_s]
    kv_bytes_per_token = 2 * c.layers * c.kv_heads * c.head_dim * 2  # K and V, 16-bit
    kv_pool_bytes = 0.9 * GPU_MEMORY_BYTES * c.tp - 2 * c.params
    tokens = [t for t in (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768) if t <= c.max_prompt]
    # [LMD] prompt-2048 rows: decode seconds per context token, and the MBU its KV reads imply
    ctx_fit = float(np.mean([(c.decode_p50_ctx[b] - c.decode_p50[b]) / (b * CTX_EXTRA_TOKENS)
                             for b in sorted(c.decode_p50_ctx)]))
    fixed = decode_s[0] - (decode_s[1] - decode_s[0]) / (batches[1] - batches[0])
    link = IB_BYTES_S * c.tp
    return Profile(
        name=c.name if mfu is None and mbu is None else f"{c.name}-mfu{mfu or implied_mfu:.2f}-mbu{mbu or implied_mbu:.2f}",
        measured=False,
        machine=f"{c.tp}× NVIDIA A100 80GB SXM4 (cited, not measured)" if c.tp > 1 else
        "NVIDIA A100 80GB SXM4 (cited, not measured)",
        model=c.model + c.suffix + (f", tensor parallel {c.tp}" if c.tp > 1 else ""), dtype="float16",
        prefill_tokens=tokens, prefill_s=[prefill(n) for n in tokens],
        decode_batch=batches, decode_s=decode_s,
        # QKᵀ and AV: 4·layers·hidden FLOPs per (token, context token) at the prefill's utilization
        prefill_attn_s=attn_s,
        decode_ctx_s=ctx_fit * decode_scale,  # [LMD]'s prompt-2048 rows
        step_fixed_s=min(fixed, floor),
        kv_bytes_per_token=kv_bytes_per_token,
        kv_stage_fixed_s=HOP_S, kv_stage_s_per_byte=1 / link,
        kv_load_fixed_s=HOP_S, kv_load_s_per_byte=0.0,  # the transfer is counted once, on the staging side
        kv_store="network",
        kv_stores={"network": {"put_fixed_s": HOP_S, "put_s_per_byte": 1 / link, "get_fixed_s": 0.0,
                               "get_s_per_byte": 0.0,
                               "source": f"[DGX] {c.tp}× 200 Gb/s HDR InfiniBand per worker, the sender's link "
                                         "carries the transfer (RDMA into the receiver's memory); "
                                         "fixed cost one [FACTS] bus hop"}},
        kv_import_fixed_s=0.0, kv_import_s_per_byte=0.0,
        bus_hop_s=HOP_S, tokenize_s=0.0, token_cpu_s=0.0, request_cpu_s=0.0,
        corun_slowdown=1.0, host_cores=0,
        num_kv_blocks=int(kv_pool_bytes / kv_bytes_per_token / 16), block_size=16,
        sources={
            "decode_s (batch 1-64)": "[LMD] per-token latency p50, prompt 1, output 128",
            "decode_s (batch 128, 256)": "[DERIVED] the [LMD] 32→64 slope continued, floored by batch × "
                                         "2·params FLOPs at the implied prefill utilization",
            "prefill_s": "[LMD] first-token latency at batch 1, piecewise linear; [DERIVED] above 2,048 tokens "
                         "the 128→2,048 slope continued plus prefill_attn_s·(n²−2048²)/2",
            "step_fixed_s": "decode(1) − the [LMD] batch 1→16 slope, at most the one-token first-token latency",
            "decode_ctx_s": "[LMD] prompt-2048 rows: (p50 at prompt 2048 − p50 at prompt 1) / (batch × "
                            f"{CTX_EXTRA_TOKENS} context tokens), mean over batch "
                            f"{' and '.join(str(b) for b in sorted(c.decode_p50_ctx))}; the KV reads' "
                            f"implied MBU {kv_bytes_per_token / (hbm * ctx_fit):.2f}",
            "kv import": "none on the engine thread: the network transfer writes the decode worker's pool "
                         "(an assumption of an RDMA transport, not a cited figure)",
            "redis, shm": "no cited figures for a GPU worker's KV through Redis or host shared memory: "
                          "only the network store is priced",
            "prefill_attn_s": "4·layers·hidden FLOPs per (token, context token) / (peak [A100] × implied MFU)",
            "kv hand-off": f"KV bytes / {link / 1e9:.0f} GB/s ({c.tp}× 200 Gb/s HDR InfiniBand [DGX]) + one bus hop",
            "bus_hop_s": "[FACTS] JetStream publish with ack on loopback, 0.85 ms",
            "num_kv_blocks": "(0.9 × GPU memory − 16-bit weights) / KV bytes per token / 16",
            "mfu_implied": round(implied_mfu, 3), "mbu_implied": round(implied_mbu, 3),
            "mfu": mfu or round(implied_mfu, 3), "mbu": mbu or round(implied_mbu, 3),
            "citations": __doc__.split("Sources:")[1].split("Derived, not cited")[0].strip(),
        },
    )


def a100_llama2_7b(mfu: float | None = None, mbu: float | None = None) -> Profile:
    """Llama-2-7B on one A100 (see module doc)."""
    return build(LLAMA2_7B, mfu, mbu)


def a100x4_llama2_70b_tp4(mfu: float | None = None, mbu: float | None = None) -> Profile:
    """Llama-2-70B on four A100s with tensor parallelism 4, one worker (see module doc)."""
    return build(LLAMA2_70B, mfu, mbu)


def a100x4_llama2_70b_32k_tp4(mfu: float | None = None, mbu: float | None = None) -> Profile:
    """The long-context profile: Llama-2-70B with a 32k window on four A100s, TP 4 (see module doc)."""
    return build(LLAMA2_70B_32K, mfu, mbu)


def with_network_store(measured: Profile, links: int = 1) -> Profile:
    """A what-if copy of a measured profile whose KV hand-off is the cited profiles' network
    store (``links`` × 200 Gb/s HDR InfiniBand, RDMA into the decode worker's pool: one bus hop
    plus bytes / link rate on the sender, no import on the decode engine thread) in place of
    the store it was measured with; named ``<name>-ib``. Everything else is the measurement.
    What it answers: would the split pay on that hardware if pdserve moved KV at network speed?"""
    from dataclasses import asdict

    link = IB_BYTES_S * links
    d = asdict(measured)
    d.update(name=f"{measured.name}-ib", kv_store="network",
             kv_stage_fixed_s=HOP_S, kv_stage_s_per_byte=1 / link, kv_load_fixed_s=HOP_S, kv_load_s_per_byte=0.0,
             kv_stores={"network": {"put_fixed_s": HOP_S, "put_s_per_byte": 1 / link, "get_fixed_s": 0.0,
                                    "get_s_per_byte": 0.0,
                                    "source": f"[DGX] {links}× 200 Gb/s HDR InfiniBand per worker (a what-if: "
                                              "not measured with pdserve); fixed cost one [FACTS] bus hop"}},
             kv_import_fixed_s=0.0, kv_import_s_per_byte=0.0)
    d["sources"] = {**measured.sources, "kv hand-off": f"what-if: KV bytes / {link / 1e9:.0f} GB/s (sim.cited."
                    f"with_network_store), not the measured {measured.kv_store} store"}
    return Profile(**d)


#: name → builder of every cited profile (``docs/profiles/<name>.json``).
BUILDERS = {"a100-llama2-7b": a100_llama2_7b, "a100x4-llama2-70b-tp4": a100x4_llama2_70b_tp4,
            "a100x4-llama2-70b-32k-tp4": a100x4_llama2_70b_32k_tp4}
#: The sensitivity rows written beside them: (name, mfu, mbu).
SENSITIVITY = [("a100x4-llama2-70b-32k-tp4", 0.35, None), ("a100x4-llama2-70b-32k-tp4", None, 0.4)]
#: Measured profiles (``docs/profiles/<name>.json``) that get a :func:`with_network_store` variant.
NETWORK_VARIANTS = ["h200-llama2-7b"]


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/profiles")
    for name, builder in BUILDERS.items():
        print(builder().save(folder / f"{name}.json"))
    for name, mfu, mbu in SENSITIVITY:
        profile = BUILDERS[name](mfu=mfu, mbu=mbu)
        print(profile.save(folder / f"{profile.name}.json"))
    for name in NETWORK_VARIANTS:
        profile = with_network_store(Profile.load(folder / f"{name}.json"))
        print(profile.save(folder / f"{profile.name}.json"))
