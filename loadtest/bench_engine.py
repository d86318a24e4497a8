"""The engine against this machine's own limits, and against llama.cpp and plain
transformers — all in one run (ratios are what counts on a shared, noisy machine).

``pdserve bench engine [--quick] [--skip-http] [--threads N]`` prints:

1. the machine: memory read bandwidth (GB/s), fp32 and bf16 matmul GFLOP/s;
2. decode ms/step and tokens/s at batch 1, 8, 32 and 64 (context 512): batch 1 as a multiple
   of the memory-bandwidth roofline (weight bytes / bandwidth), larger batches as a fraction of
   the compute roofline (2 × parameters FLOPs per token at the measured matmul rate);
3. prefill tokens/s at 512, 2048 and 6000 tokens against the GEMM roofline (2 x parameters FLOPs
   per token at the measured matmul rate) and against llama.cpp's prompt processing on the same
   GGUF in the same run (issue 29: at least 1.5x llama.cpp's; at 2048 at least 60% of the roofline);
4. TTFT of a 2048-token prompt cold, with 1792 of its tokens in this worker's prefix cache,
   and with those 1792 read from the KV store (put there by another worker);
5. through HTTP in one run, at concurrency 1, 8 and 32: ITL p50, TTFT p50 and output tokens/s
   of pdserve's full pipeline (``pdserve up`` defaults), llama.cpp's server on the same GGUF file
   (found as :func:`loadtest.baselines.find_llama_server` says, or built with ``--build-llama``)
   and plain transformers ``generate``;
7. 16 long prompts at once (100..5,700 words, 12 tokens each) through both servers: the last
   answer's time, TTFT and decode ITL (:mod:`loadtest.bench_longmix`; issue 29: at most 0.7x
   llama.cpp's wall time, ITL p99 at most 100 ms); ``--skip-long-mix`` leaves it out.

Targets (issue 12): batch-1 step within 1.5× the roofline of the bytes it reads; batch 64 at
least 50% of the compute roofline; ITL p50 at concurrency 1 at most llama.cpp's; output tokens/s
at least 3× llama.cpp's at concurrency 8 and 6× at 32; prefix-hit TTFT at most 15% of cold
(issue 3). The run prints each figure next to its target; a miss is printed as a miss.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from shared.config import Settings


def measure_bandwidth_gbs(threads: int, size_mb: int = 512) -> float:
    """Memory read bandwidth: sum over a buffer far larger than the caches (best of 5)."""
    torch.set_num_threads(threads)
    x = torch.ones(size_mb * (1 << 20) // 4)
    x.sum()
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def measure_matmul_gflops(threads: int, dtype: torch.dtype, n: int = 1024) -> float:
    """Dense matmul rate (best of 5) for an n×n by n×n product in ``dtype``."""
    torch.set_num_threads(threads)
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b
    best = 1e9
    t = time.perf_counter()
    a @ b
    # best of 5, or one more when a product takes long (bf16 without hardware support: seconds)
    reps = 5 if time.perf_counter() - t < 0.2 else 1
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def build(settings: Settings, **overrides):
    from engine.factory import build_engine

    return build_engine(settings.replace(**overrides))


def decode_rates(settings: Settings, batches: list[int], context: int, steps: int) -> dict[int, float]:
    """Seconds per decode step at each batch size, every sequence at ``context`` tokens, with
    speculative decoding off: one token per sequence a step, what the rooflines count (with the
    default ngram drafts a batch-1 step verified several rows: 14.2 / 12.9 ms against 11.6 / 12.2
    ms off, alternating, on the AVX-512 Xeon of 2026-12-06, and the bench divided by one token)."""
    from shared.messages import SamplingParams

    out = {}
    for batch in batches:
        kv = int(batch * (context + steps + 32) * 46_080 * 1.3)
        engine = build(settings, speculative_method="off", kv_cache_memory_bytes=max(kv, 256 << 20),
                       max_num_seqs=max(batch, 1),
                       max_num_batched_tokens=4096, max_prefill_chunk_tokens=0, enable_prefix_caching=False)
        sp = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
        for b in range(batch):
            engine.add_request(f"d{b}", [(7 * b + i) % 40000 + 100 for i in range(context)], sp)
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.sequences.values()):
            engine.step()
        engine.step()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        out[batch] = sorted(times)[len(times) // 2]
        del engine
    return out


def prefill_rates(settings: Settings, lengths: list[int]) -> dict[int, float]:
    """Seconds to prefill one prompt of each length (cold, no prefix cache), to the first token."""
    from shared.messages import SamplingParams

    engine = build(settings, max_num_batched_tokens=max(lengths), max_prefill_chunk_tokens=0,
                   enable_prefix_caching=False, kv_cache_memory_bytes=512 << 20)
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    engine.generate([[100 + i for i in range(64)]], sp)  # warm up
    out = {}
    for n in lengths:
        best = 1e9
        for rep in range(2):
            engine.add_request(f"p{n}-{rep}", [(3 * i + rep) % 40000 + 100 for i in range(n)], sp)
            t = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            best = min(best, time.perf_counter() - t)
        out[n] = best
    return out


def llama_prefill_rates(settings: Settings, threads: int, lengths: list[int]) -> dict[int, float] | str:
    """llama.cpp's prompt processing rate (tokens/s, its own ``timings.prompt_per_second``) for one
    cold prompt of each length on the same GGUF file, one slot, ``threads`` threads; best of two.
    Returns a reason string instead when no llama-server or no GGUF is at hand."""
    import httpx

    from loadtest.baselines import LlamaCpp, find_llama_server
    from loadtest.infra import free_port
    from shared.model_files import default_gguf_path

    binary = find_llama_server()
    if binary is None:
        return "no llama-server (pdserve bench engine --build-llama, or PD_LLAMA_SERVER=path)"
    if settings.model:
        return "PD_MODEL is set: llama.cpp needs the default GGUF"
    out: dict[int, float] = {}
    try:
        with LlamaCpp(binary, default_gguf_path(), free_port(), threads, parallel=1,
                      ctx_per_slot=max(lengths) + 64) as server:
            for n in lengths:
                rates = []
                for rep in range(2):  # distinct prompts, no prompt cache: both runs cold
                    prompt = [(3 * i + rep) % 40000 + 100 for i in range(n)]
                    r = httpx.post(f"{server.url}/completion", timeout=600,
                                   json={"prompt": prompt, "n_predict": 1, "cache_prompt": False, "temperature": 0})
                    r.raise_for_status()
                    rates.append(r.json()["timings"]["prompt_per_second"])
                out[n] = max(rates)
    except (RuntimeError, httpx.HTTPError, KeyError) as exc:
        return f"llama-server failed: {exc}"
    return out


def prefix_ttft(settings: Settings, total: int = 2048, cached: int = 1792) -> dict[str, float]:
    """TTFT of a ``total``-token prompt: cold; with ``cached`` tokens in the local prefix cache;
    with them imported from another engine's exported blocks (the KV-store path)."""
    from shared.messages import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0)
    overrides = dict(max_num_batched_tokens=total, max_prefill_chunk_tokens=0, kv_cache_memory_bytes=512 << 20)
    engine = build(settings, **overrides)
    base = [(5 * i) % 40000 + 100 for i in range(cached)]

    def ttft(e, tail_seed: int) -> float:
        prompt = base + [(11 * i + tail_seed) % 40000 + 100 for i in range(total - cached)]
        e.add_request(f"t{tail_seed}", prompt, sp)
        t = time.perf_counter()
        while e.has_unfinished():
            e.step()
        return time.perf_counter() - t

    engine.generate([[100 + i for i in range(64)]], sp)
    cold = ttft(engine, 1)  # also fills the prefix cache with `base`
    local = ttft(engine, 2)
    # another worker: the prefix arrives as exported blocks (what the KV store hands over)
    engine.add_request("exporter", base + [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0),
                       stop_after_prefill=True)
    exported = None
    while engine.has_unfinished():
        for out in engine.step():
            exported = out.prompt_kv
    other = build(settings, **overrides)
    other.generate([[100 + i for i in range(64)]], sp)
    blocks = [bytes(b) for b in exported.blocks]
    t = time.perf_counter()
    other.import_cached_blocks(exported.block_hashes, blocks)
    imported = time.perf_counter() - t + ttft(other, 3)
    return {"cold": cold, "local_hit": local, "store_hit": imported}


