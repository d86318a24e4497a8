"""Two example stages: retrieved context added to the prompt, and patterns redacted from the
streamed text. ``PD_PRE_STAGES=services.plugins.examples:AddContext`` and
``PD_TEXT_FILTERS=services.plugins.examples:RedactPatterns`` turn them on."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import msgspec

from services.plugins.api import PromptStage, TextFilter
from shared.messages import ChatMessage, TokenizeTask

#: A tiny knowledge base; ``PD_CONTEXT_FILE`` (a JSON object keyword → fact) replaces it.
DEFAULT_FACTS = {
    "pdserve": "pdserve serves language models as separate tokenizer, prefill, decode and postfilter services.",
    "paris": "Paris is the capital and largest city of France.",
    "nats": "NATS is a messaging system; JetStream adds persistent streams to it.",
}


class AddContext(PromptStage):
    """Retrieval-augmented prompts: for each keyword of the knowledge base that the user's
    last message mentions, its fact is added as a system message in front of the
    conversation (or in front of the prompt of a text completion)."""

    async def setup(self, settings) -> None:
        path = os.environ.get("PD_CONTEXT_FILE")
        self.facts = json.loads(open(path).read()) if path else dict(DEFAULT_FACTS)

    def retrieve(self, text: str) -> list[str]:
        words = set(re.findall(r"[a-z0-9]+", text.lower()))
        return [fact for key, fact in self.facts.items() if key in words]

    async def process(self, task: TokenizeTask) -> TokenizeTask:
        if task.messages:
            found = self.retrieve(task.messages[-1].content)
            if not found:
                return task
            context = ChatMessage(role="system", content="Context: " + " ".join(found))
            return msgspec.structs.replace(task, messages=[context, *task.messages])
        if task.prompt:
            found = self.retrieve(task.prompt)
            if found:
                return msgspec.structs.replace(task, prompt="Context: " + " ".join(found) + "\n\n" + task.prompt)
        return task


@dataclass
class _Held:
    pending: str = ""


class RedactPatterns(TextFilter):
    """Replaces every match of the patterns (default: e-mail addresses and runs of 4 or more
    digits) by ``[redacted]``, across chunk boundaries: the last ``WINDOW`` characters are
    held back until they can no longer be the start of a match (matches longer than
    ``WINDOW`` are not guaranteed). ``PD_REDACT_PATTERNS`` (a JSON list of regexes) replaces
    the defaults."""

    WINDOW = 64
    REPLACEMENT = "[redacted]"

    def __init__(self, settings):
        super().__init__(settings)
        custom = os.environ.get("PD_REDACT_PATTERNS")
        patterns = json.loads(custom) if custom else [r"[\w.+-]+@[\w-]+\.[\w.-]+", r"\d{4,}"]
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns))

    def open(self, request_id: str) -> _Held:
        return _Held()

    def feed(self, state: _Held, text: str) -> str:
        state.pending += text
        cut = len(state.pending) - self.WINDOW
        if cut <= 0:
            return ""
        for match in self.pattern.finditer(state.pending):
            if match.start() < cut <= match.end():
                cut = match.start()  # never split a match (or a match that may still grow)
                break
        out = self.pattern.sub(self.REPLACEMENT, state.pending[:cut])
        state.pending = state.pending[cut:]
        return out

    def finish(self, state: _Held) -> str:
        out = self.pattern.sub(self.REPLACEMENT, state.pending)
        state.pending = ""
        return out
