"""Where splitting pays (issue 34): the crossover map of ``docs/scale.md``.

``pdserve simulate sweep [--out docs/scale.json] [--requests 300] [--workers 8]`` simulates every
cell of load × prompt mix × profile in the four modes at equal hardware (``--workers`` model
workers, each the profile's GPUs) and writes ``scale.json`` (stamped with the commit, each
profile's :meth:`~sim.profile.Profile.digest` and the simulator code's hash, so
``tests/unit/test_sweep.py`` refuses a stale one), ``scale.md`` and ``scale.png``.

Modes (the "best aggregated configuration" is the better of the first two):

* ``aggregated``: whole prompts (the step budget is the mix's longest prompt);
* ``aggregated+chunked``: chunked prefill, the better of 512- and 2,048-token chunks (budget =
  chunk, as vLLM's ``max_num_batched_tokens``);
* ``disaggregated``: prefill pool (chunks of up to 8,192 tokens) and decode pool; the best of the
  prefill counts next to the mix's prefill share of compute;
* ``conditional``: the same pools, the tokenizer's router deciding per request (local limit 512).

Load: arrivals rescaled so the offered work (each request's prefill of the tokens an unbounded
prefix cache would not hit, with attention to the hit context, plus its decode at batch 32) is
``load`` × the deployment's capacity. SLOs ("tight"): TTFT ≤ max(0.5 s, 3 × the p90 of a
request's prefill alone on an idle worker), TPOT ≤ 3 × a batch-1 decode step at the mix's mean
prompt length — per request (DistServe's attainment, Zhong et al., OSDI 2024).

Measures per cell and mode: per-request TPOT p90, ITL p90 / p99 / p99.9 (pooled gaps), TTFT
p90, SLO attainment, goodput per worker (requests meeting both SLOs per second per worker);
per (profile, mix, mode): goodput per worker at ≥ 90 % attainment — the highest swept load's rate
per worker where ≥ 90 % of requests met both SLOs, or, where none did, the highest of the loads
0.3 / 0.2 / 0.1 / 0.05 that did (0: not even at 0.05) — a lower bound at the grid's resolution.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import subprocess
import time
from pathlib import Path

import numpy as np

from sim import trace as traces
from sim.profile import CostModel, Profile
from sim.simulator import Topology, simulate

ROOT = Path(__file__).resolve().parents[1]
PROFILES_DIR = ROOT / "docs" / "profiles"
#: The files whose code decides the simulated numbers (their hash is in the stamp; the report's
#: wording in this module is not, so ``--report-only`` can rewrite scale.md from the JSON).
CODE_FILES = ("sim/simulator.py", "sim/worker.py", "sim/profile.py", "sim/metrics.py", "sim/trace.py",
              "engine/scheduler.py", "engine/block_manager.py")
#: (profile, the mixes run on it, the prompt cap: the model's window).
GRID = [
    ("a100-llama2-7b", ("azure-conv", "azure-code", "mooncake"), 4096),
    ("a100x4-llama2-70b-tp4", ("azure-conv", "azure-code", "mooncake"), 4096),
    ("a100x4-llama2-70b-32k-tp4", ("azure-conv", "mooncake", "agentic"), 32768),
    ("h200-llama2-7b", ("azure-conv", "azure-code", "mooncake"), 4096),
]
#: Sensitivity rows: the seeds' regime on the long-context profile's MFU / MBU variants.
SENSITIVITY = [("a100x4-llama2-70b-32k-tp4-mfu0.35-mbu0.58", ("agentic",), 32768),
               ("a100x4-llama2-70b-32k-tp4-mfu0.65-mbu0.40", ("agentic",), 32768),
               ("h200-llama2-7b-ib", ("azure-conv", "azure-code", "mooncake"), 4096)]
LOADS = (0.4, 0.6, 0.8, 0.95)
MODES = ("aggregated", "aggregated+chunked", "disaggregated", "conditional")
MIX_NOTES = {
    "azure-conv": "Azure LLM inference trace 2023, conversation (Splitwise, Patel et al., ISCA 2024)",
    "azure-code": "Azure LLM inference trace 2023, code",
    "mooncake": "Mooncake conversation trace (Qin et al., FAST 2025), 512-token blocks as hash ids: prefix reuse",
    "agentic": "synthetic agentic sessions, 8-32k-token prompts, each turn resending its history (sim.trace.agentic)",
}


def code_digest() -> str:
    h = hashlib.sha256()
    for name in CODE_FILES:
        h.update((ROOT / name).read_bytes())
    return h.hexdigest()[:16]


def load_mix(name: str, n: int, max_prompt: int) -> list[traces.SimRequest]:
    """The first ``n`` requests of a mix (arrivals as the trace has them; rescaled later).
    ``n`` ≤ 500 reads the same requests from the bundled samples as from the full traces."""
    if name == "agentic":
        return traces.agentic(n, seed=0, max_tokens=max_prompt)
    sc = traces.Scaling(1.0, max_prompt, 2048, block_tokens=512)
    if name == "mooncake":
        return traces.mooncake("mooncake_conversation.jsonl", n, sc)
    return traces.azure(f"azure2023_{name.split('-')[1]}.csv", n, sc)


def request_work(reqs, cost: CostModel, block_size: int, batch: int = 32) -> tuple[list[float], list[float]]:
    """Per request, (prefill seconds alone on an idle worker with the prefix hits an unbounded
    cache would have, decode seconds at batch ``batch``)."""
    hits = traces.prefix_hit_tokens(reqs, block_size)
    pre = [cost.prefill(r.prompt_tokens - h) + cost.ctx_attn * (r.prompt_tokens - h) * h for r, h in zip(reqs, hits)]
    dec = [r.max_tokens * cost.decode_step(batch, batch * r.prompt_tokens) / batch for r in reqs]
    return pre, dec


def slos(reqs, profile: Profile) -> tuple[float, float]:
    """(TTFT, TPOT) SLOs in seconds for a mix on a profile (module doc)."""
    cost = CostModel(profile)
    pre, _ = request_work(reqs, cost, profile.block_size)
    mean_prompt = int(sum(r.prompt_tokens for r in reqs) / len(reqs))
    return max(0.5, 3 * float(np.percentile(pre, 90))), 3 * cost.decode_step(1, mean_prompt)


def _brief(s: dict, topo: Topology, n: int) -> dict:
    span = s["sim_seconds"] or 1e-9
    return {"config": topo.label(), "ttft_p90": s["ttft"]["p90"], "tpot_p90": s["tpot"]["p90"],
            "itl_p50": s["itl"]["p50"], "itl_p90": s["itl"]["p90"], "itl_p99": s["itl"]["p99"],
            "itl_p999": s["itl"]["p99.9"], "attainment": s["slo_attainment"],
            "goodput_per_worker": s["goodput_rps"] / n, "finished": s["finished"], "requests": s["requests"],
            "remote_share": s["remote_share"], "kv_wait_s": s["kv"].get("wait_s", 0.0), "sim_s": span}


def _better(a: dict, b: dict | None) -> bool:
    """Whether summary ``a`` beats ``b``: higher attainment, then lower per-request TPOT p90."""
    if b is None:
        return True
    return (round(a["attainment"], 3), -(a["tpot_p90"] or math.inf)) > (round(b["attainment"], 3),
                                                                         -(b["tpot_p90"] or math.inf))


def mode_topologies(mode: str, n: int, cap: int, share: float) -> list[Topology]:
    """The configurations a mode is tried in at ``n`` workers (module doc)."""
    base = dict(max_num_seqs=128)
    if mode == "aggregated":
        return [Topology(mode="aggregated", workers=n, max_num_batched_tokens=cap, **base)]
    if mode == "aggregated+chunked":
        return [Topology(mode="aggregated", workers=n, max_num_batched_tokens=chunk, max_prefill_chunk_tokens=chunk,
                         **base) for chunk in (512, 2048)]
    roles = {"prefill": {"max_num_batched_tokens": min(cap, 8192), "max_prefill_chunk_tokens": min(cap, 8192)},
             "decode": {"max_num_batched_tokens": 512, "max_prefill_chunk_tokens": 512}}
    ps = sorted({p for p in (math.floor(share * n), math.ceil(share * n), math.ceil(share * n) + 1) if 1 <= p < n})
    return [Topology(mode=mode, prefill=p, decode=n - p, local_max_tokens=512, roles=roles, **base) for p in ps]


def run_mode(reqs, profile: Profile, mode: str, n: int, cap: int, slo: tuple[float, float], share: float) -> dict:
    """A mode's best configuration in one cell (brief summary)."""
    best = None
    for topo in mode_topologies(mode, n, cap, share):
        b = _brief(simulate(reqs, topo, profile, *slo), topo, n)
        if _better(b, best):
            best = b
    return best


