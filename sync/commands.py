"""What the sync commands do (imported only when one runs)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from .client import ConnectOptions, TLSOptions
from .errors import BadLine
from .packets import MQTT_5, MQTT_311
from .running import run_until_stopped
from .store import Reading, Store
from .uplink import Uplink, UplinkConfig
from .wire import GAUGE, KINDS, parse_key, wire_time

log = logging.getLogger(__name__)


def _open_store(args: argparse.Namespace) -> Store:
    return Store(args.store, gateway_id=args.gateway_id)


def parse_jsonl(path: Path) -> Iterator[Reading]:
    """Readings from a JSON-lines file; a bad line raises with its line number."""
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise BadLine(f"{path}:{n}: not JSON: {exc.msg}") from None
            if not isinstance(obj, dict):
                raise BadLine(f"{path}:{n}: expected a JSON object")
            unknown = obj.keys() - {"sensor", "ts", "value", "unit", "origin", "flags", "kind"}
            if unknown:
                raise BadLine(f"{path}:{n}: unknown keys {sorted(unknown)}")
            sensor, value = obj.get("sensor"), obj.get("value")
            if not isinstance(sensor, str) or not sensor:
                raise BadLine(f"{path}:{n}: 'sensor' must be a non-empty string")
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
            ):
                raise BadLine(f"{path}:{n}: 'value' must be a finite number or null")
            for key in ("ts", "unit", "origin"):
                if obj.get(key) is not None and not isinstance(obj[key], str):
                    raise BadLine(f"{path}:{n}: '{key}' must be a string")
            ts = obj.get("ts")
            if ts is not None:
                try:
                    ts = normalise_ts(ts)
                except ValueError as exc:
                    raise BadLine(f"{path}:{n}: 'ts' {exc}") from None
            flags = obj.get("flags", [])
            if not isinstance(flags, list) or not all(isinstance(x, str) for x in flags):
                raise BadLine(f"{path}:{n}: 'flags' must be a list of strings")
            kind = obj.get("kind", GAUGE)
            if kind not in KINDS:
                raise BadLine(f"{path}:{n}: 'kind' must be one of {', '.join(KINDS)}")
            yield Reading(
                sensor,
                None if value is None else float(value),
                ts,
                obj.get("unit"),
                obj.get("origin"),
                flags,
                kind=kind,
            )


def normalise_ts(ts: str) -> str:
    """Any ISO 8601 time with a zone, as UTC with milliseconds (the wire format's form)."""
    try:
        t = datetime.fromisoformat(ts.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"is not an ISO 8601 time: {ts!r}") from None
    if t.tzinfo is None:
        raise ValueError(f"has no time zone: {ts!r} (add Z for UTC)")
    return wire_time(t)


def store_import(args: argparse.Namespace) -> int:
    path = Path(args.file)
    with _open_store(args) as store:
        readings = parse_jsonl(path)
        try:
            # One op, all or nothing; it reads the file as it goes, so it cannot run twice.
            first, last = store.commit(lambda db: store.append_in(db, readings), retry=False)
        except (BadLine, OSError) as exc:
            print(f"pubcomp store import: {exc}; nothing was imported", file=sys.stderr)
            return 1
        print(f"imported {max(0, last - first + 1)} readings into {store.path}")
    return 0


def store_stats(args: argparse.Namespace) -> int:
    with _open_store(args) as store:
        st = store.stats()
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    age = st["oldest_age_s"]
    lines = [
        ("store", st["store"]),
        ("gateway", st["gateway_id"]),
        ("epoch", st["epoch"]),
        ("backlog", f"{st['backlog']} readings"),
        ("oldest", "-" if age is None else f"{age:.1f} s"),
        ("in flight", f"{st['inflight_messages']} messages"),
        ("dead letter", st["dead_letter"]),
        ("size", f"{st['store_bytes'] / 1e6:.2f} MB used, {st['file_bytes'] / 1e6:.2f} MB on disk"),
    ] + [(k.replace("_", " "), v) for k, v in sorted(st["counters"].items())]
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        print(f"{k:<{width}}  {v}")
    return 0


def peak_rss_mb() -> float | None:
    """This process's peak resident memory (Linux VmHWM), for the run summary."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def uplink_options(args: argparse.Namespace) -> ConnectOptions:
    return ConnectOptions(
        client_id=args.client_id,
        version=MQTT_5 if args.protocol == "5" else MQTT_311,
        keepalive=args.keepalive,
        username=args.username,
        password_file=args.password_file,
        tls=TLSOptions(args.ca_file, args.cert_file, args.key_file),
    )


def read_landed_key(path: str) -> bytes:
    return parse_key(Path(path).read_text(), path)


def uplink_run(args: argparse.Namespace) -> int:
    store = _open_store(args)
    cfg = UplinkConfig(
        topic_prefix=args.topic_prefix,
        qos=args.qos,
        batch=args.batch,
        max_bytes=args.max_bytes,
        end_to_end=args.end_to_end,
        landed_timeout=args.landed_timeout,
        landed_key=read_landed_key(args.landed_key_file) if args.landed_key_file else None,
    )
    uplink = Uplink(store, args.broker, uplink_options(args), cfg)

    async def work(stop: asyncio.Event) -> None:
        await uplink.run(stop, exit_when_drained=args.exit_when_drained)

    try:
        run_until_stopped(work)
    finally:
        summary: dict[str, Any] = uplink.metrics()
        summary["peak_rss_mb"] = peak_rss_mb()
        store.close()
        print(json.dumps(summary), flush=True)
    return 0
