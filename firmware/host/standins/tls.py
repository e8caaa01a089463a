"""MicroPython's tls module (1.22 and later) under CPython, on OpenSSL.

What the board's mbedTLS does, as far as the firmware can tell: a client
context verifies the chain against the one DER certificate given to
load_verify_locations, and the name with server_hostname; a certificate that
does not verify raises OSError(MBEDTLS_ERR_X509_CERT_VERIFY_FAILED) (-0x2700).
CERT_NONE checks nothing. The wrapped socket reads and writes with usocket's
stream semantics.
"""

from __future__ import annotations

import errno
import ssl as _ssl

import usocket

PROTOCOL_TLS_CLIENT, PROTOCOL_TLS_SERVER = 0, 1
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


class SSLContext:
    def __init__(self, protocol: int) -> None:
        assert protocol == PROTOCOL_TLS_CLIENT, "the node is a client"
        self.verify_mode = CERT_REQUIRED
        self._cadata: bytes | None = None

    def load_verify_locations(self, cadata: bytes) -> None:
        self._cadata = bytes(cadata)

    def wrap_socket(
        self,
        sock: usocket.socket,
        server_side: bool = False,
        do_handshake_on_connect: bool = True,
        server_hostname: str | None = None,
    ) -> _TlsSocket:
        assert not server_side and do_handshake_on_connect
        ctx = _ssl.SSLContext(_ssl.PROTOCOL_TLS_CLIENT)
        if self.verify_mode == CERT_REQUIRED:
            ctx.load_verify_locations(cadata=self._cadata or b"")
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
