"""Reading the wire format (docs/wire-format.md): strict JSON and the shipped JSON Schemas.

Both receivers, the gateway's node ingress and the cloud ingest, parse
payloads the same way: ``json.loads`` would accept NaN and Infinity, which
are not JSON, so they are refused here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from importlib import resources
from typing import Annotated, Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, ValidationError

NODE_SCHEMA = "node-readings.v1.json"
CLOUD_SCHEMA = "cloud-readings.v1.json"


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(payload: bytes | str) -> Any:
    """``json.loads`` without NaN / Infinity; raises ValueError (or UnicodeDecodeError)."""
    return json.loads(payload, parse_constant=_no_constants)


def validator(schema: str) -> jsonschema.protocols.Validator:
    """A validator for one of the schemas in ``sync/schemas/``."""
    text = resources.files("pubcomp.sync").joinpath(f"schemas/{schema}").read_text()
    return jsonschema.Draft202012Validator(json.loads(text))


# The node message (node-readings.v1.json) as a pydantic model: the ingress checks every
# message on its event loop, and pydantic parses and validates JSON in compiled code (a
# 100-reading message took 8.5 ms through jsonschema, the whole loop's budget at 100
# messages a second). tests/test_wire_format.py holds it to the shipped JSON Schema.
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)
# Bounds (issue 25): what the store and Python's datetime can hold. A year 0001-9999, a
# month 01-12, a day 01-31, 00:00:00-23:59:59 (no leap second: datetime has none). The
# calendar (30 February) is beyond a pattern: the ingress refuses it as invalid_time.
_YEAR = "([0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"
_TS = (
    rf"^{_YEAR}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    r"T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,6})?Z$"
)
# boot and seq: 2**53 - 1, the largest integer every JSON reader holds exactly (and well
# inside SQLite's int64, which 2**64 overflowed). dt: a hundred years.
MAX_COUNTER = 2**53 - 1
MAX_DT_S = 3_155_760_000


# What a value is (docs/wire-format.md): a level, a count per interval, a running total.
Kind = Literal["gauge", "counter", "total"]
GAUGE: Kind = "gauge"
KINDS: tuple[Kind, ...] = ("gauge", "counter", "total")


class NodeReading(BaseModel):
    model_config = _STRICT
    sensor: Annotated[str, Field(min_length=1, max_length=64)]
    value: float | None
    unit: Annotated[str, Field(max_length=16)] | None
    dt: Annotated[float, Field(ge=0, le=MAX_DT_S)] = 0.0
    kind: Kind = GAUGE


class NodeMessage(BaseModel):
    model_config = _STRICT
    v: Annotated[int, Field(ge=1, le=1)]  # Literal[1] would take true (True == 1)
    node: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    boot: Annotated[int, Field(ge=0, le=MAX_COUNTER)]
    seq: Annotated[int, Field(ge=0, le=MAX_COUNTER)]
    ts: Annotated[str, Field(pattern=_TS)] | None
    readings: Annotated[list[NodeReading], Field(min_length=1, max_length=500)]


def parse_node_message(payload: bytes) -> NodeMessage | str:
    """The message, or why it was refused: ``invalid_json`` or ``invalid_schema``."""
    try:
        return NodeMessage.model_validate_json(payload)
    except ValidationError as exc:
        kinds = {e["type"] for e in exc.errors()}
        # NaN and Infinity parse, then fail as numbers: they are not JSON all the same.
        not_json = {"json_invalid", "json_type", "finite_number"}
        return "invalid_json" if kinds & not_json else "invalid_schema"


# One encoder for all: json.dumps with options builds a new one on every call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def encode_readings(readings: Sequence[dict[str, Any]]) -> bytes:
    """Readings in the cloud wire format, comma separated (the inside of ``readings: [...]``).

    Deterministic: the same readings always give the same bytes, which is what lets
    a DUP resend rebuilt from the store be byte-identical to the first PUBLISH.
    Raises ValueError on NaN or Infinity (not JSON).
    """
    return _ENCODER.encode(readings)[1:-1].encode()


def encode_payload(gateway: str, bodies: Sequence[bytes]) -> bytes:
    """The gateway-to-cloud wire format, version 1 (docs/wire-format.md), from readings
    already encoded (``encode_readings``)."""
    return b"".join((payload_head(gateway), b",".join(bodies), b"]}"))


def payload_head(gateway: str) -> bytes:
    return (
        b'{"v":1,"gateway":' + json.dumps(gateway, ensure_ascii=False).encode() + b',"readings":['
    )


def wire_time(t: datetime | float | None = None) -> str:
    """A time as the wire format writes it (UTC, milliseconds, ``Z``): now when ``t`` is
    None, a Unix time when it is a number, else an aware datetime."""
    if t is None:
        t = datetime.now(UTC)
    elif isinstance(t, int | float):
        t = datetime.fromtimestamp(t, UTC)
    return t.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
