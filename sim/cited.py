"""A GPU-class worker profile built from published figures — NOT measured here.

Worker: one NVIDIA A100 80GB SXM4 serving Llama-2-7B in 16-bit, tensor parallel 1. Every
number below is a cited figure or is derived from cited figures by the arithmetic shown.
``python -m sim.cited docs/profiles/a100-llama2-7b.json`` writes the profile.

Sources:
  [NEMO]  NVIDIA NeMo Framework user guide, "Llama-2 Results — Inference Performance",
          Configuration 1 (input 128, output 20 tokens, TensorRT-LLM), Llama-2-7B, TP1, A100 80GB SXM4:
          average latency 234.0 / 249.6 / 272.6 / 329.5 ms at batch 1 / 2 / 4 / 8.
          https://docs.nvidia.com/nemo-framework/user-guide/latest/performance/llama.html
  [A100]  NVIDIA A100 Tensor Core GPU datasheet: 312 TFLOP/s dense BF16/FP16, 2,039 GB/s HBM2e (80GB SXM).
  [LLAMA] Touvron et al., "Llama 2", 2023: 7B = 6.74e9 parameters, 32 layers, hidden 4096, 32 heads (no GQA).
  [DGX]   NVIDIA DGX A100 datasheet: 8× 200 Gb/s HDR InfiniBand (one per GPU) for the KV hand-off.
  [FACTS] this project's ../shared/design/FACTS.md: JetStream publish awaiting its ack ≈ 0.85 ms.
  [ASSUMED] prefill model-FLOPs utilization 0.5: an assumption (not a cited figure), in the range
          Sarathi-Serve (Agrawal et al., OSDI 2024) and DistServe (Zhong et al., OSDI 2024) describe
          for compute-bound prefill; the at-scale conclusions are checked at 0.35 and 0.65 in docs/scale.md.
"""

from __future__ import annotations

import sys

from sim.profile import Profile

PARAMS = 6.74e9  # [LLAMA]
LAYERS, HIDDEN = 32, 4096  # [LLAMA]
PEAK_FLOPS = 312e12  # [A100]
HBM_BYTES_S = 2.039e12  # [A100]
NEMO_IN, NEMO_OUT = 128, 20  # [NEMO]
NEMO_LATENCY_S = {1: 0.2340, 2: 0.2496, 4: 0.2726, 8: 0.3295}  # [NEMO]
LINK_BYTES_S = 200e9 / 8  # [DGX]
HOP_S = 0.00085  # [FACTS]


def a100_llama2_7b(mfu: float = 0.5) -> Profile:
    """The profile (see module doc); ``mfu`` is the assumed prefill utilization."""
    flops_per_token = 2 * PARAMS  # forward pass ≈ 2 FLOPs per parameter per token
    per_token_s = flops_per_token / (PEAK_FLOPS * mfu)
    weights_s = 2 * PARAMS / HBM_BYTES_S  # one read of the 16-bit weights

    def prefill(n: int) -> float:
        return max(weights_s, n * per_token_s)

    # [NEMO] latency = prefill(128·B) + 20 decode steps at batch B  →  decode step at batch B
    decode = {b: (lat - prefill(NEMO_IN * b)) / NEMO_OUT for b, lat in NEMO_LATENCY_S.items()}
    slope = (decode[8] - decode[1]) / 7  # marginal seconds per extra sequence (batch ≤ 8)
    batches = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    decode_s = [decode[b] if b in decode else max(decode[8] + slope * (b - 8), b * per_token_s) for b in batches]
    mbu = weights_s / decode[1]  # memory-bandwidth utilization implied by [NEMO] at batch 1
    kv_bytes_per_token = 2 * LAYERS * HIDDEN * 2  # K and V, 16-bit [LLAMA]
    kv_pool_bytes = 0.9 * 80e9 - 2 * PARAMS  # 90% of HBM minus the weights
    tokens = [1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    return Profile(
        name="a100-llama2-7b", measured=False, machine="NVIDIA A100 80GB SXM4 (cited, not measured)",
        model="Llama-2-7B", dtype="float16",
        prefill_tokens=tokens, prefill_s=[prefill(n) for n in tokens],
        decode_batch=batches, decode_s=decode_s,
        prefill_attn_s=4 * LAYERS * HIDDEN / (PEAK_FLOPS * mfu),  # QKᵀ and AV: 4·layers·hidden FLOPs per (token, context token)
        decode_ctx_s=kv_bytes_per_token / (HBM_BYTES_S * mbu),  # each context token's KV read once per step
        step_fixed_s=decode[1] - slope,
        kv_bytes_per_token=kv_bytes_per_token,
        kv_stage_fixed_s=HOP_S, kv_stage_s_per_byte=1 / LINK_BYTES_S,
        kv_load_fixed_s=HOP_S, kv_load_s_per_byte=0.0,  # the transfer is counted once, on the staging side
        bus_hop_s=HOP_S, tokenize_s=0.0, token_cpu_s=0.0, request_cpu_s=0.0,
        corun_slowdown=1.0, host_cores=0,
        num_kv_blocks=int(kv_pool_bytes / kv_bytes_per_token / 16), block_size=16,
        sources={
            "decode_s (batch 1-8)": "[NEMO] latency minus prefill(128·B), over 20 output tokens",
            "decode_s (batch > 8)": "linear in batch with the [NEMO] batch 1→8 slope, floored by compute (prefill rate)",
            "prefill_s": "max(weights read [A100][LLAMA], n·2·6.74e9 FLOPs / (312 TFLOP/s [A100] × MFU [ASSUMED]))",
            "decode_ctx_s": "KV bytes per token / (2,039 GB/s [A100] × MBU implied by [NEMO] batch 1)",
            "prefill_attn_s": "4·32·4096 FLOPs per (token, context token) / (312 TFLOP/s × MFU)",
            "kv hand-off": "KV bytes / 25 GB/s (200 Gb/s HDR InfiniBand per GPU [DGX]) + one bus hop",
            "bus_hop_s": "[FACTS] JetStream publish with ack on loopback, 0.85 ms",
            "num_kv_blocks": "(0.9·80 GB − 13.5 GB weights) / 512 KiB per token / 16",
            "mfu": mfu, "mbu_implied": round(mbu, 3),
            "citations": __doc__.split("Sources:")[1].split('"""')[0].strip(),
        },
    )


if __name__ == "__main__":
    path = a100_llama2_7b().save(sys.argv[1] if len(sys.argv) > 1 else "docs/profiles/a100-llama2-7b.json")
    print(path)
