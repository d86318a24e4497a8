"""Choosing the Triton backend, and the GPU-path settings."""

from __future__ import annotations

import importlib.util

import pytest

import kernels
from kernels import attention
from shared.config import Settings, SettingsError


def test_triton_backend_needs_cuda():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        kernels.select("cpu", "triton")


def test_auto_on_cuda_picks_triton_when_installed(monkeypatch):
    real = importlib.util.find_spec
    if real("triton") is not None:
        assert kernels.select("cuda", "auto").__name__ == "kernels.triton"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    assert kernels.select("cuda", "auto") is attention
    with pytest.raises(RuntimeError):
        kernels.select("cuda", "triton")


def test_gpu_settings_are_validated():
    s = Settings.from_env({"PD_ATTENTION_BACKEND": "triton", "PD_CUDA_GRAPH_BATCH_SIZES": "8, 1,4",
                           "PD_CUDA_GRAPHS": "false", "PD_KV_PINNED_BUFFER_BYTES": "1048576"})
    assert (s.attention_backend, s.cuda_graphs, s.kv_pinned_buffer_bytes) == ("triton", False, 1 << 20)
    from engine.factory import engine_config

    assert engine_config(s).cuda_graph_batch_sizes == (1, 4, 8)
    for env, name in [({"PD_CUDA_GRAPH_BATCH_SIZES": "1,two"}, "PD_CUDA_GRAPH_BATCH_SIZES"),
                      ({"PD_CUDA_GRAPH_BATCH_SIZES": "0"}, "PD_CUDA_GRAPH_BATCH_SIZES"),
                      ({"PD_KV_PINNED_BUFFER_BYTES": "0"}, "PD_KV_PINNED_BUFFER_BYTES"),
                      ({"PD_ATTENTION_BACKEND": "cuda"}, "PD_ATTENTION_BACKEND")]:
        with pytest.raises(SettingsError, match=name):
            Settings.from_env(env)
