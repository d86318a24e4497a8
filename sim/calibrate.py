"""Calibrate a profile on a real run's own engine steps: the observed/expected correction of
NVIDIA Dynamo's SLA planner (``docs/architecture/sla_planner.md``: it scales its pre-deployment
prefill and decode interpolations by the ratio of what the live workers report to what the
profile predicted), applied per step with the step log the model workers write
(``PD_STEP_LOG_DIR``, :class:`services.common.engine_loop.EngineLoop`).

On a machine whose load changes minute to minute (other jobs share its cores), a profile
measured ten minutes before a run describes another machine. The run's own steps are measured
in the same window as its latencies, so the costs the simulator replays are those the
requests met; the latencies (queueing, batching, interleaving, the tails) are still predicted
by the simulator, not fitted.

What is fitted, from the steps inside the workload's window:

* ``decode`` — observed / profile-predicted time of decode-only steps, when no other model
  worker of the host was computing (time-weighted: Σ observed / Σ predicted); scales the decode
  context term and the fixed per-step cost, and — per batch-size point of the decode table
  (``decode_by_batch``: steps counted at the nearest point, points without steps
  interpolated) — the table itself, so a profile whose shape a loaded machine bent is
  straightened where the run has data;
* ``prefill`` — the same for steps that compute prompt tokens (``prefill_by_tokens`` per
  chunk-size point of the prefill table); the overall ratio scales the attention term;
* ``corun`` — the same ratio for steps that overlapped another worker's step, over the alone
  one: the host's co-running slowdown as the run met it (shared cores, memory bandwidth, and
  the services' CPU, which is busiest when both workers are) — it replaces the profile's
  ``corun_slowdown`` and the simulator's processor-sharing term (the topology's ``host_cores``
  is set to 0 by :func:`calibrated_topology`: that contention is inside the observed steps).
  It is one factor for every pair of workers: on the Intel Xeon runs of
  ``docs/data/sim-oos-xeon`` an aggregated deployment's decode steps beside the other worker's
  steps took 1.07x those alone (batch 1, 1,570 against 2,592 steps) and a disaggregated
  deployment's beside prefill steps 1.03-1.13x, where the profile measured 1.00x beside a
  matmul on the other core (``sim.measure``): the contention is the host's (the pipeline's
  services share the two cores), not one pairing's;
* ``jitter`` — the spread of each decode step's time over what those ratios predict for it
  (twenty equally likely levels, mean 1): the stretches in which other processes held the
  core. Decode steps only, and replayed on decode steps only: a prefill step of seconds
  averages such stalls out. A
  replay with the mean cost alone gets the median inter-token gap too long and the tail too
  short; with ``Profile.step_jitter`` each step draws a level;
* ``load_timeline`` — observed over predicted per :data:`LOAD_BIN_S` of the run: the
  machine's speed as the other jobs on it left it, minute to minute (1.0 throughout on a
  machine of one's own). A replay of that run (``Profile.load_timeline``) meets the same
  slow and fast stretches at the same times; queueing, batching and the tails are still the
  simulator's. The jitter is what is left within a bin;
* ``step_loop_s`` — the median gap between consecutive decode steps of a busy worker: the
  worker loop's own time per step (queued calls, handing outputs to the event loop).
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from sim.profile import CostModel, Profile, monotone, smooth_prefill


@dataclass
class StepLog:
    """One worker's steps: ``header`` (stage, instance, cpus, pid) and records
    ``(start, seconds, [[chunk, context], ...], decode batch, decode context)``."""

    header: dict
    steps: list[tuple]


def smoothed(profile: Profile) -> Profile:
    """``profile`` with its prefill table smoothed (:func:`sim.profile.smooth_prefill`: the
    least-squares ``a + b n + c n²``) and its ``prefill_attn_s`` that fit's own quadratic term
    (``2c`` seconds per pair of tokens: a prompt of ``n`` tokens has ``n²/2`` pairs), so that a
    step of several prompts — ``prefill(N)`` less the pairs between different prompts
    (:meth:`sim.profile.CostModel.step`) — costs ``a + b·N + c·Σ n²``: one step's constant, the
    linear layers over all ``N`` tokens and each prompt's attention over itself.

    Why: the profile's own ``prefill_attn_s`` (``sim.measure`` until 2026-12-06: a 1,024-token
    prompt against two of 512, each timed apart from the table) disagreed with the table it is
    subtracted from — 5.3e-7 s against the table's 7.2e-7 on the Zen 4 profile of
    ``docs/data/sim-oos-zen4``, 0 against 2.4e-6 on the AVX2 one of ``docs/data/sim-oos-avx2`` —
    which priced a step of four 512-token prompts 8 % and 32 % above the four alone. A table of
    fewer than four points (not smoothed) is returned as it is."""
    attn = table_attention(profile.prefill_tokens, profile.prefill_s)
    if attn is None:
        return profile
    return replace(profile, prefill_s=smooth_prefill(profile.prefill_tokens, profile.prefill_s), prefill_attn_s=attn)


def table_attention(tokens: list[int], seconds: list[float]) -> float | None:
    """Seconds per pair of tokens attending to each other inside one prompt that a prefill table
    (``seconds[i]`` for a prompt of ``tokens[i]`` tokens) holds: twice the ``n²`` coefficient of
    its fit :func:`sim.profile.smooth_prefill`. None for a table that is not fitted (fewer than
    four points, or a time that is not positive)."""
    if len(tokens) < 4 or min(seconds) <= 0:
        return None
    values = smooth_prefill(tokens, seconds)
    # the smoothed values lie on the fitted quadratic: its n² coefficient, exactly
    c = float(np.polyfit(np.asarray(tokens, dtype=np.float64), np.asarray(values, dtype=np.float64), 2)[0])
    return 2 * max(0.0, c)


def read_step_logs(folder: str | Path) -> list[StepLog]:
    """Every ``*.jsonl`` step log in ``folder`` (one per model worker process)."""
    logs = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        header, steps = {}, []
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            if isinstance(rec, dict):
                header = rec.get("header", {})
            else:
                steps.append(tuple(rec))
        logs.append(StepLog(header, steps))
    return logs


def _overlap(intervals: list[tuple[float, float]], starts: list[float], a: float, b: float) -> float:
    """Seconds of [a, b] covered by ``intervals`` (sorted, disjoint; ``starts`` their starts)."""
    i = max(0, bisect.bisect_right(starts, a) - 1)
    cover = 0.0
    while i < len(intervals) and intervals[i][0] < b:
        s, e = intervals[i]
        cover += max(0.0, min(b, e) - max(a, s))
        i += 1
    return cover


def fit(profile: Profile, logs: list[StepLog], window: tuple[float, float] | None = None,
        decode_by_point: bool = True) -> dict:
    """Observed/predicted ratios of the run's steps (see module doc), after refitting the
    profile's context-attention term on the run's prefill steps (:func:`_attention`: only
    where the run has chunks after a context); the result's ``prefill_ctx_attn_s`` is in the
    profile's units, before scaling by the prefill ratio."""
    ctx = profile.ctx_attn_s
    first = _ratios(profile, logs, window, decode_by_point)
    attn = _attention(profile, first)
    if attn is None:
        return first | {"prefill_ctx_attn_s": ctx}
    return _ratios(replace(profile, prefill_ctx_attn_s=attn), logs, window, decode_by_point) | {
        "prefill_ctx_attn_s": attn}


