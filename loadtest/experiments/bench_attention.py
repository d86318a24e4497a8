"""GFLOP/s of the CPU attention kernels (``kernels/cpu/paged_attention.cpp``): float32 math against
bf16 dot products (``bf16=True``; AVX512-BF16 builds only) and the same roundings on AMX tiles
(``amx=True``; where the OS grants them), interleaved in one run (ratios are
what counts on a shared machine), for a prefill chunk at the end of a context
(``paged_prefill_attention_tiled``, the batch-invariant mode's prefill) and for one decode query
(``paged_decode_attention``), over a bfloat16 cache with SmolLM2-135M's shape (9 query heads on
3 KV heads, head_dim 64, blocks of 16 scattered through the pool).

``pdserve bench attention [--contexts 512,2048,6000] [--chunk 512] [--threads 1,2] [--repeats 5]
[--quality TOKENS]``

Each cell is the minimum over ``repeats`` calls (decode: of the mean of 30 calls). FLOPs are
``4 head_dim`` per (query head, key): q.k and p.v, the causal keys of each query only. Prints
the CPU's flags that matter and the load average before and after.

``--quality TOKENS``: what the arithmetic does to the default model, through the engine's own
forward (README defaults, batch-invariant, fused): one prefill of TOKENS tokens of
docs/architecture.md with every position's logits kept (teacher forcing), once with bf16 and once
with float32 attention, each against transformers' float32 model of the same folder: top-1
agreement and perplexity.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def _best_s(repeats: int, fn, calls: int = 1) -> float:
    """The smallest mean seconds of ``calls`` calls of ``fn`` over ``repeats`` rounds (after one
    warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def _cpu() -> str:
    from kernels.cpu import _cpu_flags

    flags = set(_cpu_flags().split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
    return " ".join(f for f in wanted if f in flags) or "no AVX2"


def engine_quality(tokens: int) -> None:
    """Print top-1 agreement and perplexity of the engine's prefill logits (every position) with
    bf16 and with float32 attention against transformers' float32 model (see the module doc)."""
    import math

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import engine.model.batch_invariant as invariant
    from engine.factory import build_engine
    from loadtest.quality import chunked_logits, repo_text
    from shared.config import Settings
    from shared.messages import SamplingParams
    from shared.model_files import model_dir

    settings = Settings.from_env()
    folder = model_dir(settings)
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok(repo_text(200_000))["input_ids"][:tokens]
    reference = chunked_logits(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), ids, 64)[:-1]
    target = torch.tensor(ids[1:])

    def ppl(logits: torch.Tensor) -> float:
        return math.exp(torch.nn.functional.cross_entropy(logits, target).item())

    real, got = invariant.attention_bf16, {}
    try:
        for name, choose in (("bf16", real), ("float32", lambda runner, ext: False)):
            invariant.attention_bf16 = choose
            engine = build_engine(settings.replace(max_num_batched_tokens=len(ids), max_prefill_chunk_tokens=0,
                                                   enable_prefix_caching=False, kv_cache_memory_bytes=512 << 20))
            fused = engine.runner.fused
            if fused is None or not engine.runner.is_batch_invariant:
                print("quality: the engine is not on the fused batch-invariant path here; skipped")
                return
            every = fused.step_logits

            def keep_all(i, pos, meta, keep, every=every):
                got["rows"] = every(i, pos, meta, torch.arange(i.shape[0]))
                return got["rows"][keep]

            fused.step_logits = keep_all
            engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
            got[name] = got.pop("rows")[:-1].float()
            top1 = (got[name].argmax(-1) == reference.argmax(-1)).float().mean().item()
            print(f"quality, {name} attention ({engine.runner.attention.__name__}), {len(target)} tokens: top-1 "
                  f"agreement with float32 {top1 * 100:.1f}%, perplexity {ppl(got[name]):.3f} vs {ppl(reference):.3f} "
                  f"(ratio {ppl(got[name]) / ppl(reference):.4f})", flush=True)
    finally:
        invariant.attention_bf16 = real
    same = (got["bf16"].argmax(-1) == got["float32"].argmax(-1)).float().mean().item()
    print(f"quality, bf16 against float32 attention: top-1 agreement {same * 100:.1f}%")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench attention")
    p.add_argument("--contexts", default="512,2048,6000")
    p.add_argument("--chunk", type=int, default=512, help="prefill queries at the end of each context")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quality", type=int, default=0, metavar="TOKENS",
                   help="also the engine's teacher-forced quality over TOKENS tokens, bf16 vs float32 attention")
    args = p.parse_args(argv)
    from kernels import cpu

    ext = cpu.load()
    print(f"CPU flags: {_cpu()}; bf16 dot products: {'yes' if ext.has_bf16 else 'no (float32 only)'}; "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"{HEADS} heads on {KV_HEADS} KV heads, head_dim {HEAD_DIM}, bf16 cache, blocks of {BLOCK}")
    kinds = [("float32", (False, False))] + ([("bf16", (True, False))] if ext.has_bf16 else [])
    kinds += [("amx", (False, True))] if getattr(ext, "has_amx", False) else []
    print(" threads  context  chunk  " + "  ".join(f"{k} ms GFLOP/s" for k, _ in kinds)
          + "  |  decode " + "  ".join(f"{k} us" for k, _ in kinds) + "  |  ratios to float32 (prefill, decode)"
          + ("; amx to bf16" if len(kinds) == 3 else ""))
    gen = torch.Generator().manual_seed(0)
    before = torch.get_num_threads()
    try:
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for ctx in (int(c) for c in args.contexts.split(",")):
                blocks = -(-ctx // BLOCK)
                k = torch.randn(blocks + 4, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
                v = torch.randn(blocks + 4, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
                table = torch.randperm(blocks + 4, generator=gen)[:blocks]
                n = min(ctx, args.chunk)
                q = torch.randn(n, HEADS, HEAD_DIM, generator=gen)
                flops = 4 * HEAD_DIM * HEADS * sum(ctx - n + 1 + i for i in range(n))
                q1, t1, l1 = q[-1:].contiguous(), table.unsqueeze(0), torch.tensor([ctx])
                cells = {}
                for name, (b, a) in kinds:
                    cells[name] = (
                        _best_s(args.repeats, lambda b=b, a=a, q=q, k=k, v=v, table=table, ctx=ctx:
                                ext.paged_prefill_attention_tiled(q, k, v, table, ctx, HEAD_DIM ** -0.5, 0, b, a)),
                        _best_s(args.repeats, lambda b=b, a=a, q1=q1, k=k, v=v, t1=t1, l1=l1:
                                ext.paged_decode_attention(q1, k, v, t1, l1, HEAD_DIM ** -0.5, b, a), calls=30))
                f_pre, f_dec = cells["float32"]
                row = f"{threads:>8} {ctx:>8} {n:>6}  "
                row += "  ".join(f"{pre * 1e3:>8.2f} {flops / pre / 1e9:>5.0f}" for pre, _ in cells.values())
                row += "  |  " + "  ".join(f"{dec * 1e6:>8.0f}" for _, dec in cells.values())
                row += "  |  " + "  ".join(f"{name} {f_pre / pre:.2f}x, {f_dec / dec:.2f}x"
                                           for name, (pre, dec) in cells.items() if name != "float32")
                if len(cells) == 3:
                    row += f"; amx {cells['bf16'][0] / cells['amx'][0]:.2f}x, {cells['bf16'][1] / cells['amx'][1]:.2f}x"
                print(row, flush=True)
    finally:
        torch.set_num_threads(before)
    print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if args.quality and ext.has_bf16:
        engine_quality(args.quality)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
