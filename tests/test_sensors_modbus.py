"""Modbus RTU through pymodbus's own server (RTU framing over TCP, reached as socket://)."""

from __future__ import annotations

import asyncio
import struct

from pymodbus.datastore import ModbusDeviceContext, ModbusSequentialDataBlock, ModbusServerContext
from pymodbus.framer import FramerType
from pymodbus.server import ModbusTcpServer

from devkit.broker import free_port
from pubcomp.sensors.modbus import ModbusReader
from tests.sensor_helpers import ListSink

REGISTERS = [
    {"name": "voltage", "address": 0, "type": "uint16", "scale": 0.1, "unit": "V"},
    {"name": "power", "address": 1, "type": "int16", "unit": "W"},
    {"name": "energy", "address": 2, "type": "uint32", "scale": 0.01, "unit": "kWh"},
    {"name": "freq", "address": 4, "kind": "input", "type": "float32", "unit": "Hz"},
]
REGISTERS[2]["value_kind"] = "total"  # a meter's running total


def registers() -> list[int]:
    hi, lo = struct.unpack(">HH", struct.pack(">f", 49.98))
    return [2301, 0xFFF6, 0x0001, 0x86A0, hi, lo] + [0] * 10  # 230.1 V, -10 W, 1000 kWh


_tasks: list[asyncio.Task[None]] = []


async def serve(port: int) -> ModbusTcpServer:
    store = ModbusDeviceContext(
        hr=ModbusSequentialDataBlock(1, registers()), ir=ModbusSequentialDataBlock(1, registers())
    )
    context = ModbusServerContext(devices={7: store}, single=False)
    server = ModbusTcpServer(context, framer=FramerType.RTU, address=("127.0.0.1", port))
    _tasks.append(asyncio.create_task(server.serve_forever()))
    async with asyncio.timeout(30):
        while True:  # until it listens
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.02)
                continue
            writer.close()
            await writer.wait_closed()
            return server


def test_modbus_register_map_scaled() -> None:
    async def main() -> ListSink:
        port = free_port()
        server = await serve(port)
        reader = ModbusReader(
            "meter",
            port=f"socket://127.0.0.1:{port}",
            unit_id=7,
            registers=REGISTERS,
            interval_s=0.05,
        )
        sink = ListSink()
        task = asyncio.create_task(reader.run(sink))
        await sink.wait_for(lambda s: len(s.readings) >= 4, timeout=10)
        task.cancel()
        await server.shutdown()
        return sink

    sink = asyncio.run(main())
    got = {r.sensor: (r.value, r.unit) for r in sink.readings[:4]}
    assert got["meter.voltage"] == (230.1, "V")
    assert got["meter.power"] == (-10.0, "W")
    assert got["meter.energy"] == (1000.0, "kWh")
    assert got["meter.freq"][0] == round(struct.unpack(">f", struct.pack(">f", 49.98))[0], 6)
    kinds = {r.sensor: r.kind for r in sink.readings[:4]}
    assert kinds == {
        "meter.voltage": "gauge",
        "meter.power": "gauge",
        "meter.energy": "total",  # a meter's running total, declared in the register map
        "meter.freq": "gauge",
    }


def test_modbus_exception_and_lost_device_are_faults() -> None:
    async def main() -> ListSink:
        port = free_port()
        server = await serve(port)
        bad = [*REGISTERS[:1], {"name": "nowhere", "address": 9000, "type": "uint16"}]
        reader = ModbusReader(
            "meter",
            port=f"socket://127.0.0.1:{port}",
            unit_id=7,
            registers=bad,
            interval_s=0.05,
            timeout_s=0.3,
        )
        sink = ListSink()
        task = asyncio.create_task(reader.run(sink))
        await sink.wait_for(lambda s: "modbus_error" in s.fault_kinds(), timeout=10)
        await server.shutdown()  # the meter goes away
        await sink.wait_for(lambda s: {"timeout", "port_error"} & set(s.fault_kinds()), timeout=15)
        task.cancel()
        return sink

    sink = asyncio.run(main())
    assert sink.values("meter.voltage")[0] == 230.1  # good registers still read
