"""``pdserve plan``: the fewest model workers whose requests meet their SLOs, for a trace at
a given load, found by simulating candidate topologies (:mod:`sim.simulator`).

``pdserve plan --profile FILE --trace azure-conv --rate 20 --slo-ttft 2 --slo-tpot 0.05
[--attainment 0.9] [--slo-itl 0.1 --percentile 90] [--requests N]
[--modes aggregated,disaggregated,conditional] [--max-workers 64] [--emit k8s --out DIR]``

What counts is each request's own experience (DistServe's SLO attainment, Zhong et al., OSDI
2024): a request meets its SLOs when its TTFT is within ``--slo-ttft`` and its time per output
token (TPOT: (last token − first token) / (output tokens − 1)) within ``--slo-tpot``; a
deployment meets them when at least ``--attainment`` of the requests do (and all finish).
``--slo-itl`` adds a bound on the fleet's pooled inter-token gaps at ``--percentile``, for
operators who watch that number too.

Search: every worker count ``N`` from a lower bound (the trace's compute demand over one
worker's capacity) upwards, one at a time; at each, aggregated ×N and, for the split modes,
the prefill shares ``P`` next to the trace's prefill share of compute (``P`` ∈ {⌊fN⌋−1 …
⌈fN⌉+1}). The first ``N`` where a candidate meets the SLOs wins; among its candidates the
highest attainment wins, then the lowest ITL at ``--percentile`` (ties: aggregated, then
conditional). :func:`exhaustive` tries every ``N`` and every split, the reference the planner
is tested against (``tests/unit/test_sim.py``). Dynamo's SLA planner sizes prefill and decode
separately from the same two interpolations (NVIDIA Dynamo, ``docs/architecture/sla_planner.md``);
here the split is searched with the whole pipeline simulated, so queueing, KV hand-offs and
the conditional router count.

``--hardware FILE:COST`` (repeatable) plans heterogeneous pools instead (:mod:`sim.pools`): each
option is a profile (one GPU kind at one tensor-parallel degree — give one per degree to search
TP) and a cost per worker-hour; the answer is the cheapest deployment meeting the SLOs, prefill
and decode hardware, pool sizes and per-role engine settings (chunk size, max_num_seqs) chosen.

The predicted percentiles are printed with the simulator's error band where one was measured
out of sample; none has been yet, so each is marked unvalidated.

``--emit k8s`` writes a kustomize overlay of ``infra/k8s``: the replica counts, the routing
settings and KEDA ScaledObjects whose ``minReplicaCount`` holds the plan and whose
``lagThreshold`` is the work one worker clears within the TTFT SLO.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from sim import trace as traces
from sim.metrics import meets_slos
from sim.profile import CostModel, Profile
from sim.simulator import Topology, simulate
from sim.trace import Scaling


def load_trace(name: str, n: int, max_prompt: int, max_output: int, rate: float = 0.0, seed: int = 0):
    """``azure-conv``, ``azure-code``, ``mooncake`` or ``poisson:LEN:W,LEN:W`` as
    :class:`~sim.trace.SimRequest` s; arrivals rescaled to ``rate`` req/s when given.

    Raises:
        ValueError: an unknown trace name.
    """
    sc = Scaling(1.0, max_prompt, max_output, block_tokens=64)
    if name in ("azure-conv", "azure-code"):
        reqs = traces.azure(f"azure2023_{name.split('-')[1]}.csv", n, sc)
    elif name == "mooncake":
        reqs = traces.mooncake("mooncake_conversation.jsonl", n, sc)
    elif name.startswith("poisson"):
        mix = [(int(a), float(b)) for a, b in (x.split(":") for x in (name.partition(":")[2] or "128:0.8,1024:0.2").split(","))]
        if any(a < 1 or not 0 <= b < math.inf for a, b in mix):
            raise ValueError("lengths must be at least 1 and weights non-negative")
        return traces.synthetic(n, rate or 1.0, mix, max_output, seed=seed)
    else:
        raise ValueError(f"unknown trace {name!r} (azure-conv, azure-code, mooncake, poisson:LEN:W,...)")
    return traces.rescale(reqs, rate) if rate else reqs


def prefill_share(reqs, cost: CostModel, batch: int = 32) -> float:
    """Fraction of the trace's compute that is prefill (decode counted at batch ``batch``)."""
    pre = sum(cost.prefill_whole(r.prompt_tokens) for r in reqs)
    dec = sum(r.max_tokens * cost.decode_step(batch, batch * 600) / batch for r in reqs)
    return pre / max(pre + dec, 1e-12)


