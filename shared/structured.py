"""Grammars for structured output and forced tool calls, made and checked at the gateway.

The result is an llguidance grammar (JSON text) that travels in ``SamplingParams.grammar``;
the model stages compile it into a token matcher (``engine/grammar.py``). Torch-free.

* ``response_format: {"type": "json_object"}`` → any JSON object;
  ``{"type": "json_schema", "json_schema": {"schema": ...}}`` → JSON valid for the schema
  (``strict`` or not: pdserve always enforces the schema, as vLLM and SGLang do).
* ``tool_choice: "required"`` → a JSON array of one or more calls (one when
  ``parallel_tool_calls`` is false), each ``{"name": <a tool's name>, "arguments": <valid for
  that tool's parameters schema>}``; a named function → just its arguments object.

JSON is generated compactly with ``", "`` and ``": "`` separators and no other whitespace
(so a model cannot pad forever with blanks). Objects hold only the properties their schema
names, unless it says otherwise (:func:`close_objects`; ``PD_STRUCTURED_ADDITIONAL_PROPERTIES``
keeps JSON Schema's default, ``strict: true`` always closes them). Unknown schema keywords (``format`` values
llguidance lacks, ...) are ignored (llguidance's ``lenient``); a schema that is not a valid
schema (a wrong ``type``, a bad ``pattern``, a dangling ``$ref``) is a 400 naming the parameter.
Compiling the same schema again is served from a cache (:data:`CACHE_SIZE` entries).
"""

from __future__ import annotations

import json
from functools import lru_cache

from llguidance import LLMatcher

from shared.errors import InvalidRequest

#: llguidance JSON-compiler options (see the module docstring).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}
#: Distinct schemas whose grammars each gateway keeps.
CACHE_SIZE = 512
#: The schema of ``json_object`` and of a function without ``parameters``.
ANY_OBJECT: dict = {"type": "object"}


@lru_cache(maxsize=CACHE_SIZE)
def _grammar(schema_json: str, param: str) -> str:
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema_json, overrides=JSON_OPTIONS)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    except Exception as exc:  # the binding raises ValueError, TypeError or RuntimeError on odd input
        raise InvalidRequest(f"invalid JSON schema in '{param}': {exc}", param=param) from None
    if is_error:
        raise InvalidRequest(f"invalid JSON schema in '{param}': {messages[0] if messages else 'rejected'}",
                             param=param)
    # lenient compilation ignores keywords it cannot enforce (uniqueItems, contains, ...): the
    # output would then not be guaranteed to match, so such schemas are refused
    unenforced = [m.split(":", 1)[1].strip() for m in messages if m.startswith("Unimplemented keys")]
    if unenforced:
        raise InvalidRequest(f"invalid JSON schema in '{param}': keywords the structured-output engine cannot "
                             f"enforce: {', '.join(unenforced)}", param=param)
    return grammar


#: most entries in one object's ``properties``, one ``enum`` or one ``anyOf``/``oneOf``: llguidance's
#: Earley parser allows 2,000 items in a row, about four per property (measured: 100 properties
#: work, 500 end the output after "{"), so larger schemas are refused up front
MAX_SCHEMA_ENTRIES = 256
INT64 = (-(1 << 63), (1 << 63) - 1)  # llguidance clamps integer bounds to int64


def _check_limits(node, param: str) -> None:
    """Refuse schema parts the grammar engine cannot enforce (400 naming ``param``)."""
    if isinstance(node, list):
        for item in node:
            _check_limits(item, param)
        return
    if not isinstance(node, dict):
        return
    for key in ("properties", "enum", "anyOf", "oneOf"):
        entries = node.get(key)
        if isinstance(entries, (dict, list)) and len(entries) > MAX_SCHEMA_ENTRIES:
            raise InvalidRequest(f"invalid JSON schema in '{param}': '{key}' has {len(entries)} entries; at most "
                                 f"{MAX_SCHEMA_ENTRIES} are supported", param=param)
    if node.get("type") == "integer":
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            bound = node.get(key)
            if isinstance(bound, (int, float)) and not isinstance(bound, bool) and not INT64[0] <= bound <= INT64[1]:
                raise InvalidRequest(f"invalid JSON schema in '{param}': integer '{key}' {bound} is outside the "
                                     "64-bit range", param=param)
    for value in node.values():
        _check_limits(value, param)


