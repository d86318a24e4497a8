"""OpenAI fidelity at the gateway without a model (issue 32): forced tool calls cut by
``max_tokens``, ``required`` calls streamed as generated, closed objects in grammars, tool
messages that answer no call, the order in which streamed choices first appear, echo with
logprobs streamed, and validation messages in the client's terms. Bodies and chunks are read
back with the official ``openai`` client's types and its stream accumulator."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError
from transformers import AutoTokenizer

from services.gateway.echo import PromptEcho
from services.gateway.openai_models import ChatCompletionRequest, CompletionRequest, validation_error_to_invalid
from services.gateway.request_run import Choice, Delta
from services.gateway.responses import Responses
from services.gateway.tools.calls import CallScanner, plan_chat
from services.gateway.tools.responses import responses_for
from shared.errors import InvalidRequest
from shared.messages import OutputLogprob
from shared.structured import close_objects, response_format_grammar, schema_grammar, tool_grammar

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, **kw})


def choice(index: int = 0, text: str = "", finish: str | None = None, prompt_index: int = 0) -> Choice:
    c = Choice(index=index, prompt_index=prompt_index, task=None)  # type: ignore[arg-type]
    c.text, c.finish_reason = ([text] if text else []), finish
    return c


def events(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.decode().split("\n") if line.startswith("data: {")]


def stream_chunks(resp, c: Choice, pieces: list[str], finish: str) -> list[list[dict]]:
    """The chunks of each step: the first chunks, then one list per delta (the last one
    finishing with ``finish``)."""
    steps = [events(b"".join(resp.first_chunks([c])))]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        c.text.append(piece)
        steps.append(events(resp.delta_chunk(Delta(c, piece, finish if last else None, []), [c])))
    return steps


def accumulate(chunks: list[dict]):
    """The completion assembled by openai-python's own stream state (what
    ``client.chat.completions.stream(...)`` uses; its snapshot, since the final parse raises
    LengthFinishReasonError for a ``length`` finish by design)."""
    state = ChatCompletionStreamState()
    for obj in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(obj))
    return state.current_completion_snapshot


# --- 1. a forced call cut by max_tokens is still a call ----------------------------------------
@pytest.mark.parametrize("tool_choice,cut,name,arguments", [
    (NAMED, '{"city": "Par', "get_weather", '{"city": "Par'),
    ("required", '[{"name": "get_weather", "arguments": {"city": "Par', "get_weather", '{"city": "Par'),
])
def test_forced_call_cut_by_max_tokens_is_a_call_with_finish_length(tool_choice, cut, name, arguments):
    req = chat(tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=8)
    body = responses_for("chat", "chatcmpl-1", "m", 0, req, []).complete([choice(text=cut, finish="length")])
    whole = ChatCompletion.model_validate(body).choices[0]
    assert whole.finish_reason == "length" and whole.message.content is None
    assert [(tc.function.name, tc.function.arguments) for tc in whole.message.tool_calls] == [(name, arguments)]
    assert whole.message.tool_calls[0].id.startswith("call_")

    resp = responses_for("chat", "chatcmpl-1", "m", 0, req, [])
    steps = stream_chunks(resp, choice(), [cut[:5], cut[5:]], "length")
    chunks = [obj for step in steps for obj in step]
    final = accumulate(chunks).choices[0]
    assert final.finish_reason == "length"
    assert [(tc.function.name, tc.function.arguments) for tc in final.message.tool_calls] == [(name, arguments)]
    heads = [tc for obj in chunks for tc in obj["choices"][0]["delta"].get("tool_calls") or () if "id" in tc]
    assert [(h["index"], h["type"], h["function"]["name"], h["function"]["arguments"]) for h in heads] == [
        (0, "function", name, "")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(not obj["choices"][0]["delta"].get("content") for obj in chunks)  # nothing as content


def test_required_cut_before_any_name_has_neither_content_nor_calls():
    req = chat(tools=[WEATHER, TIME], tool_choice="required", max_tokens=2)
    body = responses_for("chat", "chatcmpl-1", "m", 0, req, []).complete([choice(text='[{"na', finish="length")])
    whole = ChatCompletion.model_validate(body).choices[0]
    assert whole.finish_reason == "length" and whole.message.content is None and whole.message.tool_calls is None


def test_auto_answer_cut_short_stays_content():
    req = chat(tools=[WEATHER], max_tokens=4)
    body = responses_for("chat", "chatcmpl-1", "m", 0, req, []).complete([choice(text='{"name": "get_w', finish="length")])
    assert body["choices"][0]["message"]["content"] == '{"name": "get_w' and body["choices"][0]["finish_reason"] == "length"


# --- 5a. required: calls stream as they are generated ------------------------------------------
def test_required_calls_stream_as_they_are_generated():
    answer = ('[{"name": "get_weather", "arguments": {"city": "Rome"}}, '
              '{"name": "get_time", "arguments": {"zone": "CET"}}]')
    req = chat(tools=[WEATHER, TIME], tool_choice="required")
    resp = responses_for("chat", "chatcmpl-1", "m", 0, req, [])
    pieces = [answer[i:i + 7] for i in range(0, len(answer), 7)]
    steps = stream_chunks(resp, choice(), pieces, "stop")
    # the first call's head goes out once its name is complete, long before the answer ends
    first_head = next(i for i, step in enumerate(steps)
                      if any(tc.get("id") for obj in step for tc in obj["choices"][0]["delta"].get("tool_calls") or ()))
    assert first_head == 1 + (len('[{"name": "get_weather"') - 1) // 7
    fragments = [tc["function"]["arguments"] for step in steps[:len(steps) // 2] for obj in step
                 for tc in obj["choices"][0]["delta"].get("tool_calls") or () if not tc.get("id")]
    assert "".join(fragments).startswith('{"city"')  # arguments fragments flow mid-answer
    chunks = [obj for step in steps for obj in step]
    final = accumulate(chunks).choices[0]
    assert final.finish_reason == "tool_calls" and not final.message.content
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in final.message.tool_calls] == [
        ("get_weather", {"city": "Rome"}), ("get_time", {"zone": "CET"})]
    whole = resp.complete([choice(text=answer, finish="stop")])["choices"][0]["message"]["tool_calls"]
    assert [tc.function.arguments for tc in final.message.tool_calls] == [tc["function"]["arguments"] for tc in whole]


def test_call_scanner_reads_any_cut_and_any_spacing():
    text = '[ {"name": "f", "arguments": {"s": "a\\"}]{", "n": [1, {"x": 2}]}} , {"name":"g","arguments":{}}]'
    whole = [{"name": "f", "arguments": '{"s": "a\\"}]{", "n": [1, {"x": 2}]}'}, {"name": "g", "arguments": "{}"}]
    for cut in range(len(text) + 1):
        scanner = CallScanner()
        for ch in text[:cut]:
            scanner.feed(ch)
        calls = scanner.named_calls()
        assert [c["name"] for c in calls] == [c["name"] for c in whole[:len(calls)]]
        assert all(whole[i]["arguments"].startswith(c["arguments"]) for i, c in enumerate(calls)), (cut, calls)
    assert calls == whole


# --- 2. closed objects ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def accepts(tiny_model_dir):
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok = llguidance.hf.from_tokenizer(hf)

    def check(grammar: str, text: str) -> bool:
        ids = hf.encode(text, add_special_tokens=False)
        assert hf.decode(ids) == text
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        if matcher.validate_tokens(ids) != len(ids):
            return False
        matcher.consume_tokens(ids)
        return matcher.is_accepting()

    return check


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "pet": {
    "type": "object", "properties": {"kind": {"type": "string"}}}}, "required": ["name"]}


def test_objects_hold_only_named_properties_by_default(accepts):
    closed, open_ = schema_grammar(PERSON, "response_format"), schema_grammar(PERSON, "response_format", closed=False)
    assert accepts(closed, '{"name": "Ann", "pet": {"kind": "cat"}}')
    for extra in ('{"name": "Ann", "type": "x"}', '{"name": "Ann", "pet": {"kind": "cat", "age": 3}}'):
        assert not accepts(closed, extra) and accepts(open_, extra)
    # strict: true closes them whatever the setting; json_object stays any object
    strict = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    assert not accepts(response_format_grammar(strict, closed=False), '{"name": "Ann", "type": "x"}')
    assert accepts(response_format_grammar({"type": "json_object"}), '{"anything": 1}')
    named = tool_grammar([WEATHER], "get_weather", True)
    assert accepts(named, '{"city": "Oslo"}') and not accepts(named, '{"city": "Oslo", "type": "x"}')
    assert accepts(tool_grammar([WEATHER], "get_weather", True, closed=False), '{"city": "Oslo", "type": "x"}')
    strict_tool = tool_grammar([WEATHER], "required", True, closed=False, strict=frozenset({"get_weather"}))
    assert not accepts(strict_tool, '[{"name": "get_weather", "arguments": {"city": "Oslo", "type": "x"}}]')


def test_closing_leaves_alone_what_it_would_break(accepts):
    said = {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": {"type": "integer"}}
    assert close_objects(said) == said
    part_a = {"type": "object", "properties": {"a": {"type": "string"}}}
    part_b = {"type": "object", "properties": {"b": {"type": "string"}}}
    both = {"allOf": [part_a, part_b]}
    assert close_objects(both) == both and accepts(schema_grammar(both, "r"), '{"a": "x", "b": "y"}')
    extended = {"type": "object", "properties": {"a": {"type": "string"}}, "anyOf": [part_b]}
    assert accepts(schema_grammar(extended, "r"), '{"a": "x", "b": "y"}')
    via_ref = {"$defs": {"Base": part_a}, "allOf": [{"$ref": "#/$defs/Base"}, part_b]}
    assert "additionalProperties" not in close_objects(via_ref)["$defs"]["Base"]
    assert accepts(schema_grammar(via_ref, "r"), '{"a": "x", "b": "y"}')
    values = {"type": "object", "properties": {"k": {"const": {"properties": {}}}}, "default": {"properties": {}}}
    assert close_objects(values)["properties"]["k"] == {"const": {"properties": {}}}
    assert close_objects(values)["default"] == {"properties": {}}
    nested = close_objects({"type": "array", "items": {"$ref": "#/$defs/P"}, "$defs": {"P": PERSON}})
    assert nested["$defs"]["P"]["additionalProperties"] is False
    assert nested["$defs"]["P"]["properties"]["pet"]["additionalProperties"] is False
    assert "additionalProperties" not in PERSON  # a copy


def test_the_setting_reaches_the_plan(tiny_model_dir, accepts):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    req = chat(tools=[WEATHER], tool_choice=NAMED)
    assert not accepts(plan_chat(req, tok).grammar, '{"city": "Oslo", "type": "x"}')
    assert accepts(plan_chat(req, tok, closed=False).grammar, '{"city": "Oslo", "type": "x"}')


# --- 3. a tool message must answer an earlier call -----------------------------------------------
@pytest.mark.parametrize("messages", [
    [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "21 C"}],
    [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
     {"role": "tool", "tool_call_id": "call_b", "content": "21 C"}],
    [{"role": "tool", "tool_call_id": "call_a", "content": "21 C"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}],
])
def test_tool_message_answering_no_earlier_call_is_refused(messages):
    with pytest.raises(InvalidRequest) as info:
        chat(messages=messages, tools=[WEATHER])
    assert info.value.status == 400 and info.value.param == "messages" and "tool_call_id" in info.value.message
    ok = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "21 C"}]
    assert chat(messages=ok, tools=[WEATHER]).messages[-1].tool_call_id == "call_a"


# --- 4. streamed choices first appear in index order ---------------------------------------------
@pytest.mark.parametrize("body", [{"prompt": "hi"}, {"prompt": ["a", "b"]}, {"prompt": "hi", "echo": True},
                                  {"prompt": "hi", "echo": True, "logprobs": 0}])
def test_streamed_completion_choices_first_appear_in_index_order(body, tiny_model_dir):
    from services.tokenizer.prompts import PromptProcessor

    req = CompletionRequest.model_validate({"model": "m", "n": 3, "stream": True, **body})
    prompts = PromptProcessor(AutoTokenizer.from_pretrained(tiny_model_dir), 400, 1024)
    resp = Responses("completion", "cmpl-1", "m", 0, req, [p for p in req.prompts()] if req.echo else [],
                     PromptEcho.of(req, prompts))
    choices = [choice(i, prompt_index=i // 3) for i in range(3 * len(req.prompts()))]
    raw = b"".join(resp.first_chunks(choices))
    for c in reversed(choices):  # the pipeline answers the last choice first
        raw += resp.delta_chunk(Delta(c, "x", "stop", [OutputLogprob("x", -0.5, [120], ())]), choices)
    seen: list[int] = []
    for obj in events(raw):
        assert obj["object"] == "text_completion" and len(obj["choices"]) == 1
        seen += [c["index"] for c in obj["choices"] if c["index"] not in seen]
    assert seen == [c.index for c in choices]


# --- 5b. echo with logprobs: the prompt and its logprobs in one chunk -----------------------------
def test_streamed_echo_carries_the_prompt_with_its_logprobs(tiny_model_dir):
    from services.tokenizer.prompts import PromptProcessor

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = "ab ab"
    ids = tok.encode(prompt)
    pieces = [tok.decode([t]) for t in ids]
    req = CompletionRequest.model_validate({"model": "m", "prompt": prompt, "echo": True, "logprobs": 0,
                                            "stream": True, "max_tokens": 2})
    resp = Responses("completion", "cmpl-1", "m", 0, req, [prompt], PromptEcho.of(req, PromptProcessor(tok, 400, 1024)))
    c = choice()
    prompt_lps = [OutputLogprob(p, -1.0, list(p.encode()), ()) for p in pieces[1:]]
    first = resp.first_chunks([c]) + [resp.delta_chunk(Delta(c, "Z", None, [OutputLogprob("Z", -0.1, [90], ())], 0,
                                                                prompt_lps), [c])]
    later = resp.delta_chunk(Delta(c, "Y", "length", [OutputLogprob("Y", -0.2, [89], ())], 1), [c])
    chunks = [obj["choices"][0] for obj in events(b"".join([*first, later]))]
    assert [ch["text"] for ch in chunks] == ["", prompt + "Z", "Y"]
    lp = chunks[1]["logprobs"]
    assert "".join(lp["tokens"]) == chunks[1]["text"] and lp["token_logprobs"] == [None, *[-1.0] * len(prompt_lps), -0.1]
    assert chunks[2]["logprobs"]["text_offset"] == [len(prompt) + 1]


# --- 5c. validation messages name JSON types, never pdserve's classes -----------------------------
@pytest.mark.parametrize("extra,param", [
    ({"tool_choice": "bogus", "tools": [WEATHER]}, "tool_choice"),
    ({"tool_choice": 5, "tools": [WEATHER]}, "tool_choice"),
    ({"tool_choice": {"type": "function"}, "tools": [WEATHER]}, "tool_choice.function"),
    ({"tools": ["get_weather"]}, "tools[0]"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [5]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": ["x"]}]}, "messages[0].tool_calls[0]"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format.json_schema"),
    ({"stream": True, "stream_options": "x"}, "stream_options"),
])
def test_validation_messages_speak_json_not_class_names(extra, param):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, **extra})
    err = validation_error_to_invalid(info.value)
    assert err.param == param, err.message
    internal = ("ChatMessageIn", "TextPart", "ToolCallIn", "NamedToolChoice", "ResponseFormat", "JsonSchemaSpec",
                "StreamOptions", "Tool", "literal[", "instance of")
    assert not any(name in err.message for name in internal), err.message
    assert err.message.startswith(("Invalid value for", "Missing required parameter"))


@pytest.mark.parametrize("key", ["str", "list", "none", "a[b]", "Tool", "ChatMessageIn"])
def test_unknown_argument_named_like_a_type_is_named_back(key):
    """An unknown key is the client's word, even when it spells a type name pydantic uses for
    union members ("str", "list[...]", a model class): it is the param, not dropped."""
    for body, param in (({"model": "m", "messages": ASK, key: 1}, key),
                        ({"model": "m", "messages": [{"role": "user", "content": "hi", key: 1}]}, f"messages[0].{key}")):
        with pytest.raises(ValidationError) as info:
            ChatCompletionRequest.model_validate(body)
        err = validation_error_to_invalid(info.value)
        assert (err.param, err.code) == (param, "unrecognized_parameter"), err.message
        assert err.message == f"Unrecognized request argument supplied: {param}"


# --- required calls of tools whose parameters use $defs / $ref ---------------------------------
def test_required_with_parameters_that_refer_to_their_own_defs(accepts):
    """``$ref`` s in a tool's parameters mean that schema's root (pydantic-made schemas use
    ``$defs``); in the ``required`` array schema they used to dangle (a 400, "Pointer
    '/$defs/City' does not exist")."""
    city = {"type": "object", "$defs": {"City": {"type": "object", "properties": {"n": {"type": "string"}}}},
            "properties": {"c": {"$ref": "#/$defs/City"}}}
    count = {"type": "object", "$defs": {"City": {"type": "integer"}},
             "properties": {"c": {"$ref": "#/$defs/City"}, "again": {"$ref": "#"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": city}},
             {"type": "function", "function": {"name": "g", "parameters": count}}]
    grammar = tool_grammar(tools, "required", True)
    assert accepts(grammar, '[{"name": "f", "arguments": {"c": {"n": "x"}}}]')
    assert accepts(grammar, '[{"name": "g", "arguments": {"c": 5, "again": {"c": 3}}}]')
    assert not accepts(grammar, '[{"name": "f", "arguments": {"c": 5}}]')  # each tool's own City
    assert not accepts(grammar, '[{"name": "f", "arguments": {"c": {"n": "x", "z": 1}}}]')  # closed through $ref
    assert accepts(tool_grammar(tools, "required", True, closed=False), '[{"name": "f", "arguments": {"c": {"n": "x", "z": 1}}}]')
    strict = tool_grammar(tools, "required", True, closed=False, strict=frozenset({"f"}))
    assert not accepts(strict, '[{"name": "f", "arguments": {"c": {"n": "x", "z": 1}}}]')
    assert count["properties"]["again"] == {"$ref": "#"}  # the request's schema is not changed


@pytest.mark.parametrize("prompt, expected", [
    ([1.5], ["a valid string", "a valid integer", "a valid list"]),
    ([10**12], ["a valid string", "less than or equal to", "a valid list"]),
])
def test_a_prompt_list_that_fits_no_kind_names_every_kind(prompt, expected):
    """``prompt: [1.5]`` is a list, but of strings, token ids or lists? The message names every
    kind the input got equally far into, not the first one (which read "should be a valid string")."""
    from pydantic import ValidationError

    from services.gateway.openai_models import CompletionRequest, validation_error_to_invalid

    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"model": "m", "prompt": prompt})
    err = validation_error_to_invalid(info.value)
    assert err.status == 400 and err.param == "prompt[0]"
    assert all(part in err.message for part in expected), err.message
