"""Tool calling at the gateway without a model: request checks, the prompt (native chat
template or the default format), parsing answers into calls, and the response bodies and
stream chunks (read back with the official ``openai`` client's types)."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from transformers import AutoTokenizer

from services.gateway.openai_models import ChatCompletionRequest
from services.gateway.request_run import Choice, Delta
from services.gateway.tools.calls import may_become_call, parse_tool_calls, plan_chat
from services.gateway.tools.responses import responses_for
from shared.errors import InvalidRequest
from shared.messages import RequestMeta, SamplingParams, TokenizeTask

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
]
NATIVE_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}[call {{ c.function.name }} {{ c.function.arguments.city }}]"
    "{% endfor %}{% endif %}{% if m.tool_call_id %} (for {{ m.tool_call_id }}){% endif %}\n{% endfor %}"
)


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": HISTORY[:1], **kw})


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_parsing_answers_into_calls():
    names = {"get_weather"}
    assert parse_tool_calls('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', names) == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    two = '[{"name": "get_weather", "arguments": {"city": "A"}}, {"name": "get_weather", "arguments": {}}]'
    assert [c["arguments"] for c in parse_tool_calls(two, names)] == ['{"city": "A"}', "{}"]
    assert parse_tool_calls('{"name": "get_weather", "parameters": {"city": "B"}}', names)[0]["arguments"] == '{"city": "B"}'
    for content in ("Hello", '{"name": "other", "arguments": {}}', "<tool_call>{broken</tool_call>", "{}"):
        assert parse_tool_calls(content, names) is None
    assert may_become_call("  <tool") and may_become_call("{") and may_become_call(" ")
    assert not may_become_call("Hi") and not may_become_call("<b>")


def test_request_checks():
    for kw, param in [({"tool_choice": "required"}, "tool_choice"),
                      ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                      ({"tools": [TOOL, TOOL]}, "tools"),
                      ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]}, "tools")]:
        with pytest.raises(InvalidRequest) as info:
            request(**kw)
        assert info.value.param == param
    with pytest.raises(ValueError):  # pydantic: a bad function name
        request(tools=[{"type": "function", "function": {"name": "has space"}}])


def test_default_tool_prompt_renders_tools_calls_and_results(tokenizer):
    plan = plan_chat(request(messages=HISTORY, tools=[TOOL]), tokenizer)
    assert plan.mode == "auto" and plan.grammar is None and plan.tools is None  # tiny template has no tools
    assert plan.messages[0].role == "system" and '"get_weather"' in plan.messages[0].content
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in plan.messages[2].content
    assert plan.messages[3].role == "user" and "<tool_response>\n21 C\n</tool_response>" == plan.messages[3].content
    none = plan_chat(request(messages=HISTORY, tools=[TOOL], tool_choice="none"), tokenizer)
    assert none.mode == "none" and none.messages[0].role == "user"  # tools not shown
    named = plan_chat(request(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                      tokenizer)
    assert named.mode == "named" and named.grammar is not None


def test_native_template_gets_tools_and_tool_messages(tiny_model_dir):
    from services.tokenizer.prompts import PromptProcessor

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = NATIVE_TEMPLATE
    plan = plan_chat(request(messages=HISTORY, tools=[TOOL], tool_choice="required"), tok)
    assert plan.tools == [TOOL] and plan.grammar is not None
    task = TokenizeTask(meta=RequestMeta("r", "inbox", "m", 0.0, 1.0), sampling=SamplingParams(max_tokens=4),
                        messages=plan.messages, tools=plan.tools)
    text = PromptProcessor(tok, 400, 1024).render_chat(task.messages, True, task.tools)
    assert text.startswith("TOOLS:get_weather;user: Weather in Paris?")
    assert "[call get_weather Paris]" in text and "tool: 21 C (for call_1)" in text


def _choice(req, text: str, finish: str) -> Choice:
    c = Choice(index=0, prompt_index=0, task=None)  # type: ignore[arg-type]
    c.text, c.finish_reason = [text], finish
    return c


def _sse_json(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.decode().split("\n") if line.startswith("data: {")]


@pytest.mark.parametrize("choice,answer", [
    ("required", '[{"name": "get_weather", "arguments": {"city": "Rome"}}]'),
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Rome"}'),
])
def test_bodies_and_chunks_parse_with_the_openai_types(choice, answer):
    req = request(tools=[TOOL], tool_choice=choice)
    resp = responses_for("chat", "chatcmpl-1", "m", 0, req, [])
    whole = ChatCompletion.model_validate(resp.complete([_choice(req, answer, "stop")]))
    call = whole.choices[0].message.tool_calls[0]
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content is None
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
    # streamed in two pieces: typed chunks whose fragments assemble to the same call
    resp = responses_for("chat", "chatcmpl-1", "m", 0, req, [])
    c = _choice(req, "", None)
    raw = b"".join(resp.first_chunks([c]))
    half = len(answer) // 2
    raw += resp.delta_chunk(Delta(c, answer[:half], None, []), [c])
    raw += resp.delta_chunk(Delta(c, answer[half:], "stop", []), [c])
    chunks = [ChatCompletionChunk.model_validate(obj) for obj in _sse_json(raw)]
    name, args, ids, finish = "", "", set(), None
    for ch in chunks:
        for tc in ch.choices[0].delta.tool_calls or ():
            name += (tc.function.name or "") if tc.function else ""
            args += (tc.function.arguments or "") if tc.function else ""
            ids |= {tc.id} if tc.id else set()
        finish = ch.choices[0].finish_reason or finish
    assert name == "get_weather" and json.loads(args) == {"city": "Rome"} and len(ids) == 1 and finish == "tool_calls"


def test_auto_streams_plain_text_at_once_and_truncated_calls_as_content():
    req = request(tools=[TOOL])
    resp = responses_for("chat", "chatcmpl-1", "m", 0, req, [])
    c = _choice(req, "", None)
    first = _sse_json(resp.delta_chunk(Delta(c, "Hel", None, []), [c]))
    assert first[0]["choices"][0]["delta"] == {"content": "Hel"}  # not a call: streamed right away
    resp = responses_for("chat", "chatcmpl-1", "m", 0, req, [])
    assert resp.delta_chunk(Delta(c, '{"name": "get_w', None, []), [c]) == b""  # may be a call: held
    cut = _sse_json(resp.delta_chunk(Delta(c, "eath", "length", []), [c]))
    assert cut[0]["choices"][0] == {"index": 0, "delta": {"content": '{"name": "get_weath'}, "logprobs": None,
                                    "finish_reason": "length"}
