"""Shared fixtures: a tiny locally built model, settings isolated per test session, and
helpers to reach the NATS and Redis servers the machine runs."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest

from tests.tiny_model import build_tiny_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    """(model loaded for pdserve's engine, reference model for transformers' generate, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.model_runner import ATTN_IMPLEMENTATION, register_attention

    register_attention()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION).eval()
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return model, ref, tok


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def nats_url() -> str:
    url = os.environ.get("PD_NATS_URL", "nats://127.0.0.1:4222")
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    if not _reachable(host, int(port)):
        pytest.fail(f"NATS is not reachable at {url} (the test suite needs a NATS server with JetStream)")
    return url


@pytest.fixture(scope="session")
def redis_url() -> str:
    url = os.environ.get("PD_REDIS_URL", "redis://127.0.0.1:6379/0")
    hostport = url.split("://", 1)[1].split("/", 1)[0]
    host, port = hostport.rsplit(":", 1)
    if not _reachable(host, int(port)):
        pytest.fail(f"Redis is not reachable at {url}")
    return url


@pytest.fixture
def namespace() -> str:
    """A namespace of its own for each test: no stream, subject or key is shared."""
    return f"t{uuid.uuid4().hex[:10]}"


def pytest_collection_modifyitems(config, items):
    """Mark every test under tests/integration/ ``deployment`` (each starts pdserve processes
    through tests/pipeline_fixture.py, or NATS servers of its own), and any other test whose
    module uses that fixture's ``deployment``: ``make test-fast`` leaves them out."""
    from tests import pipeline_fixture

    integration = REPO / "tests" / "integration"
    for item in items:
        path = Path(str(item.fspath))
        module = getattr(item, "module", None)
        if integration in path.parents or getattr(module, "deployment", None) is pipeline_fixture.deployment:
            item.add_marker(pytest.mark.deployment)
