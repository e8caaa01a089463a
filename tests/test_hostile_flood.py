"""One logged-in client floods packets other than PUBLISH and reads nothing (issue 25).

Found by an abuse run: a PINGREQ flood from a client that never read stalled
the gateway's event loop for about 25 s (health failed 9 of 10 probes, both
good nodes went 27.7 s without a PUBACK, 126,887 asyncio warnings in the log):
replies were queued without bound, the reader buffered up to 2 MiB and the
writer never noticed its peer had stopped reading. SUBSCRIBE, UNSUBSCRIBE and
PUBREL took the same path. Each is a flooder here, four at once, for 3 s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from devkit.broker import Mosquitto
from tests.hostile_helpers import (
    PINGREQ,
    Siege,
    connect_packet,
    pubrel_packet,
    raw_socket,
    read_connack,
    subscribe_packet,
    unsubscribe_packet,
)

FLOODERS: dict[str, Callable[[int], bytes]] = {
    "flood-ping": lambda i: PINGREQ,
    "flood-sub": lambda i: subscribe_packet(i % 65535 + 1),
    "flood-unsub": lambda i: unsubscribe_packet(i % 65535 + 1),
    "flood-pubrel": lambda i: pubrel_packet(i % 65535 + 1),
}
ATTACK_S = 3.0


def _flood(port: int, node: str, packet: Callable[[int], bytes], until: float, sent: list[int]):
    """Log in, then write packets as fast as the socket takes them, never reading."""
    while time.monotonic() < until:
        s = raw_socket(port, "127.0.0.2", rcvbuf=4096)
        try:
            s.sendall(connect_packet(node.encode(), f"pw-{node}".encode(), node.encode()))
            if read_connack(s) != 0:
                return
            burst = b"".join(packet(i) for i in range(512))
            s.settimeout(0.5)
            while time.monotonic() < until:
                s.sendall(burst)  # blocks (times out) once the gateway stops reading
                sent[0] += 512
        except OSError:  # the gateway closed it, or stopped reading: log in again
            pass
        finally:
            s.close()


def test_a_client_flooding_other_packets_and_reading_nothing_costs_only_itself(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    siege = Siege(tmp_path, mosquitto, nodes={n: f"pw-{n}" for n in FLOODERS})
    sent = [0]
    with siege.watch():
        until = time.monotonic() + ATTACK_S
        threads = [
            threading.Thread(target=_flood, args=(siege.gw.ingress_port, n, p, until, sent))
            for n, p in FLOODERS.items()
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(ATTACK_S + 30)
    metrics = siege.metrics()
    figures = siege.finish(rss_mb=30, fds=40, log_kb=16)
    closed = {
        r: metrics[("pubcomp_ingress_closed_connections_total", (("reason", r),))]
        for r in ("control_flood", "write_stalled")
    }
    print(f"flood: {sent[0]:,} packets offered in {ATTACK_S:g} s; closed {closed}")
    assert sent[0] > 10_000, sent  # the attack did flood
    # Each flooder was cut off (counted), over and over, and never logged once per packet.
    assert closed["control_flood"] + closed["write_stalled"] >= len(FLOODERS), closed
    assert figures["worst_puback_s"] < 1.0
