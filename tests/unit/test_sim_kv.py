"""The simulator's KV hand-off as pdserve does it (issue 34): the store is a FIFO server per
scope (shm per host, Redis for the fleet, the network per worker link), staging runs in a
thread (the prefill engine steps on), the decode-side import runs on the engine thread (it
delays that worker's next step), blocks the store or the decode worker already hold are not
moved again; and per-role engine settings."""

from __future__ import annotations

import pytest

from sim import trace
from sim.profile import CostModel
from sim.simulator import Simulation, Topology, simulate
from tests.unit.test_sim import _profile

SLOW = {"put_fixed_s": 0.0, "put_s_per_byte": 1e-6, "get_fixed_s": 0.0, "get_s_per_byte": 0.0, "source": "test"}


def _pair(arrive=(0.0, 0.0), prompt=1024, out=20):
    return [trace.SimRequest(i, t, prompt, out) for i, t in enumerate(arrive)]


def test_a_fleet_store_queues_puts_a_host_store_does_not():
    """Two prompts finish prefill at once on two prefill workers on two hosts: with Redis (one
    server for the fleet) the second put waits for the first; with shm (one per host) neither waits."""
    p = _profile(kv_stores={"redis": SLOW, "shm": SLOW})
    put = 1024 * p.kv_bytes_per_token * 1e-6  # 1.024 s
    topo = dict(mode="disaggregated", prefill=2, decode=2, tokenizers=2)  # both tokenized at once
    fleet = Simulation(Topology(kv_store="redis", **topo), p).run(_pair())
    host = Simulation(Topology(kv_store="shm", **topo), p).run(_pair())
    assert fleet.kv["wait_s"] == pytest.approx(put, rel=1e-6)
    assert host.kv["wait_s"] == 0.0
    assert fleet.kv["put_s"] == host.kv["put_s"] == pytest.approx(2 * put, rel=1e-6)
    # the second request's second token is a put later under Redis
    later = sorted(fleet.last)[1] - sorted(host.last)[1]
    assert later == pytest.approx(put, rel=0.01)


def test_staging_runs_in_a_thread():
    """A slow put delays the hand-off, not the prefill worker's next prompt."""
    reqs = _pair(arrive=(0.0, 0.001), prompt=512, out=3)
    fast = Simulation(Topology(mode="disaggregated", prefill=1, decode=1), _profile()).run(reqs)
    slow = Simulation(Topology(mode="disaggregated", prefill=1, decode=1, kv_store="shm"),
                      _profile(kv_stores={"shm": SLOW})).run(reqs)
    assert slow.first == pytest.approx(fast.first, rel=1e-9)  # both first tokens come from prefill
    assert min(s - f for s, f in zip(slow.last, fast.last)) > 0.5  # the hand-off waited for the put


def test_the_import_delays_the_decode_workers_next_step():
    """A request decoding alone on the decode worker; a second one's KV arrives: the first
    request's gap over the import is one decode step longer by the import's engine-thread time."""
    imp = 0.2
    p = _profile(kv_import_fixed_s=imp, kv_import_s_per_byte=0.0)
    reqs = [trace.SimRequest(0, 0.0, 64, 400), trace.SimRequest(1, 1.0, 64, 5)]
    r = Simulation(Topology(mode="disaggregated", prefill=1, decode=1), p).run(reqs)
    gaps0 = sorted([v for v, q in zip(r.gap_v, r.gap_r) if q == 0][1:])  # the first gap holds its own import
    c = CostModel(p)
    assert gaps0[-1] >= imp + c.decode_step(1, 64)
    assert gaps0[-1] <= imp + c.decode_step(2, 2 * 500)
    assert r.kv["import_s"] == pytest.approx(2 * imp)
    # without the import cost the longest gap is a decode step
    q = Simulation(Topology(mode="disaggregated", prefill=1, decode=1),
                   _profile(kv_import_fixed_s=0.0, kv_import_s_per_byte=0.0)).run(reqs)
    assert max([v for v, k in zip(q.gap_v, q.gap_r) if k == 0][1:]) < imp


