"""A simulation's raw timings and their summary: the metrics of :mod:`loadtest.client`
(TTFT, ITL per gap, TPOT, E2E, goodput after DistServe, Zhong et al. 2024), computed with numpy.

ITL gaps come as (value, weight) pairs — a run of ``k`` equal-batch decode steps is one pair
of weight ``k − 1`` (its mean gap) — so percentiles are weighted (the inverse of the weighted
empirical CDF).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SimResult:
    """Raw outputs. Times in simulated seconds from the trace's start; lists indexed by request."""

    label: str
    arrival: list[float]
    first: list[float]
    last: list[float]
    n_out: list[int]
    gap_v: list[float]
    gap_w: list[int]
    utilization: dict
    sim_s: float
    wall_s: float
    events: int
    remote: int
    finished: int
    preemptions: int = 0
    cpu_s: float = 0.0
    gap_r: list[int] | None = None  # the request of each gap
    kv: dict | None = None  # the KV hand-off's seconds: store puts, gets, waits for the store, engine imports

    def only(self, keep: list[bool]) -> SimResult:
        """The same run counting only requests ``i`` with ``keep[i]`` (e.g. those a measured
        run completed), their gaps included."""
        from dataclasses import replace

        nan = float("nan")
        gi = [j for j, r in enumerate(self.gap_r or []) if keep[r]]
        return replace(self, first=[f if k else nan for f, k in zip(self.first, keep)],
                       last=[x if k else nan for x, k in zip(self.last, keep)],
                       gap_v=[self.gap_v[j] for j in gi], gap_w=[self.gap_w[j] for j in gi],
                       gap_r=[self.gap_r[j] for j in gi])


def weighted_percentiles(values, weights, qs=(50, 90, 99, 99.9)) -> dict:
    """{"p50": ..., "p99.9": ...} of ``values`` counted ``weights`` times each; None when empty."""
    if len(values) == 0:
        return {f"p{q}": None for q in qs} | {"mean": None}
    v = np.asarray(values, float)
    w = np.asarray(weights, float)
    order = np.argsort(v, kind="stable")
    v, w = v[order], w[order]
    cdf = np.cumsum(w)
    total = cdf[-1]
    out = {}
    for q in qs:
        i = int(np.searchsorted(cdf, q / 100.0 * total, side="left"))
        out[f"p{q:g}"] = float(v[min(i, len(v) - 1)])
    out["mean"] = float(np.sum(v * w) / total)
    return out


def _pcts(x: np.ndarray) -> dict:
    if x.size == 0:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    p = np.percentile(x, [50, 90, 99])
    return {"p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2]), "mean": float(x.mean())}


def summarize(r: SimResult, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    """Percentiles (seconds), rates (per second of simulated time), goodput, utilization and
    the simulator's speed (simulated requests per second of wall time)."""
    arrival = np.asarray(r.arrival)
    first = np.asarray(r.first)
    last = np.asarray(r.last)
    n = np.asarray(r.n_out)
    ok = ~np.isnan(first)
    ttft = first[ok] - arrival[ok]
    e2e = last[ok] - arrival[ok]
    many = ok & (n >= 2)
    tpot = (last[many] - first[many]) / (n[many] - 1)
    tpot_all = np.zeros(len(n))
    tpot_all[many] = tpot
    good = ok & (first - arrival <= slo_ttft_s) & (tpot_all <= slo_tpot_s)
    span = max(float(np.nanmax(last)) if ok.any() else 0.0, 1e-9)
    return {
        "topology": r.label,
        "requests": len(arrival),
        "finished": int(ok.sum()),
        "ttft": _pcts(ttft),
        "itl": weighted_percentiles(r.gap_v, r.gap_w),
        "tpot": _pcts(tpot),
        "e2e": _pcts(e2e),
        "requests_per_s": float(ok.sum()) / span,
        "output_tokens_per_s": float(n[ok].sum()) / span,
        "goodput_rps": float(good.sum()) / span,
        "slo_attainment": float(good.sum()) / max(1, len(arrival)),
        "utilization": r.utilization,
        "remote_share": r.remote / max(1, len(arrival)),
        "preemptions": r.preemptions,
        "sim_seconds": r.sim_s,
        "wall_seconds": r.wall_s,
        "sim_requests_per_wall_s": len(arrival) / max(r.wall_s, 1e-9),
        "cpu_seconds": r.cpu_s,
        "sim_requests_per_cpu_s": len(arrival) / max(r.cpu_s, 1e-9),
        "events": r.events,
        "kv": r.kv or {},
    }


def meets_slos(summary: dict, slo_ttft: float, slo_tpot: float, attainment: float = 0.9,
               slo_itl: float | None = None, percentile: int = 90) -> bool:
    """Whether a simulated deployment meets the SLOs (:mod:`sim.plan`'s criterion): every request
    finished, at least ``attainment`` of them within both per-request SLOs (their TTFT ≤
    ``slo_ttft`` s and TPOT ≤ ``slo_tpot`` s, :func:`sim.metrics.summarize` counts them with
    those SLOs) and, with ``slo_itl``, the pooled ITL at ``percentile`` ≤ ``slo_itl`` s."""
    if summary["finished"] < summary["requests"] or summary["slo_attainment"] < attainment:
        return False
    if slo_itl is not None:
        itl = summary["itl"][f"p{percentile}"]
        return itl is not None and itl <= slo_itl
    return True
