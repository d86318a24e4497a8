"""Simulated against measured: the modes benchmark's workload (``loadtest/bench_modes.py``)
served for real by each mode and replayed in the simulator, in one script.

``pdserve bench sim-fit-replay [--requests 60] [--rate 0.5] [--modes ...] [--crossover 128]
[--profile FILE] [--out DIR] [--measured DIR]``

1. Unless ``--profile`` is given, a fresh ``pdserve profile --quick`` of the model in
   ``PD_*``: the shape of the costs (prefill by tokens and context, decode by batch and
   context, KV hand-off, bus hop, detokenize).
2. The modes benchmark's deployments (``bench_modes.mode_plans``: each model worker pinned to
   its own core), its workload (the same seed, so the same arrivals and lengths) through each,
   every model worker writing its step log (``PD_STEP_LOG_DIR``) into ``<out>/steps/<mode>``.
3. The same requests through the simulator's matching topologies, each on the profile
   corrected by its own run's engine steps (:mod:`sim.calibrate`: observed/expected
   decode and prefill ratios, the co-run slowdown, loop gap and step jitter, all measured in
   the minutes the run's latencies were) and its idle probe's TTFT (the pipeline latency).
   On a machine other jobs share, a profile measured earlier describes another machine.
4. A table of p50/p90 TTFT and ITL, simulated vs measured, with the relative error; then the
   same with the idle-probe calibration alone and with the profile alone, for comparison.

``--measured DIR`` replays a previous run's folder (its profile, ``measured.json`` and step
logs) without measuring again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import time
from pathlib import Path

from sim import trace as traces
from sim.profile import Profile
from sim.simulator import Topology, simulate


def sim_topologies(crossover: int, cores: int, kv_prefetch: str = "auto") -> dict[str, Topology]:
    """The simulator's twin of each ``bench_modes.mode_plans`` deployment; ``kv_prefetch``: its
    decode workers read early-staged KV ahead (``PD_KV_PREFETCH``; see :func:`measured_kv_prefetch`)."""
    common = dict(max_num_seqs=32, host_cores=cores, workers_per_host=2, local_max_tokens=crossover,
                  kv_prefetch=kv_prefetch)
    return {
        "disaggregated": Topology(mode="disaggregated", prefill=1, decode=1, max_num_batched_tokens=2048,
                                  max_prefill_chunk_tokens=512, **common),
        "aggregated": Topology(mode="aggregated", workers=2, max_num_batched_tokens=4096, **common),
        "aggregated+chunked": Topology(mode="aggregated", workers=2, max_num_batched_tokens=256,
                                       max_prefill_chunk_tokens=128, **common),
        "conditional": Topology(mode="conditional", prefill=1, decode=1, max_num_batched_tokens=2048,
                                max_prefill_chunk_tokens=512, **common),
    }


def measured_kv_prefetch(measured: dict | None) -> str:
    """``PD_KV_PREFETCH`` of the deployments of measured runs (``measured.json``: a summary dict
    per run or mode): each run records ``kv_prefetch`` since that read exists; runs kept from
    before have no record and had no such read (``off``).

    Raises:
        ValueError: the runs recorded different settings (one twin topology cannot replay them).
    """
    seen = {str(v.get("kv_prefetch", "off")) for v in (measured or {}).values() if isinstance(v, dict)}
    if len(seen) > 1:
        raise ValueError(f"measured runs with different PD_KV_PREFETCH settings: {sorted(seen)}")
    return seen.pop() if seen else "off"


def keep_logs(src: Path, dest: Path, say=print) -> None:
    """Copy a deployment's service logs (the tokenizer's `route` decision per request id among
    them: what a conditional prediction is checked against) to ``dest``, each deployment to a
    folder of its own (a resumed sweep must not overwrite the logs of runs it keeps). A failed
    copy is said and skipped: it must never end a sweep whose measurements are already written."""
    try:
        shutil.copytree(src, dest, dirs_exist_ok=True)
    except (OSError, shutil.Error) as exc:
        say(f"the services' logs were not kept ({type(exc).__name__}: {exc})")



def measure_modes(base, modes: list[str], args, vocab: int, crossover: int, say) -> dict[str, dict]:
    """Run the real deployments; {mode: loadtest.client.Summary as a dict, with the idle
    ``probe`` and the workload's ``window`` on the host's monotonic clock}. With ``args.out``
    each model worker's step log lands in ``<out>/steps/<mode>/`` and each request's timings in
    ``<out>/requests-<mode>.json``, its services' logs in ``<out>/logs/<mode>``."""
    import random
    from dataclasses import asdict

    from loadtest.bench_modes import Deployed, _model_name, _ttft, mode_plans
    from loadtest.client import run_workload, summarize
    from loadtest.workloads import random_tokens, synthetic

    plans = mode_plans(crossover)
    model = _model_name(base)
    out = {}
    for name in modes:
        say(f"validate: measuring {name} ...")
        steps = Path(args.out) / "steps" / name.replace("+", "-") if args.out else None
        settings = base.replace(step_log_dir=str(steps)) if steps else base
        with Deployed(settings, plans[name]) as dep:
            asyncio.run(_ttft(dep.url, model, random_tokens(random.Random(9), 16, vocab)))
            rng = random.Random(11)  # a new prompt each time: a repeat would be a prefix-cache hit
            probe = asyncio.run(_probe(dep.url, model, [random_tokens(rng, args.short, vocab) for _ in range(PROBE_MAX)]))
            specs = synthetic(args.requests, args.rate, _mix(args), args.output_tokens, seed=3, vocab_size=vocab)
            t0 = time.perf_counter()
            res, wall = asyncio.run(run_workload(dep.url, model, specs, extra={"ignore_eos": True}, progress=False))
            t1 = time.perf_counter()
            out[name] = summarize(res, wall, args.slo_ttft, args.slo_tpot).to_dict()
            out[name].update(probe=probe, window=[t0, t1], load_average=os.getloadavg(),
                             kv_prefetch=settings.kv_prefetch)
            if args.out:  # each mode as it completes: a long run interrupted keeps what it measured
                Path(args.out).mkdir(parents=True, exist_ok=True)
                (Path(args.out) / "measured.json").write_text(json.dumps(out, indent=1, default=str))
                (Path(args.out) / f"requests-{name.replace('+', '-')}.json").write_text(
                    json.dumps([asdict(r) for r in res], default=str))
                keep_logs(dep.state_dir / "logs", Path(args.out) / "logs" / name.replace("+", "-"), say)
    return out


