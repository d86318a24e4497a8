"""OpenAI-compatible request bodies (pydantic, at the HTTP edge) and their translation into
pipeline SamplingParams.

Every parameter is either honoured or rejected with a 400 that names it: unknown fields are
refused (``extra="forbid"``), and known parameters pdserve does not implement yet (tools,
response_format, ...) get a message that says so.
"""

from __future__ import annotations

from functools import cache
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from services.gateway.tools.calls import check_tool_request
from services.gateway.tools.models import MAX_TOOLS, ResponseFormat, Tool, ToolCallIn, ToolChoice
from shared.errors import InvalidRequest

MAX_STOP_STRINGS = 16
MAX_N = 16
MAX_TOP_LOGPROBS = 20

#: Parameters clients send that pdserve recognises but does not implement: a clear 400.
#: Each maps to (values that mean "off" and are accepted, message).
NOT_IMPLEMENTED: dict[str, tuple[tuple, str]] = {
    "tools": (([],), "tool calling is not supported"),
    "tool_choice": (("none",), "tool calling is not supported"),
    "functions": (([],), "function calling is not supported"),
    "function_call": (("none",), "function calling is not supported"),
    "parallel_tool_calls": ((False,), "tool calling is not supported"),
    "response_format": (({"type": "text"},), "response_format (JSON mode, structured outputs) is not supported; only {\"type\": \"text\"}"),
    "audio": ((), "audio output is not supported"),
    "modalities": ((["text"],), "only text output is supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "web_search_options": ((), "web search is not supported"),
    "suffix": (("",), "suffix (insertion) is not supported"),
    "reasoning_effort": ((), "reasoning_effort is not supported"),
    "store": ((False,), "storing completions is not supported"),
    "metadata": (({},), "metadata is only used by stored completions, which are not supported"),
    "service_tier": (("auto", "default"), "only the default service tier exists"),
    "guided_json": ((), "guided decoding is not supported"),
    "guided_regex": ((), "guided decoding is not supported"),
    "guided_choice": ((), "guided decoding is not supported"),
}


class _Base(BaseModel):
    # strict: "2" is not a number and true is not 1; unknown fields are errors
    model_config = ConfigDict(extra="forbid", strict=True)


#: Bounds that keep every number inside what the bus (64-bit msgpack integers) carries.
MAX_INT = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=MAX_INT)]
#: Most pipeline requests one API request may fan out to (prompts × n).
MAX_CHOICES = 64


class TextPart(_Base):
    type: Literal["text"]
    text: str


