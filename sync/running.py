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
    connection: Callable[[Backoff], Awaitable[object]],
    failed: Callable[[str], None],
) -> None:
    """``connection(backoff)`` (one connection's life: it resets the back-off once it is
    up) again and again until ``stop``: one that ends in a TransportError, OSError or
    TimeoutError is told to ``failed`` in a sentence and tried again after the
    back-off's next delay."""
    backoff = Backoff()
    while not stop.is_set():
        try:
            await connection(backoff)
        except ConnectRefused as exc:
            failed(str(exc))  # its text says why, with the broker's reason code
        except (TransportError, OSError, TimeoutError) as exc:
            failed(f"{type(exc).__name__}: {exc}")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), backoff.next_delay())
