"""The simulator (sim): bulk decode segments give the same timings as single steps,
a lone request's latencies match the profile's arithmetic, queueing, preemption, the
conditional router's split, the planner's minimality and its k8s overlay."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from sim import trace
from sim.metrics import weighted_percentiles
from sim.plan import emit_k8s, exhaustive, meets_slos, plan
from sim.profile import CostModel, Profile
from sim.simulator import Simulation, Topology, simulate


def _profile(**kw) -> Profile:
    base = dict(name="test", measured=False, machine="-", model="-", dtype="-",
                prefill_tokens=[1, 128, 512, 2048], prefill_s=[0.01, 0.05, 0.2, 0.8],
                decode_batch=[1, 8, 32, 64], decode_s=[0.02, 0.03, 0.06, 0.1], decode_ctx_s=0.0,
                prefill_attn_s=1e-8, step_fixed_s=0.015, kv_bytes_per_token=1000, kv_stage_fixed_s=0.003,
                kv_stage_s_per_byte=1e-9, kv_load_fixed_s=0.002, kv_load_s_per_byte=1e-9, bus_hop_s=0.001,
                tokenize_s=0.002, tokenize_s_per_token=1e-6, token_cpu_s=1e-4, request_cpu_s=1e-3,
                num_kv_blocks=4096, block_size=16)
    base.update(kw)
    return Profile(**base)


def _workload(n=120, rate=4.0, seed=1):
    return trace.synthetic(n, rate, [(96, 0.7), (700, 0.3)], 40, seed=seed)


@pytest.mark.parametrize("topo", [
    Topology(mode="aggregated", workers=2, max_num_seqs=16, max_num_batched_tokens=1024, max_prefill_chunk_tokens=256),
    Topology(mode="disaggregated", prefill=1, decode=2, max_num_seqs=16, max_num_batched_tokens=1024),
    Topology(mode="conditional", prefill=1, decode=1, max_num_seqs=16, local_max_tokens=128),
    Topology(mode="aggregated", workers=1, max_num_seqs=32, num_kv_blocks=120),  # preempts
], ids=lambda t: t.label())
def test_segments_equal_single_steps(topo):
    """Advancing k decode steps at once must give every request the same first-token and
    last-token times as stepping one at a time (the reference: max_segment=1)."""
    p = _profile()
    reqs = _workload()
    bulk = Simulation(topo, p).run(reqs)
    single = Simulation(topo, p, max_segment=1).run(reqs)
    assert bulk.events < single.events  # it did take the shortcut
    assert bulk.n_out == single.n_out == [r.max_tokens for r in reqs]
    for a, b in zip(bulk.first + bulk.last, single.first + single.last):
        assert a == pytest.approx(b, abs=1e-9)
    assert bulk.preemptions == single.preemptions


def test_preemption_keeps_every_token():
    p = _profile()
    reqs = _workload(60, 20.0)
    sim = Simulation(Topology(mode="aggregated", workers=1, max_num_seqs=32, num_kv_blocks=90), p)
    r = sim.run(reqs)
    assert r.preemptions > 0
    assert r.n_out == [q.max_tokens for q in reqs]


def test_lone_request_matches_the_profile():
    """One request, nothing else: TTFT and every gap are the profile's arithmetic."""
    p = _profile(decode_ctx_s=2e-6)
    c = CostModel(p)
    req = [trace.SimRequest(0, 0.0, 300, 5)]
    s = simulate(req, Topology(mode="aggregated", workers=1), p)
    expect_ttft = p.bus_hop_s + c.tokenize(300) + p.bus_hop_s + c.prefill(300) + 2 * p.bus_hop_s + p.token_cpu_s
    assert s["ttft"]["p50"] == pytest.approx(expect_ttft, rel=1e-9)
    gaps = [c.decode_step(1, 300 + i) for i in range(4)]  # context grows by one token a step
    assert s["tpot"]["p50"] == pytest.approx(sum(gaps) / 4, rel=1e-9)
    # disaggregated: the second token waits for the KV hand-off (stage, hop, load)
    d = simulate(req, Topology(mode="disaggregated", prefill=1, decode=1), p)
    handoff = c.kv_stage(300) + p.bus_hop_s + c.kv_load(300)
    assert d["e2e"]["p50"] - s["e2e"]["p50"] == pytest.approx(handoff, rel=1e-6)