def test_shared_prefixes_move_once():
    """Mooncake-style prefix reuse: a second prompt with the first's 1,024-token prefix stages
    only its own blocks, and the decode worker that holds the prefix reads only the rest."""
    p = _profile(kv_stores={"shm": {**SLOW, "get_s_per_byte": 1e-6}})
    a = trace.SimRequest(0, 0.0, 1024 + 64, 10, hash_ids=tuple(range(17)), segment_tokens=64)
    b = trace.SimRequest(1, 8.0, 1024 + 64, 10, hash_ids=tuple(range(16)) + (99,), segment_tokens=64)
    r = Simulation(Topology(mode="disaggregated", prefill=1, decode=1, kv_store="shm"), p).run([a, b])
    per_token = p.kv_bytes_per_token * 1e-6
    assert r.kv["put_s"] == pytest.approx((1088 + 64) * per_token, rel=1e-6)
    assert r.kv["get_s"] == pytest.approx((1088 + 64) * per_token, rel=1e-6)


def test_store_kinds_need_figures():
    p = _profile()
    with pytest.raises(ValueError, match="no figures for the redis KV store"):
        simulate(_pair(), Topology(mode="disaggregated", kv_store="redis"), p)
    with pytest.raises(ValueError, match="unknown KV store"):
        simulate(_pair(), Topology(mode="disaggregated", kv_store="nfs"), p)


def test_per_role_engine_settings():
    """The decode pool's max_num_seqs 2 holds four simultaneous requests to two at a time;
    the prefill pool keeps its own settings; an unknown setting is refused."""
    reqs = [trace.SimRequest(i, 0.0, 64, 50) for i in range(4)]
    both = simulate(reqs, Topology(mode="disaggregated", prefill=1, decode=1), _profile())
    narrow = simulate(reqs, Topology(mode="disaggregated", prefill=1, decode=1, roles={"decode": {"max_num_seqs": 2}}),
                      _profile())
    assert narrow["e2e"]["p99"] > 1.5 * both["e2e"]["p99"] > 0  # the last two wait for the first two
    topo = Topology(mode="disaggregated", max_prefill_chunk_tokens=0, roles={"prefill": {"max_prefill_chunk_tokens": 256}})
    assert topo.engine("prefill")["max_prefill_chunk_tokens"] == 256
    assert topo.engine("decode")["max_prefill_chunk_tokens"] == 0
    with pytest.raises(ValueError, match="unknown engine setting 'chunk'"):
        Topology(roles={"decode": {"chunk": 1}}).engine("decode")


def test_heterogeneous_pools_price_prefill_from_their_profile():
    """A prefill pool on a profile twice as fast at prefill gives a shorter TTFT; pools of
    different models (KV bytes per token) are refused."""
    p = _profile()
    fast = _profile(prefill_s=[x / 2 for x in p.prefill_s], prefill_attn_s=p.prefill_attn_s / 2)
    reqs = [trace.SimRequest(0, 0.0, 2048, 4)]
    same = simulate(reqs, Topology(mode="disaggregated"), p)
    het = simulate(reqs, Topology(mode="disaggregated"), p, prefill_profile=fast)
    c, cf = CostModel(p), CostModel(fast)
    assert same["ttft"]["p50"] - het["ttft"]["p50"] == pytest.approx(c.prefill(2048) - cf.prefill(2048), rel=1e-6)
    with pytest.raises(ValueError, match="not the same model"):
        simulate(reqs, Topology(mode="disaggregated"), p, prefill_profile=_profile(kv_bytes_per_token=7))


def test_simulate_command_takes_the_store_and_per_role_settings(tmp_path, capsys):
    from sim import run

    prof = _profile(kv_stores={"redis": SLOW}).save(tmp_path / "p.json")
    common = ["--profile", str(prof), "--trace", "poisson:512:1", "--requests", "20", "--rate", "4",
              "--mode", "disaggregated", "--max-output", "8", "--json"]
    assert run.main(common + ["--kv-store", "redis", "--role", "decode.max_num_seqs=2"]) == 0
    import json

    s = json.loads(capsys.readouterr().out)
    assert s["kv"]["store"] == "redis" and s["kv"]["put_s"] > 0 and s["finished"] == 20
    assert run.main(common + ["--kv-store", "network"]) == 2
    assert "no figures for the network KV store" in capsys.readouterr().out
    assert run.main(common + ["--role", "decode.chunk=3"]) == 2
    assert "unknown engine setting 'chunk'" in capsys.readouterr().out
    assert run.main(common + ["--role", "middle.max_num_seqs=3"]) == 2


