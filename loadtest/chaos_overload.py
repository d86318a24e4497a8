"""The ``overload`` scenario of ``pdserve chaos``: more long prompts than the deployment can
serve, arriving regardless of how it copes (open loop), and what became of each.

1. Measure the sustained rate: one long prompt per prefill replica, untimed (a cold deployment's
   one-time costs), then ``warmup`` long prompts, closed loop at a concurrency of the prefill
   replicas; completions per second over the whole of those.
2. Arrivals for ``duration_s`` at ``factor`` × that rate (or ``rate``), Poisson, each a
   distinct long prompt (no prefix-cache hits), streamed, never retried.
3. Each request must end — completed, or a typed error (an OpenAI error object: a 503
   ``overloaded`` from admission by predicted wait, or any other) — within its deadline
   (``PD_REQUEST_TIMEOUT_S``); **hung** (no end within the deadline + 30 s) and **late** (an end
   after the deadline + :data:`LATE_MARGIN_S`) must be 0. The admitted requests' TTFT p99 is
   reported against the deadline, and the caller checks that nothing is left staged, held or
   in the KV ledger (**leaked**).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass

import httpx

from loadtest.chaos_client import Outcome, one_request, run_load

#: An end this long after the deadline is still on time (the gateway's deadline check runs on
#: each event or tick; the client's clock started before the request's).
LATE_MARGIN_S = 2.0
WORDS = ("river", "stone", "lantern", "harbour", "orchard", "engine", "meadow", "signal", "copper", "thread",
         "valley", "market", "winter", "compass", "garden", "bridge", "ember", "ladder", "canyon", "velvet")


@dataclass(frozen=True)
class OverloadPlan:
    """The scenario's knobs: arrivals for ``duration_s`` at ``factor`` × the sustained rate (or
    ``rate`` per second when set), prompts of ``prompt_words`` words, ``max_tokens`` each,
    ``warmup`` requests to measure the sustained rate (0: four per prefill replica), and the
    deployment's ``PD_MAX_QUEUE_TIME_S``."""

    duration_s: float = 60.0
    factor: float = 4.0
    rate: float = 0.0
    prompt_words: int = 1500
    max_tokens: int = 16
    warmup: int = 0
    max_queue_time_s: float = 20.0


def long_prompts(n: int, words: int, seed: int) -> list[str]:
    """``n`` distinct prompts of ``words`` words (their first words differ: no shared prefix)."""
    rng = random.Random(seed)
    return [f"Document {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) +
            "\nSummarize the document in one sentence." for i in range(n)]


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


