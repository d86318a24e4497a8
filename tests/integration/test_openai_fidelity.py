"""OpenAI fidelity through the real pipeline with the official ``openai`` client (issue 32):
forced tool calls cut by ``max_tokens``, ``required`` calls streamed as generated, closed
objects, tool messages that answer no call, streamed choices in index order, and echo with
logprobs streamed. The tiny model's text is gibberish: the grammar decides the shape."""

from __future__ import annotations

import json

import openai
import pytest

pytestmark = pytest.mark.timeout(600)  # the first test also starts the shared deployment
MODEL = "tiny-llama"
#: a parameter the gibberish model cannot finish within a few dozen tokens
NOTE = {"type": "function", "function": {"name": "take_note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "minLength": 300}}, "required": ["text"]}}}
CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def oai(pipeline):
    return openai.OpenAI(base_url=f"{pipeline.url}/v1", api_key="unused", max_retries=0)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def assemble(chunks) -> tuple[list[dict], list[str | None], list[str]]:
    """(calls by index with id/type/name/arguments, finish reasons, content pieces) of typed chunks."""
    calls: dict[int, dict] = {}
    finishes, content = [], []
    for chunk in chunks:
        for ch in chunk.choices:
            content.append(ch.delta.content or "")
            for tc in ch.delta.tool_calls or ():
                if tc.index not in calls:  # the call's first delta: index, id, type and name
                    assert tc.id and tc.type == "function" and tc.function.name, tc
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": "", "fragments": 0}
                if tc.function and tc.function.arguments:
                    calls[tc.index]["arguments"] += tc.function.arguments
                    calls[tc.index]["fragments"] += 1
            finishes.append(ch.finish_reason)
    return [calls[i] for i in sorted(calls)], [f for f in finishes if f], content


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "take_note"}}, "required"])
def test_forced_call_cut_by_max_tokens_comes_back_as_a_cut_call(oai, tool_choice):
    kw = dict(model=MODEL, messages=ask("Note this"), tools=[NOTE], tool_choice=tool_choice, max_tokens=60,
              temperature=0)
    whole = oai.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "length" and whole.message.content is None
    call = whole.message.tool_calls[0]
    assert call.function.name == "take_note" and call.id.startswith("call_") and call.type == "function"
    assert call.function.arguments.startswith('{"text": "') and len(call.function.arguments) > 12
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)  # cut short, as OpenAI returns it

    calls, finishes, content = assemble(oai.chat.completions.create(**kw, stream=True))
    assert finishes == ["length"] and not "".join(content)
    assert [(c["name"], c["arguments"]) for c in calls] == [("take_note", call.function.arguments)]  # greedy: same
    assert calls[0]["fragments"] > 1  # the arguments streamed as generated, not in one piece at the end


def test_required_calls_stream_while_generated_and_match_the_whole_answer(oai):
    kw = dict(model=MODEL, messages=ask("Weather?"), tools=[CITY], tool_choice="required", max_tokens=200,
              temperature=0)
    whole = oai.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    calls, finishes, _ = assemble(chunks)
    assert finishes == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (tc.function.name, tc.function.arguments) for tc in whole.message.tool_calls]
    assert all(c["fragments"] > 1 for c in calls)
    for c in calls:
        assert set(json.loads(c["arguments"])) == {"city"}  # closed by default: only the named property


def test_tool_message_answering_no_call_is_a_400_naming_messages(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            *ask("Weather?"), {"role": "tool", "tool_call_id": "call_nope", "content": "21 C"}])
    assert info.value.status_code == 400 and info.value.body["param"] == "messages"
    assert info.value.body["type"] == "invalid_request_error" and "tool_call_id" in info.value.body["message"]
    history = [*ask("Weather?"), {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    ok = oai.chat.completions.create(model=MODEL, max_tokens=2, messages=history, tools=[CITY], tool_choice="none")
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_streamed_choices_first_appear_in_index_order(oai):
    for _ in range(3):
        seen: list[int] = []
        for chunk in oai.completions.create(model=MODEL, prompt=["Hello", "World"], n=3, max_tokens=6,
                                            temperature=1.0, stream=True):
            seen += [c.index for c in chunk.choices if c.index not in seen]
        assert seen == list(range(6))
    with oai.chat.completions.stream(model=MODEL, messages=ask("Hi"), n=3, max_tokens=6, temperature=1.0,
                                     seed=4) as stream:
        # the helper accumulates choices by position (its final parse refuses a "length" finish)
        final = stream.until_done().current_completion_snapshot
    whole = oai.chat.completions.create(model=MODEL, messages=ask("Hi"), n=3, max_tokens=6, temperature=1.0, seed=4)
    assert [c.index for c in final.choices] == [0, 1, 2]
    assert [c.message.content for c in final.choices] == [c.message.content for c in whole.choices]


def test_streamed_echo_sends_the_prompt_with_its_logprobs(oai):
    prompt = "The cat sat on the mat."
    chunks = list(oai.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=0, max_tokens=3,
                                         temperature=0, stream=True, extra_body={"ignore_eos": True}))
    texts = [c.choices[0].text for c in chunks]
    first = next(c.choices[0] for c in chunks if c.choices[0].text)
    assert first.text.startswith(prompt) and len(first.text) > len(prompt)
    assert "".join(first.logprobs.tokens) == first.text  # the chunk's text is its logprobs' tokens
    assert first.logprobs.token_logprobs[0] is None and len(first.logprobs.tokens) > 3
    whole = oai.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=0, max_tokens=3, temperature=0,
                                   extra_body={"ignore_eos": True}).choices[0]
    assert "".join(texts) == whole.text
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == whole.logprobs.tokens
