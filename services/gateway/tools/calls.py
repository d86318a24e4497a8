"""Tool calling and structured output at the gateway: checking the request, turning its
tools and tool messages into the prompt, the grammar that forces a call, and parsing the
model's output back into ``tool_calls``. See ``docs/structured-output.md``.

Prompt: when the model's chat template renders tools itself (its source mentions ``tools``,
the rule vLLM and Hugging Face use), the tools and the tool-call / tool-result messages go to
it unchanged (arguments as objects). Otherwise pdserve renders them with a default format
(Hermes'; Qwen 2.5 and SmolLM3 use it): a system message listing the tools in ``<tools>``,
earlier calls as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` lines of the
assistant, results as ``<tool_response>`` user turns.

Modes (``tool_choice``): ``none`` (tools not shown, no parsing), ``auto`` (tools shown; the
answer is parsed: ``<tool_call>`` blocks, or an answer that is nothing but a call object or an
array of them, becomes ``tool_calls``), ``required`` (a grammar forces a JSON array of calls),
a named function (a grammar forces its arguments object: the whole output is the arguments).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from shared.errors import InvalidRequest
from shared.messages import ChatMessage
from shared.structured import check_tools, response_format_grammar, tool_grammar

DEFAULT_TOOL_PROMPT = (
    "You can call functions (tools). Their signatures, as JSON schemas of their arguments:\n<tools>\n{tools}\n</tools>\n"
    "To call one or more of them, answer with nothing but one line per call:\n"
    '<tool_call>{{"name": <function name>, "arguments": <arguments object>}}</tool_call>\n'
    "Otherwise answer normally."
)
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def check_tool_request(req) -> None:
    """Cross-field checks of a chat request's tool and response_format fields, and that
    their schemas compile.

    Raises:
        InvalidRequest: naming ``tools``, ``tool_choice`` or ``response_format``.
    """
    names = [t.function.name for t in req.tools or ()]
    if len(set(names)) != len(names):
        raise InvalidRequest("tool function names must be unique", param="tools")
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, str) and choice.function.name not in names:
        raise InvalidRequest(f"tool_choice names function '{choice.function.name}', which is not in tools",
                             param="tool_choice")
    if choice == "required" and not names:
        raise InvalidRequest("tool_choice 'required' needs tools", param="tool_choice")
    if req.tools:
        check_tools([t.as_dict() for t in req.tools])
    grammar = response_format_grammar(req.response_format.as_dict()) if req.response_format else None
    if grammar is not None and tool_mode(req)[0] in ("required", "named"):
        raise InvalidRequest("response_format cannot be combined with a forced tool_choice (required or named)",
                             param="response_format", code="unsupported_parameter")


def tool_mode(req) -> tuple[str, str | None]:
    """``(mode, function name)``: mode is none, auto, required or named (OpenAI's default:
    auto when tools are given, else none)."""
    if not req.tools:
        return "none", None
    choice = req.tool_choice
    if choice is None or choice == "auto":
        return "auto", None
    if isinstance(choice, str):
        return choice, None
    return "named", choice.function.name


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders a ``tools`` argument."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    return "tools" in (template or "")


@dataclass
class ToolPlan:
    """What a chat request becomes: the messages and tools for the tokenizer, the grammar of
    every choice, and how the output is to be read."""

    mode: str = "none"
    name: str | None = None
    messages: list[ChatMessage] = field(default_factory=list)
    tools: list[dict] | None = None
    grammar: str | None = None

    @property
    def parses_calls(self) -> bool:
        return self.mode in ("auto", "required", "named")


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def plan_chat(req, tokenizer, *, closed: bool = True) -> ToolPlan:
    """Messages, tools and grammar of a chat request (see the module docstring). ``closed``:
    constrained objects hold only the properties their schema names
    (``PD_STRUCTURED_ADDITIONAL_PROPERTIES`` false; :func:`shared.structured.close_objects`).

    Raises:
        InvalidRequest: an invalid schema (naming the parameter).
    """
    mode, name = tool_mode(req)
    tools = [t.as_dict() for t in req.tools or ()]
    native = template_renders_tools(tokenizer)
    messages: list[ChatMessage] = []
    for m in req.messages:
        role = "system" if m.role == "developer" else m.role
        text = m.text()
        if native:
            calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                 "arguments": _arguments(c.function.arguments)}}
                     for c in m.tool_calls or ()] or None
            messages.append(ChatMessage(role=role, content=text, tool_calls=calls, tool_call_id=m.tool_call_id))
        elif role == "tool":
            messages.append(ChatMessage(role="user", content=f"<tool_response>\n{text}\n</tool_response>"))
        elif m.tool_calls:
            lines = [json.dumps({"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                                ensure_ascii=False) for c in m.tool_calls]
            calls_text = "\n".join(f"<tool_call>{line}</tool_call>" for line in lines)
            messages.append(ChatMessage(role=role, content=(text + "\n" if text else "") + calls_text))
        else:
            messages.append(ChatMessage(role=role, content=text))
    shown = tools if mode != "none" else []
    if shown and not native:
        prompt = DEFAULT_TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in shown))
        if messages and messages[0].role == "system":
            messages[0] = ChatMessage(role="system", content=messages[0].content + "\n\n" + prompt)
        else:
            messages.insert(0, ChatMessage(role="system", content=prompt))
    strict = frozenset(t.function.name for t in req.tools or () if t.function.strict)
    grammar = tool_grammar(tools, "required" if mode == "required" else name, req.parallel_tool_calls is not False,
                           closed=closed, strict=strict)
    if grammar is None and req.response_format is not None:
        grammar = response_format_grammar(req.response_format.as_dict(), closed=closed)
    return ToolPlan(mode=mode, name=name, messages=messages, tools=shown if native and shown else None,
                    grammar=grammar)


def new_call_id() -> str:
    """A tool call id (``call_`` and 24 random hex digits, OpenAI's shape)."""
    return "call_" + secrets.token_hex(12)


def _as_call(obj, names: set[str]) -> dict | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _arguments(args)
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def parse_tool_calls(text: str, names: set[str]) -> list[dict] | None:
    """The calls in a model's answer, as ``[{"name", "arguments" (JSON text)}]``, or None
    when the answer is not a tool call (then it is content). Calls of unknown functions, or
    not JSON, make the whole answer content."""
    stripped = text.strip()
    if "<tool_call>" in stripped:
        bodies = _TOOL_CALL.findall(stripped)
    elif stripped.startswith(("{", "[")):
        bodies = [stripped]
    else:
        return None
    calls: list[dict] = []
    for body in bodies:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        for item in obj if isinstance(obj, list) else [obj]:
            call = _as_call(item, names)
            if call is None:
                return None
            calls.append(call)
    return calls or None


def may_become_call(text: str) -> bool:
    """Whether an auto-mode answer that begins with ``text`` may still be a tool call (so a
    stream holds it back rather than show it as content)."""
    stripped = text.lstrip()
    if not stripped:
        return True
    return stripped.startswith(("{", "[", "<tool_call>")) or "<tool_call>".startswith(stripped)


@dataclass(slots=True)
class ScannedCall:
    """One call of a ``required`` answer as far as it has been generated: its name once the
    name string is complete, and the span of its ``arguments`` text (``end`` is None while
    the arguments are still open)."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None


class CallScanner:
    """Reads the output of ``tool_choice: "required"`` (a JSON array of ``{"name": ...,
    "arguments": {...}}`` objects, forced by the grammar) as it grows, so that its calls can
    stream while they are generated and a cut answer still yields the calls begun.

    :meth:`feed` takes each new piece of text; :attr:`calls` are the calls seen so far, and
    :meth:`arguments` their arguments text: whole once closed, else as far as generated.
    A character-level JSON scan (strings, escapes, nesting), so any whitespace is read.
    """

    def __init__(self):
        self.text = ""
        self.calls: list[ScannedCall] = []
        self._depth = 0  # 1: inside the array, 2: inside a call object
        self._in_string = False
        self._escaped = False
        self._string_start = 0
        self._expect_key = False  # at depth 2: the next string is a key
        self._key: str | None = None  # the call object's key whose value is being read
        self._scalar_args = False  # arguments that are a bare number / true / false / null

    def feed(self, piece: str) -> None:
        """Scan ``piece``, the next text of the answer."""
        start = len(self.text)
        self.text += piece
        for pos in range(start, len(self.text)):
            self._step(self.text[pos], pos)

    def _step(self, ch: str, pos: int) -> None:
        call = self.calls[-1] if self.calls else None
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
                if self._depth == 2 and call is not None:
                    self._end_string(call, self.text[self._string_start:pos + 1], pos)
            return
        if self._scalar_args and call is not None and self._depth == 2 and (ch in ",}" or ch.isspace()):
            call.args_end, self._scalar_args = pos, False
        if ch == '"':
            self._in_string, self._string_start = True, pos
            if self._depth == 2 and call is not None and self._key == "arguments" and call.args_start is None:
                call.args_start = pos
        elif ch in "{[":
            if self._depth == 1 and ch == "{":
                self.calls.append(ScannedCall())
                self._expect_key, self._key = True, None
            elif self._depth == 2 and call is not None and self._key == "arguments" and call.args_start is None:
                call.args_start = pos
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 2 and call is not None and self._key == "arguments" and call.args_end is None:
                call.args_end = pos + 1
        elif self._depth == 2 and ch == ":":
            self._expect_key = False
        elif self._depth == 2 and ch == ",":
            self._expect_key, self._key = True, None
        elif (self._depth == 2 and call is not None and self._key == "arguments" and call.args_start is None
              and not ch.isspace()):
            call.args_start, self._scalar_args = pos, True

    def _end_string(self, call: ScannedCall, raw: str, pos: int) -> None:
        try:
            value = json.loads(raw)
        except ValueError:
            return
        if self._expect_key:
            self._key = value
        elif self._key == "name" and call.name is None:
            call.name = value
        elif self._key == "arguments" and call.args_end is None:
            call.args_end = pos + 1  # arguments given as a JSON string

    def arguments(self, call: ScannedCall) -> str:
        """The call's arguments text so far ("" before they begin)."""
        if call.args_start is None:
            return ""
        return self.text[call.args_start:call.args_end if call.args_end is not None else len(self.text)]

    def named_calls(self) -> list[dict]:
        """``[{"name", "arguments"}]`` of the calls whose name is complete (arguments as
        generated, cut where the answer was cut)."""
        return [{"name": c.name, "arguments": self.arguments(c)} for c in self.calls if c.name is not None]
