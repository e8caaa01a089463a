"""MicroPython's ussl under CPython: wrap_socket with MicroPython's arguments, on OpenSSL.

What the board's mbedTLS does, as far as the firmware can tell: cadata is one
DER certificate; cert_reqs=CERT_REQUIRED verifies the chain and, with
server_hostname, the name; a certificate that does not verify raises
OSError(MBEDTLS_ERR_X509_CERT_VERIFY_FAILED) (-0x2700). The wrapped socket
reads and writes with usocket's stream semantics.
"""

from __future__ import annotations

import errno
import ssl as _ssl
from typing import Any

import usocket

CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED = 0, 1, 2
MBEDTLS_ERR_X509_CERT_VERIFY_FAILED = -0x2700
MBEDTLS_ERR_SSL_HANDSHAKE = -0x6C00  # a stand-in code for any other handshake failure


class _TlsSocket(usocket.socket):
    def __init__(self, s: _ssl.SSLSocket) -> None:
        self._s = s

    def read(self, n: int) -> bytes | None:
        out = b""
        while len(out) < n:
            try:
                chunk = self._s.recv(n - len(out))
            except (BlockingIOError, _ssl.SSLWantReadError):
                return out or None
            except TimeoutError:
                raise OSError(errno.ETIMEDOUT, "ETIMEDOUT") from None
            if not chunk:
                break
            out += chunk
        return out


def wrap_socket(
    sock: usocket.socket,
    server_side: bool = False,
    key: Any = None,
    cert: Any = None,
    cert_reqs: int = CERT_NONE,
    cadata: bytes | None = None,
    server_hostname: str | None = None,
    do_handshake: bool = True,
) -> _TlsSocket:
    assert not server_side and do_handshake, "the node is a client"
    ctx = _ssl.SSLContext(_ssl.PROTOCOL_TLS_CLIENT)
    if cert_reqs == CERT_REQUIRED:
        ctx.load_verify_locations(cadata=bytes(cadata or b""))
        ctx.check_hostname = server_hostname is not None
    else:  # as on mbedTLS: CERT_NONE and CERT_OPTIONAL check nothing
        ctx.check_hostname = False
        ctx.verify_mode = _ssl.CERT_NONE
    try:
        s = ctx.wrap_socket(sock._s, server_hostname=server_hostname)
    except _ssl.SSLCertVerificationError as e:
        raise OSError(
            MBEDTLS_ERR_X509_CERT_VERIFY_FAILED,
            f"MBEDTLS_ERR_X509_CERT_VERIFY_FAILED ({e.verify_message})",
        ) from None
    except _ssl.SSLError as e:
        raise OSError(MBEDTLS_ERR_SSL_HANDSHAKE, f"TLS handshake failed ({e.reason})") from None
    return _TlsSocket(s)