def weight_bytes_read(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads per token: every parameter and buffer as stored
    (quantized blocks at their size), less an input embedding the LM head does not share
    (a lookup reads one row)."""
    emb = model.get_input_embeddings().weight
    tied = getattr(model.get_output_embeddings(), "weight", None) is emb
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if tied or t is not emb)


def parameter_count(model: torch.nn.Module) -> int:
    """Parameters including quantized layers' weights; an input embedding the (quantized) LM
    head no longer shares counts once, as in the float model."""
    emb = model.get_input_embeddings().weight
    tied = getattr(model.get_output_embeddings(), "weight", None) is emb
    total = sum(p.numel() for p in model.parameters()) + quantized_weight_count(model)
    return total if tied or not isinstance(model.get_output_embeddings(), torch.nn.Module) else total - emb.numel()


def quantized_weight_count(model: torch.nn.Module) -> int:
    """Weights held by quantized layers (not parameters)."""
    from engine.model.quant import BlockLinear

    return sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, BlockLinear))


def quality_gate(settings: Settings, folder, block_dot: str, dtype: torch.dtype, device_type: str,
                 tokens: int = 256):
    """Teacher-forced quality of ``PD_WEIGHTS`` against float32 of the same model, or ``None``
    when the weights stay float; the block layers multiply with the served engine's resolved
    ``block_dot`` (for a model served in ``dtype`` on ``device_type``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loadtest.quality import compare, quantized_copy, repo_text

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    quantized = quantized_copy(reference, settings.weights, folder, block_dot, dtype, device_type)
    if quantized_weight_count(quantized) == 0:
        return None
    ids = AutoTokenizer.from_pretrained(folder)(repo_text())["input_ids"][:tokens]
    return compare(reference, quantized, ids)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench engine")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--quick", action="store_true", help="fewer steps and requests")
    p.add_argument("--skip-http", action="store_true", help="skip the HTTP comparisons (parts 5 and 7)")
    p.add_argument("--skip-long-mix", action="store_true", help="skip the long-prompt burst (part 7)")
    p.add_argument("--build-llama", action="store_true",
                   help="build llama.cpp's llama-server first when none is found (about 12 minutes on 2 cores)")
    args = p.parse_args(argv or [])
    threads = args.threads
    settings = Settings.from_env(torch_threads=threads)
    if args.build_llama and not args.skip_http:
        from loadtest.baselines import build_llama_server, find_llama_server

        if find_llama_server() is None:
            print(f"llama-server built: {build_llama_server()}")
    from engine.model.loader import ensure_model, resolve_device, resolve_dtype
    from shared.model_files import served_model_name

    folder = ensure_model(settings)
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    probe = build(settings, kv_cache_memory_bytes=64 << 20)
    block_dot = probe.runner.block_dot  # the arithmetic the engine resolved (fallbacks included)
    params = parameter_count(probe.model)
    weight_bytes = weight_bytes_read(probe.model)
    kv_per_token = probe.bytes_per_token
    attention = probe.runner.attention.__name__
    del probe

    bw = measure_bandwidth_gbs(threads)
    fp32 = measure_matmul_gflops(threads, torch.float32)
    bf16 = measure_matmul_gflops(threads, torch.bfloat16)
    # the roofline is the machine's faster GEMM, whatever the model's dtype: a bfloat16 model
    # whose block loops multiply in float32 (an Intel CPU without AMX tiles, where oneDNN's bf16
    # GEMM is the slower one) is held to the float32 rate, not flattered by the bf16 one
    peak = fp32 if dtype == torch.float32 else max(fp32, bf16)
    flops_per_token = 2 * params
    print(f"\nmodel {served_model_name(settings)} ({folder}), {params / 1e6:.1f} M parameters, {dtype}, "
          f"weights {weight_bytes / 1e6:.0f} MB, KV {kv_per_token / 1024:.1f} KiB/token, attention {attention}, "
          f"{threads} threads")
    from loadtest.bench_cores import cpu_line

    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print("\n1. machine")
    print(f"   {cpu_line()}; load average {load}")
    print(f"   memory read bandwidth   {bw:8.1f} GB/s")
    print(f"   fp32 matmul             {fp32:8.1f} GFLOP/s")
    print(f"   bf16 matmul             {bf16:8.1f} GFLOP/s   (this run: {str(dtype).removeprefix('torch.')}; "
          f"PD_DTYPE=auto picks bf16 only where the CPU has AVX512-BF16 or AMX)")
    print(f"   GEMM roofline           {peak:8.1f} GFLOP/s   ({'fp32' if peak == fp32 else 'bf16'}; block "
          f"arithmetic PD_BLOCK_DOT={block_dot})")
    roof_ms = weight_bytes / (bw * 1e9) * 1e3
    roof_tps = peak * 1e9 / flops_per_token

    steps = 6 if args.quick else 12
    rates = decode_rates(settings, [1, 8, 32, 64], context=512, steps=steps)
    print("\n2. decode at context 512")
    print(f"   bandwidth roofline (batch 1): {roof_ms:.1f} ms/step; compute roofline: {roof_tps:.0f} tokens/s")
    for batch, step in rates.items():
        tps = batch / step
        if batch == 1:
            ratio = step * 1e3 / roof_ms
            verdict = "meets" if ratio <= 1.5 else "MISSES"
            print(f"   batch {batch:>2}: {step * 1e3:7.1f} ms/step {tps:7.1f} tok/s = {ratio:.2f}× the bandwidth roofline "
                  f"(target ≤ 1.5×: {verdict})")
        else:
            frac = tps / roof_tps
            note = f" (target ≥ 50%: {'meets' if frac >= 0.5 else 'MISSES'})" if batch == 64 else ""
            print(f"   batch {batch:>2}: {step * 1e3:7.1f} ms/step {tps:7.1f} tok/s = {frac * 100:5.1f}% of the compute "
                  f"roofline{note}")

    lengths = [512, 2048] if args.quick else [512, 2048, 6000]
    prefill = prefill_rates(settings, lengths)
    llama = llama_prefill_rates(settings, threads, lengths)
    print("\n3. prefill (one prompt, cold), against llama.cpp's prompt processing on the same GGUF "
          f"(-t {threads}, its own timings)")
    if isinstance(llama, str):
        print(f"   llama.cpp: {llama}")
    for n, secs in prefill.items():
        tps = n / secs
        line = (f"   {n:>4} tokens: {secs * 1e3:8.1f} ms  {tps:7.0f} tok/s = {tps / roof_tps * 100:5.1f}% of the "
                f"GEMM roofline")
        if n == 2048:
            line += f" (target ≥ 60%: {'meets' if tps / roof_tps >= 0.6 else 'MISSES'})"
        if isinstance(llama, dict) and n in llama:
            ratio = tps / llama[n]
            line += (f"; llama.cpp {llama[n]:6.0f} tok/s, pdserve/llama.cpp {ratio:4.2f}x "
                     f"(target ≥ 1.5x: {'meets' if ratio >= 1.5 else 'MISSES'})")
        print(line)

    pt = prefix_ttft(settings)
    print("\n4. TTFT of a 2048-token prompt")
    print(f"   cold                              {pt['cold'] * 1e3:8.1f} ms")
    for key, label in (("local_hit", "1792 tokens in the prefix cache"), ("store_hit", "1792 tokens read from the store")):
        frac = pt[key] / pt["cold"]
        print(f"   {label:<33} {pt[key] * 1e3:8.1f} ms = {frac * 100:4.1f}% of cold "
              f"(target ≤ 15%: {'meets' if frac <= 0.15 else 'MISSES'})")

    gate = quality_gate(settings, folder, block_dot, dtype, device.type)
    if gate is not None:
        print(f"\n6. quality of PD_WEIGHTS={settings.weights} PD_BLOCK_DOT={block_dot} "
              f"vs float32 of the same file (teacher-forced, "
              f"{gate.tokens} tokens of docs/architecture.md)")
        print(f"   top-1 agreement {gate.top1_agreement * 100:.1f}%, perplexity {gate.ppl_quantized:.3f} vs "
              f"{gate.ppl_reference:.3f} (ratio {gate.ppl_ratio:.4f})")

    if not args.skip_http:
        print("\n5. through HTTP, one run (~200-word prompts, streamed, greedy)")
        from loadtest.bench_http import http_rates, print_http

        print_http(http_rates(settings, threads, args.quick))
    if not args.skip_http and not args.skip_long_mix:
        from loadtest.bench_longmix import long_mix, print_long_mix

        print("\n7. long prompts at once, through HTTP, one run")
        print_long_mix(long_mix(settings, threads), 16, 100, 5700, 12)
    return 0
