"""The load generator against a running pdserve, and the modes comparison end to end (on the
tiny model: this checks the machinery, not the targets, which `pdserve bench modes` reports on
the real model)."""

from __future__ import annotations

import json

import pytest

from loadtest import bench_modes, loadgen

pytestmark = pytest.mark.timeout(900)


def test_load_generator_replays_a_mooncake_sample_with_prefix_hits(pipeline, tmp_path):
    loadgen.main(["--url", pipeline.url, "--workload", "mooncake", "--requests", "12", "--time-scale", "0.001",
                         "--max-prompt", "600", "--max-output", "8", "--block-tokens", "16", "--ignore-eos",
                         "--out", str(tmp_path)])
    data = json.loads((tmp_path / "report.json").read_text())
    summary = data["summaries"]["mooncake"]
    assert summary["num_ok"] == 12 and summary["output_tokens_per_s"] > 0
    from loadtest.workloads import Scaling, mooncake

    specs = mooncake("mooncake_conversation.jsonl", 12, Scaling(0.001, 600, 8, block_tokens=16), vocab_size=400)
    assert sorted(r["output_tokens"] for r in data["requests"]["mooncake"]) == sorted(s.max_tokens for s in specs)
    assert (tmp_path / "cdf_itl.png").exists()


def test_modes_comparison_measures_the_crossover_and_feeds_it_to_conditional_routing(tiny_model_dir, tmp_path,
                                                                                     monkeypatch, nats_url):
    """The crossover measurement, on one deployment of each shape (an aggregated decode worker
    without prefill, then one prefill + one decode worker), its length given to the conditional
    mode's router, that mode's workload, and the report. Every mode's plan is checked without
    starting it below; the modes themselves serve in test_routing.py (aggregated, conditional)
    and everywhere else (disaggregated). (All four modes once ran here: six deployments, 247 s of
    a 1639 s suite.)"""
    from services import launcher

    monkeypatch.setenv("PD_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("PD_KV_CACHE_MEMORY_BYTES", str(64 << 20))
    measured, started = [], []
    real_crossover, real_up = bench_modes.crossover, launcher.up

    def spy_crossover(*args, **kwargs):
        measured.append(real_crossover(*args, **kwargs))
        return measured[-1]

    def spy_up(settings, *args, **kwargs):
        started.append(settings)
        return real_up(settings, *args, **kwargs)

    monkeypatch.setattr(bench_modes, "crossover", spy_crossover)
    monkeypatch.setattr(launcher, "up", spy_up)
    bench_modes.main(["--requests", "6", "--rate", "4", "--short", "16", "--long", "200", "--output-tokens", "6",
                             "--lengths", "16,200", "--modes", "conditional", "--out", str(tmp_path), "--quiet"])
    data = json.loads((tmp_path / "report.json").read_text())
    assert set(data["summaries"]) == {"conditional"}
    assert data["summaries"]["conditional"]["num_ok"] == 6
    md = (tmp_path / "report.md").read_text()
    assert "Crossover:" in md and "hand-off" in md
    crossover = int(md.split("Crossover: ")[1].split(" tokens")[0])
    # the rule on the measured rows: the first length whose stall exceeds its hand-off, else the longest
    (found, rows), = measured
    assert [r["prompt_tokens"] for r in rows] == [16, 200]
    assert all(r["ttft_aggregated_s"] > 0 and r["ttft_disaggregated_s"] > 0 for r in rows), rows
    want = next((r["prompt_tokens"] for r in rows if r["stall_s"] > r["handoff_s"]), 200)
    assert crossover == found == want, rows
    # three deployments (aggregated, disaggregated, then the conditional mode): the last one's
    # router (the tokenizer's settings, passed to its process as PD_* variables) got the value
    assert [s.routing for s in started] == ["aggregated", "disaggregated", "conditional"]
    assert started[-1].to_env()["PD_ROUTER_LOCAL_MAX_TOKENS"] == str(crossover)


def test_every_mode_plan_is_a_valid_deployment():
    """Each mode's settings pass the start-up checks, its replicas fit its routing, and every
    pinned worker exists."""
    from shared.config import Settings

    plans = bench_modes.mode_plans(crossover=64)
    assert set(plans) == {"disaggregated", "aggregated", "aggregated+chunked", "conditional"}
    for name, plan in plans.items():
        settings = Settings.from_env({}, **plan["settings"])
        reps = plan["replicas"]
        assert reps["decode"] >= 1, name
        assert (reps["prefill"] == 0) == (settings.routing == "aggregated"), name
        names = {f"{stage}-{i}" for stage, n in reps.items() for i in range(n)}
        assert set(plan["affinity"]) <= names, name
    assert plans["conditional"]["settings"]["router_local_max_tokens"] == 64
    assert plans["aggregated+chunked"]["settings"]["max_prefill_chunk_tokens"] == bench_modes.CHUNK_TOKENS
    assert plans["aggregated"]["settings"]["max_prefill_chunk_tokens"] == 0
