"""A background chore that dies makes the gateway unhealthy and is logged (issue 25).

The gateway's clock, sample, watchdog, prune and status loops were started with
``create_task`` and nothing looked at them again: ``healthy()`` saw only the
commit and uplink tasks, so a chore that raised left a gateway that reported
itself healthy with, say, no backlog sampling or no pruning, and the traceback
appeared (if ever) as "Task exception was never retrieved" at exit.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from devkit.gateway_helpers import offline_config
from pubcomp.gateway import service
from pubcomp.gateway.notify import Notifier
from tests.test_gateway_notify import NotifySocket


def test_a_dead_chore_makes_the_gateway_unhealthy_logged_with_its_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ns = NotifySocket(tmp_path / "notify.sock")
    cfg = offline_config(tmp_path, "gw-chores")
    # A watchdog ping every 0.5 s, and the store probe's limit the same: on a busy machine
    # a probe that waits behind a commit's fsync for longer makes its own (true) problem,
    # which is not what this test is about, so it is named apart below.
    notifier = Notifier({"NOTIFY_SOCKET": ns.path, "WATCHDOG_USEC": "1000000"})
    seen: dict[str, object] = {}
    chore_died = "prune chore died: RuntimeError: prune broke"

    async def until(check: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 30
        while not check():
            assert time.monotonic() < deadline, f"waited 30 s for {what}"
            await asyncio.sleep(0.02)

    async def main() -> int:
        gw = service.Gateway(cfg, notifier=notifier)
        release = asyncio.Event()

        async def broken_prune() -> None:
            await release.wait()
            raise RuntimeError("prune broke")

        gw._prune_loop = broken_prune  # type: ignore[method-assign]  # the chore, made to fail
        stop = asyncio.Event()
        run = asyncio.create_task(gw.run(stop))
        try:  # stopped the way systemd stops it, also when a wait below gives up
            await until(lambda: gw.healthy()[0], "a healthy gateway")
            seen["before"] = gw.healthy()
            release.set()
            await until(lambda: chore_died in gw.healthy()[1], "the dead chore in healthy()")
            seen["after"] = gw.healthy()
            await until(
                lambda: any("UNHEALTHY: " in f.get("STATUS", "") for _, f in ns.got),
                "an UNHEALTHY status to systemd",
            )
        finally:
            stop.set()
            code = await run
        return code

    try:
        with caplog.at_level(logging.ERROR, logger="pubcomp.gateway.service"):
            assert asyncio.run(main()) == 0
        ns.wait("STOPPING")
    finally:
        ns.close()
    assert seen["before"] == (True, [])
    ok, why = seen["after"]  # type: ignore[misc]
    assert not ok and [w for w in why if not w.startswith("store probe")] == [chore_died]
    died = [r for r in caplog.records if "chore prune died" in r.getMessage()]
    assert len(died) == 1 and died[0].exc_info is not None  # once, with its traceback
    statuses = [f["STATUS"] for _, f in ns.got if "STATUS" in f]
    assert any(s.startswith("UNHEALTHY: ") and chore_died in s for s in statuses), statuses


def test_a_cancelled_gateway_still_stops(tmp_path: Path) -> None:
    """``asyncio.run`` ending (an exception in an embedding program, a test that gave up)
    cancels every task at once: the commit loop with the rest. The gateway's stop then
    asked the dead loop for its last $ledger record and waited for it forever."""
    cfg = offline_config(tmp_path, "gw-cancelled")
    gw = service.Gateway(cfg, notifier=Notifier({}))

    async def main() -> None:
        run = asyncio.create_task(gw.run(asyncio.Event()))
        deadline = time.monotonic() + 30
        while not gw.ready:
            assert not run.done() and time.monotonic() < deadline, "the gateway never came up"
            await asyncio.sleep(0.02)
        raise RuntimeError("the program gives up")  # asyncio.run cancels ``run`` and the rest

    def ended() -> None:
        with pytest.raises(RuntimeError, match="gives up"):
            asyncio.run(main())

    stopper = threading.Thread(target=ended, daemon=True)
    stopper.start()
    stopper.join(60)
    assert not stopper.is_alive(), "the cancelled gateway did not stop within 60 s"
    # The stop ran to its end, and the store it left is whole.
    db = sqlite3.connect(tmp_path / "gw.db")
    try:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    finally:
        db.close()
