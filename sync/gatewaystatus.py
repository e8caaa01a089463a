"""The gateway status message (docs/wire-format.md, "Gateway status"), as one typed model.

A gateway publishes its health, retained, on ``{prefix}/{gateway}/status``
(gateway/fleetstatus.py); the cloud lands it (pipeline/statusland.py), keeps it
in ``gateway_health`` (pipeline/health.py) and shows it (pipeline/fleet.py). Every
one of them reads this model, and what is derived from it:

- ``sync/schemas/gateway-status.v1.json`` is ``json_schema()``, written by
  ``python -m pubcomp.sync.gatewaystatus --write`` (tests/test_status_model.py
  fails while the shipped file differs);
- the Spark schema of a landed status line is derived from ``OnlineStatus``
  (pipeline/sparktypes.py).

So a new field is one line here (with its docstring, which becomes its
description in the schema), and then wherever it is shown.

A message is either ``OnlineStatus`` (the figures) or ``OfflineStatus`` (the
Will, or a clean stop: no figures); ``online`` tells which (``StatusMessage``,
``parse``). Fields that v1 gained later (issue 24's end to end) are optional, so a
message from an older gateway still reads; writers leave them out by not setting
them (``dumps``, which excludes what was not set).

Pydantic, like sync/wire.py's node message; pydantic-free parts (the exit codes a
verdict carries) are in sync/exitcodes.py, so that the command line's argument
parsing does not import pydantic.
"""

from __future__ import annotations

import json
import sys
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue, SkipJsonSchema
from pydantic_core import core_schema

STATUS_SCHEMA = "gateway-status.v1.json"
STATUS_V: Literal[1] = 1

# Rules shared by every part of the message: unknown keys are an error (as the schema's
# additionalProperties: false), and each field's docstring is its description.
_MODEL = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

Time = Annotated[
    str,
    Field(
        pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{3}Z$",
        description="UTC, ISO 8601 with milliseconds, by the gateway's clock (see clock.synced).",
    ),
]
Count = Annotated[int, Field(ge=0)]

Level = Literal["ok", "down", "unhealthy"]
LEVELS: tuple[Level, ...] = ("ok", "down", "unhealthy")
OnlineReason = Literal["connected", "changed", "heartbeat"]
OfflineReason = Literal["will", "stopped"]
ClockSource = Literal["kernel", "gps", "none"]


class Verdict(BaseModel):
    """What ``pubcomp status`` says on the gateway."""

    model_config = _MODEL
    level: Level
    """ok; down: running, not delivering; unhealthy."""
    headline: str
    """Its first line."""
    exit: int
    """Its exit code (sync/exitcodes.py: 0, 4, 1)."""


class UplinkStatus(BaseModel):
    model_config = _MODEL
    state: str
    """connected, connecting, backoff, ..."""
    broker: str
    qos: Literal[1, 2]
    connected_since: Time | None
    down_since: Time | None
    backlog: Count
    """Readings waiting in the store."""
    inflight_messages: Count
    oldest_age_s: float | None
    """Age of the oldest waiting reading."""
    drain_rate: Annotated[float, Field(ge=0)]
    """Readings a second over 30 s; 0 while down."""
    eta_s: float | None
    """While a held backlog drains: when it will be empty."""
    delivered: Count
    """Readings delivered since the start."""
    last_error: str | None
    """The last error in a sentence."""
    last_error_at: Time | None
    # Optional (issue 24): absent in a message from an older gateway.
    end_to_end: bool | SkipJsonSchema[None] = None
    """Optional: true while delivered readings are kept until the cloud ingest says
    they landed."""
    awaiting_landing: Count | SkipJsonSchema[None] = None
    """Optional: readings the broker completed, not yet landed."""
    awaiting_age_s: float | None = None
    """Optional: age of the oldest of them."""


class StoreStatus(BaseModel):
    model_config = _MODEL
    bytes: Count
    """Bytes used in the store."""
    quota_bytes: Count | None
    """Its quota; null: none."""
    disk_free_bytes: Count
    """Free bytes on its file system."""


class FlashStatus(BaseModel):
    model_config = _MODEL
    bytes_per_day: float | None
    """Bytes the gateway writes a day (over the last hour)."""
    life_years: float | None
    """The card's projected life at that rate."""


class ClockStatus(BaseModel):
    model_config = _MODEL
    source: ClockSource
    """kernel (NTP), gps or none."""
    synced: bool
    corrections: Count


class LastReading(BaseModel):
    model_config = _MODEL
    value: float | None
    unit: str | None
    ts: str | None


