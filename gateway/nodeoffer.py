"""The ingress's side of node software updates: the offers `pubcomp node update` wrote
(gateway/nodesets.py), served to the nodes they name.

A node subscribes to ``nodes/{node}/update`` and asks on ``nodes/{node}/update/req``
(QoS 0); each request gets one answer (docs/firmware.md, "The protocol")::

    H {json}      hello: the software it runs (sw, state, bad: highest version rolled
                  back, have: what it is fetching, last: its last offer's outcome)
                  -> M <hmac>\\n<manifest> | A <version> (carry on) | N (nothing for you)
    G v i off     chunk ``off`` of file ``i`` of version ``v``
                  -> C v i off <mac>\\n<data> | E <why>

The node decides what it takes: it checks every MAC and hash and refuses old or
rolled-back versions. The gateway holds no key; it keeps what each node last said
(``software``: status, metrics, the rollout's view) and stops offering what a node
refused, until the offer changes.

What one node can cost stays bounded (issue 25): a request is a PUBLISH, so it is
paced by the node's message rate, and its answer (at most one chunk) waits in the
connection's queue of unanswered packets, which stops the node's reader when full.
An offer file is read again only when it changes; a set is loaded and checked in a
thread, and at most ``MAX_SETS`` are kept in memory.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .nodesets import SoftwareSet, UpdateError, load_set, offer_path
from .ratelog import Summary

log = logging.getLogger(__name__)

MAX_SETS = 2
MAX_TEXT = 200  # characters of a node's words kept (its last refusal's reason)
STATES = ("running", "trial", "downloading", "ready")


@dataclass
class Offer:
    node: str
    version: int
    chunk: int
    manifest: bytes
    mac: str
    chunk_macs: list[list[str]]
    sizes: list[int]
    kind: str = "files"  # or "image": one whole firmware image (ESP32)
    refused: bool = False  # the node said no: not offered again until the file changes

    @property
    def total(self) -> int:
        return sum(self.sizes)


def manifest_message(offer: Offer) -> bytes:
    return b"M " + offer.mac.encode() + b"\n" + offer.manifest


def chunk_message(offer: Offer, s: SoftwareSet, index: int, offset: int) -> bytes:
    data = s.files[index].data[offset : offset + offer.chunk]
    mac = offer.chunk_macs[index][offset // offer.chunk]
    return f"C {offer.version} {index} {offset} {mac}\n".encode() + data


def parse_offer(raw: bytes, node: str) -> Offer:
    """An offer file's contents; ValueError says what is wrong with it."""
    d = json.loads(raw)
    if not isinstance(d, dict) or d.get("v") != 1:
        raise ValueError("not an offer (v 1)")
    body = d["manifest"].encode()
    m = json.loads(body)
    version, chunk = int(d["version"]), int(d["chunk"])
    if m["version"] != version or m["chunk"] != chunk:
        raise ValueError("its manifest's version or chunk size differs from the offer's")
    sizes = [int(f[1]) for f in m["files"]]
    macs = d["chunk_macs"]
    if len(macs) != len(sizes) or any(
        len(ms) != -(-size // chunk) for ms, size in zip(macs, sizes, strict=True)
    ):
        raise ValueError("its chunk MACs do not cover its files")
    kind = "image" if m.get("kind") == "image" else "files"
    return Offer(node, version, chunk, body, str(d["mac"]), macs, sizes, kind)


def _small(v: Any) -> Any:
    """A node's own words, bounded before they are kept or shown."""
    if isinstance(v, str):
        return v[:MAX_TEXT]
    if isinstance(v, list):
        return [_small(x) for x in v[:8]]
    if isinstance(v, dict):
        return {str(k)[:40]: _small(x) for k, x in list(v.items())[:16]}
    return v if isinstance(v, int | float | bool) or v is None else str(v)[:MAX_TEXT]


class OfferServer:
    def __init__(self, root: Path, *, events: Summary | None = None) -> None:
        self.root = root
        self.events = events or Summary()
        self._offers: dict[str, tuple[tuple[int, int, int] | None, Offer | None]] = {}
        self._sets: collections.OrderedDict[int, SoftwareSet] = collections.OrderedDict()
        self._loading: dict[int, asyncio.Future[SoftwareSet]] = {}
        # node -> what it said last, with its offer's progress (bounded: the fleet's nodes)
        self.software: dict[str, dict[str, Any]] = {}
        self._said: dict[str, tuple[Any, dict[str, int]]] = {}  # node -> (boot, its counts)
        self._refused: dict[str, collections.Counter[str]] = {}  # node -> summed

    async def answer(
        self, node: str, payload: bytes, rejected: collections.Counter[str]
    ) -> bytes | None:
        """The answer to one request from ``node`` (None: nothing to say)."""
        kind = payload[:2]
        if kind == b"H ":
            return await self._hello(node, payload[2:], rejected)
        if kind == b"G ":
            return await self._get(node, payload[2:], rejected)
        rejected["update_bad_request"] += 1
        return b"E bad request\n"

    # ------------------------------------------------------------ offers and sets

    async def offer(self, node: str) -> Offer | None:
        """The offer for ``node`` on disk (read again when its file changes)."""
        path = offer_path(self.root, node)
        try:
            st = os.stat(path)
        except OSError:
            self._offers.pop(node, None)
            return None
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        cached = self._offers.get(node)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        offer: Offer | None = None
        try:
            raw = await asyncio.to_thread(path.read_bytes)
            offer = parse_offer(raw, node)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.events.log(
                log, logging.ERROR, ("offer_unreadable", node),
                "ingress: %s: offer %s cannot be served: %s", node, path, exc,
            )  # fmt: skip
        self._offers[node] = (stamp, offer)
        return offer

    async def software_set(self, version: int) -> SoftwareSet:
        """A set, loaded and checked against its set.json in a thread; UpdateError if not."""
        s = self._sets.get(version)
        if s is not None:
            self._sets.move_to_end(version)
            return s
        fut = self._loading.get(version)
        if fut is None:
            fut = asyncio.ensure_future(asyncio.to_thread(load_set, self.root, version))
            self._loading[version] = fut
        try:
            s = await asyncio.shield(fut)
        finally:
            if fut.done():
                self._loading.pop(version, None)
        self._sets[version] = s
        while len(self._sets) > MAX_SETS:
            self._sets.popitem(last=False)
        return s

    def paced(self, node: str) -> None:
        """A request of ``node``'s waited for its message rate (counted, not a rejection)."""
        sw = self.software.setdefault(node, {"offer": None, "served": 0, "total": 0})
        sw["paced"] = sw.get("paced", 0) + 1

    # ------------------------------------------------------------ requests

    async def _hello(
        self, node: str, body: bytes, rejected: collections.Counter[str]
    ) -> bytes | None:
        try:
            h = json.loads(body)
            if not isinstance(h, dict) or not isinstance(h.get("sw"), int):
                raise ValueError("no sw")
        except ValueError:
            rejected["update_bad_request"] += 1
            return b"E bad request\n"
        state = h.get("state") if h.get("state") in STATES else "running"
        have = h.get("have") if isinstance(h.get("have"), list) else None
        last = h.get("last") if isinstance(h.get("last"), list) and len(h["last"]) == 3 else None
        before = self.software.get(node) or {}
        said: dict[str, Any] = h["refused"] if isinstance(h.get("refused"), dict) else {}
        sw: dict[str, Any] = {
            "version": h["sw"],
            "state": state,
            "bad": h.get("bad") if isinstance(h.get("bad"), int) else 0,
            "have": _small(have),
            "last": _small(last),
            "refused": self._refusals(node, h.get("boot"), said),
            "image": h.get("fw") if isinstance(h.get("fw"), int) else None,
            "image_bad": h.get("fw_bad") if isinstance(h.get("fw_bad"), int) else 0,
            "seen": time.time(),
            "offer": None,
            "offer_kind": None,
            "served": 0,
            "total": 0,
            "paced": before.get("paced", 0),
        }
        offer = await self.offer(node)
        reply = b"N\n"
        if offer is not None:
            sw["offer"], sw["total"], sw["offer_kind"] = offer.version, offer.total, offer.kind
            runs = sw["image"] if offer.kind == "image" else h["sw"]
            if before.get("offer") == offer.version:
                sw["served"] = before.get("served", 0)
            if last is not None and last[0] == offer.version and last[1] in ("refused", "failed"):
                offer.refused = True  # the node will not take it: say nothing more of it
            if offer.refused or runs == offer.version:
                reply = b"N\n"
            elif have is not None and have[:1] == [offer.version]:
                reply = f"A {offer.version}\n".encode()
            else:
                reply = manifest_message(offer)
        self._tell(node, before, sw)
        self.software[node] = sw
        return reply

    def _refusals(self, node: str, boot: Any, said: dict[str, Any]) -> dict[str, int]:
        """What the node refused, summed across its boots: it counts in RAM from 0 at
        each boot (a count written to flash per refusal would let a forger wear it out)."""
        seen_boot, prev = self._said.get(node, (None, {}))
        if boot != seen_boot:
            prev = {}  # a new boot: its counts began again
        total = self._refused.setdefault(node, collections.Counter())
        now: dict[str, int] = {}
        for reason, n in list(said.items())[:32]:
            if not isinstance(n, int) or n < 0:
                continue
            reason = str(reason)[:40]
            total[reason] += max(0, n - prev.get(reason, 0))
            now[reason] = max(n, prev.get(reason, 0))
        self._said[node] = (boot, now)
        return dict(total)

    def _tell(self, node: str, before: dict[str, Any], sw: dict[str, Any]) -> None:
        """One log line when a node's software or its last outcome changes."""
        if before.get("version") != sw["version"] or before.get("state") != sw["state"]:
            log.info("ingress: %s: software version %s (%s)", node, sw["version"], sw["state"])
        if sw["last"] is not None and before.get("last") != sw["last"]:
            v, result, why = sw["last"]
            self.events.log(
                log, logging.WARNING, ("update_outcome", node),
                "ingress: %s: version %s %s: %s", node, v, result, why,
            )  # fmt: skip

    async def _get(
        self, node: str, body: bytes, rejected: collections.Counter[str]
    ) -> bytes | None:
        try:
            v, index, offset = (int(x) for x in body.split())
        except ValueError:
            rejected["update_bad_request"] += 1
            return b"E bad request\n"
        offer = await self.offer(node)
        if offer is None or offer.version != v:
            rejected["update_not_offered"] += 1
            return b"E not offered\n"
        try:
            s = await self.software_set(v)
        except UpdateError as exc:
            rejected["update_set_damaged"] += 1
            self.events.log(
                log, logging.ERROR, ("set_damaged", v),
                "ingress: %s: cannot serve %s", node, exc,
            )  # fmt: skip
            return b"E the gateway's copy of this version is damaged\n"
        if [len(f.data) for f in s.files] != offer.sizes:
            rejected["update_set_damaged"] += 1
            return b"E the offer does not match the gateway's copy\n"
        if (
            not (0 <= index < len(s.files))
            or offset % offer.chunk
            or not (0 <= offset < offer.sizes[index])
        ):
            rejected["update_bad_request"] += 1
            return b"E bad request\n"
        sw = self.software.setdefault(node, {"offer": v, "served": 0, "total": offer.total})
        if sw.get("offer") == v:
            n = min(offer.chunk, offer.sizes[index] - offset)
            sw["served"] = max(sw.get("served", 0), sum(offer.sizes[:index]) + offset + n)
            if sw.get("state") == "running":
                sw["state"] = "downloading"
        return chunk_message(offer, s, index, offset)
