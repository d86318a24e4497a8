"""Reports of load runs: JSON with every request's timings, a Markdown table, PNG plots."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from loadtest.client import RequestResult, Summary


def table(rows: dict[str, Summary]) -> str:
    """The comparison table (milliseconds, rates per second) as Markdown."""

    def ms(x):
        return "—" if x is None else f"{x * 1e3:.0f}"

    head = ("| mode | ok | TTFT p50 | p90 | p99 | ITL p50 | p90 | p99 | TPOT mean | req/s | out tok/s | goodput req/s |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for name, s in rows.items():
        lines.append(
            f"| {name} | {s.num_ok}/{s.num_requests} | {ms(s.ttft['p50'])} | {ms(s.ttft['p90'])} | {ms(s.ttft['p99'])} | "
            f"{ms(s.itl['p50'])} | {ms(s.itl['p90'])} | {ms(s.itl['p99'])} | {ms(s.tpot['mean'])} | "
            f"{s.requests_per_s:.2f} | {s.output_tokens_per_s:.1f} | {s.goodput_rps:.2f} |")
    return "\n".join(lines)


def write(folder: Path, title: str, workload: str, rows: dict[str, Summary],
          results: dict[str, list[RequestResult]], extra_md: str = "",
          sweeps: dict[str, list[tuple[float, Summary]]] | None = None) -> Path:
    """Write ``report.json``, ``report.md`` and the plots into ``folder``; returns the Markdown path."""
    folder.mkdir(parents=True, exist_ok=True)
    payload = {
        "title": title,
        "workload": workload,
        "summaries": {k: v.to_dict() for k, v in rows.items()},
        "requests": {k: [asdict(r) for r in rs] for k, rs in results.items()},
        "sweeps": {k: [(load, s.to_dict()) for load, s in v] for k, v in (sweeps or {}).items()},
    }
    (folder / "report.json").write_text(json.dumps(payload, indent=1))
    plots = plot(folder, results, sweeps or {})
    md = [f"# {title}", "", f"Workload: {workload}", "", table(rows), ""]
    if extra_md:
        md += [extra_md, ""]
    md += [f"![{p.stem}]({p.name})" for p in plots]
    path = folder / "report.md"
    path.write_text("\n".join(md) + "\n")
    return path


def plot(folder: Path, results: dict[str, list[RequestResult]], sweeps: dict[str, list[tuple[float, Summary]]]) -> list[Path]:
    """CDFs of TTFT and ITL per mode; throughput and goodput against load when swept."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    for metric, label in (("ttft", "TTFT (s)"), ("itl", "inter-token latency (s)")):
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for name, rs in results.items():
            values = sorted(r.ttft_s for r in rs if r.ok and r.ttft_s is not None) if metric == "ttft" else \
                sorted(x for r in rs if r.ok for x in r.itls)
            if not values:
                continue
            ys = [(i + 1) / len(values) for i in range(len(values))]
            ax.step(values, ys, where="post", label=name)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of " + ("requests" if metric == "ttft" else "gaps"))
        ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"CDF of {label.split(' (')[0]}")
        fig.tight_layout()
        path = folder / f"cdf_{metric}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append(path)
    if sweeps:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4.0))
        for name, points in sweeps.items():
            loads = [p[0] for p in points]
            axes[0].plot(loads, [p[1].output_tokens_per_s for p in points], marker="o", label=name)
            axes[1].plot(loads, [p[1].goodput_rps for p in points], marker="o", label=name)
        axes[0].set_xlabel("offered load (requests/s)")
        axes[0].set_ylabel("output tokens/s")
        axes[1].set_xlabel("offered load (requests/s)")
        axes[1].set_ylabel("goodput (requests/s within SLOs)")
        for ax in axes:
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = folder / "load.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append(path)
    return out