PROBE_TOKENS = 16
#: the most probe requests sent; they stop once :data:`PROBE_SETTLED` in a row agree, after at
#: least :data:`PROBE_MIN` answers (so a slow start as long as three probes is still waited out)
PROBE_MAX = 9
PROBE_MIN = 5
#: probes in a row whose TTFTs lie within a factor :data:`PROBE_SPREAD` of each other: settled
PROBE_SETTLED = 3
PROBE_SPREAD = 2.0


async def _probe(url: str, model: str, prompts: list[list[int]]) -> dict:
    """TTFT and ITL of the idle deployment: ``prompts`` sent one at a time (distinct prompts: a
    repeated one would hit the prefix cache and time no prefill) until, after at least
    :data:`PROBE_MIN` answers, the last :data:`PROBE_SETTLED` TTFTs lie within a factor
    :data:`PROBE_SPREAD` of each other; the medians of those. A deployment just started can answer its first requests slowly (a CI run
    on the AMX Xeon saw a probe TTFT of ~0.9 s where the run's p50 was 0.03 s): the median of
    the first three alone would make that the twin's pipeline latency. ``ttfts`` keeps every
    probe's TTFT (seconds); ``settled`` says whether they agreed before ``prompts`` ran out
    (if not, the medians are of the last three). {} when no probe succeeded."""
    import statistics

    import httpx

    from loadtest.client import RequestSpec, send_one

    ttfts, itls = [], []
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        for prompt in prompts:
            r = await send_one(client, model, RequestSpec(0, prompt, PROBE_TOKENS, chat=False), extra={"ignore_eos": True})
            if r.ok:
                ttfts.append(r.ttft_s)
                itls.append(r.tpot_s or 0.0)
            if len(ttfts) >= PROBE_MIN and probe_settled(ttfts):
                break
    if not ttfts:
        return {}
    last = slice(-PROBE_SETTLED, None)
    return {"ttft": statistics.median(ttfts[last]), "itl": statistics.median(itls[last]),
            "ttfts": ttfts, "settled": probe_settled(ttfts)}


def probe_settled(ttfts: list[float]) -> bool:
    """Whether the last :data:`PROBE_SETTLED` probe TTFTs (seconds) lie within a factor
    :data:`PROBE_SPREAD` of each other."""
    tail = ttfts[-PROBE_SETTLED:]
    return len(tail) == PROBE_SETTLED and min(tail) > 0 and max(tail) <= PROBE_SPREAD * min(tail)


