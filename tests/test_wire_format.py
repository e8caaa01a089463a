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

from devkit.store_helpers import append
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
        append(
            s,
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
            ],
        )
        for start in range(0, 30, 6):  # rows of 6: messages of whole rows, several of them
            append(
                s,
                (
                    Reading("é-sensor", float(i), "2026-11-21T12:00:06.000Z", "°C")
                    for i in range(start, start + 6)
                ),
            )

    async def main() -> None:
        port = await broker.start()
        with Store(store_path) as store:
            up = Uplink(
                store,
                f"mqtt://127.0.0.1:{port}",
                ConnectOptions("gw-7", MQTT_5),
                UplinkConfig(batch=8, end_to_end=False),
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


# The ingress checks node messages with a pydantic model (compiled, fast); the shipped JSON
# Schema is the contract. Both must take and refuse the same payloads.
_VALID: dict[str, Any] = {
    "v": 1,
    "node": "node-7",
    "boot": 3,
    "seq": 41,
    "ts": "2026-11-23T10:00:00.123Z",
    "readings": [
        {"sensor": "t", "value": 21.5, "unit": "C"},
        {"sensor": "rh", "value": None, "unit": None, "dt": 2},
    ],
}
_FIELD_VALUES: dict[str, list[Any]] = {
    "v": [1, 2, "1", True, None],
    "node": ["n", "", "a/b", "x" * 64, "x" * 65, 5],
    "boot": [0, -1, 1.5, True, "1", 2**40, 2**53 - 1, 2**53, 2**64],
    "seq": [0, -3, 7, None, 2**53 - 1, 2**53],
    "ts": [
        None,
        "2026-11-23T10:00:00Z",
        "2026-11-23T10:00:00.123456Z",
        "2026-11-23",
        0,
        "2026-13-01T00:00:00Z",
        "0000-01-01T00:00:00Z",
        "0001-01-01T00:00:00Z",
        "9999-12-31T23:59:59.999Z",
        "2026-00-10T00:00:00Z",
        "2026-01-32T00:00:00Z",
        "2026-01-31T24:00:00Z",
        "2026-01-31T23:60:00Z",
        "2026-01-31T23:59:60Z",
        "1000-01-01T00:00:00Z",
        "2010-01-01T00:00:00Z",
    ],
    "readings": [[], [{"sensor": "a", "value": 1, "unit": "u"}] * 501, "x"],
}
_READING_VALUES: dict[str, list[Any]] = {
    "sensor": ["", "s" * 64, "s" * 65, 3, None, "$ledger", "a$"],
    "value": [0, -1e300, 1.5, True, "2", None],
    "unit": [None, "", "u" * 16, "u" * 17, 1],
    "dt": [0, 1.5, -1, "1", None, 1e12, 3_155_760_000, 3_155_760_001],
    "extra": ["not allowed"],
}


def _cases() -> list[dict[str, Any]]:
    out = [dict(_VALID), {k: v for k, v in _VALID.items() if k != "ts"}, {**_VALID, "x": 1}]
    for key, values in _FIELD_VALUES.items():
        out += [{**_VALID, key: v} for v in values]
    for key, values in _READING_VALUES.items():
        out += [{**_VALID, "readings": [{**_VALID["readings"][0], key: v}]} for v in values]
    out.append({**_VALID, "readings": [{"sensor": "t", "value": 1}]})  # no unit
    return out


@pytest.mark.parametrize("msg", _cases(), ids=lambda m: json.dumps(m)[:60])
def test_the_ingress_model_takes_what_the_node_schema_takes(msg: dict[str, Any]) -> None:
    from pubcomp.sync import wire

    by_schema = jsonschema.Draft202012Validator(schema("node-readings.v1.json")).is_valid(msg)
    by_model = not isinstance(wire.parse_node_message(json.dumps(msg).encode()), str)
    assert by_model == by_schema


def test_the_ingress_model_refuses_nan_as_not_json() -> None:
    from pubcomp.sync import wire

    body = json.dumps(_VALID).replace("21.5", "NaN").encode()
    assert wire.parse_node_message(body) == "invalid_json"
    assert wire.parse_node_message(b"{not json") == "invalid_json"
