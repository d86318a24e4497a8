"""Calibration on a run's own engine steps (sim/calibrate.py): step logs written by a
known machine — the profile's costs × known ratios, a co-run slowdown, a loop gap and a jitter —
give those figures back; the engine's step record describes what it computed; a jittered
replay spreads the inter-token gaps around the same mean."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from sim import calibrate, trace
from sim.profile import CostModel
from sim.simulator import Topology, simulate
from tests.unit.test_sim import _profile


def _write_logs(tmp_path, prof, decode=1.8, prefill=1.3, corun=1.25, gap=0.0004, jitter=(0.7, 1.3)):
    """Two workers on one host: worker 0 decodes alone for a while, then both are busy."""
    cost = CostModel(prof)
    rng = random.Random(1)
    logs = {0: [], 1: []}
    t = 100.0
    for _ in range(400):  # worker 0 alone: decode steps of 8 sequences
        dt = cost.decode_step(8, 8 * 200) * decode * rng.choice(jitter)
        logs[0].append([t, dt, [], 8, 8 * 200])
        t += dt + gap
    t1 = t
    for _ in range(200):  # both: worker 1 prefills 256-token chunks while worker 0 decodes
        dt = cost.step([(256, 0)], 0, 0) * prefill * corun * rng.choice(jitter)
        logs[1].append([t1, dt, [[256, 0]], 0, 0])
        t1 += dt
    u = t
    while u < t1 - 0.05:
        dt = cost.decode_step(8, 8 * 200) * decode * corun * rng.choice(jitter)
        logs[0].append([u, dt, [], 8, 8 * 200])
        u += dt + gap
    # worker 1 alone afterwards: prefill steps
    for _ in range(200):
        dt = cost.step([(256, 0)], 0, 0) * prefill * rng.choice(jitter)
        logs[1].append([t1 + 1.0, dt, [[256, 0]], 0, 0])
        t1 += dt + 0.01
    for w, steps in logs.items():
        lines = [json.dumps({"header": {"stage": "decode", "cpus": str(w)}})] + [json.dumps(s) for s in steps]
        (tmp_path / f"w{w}.jsonl").write_text("\n".join(lines) + "\n")
    return t1 + 2


def test_fit_recovers_the_machine(tmp_path):
    prof = _profile(step_loop_s=0.0)
    end = _write_logs(tmp_path, prof)
    logs = calibrate.read_step_logs(tmp_path)
    assert len(logs) == 2 and logs[0].header["cpus"] == "0"
    f = calibrate.fit(prof, logs, (0.0, end))
    assert f["decode"] == pytest.approx(1.8, rel=0.05)
    assert f["prefill"] == pytest.approx(1.3, rel=0.05)
    assert f["corun"] == pytest.approx(1.25, rel=0.08)
    assert f["step_loop_s"] == pytest.approx(0.0004, rel=0.01)
    j = f["jitter"]
    assert len(j) == calibrate.JITTER_LEVELS and sum(j) / len(j) == pytest.approx(1.0, abs=1e-3)
    assert min(j) == pytest.approx(0.7, rel=0.05) and max(j) == pytest.approx(1.3, rel=0.05)
    # the window drops what lies outside it
    assert calibrate.fit(prof, logs, (0.0, 100.5))["steps"] < f["steps"] / 5
    p = calibrate.apply(prof, f)
    # one batch size and one chunk size ran: every table point gets their ratio
    assert f["decode_by_batch"] == pytest.approx([f["decode"]] * len(prof.decode_s), rel=0.02)
    assert f["prefill_by_tokens"] == pytest.approx([f["prefill"]] * len(prof.prefill_s), rel=0.02)
    assert p.decode_s[0] == pytest.approx(prof.decode_s[0] * f["decode_by_batch"][0])
    assert p.prefill_s[-1] == pytest.approx(prof.prefill_s[-1] * f["prefill_by_tokens"][-1])
    assert p.corun_slowdown == f["corun"] and p.step_jitter == j


def test_fit_by_point_straightens_a_bent_profile(tmp_path):
    """Run steps at two batch sizes whose true costs differ from the profile by different
    factors: each table point gets its own, points between are interpolated, points beyond
    take the run's overall (time-weighted) ratio, not the nearest point's."""
    prof = _profile()  # decode_batch [1, 8, 32, 64]
    cost = CostModel(prof)
    steps, t = [], 10.0
    for b, r in ((1, 0.5), (32, 2.0)):
        for _ in range(100):
            dt = cost.decode_step(b, 0) * r
            steps.append([t, dt, [], b, 0])
            t += dt + 0.001
    (tmp_path / "w.jsonl").write_text("\n".join(json.dumps(s) for s in steps) + "\n")
    f = calibrate.fit(prof, calibrate.read_step_logs(tmp_path))
    overall = (0.5 * cost.decode_step(1, 0) + 2.0 * cost.decode_step(32, 0)) / (
        cost.decode_step(1, 0) + cost.decode_step(32, 0))
    assert f["decode"] == pytest.approx(overall, rel=0.01)
    assert f["decode_by_batch"] == pytest.approx([0.5, 1.25, 2.0, overall], rel=0.01)


def test_engine_step_record_describes_the_step():
    from engine.block_manager import BlockManager
    from engine.engine import step_shape
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence
    from shared.messages import SamplingParams

    sched = Scheduler(BlockManager(64, 16), 8, 40, 32)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    a = Sequence("a", list(range(1, 11)), 10, sp, 16)
    b = Sequence("b", list(range(1, 51)), 50, sp, 16)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()  # a's 10 tokens, b's first 30 (budget 40)
    assert step_shape(plan.scheduled) == ([[10, 0], [30, 0]], 0, 0)
    for item in plan.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
    a.token_ids.append(5)
    plan = sched.schedule()  # a decodes after 10 tokens, b's next 20 after 30
    assert step_shape(plan.scheduled) == ([[20, 30]], 1, 10)


def test_jitter_spreads_gaps_around_the_same_mean():
    reqs = trace.synthetic(60, 2.0, [(96, 1.0)], 40, seed=2)
    topo = Topology(mode="aggregated", workers=1, max_num_seqs=32)
    plain = simulate(reqs, topo, _profile())
    jit = simulate(reqs, topo, _profile(step_jitter=[0.5, 1.0, 1.5]))
    assert jit["itl"]["mean"] == pytest.approx(plain["itl"]["mean"], rel=0.05)
    assert jit["itl"]["p90"] > 1.2 * plain["itl"]["p90"]
    assert jit["itl"]["p50"] < plain["itl"]["p90"]


def test_load_timeline_follows_the_machine_and_the_replay_meets_it(tmp_path):
    """Decode steps at the profile's cost for 20 s, then twice it for 20 s: the second bin's
    factor is twice the first's; a lone request replayed in a slow bin takes that much longer."""
    prof = _profile()
    cost = CostModel(prof)
    steps, t = [], 0.0
    while t < 2 * calibrate.LOAD_BIN_S:
        dt = cost.decode_step(8, 0) * (1.0 if t < calibrate.LOAD_BIN_S else 2.0)
        steps.append([t, dt, [], 8, 0])
        t += dt
    (tmp_path / "w.jsonl").write_text("\n".join(json.dumps(s) for s in steps) + "\n")
    f = calibrate.fit(prof, calibrate.read_step_logs(tmp_path), (0.0, t))
    tl = f["load_timeline"]
    assert len(tl) == 2 and tl[1] / tl[0] == pytest.approx(2.0, rel=0.02)
    topo = Topology(mode="aggregated", workers=1)
    early = simulate([trace.SimRequest(0, 1.0, 96, 8)], topo, replace(prof, load_timeline=[1.0, 2.0], load_bin_s=20.0))
    late = simulate([trace.SimRequest(0, 21.0, 96, 8)], topo, replace(prof, load_timeline=[1.0, 2.0], load_bin_s=20.0))
    assert late["tpot"]["p50"] == pytest.approx(2 * early["tpot"]["p50"], rel=1e-6)


