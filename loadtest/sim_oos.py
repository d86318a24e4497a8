"""The simulator predicting runs it was not fitted on: ``pdserve bench sim-validate`` (its
default; ``--fit-replay`` is the older in-run replay, a fit).

1. A profile of this machine (``pdserve profile --quick``, or ``--profile FILE``).
2. Each mode's deployment (:func:`loadtest.bench_modes.mode_plans`: aggregated,
   aggregated+chunked, disaggregated, conditional at equal cores, one per model worker) serves
   every cell: 2 traces (:func:`sim.trace.synthetic`'s short/long mix without reuse;
   :func:`sim.trace.shared_prefix` with prefix reuse) × 3 rates (``--rates``, about 0.5x, 1x and
   1.5x the fitted one) × ``--repeats`` repeats (the same lengths and arrivals, token content of
   its own: nothing a previous repeat cached is hit). Every model worker writes its step log.
3. **The fit**: one run only (``--fit``: mode, trace, rate, repeat; default the disaggregated
   deployment on the trace without reuse at the middle rate, first repeat) — its engine steps
   give the step costs (:func:`sim.calibrate.fit`: one decode ratio, per-point prefill ratios,
   the context-attention term where the run has chunks after a context, the co-run factor, the
   loop gap, the step jitter) and its unqueued short requests the pipeline latency
   (:func:`pipeline_from_run`). The fitted run's own load timeline is left out (it describes
   that run's minutes), so is every later run's: the profile is frozen.
4. **The prediction**: every other run through its mode's simulated twin (:func:`twin`: the
   gateway's admission limit, the workers' prefill rates warm) on the frozen profile, all of
   its requests (the measured run's set of completed requests is not used: the twin refuses
   what the gateway would), as the median of :data:`SEEDS` simulations.
5. Tables: per run, TTFT and ITL p50/p90/p99 measured vs predicted; per mode and percentile the
   error's median and spread; the share within ``--tolerance`` (15 %) of the p50 and p90
   predictions (the target: 80 %); the modes' ranking per (trace, rate, repeat) by TTFT p90 and
   by ITL p90. The fitted run is printed and labelled ``fit`` and counted in no share.

Speculative decoding is off in these deployments (``PD_SPECULATIVE_METHOD=off``): the simulator
has no model of drafts and acceptance yet, so a run with speculation would test something the
simulator does not claim. ``--measured DIR`` re-predicts a previous run's folder without
measuring again (another fit run with ``--fit``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

from loadtest.sim_validate import keep_logs
from sim import calibrate as cal
from sim import trace as traces
from sim.profile import Profile
from sim.simulator import Simulation, simulate

TRACES = ("mix", "prefix")
MODES = ("aggregated", "aggregated+chunked", "disaggregated", "conditional")
QS = ("p50", "p90", "p99")


def workload(trace: str, rate: float, args) -> list[traces.SimRequest]:
    """One cell's requests (arrival order). ``mix``: the modes benchmark's short/long mix
    (``--short`` 80 % / ``--long`` 20 %) without reuse; ``prefix``: :func:`sim.trace.shared_prefix`
    (4 system prompts of 512 tokens and their questions, 20 % unshared ``--long`` prompts).
    The same for every repeat (the repeat changes the tokens only: :func:`key`)."""
    if trace == "mix":
        return traces.synthetic(args.requests, rate, [(args.short, 0.8), (args.long, 0.2)], args.output_tokens, seed=3)
    if trace == "prefix":
        return traces.shared_prefix(args.requests, rate, long_tokens=args.long, output_tokens=args.output_tokens, seed=5)
    raise ValueError(f"unknown trace {trace!r} (one of {', '.join(TRACES)})")


def key(mode: str, trace: str, rate: float, rep: int) -> str:
    return f"{mode}|{trace}|{rate:g}|{rep}"


def _slug(mode: str) -> str:
    return mode.replace("+", "-")


def measure(base, args, vocab: int, say) -> dict:
    """Serve every cell for real, one deployment per mode; {key: summary dict with ``window``
    (host monotonic clock), ``probe`` (the mode's idle probe), ``load_average``, ``order``}.
    Written to ``<out>/measured.json`` after each run, so an interrupted sweep keeps its runs."""
    from loadtest.bench_modes import Deployed, _model_name, _ttft, mode_plans
    from loadtest.client import run_workload, summarize
    from loadtest.sim_validate import PROBE_MAX, _probe
    from loadtest.workloads import from_sim, random_tokens

    out_dir = Path(args.out)
    path = out_dir / "measured.json"
    out = json.loads(path.read_text()) if path.exists() else {}
    plans = mode_plans(args.crossover)
    model = _model_name(base)
    order = len(out)
    for mode in args.modes:
        cells = [(t, r, k) for t in args.traces for r in args.rates for k in range(args.repeats)
                 if key(mode, t, r, k) not in out]
        if not cells:
            continue
        settings = base.replace(step_log_dir=str(out_dir / "steps" / _slug(mode)), speculative_method="off")
        say(f"oos: {mode}: deploying for {len(cells)} runs ...")
        first = order  # this deployment's logs go beside its runs, apart from an earlier deployment's
        with Deployed(settings, plans[mode]) as dep:
            asyncio.run(_ttft(dep.url, model, random_tokens(random.Random(9), 16, vocab)))
            rng = random.Random(11)
            probe = asyncio.run(_probe(dep.url, model, [random_tokens(rng, args.short, vocab) for _ in range(PROBE_MAX)]))
            for trace, rate, rep in cells:
                reqs = workload(trace, rate, args)
                # token content of its own per (trace, rate, repeat): no run hits what an earlier one cached
                seed = 1 + rep + 10 * args.rates.index(rate) + 100 * TRACES.index(trace)
                specs = from_sim(reqs, seed=seed, vocab_size=vocab)
                t0 = time.perf_counter()
                res, wall = asyncio.run(run_workload(dep.url, model, specs, extra={"ignore_eos": True}, progress=False))
                t1 = time.perf_counter()
                s = summarize(res, wall, args.slo_ttft, args.slo_tpot).to_dict()
                s.update(window=[t0, t1], probe=probe, load_average=os.getloadavg(), order=order,
                         at=time.strftime("%H:%M:%S"), kv_prefetch=settings.kv_prefetch)
                order += 1
                out[key(mode, trace, rate, rep)] = s
                say(f"oos: {key(mode, trace, rate, rep)}: {s['num_ok']}/{s['num_requests']} ok, TTFT p50/p90 "
                    f"{s['ttft']['p50']:.3f}/{s['ttft']['p90']:.3f} s, ITL p50/p90 {s['itl']['p50'] * 1e3:.1f}/"
                    f"{s['itl']['p90'] * 1e3:.1f} ms, load {os.getloadavg()[0]:.2f}")
                out_dir.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(out, indent=1, default=str))
                (out_dir / "requests").mkdir(exist_ok=True)
                _requests_path(out_dir, key(mode, trace, rate, rep)).write_text(
                    json.dumps([asdict(r) for r in res], default=str))
                keep_logs(dep.state_dir / "logs", out_dir / "logs" / _slug(mode) / f"from-run-{first}", say)
    return out


def frozen_profile(profile: Profile, measured: dict, fit_key: str, args) -> tuple[Profile, dict]:
    """The profile with step costs fitted on the run ``fit_key`` alone (its steps inside its
    window; its load timeline dropped; one decode ratio) and the pipeline latency of its
    unqueued short requests (:func:`pipeline_from_run`; the idle probe's where it has none);
    the fitted numbers beside it (``pipeline_from``: ``run`` or ``probe``)."""
    from loadtest.sim_validate import _pipeline_from_probe, measured_kv_prefetch, sim_topologies

    mode = fit_key.split("|")[0]
    m = measured[fit_key]
    profile = cal.smoothed(profile)
    logs = cal.read_step_logs(Path(args.out) / "steps" / _slug(mode))
    fitted = cal.fit(profile, logs, tuple(m["window"]), decode_by_point=False)
    fitted.pop("_prefill_rows", None)
    fitted.pop("load_timeline", None)
    prof = cal.apply(profile, fitted, timeline=False)
    topo = twin(sim_topologies(args.crossover, 2, measured_kv_prefetch(measured))[mode], prof, args)
    path = _requests_path(Path(args.out), fit_key)
    _, trace, rate, _ = fit_key.split("|")
    pipe = pipeline_from_run(prof, topo, workload(trace, float(rate), args),
                             json.loads(path.read_text()) if path.exists() else [])
    if pipe is None:  # no request of the run went through unqueued: the idle probe's
        prof = _pipeline_from_probe(prof, topo, m.get("probe") or {}, args.short)
        fitted["pipeline_from"] = "probe"
    else:
        prof = replace(prof, pipeline_s=pipe)
        fitted["pipeline_from"] = "run"
    return prof, fitted


def pipeline_from_run(prof: Profile, topo, reqs: list[traces.SimRequest], results: list[dict],
                      queued: float = 0.1, min_requests: int = 2) -> float | None:
    """The pipeline latency (``Profile.pipeline_s``, seconds) the fitted run's own requests
    show: the median of measured TTFT − simulated TTFT (at pipeline 0) over the short requests
    (an idle TTFT within 2x the run's shortest) the simulation serves unqueued (their simulated
    TTFT within ``queued`` (relative) of the same prompt alone). Unqueued, that difference is the time outside the modelled steps, hops and
    store — the gateway, the tokenizer's process, the first token's way out; queued requests
    would fold the queueing error into it.

    Why not the idle probe: the probe runs right after the deployment starts, and its first
    requests pay warm-up (on the AVX2 EPYC its 32-token TTFT was 0.31 s against 0.17-0.25 s
    for unqueued requests of the same size minutes later), which added a constant ~0.1 s to
    every predicted TTFT. ``results``: the run's requests (:class:`loadtest.client.RequestResult`
    as dicts), matched to ``reqs`` by send order. None with fewer than ``min_requests`` such
    requests (or no results)."""
    done = sorted((r for r in results if r.get("sent_at") is not None), key=lambda r: r["sent_at"])
    if len(done) != len(reqs):
        return None
    p0 = replace(prof, pipeline_s=0.0)
    res = Simulation(topo, p0).run(reqs)
    idle: dict[int, float] = {}
    for n in sorted({req.prompt_tokens for req in reqs}):
        alone = Simulation(topo, p0).run([traces.SimRequest(0, 0.0, n, 2)])
        idle[n] = alone.first[0] - alone.arrival[0]
    shortest = min(idle.values())
    gaps = []
    for i, (req, r) in enumerate(zip(reqs, done)):
        if not r["ok"] or r["ttft_s"] is None or idle[req.prompt_tokens] > 2 * shortest:
            continue  # a long prompt's TTFT is mostly its prefill, whose error is not the pipeline's
        sim_ttft = res.first[i] - res.arrival[i]
        if sim_ttft <= idle[req.prompt_tokens] * (1 + queued):
            gaps.append(r["ttft_s"] - sim_ttft)
    if len(gaps) < min_requests:
        return None
    return max(0.0, statistics.median(gaps))


def twin(topo, prof: Profile, args):
    """A mode's simulated twin as the validation deploys it: the calibrated topology, the
    gateway's admission limit of the deployment (``--max-queue-time``, ``PD_MAX_QUEUE_TIME_S``),
    and every worker's prefill-rate EWMA started at the profile's 512-token rate (the real
    workers have served the warm-up and earlier runs before a run starts; the router and the
    admission read that rate from their heartbeats)."""
    from sim.profile import CostModel

    rate = CostModel(prof).prefill_rate()
    return replace(cal.calibrated_topology(topo), max_queue_time_s=args.max_queue_time,
                   extra={**topo.extra, "prefill_rates": {"*": rate}})


#: Simulations per predicted run (the fetches' phases and the step jitter drawn anew each time);
#: the prediction is the median of their percentiles: the run's typical outcome, not one draw of
#: which worker happened to take which request.
SEEDS = 5


def predict(prof: Profile, measured: dict, args, seeds: int = SEEDS) -> dict:
    """{key: the simulator's summary of that run's requests on the frozen profile}, each
    percentile and the SLO attainment the median over ``seeds`` simulations (:data:`SEEDS`)."""
    from loadtest.sim_validate import measured_kv_prefetch, sim_topologies

    topos = {k: twin(v, prof, args) for k, v in sim_topologies(args.crossover, 2, measured_kv_prefetch(measured)).items()}
    out, cache = {}, {}
    for k in measured:
        mode, trace, rate, _ = k.split("|")
        if (mode, trace, rate) not in cache:  # the repeats send the same lengths and arrivals
            runs = [simulate(workload(trace, float(rate), args), topos[mode], prof, args.slo_ttft, args.slo_tpot,
                             seed=s) for s in range(seeds)]
            # only the medians: one seed's other fields (utilization, rates) are one draw, not the run's
            med = {"requests": runs[0]["requests"], "seeds": seeds,
                   "finished": statistics.median(r["finished"] for r in runs)}
            for metric in ("ttft", "itl", "tpot"):  # None where a seed had none (no request finished)
                med[metric] = {q: (statistics.median(r[metric][q] for r in runs)
                                   if all(r[metric][q] is not None for r in runs) else None)
                               for q in runs[0][metric]}
            med["slo_attainment"] = statistics.median(r["slo_attainment"] for r in runs)
            cache[(mode, trace, rate)] = med
        out[k] = cache[(mode, trace, rate)]
    return out


def rows(measured: dict, predicted: dict, fit_key: str) -> list[dict]:
    """One row per (run, metric, percentile): measured and predicted seconds, relative error."""
    out = []
    for k, m in measured.items():
        mode, trace, rate, rep = k.split("|")
        for metric in ("ttft", "itl"):
            for q in QS:
                a, b = m[metric][q], predicted[k][metric].get(q)
                out.append({"key": k, "mode": mode, "trace": trace, "rate": float(rate), "rep": int(rep),
                            "metric": metric, "q": q, "measured_s": a, "predicted_s": b,
                            "error": (b - a) / a if a and b is not None else float("nan"), "fit": k == fit_key,
                            "failed": m["num_requests"] - m["num_ok"]})
    return out


def same_order(ma: float, mb: float, pa: float | None, pb: float | None) -> bool:
    """Whether predictions ``pa``, ``pb`` order two modes as their measured ``ma``, ``mb`` do;
    a predicted tie, or a missing prediction, orders nothing (not right)."""
    return pa is not None and pb is not None and pa != pb and (ma < mb) == (pa < pb)


def ranking(measured: dict, predicted: dict, fit_key: str, tie: float) -> list[dict]:
    """Per (trace, rate, repeat) with every mode measured, and per metric (TTFT p90, ITL p90):
    whether the predicted order of the modes is the measured one. Two modes whose measured
    values differ by less than ``tie`` (relative) are a tie: either order of that pair is right;
    otherwise a predicted tie is wrong (:func:`same_order`).
    ``pairs``: the pairs in the right order out of all pairs."""
    groups: dict[tuple, dict] = {}
    for k in measured:
        mode, trace, rate, rep = k.split("|")
        groups.setdefault((trace, rate, rep), {})[mode] = k
    out = []
    for (trace, rate, rep), by_mode in sorted(groups.items()):
        if len(by_mode) < 2:
            continue
        for metric in ("ttft", "itl"):
            ms = {mo: measured[k][metric]["p90"] for mo, k in by_mode.items()}
            ps = {mo: predicted[k][metric]["p90"] for mo, k in by_mode.items()}
            modes = sorted(ms)
            right = total = 0
            for i, a in enumerate(modes):
                for b in modes[i + 1:]:
                    total += 1
                    if abs(ms[a] - ms[b]) <= tie * max(ms[a], ms[b]) or same_order(ms[a], ms[b], ps[a], ps[b]):
                        right += 1
            out.append({"trace": trace, "rate": float(rate), "rep": int(rep), "metric": metric,
                        "right": right == total, "pairs": [right, total],
                        "measured": sorted(modes, key=ms.get),
                        "predicted": sorted(modes, key=lambda m: float("inf") if ps[m] is None else ps[m]),
                        "has_fit": fit_key in by_mode.values()})
    return out


def _cells(measured: dict) -> dict[tuple, list[str]]:
    """The runs' keys by (mode, trace, rate) cell: a cell's repeats."""
    cells: dict[tuple, list[str]] = {}
    for k in measured:
        mode, trace, rate, _ = k.split("|")
        cells.setdefault((mode, trace, rate), []).append(k)
    return cells


def repeat_agreement(measured: dict, tolerance: float) -> dict:
    """The measurement's own noise floor: each run's TTFT and ITL p50/p90 against the median of
    the other repeats of its (mode, trace, rate) cell — a prediction that knew each cell's
    typical value exactly would land within ``tolerance`` about this often. Returns
    ``{(metric, q): [within, total]}`` and ``("all", "p50+p90")``; cells with one repeat count
    in none."""
    cells = _cells(measured)
    out: dict[tuple, list[int]] = {}
    for ks in cells.values():
        if len(ks) < 2:
            continue
        for k in ks:
            for metric in ("ttft", "itl"):
                for q in ("p50", "p90"):
                    a = measured[k][metric][q]
                    ref = statistics.median(measured[o][metric][q] for o in ks if o != k)
                    hit = bool(a) and abs(ref - a) <= tolerance * a
                    for slot in ((metric, q), ("all", "p50+p90")):
                        c = out.setdefault(slot, [0, 0])
                        c[0] += hit
                        c[1] += 1
    return out


def cell_agreement(measured: dict, predicted: dict, fit_key: str, tolerance: float) -> tuple[int, int]:
    """The prediction against each cell's typical value: per (mode, trace, rate) cell with at
    least two repeats, TTFT and ITL p50/p90 measured as the median over its repeats against the
    cell's one prediction (the repeats send the same lengths and arrivals). The fitted run's
    cell is left out (its median holds the fitted run). Returns (within ``tolerance``, total): a
    view beside the target's per-run share, which also counts each run's own noise."""
    cells = _cells(measured)
    fit_cell = tuple(fit_key.split("|")[:3])
    within = total = 0
    for cell, ks in cells.items():
        if cell == fit_cell or len(ks) < 2:
            continue
        for metric in ("ttft", "itl"):
            for q in ("p50", "p90"):
                values = [measured[k][metric][q] for k in ks if measured[k][metric][q]]
                pred = predicted[ks[0]][metric][q]
                if not values or pred is None:
                    continue
                ref = statistics.median(values)
                total += 1
                within += abs(pred - ref) <= tolerance * ref
    return within, total


def resolved_ranking(measured: dict, predicted: dict) -> list[dict]:
    """Per (trace, rate) and metric (TTFT p90, ITL p90): the pairs of modes the measurement
    tells apart — every repeat of one mode below every repeat of the other (at least two
    repeats each) — and whether the prediction orders each such pair the same way (the
    prediction is one per cell: the repeats send the same lengths and arrivals). A pair whose
    repeats interleave is unresolved: run-to-run noise decides its order; a predicted tie counts
    as wrong. ``right`` is True
    when every resolved pair is right (also when there is none: ``resolved`` 0)."""
    cells: dict[tuple, dict[str, list[str]]] = {}
    for k in measured:
        mode, trace, rate, _ = k.split("|")
        cells.setdefault((trace, rate), {}).setdefault(mode, []).append(k)
    out = []
    for (trace, rate), by_mode in sorted(cells.items()):
        modes = sorted(m for m, ks in by_mode.items() if len(ks) >= 2)
        for metric in ("ttft", "itl"):
            right = resolved = 0
            for i, a in enumerate(modes):
                for b in modes[i + 1:]:
                    va = [measured[k][metric]["p90"] for k in by_mode[a]]
                    vb = [measured[k][metric]["p90"] for k in by_mode[b]]
                    if max(va) < min(vb) or max(vb) < min(va):
                        resolved += 1
                        pa = predicted[by_mode[a][0]][metric]["p90"]
                        pb = predicted[by_mode[b][0]][metric]["p90"]
                        right += same_order(min(va), min(vb), pa, pb)  # resolved: the minima order them
            out.append({"trace": trace, "rate": float(rate), "metric": metric, "resolved": resolved,
                        "right_pairs": right, "pairs": len(modes) * (len(modes) - 1) // 2,
                        "right": right == resolved})
    return out


def report(rs: list[dict], ranks: list[dict], tolerance: float, measured: dict | None = None,
           predicted: dict | None = None, dev_repeats: tuple[int, ...] = (), fit_key: str = "") -> str:
    """The out-of-sample tables as markdown."""
    lines = ["| run | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | ITL p90 | ITL p99 |", "|---|---|---|---|---|---|---|"]
    by_key: dict[str, dict] = {}
    for r in rs:
        by_key.setdefault(r["key"], {})[(r["metric"], r["q"])] = r
    for k, cells in by_key.items():
        first = next(iter(cells.values()))
        label = k.replace("|", " · ") + (" **(fit)**" if first["fit"] else "") + (
            f" ({first['failed']} failed)" if first["failed"] else "")
        parts = []
        for metric in ("ttft", "itl"):
            for q in QS:
                r = cells[(metric, q)]
                unit, scale = ("s", 1) if metric == "ttft" else ("ms", 1e3)
                mark = "" if abs(r["error"]) <= tolerance or q == "p99" else " ✗"
                parts.append(f"{r['measured_s'] * scale:.{2 if unit == 's' else 1}f} → "
                             f"{(r['predicted_s'] if r['predicted_s'] is not None else float('nan')) * scale:.{2 if unit == 's' else 1}f} ({r['error'] * 100:+.0f}%{mark})")
        lines.append(f"| {label} | " + " | ".join(parts) + " |")
    oos = [r for r in rs if not r["fit"]]
    lines += ["", "Error of the prediction, out of sample (median, p10..p90 of the signed error over runs):", "",
              "| mode | " + " | ".join(f"{m.upper()} {q}" for m in ("ttft", "itl") for q in QS) + " |",
              "|---|" + "---|" * 6]
    for mode in dict.fromkeys(r["mode"] for r in oos):
        parts = []
        for metric in ("ttft", "itl"):
            for q in QS:
                es = sorted(r["error"] for r in oos if r["mode"] == mode and r["metric"] == metric and r["q"] == q)
                parts.append(f"{statistics.median(es) * 100:+.0f}% ({es[int(0.1 * (len(es) - 1))] * 100:+.0f}.."
                             f"{es[int(0.9 * (len(es) - 1))] * 100:+.0f})" if es else "—")
        lines.append(f"| {mode} | " + " | ".join(parts) + " |")
    lines.append("")
    for metric in ("ttft", "itl"):
        for q in ("p50", "p90"):
            es = [r["error"] for r in oos if r["metric"] == metric and r["q"] == q]
            within = sum(abs(e) <= tolerance for e in es)
            lines.append(f"* {metric.upper()} {q}: {within}/{len(es)} predictions within {tolerance * 100:.0f}%")
    es = [r["error"] for r in oos if r["q"] in ("p50", "p90")]
    within = sum(abs(e) <= tolerance for e in es)
    lines.append(f"* **all p50 and p90: {within}/{len(es)} = {within / max(1, len(es)) * 100:.0f}% within "
                 f"{tolerance * 100:.0f}%** (target ≥ 80%)")
    if dev_repeats:
        held = [r["error"] for r in oos if r["q"] in ("p50", "p90") and r["rep"] not in dev_repeats]
        if held:
            within = sum(abs(e) <= tolerance for e in held)
            lines.append(f"* held out — repeats other than {', '.join(map(str, dev_repeats))} (the model's structure was "
                         f"chosen looking at those only): {within}/{len(held)} = {within / len(held) * 100:.0f}% within "
                         f"{tolerance * 100:.0f}%")
    if measured:
        agree = repeat_agreement(measured, tolerance)
        if ("all", "p50+p90") in agree:
            w, n = agree[("all", "p50+p90")]
            per = ", ".join(f"{m.upper()} {q} {agree[(m, q)][0]}/{agree[(m, q)][1]}" for m in ("ttft", "itl")
                            for q in ("p50", "p90") if (m, q) in agree)
            lines.append(f"* noise floor — each run against the median of its cell's other repeats: {w}/{n} = "
                         f"{w / n * 100:.0f}% within {tolerance * 100:.0f}% ({per}): what a prediction exact on "
                         "every cell's typical value would score")
        if predicted and fit_key:
            w, n = cell_agreement(measured, predicted, fit_key, tolerance)
            if n:
                lines.append(f"* against each cell's typical value (the median of its repeats; the fitted run's cell "
                             f"left out): {w}/{n} = {w / n * 100:.0f}% of the p50 and p90 predictions within "
                             f"{tolerance * 100:.0f}% (beside the target's per-run share)")
    es = [r["error"] for r in oos if r["q"] == "p99"]
    if es:
        lines.append(f"* p99 (reported, no target): {sum(abs(e) <= tolerance for e in es)}/{len(es)} within "
                     f"{tolerance * 100:.0f}%, median |error| {statistics.median(abs(e) for e in es) * 100:.0f}%")
    if ranks:
        lines += ["", "| trace · rate · repeat | metric | measured order (best first) | predicted order | right |",
                  "|---|---|---|---|---|"]
        for g in ranks:
            lines.append(f"| {g['trace']} · {g['rate']:g} · {g['rep']}{' (holds the fit)' if g['has_fit'] else ''} | "
                         f"{g['metric'].upper()} p90 | {', '.join(g['measured'])} | {', '.join(g['predicted'])} | "
                         f"{'yes' if g['right'] else 'no'} ({g['pairs'][0]}/{g['pairs'][1]} pairs) |")
        right = sum(g["right"] for g in ranks)
        lines.append(f"\n* **ranking right in {right}/{len(ranks)} = {right / len(ranks) * 100:.0f}%** of "
                     f"(run, metric) groups (target ≥ 90%)")
    if measured and predicted:
        res = resolved_ranking(measured, predicted)
        if res:
            n_res = sum(g["resolved"] for g in res)
            ok = sum(g["right_pairs"] for g in res)
            right = sum(g["right"] for g in res)
            lines.append(f"* ranking by what the measurement resolves (pairs whose repeats do not interleave, per "
                         f"trace and rate): {right}/{len(res)} = {right / len(res) * 100:.0f}% of (trace, rate, metric) "
                         f"groups right; {ok}/{n_res} resolved pairs right, "
                         f"{sum(g['pairs'] for g in res) - n_res} of {sum(g['pairs'] for g in res)} pairs unresolved")
    return "\n".join(lines)


def _requests_path(out: Path, k: str) -> Path:
    return out / "requests" / f"{k.replace('|', '_').replace('+', '-')}.json"


def attainment(out: Path, k: str, slo_ttft: float, slo_tpot: float) -> float | None:
    """Share of a measured run's requests that finished within both per-request SLOs (TTFT ≤
    ``slo_ttft``, time per output token ≤ ``slo_tpot``: DistServe's goodput criterion); a failed
    request misses. None when the run's requests were not kept."""
    path = _requests_path(out, k)
    if not path.exists():
        return None
    res = json.loads(path.read_text())
    good = 0
    for r in res:
        if not r["ok"] or r["ttft_s"] is None or r["ttft_s"] > slo_ttft:
            continue
        n, e2e = r["output_tokens"], r["e2e_s"]
        if n >= 2 and e2e is not None and (e2e - r["ttft_s"]) / (n - 1) > slo_tpot:
            continue
        good += 1
    return good / max(1, len(res))


def modes_table(measured: dict, predicted: dict, out: Path, args) -> str:
    """Measured on this machine, per (trace, rate), the median over repeats of each mode's SLO
    attainment (measured → predicted), TTFT p90 and ITL p90; and the conditional router's
    attainment against the best fixed mode's."""
    cells: dict[tuple, dict] = {}
    for k in measured:
        mode, trace, rate, _ = k.split("|")
        cells.setdefault((trace, float(rate)), {}).setdefault(mode, []).append(k)
    head = (f"Measured, per trace and rate (median of the repeats): SLO attainment at TTFT ≤ {args.slo_ttft:g} s and "
            f"time per output token ≤ {args.slo_tpot * 1e3:g} ms (measured → predicted), TTFT p90, ITL p90")
    lines = [head, "", "| trace · rate | " + " | ".join(args.modes) + " | conditional vs best fixed |",
             "|---|" + "---|" * (len(args.modes) + 1)]
    for (trace, rate), by_mode in sorted(cells.items()):
        parts, att = [], {}
        for mode in args.modes:
            ks = by_mode.get(mode, [])
            if not ks:
                parts.append("—")
                continue
            a = [attainment(out, k, args.slo_ttft, args.slo_tpot) for k in ks]
            a = [x for x in a if x is not None]
            att[mode] = statistics.median(a) if a else float("nan")
            pa = statistics.median(predicted[k]["slo_attainment"] for k in ks)
            ttft = statistics.median(measured[k]["ttft"]["p90"] for k in ks)
            itl = statistics.median(measured[k]["itl"]["p90"] for k in ks)
            parts.append(f"{att[mode] * 100:.0f}% → {pa * 100:.0f}%; {ttft:.2f} s; {itl * 1e3:.1f} ms")
        fixed = {m: v for m, v in att.items() if m != "conditional"}
        verdict = "—"
        if "conditional" in att and fixed:
            best = max(fixed, key=fixed.get)
            gap = att["conditional"] - fixed[best]
            verdict = (f"{att['conditional'] * 100:.0f}% vs {fixed[best] * 100:.0f}% ({best}): "
                       f"{'within 5 points' if gap >= -0.05 else f'{gap * 100:+.0f} points'}")
        lines.append(f"| {trace} · {rate:g} | " + " | ".join(parts) + f" | {verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from shared.config import Settings

    p = argparse.ArgumentParser(prog="pdserve bench sim-validate", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=24, help="requests per run")
    p.add_argument("--rates", default="0.4,0.8,1.2", help="req/s; the middle one is the fitted run's")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--traces", default=",".join(TRACES))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--fit", default="", help="mode|trace|rate|repeat of the fitted run "
                   "(default disaggregated|mix|<middle rate>|0)")
    p.add_argument("--short", type=int, default=96)
    p.add_argument("--long", type=int, default=1536)
    p.add_argument("--output-tokens", type=int, default=48)
    p.add_argument("--slo-ttft", type=float, default=4.0, help="s, for SLO attainment")
    p.add_argument("--slo-tpot", type=float, default=0.025, help="s per output token, for SLO attainment")
    p.add_argument("--crossover", type=int, default=128, help="the conditional router's local limit")
    p.add_argument("--max-queue-time", type=float, default=None,
                   help="the deployments' PD_MAX_QUEUE_TIME_S, modelled by the twins (default: PD_* as set)")
    p.add_argument("--tolerance", type=float, default=0.15)
    p.add_argument("--tie", type=float, default=0.05, help="measured values this close rank as a tie")
    p.add_argument("--profile", default="", help="use this profile instead of measuring one now")
    p.add_argument("--dev-repeats", default="", help="repeats looked at while the model was developed; the "
                   "share over the others is printed as held out")
    p.add_argument("--out", default="")
    p.add_argument("--measured", default="", help="re-predict a previous run's --out folder (no new runs)")
    args = p.parse_args(argv or [])
    args.rates = [float(x) for x in args.rates.split(",") if x]
    args.traces = [t for t in args.traces.split(",") if t]
    args.modes = [m for m in args.modes.split(",") if m]
    args.dev_repeats = tuple(int(x) for x in args.dev_repeats.split(",") if x)
    for t in args.traces:
        workload(t, 1.0, args)  # an unknown trace is refused before anything is deployed
    if args.measured:
        args.out = args.measured
    args.out = args.out or f"reports/sim-oos-{time.strftime('%Y%m%d-%H%M%S')}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    say = print
    env = dict(os.environ)
    env.setdefault("PD_TORCH_THREADS", "1")
    base = Settings.from_env(env)
    if args.max_queue_time is None:
        args.max_queue_time = base.max_queue_time_s
    profile_path = Path(args.profile) if args.profile else out / "profile.json"
    if profile_path.exists():
        profile = Profile.load(profile_path)
    else:
        from sim.measure import measure as measure_profile

        say("oos: profiling this machine now ...")
        profile = measure_profile(base.replace(speculative_method="off"), quick=True,
                                  max_prompt=max(args.long, 2048), max_batch=32, say=say)
        profile.save(profile_path)
    if args.measured:
        measured = json.loads((out / "measured.json").read_text())
    else:
        from loadtest.bench_modes import _vocab

        measured = measure(base, args, _vocab(base), say)
    mid = args.rates[len(args.rates) // 2]
    fit_key = args.fit or key("disaggregated", args.traces[0], mid, 0)
    if fit_key not in measured:
        raise SystemExit(f"the fitted run {fit_key!r} was not measured (have: {', '.join(measured)})")
    prof, fitted = frozen_profile(profile, measured, fit_key, args)
    predicted = predict(prof, measured, args)
    rs = rows(measured, predicted, fit_key)
    ranks = ranking(measured, predicted, fit_key, args.tie)
    loads = [m["load_average"][0] for m in measured.values()]
    head = (f"out of sample: step costs fitted on {fit_key} only (decode ×{fitted['decode']:.2f}, prefill "
            f"×{fitted['prefill']:.2f}, co-run ×{fitted['corun']:.2f}, loop {fitted['step_loop_s'] * 1e3:.2f} ms, "
            f"pipeline {prof.pipeline_s * 1e3:.1f} ms from the {fitted.get('pipeline_from', 'probe')}; {fitted['steps']} steps), frozen; {len(measured)} runs of "
            f"{args.requests} requests, {args.output_tokens} output tokens each; rates {args.rates} req/s; "
            f"profile {profile.name} (measured {profile.measured}); load average over the runs "
            f"{min(loads):.2f}-{max(loads):.2f}; speculation off")
    text = head + "\n\n" + report(rs, ranks, args.tolerance, measured, predicted, args.dev_repeats, fit_key) + "\n\n" + modes_table(measured, predicted, out, args)
    print("\n" + text)
    (out / "oos.md").write_text(text + "\n")
    (out / "oos.json").write_text(json.dumps({"args": vars(args), "fit_key": fit_key, "fitted": fitted,
                                              "frozen_profile": prof.__dict__, "rows": rs, "ranking": ranks,
                                              "predicted": predicted}, indent=1, default=str))
    print(f"report: {out / 'oos.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