def _attention(profile: Profile, f: dict) -> float | None:
    """The context-attention coefficient the run's prefill steps show, in the profile's
    units: least squares of each step's alone time (decodes beside it taken off) on the
    profile's cost of its chunks without context ``T`` (the table at their total, less the
    pairs between different chunks) and its context pairs ``P`` (each chunk's tokens × its
    context), ``obs ≈ a·T + b·P`` with a, b ≥ 0; returns ``b / a``. None with fewer than four
    prefill steps that have context pairs, or no spread in ``P`` (a run of prompts that each
    fit one chunk says nothing about it: the profile's stands)."""
    rows = f.get("_prefill_rows") or []
    if sum(1 for _, _, pp in rows if pp > 0) < 4:
        return None
    sx = [[0.0, 0.0], [0.0, 0.0]]
    sy = [0.0, 0.0]
    for y, t, pp in rows:
        sx[0][0] += t * t
        sx[0][1] += t * pp
        sx[1][1] += pp * pp
        sy[0] += t * y
        sy[1] += pp * y
    det = sx[0][0] * sx[1][1] - sx[0][1] ** 2
    if det <= 1e-12 * max(sx[0][0] * sx[1][1], 1e-300):
        return None
    a = (sy[0] * sx[1][1] - sy[1] * sx[0][1]) / det
    b = (sx[0][0] * sy[1] - sx[0][1] * sy[0]) / det
    if b < 0 or a <= 0:  # the attention pairs explain nothing: none of it
        return 0.0 if a > 0 or sy[0] > 0 else None
    return b / a


