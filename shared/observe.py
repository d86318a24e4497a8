"""Looking at a running deployment from outside: its workers' heartbeats and metrics.
Used by ``pdserve status``, the chaos suite and the tests."""

from __future__ import annotations

import asyncio
import urllib.request

from shared import nats_bus as bus
from shared.config import Settings
from shared.messages import Heartbeat
from shared.subjects import Protocol


def collect_heartbeats(settings: Settings, seconds: float | None = None) -> dict[str, Heartbeat]:
    """Heartbeats seen on the namespace for ``seconds`` (default: 2.2 heartbeat periods), by
    instance id.

    Raises:
        ServiceUnavailable: NATS is unreachable.
    """
    wait = seconds if seconds is not None else settings.heartbeat_interval_s * 2.2

    async def collect() -> dict[str, Heartbeat]:
        nc = await bus.connect(settings, "pdserve-observe", max_reconnect_attempts=0)
        seen: dict[str, Heartbeat] = {}

        async def on(msg) -> None:
            if isinstance(msg, Heartbeat):
                seen[msg.instance_id] = msg

        await bus.subscribe_messages(nc, Protocol(settings.namespace).heartbeat, on)
        await asyncio.sleep(wait)
        await bus.close(nc)
        return seen

    return asyncio.run(collect())


def scrape_metric(port: int, name: str, labels: str = "", host: str = "127.0.0.1") -> float:
    """Sum of a metric's samples (those whose labels contain ``labels``) from
    ``http://host:port/metrics``; 0 when absent."""
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and (not labels or labels in head):
            total += float(value)
    return total
