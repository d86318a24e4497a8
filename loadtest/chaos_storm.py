"""The cancellation-storm scenario of ``pdserve chaos`` (issue 30): many long-prompt streams
whose clients all leave, then an ordinary request.

``streams`` concurrent streamed chat requests (default 100), each with its own prompt of about
``prompt_tokens`` tokens (default 3,500; distinct from the first token on, so no prefix is
shared), are each dropped by their client within ``drop_within_s`` (0.5 s) of the response's
first bytes (its headers). As soon as the last one is dropped, a probe — a short prompt, 4
tokens, greedy — is sent and timed against the same probe's latency on the idle deployment
measured just before the storm. Issue 30's target: answered within 2x its idle latency, no
later than 2 s after the last cancel; cancelled work computes at most one prefill chunk.

Reported: the probe's latency, its ratio to the idle latency, seconds from the last cancel to
the probe's answer (and, probing on one after another, to the answer of the first probe within
2x the idle latency), prefill chunks computed for cancelled requests (all of them, and those
computed after the cancel reached the prefill worker), the work of cancelled requests each
stage dropped or stopped (``pd_cancelled_total``), and what is left once the run settled:
staged KV bytes, KV blocks held, and requests still held by prefill and decode workers (all
three must be 0).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

from shared.config import Settings

SCENARIO = "storm"
PROBE_PROMPT = "Say hello."
PROBE_MAX_TOKENS = 4
#: Longest the storm keeps probing, after the last cancel, for a probe within 2x its idle latency.
RECOVERY_WAIT_S = 60.0
WORDS = ("river", "stone", "lantern", "orchard", "copper", "harbor", "meadow", "signal", "winter", "thread",
         "garden", "engine", "violet", "summit", "compass", "ember", "canyon", "pillow", "marble", "falcon")


@dataclass
class StormRow:
    """One storm's figures (see the module docstring)."""

    streams: int
    prompt_tokens: int
    idle_s: float = 0.0
    probe_s: float = 0.0
    probe_ok: bool = False
    probe_error: str = ""
    after_last_cancel_s: float = 0.0
    recovered_after_s: float = float("nan")  # the first probe within 2x idle: its answer, after the last cancel
    storm_s: float = 0.0
    cancelled_clients: int = 0
    other_outcomes: dict = field(default_factory=dict)
    chunks_cancelled: float = 0.0
    chunks_after_cancel: float = 0.0
    dropped_by_stage: dict = field(default_factory=dict)
    staged_bytes: int = 0
    blocks_held: int = 0
    requests_held: int = 0
    ledger_entries: int = 0

    @property
    def ratio(self) -> float:
        return self.probe_s / self.idle_s if self.idle_s else float("inf")

    @property
    def is_clean(self) -> bool:
        """The probe was answered and nothing is left staged or held."""
        return (self.probe_ok and self.staged_bytes == 0 and self.blocks_held == 0 and self.requests_held == 0
                and self.ledger_entries == 0)


def storm_prompts(client: httpx.Client, model: str, n: int, num_tokens: int, seed: int) -> list[str]:
    """``n`` distinct prompts of about ``num_tokens`` tokens each (sized with the gateway's
    ``/tokenize``); each starts with its own number so no two share a prefix block."""
    rng = random.Random(seed)

    def text(i: int, num_words: int) -> str:
        body = " ".join(rng.choice(WORDS) for _ in range(num_words))
        return f"Story {i} of {n}, {rng.getrandbits(32):08x}: {body}. Summarise it."

    def count(prompt: str) -> int:
        resp = client.post("/tokenize", json={"model": model, "messages": [{"role": "user", "content": prompt}]})
        resp.raise_for_status()
        return resp.json()["count"]

    per_word = count(text(0, 1000)) / 1000
    num_words = max(1, int(num_tokens / per_word))
    return [text(i, num_words) for i in range(n)]


def probe_once(client: httpx.Client, model: str) -> tuple[float, str]:
    """(seconds, error or "") of one probe request."""
    body = {"model": model, "messages": [{"role": "user", "content": PROBE_PROMPT}], "max_tokens": PROBE_MAX_TOKENS,
            "temperature": 0}
    started = time.monotonic()
    try:
        resp = client.post("/v1/chat/completions", json=body)
    except httpx.HTTPError as exc:
        return time.monotonic() - started, f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - started
    return seconds, "" if resp.status_code == 200 else f"{resp.status_code}: {resp.text[:200]}"


async def _storm(url: str, model: str, prompts: list[str], drop_within_s: float, max_tokens: int,
                 hang_s: float, seed: int) -> tuple[list[str], list[float]]:
    """Open every stream at once; each client leaves at a random moment within
    ``drop_within_s`` of its response's headers. Returns each stream's outcome and the
    monotonic times of the drops."""
    rng = random.Random(seed)
    drops: list[float] = []
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(hang_s, connect=30), limits=limits) as client:
        async def one(prompt: str) -> str:
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            try:
                async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                    if resp.status_code != 200:
                        await resp.aread()
                        return f"http {resp.status_code}"
                    await asyncio.sleep(rng.uniform(0, drop_within_s))
                # leaving the block unread closes the connection: the client is gone
                drops.append(time.monotonic())
                return "cancelled"
            except httpx.HTTPError as exc:
                return type(exc).__name__

        outcomes = await asyncio.gather(*(one(p) for p in prompts))
    return list(outcomes), drops


