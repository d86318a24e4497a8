"""The two interfaces a pipeline extension implements, and how they are found.

Stages are named in the configuration as ``module.path:ClassName``; the runner imports them,
wires their streams and consumers, and handles acks, retries, aborts, heartbeats and errors.
"""

from __future__ import annotations

import abc
import importlib
from typing import Any

from shared.config import Settings
from shared.messages import TokenizeTask


class PromptStage(abc.ABC):
    """A pre-processing stage between the gateway and the tokenizer, run as its own service
    (``python -m services.prompt_stage module:Class``; ``pdserve up`` starts one per entry of
    ``PD_PRE_STAGES``). It receives every request's TokenizeTask, in order of
    ``PD_PRE_STAGES``, and returns the task to pass on — e.g. with retrieved context added to
    the prompt. Replicas share one durable consumer, like every stage.

    Raise :class:`shared.errors.InvalidRequest` to refuse a request (the client gets a 400);
    any other exception fails the request with a 500.
    """

    async def setup(self, settings: Settings) -> None:  # noqa: B027 (optional hook)
        """Load what the stage needs (called once, before any task)."""

    @abc.abstractmethod
    async def process(self, task: TokenizeTask) -> TokenizeTask:
        """The task to pass on (``msgspec.structs.replace`` makes modified copies)."""


class TextFilter(abc.ABC):
    """A streaming filter over each request's generated text, run inside the postfilter after
    stop strings (``PD_TEXT_FILTERS``, applied in order). Per request, the runner calls
    :meth:`open`, then :meth:`feed` with each new piece of text, then :meth:`finish`; what they
    return is what the client sees. A filter may hold text back (return less) and release it
    later.
    """

    def __init__(self, settings: Settings):  # noqa: B027 (optional hook)
        self.settings = settings

    @abc.abstractmethod
    def open(self, request_id: str) -> Any:
        """Per-request state."""

    @abc.abstractmethod
    def feed(self, state: Any, text: str) -> str:
        """Text to show now, given new text."""

    @abc.abstractmethod
    def finish(self, state: Any) -> str:
        """Text still held, at the end of the stream."""


def load_class(ref: str) -> type:
    """``module.path:ClassName`` → the class.

    Raises:
        ValueError: not of that form, or no such module or class.
    """
    module, _, name = ref.partition(":")
    if not module or not name:
        raise ValueError(f"a stage is named module.path:ClassName, not {ref!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load stage {ref!r}: {exc}") from None


def stage_name(ref: str) -> str:
    """The stage's name in subjects, streams and logs: its class name, lower case."""
    return ref.partition(":")[2].lower()


def refs(setting: str) -> list[str]:
    return [r.strip() for r in setting.split(",") if r.strip()]
