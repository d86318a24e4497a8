"""Structured output and tool calling through the real pipeline, with the official ``openai``
client. The tiny model's text is gibberish: only the grammar makes it valid JSON, which is
what these tests check (against jsonschema and pydantic, not against pdserve's own code)."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny-llama"


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    pet: Literal["cat", "dog", "none"]


class Weather(BaseModel):
    city: str = Field(max_length=10)
    unit: Literal["celsius", "fahrenheit"]


WEATHER = openai.pydantic_function_tool(Weather, name="get_weather", description="Current weather")
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def oai(pipeline):
    return openai.OpenAI(base_url=f"{pipeline.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def closing_bias(tiny_model_dir) -> dict[str, float]:
    """A logit bias towards tokens that close JSON strings, objects and arrays, so that the
    gibberish model ends an unbounded json_object within a few dozen tokens. The grammar still
    decides what is allowed; the bias only makes the allowed closers likelier."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = {t for s in ('"', "}", "]", "1") for t in tok.encode(s, add_special_tokens=False)}
    return {str(t): 8.0 for t in ids}


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_parse_with_a_pydantic_model_streamed_and_not(oai):
    done = oai.chat.completions.parse(model=MODEL, messages=ask("Who?"), response_format=Person, max_tokens=120,
                                      temperature=0)
    choice = done.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Person)
    assert Person.model_validate_json(choice.message.content) == choice.message.parsed
    with oai.chat.completions.stream(model=MODEL, messages=ask("Who?"), response_format=Person, max_tokens=120,
                                     temperature=0) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == choice.message.parsed  # greedy: the same answer streamed


def test_json_object_and_n_with_a_seed(oai, closing_bias):
    resp = oai.chat.completions.create(model=MODEL, messages=ask("Some JSON"), response_format={"type": "json_object"},
                                       max_tokens=200, temperature=1.0, seed=11, n=3, logit_bias=closing_bias)
    texts = []
    for c in resp.choices:
        assert c.finish_reason == "stop", c.message.content
        assert isinstance(json.loads(c.message.content), dict)
        texts.append(c.message.content)
    schema = {**Person.model_json_schema(), "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    runs = [oai.chat.completions.create(model=MODEL, messages=ask("Who?"), response_format=rf, max_tokens=120,
                                        temperature=1.0, seed=5, n=3) for _ in range(2)]
    for c in runs[0].choices:
        jsonschema.validate(json.loads(c.message.content), schema)
    assert [c.message.content for c in runs[0].choices] == [c.message.content for c in runs[1].choices]
    # stop strings still apply on top of the grammar (the JSON is cut where the stop string starts)
    whole = oai.chat.completions.create(model=MODEL, messages=ask("Who?"), response_format=rf, max_tokens=120,
                                        temperature=0).choices[0].message.content
    cut = oai.chat.completions.create(model=MODEL, messages=ask("Who?"), response_format=rf, max_tokens=120,
                                      temperature=0, stop=['"age"'])
    assert '"age"' in whole and whole.startswith("{"), whole  # the schema requires the key
    # greedy: the same JSON up to where the stop string starts, not an empty (or any) prefix
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == whole[:whole.index('"age"')], (cut.choices[0].message.content, whole)


def _assemble(chunks) -> tuple[dict[int, dict], str | None]:
    """Tool calls from typed stream chunks, the way OpenAI documents assembling them."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or ():
                entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = tc.id or entry["id"]
                if tc.function is not None:
                    entry["name"] += tc.function.name or ""
                    entry["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_call_round_trip(oai, tool_choice):
    tools = [WEATHER, TIME_TOOL]
    messages = ask("Weather in Paris?")
    resp = oai.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice=tool_choice,
                                       max_tokens=120, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert call.id.startswith("call_") and call.type == "function"

    # the same call streamed: typed chunks, assembled by index
    chunks = list(oai.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice=tool_choice,
                                              max_tokens=120, temperature=0, stream=True))
    calls, finish = _assemble(chunks)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())

    # the result goes back as a tool message; the model answers (tool_choice none: text)
    messages = messages + [choice.message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    final = oai.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="none",
                                        max_tokens=6, temperature=0)
    assert final.choices[0].message.tool_calls is None and isinstance(final.choices[0].message.content, str)
    alone = oai.chat.completions.create(model=MODEL, messages=messages[:1], tools=tools, tool_choice="none",
                                        max_tokens=1, temperature=0)
    assert final.usage.prompt_tokens > alone.usage.prompt_tokens + 10  # the call and its result are in the prompt


def test_client_stream_helper_parses_a_strict_tool_call(oai):
    with oai.chat.completions.stream(model=MODEL, messages=ask("Weather?"), tools=[WEATHER],
                                     tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                     max_tokens=120, temperature=0.7, seed=3) as stream:
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Weather)


def test_auto_tool_choice_answers_text_or_calls(oai):
    resp = oai.chat.completions.create(model=MODEL, messages=ask("Hello"), tools=[WEATHER], max_tokens=8,
                                       temperature=0)
    msg = resp.choices[0].message
    assert (msg.tool_calls is None) == (resp.choices[0].finish_reason != "tool_calls")
    streamed = list(oai.chat.completions.create(model=MODEL, messages=ask("Hello"), tools=[WEATHER], max_tokens=8,
                                                temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == (msg.content or "")


@pytest.mark.parametrize("kwargs,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "(("}}}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/missing"}}}]},
     "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_invalid_schemas_are_400_naming_the_parameter(oai, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, messages=ask("x"), max_tokens=4, **kwargs)
    assert info.value.body["param"] == param


def test_completions_still_refuse_response_format(pipeline):
    client = openai.OpenAI(base_url=f"{pipeline.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"response_format": {"type": "json_object"}})
    assert info.value.body["param"] == "response_format"
