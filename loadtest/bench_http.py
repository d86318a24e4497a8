"""The issue-12 table in one run: pdserve (``pdserve up`` defaults: 1 prefill + 1 decode worker,
the launcher's thread share) against llama.cpp's server on the same GGUF (found or built as
:mod:`loadtest.baselines` says; ``-t`` = this machine's cores), 200-word prompts, 64 output
tokens, streamed, greedy: part 5 of ``pdserve bench engine`` alone, with its target verdicts.

``PD_LLAMA_SERVER=/path/llama-server python -m loadtest.bench_http [--concurrency 1,8,32]``

Prints per server and concurrency: ITL p50, TPOT p50, TTFT p50 (ms) and output tokens/s. TTFT is
the client's first SSE chunk, which for both servers can be the role chunk sent before any token.
ITL is the gap between content chunks (vLLM's ``benchmark_serving`` convention); a chunk of a
speculative step carries several tokens, so with speculation on the gaps grow while the time per
output token (TPOT, (E2E - TTFT) / (tokens - 1) per request: genai-perf's "inter-token
latency") falls. Both are printed, and the verdict is on the ITL as the issue states it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import uuid
from pathlib import Path

from shared.config import Settings

WORDS = ("the quick brown fox jumps over the lazy dog while a cat sleeps on a warm mat near the old "
         "stone bridge").split()


def prompt(i: int) -> str:
    """A ~200-word prompt, distinct per request (no prefix-cache hits between requests)."""
    return f"Request {i}: summarize this text. " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(200))


def measure(url: str, model: str, concurrency: int, out_tokens: int = 64) -> tuple[float, float, float, float]:
    """(ITL p50 ms, TPOT p50 ms, TTFT p50 ms, output tok/s) for ``2 x concurrency`` requests (at
    least 4); NaN where no request gave the figure."""
    from loadtest.client import RequestSpec, run_workload

    n = max(4, 2 * concurrency)
    specs = [RequestSpec(0.0, prompt(i + 1000 * concurrency), out_tokens) for i in range(n)]
    results, wall = asyncio.run(run_workload(url, model, specs, concurrency=concurrency, extra={"ignore_eos": True},
                                             progress=False))
    ok = [r for r in results if r.ok]
    itls = [x for r in ok for x in r.itls]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    return (statistics.median(itls) * 1e3 if itls else float("nan"),
            statistics.median(tpots) * 1e3 if tpots else float("nan"),
            statistics.median(ttfts) * 1e3 if ttfts else float("nan"),
            sum(r.output_tokens for r in ok) / wall)


def http_rates(settings: Settings, threads: int, quick: bool, levels: tuple[int, ...] = (1, 8, 32),
               transformers: bool = True) -> list[tuple[str, int, float, float, float, float, str]]:
    """(server, concurrency, ITL p50 ms, TPOT p50 ms, TTFT p50 ms, output tokens/s, note) through HTTP, in one
    run: pdserve as ``pdserve up`` starts it (1 prefill + 1 decode worker, the launcher's thread
    share, the README's defaults), llama.cpp's server on the same GGUF (``-t`` = this machine's
    cores, ``--parallel`` = the concurrency) and plain transformers ``generate`` (concurrency 1).
    Requests as :func:`loadtest.bench_http.measure`: ~200-word prompts, 64 output tokens
    (32 with ``quick``), streamed, ``ignore_eos``."""
    from engine.model.loader import ensure_model
    from loadtest.baselines import LlamaCpp, ServerThread, find_llama_server, hf_app
    from loadtest.infra import free_port
    from services import launcher, local_infra
    from shared.model_files import DEFAULT_GGUF_FILE, default_gguf_path, served_model_name

    name = served_model_name(settings)
    out_tokens = 32 if quick else 64
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # torch_threads=0: the launcher shares the cores out among the model workers as
        # `pdserve up` does (the bench's --threads for every worker oversubscribes the cores:
        # measured 13.8 against 20.7 tok/s at concurrency 1 on 2 cores)
        s = settings.replace(namespace=f"bench{uuid.uuid4().hex[:6]}", gateway_port=free_port(),
                             kv_cache_memory_bytes=1 << 30, max_num_seqs=64, torch_threads=0)
        dep = launcher.up(s, {"tokenizer": 1, "prefill": 1, "decode": 1, "postfilter": 1, "gateway": 1},
                          Path(tmp), ready_timeout_s=600, quiet=True)
        try:
            measure(dep.url, name, 1, out_tokens)  # warm-up
            rows += [("pdserve up", c, *measure(dep.url, name, c, out_tokens), "") for c in levels]
        finally:
            launcher.stop_all(dep)
            local_infra.drop_namespace(s)
    binary = find_llama_server()
    gguf = default_gguf_path() if not settings.model else None
    if binary is None:
        rows.append(("llama.cpp server", 0, *(float("nan"),) * 4,
                     "not found: pdserve bench engine --build-llama (or PD_LLAMA_SERVER=path)"))
    elif gguf is None:
        rows.append(("llama.cpp server", 0, *(float("nan"),) * 4, f"needs the GGUF ({DEFAULT_GGUF_FILE}); PD_MODEL is set"))
    else:
        for c in levels:
            try:
                with LlamaCpp(binary, gguf, free_port(), threads, parallel=c) as server:
                    measure(server.url, name, 1, out_tokens)
                    rows.append((f"llama.cpp server -t {threads}", c, *measure(server.url, name, c, out_tokens), ""))
            except RuntimeError as exc:  # e.g. a build for another CPU: SIGILL at start
                rows.append((f"llama.cpp server -t {threads}", c, *(float("nan"),) * 4, f"did not start: {exc}"))
    if not transformers:
        return rows
    folder = ensure_model(settings)
    with ServerThread(hf_app(folder, name, threads), free_port()) as server:
        measure(server.url, name, 1, out_tokens)
        rows.append(("transformers generate", 1, *measure(server.url, name, 1, out_tokens), "one request at a time"))
    return rows


def print_http(rows) -> None:
    """Print :func:`http_rates` rows as a table, then :func:`http_verdicts`."""
    print(f"   {'server':<26} {'conc':>4} {'ITL p50 ms':>10} {'TPOT p50 ms':>11} {'TTFT p50 ms':>11} {'out tok/s':>9}")
    for server, c, itl, tpot, ttft, tps, note in rows:
        print(f"   {server:<26} {c:>4} {itl:>10.1f} {tpot:>11.1f} {ttft:>11.0f} {tps:>9.1f}  {note}")
    for line in http_verdicts(rows):
        print(f"   {line}")


def http_verdicts(rows) -> list[str]:
    """Issue 12's HTTP targets from :func:`http_rates` rows, one line each: pdserve's ITL p50 at
    concurrency 1 at most llama.cpp's; output tokens/s at least 3x llama.cpp's at 8 and 6x at 32.
    Beside the ITL verdict, the TPOT p50 ratio at concurrency 1, without a target (see the module
    docstring)."""
    ours = {c: (itl, tps, tpot) for server, c, itl, tpot, _, tps, _ in rows if server == "pdserve up"}
    theirs = {c: (itl, tps, tpot) for server, c, itl, tpot, _, tps, _ in rows
              if server.startswith("llama.cpp") and tps == tps}
    lines = []
    if 1 in ours and 1 in theirs:
        ratio = ours[1][0] / theirs[1][0]
        lines.append(f"ITL p50 at concurrency 1: pdserve {ours[1][0]:.1f} ms / llama.cpp {theirs[1][0]:.1f} ms = "
                     f"{ratio:.2f}x (target <= 1x: {'meets' if ratio <= 1 else 'MISSES'})")
        lines.append(f"TPOT p50 at concurrency 1: pdserve {ours[1][2]:.1f} ms / llama.cpp {theirs[1][2]:.1f} ms = "
                     f"{ours[1][2] / theirs[1][2]:.2f}x (time per output token; no target)")
    for c, target in ((8, 3.0), (32, 6.0)):
        if c in ours and c in theirs:
            ratio = ours[c][1] / theirs[c][1]
            lines.append(f"output tok/s at concurrency {c}: {ratio:.2f}x llama.cpp (target >= {target:.0f}x: "
                         f"{'meets' if ratio >= target else 'MISSES'})")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench http")
    p.add_argument("--concurrency", default="1,8,32")
    args = p.parse_args(argv)

    settings = Settings.from_env()
    levels = tuple(int(c) for c in args.concurrency.split(","))
    print_http(http_rates(settings, len(os.sched_getaffinity(0)), False, levels, transformers=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
