"""DS18B20 through a fake sysfs tree: good, CRC NO, 85000, vanished, both file formats."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pubcomp.sensors.onewire import DS18B20, discover
from tests.sensor_helpers import ListSink

W1_GOOD = "72 01 4b 46 7f ff 0e 10 57 : crc=57 YES\n72 01 4b 46 7f ff 0e 10 57 t=23125\n"
W1_CRC_NO = "72 01 4b 46 7f ff 0e 10 57 : crc=58 NO\n72 01 4b 46 7f ff 0e 10 57 t=23125\n"
W1_NEGATIVE = "5e ff 4b 46 7f ff 02 10 6e : crc=6e YES\n5e ff 4b 46 7f ff 02 10 6e t=-10125\n"


@pytest.fixture
def bus(tmp_path: Path) -> Path:
    base = tmp_path / "devices"
    (base / "w1_bus_master1").mkdir(parents=True)  # not a probe: never listed
    probes = {
        "28-000005e2fdc3": {"temperature": "21437\n"},  # newer kernels
        "28-000005e2fdc4": {"w1_slave": W1_GOOD},  # older kernels
        "28-000005e2fdc5": {"w1_slave": W1_CRC_NO},
        "28-000005e2fdc6": {"temperature": "85000\n"},  # power-on value
        "28-000005e2fdc7": {"w1_slave": W1_NEGATIVE},
    }
    for dev, files in probes.items():
        (base / dev).mkdir()
        for name, text in files.items():
            (base / dev / name).write_text(text)
    return base


def test_discovery_lists_every_probe(bus: Path) -> None:
    assert discover(bus) == [f"28-000005e2fdc{i}" for i in range(3, 8)]
    assert discover(bus / "nothing-here") == []


def test_readings_and_faults(bus: Path) -> None:
    probe = DS18B20("t", base=bus, names={"28-000005e2fdc3": "t.outdoor"})
    sink = ListSink()
    probe.poll(sink)
    assert {r.sensor: r.value for r in sink.readings} == {
        "t.outdoor": 21.437,
        "t.28-000005e2fdc4": 23.125,
        "t.28-000005e2fdc7": -10.125,
    }
    assert all(r.unit == "C" for r in sink.readings)
    assert sorted(sink.fault_kinds()) == ["crc_error", "power_on_value"]


def test_a_vanished_probe_is_a_fault_not_a_crash(bus: Path) -> None:
    wanted = ["28-000005e2fdc3", "28-00000000dead"]
    probe = DS18B20("t", base=bus, devices=wanted)
    sink = ListSink()
    probe.poll(sink)
    assert sink.fault_kinds() == ["vanished"]
    (bus / "28-000005e2fdc3" / "temperature").unlink()  # gone mid-read
    (bus / "28-000005e2fdc3").rmdir()
    probe.poll(sink)
    assert sink.fault_kinds() == ["vanished", "vanished", "vanished"]
    assert probe.counters["vanished"] == 3


def test_run_polls_in_a_thread_and_reports_on_the_loop(bus: Path) -> None:
    async def main() -> ListSink:
        sink = ListSink()
        task = asyncio.create_task(DS18B20("t", base=bus, interval_s=0.05).run(sink))
        await sink.wait_for(lambda s: len(s.readings) >= 6)
        task.cancel()
        return sink

    assert len(asyncio.run(main()).readings) >= 6