def run_cell(reqs, profile: Profile, n: int, cap: int, slo: tuple[float, float], share: float) -> dict:
    """{mode: brief summary} of one (profile, mix, load) cell at ``n`` workers."""
    return {mode: run_mode(reqs, profile, mode, n, cap, slo, share) for mode in MODES}


#: Loads tried below the grid for a mode no swept load let meet 90 % attainment.
LOW_LOADS = (0.3, 0.2, 0.1, 0.05)


def _meets90(b: dict) -> bool:
    return b["attainment"] >= 0.9 and b["finished"] == b["requests"]


def verdict(modes: dict) -> dict:
    """The split's best against the best aggregated configuration in one cell."""
    agg = max((modes["aggregated"], modes["aggregated+chunked"]), key=lambda b: (round(b["attainment"], 3),
                                                                                  -(b["tpot_p90"] or math.inf)))
    split = max((modes["disaggregated"], modes["conditional"]), key=lambda b: (round(b["attainment"], 3),
                                                                                -(b["tpot_p90"] or math.inf)))

    def ratio(key: str) -> float | None:
        a, s = agg[key], split[key]
        return a / s if a and s else None

    gain = split["attainment"] - agg["attainment"]
    tpot = ratio("tpot_p90")
    wins = gain > 0.005 or (abs(gain) <= 0.005 and tpot is not None and tpot > 1.05)
    loses = gain < -0.005 or (abs(gain) <= 0.005 and tpot is not None and tpot < 1 / 1.05)
    return {"best_aggregated": agg["config"], "best_split": split["config"],
            "attainment_gain": gain, "tpot_p90_ratio": tpot, "itl_p90_ratio": ratio("itl_p90"),
            "itl_p99_ratio": ratio("itl_p99"), "ttft_p90_ratio": ratio("ttft_p90"),
            "goodput_ratio": (split["goodput_per_worker"] / agg["goodput_per_worker"]
                              if agg["goodput_per_worker"] else None),
            "outcome": "split wins" if wins else "split loses" if loses else "tie"}


