"""Reading the wire format (docs/wire-format.md): strict JSON and the shipped JSON Schemas.

Both receivers, the gateway's node ingress and the cloud ingest, parse
payloads the same way: ``json.loads`` would accept NaN and Infinity, which
are not JSON, so they are refused here.
"""

from __future__ import annotations

import hashlib
import hmac
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
    # A name starting with "$" is the gateway's: its records ($ledger, ...) travel as
    # readings, and a node must not be able to write one.
    sensor: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[^$]")]
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


def encode_payload(
    gateway: str, bodies: Sequence[bytes], outbox: tuple[str, int, int] | None = None
) -> bytes:
    """The gateway-to-cloud wire format, version 1 (docs/wire-format.md), from readings
    already encoded (``encode_readings``). ``outbox``: (epoch, first seq, last seq) of
    the gateway's store that the message carries, for the end-to-end acknowledgement."""
    return b"".join((payload_head(gateway, outbox), b",".join(bodies), b"]}"))


def payload_head(gateway: str, outbox: tuple[str, int, int] | None = None) -> bytes:
    name = json.dumps(gateway, ensure_ascii=False).encode()
    if outbox is None:
        return b'{"v":1,"gateway":' + name + b',"readings":['
    epoch, first, last = outbox
    span = _ENCODER.encode({"epoch": epoch, "first": first, "last": last}).encode()
    return b'{"v":1,"gateway":' + name + b',"outbox":' + span + b',"readings":['


def wire_time(t: datetime | float | None = None) -> str:
    """A time as the wire format writes it (UTC, milliseconds, ``Z``): now when ``t`` is
    None, a Unix time when it is a number, else an aware datetime."""
    if t is None:
        t = datetime.now(UTC)
    elif isinstance(t, int | float):
        t = datetime.fromtimestamp(t, UTC)
    return t.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# ------------------------------------------------------------------ landed

# The end-to-end acknowledgement (docs/wire-format.md, issue 24): an ingest says which
# seqs of a gateway's store are durably in its landing zone. Retained, QoS 1, on
# ``{prefix}/{gateway}/landed/{ingest}``; cumulative (the seqs it landed that the
# gateway may still hold), so the newest one says everything and a lost one costs
# nothing but a later re-send.
LANDED_SCHEMA = "landed.v1.json"
MAX_LANDED_RANGES = 512
_SEQ = Annotated[int, Field(ge=1, le=2**63 - 1)]
_NAME = r"^[^/+#\x00]{1,128}$"


class LandedAck(BaseModel):
    model_config = _STRICT
    v: Annotated[int, Field(ge=1, le=1)]
    gateway: Annotated[str, Field(min_length=1, max_length=256)]
    epoch: Annotated[str, Field(min_length=1, max_length=64)]
    ingest: Annotated[str, Field(pattern=_NAME)]
    at: Annotated[str, Field(pattern=_TS)]
    landed: Annotated[list[tuple[_SEQ, _SEQ]], Field(max_length=MAX_LANDED_RANGES)]
    hmac: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None

    def body(self) -> bytes:
        """What the HMAC covers: the acknowledgement without its ``hmac``, encoded as
        ``encode_landed`` encodes it (fixed key order, no spaces)."""
        return _landed_body(self.gateway, self.epoch, self.ingest, self.at, self.landed)


def _landed_body(
    gateway: str, epoch: str, ingest: str, at: str, ranges: Sequence[tuple[int, int]]
) -> bytes:
    doc = {"v": 1, "gateway": gateway, "epoch": epoch, "ingest": ingest, "at": at}
    doc["landed"] = [[lo, hi] for lo, hi in ranges]
    return _ENCODER.encode(doc).encode()


def encode_landed(
    gateway: str,
    epoch: str,
    ingest: str,
    ranges: Sequence[tuple[int, int]],
    *,
    at: str | None = None,
    key: bytes | None = None,
) -> bytes:
    """An acknowledgement; with ``key`` (the gateway's, ``landed_key``) it carries an
    HMAC-SHA256 of its body, so a gateway holding the key trusts no other author."""
    body = _landed_body(gateway, epoch, ingest, at or wire_time(), ranges)
    if key is None:
        return body
    mac = hmac.new(key, body, hashlib.sha256).hexdigest()
    return body[:-1] + b',"hmac":"' + mac.encode() + b'"}'


def parse_landed(payload: bytes) -> LandedAck | str:
    """The acknowledgement, or why not (a sentence for a log line)."""
    try:
        ack = LandedAck.model_validate_json(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = "/".join(str(p) for p in first["loc"]) or "(top)"
        return f"{where}: {first['msg']}"
    if any(hi < lo for lo, hi in ack.landed):
        return "landed: a range ends before it begins"
    return ack


def landed_mac_ok(ack: LandedAck, key: bytes) -> bool:
    if ack.hmac is None:
        return False
    mac = hmac.new(key, ack.body(), hashlib.sha256).hexdigest()
    return hmac.compare_digest(mac, ack.hmac)


def gateway_key(master: bytes, gateway: str) -> bytes:
    """A gateway's acknowledgement key, derived from the ingest's master key: the ingest
    holds one secret for the fleet, and a gateway's key tells nothing of another's."""
    return hmac.new(master, b"pubcomp-landed-v1:" + gateway.encode(), hashlib.sha256).digest()


def parse_key(text: str, where: str = "the key") -> bytes:
    """A key as its files hold it: 64 hex digits (32 bytes), surrounding space ignored."""
    t = text.strip()
    if len(t) != 64:
        raise ValueError(f"{where}: expected 64 hex digits, found {len(t)} characters")
    try:
        return bytes.fromhex(t)
    except ValueError:
        raise ValueError(f"{where}: not hex") from None