def _ratios(profile: Profile, logs: list[StepLog], window: tuple[float, float] | None,
            decode_by_point: bool = True) -> dict:
    """Observed/predicted ratios of the run's steps with ``profile`` as it is.

    Args:
        profile: the profile whose predictions are corrected.
        logs: the run's step logs (all its model workers; all on one host).
        window: (start, end) on the step logs' clock; steps outside are ignored.
        decode_by_point: a decode ratio per point of the decode table (the run's steps of each
            batch size); False: the run's overall decode ratio at every point — the profile's
            shape kept, its level corrected. A prediction of other runs wants False: one run's
            per-batch ratios are noisy where it has few steps and are held constant past its
            largest batch (on the AVX2 EPYC, batches 6-11 of the fitted run gave 0.83 at the
            point 8 and so at 16 and 32, where the other runs' steps showed 0.9-1.0).

    Returns:
        ``{"decode", "prefill", "corun", "decode_by_batch", "prefill_by_tokens", "jitter",
        "load_timeline", "step_loop_s", "steps", "spread", "seconds"}`` (module doc) —
        ``spread`` is the (p10, p50, p90) of per-step ratios of alone decode steps, ``seconds``
        the observed seconds by kind of step. Ratios default to 1.0 where there were no steps.
    """
    cost = CostModel(replace(profile, step_loop_s=0.0))
    busy = []
    for log in logs:
        iv = sorted((s[0], s[0] + s[1]) for s in log.steps)
        busy.append((iv, [a for a, _ in iv]))
    sums = {k: [0.0, 0.0] for k in ("decode", "prefill", "decode_co", "prefill_co")}
    gaps, ratios, seen, pre_rows, n = [], [], [], [], 0
    for w, log in enumerate(logs):
        prev = None
        for start, seconds, chunks, batch, ctx in log.steps:
            if window and not (window[0] <= start <= window[1]):
                prev = None
                continue
            n += 1
            expected = cost.step([tuple(c) for c in chunks], batch, ctx)
            co = sum(_overlap(iv, st, start, start + seconds) for v, (iv, st) in enumerate(busy) if v != w)
            kind = ("prefill" if chunks else "decode") + ("_co" if co > 0.5 * seconds else "")
            sums[kind][0] += seconds
            sums[kind][1] += expected
            if expected > 0:
                seen.append((seconds, expected, kind, sum(c[0] for c in chunks) if chunks else batch, start))
            if chunks:
                pre_rows.append((seconds, kind, chunks, batch, ctx))
            if kind == "decode" and expected > 0:
                ratios.append(seconds / expected)
            if prev is not None and not chunks and not prev[2]:
                gap = start - (prev[0] + prev[1])
                if 0 <= gap < 0.05:
                    gaps.append(gap)
            prev = (start, seconds, chunks)

    def ratio(k: str, default: float = 1.0) -> float:
        o, e = sums[k]
        return o / e if e > 0 else default

    # decode steps come both alone and beside another worker's: they give the co-run factor;
    # prefill steps (mostly beside decodes) are then counted at their alone time
    dec, pre = ratio("decode"), ratio("prefill")
    if sums["decode"][1] and sums["decode_co"][1]:
        corun = max(1.0, ratio("decode_co") / dec)
    else:
        dec = dec if sums["decode"][1] else pre
        pre = pre if sums["prefill"][1] else dec
        co_obs = sums["decode_co"][0] + sums["prefill_co"][0]
        co_alone = sums["decode_co"][1] * dec + sums["prefill_co"][1] * pre  # what they'd take alone
        corun = max(1.0, co_obs / co_alone) if co_alone > 0 else 1.0
    pre_e = sums["prefill"][1] + sums["prefill_co"][1]
    if pre_e:
        pre = (sums["prefill"][0] + sums["prefill_co"][0] / corun) / pre_e
    if not sums["decode"][1]:
        dec = ratio("decode_co", pre * corun) / corun
    spread = tuple(_quantiles(ratios, (0.1, 0.5, 0.9))) if ratios else (1.0, 1.0, 1.0)
    # by table point: the profile's shape corrected where the run has steps of that size
    by = {"decode": (_by_point(profile.decode_batch, [x for x in seen if not x[2].startswith("prefill")], corun, dec)
                     if decode_by_point else [round(dec, 4)] * len(profile.decode_batch)),
          "prefill": _by_point(profile.prefill_tokens, [x for x in seen if x[2].startswith("prefill")], corun, pre)}
    tables = {k: (profile.decode_batch if k == "decode" else profile.prefill_tokens, v) for k, v in by.items()}

    def predicted(e: float, kind: str, size: int) -> float:
        xs, rs = tables[kind.removesuffix("_co")]
        return e * rs[_nearest(xs, size)] * (corun if kind.endswith("_co") else 1.0)

    # the machine's speed over the run: predicted/observed per LOAD_BIN_S of the window, then
    # each step over what the fitted ratios and its bin's factor predict for it: the jitter
    t0 = window[0] if window else min((x[4] for x in seen), default=0.0)
    nbins = int(max((x[4] - t0 for x in seen), default=0.0) // LOAD_BIN_S) + 1
    bo, bp = [0.0] * nbins, [0.0] * nbins
    for o, e, k, size, start in seen:
        b = int((start - t0) // LOAD_BIN_S)
        bo[b] += o
        bp[b] += predicted(e, k, size)
    timeline = [round(bo[b] / bp[b], 4) if bp[b] > 0 else 1.0 for b in range(nbins)]
    resid = [o / predicted(e, k, size) / timeline[int((start - t0) // LOAD_BIN_S)] for o, e, k, size, start in seen
             if not k.startswith("prefill")]  # a step of seconds averages the short stalls out
    jitter = _quantiles(resid, [(i + 0.5) / JITTER_LEVELS for i in range(JITTER_LEVELS)]) if len(resid) >= 50 else []
    mean = sum(jitter) / len(jitter) if jitter else 1.0
    rows = []
    for o, kind, chunks, batch, ctx in pre_rows:
        o = o / (corun if kind.endswith("_co") else 1.0) - (cost.decode_step(batch, ctx) - cost.fixed) * dec * (batch > 0)
        total = sum(c[0] for c in chunks)
        cross = profile.prefill_attn_s * (total * total - sum(c[0] * c[0] for c in chunks)) / 2
        rows.append((o, cost.prefill(total) - cross, sum(c[0] * c[1] for c in chunks)))
    return {"decode": dec, "prefill": pre, "corun": corun, "jitter": [round(j / mean, 4) for j in jitter],
            "_prefill_rows": rows, "load_timeline": timeline,
            "decode_by_batch": by["decode"], "prefill_by_tokens": by["prefill"],
            "step_loop_s": statistics.median(gaps) if gaps else profile.step_loop_s,
            "steps": n, "spread": spread,
            "seconds": {k: round(v[0], 3) for k, v in sums.items()}}


#: seconds of one bin of the fitted load timeline
LOAD_BIN_S = 20.0

#: steps a table point needs for a ratio of its own (fewer: a loaded machine's noise)
MIN_POINT_STEPS = 8


def initial_rates(logs: list[StepLog], t0: float) -> dict[str, float]:
    """Each worker's prefill-rate EWMA (``EngineLoop._observe_rates``: steps of ≥ 32 tokens)
    over its steps before ``t0`` — the warm-up and probe requests: what its heartbeats told
    the conditional router when the workload began. Keyed ``<stage>-<i>`` (the launcher's
    name, the instance id without its suffix)."""
    out = {}
    for log in logs:
        name = "-".join(str(log.header.get("instance", "")).split("-")[:2])
        rate = 0.0
        for start, seconds, chunks, batch, _ in log.steps:
            tokens = sum(c[0] for c in chunks) + batch
            if start >= t0:
                break
            if tokens >= 32 and seconds > 0:
                rate = tokens / seconds if not rate else 0.8 * rate + 0.2 * tokens / seconds
        if name and rate:
            out[name] = rate
    return out


def _nearest(xs: list[int], x: int) -> int:
    """Index of the table point nearest ``x`` on a log scale."""
    lx = math.log(max(x, 1))
    return min(range(len(xs)), key=lambda i: abs(math.log(max(xs[i], 1)) - lx))


def _by_point(xs: list[int], seen: list[tuple], corun: float, overall: float) -> list[float]:
    """Observed/predicted per table point (steps assigned to the nearest point, co-run steps
    counted at their alone time); points with fewer than :data:`MIN_POINT_STEPS` steps
    interpolated between those with, ``overall`` (the run's ratio over all its steps of that
    kind, time-weighted) beyond them; all ``overall`` when none has. Beyond the observed points
    a held ratio would carry one size's overhead to every size: a run whose only frequent
    prefill steps were 32-token prompts (31 % over the profile there: a step's fixed costs)
    put 31 % on every 512-token step, whose own ratio was 13 %."""
    obs, exp, cnt = [0.0] * len(xs), [0.0] * len(xs), [0] * len(xs)
    for o, e, kind, size, _ in seen:
        i = _nearest(xs, size)
        obs[i] += o / (corun if kind.endswith("_co") else 1.0)
        exp[i] += e
        cnt[i] += 1
    have = [i for i in range(len(xs)) if exp[i] > 0 and cnt[i] >= MIN_POINT_STEPS]
    if not have:
        return [overall] * len(xs)
    r = {i: obs[i] / exp[i] for i in have}
    out = []
    for i in range(len(xs)):
        lo = max((j for j in have if j <= i), default=None)
        hi = min((j for j in have if j >= i), default=None)
        if lo is None or hi is None:
            out.append(overall)
        elif lo == hi:
            out.append(r[lo])
        else:
            out.append(r[lo] + (r[hi] - r[lo]) * (i - lo) / (hi - lo))
    return [round(x, 4) for x in out]


#: equally likely levels of the fitted step jitter
JITTER_LEVELS = 20


def _quantiles(xs: list[float], qs) -> list[float]:
    ys = sorted(xs)
    return [ys[min(len(ys) - 1, int(q * len(ys)))] for q in qs]


def apply(profile: Profile, f: dict, timeline: bool = True) -> Profile:
    """``profile`` with the fitted ratios applied (host-side CPU costs unchanged); with
    ``timeline`` the run's load timeline too (a replay of that run, time 0 its window's start)."""
    d = {
        "prefill_s": [x * r for x, r in zip(profile.prefill_s, f.get("prefill_by_tokens") or [f["prefill"]] * 99)],
        "prefill_attn_s": profile.prefill_attn_s * f["prefill"],
        "prefill_ctx_attn_s": f.get("prefill_ctx_attn_s", profile.ctx_attn_s) * f["prefill"],
        "decode_s": [x * r for x, r in zip(profile.decode_s, f.get("decode_by_batch") or [f["decode"]] * 99)],
        "decode_ctx_s": profile.decode_ctx_s * f["decode"],
        "step_fixed_s": profile.step_fixed_s * f["decode"],
        "corun_slowdown": f["corun"],
        "step_loop_s": f["step_loop_s"],
        "step_jitter": f.get("jitter", []),
        "load_timeline": f.get("load_timeline", []) if timeline else [],
        "load_bin_s": LOAD_BIN_S,
    }
    d["prefill_s"], d["decode_s"] = monotone(d["prefill_s"]), monotone(d["decode_s"])
    return replace(profile, **d)


def calibrated_topology(topo):
    """The topology to replay a calibrated profile on: the host's contention is in the fitted
    ``corun`` ratio, so processor sharing is not modelled again (``host_cores`` 0)."""
    return replace(topo, host_cores=0)
