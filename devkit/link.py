"""A TCP forwarder whose link can be cut or taken down: a Wi-Fi drop or a dead uplink.

Used by the demo, the tests and bench/chaos_compare.py between a client and
its broker, so the client sees what a field link does: connections reset
(RST both ways, not a polite FIN) and, while it is down, new connections
refused, while both ends stay up.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading


class LinkProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.cuts = 0
        self.is_down = False
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="link-proxy").start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            try:
                if self.is_down:
                    raise OSError("link down")
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def cut(self) -> None:
        """Reset every open connection; new ones are accepted unless the link is down."""
        with self._lock:
            conns, self.conns = self.conns, []
        for s in conns:
            _reset(s)
        self.cuts += 1

    def down(self) -> None:
        """Cut, and refuse (reset) new connections until ``up``."""
        self.is_down = True
        self.cut()

    def up(self) -> None:
        self.is_down = False

    def close(self) -> None:
        self.server.close()
        self.cut()


def _reset(s: socket.socket) -> None:
    with contextlib.suppress(OSError):  # linger 0: close with RST, as a dropped link looks
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