def lower_bound(reqs, cost: CostModel, batch: int = 32) -> int:
    if len(reqs) < 2:
        return 1
    span = max(reqs[-1].arrival_s - reqs[0].arrival_s, 1e-9)
    pre = sum(cost.prefill_whole(r.prompt_tokens) for r in reqs)
    dec = sum(r.max_tokens * cost.decode_step(batch, batch * 600) / batch for r in reqs)
    return max(1, math.floor((pre + dec) / span))


def candidates(n: int, share: float, modes: list[str], base: dict) -> list[Topology]:
    out = []
    if "aggregated" in modes:
        out.append(Topology(mode="aggregated", workers=n, **base))
    if n >= 2:
        ps = sorted({p for p in (math.floor(share * n) - 1, math.floor(share * n), math.ceil(share * n),
                                 math.ceil(share * n) + 1) if 1 <= p <= n - 1})
        for mode in ("conditional", "disaggregated"):
            if mode in modes:
                out += [Topology(mode=mode, prefill=p, decode=n - p, **base) for p in ps]
    return out


def plan(reqs, profile: Profile, slo_ttft: float, slo_tpot: float, *, attainment: float = 0.9,
         slo_itl: float | None = None, percentile: int = 90, max_workers: int = 64,
         modes=("aggregated", "disaggregated", "conditional"), base: dict | None = None, say=print) -> dict:
    """Search (see module doc). SLOs in seconds; ``attainment`` a fraction.

    Returns:
        ``{"best": (Topology, summary) or None, "tried": [(Topology, summary, meets), ...],
        "prefill_share": float}``; every ``N`` from the lower bound to the answer is in ``tried``.
    """
    cost = CostModel(profile)
    share = prefill_share(reqs, cost)
    base = base or {}
    key = f"p{percentile}"
    tried = []
    for n in range(lower_bound(reqs, cost), max_workers + 1):
        ok = []
        for topo in candidates(n, share, list(modes), base):
            s = simulate(reqs, topo, profile, slo_ttft, slo_tpot)
            meets = meets_slos(s, slo_ttft, slo_tpot, attainment, slo_itl, percentile)
            tried.append((topo, s, meets))
            itl = s["itl"][key]
            say(f"plan: {topo.label():28s} attainment {s['slo_attainment'] * 100:5.1f}%  TTFT {key} "
                f"{s['ttft'][key] or float('nan'):8.3f}s  TPOT {key} {(s['tpot'][key] or 0) * 1e3:7.1f}ms  "
                f"ITL {key} {(itl or 0) * 1e3:7.1f}ms  {'meets' if meets else '-'}")
            if meets:
                ok.append((topo, s))
        if ok:
            order = {"aggregated": 0, "conditional": 1, "disaggregated": 2}
            best = min(ok, key=lambda ts: (-round(ts[1]["slo_attainment"], 4), round(ts[1]["itl"][key] or 0, 4),
                                           order[ts[0].mode]))
            return {"best": best, "tried": tried, "prefill_share": share}
    return {"best": None, "tried": tried, "prefill_share": share}


