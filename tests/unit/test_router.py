"""The conditional router's cost model: short prompts local when it is cheaper, long ones
remote, and long ones local only when the prefill workers are backed up."""

from __future__ import annotations

import pytest

from services.tokenizer.router import Router
from shared.messages import Heartbeat


def hb(stage: str, iid: str, rate: float, queued: int = 0, running: int = 0) -> Heartbeat:
    return Heartbeat(stage=stage, instance_id=iid, model="m", sent_at=0.0, ready=True, prefill_tokens_per_s=rate,
                     queued_prefill_tokens=queued, num_running=running)


def test_short_prompt_is_local_and_long_prompt_remote_when_idle():
    r = Router(local_max_tokens=64, kv_bytes_per_token=46_080)
    prefill, decode = [hb("prefill", "p", 1000.0)], [hb("decode", "d", 1000.0)]
    short = r.decide(40, 0, prefill, decode)
    assert short.target == "local" and short.local_s < short.remote_s
    long = r.decide(1536, 0, prefill, decode)
    assert long.target == "remote" and "local limit of 64" in long.reason


def test_cached_tokens_count_only_what_is_left_to_compute():
    r = Router(local_max_tokens=64, kv_bytes_per_token=0)
    d = r.decide(1000, 960, [hb("prefill", "p", 1000.0)], [hb("decode", "d", 1000.0)])
    assert d.target == "local" and d.reason.startswith("cheaper locally: 40 tokens")


def test_backed_up_prefill_sends_a_medium_prompt_local():
    r = Router(local_max_tokens=64, kv_bytes_per_token=0)
    decode = [hb("decode", "d", 1000.0, running=3)]
    idle = r.decide(96, 0, [hb("prefill", "p", 1000.0)], decode)
    assert idle.target == "remote"
    # 6 s of prompts queued at the prefill worker: a 96-token prefill stalling 3 streams is the lesser harm
    busy = r.decide(96, 0, [hb("prefill", "p", 1000.0, queued=6000)], decode)
    assert busy.target == "local" and "backed up" in busy.reason
    # but never a prompt whose local stall costs more than half of waiting
    huge = r.decide(4000, 0, [hb("prefill", "p", 1000.0, queued=6000)], decode)
    assert huge.target == "remote"


def test_no_worker_of_a_kind_decides_by_itself():
    r = Router(local_max_tokens=64, kv_bytes_per_token=0)
    assert r.decide(5000, 0, [], [hb("decode", "d", 1.0)]).target == "local"
    assert r.decide(5, 0, [hb("prefill", "p", 1.0)], []).target == "remote"


def test_long_prompt_goes_remote_to_idle_prefill_workers_even_on_a_fast_model():
    """Over the local limit with nothing queued at prefill: remote, however fast local prefill
    is (the hop's fixed cost alone must not pull long prompts onto decode workers)."""
    r = Router(local_max_tokens=32, kv_bytes_per_token=0)
    d = r.decide(80, 0, [hb("prefill", "p", 20000.0)], [hb("decode", "d", 20000.0)])
    assert d.target == "remote" and "local limit of 32" in d.reason


def test_hand_off_estimates_come_from_the_router_parameters():
    """The remote cost is queue + compute + KV bytes / the given bandwidth + the given hop cost,
    so a simulated router prices the hand-off with its profile's figures, not constants."""
    prefill, decode = [hb("prefill", "p", 2000.0)], [hb("decode", "d", 1000.0, running=1)]
    fast = Router(local_max_tokens=64, kv_bytes_per_token=1000, kv_bandwidth_bytes_per_s=1e12, hop_overhead_s=0.0)
    slow = Router(local_max_tokens=64, kv_bytes_per_token=1000, kv_bandwidth_bytes_per_s=1e6, hop_overhead_s=0.5)
    a, b = fast.decide(60, 0, prefill, decode), slow.decide(60, 0, prefill, decode)
    assert a.remote_s == pytest.approx(60 / 2000.0 + 60 * 1000 / 1e12)
    assert b.remote_s == pytest.approx(60 / 2000.0 + 60 * 1000 / 1e6 + 0.5)
    assert a.local_s == b.local_s == pytest.approx(60 / 1000.0 * 2)
    assert (a.target, b.target) == ("remote", "local")
