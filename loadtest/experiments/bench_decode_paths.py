"""Decode step time of the three weight paths in one run (ratios are what counts on a shared
machine): float weights (``PD_WEIGHTS=float``, the dtype's matrices), GGUF blocks op by op
(``PD_WEIGHTS=auto`` with the fused step switched off) and GGUF blocks with the fused decode
step (``engine/model/fused_decode.py``), against the bandwidth roofline of the bytes each reads.
``fused-int8``: the fused step with int8 activations (``PD_BLOCK_DOT=int8``, integer dot
products; ``fused`` runs the float32 loops). ``fused-bf16dot``: the fused step with bf16 dot
products (``PD_BLOCK_DOT=bf16``: a bfloat16 model on an AVX512-BF16 CPU; elsewhere it runs the
float32 loops and says so in its log).

``python -m loadtest.experiments.bench_decode_paths [--batches 1,8,64] [--context 512] [--steps 12]``
"""

from __future__ import annotations

import argparse
import os

import torch

from loadtest.bench_engine import (
    decode_rates,
    measure_bandwidth_gbs,
    measure_matmul_gflops,
    parameter_count,
    weight_bytes_read,
)
from shared.config import Settings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench decode-paths")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--paths", default="float,blocks,fused", help="which of float, blocks, fused, fused-int8, fused-bf16dot to run")
    args = p.parse_args(argv)
    from engine.factory import build_engine
    from engine.model import fused_decode

    batches = [int(b) for b in args.batches.split(",")]
    base = Settings.from_env(torch_threads=args.threads)
    bw = measure_bandwidth_gbs(args.threads)
    bf16 = measure_matmul_gflops(args.threads, torch.bfloat16)
    print(f"memory read bandwidth {bw:.1f} GB/s, bf16 matmul {bf16:.0f} GFLOP/s, {args.threads} threads, context {args.context}, "
          f"{torch.__config__.parallel_info().splitlines()[0]}")
    build = fused_decode.build
    results = {}
    paths = {"float": ("float", "float", False, "float32"), "blocks": ("blocks, op by op", "auto", False, "float32"),
             "fused": ("blocks, fused step", "auto", True, "float32"),
             "fused-int8": ("fused, int8 dot", "auto", True, "int8"),
             "fused-bf16dot": ("fused, bf16 dot", "auto", True, "bf16")}
    for label, weights, fused, dot in (paths[name] for name in args.paths.split(",")):
        settings = base.replace(weights=weights, block_dot=dot)
        fused_decode.build = build if fused else (lambda *a, **k: None)
        try:
            probe = build_engine(settings.replace(kv_cache_memory_bytes=64 << 20))
            weight_bytes = weight_bytes_read(probe.model) + args.context * probe.bytes_per_token  # + one sequence's KV
            dtype = probe.dtype
            flops_per_token = 2 * parameter_count(probe.model)
            del probe
            results[label] = (weight_bytes, decode_rates(settings, batches, args.context, args.steps))
        finally:
            fused_decode.build = build
        wb, rates = results[label]
        roof_ms = wb / (bw * 1e9) * 1e3
        cells = "  ".join(f"b{b}: {s * 1e3:6.1f} ms ({b / s:6.1f} tok/s)" for b, s in rates.items())
        print(f"{label:<20} {str(dtype).removeprefix('torch.'):>9} weights+KV {wb / 1e6:5.0f} MB "
              f"(roofline {roof_ms:4.1f} ms)  {cells}")
        top = max(rates)
        print(f"{'':<20} batch {top}: {top / rates[top] * flops_per_token / 1e9 / bf16 * 100:.1f}% of the bf16 "
              f"matmul rate ({bf16:.0f} GFLOP/s, the compute roofline)")
    fused_rates = results.get("blocks, fused step", (0, {}))[1]
    for label in [k for k in ("float", "blocks, op by op", "fused, bf16 dot") if k in results and fused_rates]:
        ratios = "  ".join(f"b{b}: {results[label][1][b] / fused_rates[b]:.2f}x" for b in batches)
        print(f"fused step vs {label}: {ratios}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
