"""Batch-invariant numerics end to end with the real default model as the README starts it:
SmolLM2-135M-Instruct from its GGUF (4-bit blocks, every step through the fused per-row path),
the default dtype (bfloat16 on a CPU with native bf16), real NATS, one prefill and two decode
workers. The cases are those of ``tests/integration/test_batch_invariance_pipeline.py``: the
seeded example alone and in a crowd, temperature 0 with and without a prefix hit (streamed and
not), a stream resumed on another decode worker after the first is SIGKILLed, and
disaggregated vs aggregated routing."""

from __future__ import annotations

import uuid

import pytest

from tests.integration.test_batch_invariance_pipeline import same_request_same_tokens
from tests.pipeline_fixture import deployment, log_tail

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]


def test_smollm2_same_request_same_tokens_in_the_default_dtype(tmp_path, nats_url):
    from engine.model.loader import ensure_model
    from shared.config import Settings

    folder = ensure_model(Settings.from_env({}))  # the default cache folder, shared with `make run`
    ns = f"e2e{uuid.uuid4().hex[:8]}"
    with deployment(tmp_path, "", ns, replicas={"decode": 2}, dtype="auto", weights="auto",
                    routing="disaggregated", cache_dir=str(folder.parent.parent), kv_cache_memory_bytes=256 << 20,
                    ack_wait_s=2.0, stall_timeout_s=60.0) as dep:
        assert dep.settings.dtype == "auto"
        # the path under test, in every model worker (the launcher returns once every started
        # worker is live, and a worker is live only after its engine is built)
        for worker in ("prefill-0", "decode-0", "decode-1"):
            log = log_tail(dep, worker, chars=1 << 30)
            assert "fused_decode_on" in log and "batch_invariant_on" in log, worker
        same_request_same_tokens(dep, "SmolLM2-135M-Instruct")
