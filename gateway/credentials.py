"""Node credentials: only scrypt hashes sit in the fleet file, never passwords."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

# n=2**14, r=8: about 16 MB and tens of milliseconds on a Pi, once per node connection.
N, R, P = 2**14, 8, 1


def hash_password(password: str, *, salt: bytes | None = None) -> str:
    salt = salt or secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=N, r=R, p=P, dklen=32)
    b64 = base64.b64encode
    return f"scrypt${N}${R}${P}${b64(salt).decode()}${b64(digest).decode()}"


def verify_password(password: str | bytes, hashed: str) -> bool:
    try:
        scheme, n, r, p, salt, digest = hashed.split("$")
        if scheme != "scrypt":
            return False
        pw = password if isinstance(password, bytes) else password.encode()
        got = hashlib.scrypt(
            pw, salt=base64.b64decode(salt), n=int(n), r=int(r), p=int(p), dklen=32
        )
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(got, base64.b64decode(digest))
