"""How long-running work runs: the main of every command that runs until stopped
(uplink, gateway, ingest: one event loop, and SIGTERM or SIGINT asks the work to
stop, so it commits and disconnects cleanly instead of being torn down
mid-commit), and the reconnect loop of a connection that must come back."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable
from typing import TypeVar

from .client import Backoff, ConnectRefused
from .errors import TransportError

T = TypeVar("T")


def run_until_stopped(work: Callable[[asyncio.Event], Awaitable[T]]) -> T:
    """Run ``work(stop)`` to its end; a SIGTERM or SIGINT sets ``stop``."""

    async def main() -> T:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await work(stop)

    return asyncio.run(main())


async def reconnecting(
    stop: asyncio.Event,
    connection: Callable[[Backoff], Awaitable[bool | None]],
    failed: Callable[[str, BaseException], Awaitable[None] | None],
) -> None:
    """``connection(backoff)`` (one connection's life: it resets the back-off once it is
    up) again and again until ``stop``, or until it returns True (its work is done). One
    that ends in a TransportError, OSError or TimeoutError is told to ``failed`` (a
    sentence, and the error; awaited if it is a coroutine) and tried again after the
    back-off's next delay."""
    backoff = Backoff()
    while not stop.is_set():
        try:
            if await connection(backoff) is True:
                return
        except ConnectRefused as exc:
            await _told(failed, str(exc), exc)  # its text says why, with the reason code
        except (TransportError, OSError, TimeoutError) as exc:
            await _told(failed, f"{type(exc).__name__}: {exc}", exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), backoff.next_delay())


async def _told(
    failed: Callable[[str, BaseException], Awaitable[None] | None], why: str, exc: BaseException
) -> None:
    told = failed(why, exc)
    if told is not None:
        await told
