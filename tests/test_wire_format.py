"""The gateway-to-cloud payloads the uplink really sends match the shipped JSON Schema,
and a DUP resend is byte-for-byte the first PUBLISH."""

from __future__ import annotations

import asyncio
import json
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from pubcomp.sync.client import ConnectOptions
from pubcomp.sync.commands import normalise_ts
from pubcomp.sync.packets import MQTT_5, Publish, Pubrec
from pubcomp.sync.store import Reading, Store
from pubcomp.sync.uplink import Uplink, UplinkConfig
from tests.test_uplink_bad_peers import FakeBroker


def schema(name: str) -> dict[str, Any]:
    text = resources.files("pubcomp.sync").joinpath(f"schemas/{name}").read_text()
    return json.loads(text)


def test_schemas_are_valid_json_schema() -> None:
    for name in ("cloud-readings.v1.json", "node-readings.v1.json"):
        jsonschema.Draft202012Validator.check_schema(schema(name))


def test_uplink_payloads_validate_and_dup_resend_is_byte_identical(tmp_path: Path) -> None:
    seen: list[int] = []

    def script(pub: Publish, n: int) -> list[Any]:
        seen.append(n)
        if n == 2:
            return [b"\x00\x00"]  # reserved packet type: the uplink drops the connection
        return [Pubrec(pub.packet_id)]  # type: ignore[arg-type]

    broker = FakeBroker(script)
    store_path = tmp_path / "gw.db"
    with Store(store_path, gateway_id="gw-7") as s:
        s.append(
            [
                Reading("rain", 0.2, "2026-11-21T12:00:05.000Z", "mm"),
                Reading(
                    "t",
                    None,
                    None,
                    None,
                    origin="node-7",
                    flags=["clock_unsynced"],
                    id="node-7/42/1187.0",
                ),
                *[
                    Reading("é-sensor", float(i), "2026-11-21T12:00:06.000Z", "°C")
                    for i in range(30)
                ],
            ]
        )

    async def main() -> None:
        port = await broker.start()
        with Store(store_path) as store:
            up = Uplink(
                store,
                f"mqtt://127.0.0.1:{port}",
                ConnectOptions("gw-7", MQTT_5),
                UplinkConfig(batch=8),
            )
            await asyncio.wait_for(up.run(exit_when_drained=True), 30)
        broker.server.close()

    asyncio.run(main())
    pubs = [p for p in broker.seen if isinstance(p, Publish)]
    validator = jsonschema.Draft202012Validator(schema("cloud-readings.v1.json"))
    for p in pubs:
        validator.validate(json.loads(p.payload))
        assert p.topic == "telemetry/gw-7/readings"
    dups = [p for p in pubs if p.dup]
    assert dups, "the scripted disconnect should have caused a DUP resend"
    for d in dups:
        original = next(p for p in pubs if p.packet_id == d.packet_id and not p.dup)
        assert d.payload == original.payload  # MQTT-4.3.3-1 same message, same id
    ids = [r["id"] for p in pubs if not p.dup for r in json.loads(p.payload)["readings"]]
    assert "node-7/42/1187.0" in ids and len(ids) == len(set(ids)) == 32


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("2026-11-21T12:00:05Z", "2026-11-21T12:00:05.000Z"),
        ("2026-11-21T13:00:05.1234+01:00", "2026-11-21T12:00:05.123Z"),
        ("2026-11-21 12:00:05.5+00:00", "2026-11-21T12:00:05.500Z"),
    ],
)
def test_import_timestamps_are_normalised_to_utc_milliseconds(given: str, expected: str) -> None:
    assert normalise_ts(given) == expected


def test_import_timestamps_need_a_zone() -> None:
    with pytest.raises(ValueError, match="no time zone"):
        normalise_ts("2026-11-21T12:00:05")
