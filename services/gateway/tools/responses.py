"""Chat responses whose answers may be tool calls: ``message.tool_calls`` with
``finish_reason: "tool_calls"``, and streamed the way OpenAI streams them (the official
``openai`` client assembles them): a delta with the call's ``index``, ``id``, ``type`` and
``function.name`` (``arguments: ""``), then deltas with fragments of ``function.arguments``.

* A named ``tool_choice``: the whole output is the arguments, so they stream as they come.
* ``required``: the output (a JSON array of calls, forced by the grammar) is held back and
  sent as calls when the choice ends.
* ``auto``: text streams as content as soon as it cannot be the start of a call
  (:func:`services.gateway.tools.calls.may_become_call`); otherwise it is held until the end and
  sent as calls when it parses as calls, else as content.

A tool-call answer's ``finish_reason`` is ``"tool_calls"`` (``"length"`` stays: the call was
cut short, and its text comes back as content).
"""

from __future__ import annotations

from services.gateway.request_run import Choice, Delta
from services.gateway.responses import Responses, chat_logprobs, usage_of
from services.gateway.tools.calls import may_become_call, new_call_id, parse_tool_calls, tool_mode


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
        self.call_ids: dict[int, str] = {}  # choice index → the named call's id
        self.held: dict[int, list[str]] = {}  # choice index → text held back
        self.held_logprobs: dict[int, list] = {}
        self.passing: set[int] = set()  # auto choices now known to be content
        self._chunk_usage: dict | None = None  # continuous usage stats of the chunk being built

    def _calls(self, c: Choice, text: str) -> list[dict] | None:
        if self.mode == "named":
            return [{"name": self.name, "arguments": text}]
        return parse_tool_calls(text, self.names)

    def complete(self, choices: list[Choice]) -> dict:
        body = super().complete(choices)
        for item, c in zip(body["choices"], choices):
            calls = self._calls(c, "".join(c.text)) if c.finish_reason != "length" else None
            if calls is None:
                continue
            item["message"]["content"] = None
            item["message"]["tool_calls"] = [
                {"id": new_call_id(), "type": "function", "function": call} for call in calls]
            item["finish_reason"] = "tool_calls"
        return body

    def first_chunks(self, choices: list[Choice]) -> list[bytes]:
        if self.mode != "named":
            return super().first_chunks(choices)
        out = []
        for c in choices:
            self.call_ids[c.index] = call_id = new_call_id()
            call = {"index": 0, "id": call_id, "type": "function", "function": {"name": self.name, "arguments": ""}}
            out.append(self._chunk([{"index": c.index, "delta": {"role": "assistant", "content": None,
                                                                  "tool_calls": [call]},
                                     "logprobs": None, "finish_reason": None}], None))
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
        if c.index in self.passing:
            return super().delta_chunk(d, choices)
        held = self.held.setdefault(c.index, [])
        held.append(d.text)
        self.held_logprobs.setdefault(c.index, []).extend(d.logprobs)
        text = "".join(held)
        if d.finish_reason is None:
            if self.mode == "required" or may_become_call(text):
                return b""
            self.passing.add(c.index)  # auto, and plainly not a call: content from now on
            return self._chunk([self._item(c, {"content": text}, self.held_logprobs.pop(c.index), None)], None)
        calls = self._calls(c, text) if d.finish_reason != "length" else None
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
        out.append(self._chunk([self._item(c, {}, [], "tool_calls")], None))
        return b"".join(out)