def test_the_conditional_router_counts_staged_blocks_and_local_prefill_reads_them():
    """As the tokenizer does (``_staged_prefix_tokens``), the simulated router counts a prompt's
    leading blocks in the store: a question after a 1,024-token prefix another prompt staged
    has 64 tokens to compute, under the local limit, so it is prefilled on the decode worker,
    which reads the prefix from the store first (``import_store_hits``) and computes only the
    question."""
    per_byte = 1e-6  # reading a 1,024-token prefix takes about 1 s: remote would move all 1,088
    p = _profile(kv_stores={"shm": {**SLOW, "put_s_per_byte": 1e-9, "get_s_per_byte": per_byte}})
    a = trace.SimRequest(0, 0.0, 1024 + 64, 3, hash_ids=tuple(range(17)), segment_tokens=64)
    b = trace.SimRequest(1, 5.0, 1024 + 64, 3, hash_ids=tuple(range(16)) + (99,), segment_tokens=64)
    topo = Topology(mode="conditional", prefill=1, decode=2, local_max_tokens=128, kv_store="shm")
    sim = Simulation(topo, p)
    decisions = []
    decide = sim.router.decide
    sim.router.decide = lambda n, cached, pre, dec: decisions.append((n, cached)) or decide(n, cached, pre, dec)
    r = sim.run([a, b])
    assert decisions == [(1088, 0), (1088, 1024)]
    assert r.remote == 1  # a went to the prefill worker, b stayed local
    # a's hand-off read all of a; b's worker read the 1,024-token prefix unless it is the
    # worker that decoded a (its prefix cache holds it)
    read_b = r.kv["get_s"] - 1088 * p.kv_bytes_per_token * per_byte
    prefix = 1024 * p.kv_bytes_per_token * per_byte
    assert read_b == pytest.approx(prefix, rel=1e-6) or read_b == pytest.approx(0.0, abs=1e-9)
    # b computed its question only
    c = CostModel(p)
    assert r.first[1] - b.arrival_s < read_b + c.kv_import(1024 * p.kv_bytes_per_token) + c.prefill(64) \
        + c.ctx_attn * 64 * 1024 + 0.05
    assert r.first[1] - b.arrival_s - read_b < c.prefill(1088)
    # without the store's blocks counted (another prompt's prefix), b's 1,088 tokens go remote
    other = trace.SimRequest(1, 5.0, 1024 + 64, 3, hash_ids=tuple(range(100, 117)), segment_tokens=64)
    assert Simulation(topo, p).run([a, other]).remote == 2


def test_a_simulated_import_keeps_the_prompts_own_hits_and_stops_when_the_pool_is_full():
    """As ``LLMEngine.import_cached_blocks``: a worker of 6 blocks holding a prompt's first 2
    blocks imports the next 7 staged ones; it keeps its own hits, imports 4 and stops, and the
    engine thread pays for the 4 it imported."""
    from sim.worker import leading_hits, new_seq

    p = _profile(block_size=16, kv_import_fixed_s=0.0, kv_import_s_per_byte=1e-6)
    sim = Simulation(Topology(mode="conditional", prefill=1, decode=1, num_kv_blocks=6), p)
    w = sim.decode[0]
    req = trace.SimRequest(0, 0.0, 9 * 16 + 8, 3)
    hashes = req.block_hashes(16)
    for h in hashes[:2]:
        b = w.bm.allocate_block()
        w.bm.register_block(b, h)
        w.bm.release(b)
    seq = new_seq(req, 16, hashes, prefill_only=False)
    seq.store_hits, seq.kv_bytes = tuple(hashes[2:9]), 7 * 16 * p.kv_bytes_per_token
    w._import_store_hits(seq)
    assert leading_hits(w.bm, hashes) == 6
    assert w.import_s == pytest.approx(4 * 16 * p.kv_bytes_per_token * 1e-6)
    assert seq.store_hits == () and seq.kv_bytes == 0