def test_fifo_prefill_queue():
    """Two long prompts at once on one prefill worker, one per step: the second waits for the first."""
    p = _profile()
    c = CostModel(p)
    reqs = [trace.SimRequest(0, 0.0, 1024, 1), trace.SimRequest(1, 0.0, 1024, 1)]
    sim = Simulation(Topology(mode="disaggregated", prefill=1, decode=1, max_num_batched_tokens=1024,
                              max_prefill_chunk_tokens=0), p)
    r = sim.run(reqs)
    # the second is tokenized later but reaches the worker while the first is prefilled
    assert r.first[1] - r.first[0] == pytest.approx(c.prefill(1024), rel=1e-6)


def test_conditional_routes_by_the_local_limit():
    """Idle workers (one output token: nothing stays running): long prompts are over the limit
    and go remote; short ones are cheaper locally — but for the odd one the router, fed the
    prefill rates each worker's own steps showed (the prefill worker's long prompts run at a
    higher rate), finds the prefill worker cheaper."""
    p = _profile()
    reqs = trace.synthetic(200, 0.5, [(64, 0.75), (900, 0.25)], 1, seed=4)
    long_share = sum(r.prompt_tokens > 128 for r in reqs) / len(reqs)
    s = simulate(reqs, Topology(mode="conditional", prefill=1, decode=1, local_max_tokens=128), p)
    assert long_share <= s["remote_share"] <= long_share + 0.05


def test_weighted_percentiles_match_expanded_values():
    import numpy as np

    values, weights = [3.0, 1.0, 2.0, 5.0], [2, 5, 1, 2]
    expanded = np.repeat(values, weights)
    w = weighted_percentiles(values, weights)
    for q in (50, 90, 99):
        assert w[f"p{q}"] == float(np.percentile(expanded, q, method="inverted_cdf"))


def test_profile_roundtrip_and_version(tmp_path):
    p = _profile()
    p.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == p
    (tmp_path / "old.json").write_text((tmp_path / "p.json").read_text().replace('"version": 1', '"version": 0'))
    with pytest.raises(ValueError, match="version"):
        Profile.load(tmp_path / "old.json")
    c = CostModel(p)
    assert [c.prefill(n) for n in p.prefill_tokens] == pytest.approx(p.prefill_s)
    assert [c.decode_step(b, 0) for b in p.decode_batch] == pytest.approx(p.decode_s)


def test_plan_is_minimal_and_emits_k8s(tmp_path):
    p = _profile()
    reqs = trace.rescale(_workload(150, 1.0, seed=2), 6.0)
    res = plan(reqs, p, slo_ttft=1.0, slo_tpot=0.08, max_workers=12, say=lambda *a: None)
    topo, s = res["best"]
    assert s["slo_attainment"] >= 0.9 and s["finished"] == s["requests"]
    n = topo.num_workers
    assert not any(meets for t, _, meets in res["tried"] if t.num_workers < n)
    # every worker count from the first tried up to the answer was simulated (no jumps)
    counts = sorted({t.num_workers for t, _, _ in res["tried"]})
    assert counts == list(range(counts[0], n + 1))
    paths = emit_k8s(tmp_path, topo, s, reqs, p, 1.0)
    kust = yaml.safe_load((tmp_path / "kustomization.yaml").read_text())
    # the overlay's base is this checkout's infra/k8s, found from the output folder
    assert (tmp_path / kust["resources"][0]).resolve() == Path(__file__).resolve().parents[2] / "infra" / "k8s"
    assert (tmp_path / kust["resources"][0] / "kustomization.yaml").is_file()
    counts = {r["name"]: r["count"] for r in kust["replicas"]}
    assert counts["prefill"] + counts["decode"] == n
    keda = list(yaml.safe_load_all((tmp_path / "keda-patch.yaml").read_text()))
    assert {k["metadata"]["name"]: k["spec"]["minReplicaCount"] for k in keda} == counts
    assert all(int(k["spec"]["triggers"][0]["metadata"]["lagThreshold"]) >= 1 for k in keda)
    assert len(paths) == 3


