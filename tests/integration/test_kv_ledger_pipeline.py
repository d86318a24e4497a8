"""The KV ledger in a real deployment (separate processes, real NATS, the shared-memory store):
a served request's handle goes staged → imported → released and leaves no record; a handle
staged by a worker that is then SIGKILLed (its heartbeats stop) is reclaimed by the prefill
worker's reaper — tail deleted, bytes counted in its metrics."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from shared.kv import open_store, tail_key
from shared.kv.ledger import ledger_for
from shared.observe import collect_heartbeats, scrape_metric
from tests.pipeline_fixture import deployment

pytestmark = pytest.mark.timeout(600)

#: A stand-in for a prefill worker: it heartbeats as one, stages a tail with its ledger record
#: (not handed off), says so, and waits to be killed.
OWNER = r"""
import asyncio, sys, time
from shared.config import Settings
from shared.kv import open_store, tail_key
from shared.kv.ledger import ledger_for
from shared.messages import Heartbeat
from shared.nats_bus import NatsBus

async def main():
    s = Settings.from_env()
    bus = await NatsBus.connect(s, "ledger-test-owner")
    subject = s.protocol().heartbeat_of("prefill")
    beat = lambda: Heartbeat(stage="prefill", instance_id="prefill-doomed", model="m", sent_at=time.time(), ready=False)
    for _ in range(4):
        await bus.publish(subject, beat())
        await asyncio.sleep(s.heartbeat_interval_s)
    store = open_store(s)
    rid = sys.argv[1]
    n = store.put({tail_key(rid): b"k" * 5000}, 300.0)
    ledger_for(store).staged(rid, "prefill-doomed", "prefill", 300.0, time.time() + 600, n, 0, tail_key(rid))
    print("staged", flush=True)
    while True:
        await bus.publish(subject, beat())
        await asyncio.sleep(s.heartbeat_interval_s)

asyncio.run(main())
"""


def _metric(settings, stage: str, name: str, labels: str = "") -> float:
    return sum(scrape_metric(hb.metrics_port, name, labels) for hb in collect_heartbeats(settings).values()
               if hb.stage == stage and hb.metrics_port)


def test_ledger_records_are_released_and_a_killed_owners_handle_is_reclaimed(tmp_path, tiny_model_dir, nats_url):
    ns = f"led{uuid.uuid4().hex[:8]}"
    # the reference attention: no C++ kernel to build (the ledger is what is under test)
    with deployment(tmp_path, str(tiny_model_dir), ns, kv_store="shm", block_size=4, attention_backend="reference") as dep:
        settings = dep.settings
        store = open_store(settings)
        ledger = ledger_for(store)
        # a served request: its prompt's tail was staged, imported and released
        body = {"model": "tiny-llama", "prompt": "a prompt that does not fill whole blocks!", "max_tokens": 4}
        resp = httpx.post(f"{dep.url}/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        assert ledger.entries() == []
        assert _metric(settings, "prefill", "pd_kv_handle_transitions_total", 'state="staged"') >= 1
        assert _metric(settings, "decode", "pd_kv_handle_transitions_total", 'state="imported"') >= 1
        assert _metric(settings, "decode", "pd_kv_handle_transitions_total", 'state="released"') >= 1

        # an owner that dies with a handle staged and never handed off
        rid = f"orphan-{uuid.uuid4().hex[:8]}"
        env = {**os.environ, **settings.to_env(), "PYTHONPATH": os.getcwd()}
        owner = subprocess.Popen([sys.executable, "-c", OWNER, rid], env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert owner.stdout.readline().strip() == "staged"
            assert ledger.get(rid).owner == "prefill-doomed"
            time.sleep(settings.heartbeat_timeout_s)  # alive through several sweeps: kept
            assert ledger.get(rid) is not None and store.exists([tail_key(rid)]) == [True]
            before = _metric(settings, "prefill", "pd_kv_reclaimed_bytes_total")
            owner.kill()
            killed = time.monotonic()
            while ledger.get(rid) is not None:
                assert time.monotonic() - killed < 30, "the reaper left a dead owner's handle"
                time.sleep(0.2)
            took = time.monotonic() - killed
        finally:
            owner.kill()
            owner.wait()
        assert store.exists([tail_key(rid)]) == [False]
        assert took >= settings.heartbeat_timeout_s - 0.5  # not before its silence passed the timeout
        assert _metric(settings, "prefill", "pd_kv_handles_orphaned_total", 'reason="owner_dead"') >= 1
        assert _metric(settings, "prefill", "pd_kv_reclaimed_bytes_total") - before >= 5000
        assert ledger.entries() == []
        store.close()
