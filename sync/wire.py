"""Reading the wire format (docs/wire-format.md): strict JSON and the shipped JSON Schemas.

Both receivers, the gateway's node ingress and the cloud ingest, parse
payloads the same way: ``json.loads`` would accept NaN and Infinity, which
are not JSON, so they are refused here.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import jsonschema

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
