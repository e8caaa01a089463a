"""How long-running work runs: the main of every command that runs until stopped
(uplink, gateway, ingest: one event loop, and SIGTERM or SIGINT asks the work to
stop, so it commits and disconnects cleanly instead of being torn down
mid-commit), the reconnect loop of a connection that must come back, and the
cancelling of tasks at a stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from .backoff import Backoff
from .errors import ConnectRefused, TransportError

T = TypeVar("T")

log = logging.getLogger(__name__)

# How often a task that is still running after its cancel is told again.
RECANCEL_S = 0.25


class Stop(asyncio.Event):
    """The event that asks the work to stop; ``signal`` is the signal that set it (None
    while no signal came: the work may set it itself, as a gateway does to re-execute,
    and a SIGTERM that comes meanwhile must still end the process)."""

    def __init__(self) -> None:
        super().__init__()
        self.signal: int | None = None

    def signalled(self, signum: int) -> None:
        self.signal = signum
        self.set()


def run_until_stopped(work: Callable[[Stop], Awaitable[T]]) -> T:
    """Run ``work(stop)`` to its end; a SIGTERM or SIGINT sets ``stop``."""

    async def main() -> T:
        stop = Stop()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.signalled, sig)
        return await work(stop)

    return asyncio.run(main())


# What ends a connection of our own client, to be tried again.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (TransportError, OSError, TimeoutError)


async def reconnecting(
    stop: asyncio.Event,
    connection: Callable[[Backoff], Awaitable[bool | None]],
    failed: Callable[[str, BaseException], Awaitable[None] | None],
    *,
    backoff: Backoff | None = None,
    errors: tuple[type[BaseException], ...] = CONNECTION_ERRORS,
) -> None:
    """``connection(backoff)`` (one connection's life: it resets the back-off once it is
    up) again and again until ``stop``, or until it returns True (its work is done). One
    that ends in one of ``errors`` (by default a TransportError, OSError or TimeoutError;
    a connection made by another library names its own, aiomqtt's MqttError) is told to
    ``failed`` (a sentence, and the error; awaited if it is a coroutine; what ``failed``
    raises ends the loop) and tried again after the back-off's next delay."""
    backoff = backoff or Backoff()
    while not stop.is_set():
        try:
            if await connection(backoff) is True:
                return
        except errors as exc:
            # A refusal's text says why, with the reason code.
            why = str(exc) if isinstance(exc, ConnectRefused) else f"{type(exc).__name__}: {exc}"
            await _told(failed, why, exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), backoff.next_delay())


async def _told(
    failed: Callable[[str, BaseException], Awaitable[None] | None], why: str, exc: BaseException
) -> None:
    told = failed(why, exc)
    if told is not None:
        await told


async def cancel_all(tasks: Iterable[asyncio.Task[Any]], *, within: float = 10.0) -> set[str]:
    """Cancel ``tasks`` and wait until they have ended; the names of any still running
    after ``within`` seconds (logged, and left behind).

    One cancel is not always enough: Python 3.11's ``asyncio.wait_for`` returns its
    inner result, and drops the cancel, when both land in the same step (gh-86296; an
    aiomqtt client connecting as SIGTERM arrived kept a gateway from stopping). Such a
    task is told again until it ends.
    """
    tasks = list(tasks)
    left = {t for t in tasks if not t.done()}
    deadline = asyncio.get_running_loop().time() + within
    while left:
        for t in left:
            t.cancel()
        wait = min(RECANCEL_S, deadline - asyncio.get_running_loop().time())
        if wait <= 0:
            break
        _, left = await asyncio.wait(left, timeout=wait)
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()  # retrieved: asyncio would otherwise log it as never retrieved
    for t in left:
        log.warning("task %s did not end within %g s of its cancel", t.get_name(), within)
    return {t.get_name() for t in left}
