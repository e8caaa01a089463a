"""Node credentials: only scrypt hashes sit in the fleet file, never passwords."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
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


class Verifier:
    """Checks node passwords one at a time, and remembers the ones that were right.

    One scrypt check takes 16 MB: twenty nodes reconnecting at once after a
    gateway restart must not take 320 MB (or six worker threads' worth). A
    password that verified is remembered as an HMAC under a key that lives only
    in this process, so a reconnect costs microseconds and nothing on disk or
    in a core dump of the cache reveals the password.
    """

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)
        self._known: dict[tuple[str, str], bytes] = {}
        # One thread for every scrypt: glibc gives each thread its own malloc arena
        # and keeps freed 16 MB blocks there, so checks spread over the default
        # executor's threads held on to 16 MB each.
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="scrypt")

    def _mac(self, password: bytes) -> bytes:
        return hmac.new(self._key, password, hashlib.sha256).digest()

    async def verify(self, node: str, password: str | bytes, hashed: str) -> bool:
        pw = password if isinstance(password, bytes) else password.encode()
        known = self._known.get((node, hashed))
        if known is not None and hmac.compare_digest(known, self._mac(pw)):
            return True
        loop = asyncio.get_running_loop()
        ok = await loop.run_in_executor(self._pool, verify_password, pw, hashed)
        if ok:
            self._known[(node, hashed)] = self._mac(pw)
        return ok