def stamp(profiles: dict[str, Profile]) -> dict:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--", "sim", "docs/profiles")),
            "profiles": {name: p.digest() for name, p in profiles.items()}, "code": code_digest(),
            "made_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def stale(data: dict) -> list[str]:
    """Why a sweep's JSON no longer matches the profiles and code here (empty: current)."""
    why = []
    st = data.get("stamp", {})
    for name, digest in st.get("profiles", {}).items():
        path = PROFILES_DIR / f"{name}.json"
        if not path.exists():
            why.append(f"profile {name} is gone")
        elif Profile.load(path).digest() != digest:
            why.append(f"profile {name} changed")
    if st.get("code") != code_digest():
        why.append("the simulator's code changed (" + ", ".join(CODE_FILES) + ")")
    se = data.get("settings", {})
    if se.get("loads") != list(LOADS) or se.get("grid") != [[n, list(m), c] for n, m, c in GRID + SENSITIVITY]:
        why.append("the sweep's grid or loads changed (sim/sweep.py)")
    return why


def sweep(requests: int, workers: int, grid=None, loads=LOADS, say=print) -> dict:
    """Simulate the grid (module doc); returns the JSON-ready results."""
    grid = grid if grid is not None else GRID + SENSITIVITY
    profiles = {name: Profile.load(PROFILES_DIR / f"{name}.json") for name, _, _ in grid}
    cells, best90 = [], {}
    started = time.perf_counter()
    for name, mixes, cap in grid:
        prof = profiles[name]
        cost = CostModel(prof)
        for mix in mixes:
            trace = load_mix(mix, requests, cap)
            pre, dec = request_work(trace, cost, prof.block_size)
            work = (sum(pre) + sum(dec)) / len(trace)
            share = sum(pre) / max(sum(pre) + sum(dec), 1e-12)
            slo = slos(trace, prof)
            hit = traces.prefix_hit_share(trace, prof.block_size)
            for load in loads:
                rate = load * workers / work
                reqs = traces.rescale(trace, rate)
                modes = run_cell(reqs, prof, workers, cap, slo, share)
                v = verdict(modes)
                cells.append({"profile": name, "mix": mix, "load": load, "rate": rate, "slo_ttft_s": slo[0],
                              "slo_tpot_s": slo[1], "prefix_hit_share": hit, "prefill_share": share,
                              "modes": modes, "verdict": v})
                for mode, b in modes.items():
                    key = f"{name}|{mix}|{mode}"
                    if _meets90(b):
                        best90[key] = max(best90.get(key, 0.0), rate / workers)
                    best90.setdefault(key, 0.0)
                say(f"sweep: {name} {mix} load {load:.2f} ({rate:.2f} req/s): {v['outcome']} "
                    f"(split {v['best_split']} vs {v['best_aggregated']}: attainment {v['attainment_gain']:+.2f}, "
                    f"TPOT p90 x{v['tpot_p90_ratio'] or float('nan'):.2f}, ITL p90 x{v['itl_p90_ratio'] or float('nan'):.2f})"
                    f"  [{time.perf_counter() - started:.0f} s]")
            # goodput at 90 %: a mode no swept load let meet it is tried at lower loads
            for mode in MODES:
                key = f"{name}|{mix}|{mode}"
                if best90[key]:
                    continue
                for load in [x for x in LOW_LOADS if x < min(loads)]:
                    rate = load * workers / work
                    b = run_mode(traces.rescale(trace, rate), prof, mode, workers, cap, slo, share)
                    if _meets90(b):
                        best90[key] = rate / workers
                        break
                say(f"sweep: {name} {mix} {mode}: goodput at 90 % {best90[key]:.3f} req/s per worker"
                    f"  [{time.perf_counter() - started:.0f} s]")
    return {"stamp": stamp(profiles),
            "settings": {"requests": requests, "workers": workers, "loads": list(loads),
                         "grid": [[n, list(m), c] for n, m, c in grid], "mixes": MIX_NOTES},
            "cells": cells, "goodput_per_worker_at_90": best90,
            "wall_s": time.perf_counter() - started}


