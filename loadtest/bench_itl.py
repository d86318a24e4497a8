"""Where one stream's inter-token time goes, process by process (issue 12).

Starts a deployment as ``pdserve up`` does (1 tokenizer, prefill, decode, postfilter, gateway),
streams ``--requests`` requests of ``--tokens`` output tokens one after another, and prints per
output token:

* the client's ITL p50 and mean;
* the decode worker's engine step (``pd_decode_step_seconds``: scheduler + model + sampler)
  and the engine thread's period per token (wall time of the run / decode steps), whose
  difference is what the engine loop spends between steps;
* per process (decode, postfilter, gateway, the NATS server, this client, the idle stages):
  CPU ms per token (all threads, ``/proc/<pid>/task/*/schedstat``, nanoseconds) and ms per
  token spent runnable but waiting for a core (the same file's run-queue time): on a 2-core
  machine, what the other processes cost the decode worker is their CPU time, and a decode
  thread that waits in the run queue stalls every OpenMP barrier of its step.

``python -m loadtest.bench_itl [--tokens 256] [--requests 4]``; the NATS server at
``PD_NATS_URL`` must be local (its pid is found by its listening port) to be counted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from shared.config import Settings


def task_times(pid: int, main_only: bool = False) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting) summed over the threads of ``pid`` (its
    main thread alone with ``main_only``); (0, 0) when it is gone. Threads that exited in
    between are not counted."""
    cpu = wait = 0
    try:
        tasks = [str(pid)] if main_only else os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0, 0.0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run_ns, wait_ns, _ = f.read().split()
        except (OSError, ValueError):
            continue
        cpu += int(run_ns)
        wait += int(wait_ns)
    return cpu / 1e9, wait / 1e9


