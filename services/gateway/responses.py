"""OpenAI response bodies: chat and text completions, whole and as stream chunks, usage and
logprobs objects. Pure functions of the request's choices."""

from __future__ import annotations

import msgspec

from services.gateway.echo import PromptEcho
from services.gateway.request_run import Choice, Delta
from shared.messages import OutputLogprob

_json = msgspec.json.Encoder()


def sse(payload: dict | str) -> bytes:
    """One SSE event: ``data: <json>`` and a blank line."""
    data = payload.encode() if isinstance(payload, str) else _json.encode(payload)
    return b"data: " + data + b"\n\n"


def usage_of(choices: list[Choice]) -> dict:
    """OpenAI usage: each prompt counted once (n choices share it), every output token.
    ``prompt_tokens_details.cached_tokens`` is what the prefix cache served."""
    prompt_tokens: dict[int, int] = {}
    cached: dict[int, int] = {}
    completion = 0
    for c in choices:
        prompt_tokens[c.prompt_index] = c.num_prompt_tokens or (c.usage.prompt_tokens if c.usage else 0)
        if c.usage is not None:
            cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.usage.cached_tokens)
        completion += c.usage.completion_tokens if c.usage else c.num_tokens
    p = sum(prompt_tokens.values())
    return {
        "prompt_tokens": p,
        "completion_tokens": completion,
        "total_tokens": p + completion,
        "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
    }


def chat_logprobs(entries: list[OutputLogprob]) -> dict:
    """Chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}``."""
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": e.bytes,
                "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in e.top],
            }
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: list[OutputLogprob], text_offset: int = 0) -> dict:
    """Legacy completions ``logprobs``: parallel lists of tokens, their logprobs, the top
    alternatives as ``{token: logprob}`` and each token's character offset in the text."""
    offsets = []
    pos = text_offset
    for e in entries:
        offsets.append(pos)
        pos += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


class Responses:
    """Builds the bodies of one API request."""

    def __init__(self, endpoint: str, request_id: str, model: str, created: int, req, echo_texts: list[str],
                 prompt_echo: PromptEcho | None = None):
        self.endpoint = endpoint
        self.prompt_echo = prompt_echo  # echo with logprobs: the prompt's logprobs lead
        self.request_id = request_id
        self.model = model
        self.created = created
        self.req = req
        self.echo_texts = echo_texts
        self.include_usage = bool(getattr(req, "stream_options", None) and req.stream_options.include_usage)
        self.continuous_usage = bool(getattr(req, "stream_options", None) and req.stream_options.continuous_usage_stats)
        self.want_logprobs = bool(req.logprobs) if endpoint == "chat" else req.logprobs is not None
        # completions with echo and max_tokens 0: the prompt alone (prefill samples one token anyway)
        self.zero_output = endpoint != "chat" and bool(getattr(req, "echo", False)) and req.max_tokens == 0
        self.echoed: set[int] = set()  # echo with logprobs: choices whose prompt has been streamed

    # --- whole responses ----------------------------------------------------------------
    def complete(self, choices: list[Choice]) -> dict:
        if self.endpoint == "chat":
            items = [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": "".join(c.text), "refusal": None},
                    "logprobs": chat_logprobs(c.logprobs) if self.want_logprobs else None,
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ]
            obj = "chat.completion"
        else:
            items = []
            for c in choices:
                echo = self.echo_texts[c.prompt_index] if self.echo_texts else ""
                pe = self.prompt_echo
                items.append({
                    "index": c.index,
                    "text": echo + ("" if self.zero_output else "".join(c.text)),
                    "logprobs": pe.logprobs(c.prompt_index, c.prompt_logprobs, c.logprobs) if pe else
                    completion_logprobs(c.logprobs, len(echo)) if self.want_logprobs else None,
                    "finish_reason": c.finish_reason,
                })
            obj = "text_completion"
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": items, "usage": self._usage(choices)}

    def _usage(self, choices: list[Choice]) -> dict:
        usage = usage_of(choices)
        if self.zero_output:  # max_tokens 0: nothing generated
            usage.update(completion_tokens=0, total_tokens=usage["prompt_tokens"])
        return usage

    # --- stream chunks ------------------------------------------------------------------
    def _chunk(self, items: list[dict], usage: dict | None) -> bytes:
        obj = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
        body = {"id": self.request_id, "object": obj, "created": self.created, "model": self.model, "choices": items}
        if self.include_usage or self.continuous_usage:
            body["usage"] = usage
        return sse(body)

    def first_chunks(self, choices: list[Choice]) -> list[bytes]:
        """One chunk per choice, in index order, before any text: choices then first appear
        in order 0, 1, 2, ... whichever generates first (openai-python's stream helper
        accumulates choices by position). Chat: the role delta. Completions: the prompt with
        ``echo``; with ``echo`` and ``logprobs`` (the prompt's logprobs come with the first
        output, :meth:`delta_chunk`) and without echo, an empty text."""
        if self.endpoint == "chat":
            return [self._chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}], None) for c in choices]
        echo_now = bool(self.echo_texts) and self.prompt_echo is None
        return [self._chunk([{"index": c.index, "text": self.echo_texts[c.prompt_index] if echo_now else "",
                              "logprobs": None, "finish_reason": None}], None) for c in choices]

    def delta_chunk(self, d: Delta, choices: list[Choice]) -> bytes:
        if self.endpoint == "chat":
            item = {"index": d.choice.index, "delta": {"content": d.text} if d.text else {},
                    "logprobs": chat_logprobs(d.logprobs) if self.want_logprobs and d.logprobs else None,
                    "finish_reason": d.finish_reason}
        else:
            c = d.choice
            echo = self.echo_texts[c.prompt_index] if self.echo_texts else ""
            text = "" if self.zero_output else d.text
            pe = self.prompt_echo
            if pe is not None and c.index not in self.echoed:
                # echo with logprobs: the prompt, its logprobs and the first output in one chunk
                # (as vLLM streams it), so the chunk's text is its logprobs' tokens
                self.echoed.add(c.index)
                text = echo + text
                logprobs = pe.logprobs(c.prompt_index, d.prompt_logprobs or c.prompt_logprobs, d.logprobs)
            elif self.want_logprobs and d.logprobs and not self.zero_output:
                logprobs = completion_logprobs(d.logprobs, len(echo) + d.text_offset)
            else:
                logprobs = None
            item = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": d.finish_reason}
        return self._chunk([item], self._usage(choices) if self.continuous_usage else None)

    def usage_chunk(self, choices: list[Choice]) -> bytes:
        """The last chunk before ``[DONE]`` with ``stream_options.include_usage``: no choices."""
        return self._chunk([], self._usage(choices))