class SensorStatus(BaseModel):
    model_config = _MODEL
    type: str
    state: str
    """The driver's state."""
    readings: Count
    faults: Count
    fault_kinds: dict[str, Count]
    restarts: Count
    last_error: str | None
    last: dict[str, LastReading]
    """The last reading of each channel."""


class NodeStatus(BaseModel):
    model_config = _MODEL
    connected: bool
    last_seen: Time | None
    messages: Count
    """Messages stored."""
    rejected: Count
    """Messages rejected."""
    software: Count | None = None
    """Optional: the version number of its application files (``pubcomp node update``);
    null: the node has not said."""


class _Header(BaseModel):
    """What every status message says, online or offline."""

    model_config = _MODEL
    v: Literal[1]
    gateway: Annotated[str, Field(min_length=1)]
    fleet: Annotated[str, Field(min_length=1)]
    id: Annotated[str, Field(pattern=r"^[0-9a-f]+/(will-)?[0-9]+$")]
    """Unique per message: {run}/{n}, run a random id per gateway process; a Will is
    {run}/will-{n}. Repeats (retained copies, QoS 1 resends) carry the same id."""
    online: bool
    reason: str
    ts: Time
    """When the gateway wrote it (a Will: when its connection was made)."""
    version: str
    """The pubcomp version."""
    started: Time
    """The gateway process's start."""


class OnlineStatus(_Header):
    """The gateway's health while it is online."""

    online: Literal[True]
    reason: OnlineReason
    uptime_s: Annotated[float, Field(ge=0)]
    verdict: Verdict
    problems: list[str]
    """Why it is unhealthy (a task ended, the store probe failed)."""
    uplink: UplinkStatus
    store: StoreStatus
    flash: FlashStatus
    clock: ClockStatus
    sensors: dict[str, SensorStatus]
    nodes: dict[str, NodeStatus]


class OfflineStatus(_Header):
    """The Will (reason will, sent by the broker when the connection is lost without a
    DISCONNECT) or a clean stop (reason stopped). It carries no figures."""

    online: Literal[False]
    reason: OfflineReason


StatusMessage = Annotated[OnlineStatus | OfflineStatus, Field(discriminator="online")]
_MESSAGE: TypeAdapter[OnlineStatus | OfflineStatus] = TypeAdapter(StatusMessage)


def parse(msg: dict[str, Any]) -> OnlineStatus | OfflineStatus:
    """A decoded message as the model; raises pydantic's ValidationError (a ValueError)."""
    return _MESSAGE.validate_python(msg)


def as_dict(msg: OnlineStatus | OfflineStatus) -> dict[str, Any]:
    """The message as JSON values, without the optional fields its writer did not set."""
    out: dict[str, Any] = msg.model_dump(mode="json", exclude_unset=True)
    return out


def dumps(msg: OnlineStatus | OfflineStatus) -> bytes:
    """The payload: compact JSON, UTF-8."""
    return json.dumps(as_dict(msg), separators=(",", ":"), ensure_ascii=False).encode()


# ------------------------------------------------------------------ the JSON Schema


class _Schema(GenerateJsonSchema):
    """pydantic's JSON Schema without what only repeats the names (titles) or is no
    part of the contract (the defaults a Python reader fills in for optional fields)."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False

    def default_schema(self, schema: core_schema.WithDefaultSchema) -> JsonSchemaValue:
        return self.generate_inner(schema["schema"])

    def model_schema(self, schema: core_schema.ModelSchema) -> JsonSchemaValue:
        out = super().model_schema(schema)
        out.pop("title", None)
        return out


def json_schema() -> dict[str, Any]:
    """``gateway-status.v1.json`` as derived from the model."""
    body = _MESSAGE.json_schema(schema_generator=_Schema)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://pubcomp.invalid/schemas/{STATUS_SCHEMA}",
        "title": "pubcomp gateway status, version 1",
        "description": (
            "Payload of a retained QoS 1 PUBLISH on {prefix}/{gateway}/status: the "
            "gateway's health while it is online (online: true), or an offline message: "
            "its Will (reason will) or a clean stop (reason stopped). Generated from "
            "sync/gatewaystatus.py; do not edit."
        ),
        **body,
    }


def schema_text() -> str:
    return json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"


def shipped_schema_path() -> Path:
    return Path(str(resources.files("pubcomp.sync").joinpath(f"schemas/{STATUS_SCHEMA}")))


def main(argv: list[str]) -> int:
    """``--write``: write the schema file; else print it."""
    if argv == ["--write"]:
        shipped_schema_path().write_text(schema_text())
        print(f"wrote {shipped_schema_path()}")
        return 0
    if argv:
        print("usage: python -m pubcomp.sync.gatewaystatus [--write]", file=sys.stderr)
        return 2
    sys.stdout.write(schema_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
