"""Sensirion SHT31 (SHT3x-DIS) temperature and relative humidity on I2C, through smbus2.

The few commands it takes, from Sensirion's SHT3x-DIS datasheet (section 4):

- address 0x44 (ADDR pin to GND) or 0x45 (ADDR to VDD);
- soft reset 0x30A2, ready again within 1.5 ms: sent at each (re)open, so a sensor that
  another program left in periodic mode (where it ignores single shots) starts afresh;
- a single shot with clock stretching disabled: 0x2400 (high repeatability, done within
  15.5 ms), 0x240B (medium, 6.5 ms), 0x2416 (low, 4.5 ms); the driver waits 16, 7 or 5 ms;
- the result, read with no register address first: 6 bytes, T msb lsb CRC, RH msb lsb
  CRC; CRC-8 with polynomial 0x31 and initial value 0xFF (CRC(0xBEEF) = 0x92);
- T = -45 + 175 * S_T / (2**16 - 1) °C and RH = 100 * S_RH / (2**16 - 1) %RH.

Why no clock stretching: the Raspberry Pi's I2C controller mishandles a device that
stretches the clock (a long-known erratum of the BCM2835's), and the kernel reports a
timeout. Without it the sensor NACKs the read header until its measurement is done, so
the driver waits the longest measurement time before it reads.

Why not a library for the sensor: Sensirion's own Python driver (sensirion-i2c-sht3x)
brings its own transceiver stack instead of smbus2 and pins old versions of its support
packages; Adafruit's needs Blinka. The protocol above is 40 lines.

Faults: ``crc_error`` (that value is dropped; the other is reported if its own CRC
holds) and ``bus_error`` (an OSError: no /dev/i2c-N, no permission, a NACK from a sensor
unplugged or at the other address). After a ``bus_error`` the bus is closed and reopened
with back-off (backoff.py; ``reopened`` counts the recoveries). Bus I/O runs in a worker
thread; smbus2 is imported when the driver is made, never when the type is declared.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, Protocol

from pydantic import Field, field_validator

from .api import Driver, SensorReading, Sink
from .backoff import reopen_delay
from .errors import ReadError, SensorConfigError
from .registry import Need, Provided, SensorOptions, SensorType

ADDRESSES = (0x44, 0x45)
SOFT_RESET = 0x30A2
RESET_S = 0.002
# repeatability -> (single shot command, clock stretching disabled; seconds to wait)
SINGLE_SHOT = {"high": (0x2400, 0.016), "medium": (0x240B, 0.007), "low": (0x2416, 0.005)}
RESULT_LEN = 6


class I2CBus(Protocol):
    """What the driver uses of ``smbus2.SMBus`` (tests give it a fake sensor behind these)."""

    def write_i2c_block_data(self, i2c_addr: int, register: int, data: Sequence[int]) -> None:
        """START, address + write, ``register``, ``data``, STOP: a 16-bit command here."""

    def i2c_rdwr(self, *i2c_msgs: Any) -> None:
        """The messages (``smbus2.i2c_msg``) as one transaction; a read fills its buffer."""

    def close(self) -> None: ...


def crc8(data: bytes) -> int:
    """The datasheet's CRC-8: polynomial 0x31, initial 0xFF, no reflection, no final XOR."""
    crc = 0xFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = ((crc << 1) ^ 0x31) & 0xFF if crc & 0x80 else (crc << 1) & 0xFF
    return crc


def temperature_c(raw: int) -> float:
    return -45 + 175 * raw / 65535


def humidity_rh(raw: int) -> float:
    return 100 * raw / 65535


def checked_word(data: bytes, offset: int) -> int:
    """The 16-bit word at ``offset``, if the CRC byte after it matches; else ReadError."""
    word, crc = data[offset : offset + 2], data[offset + 2]
    if crc8(word) != crc:
        raise ReadError("crc_error", f"CRC {crc:#04x} for {word.hex()}, expected {crc8(word):#04x}")
    return int.from_bytes(word, "big")


CHANNELS: tuple[tuple[str, int, Callable[[int], float], str], ...] = (
    ("temperature", 0, temperature_c, "C"),
    ("humidity", 3, humidity_rh, "%RH"),
)


def _smbus2() -> Any:
    try:
        import smbus2
    except ImportError as exc:
        raise SensorConfigError(f"the sht31 driver needs smbus2 (pubcomp[pi]): {exc}") from exc
    return smbus2


def _opener(smbus2: Any) -> Callable[[int | str], I2CBus]:
    def open_bus(bus: int | str) -> I2CBus:
        dev = smbus2.SMBus()
        try:
            dev.open(bus)
        except BaseException:
            # SMBus.open keeps the descriptor when its first ioctl fails (a path that is no
            # I2C bus): retried with back-off, that would leak one each time.
            dev.close()
            raise
        return dev

    return open_bus


