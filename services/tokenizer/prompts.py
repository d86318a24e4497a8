"""Prompt processing shared by the tokenizer stage and the gateway's /tokenize: chat
template, tokenization, and the context-length checks. No I/O, no torch."""

from __future__ import annotations

import json

from shared.errors import ContextLengthExceeded, InvalidRequest
from shared.messages import TokenizeTask


class PromptProcessor:
    """Chat template, tokenization and context checks (no I/O; shared with /tokenize).

    Args:
        tokenizer: a transformers tokenizer.
        vocab_size: the model's vocabulary size.
        max_model_len: context length in tokens.
    """

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def render_chat(self, messages, add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """The chat template applied to ``messages`` (a list of ChatMessage or dicts), with
        ``tools`` (OpenAI function tools) for a template that renders them.

        Raises:
            InvalidRequest: the template rejects the conversation.
        """
        conversation = [m if isinstance(m, dict) else _as_dict(m) for m in messages]
        extra = {"tools": tools} if tools else {}
        try:
            return self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, **extra)
        except Exception as exc:  # jinja raises TemplateError and friends
            raise InvalidRequest(f"the chat template rejected the messages: {exc}", param="messages") from None

    def tokenize(self, task: TokenizeTask) -> list[int]:
        """Prompt token ids of a task.

        Raises:
            InvalidRequest: empty prompt, or token ids outside the vocabulary.
        """
        if task.prompt_token_ids is not None:
            ids = list(task.prompt_token_ids)
            if any(t < 0 or t >= self.vocab_size for t in ids):
                raise InvalidRequest(f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        elif task.messages is not None:
            text = self.render_chat(task.messages, task.add_generation_prompt, task.tools)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = self.tokenizer.encode(task.prompt or "")
        if not ids:
            raise InvalidRequest("the prompt is empty", param="prompt" if task.messages is None else "messages")
        return ids

    def max_tokens_for(self, num_prompt_tokens: int, requested: int, is_default: bool, param: str = "messages") -> int:
        """The output budget; with no ``max_tokens`` given, the rest of the context.

        Raises:
            ContextLengthExceeded: the prompt leaves no room, or prompt + max_tokens is over
                the context.
        """
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"has {num_prompt_tokens} tokens, which leaves no room for a completion.",
                param=param,
            )
        if is_default:
            return min(requested, room)
        if num_prompt_tokens + requested > self.max_model_len:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the {param}, {requested} in "
                f"the completion). Please reduce the length of the {param} or completion.",
                param="max_tokens",
            )
        return requested


def _as_dict(m) -> dict:
    out = {"role": m.role, "content": m.content}
    if m.tool_calls is not None:
        out["tool_calls"] = m.tool_calls
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def model_limits(folder, max_model_len_setting: int) -> tuple[int, int]:
    """(vocab_size, max_model_len) from a model folder's config.json, without torch."""
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)
    vocab = int(text["vocab_size"])
    max_len = max_model_len_setting or int(text.get("max_position_embeddings", 2048))
    return vocab, max_len
