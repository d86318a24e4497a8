"""Chat responses whose answers may be tool calls: ``message.tool_calls`` with
``finish_reason: "tool_calls"``, and streamed the way OpenAI streams them (the official
``openai`` client assembles them): a delta with the call's ``index``, ``id``, ``type`` and
``function.name`` (``arguments: ""``), then deltas with fragments of ``function.arguments``.

* A named ``tool_choice``: the whole output is the arguments, so they stream as they come.
* ``required``: the output (a JSON array of calls, forced by the grammar) is read as it grows
  (:class:`services.gateway.tools.calls.CallScanner`): each call's head goes out once its name
  is complete, then its arguments as they are generated.
* ``auto``: text streams as content as soon as it cannot be the start of a call
  (:func:`services.gateway.tools.calls.may_become_call`); otherwise it is held until the end and
  sent as calls when it parses as calls, else as content.

A tool-call answer's ``finish_reason`` is ``"tool_calls"``. A forced call (named or
``required``) cut by ``max_tokens`` is still a call, in ``tool_calls`` with its arguments cut
short, and ``finish_reason: "length"`` (as OpenAI answers); ``required`` cut before its first
name is complete has neither content nor calls. An ``auto`` answer cut short is content.
"""

from __future__ import annotations

from services.gateway.request_run import Choice, Delta
from services.gateway.responses import Responses, chat_logprobs, usage_of
from services.gateway.tools.calls import CallScanner, may_become_call, new_call_id, parse_tool_calls, tool_mode


def responses_for(endpoint: str, request_id: str, model: str, created: int, req, echo_texts: list[str],
                  prompt_echo=None) -> Responses:
    """The response builder of a request: :class:`ToolResponses` when its output is read
    for tool calls, else the plain one (arguments as for :class:`Responses`)."""
    cls = ToolResponses if endpoint == "chat" and tool_mode(req)[0] != "none" else Responses
    return cls(endpoint, request_id, model, created, req, echo_texts, prompt_echo)


