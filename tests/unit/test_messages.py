"""The bus protocol: every message round-trips; anything else is poison."""

from __future__ import annotations

import os

import msgspec
import pytest

from shared import messages as m
from shared.errors import PoisonMessage
from shared.kv.layout import KVLayout

META = m.RequestMeta(request_id="r1", reply_to="pd.gateway.g.events", model="x", created_at=1.0, deadline_at=2.0)
SP = m.SamplingParams(max_tokens=5, temperature=0.0, stop=("a",), logit_bias={3: 1.5})
LAYOUT = KVLayout(model_id="x", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)

SAMPLES = [
    m.TokenizeTask(meta=META, sampling=SP, messages=[m.ChatMessage("user", "hi")]),
    m.PrefillTask(meta=META, sampling=SP, prompt_token_ids=[1, 2, 3], block_hashes=[os.urandom(32)]),
    m.DecodeTask(meta=META, sampling=SP, prompt_token_ids=[1, 2], output_token_ids=[7], postfilter="p",
                 kv=m.KVHandle(store="shm", layout=LAYOUT, block_hashes=[b"h" * 32], num_tokens=6, tail_key="tail/r1")),
    m.TokenChunk(request_id="r1", index=0, token_ids=[5], spec=m.StreamSpec(reply_to="x", stop=("s",)),
                 logprobs=[m.TokenLogprob(5, -0.1, [(5, -0.1), (6, -2.0)])]),
    m.TextChunk(request_id="r1", text="héllo 😀", text_offset=3, num_tokens=2, finish_reason="stop",
                usage=m.Usage(3, 2, 1)),
    m.Accepted(request_id="r1", num_prompt_tokens=3, max_tokens=5),
    m.ErrorEvent(request_id="r1", status=400, message="bad", type="invalid_request_error", param="x", code="c"),
    m.Abort(request_id="r1", reason="stop"),
    m.Heartbeat(stage="decode", instance_id="d1", model="x", sent_at=3.0),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda x: type(x).__name__)
def test_roundtrip(msg):
    assert m.decode(m.encode(msg)) == msg


def test_decode_as_checks_the_type():
    data = m.encode(SAMPLES[0])
    assert isinstance(m.decode_as(data, m.TokenizeTask), m.TokenizeTask)
    with pytest.raises(PoisonMessage):
        m.decode_as(data, m.DecodeTask)


@pytest.mark.parametrize("data", [
    b"", b"\x00\x01garbage", msgspec.msgpack.encode({"kind": "nope"}),
    msgspec.msgpack.encode({"kind": "abort"}),  # missing fields
    msgspec.msgpack.encode({"kind": "abort", "request_id": 5, "reason": "x"}),  # wrong type
])
def test_poison(data):
    with pytest.raises(PoisonMessage):
        m.decode(data)


def test_random_bytes_never_crash_the_decoder():
    rnd = __import__("random").Random(0)
    for _ in range(2000):
        data = bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 64)))
        try:
            m.decode(data)
        except PoisonMessage:
            pass