@pytest.mark.parametrize("rate, slo_tpot", [(6.0, 0.08), (12.0, 0.06)])
def test_plan_is_as_cheap_as_an_exhaustive_search(rate, slo_tpot):
    """The planner's pick costs no more than 5% above the cheapest deployment found by trying
    every worker count and every prefill/decode split (issue 34's planner check)."""
    p = _profile()
    reqs = trace.rescale(_workload(150, 1.0, seed=3), rate)
    res = plan(reqs, p, 1.0, slo_tpot, max_workers=10, say=lambda *a: None)
    best = exhaustive(reqs, p, 1.0, slo_tpot, max_workers=10)
    assert best is not None and res["best"] is not None
    assert res["best"][0].num_workers <= math.floor(1.05 * best[0].num_workers)
    assert meets_slos(res["best"][1], 1.0, slo_tpot)


def test_slo_attainment_counts_requests_not_pooled_gaps():
    """A deployment whose pooled ITL p90 is fine but whose requests mostly miss their TPOT SLO
    does not meet the SLOs (and the reverse)."""
    summary = {"requests": 10, "finished": 10, "slo_attainment": 0.5, "itl": {"p90": 0.01}}
    assert not meets_slos(summary, 1.0, 0.05)
    assert not meets_slos(summary | {"finished": 9, "slo_attainment": 0.95}, 1.0, 0.05)
    assert meets_slos(summary | {"slo_attainment": 0.95}, 1.0, 0.05)
    assert not meets_slos(summary | {"slo_attainment": 0.95, "itl": {"p90": 0.2}}, 1.0, 0.05, slo_itl=0.1)


def test_host_contention_slows_steps():
    """Two busy workers on a 2-core host with a co-run slowdown decode slower than on two hosts."""
    p = _profile(corun_slowdown=1.5, token_cpu_s=0.0, request_cpu_s=0.0, tokenize_s=0.0, tokenize_s_per_token=0.0)
    reqs = _workload(80, 8.0)
    apart = simulate(reqs, Topology(mode="aggregated", workers=2, host_cores=2, workers_per_host=1), p)
    shared = simulate(reqs, Topology(mode="aggregated", workers=2, host_cores=2, workers_per_host=2), p)
    assert shared["itl"]["p50"] > apart["itl"]["p50"] * 1.2
    assert math.isfinite(shared["ttft"]["p90"])


def test_unknown_mode():
    with pytest.raises(ValueError):
        simulate(_workload(2), replace(Topology(), mode="ring"), _profile())


def test_plan_and_simulate_commands(tmp_path, capsys):
    from pathlib import Path

    from services.cli import external_commands
    from sim import plan as plan_cmd
    from sim import run as run_cmd

    assert {"profile", "plan", "simulate"} <= set(external_commands())
    prof = str(Path(__file__).resolve().parents[2] / "docs" / "profiles" / "a100-llama2-7b.json")
    args = ["--profile", prof, "--trace", "poisson:128:0.8,1024:0.2", "--requests", "120", "--rate", "30"]
    assert plan_cmd.main(args + ["--slo-ttft", "1", "--slo-tpot", "0.05", "--emit", "k8s", "--out", str(tmp_path)]) == 0
    assert "plan:" in capsys.readouterr().out and (tmp_path / "kustomization.yaml").exists()
    assert run_cmd.main(args + ["--mode", "disaggregated", "--prefill", "1", "--decode", "2"]) == 0
    assert "disaggregated 1P:2D" in capsys.readouterr().out
    assert run_cmd.main(["--profile", prof, "--trace", "nope"]) == 2
    assert "unknown trace" in capsys.readouterr().out


