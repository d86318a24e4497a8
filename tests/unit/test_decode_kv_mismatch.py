"""A decode worker handed a KVHandle whose layout is not its own recomputes the prompt
(services/decode/worker.py ``_fetch_kv``): two hosts resolving ``PD_DTYPE=auto`` differently (one
with native bf16, one without) and sharing a KV store reach it. The whole pipeline runs in one
process on the in-memory bus (tests/unit/test_lost_messages.py); the decode worker alone computes
in bfloat16, so the float32 blocks prefill staged are not its layout."""

from __future__ import annotations

import asyncio

import pytest

from services.decode.worker import DecodeWorker
from tests.unit.test_lost_messages import run_pipeline

pytestmark = pytest.mark.timeout(300)
#: 40-odd tokens of the tiny tokenizer: full blocks and a tail
PROMPT = "the quick brown fox jumps over the lazy dog " * 4


def decode_stats(bus):
    worker = next(w for w in bus.workers if isinstance(w, DecodeWorker))
    return worker.engine.stats, worker.engine.layout


def test_matching_layout_loads_the_staged_kv(tiny_model_dir):
    """The companion: the same layout on both sides, so decode loads what prefill staged and
    computes nothing of the prompt (what the mismatch case must not do)."""
    text, bus = asyncio.run(run_pipeline(str(tiny_model_dir), prompt=PROMPT))
    stats, layout = decode_stats(bus)
    assert layout.dtype == "float32"
    assert stats.num_loaded_tokens > 0
    assert stats.num_prefill_tokens == 0
    assert text


def test_a_kv_handle_of_another_layout_is_recomputed(tiny_model_dir):
    text, bus = asyncio.run(run_pipeline(str(tiny_model_dir), prompt=PROMPT, decode_overrides={"dtype": "bfloat16"}))
    stats, layout = decode_stats(bus)
    assert layout.dtype == "bfloat16"
    assert stats.num_loaded_tokens == 0  # nothing read from the store: its blocks are float32
    assert stats.num_prefill_tokens > 0  # the prompt computed here instead
    assert text
