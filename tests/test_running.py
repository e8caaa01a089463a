"""Stopping tasks at a shutdown: a cancel that is dropped must not keep the process up."""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest

from pubcomp.sync.running import cancel_all


def test_a_cancel_dropped_by_wait_for_is_sent_again() -> None:
    """cancel_all's own cancel lands in the step in which the task's ``wait_for``
    completes (an aiomqtt connect finishing as SIGTERM arrives); the task then waits a
    long time. One cancel does not end it on Python 3.11; cancel_all must."""

    async def main() -> tuple[bool, set[str], bool]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        passed_wait_for = False

        async def chore() -> int:
            nonlocal passed_wait_for
            got = await asyncio.wait_for(fut, 10)
            passed_wait_for = True  # the cancel was dropped
            await asyncio.sleep(3600)
            return got

        task = asyncio.create_task(chore(), name="status")
        await asyncio.sleep(0)  # into wait_for
        closing = asyncio.create_task(cancel_all([task], within=5))
        loop.call_soon(fut.set_result, 1)  # runs right after cancel_all's first cancel
        left = await closing
        return passed_wait_for, left, task.cancelled()

    dropped, left, cancelled = asyncio.run(main())
    if sys.version_info < (3, 12):  # the case this guards against happens here
        assert dropped, "wait_for did not drop the cancel: the test proves nothing"
    assert left == set()
    assert cancelled


def test_tasks_that_ended_or_failed_are_collected() -> None:
    async def main() -> set[str]:
        async def fails() -> None:
            raise RuntimeError("a chore that failed earlier")

        async def waits() -> None:
            await asyncio.Event().wait()

        failed = asyncio.create_task(fails(), name="fails")
        await asyncio.sleep(0)
        return await cancel_all([failed, asyncio.create_task(waits(), name="waits")])

    assert asyncio.run(main()) == set()


def test_a_task_that_will_not_end_is_named_and_left(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> set[str]:
        release = asyncio.Event()

        async def stubborn() -> None:
            while not release.is_set():
                try:
                    await release.wait()
                except asyncio.CancelledError:
                    continue

        task = asyncio.create_task(stubborn(), name="stubborn")
        await asyncio.sleep(0)
        left = await cancel_all([task], within=0.5)
        release.set()
        await task
        return left

    with caplog.at_level(logging.WARNING, logger="pubcomp.sync.running"):
        assert asyncio.run(main()) == {"stubborn"}
    assert "task stubborn did not end within 0.5 s of its cancel" in caplog.text


def test_reconnecting_retries_the_errors_it_is_given_with_the_backoff_it_is_given() -> None:
    """The status link and ``fleet watch`` retry aiomqtt's errors (issue 26: they had
    loops of their own); an error not named ends the loop."""
    from pubcomp.sync.client import Backoff
    from pubcomp.sync.running import reconnecting

    class Lost(Exception):
        pass

    tries: list[int] = []
    told: list[str] = []
    backoff = Backoff(base=0.001, cap=0.001)

    async def connection(b: Backoff) -> bool | None:
        assert b is backoff
        tries.append(len(tries))
        if len(tries) < 3:
            raise Lost(f"try {len(tries)}")
        if len(tries) == 3:
            raise OSError("not named: not retried")
        return True

    async def main() -> None:
        await reconnecting(
            asyncio.Event(),
            connection,
            lambda why, exc: told.append(why),
            backoff=backoff,
            errors=(Lost,),
        )

    with pytest.raises(OSError, match="not named"):
        asyncio.run(main())
    assert tries == [0, 1, 2] and told == ["Lost: try 1", "Lost: try 2"]
