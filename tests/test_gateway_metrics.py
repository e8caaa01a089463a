"""The metrics the alert rules need beside the rest (examples/prometheus/pubcomp-alerts.yml),
from a real gateway process: the store's quota, the start time (a change is a restart, which
PubcompGatewayRestarting counts), the store's dropped_quota count from 0 (PubcompStoreFull)
and the gateway's id and fleet as an info metric."""

from __future__ import annotations

import math
import time
from pathlib import Path

from devkit.broker import Mosquitto
from devkit.gateway_helpers import GatewayProc
from devkit.node_helpers import wait_until

from .metrics_helpers import samples, scrape_text

SENSORS = [{"id": "temp", "type": "simulated", "signal": "sine", "unit": "C", "interval_s": 0.1}]
START = ("pubcomp_start_timestamp_seconds", ())
QUOTA = ("pubcomp_store_quota_bytes", ())
UP = ("pubcomp_up_seconds", ())


def test_quota_start_time_and_info(tmp_path: Path, mosquitto: Mosquitto) -> None:
    gw = GatewayProc(tmp_path, mosquitto.port, sensors=SENSORS, extra={"store": {"quota_mb": 50}})
    before = time.time()
    gw.start()
    after = time.time()
    try:
        first = samples(scrape_text(gw))
        assert first[QUOTA] == 50e6
        assert 0 < first[("pubcomp_store_bytes", ())] < first[QUOTA]
        info = ("pubcomp_gateway_info", (("fleet", "e2e"), ("gateway", "gw-e2e")))
        assert first[info] == 1.0
        assert before <= first[START] <= after
        # Exported from 0 before the store counts any, so increase() sees the first drop.
        assert first[("pubcomp_store_events_total", (("event", "dropped_quota"),))] == 0
        # The start time stays put while the process runs: only a restart changes it.
        assert wait_until(lambda: samples(scrape_text(gw))[UP] > first[UP] + 0.5, 30)
        assert samples(scrape_text(gw))[START] == first[START]
    finally:
        assert gw.terminate() == 0
    # Restarted without a quota: a new start time, and the quota is NaN (no quota).
    gw.extra = {}
    gw.write()
    gw.start()
    try:
        again = samples(scrape_text(gw))
        assert again[START] > first[START]
        assert math.isnan(again[QUOTA])
    finally:
        assert gw.terminate() == 0
