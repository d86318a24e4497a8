"""The issue-12 table in one run: pdserve (``pdserve up`` defaults: 1 prefill + 1 decode worker,
the launcher's thread share) against llama.cpp's server on the same GGUF (found or built as
:mod:`loadtest.baselines` says; ``-t`` = this machine's cores), 200-word prompts, 64 output
tokens, streamed, greedy: part 5 of ``pdserve bench engine`` alone, with its target verdicts.

``PD_LLAMA_SERVER=/path/llama-server python -m loadtest.bench_http [--concurrency 1,8,32]``

Prints per server and concurrency: ITL p50, TTFT p50 (ms) and output tokens/s. TTFT is the
client's first SSE chunk, which for both servers can be the role chunk sent before any token.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics

from shared.config import Settings

WORDS = ("the quick brown fox jumps over the lazy dog while a cat sleeps on a warm mat near the old "
         "stone bridge").split()


def prompt(i: int) -> str:
    """A ~200-word prompt, distinct per request (no prefix-cache hits between requests)."""
    return f"Request {i}: summarize this text. " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(200))


def measure(url: str, model: str, concurrency: int, out_tokens: int = 64) -> tuple[float, float, float]:
    """(ITL p50 ms, TTFT p50 ms, output tok/s) for ``2 x concurrency`` requests (at least 4)."""
    from loadtest.client import RequestSpec, run_workload

    n = max(4, 2 * concurrency)
    specs = [RequestSpec(0.0, prompt(i + 1000 * concurrency), out_tokens) for i in range(n)]
    results, wall = asyncio.run(run_workload(url, model, specs, concurrency=concurrency, extra={"ignore_eos": True},
                                             progress=False))
    ok = [r for r in results if r.ok]
    itls = [x for r in ok for x in r.itls]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    return (statistics.median(itls) * 1e3 if itls else float("nan"),
            statistics.median(ttfts) * 1e3 if ttfts else float("nan"),
            sum(r.output_tokens for r in ok) / wall)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_http")
    p.add_argument("--concurrency", default="1,8,32")
    args = p.parse_args(argv)
    from loadtest.bench_engine import http_rates, print_http

    settings = Settings.from_env()
    levels = tuple(int(c) for c in args.concurrency.split(","))
    print_http(http_rates(settings, len(os.sched_getaffinity(0)), False, levels, transformers=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
