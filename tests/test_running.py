"""Stopping tasks at a shutdown: a cancel that is dropped must not keep the process up."""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest

from pubcomp.sync.running import cancel_all


async def _wait_for_racing_its_cancel() -> tuple[asyncio.Task[int], bool]:
    """A task inside ``asyncio.wait_for`` whose inner future completes in the same step
    as the task's cancel (an aiomqtt connect finishing as SIGTERM arrives); then it
    waits a long time. Returns the task, and whether that one cancel ended it."""
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def chore() -> int:
        got = await asyncio.wait_for(fut, 10)
        await asyncio.sleep(3600)
        return got

    task = asyncio.create_task(chore(), name="status")
    await asyncio.sleep(0)  # into wait_for
    task.cancel()
    fut.set_result(1)
    done, _ = await asyncio.wait({task}, timeout=0.2)
    return task, bool(done)


def test_a_cancel_dropped_by_wait_for_is_sent_again() -> None:
    async def main() -> tuple[bool, set[str], bool]:
        task, ended_by_one = await _wait_for_racing_its_cancel()
        left = await cancel_all([task], within=30)
        return ended_by_one, left, task.cancelled()

    ended_by_one, left, cancelled = asyncio.run(main())
    if sys.version_info < (3, 12):  # the case this guards against happens here
        assert not ended_by_one, "wait_for did not drop the cancel: the test proves nothing"
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
