"""A man in the middle of a node's link: it rewrites the software update's packets.

Between a node and its gateway's ingress (plaintext MQTT 3.1.1), it reads whole
MQTT packets each way and lets a function change a PUBLISH's payload, the way an
attacker on the site's Wi-Fi, or a broken link, could. The tests use it to
deliver a truncated chunk, a forged one, and a valid chunk for another place
than the one asked for (a reordering), and check the node refuses each.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable

from .link import Forwarder

# (direction "up": node to gateway, "down": gateway to node; topic, payload) -> payload
Rewrite = Callable[[str, str, bytes], bytes]


def _read_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = s.recv(n - len(out))
        if not got:
            raise ConnectionError("closed")
        out += got
    return out


def _read_packet(s: socket.socket) -> tuple[int, bytes]:
    first = _read_exact(s, 1)[0]
    length, shift = 0, 0
    while True:
        b = _read_exact(s, 1)[0]
        length |= (b & 0x7F) << shift
        if not b & 0x80:
            break
        shift += 7
    return first, _read_exact(s, length)


def _length(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


class RewritingProxy(Forwarder):
    """Forwards a node's connections to ``target_port``, passing PUBLISH payloads
    through ``rewrite`` (MQTT 3.1.1 framing; every other packet as it is)."""

    def __init__(self, target_port: int, rewrite: Rewrite) -> None:
        self.rewrite = rewrite
        super().__init__(target_port, name="node-rewriting-proxy")

    def _join(self, client: socket.socket, upstream: socket.socket) -> None:
        for src, dst, way in ((client, upstream, "up"), (upstream, client, "down")):
            threading.Thread(target=self._pipe, args=(src, dst, way), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, way: str) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while True:
                first, body = _read_packet(src)
                if first >> 4 == 3:  # PUBLISH
                    tlen = int.from_bytes(body[:2], "big")
                    head = 2 + tlen + (2 if first & 0x06 else 0)
                    topic = body[2 : 2 + tlen].decode()
                    body = body[:head] + self.rewrite(way, topic, body[head:])
                dst.sendall(bytes([first]) + _length(len(body)) + body)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
