"""Thread shares of model workers on one host (services/launcher.py, docs/decisions.md)."""

from __future__ import annotations

import os

from services.launcher import torch_threads
from shared.config import Settings


def test_decode_takes_the_cores_but_one_prefill_shares_them(monkeypatch):
    """Decode workers share every core but one (left to the postfilter, gateway and NATS);
    prefill workers share the cores with the decode workers."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    settings = Settings(torch_threads=0)
    replicas = {"prefill": 1, "decode": 1, "gateway": 1}
    assert torch_threads(settings, replicas, "prefill") == 4
    assert torch_threads(settings, replicas, "decode") == 7
    assert torch_threads(settings, {"prefill": 2, "decode": 2}, "decode") == 3
    assert torch_threads(settings, {"prefill": 0, "decode": 3}, "decode") == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert torch_threads(settings, replicas, "decode") == 1  # 2 vCPU: one for decode, one for the rest
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert torch_threads(settings, replicas, "decode") == 1
    assert torch_threads(Settings(torch_threads=3), replicas, "decode") == 3  # PD_TORCH_THREADS wins
