"""Cores where the work is (``PD_CORE_SHARE``, services/common/core_share.py), measured:
``pdserve bench cores [--rounds 2] [--long 2048] [--seconds 40]``.

The README's default deployment (one prefill and one decode worker, ``pdserve up``'s thread
shares, nothing pinned) with the rule off and on, alternating deployment by deployment
(off, on, off, on, ...), each serving:

* **alone**: ``--long``-token prompts one at a time with nothing decoding: TTFT (the prefill
  worker may take the idle decode worker's cores);
* **one stream**: ``--one`` requests one after another (96-token prompts, 128 output tokens) with
  nothing in prefill: ITL p50/p90 and time per output token (the decode worker may take the idle
  prefill worker's cores);
* **mixed**: a RAG/agent host's day: ``--streams`` interactive streams (96-token prompts,
  128 output tokens, each sending its next request when the last one ends) while a
  ``--long``-token prompt arrives every ``--every`` seconds for ``--seconds``: the streams' ITL
  p50/p90/p99 and per-request time per output token p90 (the decode worker is busy, so the
  prefill worker must keep to its share), and the long prompts' TTFT.

Prints one table with both settings in the same run, the CPU's model and flags, the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time

from loadtest.client import RequestSpec, percentile, send_one


async def _alone(url: str, model: str, prompts: list[list[int]]) -> list[float]:
    import httpx

    out = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for p in prompts:
            r = await send_one(client, model, RequestSpec(0, p, 2, chat=False), extra={"ignore_eos": True})
            out.append(r.ttft_s if r.ok else float("nan"))
    return out


async def _one_stream(url: str, model: str, prompts: list[list[int]]) -> dict:
    import httpx

    out = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for p in prompts:
            out.append(await send_one(client, model, RequestSpec(0, p, 128, chat=False), extra={"ignore_eos": True}))
    gaps = [g for r in out if r.ok for g in r.itls]
    tpots = [r.tpot_s for r in out if r.ok and r.tpot_s is not None]
    return {"one_itl": [percentile(gaps, q) for q in (50, 90)], "one_tpot": statistics.median(tpots),
            "one_failed": sum(not r.ok for r in out)}


async def _mixed(url: str, model: str, args, rng: random.Random, vocab_tokens) -> dict:
    import httpx

    stop_at = time.perf_counter() + args.seconds
    streams: list = []
    longs: list = []

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def stream():
            while time.perf_counter() < stop_at:
                r = await send_one(client, model, RequestSpec(0, vocab_tokens(rng, 96), 128, chat=False),
                                   extra={"ignore_eos": True})
                streams.append(r)

        async def long_prompts():
            tasks = []
            while time.perf_counter() < stop_at:
                tasks.append(asyncio.create_task(send_one(
                    client, model, RequestSpec(0, vocab_tokens(rng, args.long), 8, chat=False), extra={"ignore_eos": True})))
                await asyncio.sleep(args.every)
            longs.extend(await asyncio.gather(*tasks))

        await asyncio.gather(long_prompts(), *(stream() for _ in range(args.streams)))
    gaps = [g for r in streams if r.ok for g in r.itls]
    tpots = [r.tpot_s for r in streams if r.ok and r.tpot_s is not None]
    return {"itl": [percentile(gaps, q) for q in (50, 90, 99)], "tpot_p90": percentile(tpots, 90),
            "long_ttft": [r.ttft_s for r in longs if r.ok], "failed": sum(not r.ok for r in streams + longs),
            "tokens": sum(r.output_tokens for r in streams if r.ok)}


def cpu_line() -> str:
    """The CPU's model name and the vector/matrix flags that decide the kernels' paths."""
    model, flags = "?", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "?":
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = [x for x in line.split(":", 1)[1].split() if x.startswith(("avx", "amx"))]
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} vCPU, {' '.join(sorted(set(flags))) or 'no AVX flags'}"


def main(argv: list[str] | None = None) -> int:
    from loadtest.bench_modes import Deployed, _model_name, _vocab
    from loadtest.workloads import random_tokens
    from shared.config import Settings

    p = argparse.ArgumentParser(prog="pdserve bench cores", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="off/on pairs of deployments")
    p.add_argument("--long", type=int, default=2048, help="long prompt tokens")
    p.add_argument("--alone", type=int, default=3, help="long prompts timed alone per deployment")
    p.add_argument("--one", type=int, default=4, help="requests of the one-stream part")
    p.add_argument("--streams", type=int, default=3)
    p.add_argument("--every", type=float, default=6.0, help="seconds between long prompts in the mixed load")
    p.add_argument("--seconds", type=float, default=40.0, help="length of the mixed load")
    args = p.parse_args(argv or [])
    base = Settings.from_env()
    vocab = _vocab(base)
    model = _model_name(base)
    plan = {"replicas": {"prefill": 1, "decode": 1}, "affinity": {}, "settings": {}}
    results: dict[str, list] = {"off": [], "on": []}
    for rnd in range(args.rounds):
        for label in ("off", "on"):
            plan["settings"] = {"core_share": label == "on"}
            rng = random.Random(1000 * rnd + (label == "on"))  # fresh tokens: no prefix-cache hits
            with Deployed(base, plan) as dep:
                asyncio.run(_alone(dep.url, model, [random_tokens(rng, 32, vocab)]))  # warm-up
                alone = asyncio.run(_alone(dep.url, model, [random_tokens(rng, args.long, vocab) for _ in range(args.alone)]))
                one = asyncio.run(_one_stream(dep.url, model, [random_tokens(rng, 96, vocab) for _ in range(args.one)]))
                mixed = asyncio.run(_mixed(dep.url, model, args, rng, lambda r, n: random_tokens(r, n, vocab)))
            row = {"alone": alone, **one, **mixed, "load": os.getloadavg()[0]}
            results[label].append(row)
            print(f"round {rnd} core_share={label}: long TTFT alone {statistics.median(alone):.2f} s; one stream ITL "
                  f"p50/p90 {'/'.join(f'{x * 1e3:.1f}' for x in one['one_itl'])} ms, TPOT {one['one_tpot'] * 1e3:.1f} ms; mixed ITL "
                  f"p50/p90/p99 {'/'.join(f'{x * 1e3:.1f}' for x in mixed['itl'])} ms, TPOT p90 "
                  f"{mixed['tpot_p90'] * 1e3:.1f} ms, long TTFT p50 {statistics.median(mixed['long_ttft']):.2f} s, "
                  f"{mixed['failed']} failed, load {row['load']:.2f}", flush=True)

    def med(label, f):
        return statistics.median(f(r) for r in results[label])

    print(f"\n{cpu_line()}; default deployment (1 prefill + 1 decode, pdserve up's threads); {args.rounds} "
          f"deployments each; long prompts {args.long} tokens; mixed: {args.streams} streams of 128 tokens, a long "
          f"prompt every {args.every:g} s for {args.seconds:g} s\n")
    print("| measure | PD_CORE_SHARE=false | true | ratio |\n|---|---|---|---|")
    rows = [("long prompt TTFT, nothing decoding (s)", lambda r: statistics.median(r["alone"])),
            ("one stream, nothing in prefill: ITL p50 (ms)", lambda r: r["one_itl"][0] * 1e3),
            ("one stream, nothing in prefill: ITL p90 (ms)", lambda r: r["one_itl"][1] * 1e3),
            ("one stream, nothing in prefill: TPOT (ms)", lambda r: r["one_tpot"] * 1e3),
            ("mixed: stream ITL p50 (ms)", lambda r: r["itl"][0] * 1e3),
            ("mixed: stream ITL p90 (ms)", lambda r: r["itl"][1] * 1e3),
            ("mixed: stream ITL p99 (ms)", lambda r: r["itl"][2] * 1e3),
            ("mixed: per-request TPOT p90 (ms)", lambda r: r["tpot_p90"] * 1e3),
            ("mixed: long prompt TTFT p50 (s)", lambda r: statistics.median(r["long_ttft"])),
            ("mixed: stream tokens out", lambda r: r["tokens"])]
    for name, f in rows:
        off, on = med("off", f), med("on", f)
        print(f"| {name} | {off:.2f} | {on:.2f} | {on / off:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
