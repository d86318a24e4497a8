"""Settings, block hashing, subjects and the worker registry."""

from __future__ import annotations

import pytest

from shared.config import Settings, SettingsError
from shared.hashing import ROOT_HASH, block_hashes, hash_block, hash_extra
from shared.messages import Heartbeat
from shared.registry import WorkerRegistry
from shared.subjects import Protocol


def test_settings_from_env_converts_types_and_rejects_bad_values():
    s = Settings.from_env({"PD_GATEWAY_PORT": "9001", "PD_LOG_JSON": "false", "PD_KV_BLOCK_TTL_S": "2.5",
                           "PD_KV_STORE": "redis"})
    assert (s.gateway_port, s.log_json, s.kv_block_ttl_s, s.kv_store) == (9001, False, 2.5, "redis")
    with pytest.raises(SettingsError, match="PD_GATEWAY_PORT"):
        Settings.from_env({"PD_GATEWAY_PORT": "eighty"})
    with pytest.raises(SettingsError, match="PD_KV_STORE"):
        Settings.from_env({"PD_KV_STORE": "floppy"})
    with pytest.raises(SettingsError):
        Settings.from_env({"PD_BLOCK_SIZE": "0"})


def test_settings_env_roundtrip():
    s = Settings.from_env({}, namespace="abc", max_num_seqs=3, enable_prefix_caching=False)
    assert Settings.from_env(s.to_env()) == s


def test_block_hashes_are_chained_stable_and_salted():
    extra = hash_extra("m", 4)
    tokens = list(range(10))
    hs = block_hashes(tokens, 4, extra)
    assert len(hs) == 2 and all(len(h) == 32 for h in hs)
    assert hs[0] == hash_block(ROOT_HASH, [0, 1, 2, 3], extra)
    assert hs[1] == hash_block(hs[0], [4, 5, 6, 7], extra)
    # a block's hash depends on its whole prefix
    assert block_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4, extra)[1] != hs[1]
    # model, block size and salt separate caches
    assert block_hashes(tokens, 4, hash_extra("m", 4, "tenant-a"))[0] != hs[0]
    assert block_hashes(tokens, 4, hash_extra("other", 4))[0] != hs[0]
    # stable across processes and releases (staged blocks outlive a restart): a literal digest
    assert hs[0].hex() == "150593439379e069b55bd4055adc450c22d75c863bdededb39fb8061218997c8"


def test_subjects_are_namespaced():
    p = Protocol("ns1")
    assert p.prefill.subject == "ns1.prefill.tasks" and p.prefill.stream == "NS1_PREFILL_TASKS"
    assert p.prefill.durable == "prefill-workers" and p.decode.msg_id("r") == "decode:r"
    assert p.postfilter_inbox("pf-1") == "ns1.postfilter.pf-1.tokens"
    assert p.gateway_inbox("g") == "ns1.gateway.g.events" and p.abort == "ns1.control.abort"


def hb(stage, iid, ready=True):
    return Heartbeat(stage=stage, instance_id=iid, model="m", sent_at=0.0, ready=ready)


def test_registry_liveness_and_rendezvous_pick():
    r = WorkerRegistry(timeout_s=5)
    for i in range(3):
        r.observe(hb("postfilter", f"p{i}"), now=100.0)
    r.observe(hb("postfilter", "loading", ready=False), now=100.0)
    assert [h.instance_id for h in r.live("postfilter", now=101)] == ["p0", "p1", "p2"]
    owners = {k: r.pick("postfilter", k, now=101).instance_id for k in map(str, range(300))}
    assert set(owners.values()) == {"p0", "p1", "p2"}
    # p1 goes silent while p0 and p2 keep beating: only its keys move
    for t in range(101, 107):
        r.observe(hb("postfilter", "p0"), now=t)
        r.observe(hb("postfilter", "p2"), now=t)
    moved = {k for k in owners if r.pick("postfilter", k, now=106).instance_id != owners[k]}
    assert moved == {k for k, v in owners.items() if v == "p1"}
    assert r.pick("decode", "x", now=106) is None


def test_registry_does_not_declare_peers_gone_while_it_was_deaf():
    """A process paused (or cut off from NATS) for longer than the timeout hears nothing from
    anyone, itself included: that is not evidence that its peers died."""
    r = WorkerRegistry(timeout_s=5)
    for t in range(0, 4):
        r.observe(hb("gateway", "g"), now=t)
        r.observe(hb("decode", "me"), now=t)
    # frozen from t=3 to t=15: on waking, before any queued heartbeat is read, nobody is gone
    assert [h.instance_id for h in r.live("gateway", now=15)] == ["g"]
    # the queued heartbeats arrive; the gateway's among them
    r.observe(hb("decode", "me"), now=15.1)
    r.observe(hb("gateway", "g"), now=15.2)
    assert [h.instance_id for h in r.live("gateway", now=16)] == ["g"]
    # a peer that really stopped is gone once the others have been heard for timeout_s
    for t in range(16, 23):
        r.observe(hb("decode", "me"), now=t)
    assert r.live("gateway", now=22) == []