# --- the report -----------------------------------------------------------------------------
def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v * 1e3:.0f}"


def heat_map(data: dict) -> str:
    """A text heat-map: one row per (profile, mix), one column per load; each cell the
    outcome (``S`` split wins, ``A`` aggregated wins, ``=`` tie) with the best aggregated
    configuration's per-request TPOT p90 over the best split's, and ``!`` where the split's
    p90 ITL is at least 3× lower."""
    loads = data["settings"]["loads"]
    rows: dict = {}
    for c in data["cells"]:
        rows.setdefault((c["profile"], c["mix"]), {})[c["load"]] = c["verdict"]
    head = "| profile / mix | " + " | ".join(f"load {x:.2f}" for x in loads) + " |"
    out = [head, "|---|" + "---|" * len(loads)]
    for (prof, mix), by_load in rows.items():
        cells = []
        for x in loads:
            v = by_load.get(x)
            if v is None:
                cells.append("")
                continue
            mark = {"split wins": "S", "split loses": "A", "tie": "="}[v["outcome"]]
            three = " !" if (v["itl_p90_ratio"] or 0) >= 3 else ""
            cells.append(f"{mark} {_x(v['tpot_p90_ratio'])} {v['attainment_gain']:+.2f}{three}")
        out.append(f"| {prof} / {mix} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def tables(data: dict) -> str:
    out = []
    for c in data["cells"]:
        if c["load"] not in (0.6, 0.95):
            continue
        out.append(f"\n**{c['profile']} / {c['mix']} at load {c['load']:.2f}** ({c['rate']:.2f} req/s; SLOs TTFT ≤ "
                   f"{c['slo_ttft_s']:.2f} s, TPOT ≤ {c['slo_tpot_s'] * 1e3:.0f} ms; prefix hits "
                   f"{c['prefix_hit_share']:.0%})\n")
        out.append("| mode | config | TTFT p90 s | TPOT p90 ms | ITL p90 ms | ITL p99 ms | ITL p99.9 ms | "
                   "attainment | goodput /worker req/s |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for mode in MODES:
            b = c["modes"][mode]
            out.append(f"| {mode} | {b['config']} | {b['ttft_p90']:.2f} | {_ms(b['tpot_p90'])} | {_ms(b['itl_p90'])} | "
                       f"{_ms(b['itl_p99'])} | {_ms(b['itl_p999'])} | {b['attainment']:.0%} | "
                       f"{b['goodput_per_worker']:.3f} |")
    return "\n".join(out)


def headline(data: dict) -> list[str]:
    """The plain statements of the map: where the split wins, by how much, where the 3× lower
    p90 ITL holds, and where it loses."""
    cells = data["cells"]
    wins = [c for c in cells if c["verdict"]["outcome"] == "split wins"]
    loses = [c for c in cells if c["verdict"]["outcome"] == "split loses"]
    three = [c for c in cells if (c["verdict"]["itl_p90_ratio"] or 0) >= 3]

    def where(cs) -> str:
        by: dict = {}
        for c in cs:
            by.setdefault(f"{c['profile']} / {c['mix']}", []).append(f"{c['load']:.2f}")
        return "; ".join(f"{k} at load {', '.join(v)}" for k, v in by.items()) or "nowhere"

    lines = [f"* The split (best of disaggregated and conditional) **beats** the best aggregated configuration "
             f"in {len(wins)} of {len(cells)} cells: {where(wins)}."]
    if wins:
        gains = [c["verdict"]["attainment_gain"] for c in wins]
        tp = [c["verdict"]["tpot_p90_ratio"] for c in wins if c["verdict"]["tpot_p90_ratio"]]
        lines.append(f"  By how much: SLO attainment {min(gains):+.0%} to {max(gains):+.0%} "
                     f"(median {float(np.median(gains)):+.0%}); per-request TPOT p90 of the best aggregated over "
                     f"the split's {min(tp):.2f}× to {max(tp):.2f}× (median {float(np.median(tp)):.2f}×)." if tp else "")
    lines.append(f"* A p90 ITL **3× lower** than the best aggregated configuration's holds in {len(three)} of "
                 f"{len(cells)} cells: {where(three)}; everywhere else it does not.")
    lines.append(f"* The split **loses** in {len(loses)} cells: {where(loses)}.")
    ties = len(cells) - len(wins) - len(loses)
    lines.append(f"* Ties (attainment within 0.5 points and TPOT p90 within 5 %): {ties} cells.")
    g = data.get("goodput_per_worker_at_90", {})
    more, same, less = [], [], []
    for prof, mix in dict.fromkeys((c["profile"], c["mix"]) for c in cells):
        agg = max(g.get(f"{prof}|{mix}|{m}", 0.0) for m in ("aggregated", "aggregated+chunked"))
        split = max(g.get(f"{prof}|{mix}|{m}", 0.0) for m in ("disaggregated", "conditional"))
        row = f"{prof} / {mix}"
        if split > agg * 1.001:
            more.append(f"{row} ({split:.3f} vs {agg:.3f})")
        elif split < agg / 1.001:
            less.append(f"{row} ({split:.3f} vs {agg:.3f})")
        else:
            same.append(row)
    lines.append("* Goodput per worker at ≥ 90 % attainment (the grid's resolution): the split's is higher for "
                 f"{'; '.join(more) or 'no row'}; lower for {'; '.join(less) or 'no row'}; equal for "
                 f"{'; '.join(same) or 'no row'}.")
    return [x for x in lines if x]


def goodput_table(data: dict) -> str:
    g = data["goodput_per_worker_at_90"]
    rows: dict = {}
    for key, v in g.items():
        prof, mix, mode = key.split("|")
        rows.setdefault((prof, mix), {})[mode] = v
    out = ["| profile / mix | " + " | ".join(MODES) + " |", "|---|" + "---|" * len(MODES)]
    for (prof, mix), by in rows.items():
        out.append(f"| {prof} / {mix} | " + " | ".join(f"{by.get(m, 0):.3f}" for m in MODES) + " |")
    return "\n".join(out)


def write_md(data: dict, path: Path, command: str) -> None:
    st, se = data["stamp"], data["settings"]
    lines = ["# Where splitting pays: the crossover map (simulated)", "",
             f"Written by `{command}` (`sim/sweep.py`) at commit `{st['commit'][:12]}`"
             f"{' (with uncommitted changes)' if st['dirty'] else ''}, simulator code `{st['code']}`, "
             f"{st['made_at']}, in {data['wall_s']:.0f} s; raw numbers in `scale.json` (a test refuses it once a "
             "profile or the simulator's code changes: rerun the command), plot `scale.png`.", "",
             "**Simulated, not measured.** The A100 profiles are built from published figures (`sim/cited.py`, "
             "`docs/profiles/README.md`); `h200-llama2-7b` is pdserve's own engine measured on a lent H200 "
             "(`pdserve profile --synthetic llama2-7b`: Llama-2-7B's shapes, random weights), and "
             "`h200-llama2-7b-ib` is that measurement with the cited InfiniBand hand-off in place of the measured "
             "one (a what-if). The simulator's out-of-sample error was measured only against CPU deployments of "
             "the development machine (`pdserve bench sim-validate`, docs/sim-validation.md), **never against a "
             "GPU run**, so read the map as the model's prediction.", "",
             f"* Hardware: {se['workers']} model workers in every mode (equal hardware; a worker is the profile's "
             "GPUs: 1 A100 or 1 H200 for the 7B, 4 A100 for the 70B profiles). KV hand-off: on the cited profiles "
             "and the `-ib` variant over the workers' InfiniBand links (the `network` store: a FIFO per sending "
             "link), decode import free on the engine thread (RDMA into the pool); on `h200-llama2-7b` as pdserve "
             "does it today, measured: GPU → pinned host buffer → the shared-memory store and back, ~1.2 GB/s "
             "staged and ~3.9 GB/s loaded.",
             f"* Requests: the first {se['requests']} of each mix per cell (reduced to keep the sweep to minutes "
             "on 2 cores: tails past p99 rest on few requests).",
             "* Mixes: " + "; ".join(f"`{k}` — {v}" for k, v in se["mixes"].items()) + ".",
             "* Modes, load and SLOs: as `sim/sweep.py`'s module doc says — aggregated (whole prompts), "
             "aggregated+chunked (best of 512 / 2,048-token chunks), disaggregated and conditional (best prefill "
             "count next to the prefill share; prefill chunks ≤ 8,192, decode-side chunks 512); load = offered "
             "work / capacity with prefix hits counted; TTFT ≤ max(0.5 s, 3 × p90 isolated prefill), TPOT ≤ 3 × "
             "batch-1 decode step at the mean prompt, per request. For the prefix-reuse mixes (mooncake, "
             "agentic) the load counts every hit an unbounded cache shared by all workers would have; the "
             "workers' own caches hit less (work goes to whichever worker's fetch waited longest, no prefix-aware routing), so those cells run "
             "hotter than their nominal load.",
             "", "## Headline", "", *headline(data), "",
             "## Crossover map", "",
             "Each cell: outcome (`S` split wins, `A` the best aggregated wins, `=` tie), the best aggregated "
             "configuration's per-request TPOT p90 over the best split's (> 1: the split's is lower), the split's "
             "SLO-attainment gain, and `!` where the split's pooled p90 ITL is at least 3× lower.", "",
             heat_map(data), "", "![crossover map](scale.png)", "",
             "## Goodput per worker at ≥ 90 % SLO attainment", "",
             "Requests/s per worker at the highest load where ≥ 90 % of requests met both SLOs: the grid's loads, "
             "then 0.3 / 0.2 / 0.1 / 0.05 for a mode none of them satisfied (0: not even at load 0.05). A lower "
             "bound at the grid's resolution.", "",
             goodput_table(data), "", "## Cells at load 0.6 and 0.95", tables(data), ""]
    path.write_text("\n".join(lines) + "\n")


def plot(data: dict, path: Path) -> bool:
    """A heat-map PNG of log2(TPOT p90 ratio) per (profile / mix, load); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    loads = data["settings"]["loads"]
    rows: dict = {}
    for c in data["cells"]:
        rows.setdefault(f"{c['profile']}\n{c['mix']}", {})[c["load"]] = c["verdict"]
    names = list(rows)
    z = np.full((len(names), len(loads)), np.nan)
    for i, n in enumerate(names):
        for j, x in enumerate(loads):
            v = rows[n].get(x)
            if v and v["tpot_p90_ratio"]:
                z[i, j] = math.log2(v["tpot_p90_ratio"])
    fig, ax = plt.subplots(figsize=(2 + 1.6 * len(loads), 0.9 + 0.55 * len(names)))
    lim = max(1.0, float(np.nanmax(np.abs(z)))) if np.isfinite(z).any() else 1.0
    im = ax.imshow(z, cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
    for i, n in enumerate(names):
        for j, x in enumerate(loads):
            v = rows[n].get(x)
            if v:
                mark = {"split wins": "S", "split loses": "A", "tie": "="}[v["outcome"]]
                three = "!" if (v["itl_p90_ratio"] or 0) >= 3 else ""
                dark = np.isfinite(z[i, j]) and abs(z[i, j]) > 0.6 * lim
                ax.text(j, i, f"{mark}{three} {_x(v['tpot_p90_ratio'])}\n{v['attainment_gain']:+.2f}",
                        ha="center", va="center", fontsize=7, color="white" if dark else "black")
    ax.set_xticks(range(len(loads)), [f"{x:.2f}" for x in loads])
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_xlabel("load (offered work / capacity)")
    ax.set_title("best aggregated TPOT p90 / best split TPOT p90 (blue: split lower)", fontsize=9)
    fig.colorbar(im, ax=ax, label="log2 ratio")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve simulate sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/scale.json", help="the JSON; scale.md and scale.png go beside it")
    p.add_argument("--requests", type=int, default=300, help="requests per cell (at most 500: the bundled samples)")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="one profile, one mix, two loads (a smoke run)")
    p.add_argument("--report-only", action="store_true", help="rewrite scale.md and scale.png from the JSON")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.report_only:
        data = json.loads(out.read_text())
        write_md(data, out.with_suffix(".md"), data["settings"].get("command", "pdserve simulate sweep"))
        plot(data, out.with_suffix(".png"))
        print("\n".join(headline(data)))
        return 0
    if not 1 <= args.requests <= 500 or args.workers < 2:
        p.error("--requests must be in 1..500 and --workers at least 2")
    grid = [("a100-llama2-7b", ("azure-conv",), 4096)] if args.quick else None
    data = sweep(args.requests, args.workers, grid, (0.6, 0.95) if args.quick else LOADS)
    command = "pdserve simulate sweep --out " + args.out + (f" --requests {args.requests}" if args.requests != 300 else "") \
        + (f" --workers {args.workers}" if args.workers != 8 else "") + (" --quick" if args.quick else "")
    data["settings"]["command"] = command
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    write_md(data, out.with_suffix(".md"), command)
    plotted = plot(data, out.with_suffix(".png"))
    print("\n".join(headline(data)))
    print(f"wrote {out}, {out.with_suffix('.md')}" + (f", {out.with_suffix('.png')}" if plotted else
                                                        " (no matplotlib: no plot)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
