"""The disaggregation payoff by deployment size, on paper: p90 ITL of aggregated, disaggregated
and conditional deployments of equal worker count on the Azure 2023 conversation trace, for
each profile given, written as ``<out>/scale-by-size.md`` and ``.png`` (``docs/scale.md`` is the
crossover map of :mod:`sim.sweep` since issue 34).

``python -m sim.scale --profile docs/profiles/a100-llama2-7b.json
--profile docs/profiles/this-machine-smollm2.json [--workers 8,32,128] [--requests 8000]
[--load 0.6] [--out docs]``

Load: the trace's arrivals are rescaled so that the offered work is ``--load`` of the
deployment's capacity (the trace's compute per request from the profile,
:func:`sim.plan.lower_bound`), so each size runs equally loaded. The split modes
try the prefill counts around the trace's prefill share of compute and keep the one with the
best goodput (ties: lower p90 ITL) — the comparison is at equal worker count, each mode with
its best split.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from sim.plan import prefill_share
from sim.profile import CostModel, Profile
from sim.simulator import Topology, simulate
from sim.trace import Scaling, SimRequest, azure, rescale


def work_per_request(reqs: list[SimRequest], cost: CostModel, batch: int = 32) -> float:
    pre = sum(cost.prefill_whole(r.prompt_tokens) for r in reqs)
    dec = sum(r.max_tokens * cost.decode_step(batch, batch * 600) / batch for r in reqs)
    return (pre + dec) / len(reqs)


def run_size(reqs, profile: Profile, n: int, slo: tuple[float, float], base: dict, say) -> dict:
    """{mode: summary} for ``n`` workers; split modes keep their best prefill count."""
    cost = CostModel(profile)
    share = prefill_share(reqs, cost)
    out = {}
    for label, topo in (("aggregated", Topology(mode="aggregated", workers=n, max_prefill_chunk_tokens=0, **base)),
                        ("aggregated+chunked", Topology(mode="aggregated", workers=n, max_prefill_chunk_tokens=512,
                                                        **base))):
        out[label] = simulate(reqs, topo, profile, *slo)
        say(f"scale: {profile.name} {n} {label}: ITL p90 {out[label]['itl']['p90'] * 1e3:.1f} ms")
    ps = sorted({p for p in (round(share * n), math.ceil(share * n) + (1 if n >= 16 else 0)) if 1 <= p < n})
    for mode in ("disaggregated", "conditional"):
        best = None
        for p in ps:
            s = simulate(reqs, Topology(mode=mode, prefill=p, decode=n - p, max_prefill_chunk_tokens=512, **base),
                         profile, *slo)
            say(f"scale: {profile.name} {n} {mode} {p}P:{n - p}D: ITL p90 {s['itl']['p90'] * 1e3:.1f} ms, "
                f"goodput {s['goodput_rps']:.2f}")
            if best is None or (round(s["goodput_rps"], 2), -s["itl"]["p90"]) > (round(best["goodput_rps"], 2),
                                                                                  -best["itl"]["p90"]):
                best = s
        out[mode] = best
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (name, sizes) in zip(axes[0], results.items()):
        ns = sorted(int(n) for n in sizes)
        for i, mode in enumerate(("aggregated", "aggregated+chunked", "disaggregated", "conditional")):
            color = f"C{i}"
            ax.plot(ns, [sizes[str(n)][mode]["itl"]["p90"] * 1e3 for n in ns], marker="o", color=color,
                    label=f"{mode} p90")
            ax.plot(ns, [sizes[str(n)][mode]["itl"]["p99"] * 1e3 for n in ns], marker="x", ls="--", color=color,
                    label=f"{mode} p99")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("workers")
        ax.set_ylabel("ITL (ms): p90 solid, p99 dashed")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(results: dict) -> str:
    out = ["| profile | workers | mode | split | load req/s | TTFT p90 s | ITL p50 ms | ITL p90 ms | ITL p99 ms | goodput req/s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for name, sizes in results.items():
        for n in sorted(sizes, key=int):
            for mode, s in sizes[n].items():
                if mode.startswith("_"):
                    continue
                out.append(f"| {name} | {n} | {mode} | {s['topology'].split(' ')[1] if ':' in s['topology'] else 'all'} | {sizes[n]['_rate']:.1f} | "
                           f"{s['ttft']['p90']:.2f} | {s['itl']['p50'] * 1e3:.1f} | {s['itl']['p90'] * 1e3:.1f} | "
                           f"{s['itl']['p99'] * 1e3:.1f} | {s['goodput_rps']:.2f} |")
    return "\n".join(out)


def write_md(results: dict, path: Path, args) -> None:
    """``docs/scale.md``: how it was made, the table, the plot, and the reading of it."""
    lines = ["# The disaggregation payoff at cluster scale (simulated)", "",
             "Written by `python -m sim.scale " + " ".join(f"--profile {p}" for p in args.profile) +
             f" --workers {args.workers} --requests {args.requests} --load {args.load}` "
             "(`sim/scale.py`); raw numbers in `scale-by-size.json`, plot `scale-by-size.png`.", "",
             f"* Trace: the first {args.requests} requests of the Azure LLM inference trace 2023, conversation "
             f"(Splitwise, Patel et al., ISCA 2024), prompts capped at {args.max_prompt} and outputs at "
             f"{args.max_output} tokens, arrivals rescaled so the offered work is {args.load:.0%} of the "
             "deployment's capacity (the same load per worker at every size; the rate is in the table).",
             "* Modes at equal worker count: aggregated (whole prompts), aggregated with chunked prefill "
             "(512-token chunks), disaggregated and conditional (the tokenizer's router, local limit 256 "
             "tokens), each split P:D the best of the prefill counts next to the trace's prefill share "
             "of compute. `max_num_seqs` " + str(args.max_num_seqs) + ", step budget 2048 tokens.",
             "* Profiles: " + ", ".join(f"`{n}`" for n in results) + " — see `docs/profiles/`; "
             "`a100-llama2-7b` is built from published figures (`sim/cited.py` cites each), "
             "NOT measured here; the other is `pdserve profile` on the 2-vCPU development machine "
             "(two workers per 2-core host, the services sharing the cores).",
             "* SLOs for goodput: TTFT ≤ max(2 s, 20 × prefill of 1024 tokens), TPOT ≤ 5 × a batch-1 decode step.",
             "", table(results), "", "![p90 and p99 ITL against workers](scale-by-size.png)", ""]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", action="append", required=True)
    p.add_argument("--from-json", action="append", default=[], help="merge these scale.json results, simulate nothing")
    p.add_argument("--workers", default="8,32,128")
    p.add_argument("--requests", type=int, default=8000)
    p.add_argument("--load", type=float, default=0.6)
    p.add_argument("--max-prompt", type=int, default=4096)
    p.add_argument("--max-output", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--out", default="docs/scale-by-size")
    args = p.parse_args(argv)
    trace = azure("azure2023_conv.csv", args.requests, Scaling(1.0, args.max_prompt, args.max_output))
    results: dict = {}
    for path in args.from_json:
        results.update(json.loads(Path(path).read_text()))
    for path in args.profile if not args.from_json else []:
        prof = Profile.load(path)
        cost = CostModel(prof)
        w = work_per_request(trace, cost)
        slo = (max(2.0, 20 * cost.prefill(1024)), 5 * cost.decode_step(1, 0))
        base = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048,
                    host_cores=prof.host_cores if prof.measured else 0, workers_per_host=2 if prof.measured else 1)
        results[prof.name] = {}
        for n in (int(x) for x in args.workers.split(",")):
            rate = args.load * n / w
            reqs = rescale(trace, rate)
            sizes = run_size(reqs, prof, n, slo, base, print)
            sizes["_rate"] = rate
            sizes["_slo"] = slo
            results[prof.name][str(n)] = sizes
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale-by-size.json").write_text(json.dumps(results, indent=1, default=str))
    plot(results, out / "scale-by-size.png")
    write_md(results, out / "scale-by-size.md", args)
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