def _without_no_ops(node):
    """``node`` without keywords that constrain nothing and that the grammar engine would still
    report as unenforceable (``"uniqueItems": false``, JSON Schema's default)."""
    if isinstance(node, list):
        return [_without_no_ops(item) for item in node]
    if not isinstance(node, dict):
        return node
    return {k: _without_no_ops(v) for k, v in node.items() if not (k == "uniqueItems" and v is False)}


#: Keywords whose value is one subschema, a map of subschemas, or a list of subschemas.
_ONE_SCHEMA = ("additionalProperties", "items", "additionalItems", "contains", "propertyNames", "not", "if", "then",
               "else", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_APPLICATORS = ("allOf", "anyOf", "oneOf")


def _names_properties(node) -> bool:
    return isinstance(node, dict) and ("properties" in node or "patternProperties" in node)


def close_objects(schema: dict) -> dict:
    """``schema`` with ``"additionalProperties": false`` on every object schema that names
    its properties and leaves additional ones unsaid: the grammar then generates only the
    named properties (OpenAI's ``strict`` semantics; vLLM's default with xgrammar, its
    ``disable-additional-properties`` with guidance). A copy; ``schema`` is not changed.

    Left open, where closing would refuse what the schema allows: objects without
    ``properties`` (``{"type": "object"}`` stays any object), objects that say
    ``additionalProperties`` or ``unevaluatedProperties`` themselves, objects extended by
    their own ``allOf``/``anyOf``/``oneOf`` or a sibling ``$ref``, members of an ``allOf``
    (and definitions an ``allOf`` refers to), and ``anyOf``/``oneOf`` members of an object
    that names properties itself. Values (``enum``, ``const``, ``default``, ``examples``)
    are never walked into.
    """
    kept_open: set[str] = set()  # "$ref" targets that another schema extends

    def collect(node, extending: bool) -> None:
        if isinstance(node, list):
            for item in node:
                collect(item, extending)
            return
        if not isinstance(node, dict):
            return
        ref = node.get("$ref")
        if isinstance(ref, str) and (extending or _names_properties(node)):
            kept_open.add(ref)
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                for sub in value.values():
                    collect(sub, False)
            elif key == "allOf" or (key in _APPLICATORS and _names_properties(node)):
                collect(value, True)
            elif key in _SCHEMA_LISTS or key in _ONE_SCHEMA:
                collect(value, False)

    def close(node, open_here: bool, path: str):
        if isinstance(node, list):
            return [close(item, open_here, f"{path}/{i}") for i, item in enumerate(node)]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                out[key] = {name: close(sub, f"{path}/{key}/{name}" in kept_open, f"{path}/{key}/{name}")
                            for name, sub in value.items()}
            elif key == "allOf" or (key in _APPLICATORS and _names_properties(node)):
                out[key] = close(value, True, f"{path}/{key}")
            elif key in _SCHEMA_LISTS or key in _ONE_SCHEMA:
                out[key] = close(value, False, f"{path}/{key}")
            else:
                out[key] = value  # a value (enum, const, default, ...) or an annotation
        extended = any(k in node for k in (*_APPLICATORS, "$ref", "additionalProperties", "unevaluatedProperties"))
        if _names_properties(node) and not open_here and not extended:
            out["additionalProperties"] = False
        return out

    collect(schema, False)
    return close(schema, False, "#")


def schema_grammar(schema: dict, param: str, *, closed: bool = True) -> str:
    """The grammar of JSON valid for ``schema``; ``closed``: objects hold only the properties
    their schema names (:func:`close_objects`), else JSON Schema's default (any others may
    follow).

    Raises:
        InvalidRequest: ``schema`` is not a valid JSON schema (400 naming ``param``).
    """
    if not isinstance(schema, dict):
        raise InvalidRequest(f"invalid JSON schema in '{param}': a schema is an object", param=param)
    _check_limits(schema, param)
    try:
        schema = _without_no_ops(schema)
        # key order kept: properties are generated in the order given
        text = json.dumps(close_objects(schema) if closed else schema)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"invalid JSON schema in '{param}': {exc}", param=param) from None
    return _grammar(text, param)


