"""MicroPython's usocket under CPython: stream read/write on a TCP socket.

Only what umqtt.simple and the firmware use, with MicroPython's semantics:
read(n) blocks until n bytes or EOF; a non-blocking read with nothing to read
returns None; a timeout raises OSError(ETIMEDOUT).
"""

from __future__ import annotations

import errno
import socket as _socket
from typing import Any


def getaddrinfo(host: str, port: int, *_: Any) -> list[tuple[Any, ...]]:
    return _socket.getaddrinfo(host, port, 0, _socket.SOCK_STREAM)


class socket:
    def __init__(self, *_: Any) -> None:
        self._s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)

    def connect(self, addr: Any) -> None:
        self._s.connect(addr)

    def settimeout(self, t: float | None) -> None:
        self._s.settimeout(t)

    def setblocking(self, flag: bool) -> None:
        self._s.setblocking(flag)

    def write(self, buf: bytes | bytearray | str, n: int | None = None) -> int:
        if isinstance(buf, str):  # MicroPython streams take str too (umqtt relies on it)
            buf = buf.encode()
        data = bytes(buf if n is None else memoryview(buf)[:n])
        self._s.sendall(data)
        return len(data)

    def read(self, n: int) -> bytes | None:
        out = b""
        while len(out) < n:
            try:
                chunk = self._s.recv(n - len(out))
            except BlockingIOError:
                return out or None
            except TimeoutError:
                raise OSError(errno.ETIMEDOUT, "ETIMEDOUT") from None
            if not chunk:
                break
            out += chunk
        return out

    def close(self) -> None:
        self._s.close()