def exhaustive(reqs, profile: Profile, slo_ttft: float, slo_tpot: float, *, attainment: float = 0.9,
               slo_itl: float | None = None, percentile: int = 90, max_workers: int = 64,
               modes=("aggregated", "disaggregated", "conditional"), base: dict | None = None
               ) -> tuple[Topology, dict] | None:
    """The cheapest deployment meeting the SLOs found by trying every worker count from 1 and
    every prefill/decode split of it: the reference for :func:`plan` (slow: O(N²) simulations).
    Returns (Topology, summary), or None when nothing up to ``max_workers`` meets them."""
    base = base or {}
    for n in range(1, max_workers + 1):
        topos = [Topology(mode="aggregated", workers=n, **base)] if "aggregated" in modes else []
        topos += [Topology(mode=mode, prefill=p, decode=n - p, **base)
                  for mode in ("conditional", "disaggregated") if mode in modes for p in range(1, n)]
        for topo in topos:
            s = simulate(reqs, topo, profile, slo_ttft, slo_tpot)
            if meets_slos(s, slo_ttft, slo_tpot, attainment, slo_itl, percentile):
                return topo, s
    return None


def emit_k8s(out: Path, topo: Topology, summary: dict, reqs, profile: Profile, slo_ttft: float) -> list[Path]:
    """Write a kustomize overlay of ``infra/k8s`` for ``topo`` into ``out`` (see module doc)."""
    out.mkdir(parents=True, exist_ok=True)
    root = Path(__file__).resolve().parents[1] / "infra" / "k8s"
    rel = os.path.relpath(root, out.resolve())
    cost = CostModel(profile)
    mean_prompt = sum(r.prompt_tokens for r in reqs) / max(1, len(reqs))
    prefill_per_slo = max(1, int(slo_ttft / max(cost.prefill(int(mean_prompt)), 1e-9)))
    if topo.mode == "aggregated":
        prefill, decode, routing = 0, topo.workers, "aggregated"
    else:
        prefill, decode, routing = topo.prefill, topo.decode, topo.mode
    decode_lag = prefill_per_slo if topo.mode == "aggregated" else max(1, topo.max_num_seqs // 8)
    reps = {"prefill": prefill, "decode": decode}
    lines = ["# written by `pdserve plan --emit k8s`: " + topo.label(),
             f"# predicted: TTFT p90 {summary['ttft']['p90']:.3f}s, ITL p90 {summary['itl']['p90'] * 1e3:.1f}ms,"
             f" goodput {summary['goodput_rps']:.2f} req/s (profile {profile.name})",
             "apiVersion: kustomize.config.k8s.io/v1beta1", "kind: Kustomization",
             "resources:", f"  - {rel}", "replicas:"]
    lines += [f"  - name: {k}\n    count: {v}" for k, v in reps.items()]
    lines += ["patches:", "  - path: config-patch.yaml", "  - path: keda-patch.yaml"]
    files = {"kustomization.yaml": "\n".join(lines) + "\n"}
    files["config-patch.yaml"] = (
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: pdserve-config\n  namespace: pdserve\ndata:\n"
        f"  PD_ROUTING: {routing}\n  PD_ROUTER_LOCAL_MAX_TOKENS: \"{topo.local_max_tokens}\"\n"
        f"  PD_MAX_NUM_SEQS: \"{topo.max_num_seqs}\"\n  PD_MAX_NUM_BATCHED_TOKENS: \"{topo.max_num_batched_tokens}\"\n"
        f"  PD_MAX_PREFILL_CHUNK_TOKENS: \"{topo.max_prefill_chunk_tokens}\"\n")
    keda = []
    for name, count, lag in (("prefill", prefill, prefill_per_slo), ("decode", decode, decode_lag)):
        keda.append(f"apiVersion: keda.sh/v1alpha1\nkind: ScaledObject\nmetadata:\n  name: {name}\n  namespace: pdserve\n"
                    f"spec:\n  minReplicaCount: {count}\n  maxReplicaCount: {max(count * 2, 1)}\n  triggers:\n"
                    f"  - type: nats-jetstream\n    metadata:\n      natsServerMonitoringEndpoint: "
                    f"nats.pdserve.svc.cluster.local:8222\n      account: $G\n"
                    f"      stream: PD_{name.upper()}_TASKS\n      consumer: {name}-workers\n      lagThreshold: '{lag}'\n")
    files["keda-patch.yaml"] = "---\n".join(keda)
    written = []
    for fname, text in files.items():
        (out / fname).write_text(text)
        written.append(out / fname)
    return written


def bad_argument(args: argparse.Namespace) -> str | None:
    """Why the arguments of ``pdserve plan`` or ``pdserve simulate`` cannot work (checked before
    any simulation), or None. Reads the attributes each command has."""
    for flag in ("slo_ttft", "slo_tpot", "slo_itl"):
        value = getattr(args, flag, None)
        if value is not None and not (0 < value < math.inf):
            return f"--{flag.replace('_', '-')} must be a positive number of seconds, not {value}"
    attainment = getattr(args, "attainment", None)
    if attainment is not None and not 0 < attainment <= 1:
        return f"--attainment must be a share in (0, 1], not {attainment}"
    for flag in ("requests", "max_workers", "max_num_seqs", "max_num_batched_tokens", "max_prompt", "max_output",
                 "repeat", "workers", "prefill", "decode"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            return f"--{flag.replace('_', '-')} must be at least 1, not {value}"
    if not 0 <= args.rate < math.inf:
        return f"--rate must be 0 (the trace's own arrivals) or a positive req/s, not {args.rate}"
    unknown = [m for m in getattr(args, "modes", "aggregated").split(",")
               if m not in ("aggregated", "disaggregated", "conditional")]
    if unknown:
        return f"--modes: unknown mode {unknown[0]!r} (aggregated, disaggregated, conditional)"
    return None


#: What the printed percentiles' error band is: none measured out of sample yet (issue 34).
ERROR_BAND = ("  error band: unvalidated for this profile — out of sample on CPU deployments 40% of p50/p90 predictions fell within 15%, where the runs' own repeats agreed within 15% 48% of the time (docs/sim-validation.md) "
              "(`pdserve bench sim-validate`); the percentiles are the model's prediction")


def percentiles(s: dict) -> list[str]:
    """The predicted TTFT / ITL / TPOT / E2E percentiles of a summary, each with its band."""
    out = []
    for m in ("ttft", "itl", "tpot", "e2e"):
        out.append(f"  {m.upper():5s} p50 {s[m]['p50']:.4f}s  p90 {s[m]['p90']:.4f}s  p99 {s[m]['p99']:.4f}s"
                   "  (band: unvalidated)")
    return out


def _plan_pools(p: argparse.ArgumentParser, args, reqs, modes, base) -> int:
    from sim.pools import Hardware, plan_cheapest

    hardware = []
    for spec in args.hardware:
        path, sep, cost = spec.rpartition(":")
        try:
            price = float(cost)
        except ValueError:
            price = -1.0
        if not sep or not path or not 0 < price < math.inf:
            p.error(f"--hardware {spec!r}: FILE:COST with a positive cost per worker-hour")
        try:
            prof = Profile.load(path)
        except (OSError, ValueError) as exc:
            p.error(f"--hardware: {exc}")
        except (AttributeError, TypeError):
            p.error(f"--hardware: {path} is not a profile file")
        hardware.append(Hardware(prof.name, prof, price))
    try:
        res = plan_cheapest(reqs, hardware, args.slo_ttft, args.slo_tpot, attainment=args.attainment, modes=modes,
                            max_workers=args.max_workers, base=base)
    except ValueError as exc:  # pools of different models, a store a profile has no figures for
        p.error(str(exc))
    best = res["best"]
    if best is None:
        print(f"pdserve plan: no deployment up to {args.max_workers} workers meets the SLOs")
        return 1
    s = best.summary
    print(f"\nplan: {best.label()} — {best.cost_per_hour:.2f} per hour"
          f"{' (heterogeneous pools)' if best.heterogeneous else ''}, {len(res['tried'])} deployments simulated")
    print("\n".join(percentiles(s)))
    print(f"  SLO attainment {s['slo_attainment'] * 100:.1f}% (TTFT ≤ {args.slo_ttft}s and TPOT ≤ {args.slo_tpot}s, "
          f"at least {args.attainment * 100:.0f}%)")
    print(ERROR_BAND)
    if args.emit == "k8s":
        for path in emit_k8s(Path(args.out), best.topo, s, reqs, best.decode.profile, args.slo_ttft):
            print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", help="a profile file (pdserve profile, docs/profiles/); or --hardware")
    p.add_argument("--trace", default="azure-conv", help="azure-conv, azure-code, mooncake, poisson:LEN:W,...")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--rate", type=float, default=0.0, help="req/s (default: the trace's own arrivals)")
    p.add_argument("--slo-ttft", type=float, required=True, help="seconds, per request")
    p.add_argument("--slo-tpot", type=float, required=True, help="seconds per output token, per request")
    p.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet both SLOs")
    p.add_argument("--slo-itl", type=float, default=None, help="optional: seconds, pooled gaps at --percentile")
    p.add_argument("--percentile", type=int, default=90, choices=(50, 90, 99))
    p.add_argument("--modes", default="aggregated,disaggregated,conditional")
    p.add_argument("--max-workers", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=0, help="aggregated: PD_MAX_PREFILL_CHUNK_TOKENS")
    p.add_argument("--local-max-tokens", type=int, default=256, help="conditional: PD_ROUTER_LOCAL_MAX_TOKENS")
    p.add_argument("--max-prompt", type=int, default=8192)
    p.add_argument("--max-output", type=int, default=2048)
    p.add_argument("--hardware", action="append", default=[], metavar="FILE:COST",
                   help="a worker option (profile file : cost per worker-hour); repeat for heterogeneous pools")
    p.add_argument("--emit", choices=("k8s",), default=None)
    p.add_argument("--out", default="plan-k8s", help="--emit k8s: the overlay folder")
    args = p.parse_args(argv or [])
    bad = bad_argument(args)
    if bad:
        p.error(bad)
    modes = args.modes.split(",")
    if not args.profile and not args.hardware:
        p.error("--profile (one worker class) or --hardware FILE:COST (priced options) is needed")
    profile = None
    try:
        if args.profile:
            profile = Profile.load(args.profile)
    except (OSError, ValueError) as exc:
        p.error(f"--profile: {exc}")
    except (AttributeError, TypeError):  # JSON, but not an object of a profile's fields
        p.error(f"--profile: {args.profile} is not a profile file")
    try:
        reqs = load_trace(args.trace, args.requests, args.max_prompt, args.max_output, args.rate)
    except (OSError, ValueError) as exc:
        if args.trace.startswith("poisson") and "unknown trace" not in str(exc):
            exc = f"bad trace {args.trace!r} ({exc}): poisson:LEN:W,LEN:W with token lengths and positive weights"
        p.error(f"--trace: {exc}")
    base = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_prefill_chunk_tokens=args.chunk, local_max_tokens=args.local_max_tokens)
    if args.hardware:
        return _plan_pools(p, args, reqs, modes, base)
    res = plan(reqs, profile, args.slo_ttft, args.slo_tpot, attainment=args.attainment, slo_itl=args.slo_itl,
               percentile=args.percentile, max_workers=args.max_workers, modes=modes, base=base)
    if res["best"] is None:
        print(f"pdserve plan: no topology up to {args.max_workers} workers meets the SLOs")
        return 1
    topo, s = res["best"]
    k = f"p{args.percentile}"
    print(f"\nplan: {topo.label()} — {topo.num_workers} workers for {args.trace} at "
          f"{len(reqs) / max(reqs[-1].arrival_s, 1e-9):.2f} req/s (profile {profile.name})")
    print("\n".join(percentiles(s)))
    itl = f", pooled ITL {k} ≤ {args.slo_itl}s" if args.slo_itl is not None else ""
    print(f"  goodput {s['goodput_rps']:.2f} req/s, SLO attainment {s['slo_attainment'] * 100:.1f}% (per request: "
          f"TTFT ≤ {args.slo_ttft}s and TPOT ≤ {args.slo_tpot}s, at least {args.attainment * 100:.0f}%{itl}); "
          f"prefill share of compute {res['prefill_share']:.2f}")
    print(ERROR_BAND)
    if args.emit == "k8s":
        for path in emit_k8s(Path(args.out), topo, s, reqs, profile, args.slo_ttft):
            print(f"wrote {path}")
    return 0