@pytest.mark.parametrize("bad,says", [
    (["--slo-ttft", "-1"], "--slo-ttft"), (["--slo-ttft", "0"], "--slo-ttft"), (["--slo-tpot", "0"], "--slo-tpot"),
    (["--slo-tpot", "nan"], "--slo-tpot"), (["--attainment", "1.5"], "--attainment"), (["--attainment", "0"], "--attainment"),
    (["--slo-itl", "-1"], "--slo-itl"), (["--requests", "0"], "--requests"), (["--max-workers", "0"], "--max-workers"),
    (["--rate", "-2"], "--rate"), (["--modes", "ring"], "--modes"), (["--trace", "nope"], "unknown trace"),
    (["--trace", "poisson:abc"], "poisson:LEN:W"), (["--trace", "poisson:0:1"], "poisson:LEN:W"),
    (["--trace", "poisson:128:0"], "poisson:LEN:W"), (["--profile", "/nonexistent/p.json"], "--profile"),
    (["--profile", "LIST"], "not a profile file"),
])
def test_plan_refuses_bad_arguments_before_searching(bad, says, tmp_path, capsys):
    """Bad SLOs, attainment, sizes, modes, traces or profile files exit 2 with argparse's
    message before any simulation (they used to search up to 64 workers, or raise)."""
    from pathlib import Path

    from sim import plan as plan_cmd

    prof = str(Path(__file__).resolve().parents[2] / "docs" / "profiles" / "a100-llama2-7b.json")
    (tmp_path / "list.json").write_text("[1]")
    bad = [str(tmp_path / "list.json") if x == "LIST" else x for x in bad]
    args = {"--profile": prof, "--trace": "poisson:128:1", "--requests": "20", "--slo-ttft": "1", "--slo-tpot": "0.05",
            "--max-workers": "2"}
    args.update(dict(zip(bad[::2], bad[1::2])))
    with pytest.raises(SystemExit) as info:
        plan_cmd.main([x for kv in args.items() for x in kv])
    out = capsys.readouterr()
    assert info.value.code == 2 and says in out.err and "Traceback" not in out.err and "attainment" not in out.out


@pytest.mark.parametrize("name", ["a100-llama2-7b", "a100x4-llama2-70b-tp4", "a100x4-llama2-70b-32k-tp4"])
def test_cited_profiles_are_what_sim_cited_builds_and_keep_their_figures(name, tmp_path):
    """The committed cited profiles are sim.cited's output (regenerate with ``python -m sim.cited
    docs/profiles``), decode at batch 1-64 is LMDeploy's table, and no mixed step costs less
    than its decode step alone (the old 7B profile's short chunks did)."""
    from sim import cited

    build = cited.BUILDERS[name]
    fresh = build()
    committed = Profile.load(Path(__file__).resolve().parents[2] / "docs" / "profiles" / f"{name}.json")
    assert committed.digest() == fresh.digest(), "regenerate: python -m sim.cited docs/profiles"
    source = {"a100-llama2-7b": cited.LLAMA2_7B, "a100x4-llama2-70b-tp4": cited.LLAMA2_70B,
              "a100x4-llama2-70b-32k-tp4": cited.LLAMA2_70B_32K}[name]
    assert {b: d for b, d in zip(fresh.decode_batch, fresh.decode_s) if b <= 64} == source.decode_p50
    assert fresh.prefill_s[fresh.prefill_tokens.index(2048)] == pytest.approx(source.first_token[2048])
    c = CostModel(fresh)
    for n in (1, 16, 64, 127, 256):
        for b in (1, 8, 64):
            assert c.step([(n, 0)], b, b * 100) >= c.decode_step(b, b * 100)
    # the context cost reproduces [LMD]'s prompt-2048 rows (batch × 3,072 context tokens) within 5 %
    for b, p50 in source.decode_p50_ctx.items():
        assert c.decode_step(b, b * 3072) == pytest.approx(p50, rel=0.05)
    # the sensitivity rows: a lower utilization makes prefill slower, decode untouched; a lower
    # bandwidth utilization makes decode slower, prefill untouched
    slow = build(mfu=0.35)
    assert slow.prefill_s[-1] > fresh.prefill_s[-1] and slow.decode_s == fresh.decode_s
    narrow = build(mbu=0.4)
    assert narrow.decode_ctx_s > fresh.decode_ctx_s and narrow.decode_s[0] > fresh.decode_s[0]
    assert narrow.prefill_s == fresh.prefill_s
    for row, mfu, mbu in cited.SENSITIVITY:  # committed too
        if row == name:
            want = build(mfu=mfu, mbu=mbu)
            assert Profile.load(committed_path(want.name)).digest() == want.digest()


