"""``pdserve chaos`` on a three-node NATS cluster (issue 19): the deployment gets every node's
URL and work queues with three replicas, and the faults hit one node at a time.

* ``nats-node``: a node is SIGKILLed (every other fault: the JetStream meta leader, found
  through the monitoring port's ``/jsz``), stays down ``down_s``, is started again and must be
  healthy (caught up) before the next fault — so two nodes are never down at once;
* ``nats-partition``: a node's cluster routes (every other fault: the meta leader's) are cut for
  ``cut_s`` — the nodes reach each other only through relays (``loadtest/route_proxy.py``) —
  while its clients stay connected to it; then the routes heal and it catches up;
* ``nats-freeze``: a node (every other fault: the meta leader) is stopped with SIGSTOP for
  ``freeze_s`` and continued: to its peers and its clients it stops answering at once (not a
  clean exit); then it catches up;
* ``nats-partition-gateway``: as ``nats-partition``, but always the node the gateway is
  connected to (from the monitoring port's ``/connz``): workers elsewhere cannot reach the
  gateway while it waits for its requests (the loss of a partition run, issue 19).
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

from loadtest.infra import NatsServer, free_port
from loadtest.route_proxy import RouteMesh
from services.nats_cluster import NatsCluster

#: Scenarios that need ``--nats-cluster 3``.
CLUSTER_SCENARIOS = ("nats-node", "nats-partition", "nats-freeze", "nats-partition-gateway")


class ChaosCluster(NatsCluster):
    """A local cluster on free ports, with the fault actions of the cluster scenarios."""

    def __init__(self, root: Path, size: int = 3):
        super().__init__(root, [(free_port(), free_port(), free_port()) for _ in range(size)])
        self.faults = 0
        self.mesh = RouteMesh([n.cluster_port for n in self.nodes], self.host)
        self.dead_port = free_port()  # advertised route URL: no route around the relays

    def command(self, node) -> list[str]:
        """The node's routes go through the relays; the route URL it gossips leads nowhere,
        so that no node connects around them."""
        cmd = super().command(node)
        routes = self.mesh.routes_of(self.nodes.index(node))
        cmd[cmd.index("--routes") + 1] = ",".join(f"nats://{self.host}:{p}" for p in routes)
        return [*cmd, "--cluster_advertise", f"{self.host}:{self.dead_port}"]

    def stop(self) -> None:
        super().stop()
        self.mesh.close()

    def victim(self, rng: random.Random):
        """Every other fault the meta leader (when one is known), else a random node."""
        leader = self.meta_leader() if self.faults % 2 == 0 else None
        return leader or rng.choice([n for n in self.nodes if n.is_up])

    def node_of_client(self, name_prefix: str):
        """The node a client whose connection name starts with ``name_prefix`` is connected to
        (from each node's ``/connz``), or None."""
        import json
        import urllib.request

        for node in self.nodes:
            if not node.is_up:
                continue
            try:
                with urllib.request.urlopen(f"http://{self.host}:{node.http_port}/connz?limit=1024", timeout=1) as r:
                    conns = json.loads(r.read()).get("connections") or []
            except Exception:
                continue
            if any((c.get("name") or "").startswith(name_prefix) for c in conns):
                return node
        return None

    def kill_and_restart(self, rng: random.Random, down_s: float = 1.0, heal_timeout_s: float = 60.0) -> str:
        """SIGKILL one node, start it again after ``down_s``; returns its name once healthy."""
        node = self.victim(rng)
        self.faults += 1
        self.kill(node)
        time.sleep(down_s)
        self.start_node(node)
        self.wait_healthy(node, heal_timeout_s)
        return node.name

    def freeze(self, rng: random.Random, freeze_s: float = 4.0, heal_timeout_s: float = 60.0) -> str:
        """SIGSTOP one node for ``freeze_s``, then SIGCONT; returns its name once healthy."""
        node = self.victim(rng)
        self.faults += 1
        node.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(freeze_s)
        finally:
            node.proc.send_signal(signal.SIGCONT)
        self.wait_healthy(node, heal_timeout_s)
        return node.name


def partition(cluster: ChaosCluster, rng: random.Random, cut_s: float = 5.0, heal_timeout_s: float = 60.0,
              node=None) -> str:
    """Cut one node's routes (``node``, or :meth:`ChaosCluster.victim`'s) for ``cut_s``, then heal
    them; returns its name once healthy."""
    node = node or cluster.victim(rng)
    cluster.faults += 1
    i = cluster.nodes.index(node)
    cluster.mesh.cut(i)
    try:
        time.sleep(cut_s)
    finally:
        cluster.mesh.heal(i)
    cluster.wait_healthy(node, heal_timeout_s)
    return node.name


def make_nats(root: Path, nodes: int) -> NatsServer | ChaosCluster:
    """One server (``nodes`` 1) or a cluster, not started."""
    return NatsServer(root) if nodes <= 1 else ChaosCluster(root, nodes)


def cluster_fault(kind: str, cluster: ChaosCluster, rng: random.Random) -> None:
    """One fault of a cluster scenario."""
    if kind == "nats-node":
        cluster.kill_and_restart(rng)
    elif kind == "nats-partition":
        partition(cluster, rng)
    elif kind == "nats-freeze":
        cluster.freeze(rng)
    elif kind == "nats-partition-gateway":
        partition(cluster, rng, node=cluster.node_of_client("pdserve-gateway"))
    else:
        raise ValueError(f"not a cluster scenario: {kind}")
