"""``pdserve simulate``: replay a trace through one topology and print its latencies.

``pdserve simulate --profile FILE [--trace azure-conv] [--requests N] [--rate R]
[--mode aggregated|disaggregated|conditional] [--workers N | --prefill P --decode D]
[--host-cores C --workers-per-host W] [--kv-store shm|redis|network]
[--role prefill.max_prefill_chunk_tokens=4096 --role decode.max_num_seqs=32] [--json]``

``pdserve simulate sweep [--out docs/scale.json]``: the crossover map (:mod:`sim.sweep`).
"""

from __future__ import annotations

import argparse
import json

from sim.plan import bad_argument, load_trace
from sim.profile import Profile
from sim.simulator import Topology, simulate
from sim.trace import repeat


def table(rows: dict[str, dict]) -> str:
    """Markdown table of simulated summaries (milliseconds)."""
    out = ["| topology | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | ITL p90 ms | ITL p99 ms | TPOT p90 ms | goodput req/s | sim req/wall-s |",
           "|---|---|---|---|---|---|---|---|---|"]
    for name, s in rows.items():
        out.append(f"| {name} | {s['ttft']['p50'] * 1e3:.0f} | {s['ttft']['p90'] * 1e3:.0f} | {s['itl']['p50'] * 1e3:.1f} | "
                   f"{s['itl']['p90'] * 1e3:.1f} | {s['itl']['p99'] * 1e3:.1f} | {s['tpot']['p90'] * 1e3:.1f} | "
                   f"{s['goodput_rps']:.2f} | {s['sim_requests_per_wall_s']:.0f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    if argv and argv[0] == "sweep":  # pdserve simulate sweep: the crossover map (sim/sweep.py)
        from sim.sweep import main as sweep_main

        return sweep_main(argv[1:])
    p = argparse.ArgumentParser(prog="pdserve simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True)
    p.add_argument("--trace", default="azure-conv")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--rate", type=float, default=0.0)
    p.add_argument("--mode", default="aggregated", choices=("aggregated", "disaggregated", "conditional"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--host-cores", type=int, default=0)
    p.add_argument("--workers-per-host", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=0)
    p.add_argument("--local-max-tokens", type=int, default=256)
    p.add_argument("--max-prompt", type=int, default=8192)
    p.add_argument("--max-output", type=int, default=2048)
    p.add_argument("--slo-ttft", type=float, default=5.0)
    p.add_argument("--slo-tpot", type=float, default=0.25)
    p.add_argument("--repeat", type=int, default=1, help="play the trace this many times back to back")
    p.add_argument("--kv-store", default="", choices=("", "shm", "redis", "network"),
                   help="the KV hand-off's store (default: the profile's)")
    p.add_argument("--role", action="append", default=[], metavar="ROLE.SETTING=N",
                   help="a per-role engine setting, e.g. prefill.max_prefill_chunk_tokens=4096 or "
                        "decode.max_num_seqs=32 (repeatable)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv or [])
    bad = bad_argument(args)
    if bad:
        print(f"pdserve simulate: {bad}")
        return 2
    try:
        profile = Profile.load(args.profile)
        reqs = load_trace(args.trace, args.requests, args.max_prompt, args.max_output, args.rate)
        reqs = repeat(reqs, args.repeat)
    except (OSError, ValueError) as exc:
        print(f"pdserve simulate: {exc}")
        return 2
    except (AttributeError, TypeError):  # JSON, but not an object of a profile's fields
        print(f"pdserve simulate: {args.profile} is not a profile file")
        return 2
    roles: dict = {}
    for spec in args.role:
        key, _, value = spec.partition("=")
        role, _, setting = key.partition(".")
        if role not in ("prefill", "decode") or not setting or not value.isdigit() or int(value) < 1:
            print(f"pdserve simulate: --role {spec!r}: ROLE.SETTING=N with ROLE prefill or decode and N >= 1")
            return 2
        roles.setdefault(role, {})[setting] = int(value)
    topo = Topology(mode=args.mode, workers=args.workers, prefill=args.prefill, decode=args.decode,
                    host_cores=args.host_cores, workers_per_host=args.workers_per_host, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens, max_prefill_chunk_tokens=args.chunk,
                    local_max_tokens=args.local_max_tokens, kv_store=args.kv_store, roles=roles)
    try:
        s = simulate(reqs, topo, profile, args.slo_ttft, args.slo_tpot)
    except ValueError as exc:  # a store the profile has no figures for, an unknown role setting
        print(f"pdserve simulate: {exc}")
        return 2
    if args.json:
        print(json.dumps(s, indent=1))
    else:
        print(table({topo.label(): s}))
        print(f"{s['requests']} requests, {s['sim_seconds']:.0f} simulated s in {s['wall_seconds']:.1f} wall s "
              f"({s['cpu_seconds']:.1f} CPU s: {s['sim_requests_per_cpu_s']:.0f} requests per CPU second); "
              f"utilization {', '.join(f'{k} {v:.2f}' for k, v in s['utilization'].items())}")
        if s["ttft"]["p50"] > 10 * args.slo_ttft:
            print(f"overloaded: median TTFT {s['ttft']['p50']:.0f} s is over 10x the TTFT SLO ({args.slo_ttft} s): "
                  "this topology cannot keep up with the offered rate and its queues grow for the whole run; "
                  "try a lower --rate, more workers, or `pdserve plan`")
    return 0
