"""One model of the gateway status message (sync/gatewaystatus.py, issue 26): the shipped
JSON Schema and the Spark schema are what the model derives, and the cloud's two ways
of reading a status (a live message, a row of ``gateway_health``) give the same view."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DoubleType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
)

from pubcomp.pipeline import fleet
from pubcomp.pipeline.sparktypes import spark_type, struct_of
from pubcomp.sync import gatewaystatus, wire
from pubcomp.sync.gatewaystatus import OnlineStatus
from pubcomp.sync.tables import Raw, html_row, html_table, text_table

from .test_fleet_view import NOW, offline, status

SCHEMA_FILE = Path(__file__).parent.parent / "sync/schemas/gateway-status.v1.json"


def full_status(gw: str = "gw-7") -> dict[str, Any]:
    """An online status with every optional field and a sensor and a node."""
    sensor = {
        "type": "pulse",
        "state": "running",
        "readings": 1788,
        "faults": 2,
        "fault_kinds": {"bounce": 2},
        "restarts": 1,
        "last_error": "gone",
        "last": {"rain": {"value": 0.2, "unit": "mm", "ts": "2026-11-21T12:00:00.000Z"}},
    }
    node = {"connected": True, "last_seen": wire.wire_time(NOW - 2), "messages": 5, "rejected": 1,
            "software": 3}  # fmt: skip
    return status(
        gw,
        uplink={"end_to_end": True, "awaiting_landing": 12, "awaiting_age_s": 3.5},
        problems=["probe"],
        sensors={"rain": sensor},
        nodes={"node-7": node},
    )


def test_the_shipped_schema_is_the_one_the_model_derives() -> None:
    shipped = json.loads(SCHEMA_FILE.read_text())
    assert shipped == gatewaystatus.json_schema(), (
        "sync/schemas/gateway-status.v1.json differs from the model: "
        "run `python -m pubcomp.sync.gatewaystatus --write` and commit it"
    )
    assert SCHEMA_FILE.read_text() == gatewaystatus.schema_text()


def test_the_model_and_the_schema_agree_on_what_is_a_status() -> None:
    v = wire.validator(gatewaystatus.STATUS_SCHEMA)
    good = [full_status(), status("a"), offline("b"), offline("c", "stopped")]
    bad = [
        {**offline("d"), "uplink": status("d")["uplink"]},  # an offline message has no figures
        {k: x for k, x in status("e").items() if k != "uplink"},  # an online one must
        {**status("f"), "reason": "will"},
        {**status("g"), "v": 2},
        status("h", uplink={"backlog": -1}),
        status("i", uplink={"surprise": 1}),
        {**status("j"), "ts": "yesterday"},
    ]
    for msg in good:
        assert v.is_valid(msg), msg
        assert gatewaystatus.as_dict(gatewaystatus.parse(msg)) == msg
    for msg in bad:
        assert not v.is_valid(msg), msg
        with pytest.raises(ValueError):
            gatewaystatus.parse(msg)


def test_optional_fields_left_unset_are_left_out() -> None:
    """A gateway with end to end off sends ``end_to_end: false`` and no awaiting figures
    (an older ingest refuses unknown fields); a message without them still reads."""
    msg = status("a", uplink={"end_to_end": False})
    parsed = gatewaystatus.parse(msg)
    assert isinstance(parsed, OnlineStatus) and parsed.uplink.awaiting_landing is None
    assert "awaiting_landing" not in json.loads(gatewaystatus.dumps(parsed))["uplink"]
    old = gatewaystatus.parse(status("b"))  # from before issue 24: none of them
    assert isinstance(old, OnlineStatus) and old.uplink.end_to_end is None
    assert fleet.unlanded(fleet.view(old)) == "-"


def test_spark_types_of_annotations() -> None:
    class Inner(BaseModel):
        x: int

    class M(BaseModel):
        s: str
        n: int | None
        f: float
        b: bool
        lit: Literal["a", "b"]
        one: Literal[1, 2]
        xs: list[str]
        m: dict[str, Inner]

    assert struct_of(M) == StructType(
        [
            StructField("s", StringType()),
            StructField("n", LongType()),
            StructField("f", DoubleType()),
            StructField("b", BooleanType()),
            StructField("lit", StringType()),
            StructField("one", LongType()),
            StructField("xs", ArrayType(StringType())),
            StructField("m", MapType(StringType(), StructType([StructField("x", LongType())]))),
        ]
    )
    for unsupported in (int | str, dict[int, str], Literal[1, "a"], bytes):
        with pytest.raises(TypeError):
            spark_type(unsupported)


def test_each_fact_is_a_field_of_the_message_of_the_same_type() -> None:
    """``Facts`` declares its types for the type checker; the message decides them."""
    for name, path in fleet.fact_paths().items():
        model: Any = OnlineStatus
        for part in path.split("."):
            annotation = model.model_fields[part].annotation
            model = annotation
        assert spark_type(fleet.Facts.model_fields[name].annotation) == spark_type(annotation), name


def test_a_landed_status_reads_back_whole_and_the_warehouse_view_is_the_live_one(
    spark: Any, tmp_path: Path
) -> None:
    """A message read through the derived Spark schema loses nothing, and the row
    ``gateway_health`` keeps of it makes the same view as the live message does."""
    from pubcomp.pipeline import health

    msg = full_status()
    received = wire.wire_time(NOW)
    (tmp_path / "s.jsonl").write_text(json.dumps({**msg, "received": received}) + "\n")
    lines = spark.read.schema(health.STATUS_LINE_SCHEMA).json(str(tmp_path / "s.jsonl"))
    (back,) = lines.collect()
    assert back.asDict(recursive=True) == {**msg, "received": received}

    (row,) = health.parse_statuses(lines).collect()
    from_row = health.view_of_row(row)
    live = fleet.view(msg, seen=NOW)
    assert from_row == live
    assert from_row.sensors["rain"].last["rain"].unit == "mm"
    assert fleet.render([from_row], NOW) == fleet.render([live], NOW)


def test_tables_as_text_and_html() -> None:
    assert text_table(["a", "bb"], [["ccc", "d"], ["e", ""]]) == "a    bb\nccc  d\ne"
    row = html_row(["<x>", Raw("<svg/>"), "y"], attrs=' class="s3"', classes=("name",))
    assert row == '<tr class="s3"><td class="name">&lt;x&gt;</td><td><svg/></td><td>y</td></tr>'
    assert (
        html_table(["h&"], [row], tid="t") == f'<table id="t"><tr><th>h&amp;</th></tr>{row}</table>'
    )
    assert html_table(["h"], []) == "<table><tr><th>h</th></tr></table>"
