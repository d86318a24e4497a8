"""Who is alive: a view of the workers' heartbeats.

Every worker publishes a :class:`~shared.messages.Heartbeat` each ``heartbeat_interval_s``
on ``<ns>.heartbeat.<stage>``. The gateway uses this view for readiness (every stage has a
live, ready worker) and to fail fast when a stage has none; prefill uses it to pick the
postfilter instance that will own a request's token stream.

Silence only counts while this process can hear. Every worker also receives its own
heartbeats, so a gap with *no* heartbeat from anyone means this process was deaf (its event
loop stalled, it was paused, NATS was away), not that its peers died: a deaf period is
credited to every peer, and nobody is declared gone while the process is deaf.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from shared.messages import Heartbeat


@dataclass(slots=True)
class _Seen:
    heartbeat: Heartbeat
    seen_at: float


class WorkerRegistry:
    """Heartbeats by stage and instance, forgotten after ``timeout_s`` of silence heard.

    Args:
        timeout_s: silence (seconds) after which an instance counts as gone.
        deaf_after_s: a gap with no heartbeat at all longer than this (default half of
            ``timeout_s``) is a deaf period of this process, not silence of its peers.
    """

    def __init__(self, timeout_s: float, deaf_after_s: float | None = None):
        self.timeout_s = timeout_s
        self.deaf_after_s = timeout_s / 2 if deaf_after_s is None else deaf_after_s
        self._seen: dict[str, dict[str, _Seen]] = {}
        self._last_heard: float | None = None

    def observe(self, heartbeat: Heartbeat, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._last_heard is not None and now - self._last_heard > self.deaf_after_s:
            gap = now - self._last_heard
            for entries in self._seen.values():
                for seen in entries.values():
                    seen.seen_at += gap
        self._last_heard = now if self._last_heard is None else max(self._last_heard, now)
        self._seen.setdefault(heartbeat.stage, {})[heartbeat.instance_id] = _Seen(heartbeat, now)

    def forget(self, stage: str, instance_id: str) -> None:
        self._seen.get(stage, {}).pop(instance_id, None)

    def live(self, stage: str, now: float | None = None, *, ready_only: bool = True) -> list[Heartbeat]:
        """Heartbeats of the live (and, by default, ready) instances of ``stage``, by id."""
        now = time.monotonic() if now is None else now
        if self._last_heard is not None and now - self._last_heard > self.deaf_after_s:
            now = self._last_heard  # deaf right now: judge by what was heard until then
        entries = self._seen.get(stage, {})
        for instance_id in [i for i, s in entries.items() if now - s.seen_at > self.timeout_s]:
            del entries[instance_id]
        return sorted(
            (s.heartbeat for s in entries.values() if s.heartbeat.ready or not ready_only),
            key=lambda h: h.instance_id,
        )

    def is_alive(self, stage: str, instance_id: str, now: float | None = None) -> bool:
        return any(h.instance_id == instance_id for h in self.live(stage, now, ready_only=False))

    def pick(self, stage: str, key: str, now: float | None = None) -> Heartbeat | None:
        """The live instance of ``stage`` that owns ``key``, by rendezvous (highest random
        weight) hashing: stable while the set of instances is, and when one leaves only its
        own keys move (Thaler & Ravishankar, 1998)."""
        best: tuple[bytes, Heartbeat] | None = None
        for hb in self.live(stage, now):
            weight = hashlib.blake2b(f"{hb.instance_id}\x00{key}".encode(), digest_size=8).digest()
            if best is None or weight > best[0]:
                best = (weight, hb)
        return best[1] if best else None
