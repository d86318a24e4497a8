"""When ``pdserve up`` calls a deployment ready (services/launcher.py ``workers_short``): the
gateway's /health/ready body must count every worker the deployment started."""

from __future__ import annotations

import json
from pathlib import Path

from services.launcher import Deployment, workers_short
from shared.config import Settings


def dep(replicas: dict[str, int]) -> Deployment:
    return Deployment(settings=Settings(), state_dir=Path("/nonexistent"), replicas=replicas)


def body(**workers) -> str:
    return json.dumps({"status": "ready", "workers": workers})


def test_ready_only_when_every_started_worker_is_counted():
    d = dep({"tokenizer": 1, "prefill": 1, "decode": 2, "postfilter": 1, "gateway": 1})
    assert workers_short(d, body(tokenizer=1, prefill=1, decode=2, postfilter=1)) == []
    assert workers_short(d, body(tokenizer=1, prefill=0, decode=1, postfilter=1)) == ["prefill 0/1", "decode 1/2"]
    # a stage missing from the body is not live; an unstarted stage (0 replicas) is not waited for
    assert workers_short(d, body(tokenizer=1, decode=2, postfilter=1)) == ["prefill 0/1"]
    assert workers_short(dep({"prefill": 0}), body(tokenizer=1, decode=1, postfilter=1)) == []
    # stages left out of the replicas start one worker each, as start_services does
    assert workers_short(dep({}), body(tokenizer=1, prefill=1, decode=1)) == ["postfilter 0/1"]


def test_a_body_of_another_shape_means_not_ready_never_an_exception():
    d = dep({"decode": 1})
    for text in ("not json", "[1]", json.dumps({"workers": None}), json.dumps({"status": "ready"}),
                 json.dumps({"workers": {"decode": "2"}})):
        assert "decode 0/1" in workers_short(d, text), text
