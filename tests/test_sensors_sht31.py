"""The SHT31 driver against a fake sensor at the I2C bus interface: the methods of
``smbus2.SMBus`` the driver calls, with smbus2's own ``i2c_msg`` as the messages. The fake
keeps the datasheet's rules (a 16-bit command; a read header NACKed until the single shot
is done, since clock stretching is off; a result read once), and the values are checked
against the datasheet's formulas written out here, not the driver's. Then what the
registry gives the new type with nothing else edited: the fleet file's checks, the
example, ``pubcomp sensor test``, the gateway's wiring."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from smbus2.smbus2 import I2C_M_RD

from pubcomp.gateway.clock import ClockWatch
from pubcomp.gateway.config import ConfigError, Fleet, GatewayConfig
from pubcomp.gateway.drivers import Drivers
from pubcomp.gateway.intake import Intake
from pubcomp.sensors import registry
from pubcomp.sensors.errors import SensorConfigError
from pubcomp.sensors.pins.simulated import SimulatedFactory
from pubcomp.sensors.sht31 import SHT31, crc8, humidity_rh, temperature_c
from pubcomp.sync.store import Store
from tests.sensor_helpers import ListSink

# The datasheet's longest single-shot times (clock stretching disabled), in seconds.
DONE_AFTER = {0x2400: 0.0155, 0x240B: 0.0065, 0x2416: 0.0045}
SOFT_RESET = 0x30A2


def datasheet_crc(data: bytes) -> int:
    """CRC-8, polynomial x^8 + x^5 + x^4 + 1 (0x31), initial 0xFF, bit by bit."""
    crc = 0xFF
    for byte in data:
        for bit in range(7, -1, -1):
            top = (crc >> 7) ^ (byte >> bit & 1)
            crc = (crc << 1) & 0xFF
            if top:
                crc ^= 0x31
    return crc


def celsius(raw: int) -> float:
    return -45 + 175 * raw / (2**16 - 1)


def percent_rh(raw: int) -> float:
    return 100 * raw / (2**16 - 1)


class FakeSHT31:
    """One SHT31 on a bus, as ``smbus2.SMBus`` reaches it."""

    def __init__(self, results: list[tuple[int, int]], address: int = 0x44) -> None:
        self.address = address
        self.results = list(results)  # (S_T, S_RH) per single shot; the last one repeats
        self.commands: list[int] = []
        self.opens: list[float] = []  # when the driver opened the bus
        self.closes = 0
        self.missing = 0  # the next n opens fail: no such device
        self.nack = 0  # the next n transfers are NACKed
        self.bad_crc: list[set[int]] = []  # per result to come: break the CRC at 2 (T), 5 (RH)
        self.early_reads = 0
        self._result: bytes | None = None
        self._done_at = 0.0

    def open(self, bus: int | str) -> FakeSHT31:
        self.opens.append(time.monotonic())
        if self.missing:
            self.missing -= 1
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), f"/dev/i2c-{bus}")
        return self

    def close(self) -> None:
        self.closes += 1

    def _acked(self, address: int) -> None:
        if address != self.address or self.nack:
            self.nack = max(0, self.nack - 1)
            raise OSError(errno.EREMOTEIO, os.strerror(errno.EREMOTEIO))

    def write_i2c_block_data(self, i2c_addr: int, register: int, data: list[int]) -> None:
        self._acked(i2c_addr)
        assert len(data) == 1, "an SHT31 command is two bytes"
        command = register << 8 | data[0]
        self.commands.append(command)
        self._result = None
        if command in DONE_AFTER:
            t, rh = self.results.pop(0) if len(self.results) > 1 else self.results[0]
            out = bytearray()
            for word in (t, rh):
                out += word.to_bytes(2, "big") + bytes([datasheet_crc(word.to_bytes(2, "big"))])
            for i in self.bad_crc.pop(0) if self.bad_crc else ():
                out[i] ^= 0x01
            self._result, self._done_at = bytes(out), time.monotonic() + DONE_AFTER[command]

    def i2c_rdwr(self, *msgs: Any) -> None:
        for msg in msgs:
            self._acked(msg.addr)
            assert msg.flags & I2C_M_RD and msg.len == 6
            if self._result is None or time.monotonic() < self._done_at:
                self.early_reads += 1
                raise OSError(errno.EREMOTEIO, os.strerror(errno.EREMOTEIO))  # still measuring
            ctypes.memmove(msg.buf, self._result, 6)
            self._result = None  # read once


def run_until(driver: SHT31, done: Callable[[ListSink], bool]) -> ListSink:
    async def main() -> ListSink:
        sink = ListSink()
        task = asyncio.create_task(driver.run(sink))
        try:
            await sink.wait_for(done, timeout=20)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return sink

    return asyncio.run(main())


def make(fake: FakeSHT31, **kw: Any) -> SHT31:
    return SHT31("climate", 1, open_bus=fake.open, **{"interval_s": 0.01, **kw})


def test_crc8_is_the_datasheets() -> None:
    assert crc8(b"\xbe\xef") == 0x92  # the datasheet's example
    for word in (b"\x00\x00", b"\xff\xff", b"\x66\x66", b"\x5e\x6b", b"\x80\x00"):
        assert crc8(word) == datasheet_crc(word)
        assert crc8(word + bytes([crc8(word)])) == 0  # no final XOR: the residue is zero


def test_conversions_are_the_datasheets_formulas() -> None:
    for raw in (0x0000, 0x0001, 0x6666, 0x8000, 0x9A3C, 0xFFFE, 0xFFFF):
        assert temperature_c(raw) == pytest.approx(celsius(raw), rel=1e-12)
        assert humidity_rh(raw) == pytest.approx(percent_rh(raw), rel=1e-12)
    assert (temperature_c(0xFFFF), humidity_rh(0xFFFF)) == (130.0, 100.0)


def test_readings_follow_the_datasheets_formulas() -> None:
    raws = [(0x0000, 0x0000), (0xFFFF, 0xFFFF), (0x6666, 0x8000), (0x5E6B, 0x9A3C)]
    fake = FakeSHT31(raws)
    sink = run_until(make(fake), lambda s: len(s.readings) >= 8)
    temps = sink.values("climate.temperature")[:4]
    hums = sink.values("climate.humidity")[:4]
    # Reported to 0.01 (below the sensor's best repeatability, 0.04 C and 0.08 %RH).
    near = {"abs": 0.005}
    assert temps == [-45.0, 130.0, 25.0, pytest.approx(celsius(0x5E6B), **near)]
    assert hums == [
        0.0,
        100.0,
        pytest.approx(50.0, **near),
        pytest.approx(percent_rh(0x9A3C), **near),
    ]
    assert {r.unit for r in sink.readings if r.sensor.endswith("temperature")} == {"C"}
    assert {r.unit for r in sink.readings if r.sensor.endswith("humidity")} == {"%RH"}
    # A soft reset when the bus is opened, then single shots, high repeatability.
    assert fake.commands[:3] == [SOFT_RESET, 0x2400, 0x2400]
    assert fake.early_reads == 0  # it waited for each measurement before reading
    assert sink.faults == []


@pytest.mark.parametrize("repeatability,command", [("medium", 0x240B), ("low", 0x2416)])
def test_repeatability_picks_the_command_and_its_wait(repeatability: str, command: int) -> None:
    fake = FakeSHT31([(0x6666, 0x8000)])
    sink = run_until(make(fake, repeatability=repeatability), lambda s: len(s.readings) >= 4)
    assert fake.commands[1:3] == [command, command]
    assert fake.early_reads == 0 and sink.faults == []


def test_a_bad_crc_is_a_fault_its_value_dropped_and_the_driver_goes_on() -> None:
    fake = FakeSHT31([(0x6666, 0x8000)])
    fake.bad_crc = [{2}, {5}, {2, 5}]  # T's CRC, then RH's, then both; then good ones
    driver = make(fake)
    sink = run_until(driver, lambda s: len(s.values("climate.temperature")) >= 3)
    assert sink.fault_kinds()[:4] == ["crc_error"] * 4
    assert driver.counters["crc_error"] == 4
    assert (
        "temperature: CRC" in sink.faults[0].detail and "/dev/i2c-1 0x44" in sink.faults[0].detail
    )
    # Shot 1 gave only RH, shot 2 only T, shot 3 nothing; shot 4 on, both.
    first = [r.sensor.split(".")[1] for r in sink.readings[:3]]
    assert first == ["humidity", "temperature", "temperature"]
    assert all(v == 25.0 for v in sink.values("climate.temperature"))
    assert len(fake.opens) == 1  # a CRC error is not a bus error: the bus stays open


def test_a_nack_closes_the_bus_and_reopens_it_with_backoff() -> None:
    fake = FakeSHT31([(0x6666, 0x8000)])
    driver = make(fake, reopen_base_s=0.04, reopen_cap_s=10.0)

    async def main() -> ListSink:
        sink = ListSink()
        task = asyncio.create_task(driver.run(sink))
        await sink.wait_for(lambda s: len(s.readings) >= 2)
        fake.nack = 3  # unplugged for three transfers: the shot, then two soft resets
        await sink.wait_for(lambda s: len(s.readings) >= 4, timeout=20)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return sink

    sink = asyncio.run(main())
    assert sink.fault_kinds() == ["bus_error"] * 3
    assert "Remote I/O error" in sink.faults[0].detail
    assert driver.counters["bus_error"] == 3 and driver.counters["reopened"] == 1
    assert len(fake.opens) == 4 and fake.closes >= 3  # (and once more on cancel)
    # Each reopen waited at least the lower half of its back-off: 0.02, 0.04, 0.08 s.
    gaps = [b - a for a, b in zip(fake.opens[1:], fake.opens[2:], strict=False)]
    assert gaps[0] >= 0.04 and gaps[1] >= 0.08


def test_a_bus_that_is_not_there_is_a_fault_and_is_tried_again() -> None:
    fake = FakeSHT31([(0x6666, 0x8000)])
    fake.missing = 2
    driver = make(fake, reopen_base_s=0.01)
    sink = run_until(driver, lambda s: len(s.readings) >= 2)
    assert sink.fault_kinds() == ["bus_error", "bus_error"]
    assert "No such file or directory" in sink.faults[0].detail
    assert driver.counters["reopened"] == 1


def test_through_smbus2_a_device_that_is_no_i2c_bus_is_a_fault(tmp_path: Path) -> None:
    """The real smbus2, built as the gateway builds it: a path that is no bus is an OSError
    from the OS (the i2c-dev ioctl on a plain file), reported, and the driver goes on."""
    plain = tmp_path / "i2c-7"
    plain.write_bytes(b"")
    driver = registry.build("sht31", "climate", {"bus": str(plain), "interval_s": 0.01})
    assert isinstance(driver, SHT31)
    driver.reopen_base_s, driver.reopen_cap_s = 0.001, 0.002
    fds = len(os.listdir("/proc/self/fd"))
    sink = run_until(driver, lambda s: len(s.faults) >= 20)
    assert set(sink.fault_kinds()) == {"bus_error"}
    assert "Inappropriate ioctl for device" in sink.faults[0].detail
    assert str(plain) in sink.faults[0].detail
    assert len(os.listdir("/proc/self/fd")) == fds  # each failed open closed its descriptor


def test_options_as_the_fleet_file_gives_them() -> None:
    kind = registry.get("sht31")
    cfg = kind.parse({"id": "c", "type": "sht31", "address": "0x45", "bus": "/dev/i2c-3"})
    assert (cfg.address, cfg.bus, cfg.repeatability, cfg.interval_s) == (
        0x45,
        "/dev/i2c-3",
        "high",
        30,
    )
    with pytest.raises(SensorConfigError, match="address: Value error, expected 0x44"):
        kind.parse({"id": "c", "type": "sht31", "address": 0x40})
    with pytest.raises(SensorConfigError, match="repeatability"):
        kind.parse({"id": "c", "type": "sht31", "repeatability": "best"})


# What the registry gives a new type with nothing else edited: the fleet file's checks,
# the example, `pubcomp sensor test`, the gateway's wiring.

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "fleet.yaml"
FLEET = """\
fleet: test
defaults:
  uplink: {broker: "mqtt://cloud:1883"}
