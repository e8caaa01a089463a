"""Node credentials: only scrypt hashes sit in the fleet file, never passwords.

And the checking of them, which an attacker must not be able to turn against the
nodes (issue 25): 400 wrong guesses queued on the one scrypt thread made a node
whose password was right wait 14-21 s for its CONNACK, past its firmware's 10 s.
``Verifier`` answers a password it has verified before from a keyed hash
(microseconds), a wrong one it has seen lately the same way, and queues the
rest by address, taking the addresses in turn and those that failed lately
only when no other waits: a good node's check waits for at most the one
already running. ``Throttle`` remembers failures per address and per user
name in bounded tables; the ingress holds each refusal back by the delay it
gives (0.5 s, doubling every 3 recent failures, at most 5 s), and the
address's next check waits as long: delay costs a sleeping coroutine, a
check costs a scrypt.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import contextlib
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable

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


# An address with three failures lately (the count decays: 2.5) has its checks run only
# when no other address waits, and its logins give way to others' when the places are full.
PENALISED_AT = 2.5
DOUBLING_FAILURES = 3.0  # the refusal delay doubles every this many recent failures
FAILURE_HALF_LIFE_S = 60.0
REFUSAL_DELAY_S = 0.5  # the first refusal; doubling every 3 recent failures ...
REFUSAL_DELAY_MAX_S = 5.0  # ... up to this (inside the ingress's 10 s login timeout)
TABLE_SIZE = 4096  # addresses and user names remembered (least recently failed forgotten)
BAD_PASSWORDS_KEPT = 1024  # wrong (user, password) pairs answered without scrypt


class Decaying:
    """Counts per key that halve every ``half_life`` seconds; at most ``size`` keys
    (the least recently counted go first), so garbage cannot grow it."""

    def __init__(
        self,
        half_life: float = FAILURE_HALF_LIFE_S,
        size: int = TABLE_SIZE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.half_life, self.size, self._clock = half_life, size, clock
        self._counts: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()

    def get(self, key: str) -> float:
        got = self._counts.get(key)
        if got is None:
            return 0.0
        value, at = got
        return float(value * 0.5 ** ((self._clock() - at) / self.half_life))

    def last(self, key: str) -> tuple[float, float] | None:
        """(the count when last added to, when): None if not kept."""
        return self._counts.get(key)

    def add(self, key: str) -> float:
        value = self.get(key) + 1.0
        self._counts[key] = (value, self._clock())
        self._counts.move_to_end(key)
        while len(self._counts) > self.size:
            self._counts.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._counts)


class Throttle:
    """Recent failed logins per address and per user name (bounded), and what follows."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.addresses = Decaying(clock=clock)
        self.users = Decaying(clock=clock)

    def failed(self, address: str, user: str | None) -> float:
        """Record a refusal; how long to hold it back (seconds)."""
        worst = self.addresses.add(address)
        if user is not None:  # a known node's name (unknown names are not kept)
            worst = max(worst, self.users.add(user))
        return delay(worst)

    def penalised(self, address: str) -> bool:
        return self.addresses.get(address) >= PENALISED_AT

    def wait(self, address: str) -> float:
        """How long a new check from ``address`` waits: until the delay its last failure
        earned is over (its password checks come no faster than its refusals)."""
        got = self.addresses.last(address)
        if got is None:
            return 0.0
        failures, at = got
        return max(0.0, at + delay(failures) - self._clock())


def delay(failures: float) -> float:
    """0.5 s for the first failure, doubling every DOUBLING_FAILURES, at most 5 s."""
    return min(REFUSAL_DELAY_MAX_S, REFUSAL_DELAY_S * 2 ** ((failures - 1) / DOUBLING_FAILURES))


_Job = tuple[Callable[[], bool], "asyncio.Future[bool]"]


class Verifier:
    """Checks node passwords, fairly, and remembers the ones that were right.

    One scrypt check takes 16 MB: twenty nodes reconnecting at once after a
    gateway restart must not take 320 MB (or six worker threads' worth), so
    every check runs on one thread. A password that verified is remembered as
    an HMAC under a key that lives only in this process, so a reconnect costs
    microseconds and nothing on disk or in a core dump of the cache reveals
    the password; a wrong one is remembered the same way (a broken node
    retrying a stale password costs no scrypt either).

    The checks wait in one queue per address, served in turn; addresses the
    throttle penalises (recent failures) are served only when no other waits.
    A check whose client gave up (its login timed out) is dropped unrun.
    """

    def __init__(self, throttle: Throttle | None = None) -> None:
        self._key = secrets.token_bytes(32)
        self.throttle = throttle or Throttle()
        self._known: dict[tuple[str, str], bytes] = {}  # only nodes of the fleet file
        self._bad: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        # One thread for every scrypt: glibc gives each thread its own malloc arena
        # and keeps freed 16 MB blocks there, so checks spread over the default
        # executor's threads held on to 16 MB each.
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="scrypt")
        self._tiers: tuple[dict[str, collections.deque[_Job]], ...] = ({}, {})
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self.checks = 0  # scrypt checks run
        self.answered_from_cache = 0  # wrong passwords refused without one

    def _mac(self, *parts: str | bytes) -> bytes:
        data = b"\0".join(p if isinstance(p, bytes) else p.encode() for p in parts)
        return hmac.new(self._key, data, hashlib.sha256).digest()

    async def verify(
        self, node: str, password: str | bytes, hashed: str, address: str = ""
    ) -> bool:
        pw = password if isinstance(password, bytes) else password.encode()
        mac = self._mac(node, hashed, pw)
        known = self._known.get((node, hashed))
        if known is not None and hmac.compare_digest(known, mac):
            return True
        if mac in self._bad:
            self._bad.move_to_end(mac)
            self.answered_from_cache += 1
            return False
        wait = self.throttle.wait(address)
        if wait > 0:  # an address that failed lately: no new scrypt for it before then
            await asyncio.sleep(wait)
        ok = await self._queued(address, lambda: verify_password(pw, hashed))
        if ok:
            self._known[(node, hashed)] = mac
        else:
            self._bad[mac] = None
            while len(self._bad) > BAD_PASSWORDS_KEPT:
                self._bad.popitem(last=False)
        return ok

    @property
    def waiting(self) -> int:
        return sum(len(q) for tier in self._tiers for q in tier.values())

    def _queued(self, address: str, check: Callable[[], bool]) -> asyncio.Future[bool]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        tier = self._tiers[1 if self.throttle.penalised(address) else 0]
        tier.setdefault(address, collections.deque()).append((check, fut))
        if self._worker is None or self._worker.done():
            self._wake = asyncio.Event()
            self._worker = loop.create_task(self._work(), name="scrypt-queue")
        assert self._wake is not None
        self._wake.set()
        return fut

    def _next(self) -> _Job | None:
        for tier in self._tiers:
            while tier:
                address = next(iter(tier))
                queue = tier.pop(address)
                job = queue.popleft()
                if queue:
                    tier[address] = queue  # to the back: the next address goes first
                if not job[1].done():  # not given up on (cancelled by a login timeout)
                    return job
        return None

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake is not None
        while True:
            job = self._next()
            if job is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            check, fut = job
            self.checks += 1
            try:
                ok = await loop.run_in_executor(self._pool, check)
            except Exception as exc:  # verify_password catches what a bad hash raises
                if not fut.done():
                    fut.set_exception(exc)
            else:
                if not fut.done():
                    fut.set_result(ok)

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        for tier in self._tiers:
            for queue in tier.values():
                for _, fut in queue:
                    fut.cancel()
            tier.clear()
        self._pool.shutdown(wait=False)