def test_idle_probe_waits_out_a_slow_start(monkeypatch):
    """A deployment that answers its first requests slowly (a CI run's probe saw ~0.9 s where
    the run's TTFT p50 was 0.03 s, and the twin took 0.9 s as its pipeline latency) gives the
    probe the TTFT it settles at: probing goes on, five answers at least, until three in a row
    agree within 2x."""
    import asyncio
    from types import SimpleNamespace

    from loadtest import client
    from loadtest import sim_validate as v

    def fake(ttfts: list[float]):
        sent = []

        async def send_one(_client, _model, spec, extra=None):
            sent.append(spec.prompt)
            t = ttfts[len(sent) - 1]
            return SimpleNamespace(ok=t is not None, ttft_s=t, tpot_s=0.002)
        return sent, send_one

    prompts = [[i] for i in range(v.PROBE_MAX)]
    sent, send = fake([0.9, 0.85, 0.02, None, 0.011, 0.012, 0.013, 0.5, 0.5])
    monkeypatch.setattr(client, "send_one", send)
    probe = asyncio.run(v._probe("http://127.0.0.1:9", "m", prompts))
    assert len(sent) == 6 and probe["settled"]  # stopped at the third agreeing probe; the failed one skipped
    assert probe["ttft"] == pytest.approx(0.012) and probe["ttfts"] == [0.9, 0.85, 0.02, 0.011, 0.012]
    sent, send = fake([0.9, 0.9, 0.9, 0.02, 0.02, 0.02, 0.5, 0.5, 0.5])  # three slow ones agree: not yet
    monkeypatch.setattr(client, "send_one", send)
    probe = asyncio.run(v._probe("http://127.0.0.1:9", "m", prompts))
    assert len(sent) == 6 and probe["settled"] and probe["ttft"] == pytest.approx(0.02)
    sent, send = fake([0.9, 0.01] * 5)  # never settles: the medians of the last three, said so
    monkeypatch.setattr(client, "send_one", send)
    probe = asyncio.run(v._probe("http://127.0.0.1:9", "m", prompts))
    assert len(sent) == v.PROBE_MAX and not probe["settled"] and probe["ttft"] == pytest.approx(0.9)


