"""New readings wake the uplink while it waits for acknowledgements; no ack may be lost."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from devkit.broker import Mosquitto
from devkit.checker import Checker
from devkit.store_helpers import append
from pubcomp.sync.client import ConnectOptions
from pubcomp.sync.store import Reading, Store
from pubcomp.sync.uplink import Uplink, UplinkConfig


def test_frequent_wakeups_never_strand_a_message_in_flight(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """Each append cancels the uplink's pending read. Python 3.11's asyncio.wait_for
    dropped bytes read at the moment of such a cancellation: PUBRECs vanished and their
    messages stayed in flight until the next reconnect (found by bench/gateway.py)."""
    checker = Checker(mosquitto.port, topic="telemetry/#", client_id="wake-checker").start()
    n = 3000

    async def main(store: Store) -> dict[str, object]:
        uplink = Uplink(
            store, mosquitto.url, ConnectOptions("gw-wake"), UplinkConfig(batch=5, end_to_end=False)
        )
        stop = asyncio.Event()
        task = asyncio.create_task(uplink.run(stop))
        for i in range(n):
            append(store, [Reading("s", float(i), "2026-11-21T00:00:00.000Z", "C")])
            if i % 3 == 0:
                await asyncio.sleep(0.0005)
        deadline = time.monotonic() + 15
        while store.stats()["backlog"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stop.set()
        await task
        return store.stats()

    with Store(tmp_path / "s.db", gateway_id="gw-wake") as store:
        st = asyncio.run(main(store))
        epoch = store.epoch
    expected = {f"gw-wake/{epoch}/{i}" for i in range(1, n + 1)}
    counts = checker.wait_for(expected, 10)
    checker.stop()
    assert st["backlog"] == 0 and st["inflight_messages"] == 0, st
    assert counts.keys() == expected and max(counts.values()) == 1
