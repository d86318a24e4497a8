"""Fault injection: requests under killed workers, broker and store restarts, and clients that
leave — with the three numbers that must be zero.

``pdserve chaos`` (``make chaos``) starts its own NATS and Redis servers (so it can restart
them), a deployment with two prefill and two decode replicas, computes each prompt's greedy
reference text with the engine in process, then runs the scenarios, each ``--requests``
streamed requests at ``--concurrency``:

* ``decode``: a decode worker is SIGKILLed every ``--interval`` seconds (while another is
  alive) and restarted by the supervisor; its requests continue on the other one;
* ``prefill``: the same for prefill;
* ``postfilter``: the same for a postfilter (two replicas run when this scenario is asked
  for): decode replays each orphaned stream to the live one, the gateway drops text it has;
* ``nats``: the NATS server is restarted every few seconds;
* ``redis``: the Redis server (the KV store) is restarted every few seconds;
* ``disconnect``: a third of the clients go away at a random point of their stream;
* ``overload`` (asked for by name, not in the default list): long prompts arrive open-loop at
  ``--overload-factor`` (4) times the rate the deployment sustains (measured first: long
  prompts at a concurrency of the prefill replicas) for ``--overload-duration`` (60) seconds
  (``loadtest/chaos_overload.py``): each must complete or get a typed error (most a 503 from
  admission) within its deadline, and the admitted ones' TTFT p99 stay within it;
* ``storm`` (asked for by name; ``loadtest/chaos_storm.py``): ``--storm-streams`` long-prompt
  streams all dropped within 0.5 s of their headers, then a probe timed against its idle latency;
* with ``--nats-cluster 3``: ``nats-node``, ``nats-partition``, ``nats-freeze`` and
  ``nats-partition-gateway`` (``loadtest/chaos_cluster.py``).

A fault scenario keeps sending requests (cycling through the prompts) until at least
``--min-faults`` faults have happened.

Per scenario it prints: sent, completed, failed with a clean error (an HTTP error with an
OpenAI error body, or a final SSE error event), disconnected on purpose, **hung** (no end
within the deadline plus a margin: must be 0), completed requests whose text differs from
the greedy reference (**wrong**: must be 0), broken streams (ended without [DONE] or an
error: must be 0), and what is left after the run once leases have passed: **staged KV
bytes** in the store, KV blocks still held in the workers' pools and **records in the KV
ledger** (``shared/kv/ledger.py``: handles staged and never released or reclaimed) — all must be 0.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loadtest.chaos_client import Outcome, one_request, run_load  # noqa: F401 (re-exported)
from loadtest.chaos_cluster import CLUSTER_SCENARIOS, cluster_fault, make_nats
from loadtest.chaos_storm import SCENARIO as STORM
from loadtest.chaos_storm import StormRow, format_storm, run_storm
from loadtest.infra import NatsServer, RedisServer, free_port
from shared.config import Settings

SCENARIOS = ("decode", "prefill", "nats", "redis", "disconnect", "postfilter")
#: Scenarios run only when named (``--scenarios overload``).
EXTRA_SCENARIOS = ("overload",)
TOPICS = ["rivers", "the sea", "mountains", "a small robot", "bread", "winter", "trains", "music", "bees", "clocks"]


def make_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = " ".join(rng.choice(TOPICS) for _ in range(rng.randrange(1, 12)))
        out.append(f"Request {i}: write about {words}.")
    return out


class Faults(threading.Thread):
    """Injects one kind of fault every ``interval_s`` until stopped."""

    def __init__(self, kind: str, dep, nats: NatsServer, redis: RedisServer, interval_s: float, seed: int):
        super().__init__(daemon=True)
        self.kind, self.dep, self.nats, self.redis = kind, dep, nats, redis
        self.interval_s = interval_s
        self.rng = random.Random(seed)
        self.stop_event = threading.Event()
        self.count = 0

    def run(self) -> None:
        import os
        import signal

        while not self.stop_event.wait(self.interval_s):
            if self.kind in ("decode", "prefill", "postfilter"):
                procs = [p for p in self.dep.procs if p.name.startswith(self.kind) and p.popen.poll() is None]
                # kill one only while another replica that has been up a while survives it:
                # failover, not outage (a replica still loading its model is not a survivor)
                settled = [p for p in procs if time.monotonic() - p.started_at > 8]
                victims = [p for p in procs if any(q is not p for q in settled)]
                if victims:
                    victim = self.rng.choice(victims)
                    os.kill(victim.popen.pid, signal.SIGKILL)
                    self.count += 1
            elif self.kind == "nats":
                self.nats.restart(down_s=1.0)
                self.count += 1
            elif self.kind == "redis":
                self.redis.restart(down_s=0.5)
                self.count += 1
            elif self.kind in CLUSTER_SCENARIOS:
                cluster_fault(self.kind, self.nats, self.rng)
                self.count += 1

    def stop(self) -> None:
        self.stop_event.set()
        self.join(30)


class SupervisorThread(threading.Thread):
    def __init__(self, supervisor):
        super().__init__(daemon=True)
        self.supervisor = supervisor
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(0.25):
            self.supervisor.poll()


@dataclass
class Row:
    scenario: str
    faults: int
    outcomes: list[Outcome] = field(default_factory=list)
    wrong: int = 0
    wrong_examples: list = field(default_factory=list)
    staged_bytes: int = 0
    blocks_held: int = 0
    ledger_entries: int = 0
    seconds: float = 0.0
    overload: dict | None = None  # the overload scenario's figures (loadtest/chaos_overload.py)

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)


def references(url: str, model: str, prompts: list[str], max_tokens: int, hang_s: float) -> list[str]:
    """Greedy texts of each prompt sent alone to the deployment before any fault, in the default
    dtype: with batch-invariant numerics (``PD_BATCH_INVARIANT``) a request's tokens do not depend
    on its batch, a prefix hit or the worker that resumes it, so every run under faults must
    give exactly these. (The engine is checked against transformers in float32 in the suite.)

    Raises:
        RuntimeError: a reference request did not complete.
    """
    results = sorted(asyncio.run(run_load(url, model, prompts, 1, max_tokens, 0.0, hang_s, seed=0)), key=lambda r: r[0])
    failed = [o for _, o in results if o.status != "completed"]
    if failed:
        raise RuntimeError(f"reference run without faults failed: {failed[0]}")
    return [o.text for _, o in results]


def measure_leftovers(dep, settings: Settings, wait_s: float) -> tuple[int, int, int]:
    """(staged KV bytes, KV blocks held by prefill and decode workers, records in the KV
    ledger) once the run has settled: polled each second until all read zero twice in a row, at
    most ``wait_s`` + 15 s (the store reaps blocks whose TTL ran out; the prefill workers'
    reapers reconcile the ledger); the last reading otherwise."""
    from shared.kv import open_store
    from shared.kv.ledger import ledger_for
    from shared.observe import collect_heartbeats, scrape_metric

    def held_blocks() -> int:
        held = 0
        for hb in collect_heartbeats(settings).values():
            if hb.stage in ("prefill", "decode") and hb.metrics_port:
                held += int(scrape_metric(hb.metrics_port, f"pd_{hb.stage}_kv_blocks_used"))
        return held

    store = open_store(settings)
    ledger = ledger_for(store)
    end, zeros = time.monotonic() + wait_s + 15, 0
    try:
        while True:
            store.reap()
            staged, held, records = store.staged_bytes(), held_blocks(), len(ledger.entries())
            zeros = zeros + 1 if staged == 0 and held == 0 and records == 0 else 0
            if zeros >= 2 or time.monotonic() >= end:
                return staged, held, records
            time.sleep(1.0)
    finally:
        store.close()


def run_chaos(model: str, requests: int, concurrency: int, max_tokens: int, scenarios: list[str],
              interval_s: float, min_faults: int = 3, quiet: bool = False, workdir: Path | None = None,
              nats_nodes: int = 1, time_scale: float = 1.0, overload=None, storm_streams: int = 100,
              storm_prompt_tokens: int = 3500, storm_max_tokens: int = 64) -> list[Row | StormRow]:
    """Run the scenarios; returns one row each (also used by the CI test): a :class:`StormRow`
    for the ``storm`` scenario (``storm_streams`` streams of ~``storm_prompt_tokens`` tokens,
    ``loadtest/chaos_storm.py``), a :class:`Row` for the others. ``nats_nodes`` > 1:
    on a local NATS cluster of that many nodes, with stream replicas min(3, nodes).
    ``time_scale`` multiplies the requests' time limits (request, first-token and stall
    timeouts, and so the hang margin) on a machine slower or busier than a developer's.
    ``overload``: the overload scenario's :class:`~loadtest.chaos_overload.OverloadPlan`
    (default: its defaults)."""
    from loadtest.chaos_overload import OverloadPlan, run_overload
    from services import launcher
    from shared.model_files import served_model_name

    tmp_ctx = tempfile.TemporaryDirectory() if workdir is None else None
    root = Path(tmp_ctx.name) if tmp_ctx else workdir
    nats = make_nats(root / "nats", nats_nodes)
    redis = RedisServer(root / "redis")
    nats.start()
    redis.start()
    settings = Settings.from_env(
        model=model, namespace=f"chaos{uuid.uuid4().hex[:6]}", nats_url=nats.url, redis_url=redis.url,
        nats_replicas=min(3, nats_nodes), kv_store="redis", kv_block_ttl_s=5.0, kv_tail_ttl_s=5.0,
        request_timeout_s=120.0 * time_scale, stall_timeout_s=20.0 * time_scale,
        first_token_timeout_s=60.0 * time_scale, stage_down_grace_s=30.0, heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0,
        ack_wait_s=3.0, gateway_port=free_port(), kv_cache_memory_bytes=256 << 20,
        max_queue_time_s=(overload or OverloadPlan()).max_queue_time_s * time_scale,
    )
    name = served_model_name(settings)
    prompts = make_prompts(requests)
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    replicas = {"tokenizer": 1, "prefill": 2, "decode": 2, "postfilter": 1, "gateway": 1}
    if "postfilter" in scenarios:
        replicas["postfilter"] = 2  # a killed one fails over to the other
    dep = launcher.up(settings, replicas, root / "state", ready_timeout_s=600, quiet=True)
    sup = SupervisorThread(launcher.Supervisor(dep))
    sup.start()
    rows = []
    hang_s = settings.request_timeout_s + 30
    try:
        expected = []
        if any(s != STORM for s in scenarios):
            say(f"chaos: reference texts for {requests} prompts ({name}, {max_tokens} tokens, greedy, alone) ...")
            expected = references(dep.url, name, prompts, max_tokens, hang_s)
        for k, scenario in enumerate(scenarios):
            say(f"chaos: scenario {scenario} ...")
            if scenario == "overload":
                outcomes, figures, seconds = run_overload(dep.url, name, settings, overload or OverloadPlan(), seed=k,
                                                          say=say)
                row = Row("overload", 0, outcomes, seconds=seconds, overload=figures)
                wait_ready(dep.url, 120)
                row.staged_bytes, row.blocks_held, row.ledger_entries = measure_leftovers(
                    dep, settings, settings.kv_block_ttl_s + 3)
                rows.append(row)
                say(format_rows([row], header=False))
                continue
            if scenario == STORM:
                storm = run_storm(dep, settings, name, storm_streams, storm_prompt_tokens,
                                  lambda: measure_leftovers(dep, settings, settings.kv_block_ttl_s + 3),
                                  max_tokens=storm_max_tokens, seed=k, say=say)
                rows.append(storm)
                say(format_storm([storm]))
                continue
            faults = Faults(scenario, dep, nats, redis, interval_s, seed=k)
            started = time.monotonic()
            if scenario != "disconnect":
                faults.start()
            leave = 1 / 3 if scenario == "disconnect" else 0.0
            needs_faults = scenario != "disconnect"
            results = asyncio.run(run_load(dep.url, name, prompts, concurrency, max_tokens, leave, hang_s, seed=k,
                                           keep_going=lambda f=faults, n=needs_faults: n and f.count < min_faults))
            if needs_faults:
                faults.stop()
            outcomes = [o for _, o in results]
            row = Row(scenario, faults.count, outcomes, seconds=time.monotonic() - started)
            row.wrong_examples = [(i, o) for i, o in results if o.status == "completed" and o.text != expected[i]]
            row.wrong = len(row.wrong_examples)
            wait_ready(dep.url, 120)
            row.staged_bytes, row.blocks_held, row.ledger_entries = measure_leftovers(
                dep, settings, settings.kv_block_ttl_s + 3)
            rows.append(row)
            say(format_rows([row], header=False))
    finally:
        sup.stop_event.set()
        launcher.stop_all(dep)
        nats.stop()
        redis.stop()
        if tmp_ctx:
            tmp_ctx.cleanup()
    return rows


def wait_ready(url: str, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if httpx.get(f"{url}/health/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def format_rows(rows: list[Row], header: bool = True) -> str:
    lines = []
    if header:
        lines.append(f"{'scenario':<11} {'faults':>6} {'sent':>5} {'completed':>9} {'failed clean':>12} "
                     f"{'left':>5} {'HUNG':>5} {'WRONG':>6} {'broken':>6} {'staged KV B':>11} {'blocks held':>11} "
                     f"{'ledger':>6} {'s':>6}")
    for r in rows:
        lines.append(f"{r.scenario:<11} {r.faults:>6} {len(r.outcomes):>5} {r.count('completed'):>9} "
                     f"{r.count('failed'):>12} {r.count('disconnected'):>5} {r.count('hung'):>5} {r.wrong:>6} "
                     f"{r.count('broken'):>6} {r.staged_bytes:>11} {r.blocks_held:>11} {r.ledger_entries:>6} "
                     f"{r.seconds:>6.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve chaos")
    p.add_argument("--model", default="", help="local HF folder; default: SmolLM2-135M-Instruct")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--interval", type=float, default=4.0, help="seconds between faults")
    p.add_argument("--min-faults", type=int, default=3, help="keep sending requests until this many faults")
    p.add_argument("--scenarios", default="",
                   help=f"default: {','.join(SCENARIOS)}; with --nats-cluster: {','.join(CLUSTER_SCENARIOS)}; "
                        f"also: {','.join((*EXTRA_SCENARIOS, STORM))}")
    p.add_argument("--overload-duration", type=float, default=60.0, help="overload: seconds of arrivals")
    p.add_argument("--overload-factor", type=float, default=4.0, help="overload: times the sustained rate")
    p.add_argument("--overload-rate", type=float, default=0.0,
                   help="overload: arrivals per second (default: the factor times the measured sustained rate)")
    p.add_argument("--overload-prompt-words", type=int, default=1500, help="overload: words per long prompt")
    p.add_argument("--overload-max-queue-time", type=float, default=20.0,
                   help="overload: PD_MAX_QUEUE_TIME_S of the deployment (x --time-scale)")
    p.add_argument("--nats-cluster", type=int, default=1, metavar="N", help="run on a local N-node NATS cluster")
    p.add_argument("--workdir", default="", help="keep the servers' and services' logs here (default: a temp dir)")
    p.add_argument("--storm-streams", type=int, default=100, help="storm: concurrent long-prompt streams")
    p.add_argument("--storm-prompt-tokens", type=int, default=3500, help="storm: tokens per prompt (about)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply the requests' time limits (120 s request, 60 s first token, 20 s stall)")
    args = p.parse_args(argv or [])
    scenarios = args.scenarios or ",".join(CLUSTER_SCENARIOS if args.nats_cluster > 1 else SCENARIOS)
    from loadtest.chaos_overload import OverloadPlan, format_overload

    plan = OverloadPlan(duration_s=args.overload_duration, factor=args.overload_factor, rate=args.overload_rate,
                        prompt_words=args.overload_prompt_words, max_queue_time_s=args.overload_max_queue_time)
    rows = run_chaos(args.model, args.requests, args.concurrency, args.max_tokens,
                     [s for s in scenarios.split(",") if s], args.interval, args.min_faults, nats_nodes=args.nats_cluster,
                     workdir=Path(args.workdir) if args.workdir else None, time_scale=args.time_scale, overload=plan,
                     storm_streams=args.storm_streams, storm_prompt_tokens=args.storm_prompt_tokens)
    storms = [r for r in rows if isinstance(r, StormRow)]
    rows = [r for r in rows if not isinstance(r, StormRow)]
    print()
    if rows:
        print(format_rows(rows))
    if storms:
        print(format_storm(storms))
    for r in rows:
        if r.overload is not None:
            print()
            print(format_overload(r.overload, (r.staged_bytes, r.blocks_held, r.ledger_entries)))
    for r in rows:
        for o in r.outcomes:
            if o.status in ("failed", "broken", "hung") and o.error_type != "overloaded":
                print(f"  {r.scenario}: {o.status}: {o.error}")
        for i, o in r.wrong_examples[:3]:
            print(f"  {r.scenario}: wrong text for prompt {i}: {o.text[:120]!r}")
    bad = sum(r.count("hung") + r.wrong + r.count("broken") + r.staged_bytes + r.blocks_held + r.ledger_entries
              + (r.overload or {}).get("late", 0) for r in rows)
    bad += sum(not r.is_clean for r in storms)
    return 1 if bad else 0