def test_a_smoothed_profile_prices_a_step_of_several_prompts_by_its_own_table():
    """A table measured as ``a + b n + c n²`` (with noise on two points) gives back ``2c`` as the
    attention per pair, whatever attention the profile carried, and a step of four 512-token
    prompts then costs one step's constant, the linear term over 2,048 tokens and each prompt's
    own pairs: the four alone less three constants."""
    a, b, c = 0.01, 1.4e-3, 3.6e-7
    tokens = [1, 16, 64, 128, 256, 512, 1024, 1536, 2048]
    exact = [a + b * n + c * n * n for n in tokens]
    assert calibrate.table_attention(tokens, exact) == pytest.approx(2 * c, rel=1e-6)
    noisy = [t * (1.2 if n == 128 else 0.9 if n == 1024 else 1.0) for n, t in zip(tokens, exact)]
    prof = replace(_profile(), prefill_tokens=tokens, prefill_s=exact, prefill_attn_s=0.0)
    smooth = calibrate.smoothed(prof)
    assert smooth.prefill_attn_s == pytest.approx(2 * c, rel=1e-6)
    cost = CostModel(replace(smooth, step_loop_s=0.0))
    four = cost.step([(512, 0)] * 4, 0, 0)
    assert four == pytest.approx(a + b * 2048 + c * 4 * 512 * 512, rel=1e-6)
    assert four == pytest.approx(4 * cost.prefill(512) - 3 * a, rel=1e-6)
    # the profile's own attention term (here none) would have priced the four as one prompt of 2,048
    assert CostModel(replace(prof, step_loop_s=0.0)).step([(512, 0)] * 4, 0, 0) == pytest.approx(exact[-1], rel=1e-6)
    # a noisy table: still the fit's own quadratic, and the smoothed table lies on it
    attn = calibrate.table_attention(tokens, noisy)
    fitted = calibrate.smoothed(replace(prof, prefill_s=noisy))
    assert fitted.prefill_attn_s == attn and attn > 0
    second = [(y2 - y1) / (x2 - x1) for x1, x2, y1, y2 in zip(tokens, tokens[1:], fitted.prefill_s, fitted.prefill_s[1:])]
    assert all(s2 >= s1 - 1e-12 for s1, s2 in zip(second, second[1:]))  # convex: its c is the attention's
    # too short a table is not fitted
    assert calibrate.table_attention([1, 16, 64], [0.01, 0.03, 0.1]) is None
    assert calibrate.smoothed(replace(prof, prefill_tokens=[1, 16, 64], prefill_s=[0.01, 0.03, 0.1])).prefill_attn_s == 0.0