async def open_loop(url: str, model: str, prompts: list[str], rate: float, duration_s: float, max_tokens: int,
                    hang_s: float, seed: int) -> list[Outcome]:
    """Poisson arrivals at ``rate`` per second for ``duration_s``, each a streamed request of
    the next prompt; returns every request's Outcome once all have ended."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(hang_s, connect=10), limits=limits) as client:
        tasks = []
        end = time.monotonic() + duration_s
        i = 0
        while time.monotonic() < end:
            tasks.append(asyncio.create_task(one_request(client, model, prompts[i % len(prompts)], max_tokens, None,
                                                         hang_s)))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))


def run_overload(url: str, model: str, settings, plan: OverloadPlan, seed: int = 0,
                 say=print) -> tuple[list[Outcome], dict, float]:
    """Run the scenario against a deployment: (every request's outcome, the figures, seconds).
    Leftovers (staged bytes, held blocks, ledger records) are measured by the caller.

    Raises:
        RuntimeError: no warm-up request completed (the rate cannot be measured).
    """
    deadline_s = settings.request_timeout_s
    hang_s = deadline_s + 30
    started = time.monotonic()
    sustained = plan.rate / plan.factor if plan.rate else 0.0
    if not plan.rate:
        concurrency = 2  # the chaos deployment's prefill replicas
        warm = long_prompts((plan.warmup or 8) + concurrency, plan.prompt_words, seed=1000 + seed)
        # one request per slot first, untimed: a cold deployment's first requests carry one-time
        # costs that held a measured rate at a quarter of what it then served (40 of 40 admitted
        # at "4x", none refused)
        asyncio.run(run_load(url, model, warm[:concurrency], concurrency, plan.max_tokens, 0.0, hang_s, seed=seed))
        t0 = time.monotonic()
        results = asyncio.run(run_load(url, model, warm[concurrency:], concurrency, plan.max_tokens, 0.0, hang_s,
                                       seed=seed))
        done = sum(o.status == "completed" for _, o in results)
        sustained = done / (time.monotonic() - t0)
        if not done:
            raise RuntimeError(f"overload: no warm-up request completed: {results[0][1]}")
    rate = plan.rate or plan.factor * sustained
    say(f"chaos: overload: sustained {sustained:.3f} req/s of {plan.prompt_words}-word prompts; "
        f"sending {rate:.3f} req/s for {plan.duration_s:.0f}s")
    n = max(1, int(rate * plan.duration_s * 2) + 8)
    prompts = long_prompts(n, plan.prompt_words, seed=seed)
    outcomes = asyncio.run(open_loop(url, model, prompts, rate, plan.duration_s, plan.max_tokens, hang_s, seed))
    seconds = time.monotonic() - started
    admitted = [o for o in outcomes if o.http_status == 200]
    ttfts = [o.ttft_s for o in admitted if o.ttft_s is not None]
    refused = [o for o in outcomes if o.http_status == 503 and o.error_type == "overloaded"]

    def count(status: str) -> int:
        return sum(o.status == status for o in outcomes)

    figures = {
        "sustained_rps": sustained, "rate_rps": rate, "duration_s": plan.duration_s, "deadline_s": deadline_s,
        "prompt_words": plan.prompt_words, "sent": len(outcomes), "sent_rps": len(outcomes) / plan.duration_s,
        "completed": count("completed"),
        "refused_503": len(refused), "typed_errors": count("failed") - len(refused),
        "hung": count("hung"), "broken": count("broken"),
        "late": sum(o.seconds > deadline_s + LATE_MARGIN_S and o.status != "hung" for o in outcomes),
        "admitted": len(admitted), "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
        "ttft_max_s": max(ttfts) if ttfts else None,
        "errors": sorted({o.error.split(":")[0] for o in outcomes if o.status == "failed"}),
    }
    return outcomes, figures, seconds


def format_overload(o: dict, leftovers: tuple[int, int, int]) -> str:
    """The overload scenario's table: its figures and (staged KV bytes, KV blocks held,
    ledger records) left afterwards."""
    staged, held, records = leftovers

    def s(v):
        return "-" if v is None else f"{v:.2f}"

    lines = [f"overload: {o['rate_rps']:.3f} req/s ({o['rate_rps'] / o['sustained_rps']:.1f}x the sustained "
             f"{o['sustained_rps']:.3f}; {o.get('sent_rps', 0.0):.3f} sent) for {o['duration_s']:.0f}s, "
             f"{o['prompt_words']}-word prompts, deadline {o['deadline_s']:.0f}s",
             f"{'sent':>5} {'completed':>9} {'503 refused':>11} {'typed errors':>12} {'HUNG':>5} {'LATE':>5} "
             f"{'broken':>6} {'leaked B/blk/rec':>16} {'TTFT p50 s':>10} {'TTFT p99 s':>10} {'TTFT max s':>10} {'deadline s':>10}",
             f"{o['sent']:>5} {o['completed']:>9} {o['refused_503']:>11} {o['typed_errors']:>12} {o['hung']:>5} "
             f"{o['late']:>5} {o['broken']:>6} {f'{staged}/{held}/{records}':>16} "
             f"{s(o['ttft_p50_s']):>10} {s(o['ttft_p99_s']):>10} {s(o['ttft_max_s']):>10} {o['deadline_s']:>10.0f}",
             f"errors: {', '.join(o['errors']) or 'none'} (leaked: staged KV bytes / KV blocks held / ledger records)"]
    return "\n".join(lines)
