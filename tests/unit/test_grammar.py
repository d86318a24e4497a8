"""Constrained decoding in the engine (engine/grammar.py) on the tiny model: the grammar, not
the gibberish model, makes the output valid JSON; masks; replay after a resume (failover)."""

from __future__ import annotations

import asyncio
import copy
import json

import jsonschema
import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine, eos_ids_of
from engine.grammar import apply_bitmask, unpack_bitmask
from shared.errors import InvalidRequest
from shared.messages import SamplingParams
from shared.structured import response_format_grammar, schema_grammar, tool_call_schema

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 120},
                         "ok": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def engine(tiny_model, tiny_model_dir):
    model, _, _ = tiny_model
    # a copy: the C++ attention backend rewires the model it is given in place
    eng = LLMEngine(copy.deepcopy(model), EngineConfig(model_id="tiny", block_size=4, num_kv_blocks=1024, max_num_seqs=32),
                    eos_token_ids=eos_ids_of(model))
    eng.grammar.folder = tiny_model_dir
    return eng


def _text(tok, seq) -> str:
    return tok.decode(seq.output_token_ids, skip_special_tokens=True)


def test_bitmask_unpacking_and_masking():
    bitmask = torch.tensor([[0b101, 0], [-1, 1]], dtype=torch.int32)  # 2 rows, vocab 40 (2 words)
    allowed = unpack_bitmask(bitmask, 40)
    assert allowed.shape == (2, 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2]
    assert allowed[1].nonzero().flatten().tolist() == list(range(33))
    logits = torch.zeros(3, 72)  # wider than the mask: padding columns are disallowed
    apply_bitmask(logits, [0, 2], bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(logits[1]).all()  # unconstrained row untouched
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == list(range(33))
    whole = torch.randn(2, 64)
    apply_bitmask(whole, [0, 1], bitmask)  # every row constrained: the in-place path
    assert torch.isfinite(whole).tolist() == unpack_bitmask(bitmask, 64).tolist()
    row = torch.zeros(1, 64)
    apply_bitmask(row, [0], torch.zeros(1, 2, dtype=torch.int32))  # a matcher in error: never a NaN row
    assert torch.isfinite(row).all()


def test_schema_output_is_valid_json_greedy_and_sampled(engine, tiny_model):
    tok = tiny_model[2]
    prompt = tok.encode("Hello world")
    grammar = schema_grammar(SCHEMA, "response_format")
    free = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0))[0]
    with pytest.raises(ValueError):
        json.loads(_text(tok, free))  # the model alone does not write JSON
    params = [SamplingParams(max_tokens=80, temperature=0, grammar=grammar)] + [
        SamplingParams(max_tokens=80, temperature=1.0, seed=s, grammar=grammar) for s in range(5)]
    seqs = engine.generate([prompt] * len(params), params)  # one batch: masks for 6 rows per step
    for seq in seqs:
        assert seq.finish_reason == "stop"
        jsonschema.validate(json.loads(_text(tok, seq)), SCHEMA)
    assert len({_text(tok, s) for s in seqs[1:]}) > 1  # seeds still matter


def test_a_failed_matcher_ends_the_sequence_with_an_error(engine, tiny_model, monkeypatch):
    """When a sampled token breaks the grammar (here: masks not applied, so the gibberish model
    leaves the JSON grammar at once), the sequence ends with finish_reason "error" and the
    matcher's message, which the workers turn into a terminal error event, not a "stop"."""
    import engine.grammar as grammar_module

    monkeypatch.setattr(grammar_module, "apply_bitmask", lambda *args: None)
    tok = tiny_model[2]
    engine.add_request("broken", tok.encode("Hello world"),
                       SamplingParams(max_tokens=30, temperature=0, grammar=schema_grammar(SCHEMA, "response_format")))
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == "broken"]
    last = outputs[-1]
    assert last.finished and last.finish_reason == "error" and last.error
    assert all(o.error is None for o in outputs[:-1])


