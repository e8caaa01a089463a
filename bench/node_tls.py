"""What TLS costs a node's (re)connect: the firmware's own Link, TLS against plaintext.

The firmware's link (firmware/lib/pubnode/link.py) runs in this process under
the host port's stand-ins (usocket, ussl on OpenSSL) and connects to a real
`pubcomp gateway run` with a plaintext and a TLS listener side by side
(certificate from `pubcomp gateway make-cert`, ECDSA P-256). Each connect is
what a node does after a dropped connection: TCP, the TLS handshake with
certificate and name verification, CONNECT, CONNACK (the gateway's password
check included). The first connect of each kind is reported apart: the
gateway verifies a password with scrypt once and remembers it.

These are host figures (x86 and OpenSSL, loopback): on a board the handshake's
ECDHE and ECDSA run in mbedTLS on a 133-240 MHz core and dominate; the node's
status line prints ``connect_ms`` and ``connect_heap`` for the real figure.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from devkit.broker import Mosquitto, free_port  # noqa: E402
from devkit.gateway_helpers import GatewayProc  # noqa: E402

GID = "gw-bench"


def firmware_link() -> Any:
    """firmware/lib/pubnode/link.py, importable here as the host port sets it up."""
    host = ROOT / "firmware" / "host"
    sys.path[:0] = [str(host / "standins"), str(ROOT / "firmware" / "lib"), str(host)]
    sys.path.insert(0, str(ROOT / ".cache" / "umqtt"))
    import run_node  # firmware/host/run_node.py: MicroPython's ticks functions

    time.ticks_ms = run_node.ticks_ms  # type: ignore[attr-defined]
    time.ticks_add = run_node.ticks_add  # type: ignore[attr-defined]
    time.ticks_diff = run_node.ticks_diff  # type: ignore[attr-defined]
    gc.mem_free = lambda: -1  # type: ignore[attr-defined]
    from pubnode import config, link

    return config, link


def connects(link_mod: Any, port: int, tls: Any, n: int) -> tuple[float, list[float]]:
    """(first connect ms, the next n connects' ms)."""
    times = []
    for _ in range(n + 1):
        lk = link_mod.Link("node-b", PASSWORD, "127.0.0.1", port, 30, 5, tls)
        t0 = time.perf_counter()
        assert lk.ensure(), lk.last_error
        times.append((time.perf_counter() - t0) * 1000)
        lk.close()
    return times[0], times[1:]


PASSWORD = "bench-password-0123456789abcdef"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--connects", type=int, default=200)
    args = ap.parse_args()
    config, link = firmware_link()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cmd = [sys.executable, "-m", "pubcomp", "gateway", "make-cert", "--gateway", GID]
        subprocess.run([*cmd, "--out-dir", str(tmp / "tls")], check=True, capture_output=True)
        cert = tmp / "tls" / "ingress.crt"
        broker = Mosquitto(tmp / "broker").start()
        ingress = {
            "tls_cert": str(cert),
            "tls_key": str(tmp / "tls" / "ingress.key"),
            "tls_port": free_port(),
        }
        gw = GatewayProc(tmp, broker.port, gid=GID, nodes={"node-b": PASSWORD},
                         extra={"ingress": ingress})  # fmt: skip
        try:
            gw.start()
            tls_port = gw.status()["listeners"]["tls"]["port"]
            pinned = link.PinnedTls(config.pem_to_der(cert.read_text()), GID)
            results = {
                "plaintext": connects(link, gw.ingress_port, None, args.connects),
                "tls": connects(link, tls_port, pinned, args.connects),
            }
        finally:
            gw.kill()
            broker.kill()
    print(f"node (re)connect to the gateway, {args.connects} connects each, host port, loopback:")
    print(f"{'':10} {'first (scrypt)':>15} {'median':>9} {'p90':>9}")
    med = {}
    for name, (first, rest) in results.items():
        med[name] = statistics.median(rest)
        p90 = statistics.quantiles(rest, n=10)[-1]
        print(f"{name:10} {first:12.1f} ms {med[name]:6.2f} ms {p90:6.2f} ms")
    print(f"tls / plaintext (median): {med['tls'] / med['plaintext']:.1f}x")


if __name__ == "__main__":
    main()