def calibrate(profile: Profile, topo: Topology, probe: dict, prompt_tokens: int) -> Profile:
    """``profile`` with ``step_loop_s`` and ``pipeline_s`` set so that one idle request (the
    probe: ``prompt_tokens``, :data:`PROBE_TOKENS` out) gets the probe's measured TTFT and
    time per output token. The loaded run is then predicted, not fitted."""
    from dataclasses import replace

    if not probe:
        return profile
    one = [traces.SimRequest(0, 0.0, prompt_tokens, PROBE_TOKENS)]
    p0 = replace(profile, step_loop_s=0.0, pipeline_s=0.0)
    s = simulate(one, topo, p0)
    p1 = replace(p0, step_loop_s=max(0.0, probe["itl"] - s["tpot"]["p50"]))
    s = simulate(one, topo, p1)
    return replace(p1, pipeline_s=max(0.0, probe["ttft"] - s["ttft"]["p50"]))


def simulate_modes(profile: Profile, modes: list[str], args, vocab: int, crossover: int,
                   measured: dict | None = None, how: str = "run") -> dict[str, dict]:
    """The workload through each mode's twin. ``how``: ``run`` — each twin's profile is
    corrected by its measured run's own engine steps (:mod:`sim.calibrate`, step logs
    in ``<args.out>/steps/<mode>``), then its pipeline latency set from the idle probe;
    ``run-flat`` — the same without the run's load timeline; ``probe`` — the idle probe alone (:func:`calibrate`); ``none`` — the profile as it is."""
    from dataclasses import replace

    from sim import calibrate as cal

    reqs = traces.synthetic(args.requests, args.rate, _mix(args), args.output_tokens, seed=3, vocab_size=vocab)
    topos = sim_topologies(crossover, args.cores or profile.host_cores or (os.cpu_count() or 1),
                           measured_kv_prefetch(measured))
    out = {}
    for name in modes:
        m = (measured or {}).get(name) or {}
        topo, prof, fitted = topos[name], profile, None
        if how in ("run", "run-flat"):
            logs = cal.read_step_logs(Path(args.out) / "steps" / name.replace("+", "-"))
            fitted = cal.fit(profile, logs, tuple(m["window"]) if m.get("window") else None)
            fitted.pop("_prefill_rows", None)
            prof, topo = cal.apply(profile, fitted, timeline=how == "run"), cal.calibrated_topology(topo)
            if m.get("window"):
                rates = cal.initial_rates(logs, m["window"][0])
                if topo.mode == "aggregated":  # the launcher's decode-i are the twin's worker-i
                    rates = {k.replace("decode-", "worker-"): v for k, v in rates.items()}
                topo = replace(topo, extra={**topo.extra, "prefill_rates": rates})
            prof = _pipeline_from_probe(prof, topo, m.get("probe") or {}, args.short)
        elif how == "probe":
            prof = calibrate(profile, topo, m.get("probe") or {}, args.short)
        out[name] = simulate(reqs, topo, prof, args.slo_ttft, args.slo_tpot, keep=_completed(args, name, len(reqs)))
        out[name]["calibration"] = {"step_loop_s": prof.step_loop_s, "pipeline_s": prof.pipeline_s, "fit": fitted}
    return out


def _completed(args, mode: str, n: int) -> list[bool] | None:
    """Which of the workload's requests (in arrival order) the measured run completed: the
    measured percentiles count only those (a request the gateway gave up on has no TTFT), so
    the simulated ones are taken over the same requests. None when unknown."""
    path = Path(args.out or ".") / f"requests-{mode.replace('+', '-')}.json"
    if not args.out or not path.exists():
        return None
    res = sorted(json.loads(path.read_text()), key=lambda r: r["sent_at"])
    return [bool(r["ok"]) for r in res] if len(res) == n else None


def _pipeline_from_probe(profile: Profile, topo: Topology, probe: dict, prompt_tokens: int) -> Profile:
    """``pipeline_s`` set so that the idle probe request gets its measured TTFT (0 when the
    replay is slower than the probe already)."""
    from dataclasses import replace

    if not probe:
        return profile
    p0 = replace(profile, pipeline_s=0.0)
    one = [traces.SimRequest(0, 0.0, prompt_tokens, PROBE_TOKENS)]
    gap = probe["ttft"] - simulate(one, topo, replace(p0, load_timeline=[]))["ttft"]["p50"]
    return replace(p0, pipeline_s=max(0.0, gap))


def _mix(args) -> list[tuple[int, float]]:
    return [(args.short, 1 - args.long_share), (args.long, args.long_share)]


def compare(measured: dict, simulated: dict) -> list[dict]:
    """Rows of (mode, metric, percentile, measured s, simulated s, relative error)."""
    rows = []
    for mode, m in measured.items():
        s = simulated[mode]
        for metric in ("ttft", "itl"):
            for q in ("p50", "p90"):
                a, b = m[metric][q], s[metric][q]
                err = (b - a) / a if a else float("nan")
                rows.append({"mode": mode, "metric": metric, "q": q, "measured_s": a, "simulated_s": b, "error": err})
    return rows