def test_resumed_sequence_replays_the_grammar_state(engine, tiny_model):
    """A stream resumed elsewhere with the tokens it already has (failover, or the prefill →
    decode hand-off) continues exactly as the uninterrupted one."""
    tok = tiny_model[2]
    prompt = tok.encode("The quick brown fox")
    sp = SamplingParams(max_tokens=80, temperature=1.0, seed=42, grammar=schema_grammar(SCHEMA, "response_format"))
    whole = engine.generate([prompt], sp)[0].output_token_ids
    for cut in (1, len(whole) // 2):
        seq = engine.add_request(f"resume-{cut}", prompt, sp, output_token_ids=whole[:cut])
        while engine.has_unfinished():
            engine.step()
        assert seq.output_token_ids == whole
    with pytest.raises(InvalidRequest):  # tokens the grammar forbids cannot be resumed
        engine.add_request("bad", prompt, sp, output_token_ids=tok.encode("xyz"))


def test_required_tool_call_grammar_and_ignore_eos(engine, tiny_model):
    tok = tiny_model[2]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"],
        "additionalProperties": False}}}]
    schema = tool_call_schema(tools, parallel=False)
    sp = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, grammar=schema_grammar(schema, "tools"))
    seq = engine.generate([tok.encode("call")], sp)[0]
    assert seq.finish_reason == "stop"  # the grammar's end stops it even with ignore_eos
    calls = json.loads(_text(tok, seq))
    jsonschema.validate(calls, schema)
    assert calls[0]["name"] == "f"


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": {"a": {"$ref": "#/nowhere"}}}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": []}},
    {"type": "grammar"},
    {"type": "json_schema"},  # no json_schema object
    # more properties than the grammar engine can enforce (it ended the output after "{")
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(300)}}}},
    # an integer bound outside int64 (the grammar engine clamped it and broke the schema)
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 10 ** 30}}},
])
def test_invalid_response_formats_name_the_parameter(fmt):
    with pytest.raises(InvalidRequest) as info:
        response_format_grammar(fmt)
    assert info.value.param == "response_format"


def test_a_schema_at_the_entry_limit_compiles_and_a_tool_needs_object_parameters():
    from shared.structured import MAX_SCHEMA_ENTRIES, check_tools

    wide = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(MAX_SCHEMA_ENTRIES)}}
    assert schema_grammar(wide, "response_format")
    wider = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(MAX_SCHEMA_ENTRIES + 1)}}
    with pytest.raises(InvalidRequest, match=f"{MAX_SCHEMA_ENTRIES + 1} entries"):
        schema_grammar(wider, "response_format")
    with pytest.raises(InvalidRequest) as info:
        check_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}])
    assert info.value.param == "tools"
    check_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])


def test_a_schema_at_the_entry_limit_generates_output_that_matches_it(engine, tiny_model):
    """At MAX_SCHEMA_ENTRIES properties the grammar still generates, not only compiles (past
    llguidance's limit the output ended after "{"): the last property is required, so every
    output has to carry the parser through the whole object; greedy and sampled."""
    from shared.structured import MAX_SCHEMA_ENTRIES

    last = f"k{MAX_SCHEMA_ENTRIES - 1}"
    wide = {"type": "object", "additionalProperties": False, "required": [last],
            "properties": {f"k{i}": {"type": "integer", "minimum": 0, "maximum": 9} for i in range(MAX_SCHEMA_ENTRIES)}}
    grammar = schema_grammar(wide, "response_format")
    tok = tiny_model[2]
    params = [SamplingParams(max_tokens=300, temperature=0, grammar=grammar)] + [
        SamplingParams(max_tokens=300, temperature=1.0, seed=s, grammar=grammar) for s in range(3)]
    for seq in engine.generate([tok.encode("Hello world")] * len(params), params):
        text = _text(tok, seq)
        assert seq.finish_reason == "stop", text
        value = json.loads(text)
        jsonschema.validate(value, wide)
        assert last in value, text


@pytest.mark.parametrize("schema,keyword", [({"type": "array", "uniqueItems": True}, "uniqueItems"),
                                            ({"type": "array", "contains": {"type": "integer"}}, "contains")])
def test_keywords_the_grammar_cannot_enforce_are_refused(schema, keyword):
    with pytest.raises(InvalidRequest) as err:
        schema_grammar({"type": "object", "properties": {"xs": schema}}, "response_format")
    assert keyword in err.value.message and err.value.status == 400
    schema_grammar({"type": "object", "properties": {"xs": {"type": "array", "description": "kept"}}}, "response_format")
    # the keyword's default constrains nothing: accepted
    schema_grammar({"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": False}}},
                   "response_format")


def test_grammar_cache_compiles_each_schema_once(engine):
    backend = engine.grammar.get()
    grammar = response_format_grammar({"type": "json_object"})
    assert response_format_grammar({"type": "json_object"}) is grammar  # the gateway's cache
    before = backend.num_compiled
    first, second = backend.compile(grammar), backend.compile(grammar)
    assert first is not second and backend.num_compiled <= before + 1
    assert response_format_grammar({"type": "text"}) is None
    fresh = schema_grammar({"type": "array", "items": {"type": "integer"}}, "response_format")
    count = backend.num_compiled
    asyncio.run(engine.grammar.precompile(fresh))  # what the workers do before admitting
    backend.compile(fresh)
    assert backend.num_compiled == count + 1
    asyncio.run(engine.grammar.precompile('{"grammars": "not one"}'))  # errors are left for add_request