gateways:
  gw1:
    sensors:
      - {id: c, type: sht31, adress: 0x45}
      - {id: d, type: sht31,
         address: 0x40}
"""


def test_the_fleet_file_checks_its_options_with_file_line_and_key(tmp_path: Path) -> None:
    p = tmp_path / "fleet.yaml"
    p.write_text(FLEET)
    with pytest.raises(ConfigError) as err:
        Fleet(p).gateway("gw1")
    assert err.value.problems == [
        f"{p}:7: gateways.gw1.sensors[0].adress: unknown key (did you mean 'address'?)",
        f"{p}:9: gateways.gw1.sensors[1].address: Value error, expected 0x44 (ADDR to GND) "
        "or 0x45 (ADDR to VDD)",
    ]


def test_the_example_fleets_commented_entry_is_valid(tmp_path: Path) -> None:
    """examples/fleet.yaml shows it commented out; uncommented, it is valid, builds, and
    the example then covers every registered sensor type."""
    text = EXAMPLE.read_text()
    line = next(ln for ln in text.splitlines() if "type: sht31" in ln)
    shutil.copytree(EXAMPLE.parent / "secrets", tmp_path / "secrets")
    (tmp_path / "fleet.yaml").write_text(text.replace(line, line.replace("# - ", "- ", 1)))
    fleet = Fleet(tmp_path / "fleet.yaml")
    assert fleet.check() == []
    (entry,) = [s for s in fleet.gateway("gw-coast-7").sensors if s.type == "sht31"]
    assert isinstance(registry.build_from(entry), SHT31)
    types = {s.type for g in fleet.gateway_ids() for s in fleet.gateway(g).sensors}
    assert sorted(types) == sorted(registry.names())


def test_pubcomp_sensor_test_offers_it_and_opens_its_bus_first() -> None:
    def pubcomp(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pubcomp", "sensor", "test", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    res = pubcomp("--help")
    (row,) = [ln for ln in res.stdout.splitlines() if ln.split()[:1] == ["sht31"]]
    assert "--bus" in row and registry.get("sht31").summary in row
    res = pubcomp("--type", "sht31", "--bus", "99", "--address", "0x40")
    assert res.returncode == 1
    assert "address: Value error, expected 0x44 (ADDR to GND) or 0x45" in res.stderr
    res = pubcomp("--type", "sht31", "--bus", "99", "--address", "0x45")
    assert res.returncode == 1 and "No such file or directory: '/dev/i2c-99'" in res.stderr


def test_on_a_gateway_a_missing_bus_is_faults_not_a_crash(tmp_path: Path) -> None:
    """The gateway's wiring knows it only through the registry (Need.I2C): on a bus that
    is not there the driver reports bus_error and keeps trying, the supervisor never
    restarts it, and the sensor beside it goes on."""
    cfg = GatewayConfig.model_validate(
        {
            "id": "g",
            "fleet": "f",
            "uplink": {"broker": "mqtt://h:1"},
            "sensors": [
                {"id": "cabinet", "type": "sht31", "bus": str(tmp_path / "i2c-9")},
                {"id": "good", "type": "simulated", "interval_s": 0.05},
            ],
        }
    )

    async def main(drivers: Drivers, intake: Intake) -> None:
        committing = asyncio.create_task(intake.run())
        tasks = drivers.tasks()
        async with asyncio.timeout(30):
            while drivers.status["cabinet"].faults["bus_error"] < 2:
                await asyncio.sleep(0.05)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        intake.close()
        await committing

    with Store(tmp_path / "s.db", gateway_id="g") as store:
        intake = Intake(store)
        d = Drivers(list(cfg.sensors), SimulatedFactory, intake, ClockWatch(), lambda c: None)
        asyncio.run(main(d, intake))
    cabinet, good = d.status["cabinet"], d.status["good"]
    assert cabinet.restarts == 0 and cabinet.last_error is None and cabinet.readings == 0
    assert good.readings > 0 and good.restarts == 0
