"""TCP relays between the nodes of a local NATS cluster, so a test can cut one node's routes
(a network partition of that node) without root, ``tc`` or network namespaces.

Node ``i`` reaches node ``j``'s route port only through the relay ``(i, j)``; cutting node
``x`` closes every relayed connection from or to ``x`` and refuses new ones until healed. Its
clients stay connected to it (as in a real partition of the cluster network).
"""

from __future__ import annotations

import socket
import threading


class Relay:
    """Listens on a free local port and relays each connection to ``target_port``."""

    def __init__(self, target_port: int, host: str = "127.0.0.1"):
        self.host, self.target_port = host, target_port
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind((host, 0))
        self.server.listen(16)
        self.port = self.server.getsockname()[1]
        self.blocked = False
        self.open: set[socket.socket] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            if self.blocked:
                client.close()
                continue
            try:
                upstream = socket.create_connection((self.host, self.target_port), timeout=2)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.open.update((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data, socket.MSG_NOSIGNAL)  # a dead peer is EPIPE, never SIGPIPE
        except OSError:
            pass
        for s in (src, dst):
            self._close(s)

    def _close(self, s: socket.socket) -> None:
        with self.lock:
            self.open.discard(s)
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()

    def cut(self) -> None:
        """Drop every relayed connection and refuse new ones."""
        self.blocked = True
        with self.lock:
            sockets = list(self.open)
        for s in sockets:
            self._close(s)

    def heal(self) -> None:
        self.blocked = False

    def close(self) -> None:
        self.cut()
        self.server.close()


class RouteMesh:
    """One relay per ordered pair of nodes: ``relay(i, j)`` is how node i reaches node j."""

    def __init__(self, route_ports: list[int], host: str = "127.0.0.1"):
        n = len(route_ports)
        self.relays = {(i, j): Relay(route_ports[j], host) for i in range(n) for j in range(n) if i != j}

    def routes_of(self, i: int) -> list[int]:
        """The ports node ``i`` solicits routes to."""
        return [r.port for (a, _), r in sorted(self.relays.items()) if a == i]

    def cut(self, x: int) -> None:
        for (a, b), relay in self.relays.items():
            if x in (a, b):
                relay.cut()

    def heal(self, x: int) -> None:
        for (a, b), relay in self.relays.items():
            if x in (a, b):
                relay.heal()

    def close(self) -> None:
        for relay in self.relays.values():
            relay.close()