def pid_listening_on(port: int) -> int | None:
    """The pid of the process with a listening TCP socket on ``port`` (IPv4), if readable."""
    inodes = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            if parts[3] == "0A" and int(parts[1].split(":")[1], 16) == port:
                inodes.add(parts[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    return int(pid)
        except OSError:
            continue
    return None


def metric_sum_count(url: str, name: str) -> tuple[float, float]:
    """(sum, count) of a Prometheus histogram ``name`` at ``url`` (0, 0 when absent)."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    total = re.search(rf"^{name}_sum(?:{{[^}}]*}})? (\S+)$", text, re.M)
    count = re.search(rf"^{name}_count(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return (float(total.group(1)) if total else 0.0, float(count.group(1)) if count else 0.0)


def metric_buckets(url: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts ``{le: count}`` of a Prometheus histogram ``name`` at ``url``."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {float(le): float(v) for le, v in re.findall(rf'^{name}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} (\S+)$', text, re.M)}


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The upper bound of the bucket holding quantile ``q`` of the observations in between."""
    total = after.get(float("inf"), 0.0) - before.get(float("inf"), 0.0)
    for le in sorted(after):
        if after[le] - before.get(le, 0.0) >= q * total:
            return le
    return float("inf")


async def metrics_ports(settings: Settings, stages: tuple[str, ...]) -> dict[str, int]:
    """Each stage's probe port (one replica each), from their heartbeats."""
    import nats

    from shared.messages import Heartbeat, decode

    nc = await nats.connect(settings.nats_url.split(",")[0])
    ports: dict[str, int] = {}
    done = asyncio.Event()

    async def on(msg) -> None:
        hb = decode(msg.data)
        if isinstance(hb, Heartbeat):
            ports[hb.stage] = hb.metrics_port
            if len(ports) == len(stages):
                done.set()

    for stage in stages:
        await nc.subscribe(settings.protocol().heartbeat_of(stage), cb=on)
    try:
        await asyncio.wait_for(done.wait(), 30)
        return ports
    finally:
        await nc.close()


#: (label, stage, histogram): in-process hand-offs on the token path, mean per observation
HANDOFFS = (
    ("decode: engine thread -> event loop", "decode", "pd_decode_handoff_seconds"),
    ("decode: post -> publish", "decode", "pd_decode_outbox_seconds"),
    ("postfilter: handling a chunk", "postfilter", "pd_postfilter_process_seconds"),
    ("postfilter: post -> publish", "postfilter", "pd_postfilter_outbox_seconds"),
)


def run(dep, settings: Settings, name: str, tokens: int, requests: int) -> None:
    """Measure on a running deployment and print the table."""
    from loadtest.bench_http import prompt
    from loadtest.client import RequestSpec, run_workload

    ports = asyncio.run(metrics_ports(settings, ("decode", "postfilter")))
    decode_url = f"http://127.0.0.1:{ports['decode']}/metrics"

    def handoffs() -> list[tuple[float, float, dict]]:
        return [(*metric_sum_count(f"http://127.0.0.1:{ports[stage]}/metrics", name),
                 metric_buckets(f"http://127.0.0.1:{ports[stage]}/metrics", name)) for _, stage, name in HANDOFFS]
    nats_port = int(settings.nats_url.split(",")[0].rsplit(":", 1)[1])
    pids = {p.name.rsplit("-", 1)[0]: p.popen.pid for p in dep.procs}
    nats_pid = pid_listening_on(nats_port)
    if nats_pid:
        pids["nats-server"] = nats_pid
    pids["client (this)"] = os.getpid()
    specs = [RequestSpec(0.0, prompt(i + 777), tokens) for i in range(requests)]
    asyncio.run(run_workload(dep.url, name, specs[:1], concurrency=1, extra={"ignore_eos": True}, progress=False))
    print(f"measuring: {requests} requests x {tokens} tokens", flush=True)
    loop_pid = pids["decode"]
    before = {k: task_times(pid) for k, pid in pids.items()}
    loop_before = task_times(loop_pid, main_only=True)
    step_before = metric_sum_count(decode_url, "pd_decode_step_seconds")
    handoff_before = handoffs()
    load = os.getloadavg()
    results, wall = asyncio.run(run_workload(dep.url, name, specs, concurrency=1, extra={"ignore_eos": True},
                                             progress=False))
    after = {k: task_times(pid) for k, pid in pids.items()}
    loop_after = task_times(loop_pid, main_only=True)
    step_after = metric_sum_count(decode_url, "pd_decode_step_seconds")
    handoff_after = handoffs()
    ok = [r for r in results if r.ok]
    itls = [x * 1e3 for r in ok for x in r.itls]
    decode_s = sum(r.e2e_s - r.ttft_s for r in ok)  # the streaming part of each request
    n = sum(len(r.itls) for r in ok)
    steps = step_after[1] - step_before[1]
    step_ms = (step_after[0] - step_before[0]) / max(1, steps) * 1e3
    print(f"\n{len(ok)}/{requests} requests x {tokens} tokens, one at a time; load average before "
          f"{load[0]:.2f} {load[1]:.2f}, after {' '.join(f'{x:.2f}' for x in os.getloadavg()[:2])}")
    print(f"client ITL p50 {statistics.median(itls):.2f} ms, mean {statistics.mean(itls):.2f} ms, "
          f"p90 {statistics.quantiles(itls, n=10)[-1]:.2f} ms")
    per_token = decode_s / max(1, n) * 1e3
    print(f"decode engine step {step_ms:.2f} ms (mean of {steps:.0f}); streaming time per token "
          f"{per_token:.2f} ms, of which between engine steps {per_token - step_ms:.2f} ms")
    for (label, _, _), (s0, c0, b0), (s1, c1, b1) in zip(HANDOFFS, handoff_before, handoff_after):
        print(f"  {label:<40} {(s1 - s0) / max(1, c1 - c0) * 1e3:6.3f} ms mean of {c1 - c0:.0f}, p50 <= "
              f"{bucket_quantile(b0, b1, 0.5) * 1e3:g} ms, p90 <= {bucket_quantile(b0, b1, 0.9) * 1e3:g} ms")
    print(f"\n{'process':<16} {'CPU ms/token':>12} {'run-queue wait ms/token':>24}")
    per = max(1, n + len(ok))  # output tokens of the run (the run's prompts are in it too)
    total = 0.0
    rows = [(k, *before[k], *after[k]) for k in before]
    rows.insert(list(before).index("decode") + 1, ("  its event loop", *loop_before, *loop_after))
    for key, cpu0, wait0, cpu1, wait1 in rows:
        total += 0 if key.startswith(" ") else cpu1 - cpu0
        print(f"{key:<16} {(cpu1 - cpu0) / per * 1e3:>12.2f} {(wait1 - wait0) / per * 1e3:>24.2f}")
    print(f"{'all':<16} {total / per * 1e3:>12.2f}   (wall {wall / per * 1e3:.2f} ms/token, "
          f"{len(os.sched_getaffinity(0))} cores; the NATS server may serve others too)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench itl")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--threads", type=int, default=0,
                   help="PD_TORCH_THREADS for the model workers (0: the launcher's share, as pdserve up)")
    p.add_argument("--no-alone", action="store_true", help="skip the engine step measured alone afterwards")
    args = p.parse_args(argv)
    from loadtest.infra import free_port
    from services import launcher, local_infra
    from shared.model_files import served_model_name

    settings = Settings.from_env()
    name = served_model_name(settings)
    with tempfile.TemporaryDirectory() as tmp:
        s = settings.replace(namespace=f"itl{uuid.uuid4().hex[:6]}", gateway_port=free_port(),
                             torch_threads=args.threads)
        dep = launcher.up(s, {"tokenizer": 1, "prefill": 1, "decode": 1, "postfilter": 1, "gateway": 1},
                          Path(tmp), ready_timeout_s=600, quiet=True)
        try:
            started = time.monotonic()
            run(dep, s, name, args.tokens, args.requests)
            print(f"(measured in {time.monotonic() - started:.0f} s)")
        finally:
            launcher.stop_all(dep)
            local_infra.drop_namespace(s)
    if not args.no_alone:
        step_alone(s, context=256 + args.tokens // 2)
    return 0


def step_alone(settings: Settings, context: int) -> None:
    """The same engine's batch-1 decode step in this process, nothing else running in it,
    on the decode worker's thread count (``--threads``, else the launcher's share), for
    comparison with the step inside."""
    import torch

    from loadtest.bench_engine import decode_rates
    from services.launcher import torch_threads

    torch.set_num_threads(torch_threads(settings, {"prefill": 1, "decode": 1}, "decode"))
    step = decode_rates(settings.replace(torch_threads=0), [1], context, 32)[1]
    print(f"engine step alone (batch 1, context {context}, {torch.get_num_threads()} threads, median of 32): "
          f"{step * 1e3:.2f} ms; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