class ChatMessageIn(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has one")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def check_tool_results(messages: list[ChatMessageIn]) -> None:
    """Every ``role: "tool"`` message answers a call of an earlier assistant message (its
    ``tool_call_id`` is one of that message's ``tool_calls`` ids), as OpenAI requires.

    Raises:
        InvalidRequest: naming ``messages`` (400).
    """
    call_ids: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "assistant":
            call_ids.update(c.id for c in m.tool_calls or ())
        elif m.role == "tool" and m.tool_call_id not in call_ids:
            raise InvalidRequest(f"Invalid parameter: messages[{i}] has role 'tool' and tool_call_id "
                                 f"{m.tool_call_id[:64]!r}, which no preceding assistant message's tool_calls "
                                 "has; a tool message must answer an earlier tool call", param="messages")


class StreamOptions(_Base):
    include_usage: bool = False
    continuous_usage_stats: bool = False


Probability = Annotated[float, Field(ge=0.0, le=1.0)]


class _SamplingFields(_Base):
    """Parameters shared by chat and text completions."""

    #: Keys of NOT_IMPLEMENTED that this endpoint does implement.
    IMPLEMENTED: ClassVar[frozenset[str]] = frozenset()

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_INT)
    min_p: Probability | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(default=None, max_length=256)
    #: pdserve extra (beside vLLM's ignore_eos, cache_salt, ...): false opts out of speculative decoding
    speculative: bool = True

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list):
            if len(v) > MAX_STOP_STRINGS:
                raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
            if any(not s for s in v):
                raise ValueError("stop strings must not be empty")
        elif v == "":
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if v is None:
            return v
        for key, bias in v.items():
            digits = key[1:] if key.startswith("-") else key
            if not (digits.isascii() and digits.isdigit() and len(digits) <= 10):
                raise ValueError(f"logit_bias keys must be token ids, not {key[:20]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError("logit_bias values must be in [-100, 100]")
        return v

    @model_validator(mode="before")
    @classmethod
    def _reject_unimplemented(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, (off, why) in NOT_IMPLEMENTED.items():
                if key in cls.IMPLEMENTED:
                    continue
                if key in data and data[key] is not None and data[key] not in off:
                    raise InvalidRequest(f"'{key}': {why} by this server", param=key, code="unsupported_parameter")
            data = {k: v for k, v in data.items() if k not in NOT_IMPLEMENTED or k in cls.IMPLEMENTED}
            best_of, n = data.get("best_of"), data.get("n", 1)
            if isinstance(best_of, int) and isinstance(n, int) and best_of < n:
                raise InvalidRequest("'best_of' must be greater than or equal to 'n'", param="best_of")
            if best_of not in (None, 1, n):
                raise InvalidRequest("'best_of' other than n is not supported; use n", param="best_of",
                                     code="unsupported_parameter")
            data.pop("best_of", None)
            if data.get("stream_options") is not None and not data.get("stream"):
                raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
        return data

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def logit_bias_ids(self, vocab_size: int) -> dict[int, float] | None:
        """logit_bias with integer keys.

        Raises:
            InvalidRequest: a token id outside the vocabulary.
        """
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            token = int(key)
            if not 0 <= token < vocab_size:
                raise InvalidRequest(f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})",
                                     param="logit_bias")
            out[token] = bias
        return out