def committed_path(name: str) -> Path:
    return Path(__file__).resolve().parents[2] / "docs" / "profiles" / f"{name}.json"


@pytest.mark.parametrize("extra, says", [
    (["--requests", "0"], "--requests must be at least 1"),
    (["--slo-ttft", "-1"], "--slo-ttft must be a positive"),
    (["--rate", "-1"], "--rate must be 0"),
    (["--repeat", "0"], "--repeat must be at least 1"),
])
def test_simulate_refuses_bad_arguments_before_simulating(extra, says, capsys, tmp_path):
    from sim import run as run_cmd

    prof = str(Path(__file__).resolve().parents[2] / "docs" / "profiles" / "a100-llama2-7b.json")
    assert run_cmd.main(["--profile", prof, "--trace", "poisson:128:1", *extra]) == 2
    assert says in capsys.readouterr().out
    (tmp_path / "list.json").write_text("[1]")
    assert run_cmd.main(["--profile", str(tmp_path / "list.json")]) == 2
    assert "is not a profile file" in capsys.readouterr().out


def test_context_attention_has_its_own_coefficient():
    from dataclasses import replace

    p = _profile(prefill_attn_s=1e-8)
    c = CostModel(p)
    assert c.step([(64, 1024)], 0, 0) == pytest.approx(c.prefill(64) + 1e-8 * 64 * 1024)  # None: the in-prompt one
    q = CostModel(replace(p, prefill_ctx_attn_s=1e-6))
    assert q.step([(64, 1024)], 0, 0) == pytest.approx(c.prefill(64) + 1e-6 * 64 * 1024)
    # the pairs between chunks of one step are still the in-prompt coefficient's
    two = q.step([(64, 0), (64, 0)], 0, 0)
    assert two == pytest.approx(q.prefill(128) - 1e-8 * (128 * 128 - 2 * 64 * 64) / 2)
    assert replace(p, prefill_ctx_attn_s=1e-6).scaled(compute=2.0).prefill_ctx_attn_s == pytest.approx(2e-6)


def test_admission_refuses_what_would_queue_past_the_limit():
    from dataclasses import replace

    # 40 prompts of 2,048 tokens at once on one prefill worker of ~2,560 tokens/s: the last
    # ones would queue ~30 s; with a 10 s limit the gateway refuses them, without one none
    reqs = [trace.SimRequest(i, 0.01 * i, 2048, 4) for i in range(40)]
    topo = Topology(mode="disaggregated", prefill=1, decode=1, max_num_batched_tokens=2048,
                    extra={"prefill_rates": {"prefill-0": 2560.0}})
    free = Simulation(topo, _profile()).run(list(reqs))
    assert free.finished == 40 and all(f == f for f in free.first)
    sim = Simulation(replace(topo, max_queue_time_s=10.0), _profile())
    res = sim.run(list(reqs))
    done = sum(f == f for f in res.first)
    # admitted: the backlog ahead stays within 10 s at 2,560 tokens/s, i.e. about 13 prompts
    assert sim.refused == 40 - done and 10 <= done <= 16
    assert max(f - a for f, a in zip(res.first, res.arrival) if f == f) < max(
        f - a for f, a in zip(free.first, free.arrival))


