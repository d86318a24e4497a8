"""Heterogeneous pools (issue 34; the seeds: "CPUs for input, GPUs for output"): the cheapest
deployment meeting per-request SLOs when prefill and decode pools may run on different hardware,
each with a cost per worker-hour.

A :class:`Hardware` option is one worker class: a profile (one GPU kind at one tensor-parallel
degree: a model's TP degrees are searched by giving one profile per degree) and its price. A
:class:`Deployment` is aggregated ×N on one option, or P prefill workers on one option and D
decode workers on another (or the same), disaggregated or conditional, with per-role engine
settings. Its cost is Σ workers × cost per worker-hour.

:func:`plan_cheapest` searches per (mode, prefill option, decode option): the pool sizes from
lower bounds (each pool's share of the trace's work over one worker's capacity) upwards — for
aggregated the first N that meets the SLOs; for a split, for each P from its bound to two above,
the first D that meets them (a size dearer than the cheapest found is not tried, and a search
stops when three more workers gained no attainment) — then, at the cheapest size found and one worker less, the per-role
settings of :data:`SETTINGS`. :func:`exhaustive_cheapest` tries every size up to a bound with
every setting: the reference the planner is tested against (``tests/unit/test_pools.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from sim.metrics import meets_slos
from sim.profile import CostModel, Profile
from sim.simulator import Topology, simulate


@dataclass(frozen=True)
class Hardware:
    """One worker class: ``profile`` and its ``cost_per_hour`` (any currency, per worker)."""

    name: str
    profile: Profile
    cost_per_hour: float


@dataclass
class Deployment:
    """What to run: ``topo`` (mode, sizes, per-role settings) on ``prefill`` / ``decode``
    hardware (aggregated: ``decode`` only); ``summary`` is its simulation."""

    topo: Topology
    decode: Hardware
    prefill: Hardware | None = None
    summary: dict = field(default_factory=dict)

    @property
    def cost_per_hour(self) -> float:
        if self.topo.mode == "aggregated":
            return self.topo.workers * self.decode.cost_per_hour
        return self.topo.prefill * self.prefill.cost_per_hour + self.topo.decode * self.decode.cost_per_hour

    @property
    def heterogeneous(self) -> bool:
        return self.prefill is not None and self.prefill.name != self.decode.name

    def label(self) -> str:
        if self.topo.mode == "aggregated":
            return f"{self.topo.label()} on {self.decode.name}"
        roles = f" {self.topo.roles}" if self.topo.roles else ""
        return (f"{self.topo.mode} {self.topo.prefill}P on {self.prefill.name} : {self.topo.decode}D on "
                f"{self.decode.name}{roles}")


#: Per-role engine settings searched: aggregated chunk sizes; split (prefill chunk, decode max_num_seqs share).
SETTINGS = {
    "aggregated": [{}, {"decode": {"max_prefill_chunk_tokens": 512, "max_num_batched_tokens": 512}},
                   {"decode": {"max_prefill_chunk_tokens": 2048, "max_num_batched_tokens": 2048}}],
    "split": [{}, {"prefill": {"max_prefill_chunk_tokens": 2048, "max_num_batched_tokens": 2048}},
              {"decode": {"max_num_seqs": 32}}],
}


def _evaluate(reqs, dep: Deployment, slo: tuple, attainment: float) -> bool:
    if dep.topo.mode == "aggregated":
        s = simulate(reqs, dep.topo, dep.decode.profile, *slo)
    else:
        pre = dep.prefill.profile if dep.heterogeneous else None
        s = simulate(reqs, dep.topo, dep.decode.profile, *slo, prefill_profile=pre)
    dep.summary = s
    return meets_slos(s, *slo, attainment)


def _work(reqs, profile: Profile, batch: int = 32) -> tuple[float, float]:
    """(prefill, decode) seconds of the trace's work on one ``profile`` worker."""
    cost = CostModel(profile)
    pre = sum(cost.prefill_whole(r.prompt_tokens) for r in reqs)
    dec = sum(r.max_tokens * cost.decode_step(batch, batch * r.prompt_tokens) / batch for r in reqs)
    return pre, dec


def _span(reqs) -> float:
    return max(reqs[-1].arrival_s - reqs[0].arrival_s, 1e-9) if len(reqs) > 1 else 1.0


def _topo(mode: str, base: dict, roles: dict, workers: int = 1, prefill: int = 1, decode: int = 1) -> Topology:
    return Topology(mode=mode, workers=workers, prefill=prefill, decode=decode, roles=roles, **base)