def table(rows: list[dict], tolerance: float = 0.15) -> str:
    out = ["| mode | metric | measured ms | simulated ms | error |", "|---|---|---|---|---|"]
    for r in rows:
        flag = "" if abs(r["error"]) <= tolerance else " ✗"
        out.append(f"| {r['mode']} | {r['metric'].upper()} {r['q']} | {r['measured_s'] * 1e3:.1f} | "
                   f"{r['simulated_s'] * 1e3:.1f} | {r['error'] * 100:+.0f}%{flag} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from shared.config import Settings

    p = argparse.ArgumentParser(prog="pdserve bench sim-fit-replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--rate", type=float, default=0.5)
    p.add_argument("--short", type=int, default=96)
    p.add_argument("--long", type=int, default=1536)
    p.add_argument("--long-share", type=float, default=0.2)
    p.add_argument("--output-tokens", type=int, default=48)
    p.add_argument("--slo-ttft", type=float, default=5.0)
    p.add_argument("--slo-tpot", type=float, default=0.25)
    p.add_argument("--crossover", type=int, default=128, help="the conditional router's local limit")
    p.add_argument("--modes", default="disaggregated,aggregated,aggregated+chunked,conditional")
    p.add_argument("--profile", default="", help="use this profile instead of measuring one now")
    p.add_argument("--cores", type=int, default=0, help="host cores (default: the profile's)")
    p.add_argument("--out", default="")
    p.add_argument("--measured", default="", help="re-simulate a previous run's --out folder (its profile, "
                   "measured.json and step logs) instead of measuring")
    args = p.parse_args(argv or [])
    say = print
    env = dict(os.environ)
    env.setdefault("PD_TORCH_THREADS", "1")
    base = Settings.from_env(env)
    from loadtest.bench_modes import _vocab

    vocab = _vocab(base)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    if args.measured:
        args.out = args.measured
        args.profile = args.profile or str(Path(args.measured) / "profile.json")
    args.out = args.out or f"reports/sim-validate-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.profile:
        profile = Profile.load(args.profile)
    else:
        from sim.measure import measure

        say("validate: profiling this machine now ...")
        profile = measure(base, quick=True, max_prompt=max(args.long, 1024), max_batch=32, say=say)
        profile.save(Path(args.out) / "profile.json")
    modes = [m for m in args.modes.split(",") if m]
    if args.measured:
        measured = json.loads((Path(args.measured) / "measured.json").read_text())
        modes = [m for m in modes if m in measured]
    else:
        measured = measure_modes(base, modes, args, vocab, args.crossover, say)
    results = {how: simulate_modes(profile, modes, args, vocab, args.crossover, measured, how)
               for how in ("run", "run-flat", "probe", "none")}
    rows = compare(measured, results["run"])
    print(f"\nworkload: {args.requests} requests, Poisson {args.rate} req/s, prompts {args.short} "
          f"({(1 - args.long_share) * 100:.0f}%) / {args.long} tokens, {args.output_tokens} output tokens; "
          f"profile {profile.name} (measured {profile.measured}); run started {started}")
    print(table(rows))
    for name in modes:
        fit = results["run"][name]["calibration"]["fit"]
        print(f"{name}: observed/profile decode ×{fit['decode']:.2f}, prefill ×{fit['prefill']:.2f}, co-run "
              f"×{fit['corun']:.2f}, loop {fit['step_loop_s'] * 1e3:.2f} ms, pipeline "
              f"{results['run'][name]['calibration']['pipeline_s'] * 1e3:.1f} ms ({fit['steps']} steps; decode "
              f"step ratio p10/p50/p90 {'/'.join(f'{x:.2f}' for x in fit['spread'])}); load average "
              f"{measured[name].get('load_average', '?')}")
    print("\ncalibrated on the run's steps without its load timeline (costs averaged over the run):")
    print(table(compare(measured, results["run-flat"])))
    print("\ncalibrated on the idle probe only (the previous method):")
    print(table(compare(measured, results["probe"])))
    print("\nwithout calibration (profile alone):")
    print(table(compare(measured, results["none"])))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "validate.json").write_text(json.dumps({"args": vars(args), "profile": profile.__dict__, "rows": rows,
                                                   "measured": measured, "simulated": results["run"],
                                                   "simulated_flat": results["run-flat"],
                                                   "simulated_probe": results["probe"],
                                                   "simulated_uncalibrated": results["none"]}, indent=1, default=str))
    (out / "validate.md").write_text(table(rows) + "\n")
    print(f"report: {out / 'validate.md'}")
    return 0