def test_staged_blocks_count_once_their_put_has_ended():
    """The store's ``exists`` sees a block once its put is done: a question arriving while the
    prefix's put is still running is routed as a whole prompt (nothing cached), one arriving
    after it with the prefix counted."""
    p = _profile(kv_stores={"shm": {**SLOW, "put_s_per_byte": 1e-6, "get_s_per_byte": 1e-6}})
    a = trace.SimRequest(0, 0.0, 1024 + 64, 3, hash_ids=tuple(range(17)), segment_tokens=64)
    topo = Topology(mode="conditional", prefill=1, decode=1, local_max_tokens=128, kv_store="shm",
                    kv_stage_during_prefill=False)
    put_s = 1088 * p.kv_bytes_per_token * 1e-6  # about 1.1 s, after a prefill of about 0.4 s
    for arrive, cached in ((0.6, 0), (0.5 + put_s + 1.0, 1024)):
        b = trace.SimRequest(1, arrive, 1024 + 64, 3, hash_ids=tuple(range(16)) + (99,), segment_tokens=64)
        sim = Simulation(topo, p)
        seen = []
        decide = sim.router.decide
        sim.router.decide = lambda n, c, pre, dec, seen=seen, decide=decide: seen.append(c) or decide(n, c, pre, dec)
        sim.run([a, b])
        assert seen == [0, cached]


def test_a_segment_delayed_by_an_import_can_be_cut_before_it_begins():
    """A decode segment starts after the engine thread's KV import (seconds, on a GPU worker
    whose hand-off goes through host memory); a second hand-off arriving meanwhile cuts that
    segment before it has begun. The cut keeps its first step (it crashed on a negative
    elapsed time: the H200 profile's sweep hit it)."""
    p = _profile(kv_import_fixed_s=20.0, kv_import_s_per_byte=0.0, decode_ctx_s=1e-3)
    reqs = [trace.SimRequest(0, 0.0, 64, 400), trace.SimRequest(1, 1.0, 64, 50), trace.SimRequest(2, 1.5, 64, 50)]
    r = Simulation(Topology(mode="disaggregated", prefill=1, decode=1), p).run(reqs)
    assert r.finished == 3 and r.kv["import_s"] == pytest.approx(3 * 20.0)
    # the two later requests' tokens wait for both imports; the first's for all three
    assert min(r.last[1:]) > 2 * 20.0 and r.last[0] > 3 * 20.0


def test_reading_ahead_leaves_the_hand_off_the_last_chunk():
    """``PD_KV_PREFETCH``: a 2,048-token prompt prefilled in chunks of 512 on one prefill worker,
    its blocks staged chunk by chunk; the one decode worker reads each chunk's blocks as they are
    announced (idle: imported at once), so its hand-off reads the last chunk's 512 tokens, and the
    second token comes sooner by the read of the other 1,536. With two decode workers ``auto``
    reads nothing ahead (the task may go to either); ``all`` has both read."""
    get = 1e-7
    p = _profile(kv_stores={"shm": {"put_fixed_s": 0.0, "put_s_per_byte": 1e-9, "get_fixed_s": 0.0,
                                    "get_s_per_byte": get, "source": "test"}},
                 kv_import_fixed_s=0.0, kv_import_s_per_byte=0.0)
    req = [trace.SimRequest(0, 0.0, 2048, 2)]
    topo = dict(mode="disaggregated", prefill=1, max_prefill_chunk_tokens=512, kv_store="shm")
    runs = {k: Simulation(Topology(decode=1, kv_prefetch=k, **topo), p).run(req) for k in ("off", "auto")}
    saved = 1536 * p.kv_bytes_per_token * get
    assert runs["off"].last[0] - runs["auto"].last[0] == pytest.approx(saved, rel=0.02)
    assert runs["auto"].first == runs["off"].first  # the first token is prefill's either way
    assert runs["auto"].kv["get_s"] == pytest.approx(runs["off"].kv["get_s"], rel=1e-6)  # the same bytes, read earlier
    two = {k: Simulation(Topology(decode=2, kv_prefetch=k, **topo), p).run(req) for k in ("off", "auto", "all")}
    assert two["auto"].last == two["off"].last and two["auto"].kv["get_s"] == two["off"].kv["get_s"]
    assert two["all"].kv["get_s"] == pytest.approx(two["off"].kv["get_s"] + saved, rel=1e-6)  # the other worker's read