def _worker_sum(settings: Settings, name: str, labels: str = "", stages=("prefill",)) -> float:
    from shared.observe import collect_heartbeats, scrape_metric

    total = 0.0
    for hb in collect_heartbeats(settings).values():
        if hb.stage in stages and hb.metrics_port:
            total += scrape_metric(hb.metrics_port, name, labels)
    return total


def _requests_held(settings: Settings) -> int:
    from shared.observe import collect_heartbeats

    return sum(hb.num_running for hb in collect_heartbeats(settings).values() if hb.stage in ("prefill", "decode"))


def run_storm(dep, settings: Settings, model: str, streams: int, prompt_tokens: int, leftovers,
              drop_within_s: float = 0.5, max_tokens: int = 64, seed: int = 0, say=print) -> StormRow:
    """Run one storm against a running deployment (``dep.url``); returns its row.

    ``leftovers()``: (staged KV bytes, KV blocks held, KV ledger records) once the run has settled
    (:func:`loadtest.chaos.measure_leftovers`).
    """
    row = StormRow(streams=streams, prompt_tokens=prompt_tokens)
    hang_s = settings.request_timeout_s + 30
    with httpx.Client(base_url=dep.url, timeout=hang_s) as client:
        prompts = storm_prompts(client, model, streams, prompt_tokens, seed)
        idle = [probe_once(client, model) for _ in range(5)]
        errors = [e for _, e in idle if e]
        if errors:
            raise RuntimeError(f"the idle probe failed: {errors[0]}")
        row.idle_s = statistics.median(s for s, _ in idle[2:])  # the first ones warm up
        stages = ("tokenizer", "prefill", "decode")
        before = {s: _worker_sum(settings, "pd_cancelled_total", f'stage="{s}"', stages) for s in stages}
        chunks_before = (_worker_sum(settings, "pd_prefill_cancelled_chunks_total"),
                         _worker_sum(settings, "pd_prefill_cancelled_chunks_total", 'when="after_cancel"'))
        say(f"chaos: storm of {streams} streams of ~{prompt_tokens} tokens (idle probe {row.idle_s:.2f}s) ...")
        started = time.monotonic()
        outcomes, drops = asyncio.run(_storm(dep.url, model, prompts, drop_within_s, max_tokens, hang_s, seed))
        last_cancel = max(drops) if drops else time.monotonic()
        row.probe_s, row.probe_error = probe_once(client, model)
        row.probe_ok = not row.probe_error
        row.after_last_cancel_s = time.monotonic() - last_cancel
        seconds, error = row.probe_s, row.probe_error
        while not (not error and seconds <= 2 * row.idle_s) and time.monotonic() - last_cancel < RECOVERY_WAIT_S:
            seconds, error = probe_once(client, model)  # one after another until one is within 2x idle
        if not error and seconds <= 2 * row.idle_s:
            row.recovered_after_s = time.monotonic() - last_cancel
        row.storm_s = last_cancel - started
    row.cancelled_clients = outcomes.count("cancelled")
    for o in outcomes:
        if o != "cancelled":
            row.other_outcomes[o] = row.other_outcomes.get(o, 0) + 1
    time.sleep(2.0)  # the last aborts reach every worker
    row.chunks_cancelled = _worker_sum(settings, "pd_prefill_cancelled_chunks_total") - chunks_before[0]
    row.chunks_after_cancel = (_worker_sum(settings, "pd_prefill_cancelled_chunks_total", 'when="after_cancel"')
                               - chunks_before[1])
    row.dropped_by_stage = {s: _worker_sum(settings, "pd_cancelled_total", f'stage="{s}"', stages) - before[s]
                            for s in stages}
    row.staged_bytes, row.blocks_held, row.ledger_entries = leftovers()
    row.requests_held = _requests_held(settings)
    return row


def format_storm(rows: list[StormRow]) -> str:
    lines = [f"{'streams':>7} {'~tokens':>7} {'idle s':>7} {'probe s':>7} {'x idle':>6} {'after last cancel s':>19} "
             f"{'<=2x idle at s':>14} "
             f"{'storm s':>7} {'left':>5} {'chunks cancelled':>16} {'after cancel':>12} {'dropped tok/pre/dec':>19} "
             f"{'staged KV B':>11} {'blocks held':>11} {'held':>4}"]
    for r in rows:
        dropped = "/".join(str(int(r.dropped_by_stage.get(s, 0))) for s in ("tokenizer", "prefill", "decode"))
        lines.append(f"{r.streams:>7} {r.prompt_tokens:>7} {r.idle_s:>7.2f} {r.probe_s:>7.2f} {r.ratio:>6.1f} "
                     f"{r.after_last_cancel_s:>19.2f} {r.recovered_after_s:>14.2f} {r.storm_s:>7.1f} {r.cancelled_clients:>5} "
                     f"{r.chunks_cancelled:>16.0f} {r.chunks_after_cancel:>12.0f} {dropped:>19} "
                     f"{r.staged_bytes:>11} {r.blocks_held:>11} {r.requests_held:>4}")
        if r.other_outcomes or r.probe_error:
            lines.append(f"  other outcomes: {r.other_outcomes}; probe: {r.probe_error or 'ok'}")
    return "\n".join(lines)
