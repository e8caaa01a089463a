"""The main of every long-running command (uplink, gateway, ingest): one event loop,
and SIGTERM or SIGINT asks the work to stop (``systemctl stop``, Ctrl-C), so it can
commit and disconnect cleanly instead of being torn down mid-commit."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import TypeVar

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
