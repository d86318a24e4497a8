"""The load generator against any OpenAI-compatible server (pdserve, llama.cpp, vLLM).

``pdserve bench load --url http://127.0.0.1:8000 [--model NAME] [--workload W] ...``

Workloads: ``azure-conv`` and ``azure-code`` (Azure 2023 traces: arrival times and lengths),
``mooncake`` (arrival times, lengths and shared prefixes), ``poisson`` and ``gamma`` (bursty)
synthetic arrivals; ``--concurrency N`` turns any of them into a closed loop with N requests in
flight instead of replaying arrival times; ``--sweep`` repeats a synthetic workload at other
rates. Prints TTFT/ITL/TPOT/E2E percentiles, requests/s, output tokens/s and goodput (against
``--slo-ttft``/``--slo-tpot``), and writes a JSON/Markdown/PNG report to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import httpx

from loadtest import report
from loadtest.client import run_workload, summarize
from loadtest.workloads import Scaling, azure, mooncake, synthetic


def build(args, rate: float):
    scaling = Scaling(args.time_scale, args.max_prompt, args.max_output, block_tokens=args.block_tokens)
    if args.workload in ("azure-conv", "azure-code"):
        name = "azure2023_conv.csv" if args.workload == "azure-conv" else "azure2023_code.csv"
        return (azure(name, args.requests, scaling, seed=args.seed, vocab_size=args.vocab),
                f"{args.workload} trace; {scaling.describe()}")
    if args.workload == "mooncake":
        return (mooncake("mooncake_conversation.jsonl", args.requests, scaling, seed=args.seed, vocab_size=args.vocab),
                f"Mooncake conversation trace; {scaling.describe()}")
    burst = 1.0 if args.workload == "poisson" else args.burstiness
    mix = [(int(a), float(b)) for a, b in (x.split(":") for x in args.prompt_mix.split(","))]
    specs = synthetic(args.requests, rate, mix, args.max_output, burstiness=burst, seed=args.seed, vocab_size=args.vocab)
    kind = "Poisson" if burst == 1.0 else f"gamma (burstiness {burst})"
    return specs, f"{kind} arrivals at {rate} req/s, prompt mix {args.prompt_mix}, {args.max_output} output tokens"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench load")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="", help="model id (default: the server's first /v1/models entry)")
    p.add_argument("--workload", default="poisson", choices=("azure-conv", "azure-code", "mooncake", "poisson", "gamma"))
    p.add_argument("--requests", type=int, default=50)
    p.add_argument("--rate", type=float, default=1.0, help="requests/s for synthetic workloads")
    p.add_argument("--burstiness", type=float, default=4.0, help="gamma: squared coefficient of variation")
    p.add_argument("--prompt-mix", default="128:0.8,1024:0.2", help="tokens:weight,...")
    p.add_argument("--time-scale", type=float, default=1.0, help="traces: multiply inter-arrival gaps")
    p.add_argument("--max-prompt", type=int, default=2048)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--block-tokens", type=int, default=64, help="Mooncake: tokens per 512-token block")
    p.add_argument("--concurrency", type=int, default=0, help="closed loop with this many in flight")
    p.add_argument("--sweep", default="", help="also run these rates (synthetic), e.g. 0.5,2")
    p.add_argument("--slo-ttft", type=float, default=5.0)
    p.add_argument("--slo-tpot", type=float, default=0.25)
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly the output lengths (vLLM/llama.cpp/pdserve)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=0, help="token ids of synthetic prompts stay below this")
    p.add_argument("--out", default="")
    args = p.parse_args(argv or [])
    listing = httpx.get(f"{args.url}/v1/models", timeout=10).json()["data"][0]
    model = args.model or listing["id"]
    args.vocab = args.vocab or listing.get("vocab_size")  # pdserve says; other servers get the default range
    extra = {"ignore_eos": True} if args.ignore_eos else None
    rates = [args.rate] + [float(x) for x in args.sweep.split(",") if x]
    summaries, results, sweeps = {}, {}, {}
    description = ""
    for rate in rates:
        specs, description = build(args, rate)
        res, wall = asyncio.run(run_workload(args.url, model, specs, concurrency=args.concurrency or None, extra=extra))
        s = summarize(res, wall, args.slo_ttft, args.slo_tpot)
        label = f"{rate} req/s" if len(rates) > 1 else args.workload
        summaries[label], results[label] = s, res
        sweeps.setdefault(args.url, []).append((rate, s))
    print(description)
    print(report.table(summaries))
    out = Path(args.out or f"reports/load-{time.strftime('%Y%m%d-%H%M%S')}")
    path = report.write(out, f"load test of {args.url} ({model})", description, summaries, results,
                        sweeps=sweeps if len(rates) > 1 else None)
    print(f"report: {path}")
    return 0
