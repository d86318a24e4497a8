"""What ``pdserve up`` started on this machine (:class:`Deployment`, its processes) and the
process primitives the launcher, the local NATS/Redis and the local NATS cluster share.

The bottom of the launcher's modules: ``launcher`` → ``local_infra`` → ``nats_cluster`` →
this, and nothing here imports them back.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.config import Settings


@dataclass
class Proc:
    """One service process ``pdserve up`` started: its name (``<stage>-<k>``), process and log file."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)


@dataclass
class Deployment:
    """One ``pdserve up``: its settings, state folder, replicas per stage, CPU pinning and every
    process it started (services, and NATS / Redis / a NATS cluster when none was reachable)."""

    settings: Settings
    state_dir: Path
    replicas: dict[str, int]
    affinity: dict[str, str] = field(default_factory=dict)  # process name → CPU list
    procs: list[Proc] = field(default_factory=list)
    nats_proc: subprocess.Popen | None = None
    nats_nodes: int = 1  # > 1: start a local cluster of this many nodes (pdserve up --nats-cluster)
    nats_cluster: object = None  # services.nats_cluster.NatsCluster, when started here
    redis_proc: subprocess.Popen | None = None
    quiet: bool = False

    @property
    def url(self) -> str:
        return f"http://{self.settings.gateway_host}:{self.settings.gateway_port}"

    def say(self, text: str) -> None:
        if not self.quiet:
            print(f"pdserve: {text}", file=sys.stderr, flush=True)


def local_binary(name: str) -> str | None:
    """A binary from this virtual environment's bin folder, else from PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def terminate(procs: list[subprocess.Popen], timeout_s: float = 20.0) -> None:
    """SIGTERM our child processes, then SIGKILL what is left after ``timeout_s``."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