def response_format_grammar(response_format: dict | None, *, closed: bool = True) -> str | None:
    """The grammar of an OpenAI ``response_format`` (as a plain dict); None for text.
    ``closed``: as for :func:`schema_grammar` (a ``json_schema`` with ``strict: true`` is
    always closed).

    Raises:
        InvalidRequest: an unknown type or an invalid schema (param ``response_format``).
    """
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return schema_grammar(ANY_OBJECT, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequest("response_format of type json_schema needs a 'json_schema' object "
                                 "({\"name\": ..., \"schema\": {...}})", param="response_format")
        schema = spec.get("schema")
        return schema_grammar(ANY_OBJECT if schema is None else schema, "response_format",
                              closed=closed or spec.get("strict") is True)
    raise InvalidRequest(f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
                         param="response_format")


def tool_call_schema(tools: list[dict], parallel: bool) -> dict:
    """The JSON schema of ``tool_choice: "required"`` output: an array of calls.

    Args:
        tools: OpenAI function tools (``{"type": "function", "function": {name, parameters}}``).
        parallel: more than one call allowed.
    """
    calls = []
    defs: dict = {}
    for i, tool in enumerate(tools):
        fn = tool["function"]
        arguments = fn.get("parameters") or ANY_OBJECT
        rebased = _rebase_refs(arguments, f"#/$defs/tool{i}")
        if rebased != arguments:
            # its "#/..." references mean its own root: it moves under the array schema's $defs
            # and they are rewritten to point there ("#/$defs/City" → "#/$defs/tool0/$defs/City")
            defs[f"tool{i}"] = rebased
            arguments = {"$ref": f"#/$defs/tool{i}"}
        calls.append({
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": arguments},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict = {"type": "array", "items": item, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


#: Keywords whose values are data, not subschemas (never walked for ``$ref``).
_VALUES = ("enum", "const", "default", "examples")


def _rebase_refs(node, base: str):
    """``node`` with its JSON-pointer ``$ref`` s (``#``, ``#/...``) made relative to ``base``."""
    if isinstance(node, list):
        return [_rebase_refs(item, base) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
        elif key in _VALUES:
            out[key] = value
        else:
            out[key] = _rebase_refs(value, base)
    return out


def check_tools(tools: list[dict]) -> None:
    """Every function's ``parameters`` compiles.

    Raises:
        InvalidRequest: an invalid parameters schema (param ``tools``).
    """
    for tool in tools:
        parameters = tool["function"].get("parameters") or ANY_OBJECT
        if isinstance(parameters, dict) and parameters.get("type", "object") != "object":
            raise InvalidRequest(f"tool {tool['function'].get('name')!r}: 'parameters' must be a JSON schema of "
                                 f"type object, not {parameters.get('type')!r}", param="tools")
        schema_grammar(parameters, "tools")


def tool_grammar(tools: list[dict], choice: str | None, parallel: bool, *, closed: bool = True,
                 strict: frozenset[str] = frozenset()) -> str | None:
    """The grammar forcing a tool call: ``choice`` is "required", a function name, or
    anything else (auto, none: no grammar). ``closed``: as for :func:`schema_grammar`; the
    functions named in ``strict`` (``strict: true``) have closed arguments either way."""
    if not tools or choice in (None, "auto", "none"):
        return None
    if choice == "required":
        if not closed:
            tools = [{**t, "function": {**t["function"], "parameters": close_objects(t["function"]["parameters"])}}
                     if t["function"]["name"] in strict and t["function"].get("parameters") else t for t in tools]
        return schema_grammar(tool_call_schema(tools, parallel), "tools", closed=closed)
    fn = next(t["function"] for t in tools if t["function"]["name"] == choice)
    return schema_grammar(fn.get("parameters") or ANY_OBJECT, "tools", closed=closed or choice in strict)