class ChatCompletionRequest(_SamplingFields):
    IMPLEMENTED: ClassVar[frozenset[str]] = frozenset({"response_format", "tools", "tool_choice", "parallel_tool_calls"})

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    # structured output and tool calling (services/gateway/tools/calls.py)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _checks(self):
        check_tool_request(self)
        check_tool_results(self.messages)
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None and self.max_tokens != self.max_completion_tokens:
            raise InvalidRequest("max_tokens and max_completion_tokens disagree; send one", param="max_completion_tokens")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    #: 0 only with ``echo``: the prompt's logprobs alone (what lm-evaluation-harness may send)
    max_tokens: int | None = Field(default=None, ge=0, le=MAX_INT)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be an empty list")
            if isinstance(v[0], list) and any(len(p) == 0 for p in v):
                raise ValueError("token-id prompts must not be empty")
        return v

    @model_validator(mode="after")
    def _checks(self):
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            if len(self.prompt) * self.n > MAX_CHOICES:
                raise InvalidRequest(f"{len(self.prompt)} prompts × n={self.n} exceeds {MAX_CHOICES} completions per "
                                     "request", param="prompt")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequest("max_tokens 0 is only allowed with echo", param="max_tokens")
        return self

    def prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token when ``echo`` and ``logprobs`` ask for the prompt's
        logprobs (computed in prefill), else None."""
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    def num_logprobs(self) -> int | None:
        return self.logprobs


#: pydantic error types whose message names the expected model class ("a valid dictionary or
#: instance of ToolCallIn"): clients sent JSON, so they read "a JSON object" instead.
_OBJECT_EXPECTED = frozenset({"model_type", "model_attributes_type", "dict_type", "dataclass_type"})


@cache
def _model_names() -> frozenset[str]:
    """Names of the gateway's request models (pydantic puts them in the error locations of
    unions)."""
    names, todo = set(), [BaseModel]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("services.gateway"):
                names.add(sub.__name__)
    return frozenset(names)


def _is_union_tag(part) -> bool:
    """Whether a pydantic error location part names a union member (``str``,
    ``list[TextPart]``, ``literal['none','auto','required']``, ``NamedToolChoice``) rather
    than a field: a type, which the client never wrote."""
    return isinstance(part, str) and (
        "[" in part or part in _model_names() or part in ("str", "int", "float", "bool", "dict", "list", "none"))


def _type_parts(err: dict) -> tuple:
    """The parts of an error's location that may name a union member: all but an unknown
    field's own name (``extra_forbidden``: the client's key, whatever it spells, "str" or "a[b]")."""
    loc = tuple(err.get("loc", ()))
    return loc[:-1] if err.get("type") == "extra_forbidden" else loc


def _message(err: dict) -> str:
    if err.get("type") in _OBJECT_EXPECTED:
        return "Input should be a JSON object"
    return err.get("msg", "invalid value").removeprefix("Value error, ")


def _best_error(errors: list[dict]) -> tuple[dict, str]:
    """The error to report and its message: the first error, or where it is one member's of
    a union (e.g. ``tool_choice``: a string or an object), the error of the member the input
    got furthest into (an object missing its ``function`` is reported as that, not as "should
    be 'none', 'auto' or 'required'"); an input that fits no member at all hears every
    member's expectation ("... or a JSON object")."""
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    tag = next((i for i, part in enumerate(_type_parts(first)) if _is_union_tag(part)), None)
    if tag is None:
        return first, _message(first)
    rivals = [e for e in errors if tuple(e.get("loc", ()))[:tag] == loc[:tag] and len(_type_parts(e)) > tag
              and _is_union_tag(e["loc"][tag])]
    best = max(rivals, key=lambda e: len(e["loc"]), default=first)  # max keeps the first of equals
    if best.get("type") == "missing":
        return best, _message(best)
    if len(best["loc"]) > tag + 1:
        # members the input got equally far into (``prompt: [1.5]``: a list, but of strings, of
        # token ids or of lists?) are all named, not the first alone
        tied = [e for e in rivals if len(e["loc"]) == len(best["loc"]) and e["loc"][tag + 1:] == best["loc"][tag + 1:]]
        expected = [_message(e).removeprefix("Input should be ") for e in tied]
        return best, "Input should be " + " or ".join(dict.fromkeys(expected))
    expected = [_message(e).removeprefix("Input should be ") for e in rivals if len(e["loc"]) == tag + 1]
    return best, "Input should be " + " or ".join(dict.fromkeys(expected))


def validation_error_to_invalid(exc: ValidationError) -> InvalidRequest:
    """The most telling problem of a pydantic error as an InvalidRequest naming the parameter,
    in the client's terms (JSON types, never pdserve's class names)."""
    err, msg = _best_error(exc.errors())
    param = ""
    typed = len(_type_parts(err))
    for i, part in enumerate(err.get("loc", ())):
        if isinstance(part, int):
            param += f"[{part}]"
        elif i < typed and _is_union_tag(part):
            continue  # pydantic's name for a union member, not a field
        else:
            param += ("." if param else "") + str(part)
    param = param or None
    if err.get("type") == "extra_forbidden":
        return InvalidRequest(f"Unrecognized request argument supplied: {param}", param=param,
                              code="unrecognized_parameter")
    if err.get("type") == "missing":
        return InvalidRequest(f"Missing required parameter: '{param}'", param=param, code="missing_required_parameter")
    return InvalidRequest(f"Invalid value for '{param}': {msg}", param=param, code="invalid_value")


class TokenizeRequest(_Base):
    """``POST /tokenize`` (as vLLM offers it): a prompt, or chat messages with the template."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("give exactly one of 'prompt' and 'messages'", param="prompt")
        return self


class DetokenizeRequest(_Base):
    """``POST /detokenize``: token ids back to text."""

    model: str
    tokens: list[int]


def openapi_bodies() -> dict[str, dict]:
    """``openapi_extra`` request bodies, so the OpenAPI schema (and fuzzers that read it)
    knows each endpoint's body, although the handlers parse bodies themselves."""

    def inline(node, defs):
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
            return {k: inline(v, defs) for k, v in node.items() if k != "$defs"}
        if isinstance(node, list):
            return [inline(v, defs) for v in node]
        return node

    def body(model: type[BaseModel]) -> dict:
        schema = model.model_json_schema()
        schema = inline(schema, schema.get("$defs", {}))
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}

    return {
        "chat": body(ChatCompletionRequest),
        "completion": body(CompletionRequest),
        "tokenize": body(TokenizeRequest),
        "detokenize": body(DetokenizeRequest),
    }
