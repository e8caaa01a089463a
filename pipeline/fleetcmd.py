"""What ``pubcomp fleet status`` and ``pubcomp fleet watch`` do (imported only when one runs)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pubcomp.sync.exitcodes import EXIT_USAGE
from pubcomp.sync.gatewaystatus import OnlineStatus, parse

from . import fleet
from .fleet import GatewayView, Message

QUIET_S = 1.0  # --once: the retained statuses have all come when none came for this long
REDRAW_S = 5.0  # the live table is redrawn this often (ages move) and at each new status


def _fail(command: str, text: str) -> int:
    print(f"pubcomp fleet {command}: {text}", file=sys.stderr)
    return EXIT_USAGE


# ------------------------------------------------------------------ status


def fleet_status(args: argparse.Namespace) -> int:
    from .commands import warehouse_problem

    problem = warehouse_problem(args.warehouse)
    if problem is not None:
        return _fail("status", problem)
    from .health import views
    from .job import spark_session

    spark = spark_session(args.master, app="pubcomp-fleet-status")
    spark.sparkContext.setLogLevel("ERROR")
    found = views(spark, args.warehouse, history_hours=0)
    now = time.time()
    if args.json:
        ranked = fleet.rank(found, now)
        rows = [
            {**v.model_dump(mode="json"), "judgement": asdict(fleet.judge(v, now, args.stale_s))}
            for v in ranked
        ]
        print(json.dumps(rows, indent=2, default=str))
    elif not found:
        print(
            f"no gateway status in {args.warehouse}: the gateways publish it, `pubcomp ingest "
            "run` lands it, `pubcomp pipeline run` puts it in gateway_health"
        )
    else:
        print(fleet.render(found, now, args.stale_s))
    return fleet.code(found, now, args.stale_s)


# ------------------------------------------------------------------ watch


class Watch:
    """The newest status of each gateway (and its last online one), from the messages."""

    def __init__(self) -> None:
        from pubcomp.sync import wire

        self.latest: dict[str, tuple[Message, float | None]] = {}
        self.online: dict[str, OnlineStatus] = {}
        self.invalid = 0
        self._validator = wire.validator("gateway-status.v1.json")

    def add(self, payload: bytes, retained: bool, now: float) -> bool:
        """Take one message; False if it is not a valid status (counted, ignored)."""
        from pubcomp.sync import wire

        try:
            raw = wire.loads(payload)
            if not self._validator.is_valid(raw):
                raise ValueError("not a valid status")
            msg = parse(raw)
        except (ValueError, UnicodeDecodeError):  # pydantic's ValidationError is one
            self.invalid += 1
            return False
        # A retained message was sent before we subscribed: when, we do not know.
        self.latest[msg.gateway] = (msg, None if retained else now)
        if isinstance(msg, OnlineStatus):
            self.online[msg.gateway] = msg
        return True

    def views(self) -> list[GatewayView]:
        return [
            fleet.view(msg, seen, self.online.get(gw)) for gw, (msg, seen) in self.latest.items()
        ]


def _client(args: argparse.Namespace) -> Any:
    from pubcomp.sync.releaselink import client

    return client(args, "watch")  # read-only, nothing to persist


def _screen(watch: Watch, args: argparse.Namespace, note: str = "") -> str:
    text = fleet.render(watch.views(), time.time(), args.stale_s)
    foot = f"watching {args.topic} at {args.broker}" + (f"; {note}" if note else "")
    if watch.invalid:
        foot += f"; {watch.invalid} messages that are no valid status ignored"
    return f"{text}\n\n{foot}"


async def _once(args: argparse.Namespace) -> int:
    watch = Watch()
    async with _client(args) as client:
        await client.subscribe(args.topic, qos=1)
        deadline = time.monotonic() + args.wait
        it = client.messages.__aiter__()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            wait = min(left, QUIET_S) if watch.latest else left
            try:
                m = await asyncio.wait_for(it.__anext__(), wait)
            except TimeoutError:
                break
            watch.add(bytes(m.payload), bool(m.retain), time.time())
    views = watch.views()
    if not views:
        print(f"no gateway status on {args.topic} at {args.broker} (waited {args.wait:g} s)")
    else:
        print(_screen(watch, args))
    return fleet.code(views, time.time(), args.stale_s)


async def _live(args: argparse.Namespace) -> int:
    import aiomqtt

    from pubcomp.sync.client import Backoff
    from pubcomp.sync.running import reconnecting

    watch = Watch()
    tty = sys.stdout.isatty()
    note = "connecting"
    ever = False  # a broker never reached is a bad command; one lost is retried

    def draw() -> None:
        text = _screen(watch, args, note + ("; Ctrl-C to stop" if tty else ""))
        if tty:
            sys.stdout.write("\x1b[H\x1b[2J" + text + "\n")
        else:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            sys.stdout.write(f"--- {stamp}\n{text}\n")
        sys.stdout.flush()

    async def connection(backoff: Backoff) -> None:
        nonlocal note, ever
        async with _client(args) as client:
            await client.subscribe(args.topic, qos=1)
            note, ever = "connected", True
            backoff.reset()
            draw()
            it = client.messages.__aiter__()
            while True:
                try:
                    m = await asyncio.wait_for(it.__anext__(), REDRAW_S)
                    watch.add(bytes(m.payload), bool(m.retain), time.time())
                except TimeoutError:
                    pass
                draw()

    def lost(why: str, exc: BaseException) -> None:
        nonlocal note
        if not ever:
            raise exc
        note = f"connection lost ({exc}); retrying"
        draw()

    await reconnecting(
        asyncio.Event(),  # never set: Ctrl-C ends the watch
        connection,
        lost,
        backoff=Backoff(base=0.5, cap=30.0),
        errors=(aiomqtt.MqttError,),
    )
    return 0  # not reached: the loop ends only by an exception


def fleet_watch(args: argparse.Namespace) -> int:
    import aiomqtt

    try:
        from pubcomp.sync.client import BrokerURL

        BrokerURL.parse(args.broker)
        if args.password_file and not Path(args.password_file).is_file():
            return _fail("watch", f"--password-file {args.password_file}: no such file")
    except ValueError as exc:
        return _fail("watch", str(exc))
    try:
        return asyncio.run(_once(args) if args.once else _live(args))
    except aiomqtt.MqttError as exc:
        return _fail(
            "watch", f"{args.broker}: {exc} (is the broker up; are the credentials right?)"
        )
    except OSError as exc:
        return _fail("watch", f"cannot reach {args.broker}: {exc}")
