"""Thread shares of model workers on one host (services/launcher.py, docs/decisions.md)."""

from __future__ import annotations

import os

from services.launcher import torch_threads
from shared.config import Settings


def test_decode_takes_the_cores_prefill_shares_them(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    settings = Settings(torch_threads=0)
    replicas = {"prefill": 1, "decode": 1, "gateway": 1}
    assert torch_threads(settings, replicas, "prefill") == 4
    assert torch_threads(settings, replicas, "decode") == 8
    assert torch_threads(settings, {"prefill": 2, "decode": 2}, "decode") == 4
    assert torch_threads(settings, {"prefill": 0, "decode": 3}, "decode") == 2
    assert torch_threads(Settings(torch_threads=3), replicas, "decode") == 3  # PD_TORCH_THREADS wins
