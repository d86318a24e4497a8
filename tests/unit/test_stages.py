"""The example pluggable stages on their own."""

from __future__ import annotations

import asyncio
import random

import pytest

from services.plugins.api import load_class, refs, stage_name
from services.plugins.examples import AddContext, RedactPatterns
from shared.config import Settings
from shared.messages import ChatMessage, RequestMeta, SamplingParams, TokenizeTask

TEXT = ("Call me at 5551234567 or write to jane.doe@example.com; the code is 42, and 2024 was a year. "
        "Nothing else here, just words and a short number 123.")


def test_redaction_is_the_same_however_the_text_is_split():
    f = RedactPatterns(Settings.from_env({}))
    whole = f.pattern.sub(f.REPLACEMENT, TEXT)
    assert "5551234567" not in whole and "jane.doe@example.com" not in whole and "123." in whole
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(len(TEXT)), rng.randrange(0, 12)))
        pieces = [TEXT[a:b] for a, b in zip([0, *cuts], [*cuts, len(TEXT)])]
        state = f.open("r")
        out = "".join(f.feed(state, p) for p in pieces) + f.finish(state)
        assert out == whole


def test_add_context_prepends_retrieved_facts():
    stage = AddContext()
    asyncio.run(stage.setup(Settings.from_env({})))
    meta = RequestMeta(request_id="r", reply_to="x", model="m", created_at=0, deadline_at=1)
    task = TokenizeTask(meta=meta, sampling=SamplingParams(max_tokens=1),
                        messages=[ChatMessage("user", "What is the capital of France? Paris?")])
    out = asyncio.run(stage.process(task))
    assert out.messages[0].role == "system" and "capital" in out.messages[0].content
    assert out.messages[1:] == task.messages
    untouched = TokenizeTask(meta=meta, sampling=SamplingParams(max_tokens=1), messages=[ChatMessage("user", "hi")])
    assert asyncio.run(stage.process(untouched)) is untouched


def test_stage_refs():
    assert refs(" a.b:C , d:E,") == ["a.b:C", "d:E"]
    assert stage_name("services.plugins.examples:AddContext") == "addcontext"
    assert load_class("services.plugins.examples:AddContext") is AddContext
    with pytest.raises(ValueError):
        load_class("services.plugins.examples")
    with pytest.raises(ValueError):
        load_class("services.plugins.examples:Nope")
    proto = Settings.from_env({}, pre_stages="x.y:First,x.y:Second").protocol()
    assert proto.entry.subject == "pd.stage-first.tasks"
    assert proto.after_stage("first").subject == "pd.stage-second.tasks"
    assert proto.after_stage("second") == proto.tokenize