class ToolResponses(Responses):
    """Chat bodies with tool calls (see the module docstring)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.mode, self.name = tool_mode(self.req)
        self.names = {t.function.name for t in self.req.tools or ()}
        self.held: dict[int, list[str]] = {}  # auto: choice index → text held back
        self.held_logprobs: dict[int, list] = {}  # logprobs not yet sent (auto: held; required: no chunk yet)
        self.passing: set[int] = set()  # auto choices now known to be content
        self.scanners: dict[int, CallScanner] = {}  # required: choice index → its answer so far
        self.args_sent: dict[int, list[int]] = {}  # required: choice index → characters sent per call
        self._chunk_usage: dict | None = None  # continuous usage stats of the chunk being built

    @property
    def forced(self) -> bool:
        """Whether the grammar forces a call (named or ``required``)."""
        return self.mode in ("named", "required")

    def _calls(self, text: str, finish_reason: str | None) -> list[dict] | None:
        """The calls of a whole answer; None when it is content (only in auto mode)."""
        if self.mode == "named":
            return [{"name": self.name, "arguments": text}]
        if self.mode == "required":
            scanner = CallScanner()
            scanner.feed(text)
            return scanner.named_calls()
        return parse_tool_calls(text, self.names) if finish_reason != "length" else None

    def complete(self, choices: list[Choice]) -> dict:
        body = super().complete(choices)
        for item, c in zip(body["choices"], choices):
            calls = self._calls("".join(c.text), c.finish_reason)
            if calls is None:
                continue
            item["message"]["content"] = None
            if calls:
                item["message"]["tool_calls"] = [
                    {"id": new_call_id(), "type": "function", "function": call} for call in calls]
            item["finish_reason"] = "tool_calls" if c.finish_reason == "stop" and calls else c.finish_reason
        return body

    def first_chunks(self, choices: list[Choice]) -> list[bytes]:
        if not self.forced:
            return super().first_chunks(choices)
        out = []
        for c in choices:
            delta: dict = {"role": "assistant", "content": None}
            if self.mode == "named":
                delta["tool_calls"] = [{"index": 0, "id": new_call_id(), "type": "function",
                                        "function": {"name": self.name, "arguments": ""}}]
            out.append(self._chunk([{"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}],
                                   None))
        return out

    def _chunk(self, items: list[dict], usage: dict | None) -> bytes:
        return super()._chunk(items, usage if usage is not None else self._chunk_usage)

    def _item(self, c: Choice, delta: dict, logprobs: list, finish: str | None) -> dict:
        return {"index": c.index, "delta": delta,
                "logprobs": chat_logprobs(logprobs) if self.want_logprobs and logprobs else None,
                "finish_reason": finish}

    def delta_chunk(self, d: Delta, choices: list[Choice]) -> bytes:
        c = d.choice
        self._chunk_usage = usage_of(choices) if self.continuous_usage else None
        if self.mode == "named":
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": d.text}}]} if d.text else {}
            finish = "tool_calls" if d.finish_reason == "stop" else d.finish_reason
            return self._chunk([self._item(c, delta, d.logprobs, finish)], None)
        if self.mode == "required":
            return self._required_chunks(d)
        if c.index in self.passing:
            return super().delta_chunk(d, choices)
        held = self.held.setdefault(c.index, [])
        held.append(d.text)
        self.held_logprobs.setdefault(c.index, []).extend(d.logprobs)
        text = "".join(held)
        if d.finish_reason is None:
            if may_become_call(text):
                return b""
            self.passing.add(c.index)  # auto, and plainly not a call: content from now on
            return self._chunk([self._item(c, {"content": text}, self.held_logprobs.pop(c.index), None)], None)
        calls = self._calls(text, d.finish_reason)
        if calls is None:
            delta = {"content": text} if text else {}
            return self._chunk([self._item(c, delta, self.held_logprobs.pop(c.index), d.finish_reason)], None)
        out = []
        for i, call in enumerate(calls):
            head = {"index": i, "id": new_call_id(), "type": "function",
                    "function": {"name": call["name"], "arguments": ""}}
            out.append(self._chunk([self._item(c, {"tool_calls": [head]}, [], None)], None))
            body = {"index": i, "function": {"arguments": call["arguments"]}}
            out.append(self._chunk([self._item(c, {"tool_calls": [body]}, [], None)], None))
        out.append(self._chunk([self._item(c, {}, self.held_logprobs.pop(c.index, []), "tool_calls")], None))
        return b"".join(out)

    def _required_chunks(self, d: Delta) -> bytes:
        """``required``: the calls' heads and arguments fragments this delta completes; its
        logprobs ride on the first chunk sent (held while the delta sends none)."""
        c = d.choice
        scanner = self.scanners.setdefault(c.index, CallScanner())
        sent = self.args_sent.setdefault(c.index, [])
        scanner.feed(d.text)
        logprobs = self.held_logprobs.setdefault(c.index, [])
        logprobs.extend(d.logprobs)
        deltas: list[dict] = []
        for i, call in enumerate(scanner.calls):
            if call.name is None:
                break
            if i == len(sent):
                sent.append(0)
                deltas.append({"index": i, "id": new_call_id(), "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            args = scanner.arguments(call)
            if len(args) > sent[i]:
                deltas.append({"index": i, "function": {"arguments": args[sent[i]:]}})
                sent[i] = len(args)
        out = []
        for tc in deltas:
            out.append(self._chunk([self._item(c, {"tool_calls": [tc]}, logprobs, None)], None))
            logprobs = []
        if d.finish_reason is not None:
            finish = "tool_calls" if d.finish_reason == "stop" and sent else d.finish_reason
            out.append(self._chunk([self._item(c, {}, logprobs, finish)], None))
            logprobs = []
        self.held_logprobs[c.index] = logprobs
        return b"".join(out)
