"""One tiny-model deployment (five processes over real NATS) shared by the integration tests."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.pipeline_fixture import deployment


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory, tiny_model_dir, nats_url):
    """Traced to files in ``<tmp>/spans`` and logging at DEBUG (``task_done`` lines), for
    test_observability.py: one deployment fewer to start. The stall timeout (20 s, the default
    30 s) is long enough that a request of any module here is not failed by a loaded machine's
    pause between two tokens (6 s was, under ~10 modules sharing the deployment), and short
    enough for test_pipeline.py's stuck stage."""
    ns = f"t{uuid.uuid4().hex[:10]}"
    tmp = tmp_path_factory.mktemp("pipe")
    # prompts over 16 tokens are prefilled in chunks, so the prefill worker stages their full
    # blocks while it prefills the rest (PD_KV_STAGE_DURING_PREFILL) in every module's requests
    with deployment(tmp, str(tiny_model_dir), ns, block_size=4, max_prefill_chunk_tokens=16, stall_timeout_s=20.0,
                    tracing=f"file:{tmp / 'spans'}", log_level="DEBUG") as dep:
        yield dep


@pytest.fixture(scope="session")
def client(pipeline):
    with httpx.Client(base_url=pipeline.url, timeout=60) as c:
        yield c
