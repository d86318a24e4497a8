"""Noticing at once that a client went away, before or after the response's headers.

Headers of a stream go out once the tokenizer has accepted its prompts (so that a bad prompt
is a real 400): with a deep tokenizer queue that is many seconds. Polling
``Request.is_disconnected()`` once a second between events (what the run's ``on_tick`` does)
finds a departure up to a second late, and only while the run waits; a :class:`DisconnectWatch`
awaits the ASGI ``receive`` channel itself — the request body was read before the run started,
so the next message on it is ``http.disconnect`` — and tells the run the moment it comes,
whatever the run is doing. The run then raises ``Aborted`` and broadcasts an ``Abort`` for
each of its pipeline requests, so the tokenizer drops their queued work without tokenizing it.

uvicorn answers every pending and later ``receive()`` with ``http.disconnect`` once the
connection is gone, so this watch and Starlette's own disconnect listener both see it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


class ClientGone:
    """Put on a run's event queue by its watch: the client has disconnected."""

    __slots__ = ("at",)

    def __init__(self, at: float):
        self.at = at  # monotonic seconds when the disconnect was seen


class DisconnectWatch:
    """Awaits ``http.disconnect`` on an ASGI ``receive`` channel while a run is open.

    Args:
        receive: the request's ASGI receive callable (``Request.receive``), body already read.
    """

    def __init__(self, receive: Callable[[], Awaitable[dict]]):
        self.receive = receive
        self.gone_at: float | None = None  # monotonic, once seen
        self._task: asyncio.Task | None = None

    def start(self, on_gone: Callable[[ClientGone], None]) -> None:
        """Watch in a task of its own; call ``on_gone`` (on the event loop) when the client leaves."""

        async def watch() -> None:
            while True:
                message = await self.receive()
                if message.get("type") == "http.disconnect":
                    self.gone_at = time.monotonic()
                    on_gone(ClientGone(self.gone_at))
                    return

        self._task = asyncio.get_running_loop().create_task(watch(), name="disconnect-watch")

    def stop(self) -> None:
        """Stop watching (the run closed); idempotent."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._task = None
