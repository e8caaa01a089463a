"""Modbus RTU register reader for energy meters and PLCs, through pymodbus.

Config: ``port`` (anything ``serial_for_url`` opens: ``/dev/ttyUSB0``,
``socket://host:502`` for RTU over TCP), ``baud``, ``unit_id`` and a register
map, each entry ``{name, address, kind: holding|input, type: uint16|int16|
uint32|int32|float32, scale, unit, word_order: big|little}``. A timeout or a
Modbus exception is reported as a fault; the port is reopened with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .api import Driver, SensorReading, Sink
from .backoff import reopen_delay
from .errors import SensorConfigError
from .registry import Need, Provided, SensorOptions, SensorType

TYPES = ("uint16", "int16", "uint32", "int32", "float32")


VALUE_KINDS = ("gauge", "counter", "total")


@dataclass(frozen=True)
class Register:
    name: str
    address: int
    kind: str = "holding"
    type: str = "uint16"
    scale: float = 1.0
    unit: str | None = None
    word_order: str = "big"
    # What the number is (sync.wire's kinds): an energy meter's kWh register is a
    # running total, to be charted by its last value, not averaged. (``kind`` above
    # is Modbus's own word, for the register table.)
    value_kind: str = "gauge"

    def __post_init__(self) -> None:
        if self.kind not in ("holding", "input"):
            raise SensorConfigError(f"register {self.name}: kind must be holding or input")
        if self.value_kind not in VALUE_KINDS:
            raise SensorConfigError(
                f"register {self.name}: value_kind must be one of {VALUE_KINDS}"
            )
        if self.type not in TYPES:
            raise SensorConfigError(f"register {self.name}: type must be one of {TYPES}")
        if self.word_order not in ("big", "little"):
            raise SensorConfigError(f"register {self.name}: word_order must be big or little")

    @property
    def count(self) -> int:
        return 1 if self.type in ("uint16", "int16") else 2


class ModbusReader(Driver):
    def __init__(
        self,
        sensor: str,
        *,
        port: str,
        registers: list[dict[str, Any]],
        baud: int = 9600,
        unit_id: int = 1,
        interval_s: float = 10.0,
        timeout_s: float = 1.0,
    ) -> None:
        super().__init__(sensor)
        if not registers:
            raise SensorConfigError(f"sensor {sensor}: a modbus reader needs at least one register")
        self.port, self.baud, self.unit_id = port, baud, unit_id
        self.registers = [Register(**r) for r in registers]
        self.interval_s, self.timeout_s = interval_s, timeout_s

    def _client(self) -> Any:
        from pymodbus.client import AsyncModbusSerialClient

        return AsyncModbusSerialClient(
            port=self.port,
            baudrate=self.baud,
            timeout=self.timeout_s,
            retries=0,
            reconnect_delay=0,
        )

    async def run(self, sink: Sink) -> None:
        from pymodbus.exceptions import ModbusException

        client = self._client()
        attempt = 0
        try:
            while True:
                if not client.connected and not await client.connect():
                    self.report_fault(sink, "port_error", f"{self.port}: cannot open")
                    await asyncio.sleep(reopen_delay(attempt, 0.2, 10.0))
                    attempt += 1
                    continue
                attempt = 0
                try:
                    await self.poll(client, sink)
                except (ModbusException, OSError) as exc:
                    self.report_fault(sink, "timeout", f"{self.port}: {exc}")
                    client.close()
                await asyncio.sleep(self.interval_s)
        finally:
            with contextlib.suppress(Exception):
                client.close()

    async def poll(self, client: Any, sink: Sink) -> None:
        for reg in self.registers:
            read = (
                client.read_holding_registers
                if reg.kind == "holding"
                else client.read_input_registers
            )
            rr = await read(reg.address, count=reg.count, device_id=self.unit_id)
            if rr.isError():
                self.report_fault(
                    sink, "modbus_error", f"{reg.name} @ {reg.address}: exception {rr}"
                )
                continue
            raw = client.convert_from_registers(
                rr.registers, client.DATATYPE[reg.type.upper()], word_order=reg.word_order
            )
            self.counters["readings"] += 1
            value = round(float(raw) * reg.scale, 6)
            sink.reading(
                SensorReading(f"{self.sensor}.{reg.name}", value, reg.unit, kind=reg.value_kind)
            )


class RegisterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    address: Annotated[int, Field(ge=0, le=65535)]
    kind: Literal["holding", "input"] = "holding"
    type: Literal["uint16", "int16", "uint32", "int32", "float32"] = "uint16"
    scale: float = 1.0
    unit: str | None = None
    word_order: Literal["big", "little"] = "big"
    value_kind: Literal["gauge", "counter", "total"] = "gauge"


class ModbusOptions(SensorOptions):
    type: Literal["modbus"]
    port: str
    baud: int = 9600
    unit_id: Annotated[int, Field(ge=0, le=247)] = 1
    interval_s: Annotated[float, Field(gt=0)] = 10.0
    timeout_s: Annotated[float, Field(gt=0)] = 1.0
    registers: Annotated[list[RegisterConfig], Field(min_length=1)]


def build(cfg: ModbusOptions, provided: Provided) -> ModbusReader:
    return ModbusReader(
        cfg.id,
        port=cfg.port,
        registers=[r.model_dump() for r in cfg.registers],
        baud=cfg.baud,
        unit_id=cfg.unit_id,
        interval_s=cfg.interval_s,
        timeout_s=cfg.timeout_s,
    )


SENSOR = SensorType(
    "modbus",
    ModbusOptions,
    build,
    needs={Need.SERIAL},
    summary="Modbus RTU registers (pymodbus): energy meters, PLCs",
)