def plan_cheapest(reqs, hardware: list[Hardware], slo_ttft: float, slo_tpot: float, *, attainment: float = 0.9,
                  modes=("aggregated", "disaggregated", "conditional"), max_workers: int = 64,
                  base: dict | None = None, say=print) -> dict:
    """The cheapest :class:`Deployment` meeting the SLOs found by the search of the module doc.

    Returns:
        ``{"best": Deployment or None, "tried": [Deployment, ...]}``.
    """
    base = base or {}
    slo = (slo_ttft, slo_tpot)
    tried: list[Deployment] = []
    found: list[Deployment] = []

    def run(dep: Deployment) -> bool:
        ok = _evaluate(reqs, dep, slo, attainment)
        tried.append(dep)
        say(f"plan: {dep.label():70s} {dep.cost_per_hour:8.2f}/h  attainment "
            f"{dep.summary['slo_attainment'] * 100:5.1f}%  {'meets' if ok else '-'}")
        if ok:
            found.append(dep)
        return ok

    span = _span(reqs)

    def bound() -> float:  # the cheapest found so far: dearer candidates are not simulated
        return min((d.cost_per_hour for d in found), default=math.inf)

    def grow(make, start: int, stop: int) -> None:
        """Sizes ``start``.. upwards until one meets the SLOs, costs more than the cheapest
        found, or three more workers gained no attainment (the SLO is out of this option's reach)."""
        history: list[float] = []
        for k in range(start, stop + 1):
            dep = make(k)
            if dep.cost_per_hour > bound():
                return
            if run(dep):
                return
            history.append(dep.summary["slo_attainment"])
            if len(history) > 3 and history[-1] <= max(history[-4:-1]) + 1e-3:
                return

    for hw in hardware if "aggregated" in modes else []:
        pre, dec = _work(reqs, hw.profile)
        grow(lambda n, hw=hw: Deployment(_topo("aggregated", base, {}, workers=n), hw),
             max(1, math.floor((pre + dec) / span)), max_workers)
    for mode in [m for m in ("disaggregated", "conditional") if m in modes]:
        for hp in hardware:
            for hd in hardware:
                p0 = max(1, math.floor(_work(reqs, hp.profile)[0] / span))
                d0 = max(1, math.floor(_work(reqs, hd.profile)[1] / span))
                for p in range(p0, p0 + 3):
                    grow(lambda d, p=p, hp=hp, hd=hd, mode=mode: Deployment(_topo(mode, base, {}, prefill=p, decode=d),
                                                                            hd, hp),
                         d0, max(d0, max_workers - p))
    if not found:
        return {"best": None, "tried": tried}
    # settings at the cheapest sizes per (mode, hardware), and one worker less
    seeds = {}
    for dep in found:
        key = (dep.topo.mode, dep.prefill.name if dep.prefill else "", dep.decode.name)
        if key not in seeds or dep.cost_per_hour < seeds[key].cost_per_hour:
            seeds[key] = dep
    for dep in list(seeds.values()):
        kind = "aggregated" if dep.topo.mode == "aggregated" else "split"
        for roles in SETTINGS[kind][1:]:
            sizes = [dep.topo]
            t = dep.topo
            if kind == "aggregated" and t.workers > 1:
                sizes.append(replace(t, workers=t.workers - 1))
            elif kind == "split":
                sizes += [replace(t, decode=t.decode - 1)] if t.decode > 1 else []
                sizes += [replace(t, prefill=t.prefill - 1)] if t.prefill > 1 else []
            for topo in sizes:
                cand = Deployment(replace(topo, roles=roles), dep.decode, dep.prefill)
                if cand.cost_per_hour <= bound():
                    run(cand)
    best = min(found, key=lambda d: (round(d.cost_per_hour, 6), -d.summary["slo_attainment"]))
    return {"best": best, "tried": tried}


def exhaustive_cheapest(reqs, hardware: list[Hardware], slo_ttft: float, slo_tpot: float, *,
                        attainment: float = 0.9, modes=("aggregated", "disaggregated", "conditional"),
                        max_pool: int = 6, base: dict | None = None) -> Deployment | None:
    """Every aggregated N ≤ ``2·max_pool`` and every P, D ≤ ``max_pool`` on every pair of
    options, with every setting of :data:`SETTINGS`: the cheapest meeting the SLOs (slow)."""
    base = base or {}
    slo = (slo_ttft, slo_tpot)
    cands: list[Deployment] = []
    for hw in hardware if "aggregated" in modes else []:
        for n in range(1, 2 * max_pool + 1):
            cands += [Deployment(_topo("aggregated", base, roles, workers=n), hw) for roles in SETTINGS["aggregated"]]
    for mode in [m for m in ("disaggregated", "conditional") if m in modes]:
        for hp in hardware:
            for hd in hardware:
                for p in range(1, max_pool + 1):
                    for d in range(1, max_pool + 1):
                        cands += [Deployment(_topo(mode, base, roles, prefill=p, decode=d), hd, hp)
                                  for roles in SETTINGS["split"]]
    cands.sort(key=lambda d: d.cost_per_hour)
    best = None
    for dep in cands:
        if best is not None and dep.cost_per_hour > best.cost_per_hour:
            break
        if _evaluate(reqs, dep, slo, attainment) and (best is None or dep.summary["slo_attainment"] >
                                                      best.summary["slo_attainment"]):
            best = dep
    return best
