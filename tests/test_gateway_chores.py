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
from pathlib import Path

import pytest

from pubcomp.gateway import service
from pubcomp.gateway.config import GatewayConfig
from pubcomp.gateway.notify import Notifier
from tests.test_gateway_notify import NotifySocket


def test_a_dead_chore_makes_the_gateway_unhealthy_logged_with_its_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ns = NotifySocket(tmp_path / "notify.sock")
    cfg = GatewayConfig.model_validate(
        {
            "id": "gw-chores",
            "fleet": "t",
            "uplink": {"broker": "mqtt://127.0.0.1:9"},
            "store": {"path": str(tmp_path / "gw.db")},
            "health": {"port": 0},
        }
    )
    notifier = Notifier({"NOTIFY_SOCKET": ns.path, "WATCHDOG_USEC": "200000"})
    seen: dict[str, object] = {}

    async def main() -> int:
        gw = service.Gateway(cfg, notifier=notifier)

        async def broken_prune() -> None:
            await asyncio.sleep(0.3)
            raise RuntimeError("prune broke")

        gw._prune_loop = broken_prune  # type: ignore[method-assign]  # the chore, made to fail
        stop = asyncio.Event()
        run = asyncio.create_task(gw.run(stop))
        await asyncio.sleep(0.2)
        seen["before"] = gw.healthy()
        for _ in range(50):
            await asyncio.sleep(0.1)
            if not gw.healthy()[0]:
                break
        seen["after"] = gw.healthy()
        await asyncio.sleep(0.5)  # a watchdog round or two
        stop.set()
        return await run

    try:
        with caplog.at_level(logging.ERROR, logger="pubcomp.gateway.service"):
            assert asyncio.run(main()) == 0
        ns.wait("STOPPING")
    finally:
        ns.close()
    assert seen["before"] == (True, [])
    ok, why = seen["after"]  # type: ignore[misc]
    assert not ok and why == ["prune chore died: RuntimeError: prune broke"]
    died = [r for r in caplog.records if "chore prune died" in r.getMessage()]
    assert len(died) == 1 and died[0].exc_info is not None  # once, with its traceback
    statuses = [f["STATUS"] for _, f in ns.got if "STATUS" in f]
    assert any(s.startswith("UNHEALTHY: prune chore died") for s in statuses), statuses
