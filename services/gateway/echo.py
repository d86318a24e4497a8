"""``echo`` with ``logprobs`` on ``/v1/completions``: the prompt's tokens and their
log-probabilities (computed in prefill, ``engine/prompt_logprobs.py``) ahead of the output's,
in the legacy completions ``logprobs`` shape, the way OpenAI's API and vLLM answer it and
lm-evaluation-harness's ``local-completions`` model reads it (``token_logprobs[ctxlen:-1]``).

The first prompt token has nothing before it: its ``token_logprobs`` and ``top_logprobs``
entries are ``null``. With ``max_tokens: 0`` (allowed only with ``echo``) the pipeline still
samples one token (prefill always does); it is left out of the answer and of the usage.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.postfilter.text import TokenText
from shared.messages import OutputLogprob


@dataclass(slots=True)
class PromptEcho:
    """What the completions answer needs for ``echo`` with ``logprobs``, per prompt.

    Attributes:
        first_tokens: each prompt's first token's text (it has no logprob entry).
        zero_output: ``max_tokens`` was 0: answer with the prompt alone.
    """

    first_tokens: list[str]
    zero_output: bool

    @classmethod
    def of(cls, req, prompts) -> PromptEcho | None:
        """For a CompletionRequest ``req`` with ``echo`` and ``logprobs``, else None.
        ``prompts`` is the gateway's PromptProcessor (its tokenizer encodes string prompts
        as the tokenizer stage does)."""
        if not getattr(req, "echo", False) or req.logprobs is None:
            return None
        token_text = TokenText(prompts.tokenizer.backend_tokenizer)
        first = []
        for prompt in req.prompts():
            ids = prompt if isinstance(prompt, list) else prompts.tokenizer.encode(prompt)[:1]
            first.append(token_text(ids[0])[0] if ids else "")
        return cls(first, req.max_tokens == 0)

    def logprobs(self, prompt_index: int, prompt: list[OutputLogprob] | None,
                 output: list[OutputLogprob]) -> dict:
        """The ``logprobs`` object of one choice: the prompt's tokens (first without a value),
        then the output's (none with ``max_tokens: 0``); ``text_offset`` counts characters of
        the echoed text from 0."""
        tokens: list[str] = [self.first_tokens[prompt_index]]
        values: list[float | None] = [None]
        tops: list[dict | None] = [None]
        entries = [*(prompt or []), *([] if self.zero_output else output)]
        for e in entries:
            tokens.append(e.token)
            values.append(e.logprob)
            tops.append({t.token: t.logprob for t in e.top})
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