class SHT31(Driver):
    """Two channels, ``{id}.temperature`` (C) and ``{id}.humidity`` (%RH), every ``interval_s``."""

    def __init__(
        self,
        sensor: str,
        bus: int | str = 1,
        *,
        address: int = 0x44,
        repeatability: str = "high",
        interval_s: float = 30.0,
        open_bus: Callable[[int | str], I2CBus] | None = None,
        reopen_base_s: float = 0.5,
        reopen_cap_s: float = 60.0,
    ) -> None:
        super().__init__(sensor)
        if address not in ADDRESSES:
            raise SensorConfigError(f"sensor {sensor}: an SHT31 answers at 0x44 or 0x45")
        if repeatability not in SINGLE_SHOT:
            raise SensorConfigError(f"repeatability must be one of {tuple(SINGLE_SHOT)}")
        smbus2 = _smbus2()
        self.bus, self.address = bus, address
        self.where = f"{f'/dev/i2c-{bus}' if isinstance(bus, int) else bus} {address:#04x}"
        self.command, self.wait_s = SINGLE_SHOT[repeatability]
        self.interval_s = interval_s
        self.reopen_base_s, self.reopen_cap_s = reopen_base_s, reopen_cap_s
        self._open = open_bus or _opener(smbus2)
        self._read = smbus2.i2c_msg.read
        self._bus: I2CBus | None = None
        # The worker thread and close() (on cancel) never use the file descriptor at once.
        self._lock = threading.Lock()

    def _send(self, bus: I2CBus, command: int) -> None:
        bus.write_i2c_block_data(self.address, command >> 8, [command & 0xFF])

    def measure(self) -> bytes:
        """One single shot: the 6 raw bytes. Blocking (a worker thread); OSError from the bus."""
        with self._lock:
            bus = self._bus
            if bus is None:
                bus = self._bus = self._open(self.bus)
                self._send(bus, SOFT_RESET)
                time.sleep(RESET_S)
            self._send(bus, self.command)
            time.sleep(self.wait_s)
            msg = self._read(self.address, RESULT_LEN)
            bus.i2c_rdwr(msg)
            return bytes(msg)

    def report(self, sink: Sink, data: bytes, mono: float) -> None:
        for channel, offset, convert, unit in CHANNELS:
            try:
                raw = checked_word(data, offset)
            except ReadError as exc:
                self.report_fault(sink, exc.kind, f"{self.where}: {channel}: {exc}")
                continue
            self.counters["readings"] += 1
            value = round(convert(raw), 2)
            sink.reading(SensorReading(f"{self.sensor}.{channel}", value, unit, mono=mono))

    def close(self) -> None:
        with self._lock:
            bus, self._bus = self._bus, None
            if bus is not None:
                with contextlib.suppress(OSError):  # it is dropped because it failed
                    bus.close()

    async def run(self, sink: Sink) -> None:
        attempt = 0
        try:
            while True:
                started = time.monotonic()
                try:
                    data = await asyncio.to_thread(self.measure)
                except OSError as exc:
                    self.report_fault(sink, "bus_error", f"{self.where}: {exc}")
                    self.close()
                    await asyncio.sleep(
                        reopen_delay(attempt, self.reopen_base_s, self.reopen_cap_s)
                    )
                    attempt += 1
                    continue
                if attempt:
                    self.counters["reopened"] += 1
                    attempt = 0
                self.report(sink, data, time.monotonic())
                await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))
        finally:
            self.close()


class SHT31Options(SensorOptions):
    type: Literal["sht31"]
    # /dev/i2c-1 is the one on the header's pins 3 (SDA) and 5 (SCL); or a device path.
    bus: Annotated[int, Field(ge=0)] | Annotated[str, Field(pattern=r"^/")] = 1
    address: int = 0x44
    repeatability: Literal["high", "medium", "low"] = "high"
    interval_s: Annotated[float, Field(gt=0)] = 30.0

    @field_validator("address", mode="before")
    @classmethod
    def _address(cls, v: Any) -> Any:
        if isinstance(v, str):  # "0x45" from the command line
            with contextlib.suppress(ValueError):
                v = int(v, 0)
        if v not in ADDRESSES:
            raise ValueError("expected 0x44 (ADDR to GND) or 0x45 (ADDR to VDD)")
        return v


def build(cfg: SHT31Options, provided: Provided) -> SHT31:
    return SHT31(
        cfg.id,
        cfg.bus,
        address=cfg.address,
        repeatability=cfg.repeatability,
        interval_s=cfg.interval_s,
    )


SENSOR = SensorType(
    "sht31",
    SHT31Options,
    build,
    needs={Need.I2C},
    summary="Sensirion SHT31 temperature and humidity on I2C (smbus2)",
)
