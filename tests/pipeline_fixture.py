"""Start and stop a real pdserve deployment (separate OS processes, real NATS) for tests."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from loadtest.infra import free_port
from services import launcher, local_infra
from shared.config import Settings


@contextmanager
def deployment(tmp: Path, model: str, namespace: str, replicas: dict[str, int] | None = None,
               ready_timeout_s: float = 300, **overrides):
    """A running deployment; yields the launcher's Deployment (``.url``, ``.procs``)."""
    fields = dict(
        model=model,
        namespace=namespace,
        gateway_port=free_port(),
        cache_dir=str(tmp / "cache"),
        log_json=True,
        heartbeat_interval_s=0.5,
        heartbeat_timeout_s=3.0,
        kv_cache_memory_bytes=64 << 20,
        # the tests compare with transformers in float32 token by token; auto would pick
        # bfloat16 on CPUs with AMX or AVX512-BF16
        dtype="float32",
    )
    fields.update(overrides)
    settings = Settings.from_env({}, **fields)
    reps = {"tokenizer": 1, "prefill": 1, "decode": 1, "postfilter": 1, "gateway": 1}
    reps.update(replicas or {})
    dep = launcher.up(settings, reps, state_dir=tmp / f"state-{namespace}", ready_timeout_s=ready_timeout_s,
                      quiet=True)
    try:
        yield dep
    finally:
        launcher.stop_all(dep)
        local_infra.drop_namespace(settings)


def log_tail(dep, name_prefix: str, chars: int = 4000) -> str:
    return "\n".join(p.log_path.read_text(errors="replace")[-chars:] for p in dep.procs if p.name.startswith(name_prefix))


def heartbeats(settings: Settings, seconds: float = 1.5) -> dict:
    """Heartbeats seen on the namespace for ``seconds``, by instance id."""
    from shared.observe import collect_heartbeats

    return collect_heartbeats(settings, seconds)


def metric_value(port: int, name: str, labels: str = "") -> float:
    """A metric's value from a worker's /metrics (0 when absent)."""
    from shared.observe import scrape_metric

    return scrape_metric(port, name, labels)


class DecodeKiller:
    """An ``on_chunk`` callback for a streamed request: at chunk ``at`` it SIGKILLs the one decode
    worker holding KV blocks (the one the request decodes on; asserts there is exactly one).
    ``decoders``: decode worker name -> metrics port, read once from the heartbeats;
    ``killed``: the killed :class:`services.deployment.Proc`, once it happened."""

    def __init__(self, dep, at: int):
        self.dep, self.at = dep, at
        self.decoders = {h.instance_id.rsplit("-", 1)[0]: h.metrics_port
                         for h in heartbeats(dep.settings).values() if h.stage == "decode"}
        self.killed: list = []

    def __call__(self, n: int) -> None:
        import os
        import signal

        if n != self.at:
            return
        busy = [name for name, port in self.decoders.items() if metric_value(port, "pd_decode_kv_blocks_used") > 0]
        assert len(busy) == 1, busy
        victim = next(p for p in self.dep.procs if p.name == busy[0])
        os.kill(victim.popen.pid, signal.SIGKILL)
        self.killed.append(victim)