def test_work_items_go_to_the_worker_whose_fetch_waited_longest():
    topo = Topology(mode="aggregated", workers=2)
    turns = pairs = 0
    for seed in range(10):
        sim = Simulation(topo, _profile(), seed=seed)
        # items 0.1 s apart: the worker that just took one has the newest fetch, so the other
        # takes the next — unless the other's fetch expired and was sent again in between
        got = [sim._pull(sim.decode, 10.0 + 0.1 * i).name for i in range(6)]
        turns += sum(a != b for a, b in zip(got, got[1:]))
        pairs += len(got) - 1
    assert 0.75 <= turns / pairs < 1.0
    # 1.5 s after one took an item both fetches have expired and been sent again: which one was
    # sent earlier depends on the phases (the seed), not on whose turn it would be
    wins = set()
    for seed in range(20):
        sim = Simulation(topo, _profile(), seed=seed)
        sim._pull(sim.decode, 10.0)
        wins.add(sim._pull(sim.decode, 11.5).name)
    assert wins == {"worker-0", "worker-1"}


def test_queued_prefill_tokens_do_not_keep_prefix_hits():
    # shared system prompts: most of each prompt is a prefix-cache hit. Once every request is
    # served the prefill worker has nothing left to compute, and a light load is never refused
    reqs = trace.shared_prefix(120, 0.5, seed=5)
    topo = Topology(mode="disaggregated", prefill=1, decode=1, max_queue_time_s=5.0,
                    extra={"prefill_rates": {"prefill-0": 2560.0}})
    sim = Simulation(topo, _profile())
    res = sim.run(reqs)
    assert sim.refused == 0 and res.finished == len(reqs)
    assert sim.prefill[0].queued_prefill_tokens == 0 and sim.admission.backlog.prompt_tokens == 0


def test_a_whole_prompt_counts_its_attention_once():
    # the table's points were measured on whole prompts: their attention is in them already
    cost = CostModel(_profile(prefill_attn_s=1e-7))
    assert cost.prefill_whole(512) == pytest.approx(cost.prefill(512))
    assert cost.prefill_whole(2048) == pytest.approx(0.8)
    # past the last point the linear extrapolation misses the quadratic growth beyond its tangent
    assert cost.prefill_whole(4096) == pytest.approx(cost.prefill(4096) + 1e-7 * 2048**2 / 2)


def test_a_prefill_table_is_smoothed_to_constant_linear_and_quadratic_terms():
    """``smooth_prefill``: a table that is exactly a + b n + c n² comes back as it was; one point
    measured a quarter high (the quick profile's 128 tokens) is pulled back near the curve its
    neighbours trace, and the others move little."""
    from sim.profile import smooth_prefill

    tokens = [1, 16, 64, 128, 256, 512, 1024, 2048]
    exact = [0.01 + 5e-3 * n + 1.2e-6 * n * n for n in tokens]
    assert smooth_prefill(tokens, exact) == pytest.approx(exact, rel=1e-9)
    noisy = list(exact)
    noisy[3] *= 1.25
    out = smooth_prefill(tokens, noisy)
    assert abs(out[3] / exact[3] - 1) < 0.1
    assert all(abs(o / e - 1) < 0.06 for i, (o, e) in enumerate(zip(out, exact)) if i != 3)
    assert smooth_prefill(tokens[:3], noisy[:3]) == noisy[:3]  # too few points to fit
    with pytest.raises(ValueError):
        smooth_prefill(tokens, noisy[:-1])


def test_network_variants_of_measured_profiles_are_what_sim_cited_builds():
    """``docs/profiles/<name>-ib.json`` is ``sim.cited.with_network_store`` of the committed
    measured profile: the measurement's step costs, the cited InfiniBand store's hand-off, and
    no import on the decode engine thread (regenerate with ``python -m sim.cited docs/profiles``)."""
    from sim import cited

    folder = Path(__file__).resolve().parents[2] / "docs" / "profiles"
    for name in cited.NETWORK_VARIANTS:
        measured = Profile.load(folder / f"{name}.json")
        committed = Profile.load(folder / f"{name}-ib.json")
        assert measured.measured and committed.digest() == cited.with_network_store(measured).digest()
        assert committed.decode_s == measured.decode_s and committed.prefill_s == measured.prefill_s
        store = committed.store()
        assert store.kind == "network" and store.put_s_per_byte == pytest.approx(8 / 200e9)
        assert committed.import_cost() == (0.0, 0.0) and measured.store().kind == "shm"
