"""A TCP forwarder whose link can be cut or taken down: a Wi-Fi drop or a dead uplink.

Used by the demo, the tests and bench/chaos_compare.py between a client and
its broker, so the client sees what a field link does: connections reset
(RST both ways, not a polite FIN) and, while it is down, new connections
refused, while both ends stay up.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import struct
import threading
import time


class Forwarder:
    """Listens on a free loopback port and, for each client, opens a connection to
    the target; a subclass says what flows between the two (``_join``). The demo,
    the tests and the benches each need a link that misbehaves in its own way."""

    def __init__(self, target_port: int, host: str = "127.0.0.1", *, name: str) -> None:
        self.target = (host, target_port)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name=name).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return  # closed
            try:
                upstream = self._connect()
            except OSError:
                self._refuse(client)
                continue
            self._join(client, upstream)

    def _connect(self) -> socket.socket:
        upstream = socket.create_connection(self.target, timeout=5)
        upstream.settimeout(None)
        return upstream

    def _refuse(self, client: socket.socket) -> None:
        client.close()

    def _join(self, client: socket.socket, upstream: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.server.close()


def pipe(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until ``src`` ends, then end ``dst``'s sending side."""
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


class LinkProxy(Forwarder):
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.conns: list[socket.socket] = []
        self.cuts = 0
        self.is_down = False
        self._lock = threading.Lock()
        super().__init__(target_port, host, name="link-proxy")

    def _connect(self) -> socket.socket:
        if self.is_down:
            raise OSError("link down")
        return super()._connect()

    def _refuse(self, client: socket.socket) -> None:
        _reset(client)

    def _join(self, client: socket.socket, upstream: socket.socket) -> None:
        with self._lock:
            self.conns += [client, upstream]
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=pipe, args=(a, b), daemon=True).start()

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
        super().close()
        self.cut()


class SlowLink(Forwarder):
    """A link with ``delay`` seconds of latency each way (a cellular or satellite uplink:
    a round trip of twice that), or only on the way back (``up=False``: a congested
    downlink); its bytes in order, bandwidth not limited."""

    def __init__(
        self, target_port: int, delay: float, host: str = "127.0.0.1", *, up: bool = True
    ) -> None:
        self.delay, self.up = delay, up
        super().__init__(target_port, host, name="slow-link")

    def _join(self, client: socket.socket, upstream: socket.socket) -> None:
        if not self.up:
            threading.Thread(target=pipe, args=(client, upstream), daemon=True).start()
        for a, b in ((client, upstream), (upstream, client))[0 if self.up else 1 :]:
            chunks: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()
            threading.Thread(target=self._read, args=(a, chunks), daemon=True).start()
            threading.Thread(target=self._write, args=(chunks, b), daemon=True).start()

    def _read(self, src: socket.socket, chunks: queue.SimpleQueue[tuple[float, bytes]]) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                chunks.put((time.monotonic() + self.delay, data))
        chunks.put((time.monotonic() + self.delay, b""))  # the end, delayed like the bytes

    def _write(self, chunks: queue.SimpleQueue[tuple[float, bytes]], dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while True:
                due, data = chunks.get()
                time.sleep(max(0.0, due - time.monotonic()))
                if not data:
                    break
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def _reset(s: socket.socket) -> None:
    with contextlib.suppress(OSError):  # linger 0: close with RST, as a dropped link looks
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
