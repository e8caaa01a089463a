"""TLS from node to gateway, end to end: certificates from `pubcomp gateway make-cert`,
the node's config from `pubcomp node provision`, a real `pubcomp gateway run` with a
plaintext and a TLS listener side by side, the firmware's network code (host port,
OpenSSL under MicroPython's ussl API), a real Mosquitto as the cloud and paho counting
there."""

from __future__ import annotations

import json
import re
import socket
import ssl
import struct
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt

from devkit import node as devnode
from devkit.broker import Mosquitto, free_port
from devkit.checker import Checker
from devkit.gateway_helpers import GatewayProc
from devkit.link import LinkProxy
from devkit.node_helpers import NodeProc, wait_until

GID = "gw-tls"


def pubcomp(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pubcomp", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def make_cert(out: Path, gid: str = GID) -> tuple[Path, Path]:
    done = pubcomp("gateway", "make-cert", "--gateway", gid, "--out-dir", str(out))
    assert done.returncode == 0, done.stderr
    return out / "ingress.crt", out / "ingress.key"


def tls_gateway(tmp: Path, cloud_port: int) -> GatewayProc:
    """A gateway (not started) with a plaintext and a TLS listener, and no nodes yet."""
    cert, key = make_cert(tmp / "tls")
    ingress = {
        "tls_cert": str(cert),
        "tls_key": str(key),
        "tls_port": free_port(),
        "node_address": "127.0.0.1",
        "max_messages_per_second": 2000,
    }
    return GatewayProc(tmp, cloud_port, gid=GID, extra={"ingress": ingress})


def provision(gw: GatewayProc, node: str, out: Path) -> tuple[dict[str, Any], str]:
    done = pubcomp(
        "node", "provision", "--config", str(gw.fleet), "--gateway", GID, "--node", node,
        "--wifi-ssid", "site", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    cfg = json.loads((out / "config.json").read_text())
    password = cfg["node"]["password"]
    assert password not in done.stdout + done.stderr
    return cfg, password


def for_the_test(cfg: dict[str, Any], port: int, rounds: int) -> dict[str, Any]:
    """The provisioned config with the test's sampling (fast, every reading logged to flash)
    and the port of the proxy in front of the TLS listener; gateway, TLS and node as made."""
    fast = devnode.node_config("x", "x", "x", 0, rounds=rounds)
    for k in ("interval_s", "spill", "ntp", "wdt_ms", "sensors", "rounds"):
        cfg[k] = fast[k]
    cfg["gateway"] = cfg["gateway"] | {"port": port, "keepalive_s": 5, "timeout_s": 3}
    cfg["wifi"]["timeout_s"] = 1
    return cfg


def listeners(gw: GatewayProc) -> dict[str, dict[str, Any]]:
    return gw.status()["listeners"]  # type: ignore[no-any-return]


def node_ids(checker: Checker, node: str) -> dict[str, int]:
    return {k: v for k, v in checker.snapshot().items() if k.startswith(node + "/")}


def test_provisioned_node_over_tls_exactly_once_across_dropped_connections(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    checker = Checker(mosquitto.port, topic="telemetry/#", client_id="tls-check").start()
    gw = tls_gateway(tmp_path, mosquitto.port)
    cfg, password = provision(gw, "node-t", tmp_path / "node-t")
    tls_port = cfg["gateway"]["port"]
    assert cfg["gateway"]["tls"] is True and cfg["gateway"]["server_hostname"] == GID
    assert tls_port != gw.ingress_port  # the TLS listener, not the plaintext one
    proxy = LinkProxy(tls_port)
    node = NodeProc(tmp_path / "flash", for_the_test(cfg, proxy.port, rounds=300))
    gw.start()
    try:
        node.start()
        for cut in range(3):  # drop the connection whenever more readings have arrived
            seen = len(node_ids(checker, "node-t"))
            assert wait_until(lambda s=seen: len(node_ids(checker, "node-t")) > s + 40, 60)
            proxy.cut()
            assert wait_until(lambda c=cut: listeners(gw)["tls"]["accepted"] >= c + 2, 30)
        assert node.wait(120) == 0, node.output()[-3000:]
        taken = node.taken()
        assert wait_until(lambda: node_ids(checker, "node-t").keys() >= taken.keys(), 60)
        counts = node_ids(checker, "node-t")
        ls = listeners(gw)
        with urllib.request.urlopen(gw.url("/metrics"), timeout=5) as r:
            metrics = r.read().decode()
    finally:
        checker.stop()
        proxy.close()
        node.kill()
        gw.kill()
    assert len(taken) == 300 * 2 and counts.keys() == taken.keys()  # nothing lost
    assert set(counts.values()) == {1}  # nothing twice
    final = node.output().strip().splitlines()[-1]
    assert re.search(r"connects ([4-9]|\d\d)\b", final), final
    assert " tls 1 cert_refused 0 " in final, final
    assert ls["tls"]["accepted"] >= 4 and ls["tls"]["tls_failures"] == 0, ls
    assert ls["plain"]["accepted"] == 0, ls  # the node never used the plaintext listener
    label = f'{{listener="tls",port="{tls_port}"}}'
    assert re.search(rf"pubcomp_ingress_connections_total{label} ([4-9]|\d\d)", metrics), metrics
    assert f"pubcomp_ingress_tls_handshake_failures_total{label} 0.0" in metrics, metrics
    # The password is in the node's config only: not in the fleet file or any log.
    for text in (gw.fleet.read_text(), gw.log.read_text(), node.output()):
        assert password not in text


def test_a_node_with_the_wrong_pinned_certificate_sends_nothing_and_says_so(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    checker = Checker(mosquitto.port, topic="telemetry/#", client_id="tls-wrong").start()
    gw = tls_gateway(tmp_path, mosquitto.port)
    cfg, _ = provision(gw, "node-w", tmp_path / "node-w")
    other_cert, _ = make_cert(tmp_path / "other")  # same gateway name, another key
    cfg = for_the_test(cfg, cfg["gateway"]["port"], rounds=5)
    cfg["gateway"]["ca"] = other_cert.read_text()
    node = NodeProc(tmp_path / "flash", cfg)
    gw.start()
    try:
        node.start()
        assert wait_until(lambda: "gateway certificate refused" in node.output(), 30)
        assert wait_until(lambda: listeners(gw)["tls"]["tls_failures"] >= 2, 30)  # it retries
        stored = gw.status()["nodes"]["node-w"]
        output = node.output()
    finally:
        checker.stop()
        node.kill()
        gw.kill()
    line = next(ln for ln in output.splitlines() if "gateway certificate refused" in ln)
    assert "CERT_VERIFY_FAILED" in line and "LED: three blinks" in line, line
    assert output.count("gateway certificate refused") == 1  # said once, not per retry
    assert stored["messages"] == 0 and not stored["connected"]
    assert not node_ids(checker, "node-w")  # nothing reached the cloud
    assert len(node.taken()) > 0  # it did take readings: it keeps them for a right gateway


def _connect_packet(client_id: str, password: str) -> bytes:
    def s(v: str) -> bytes:
        return struct.pack("!H", len(v)) + v.encode()

    body = s("MQTT") + bytes([4, 0xC2]) + struct.pack("!H", 30)
    body += s(client_id) + s(client_id) + s(password)
    return bytes([0x10, len(body)]) + body


def test_a_plaintext_client_cannot_use_the_tls_listener(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    gw = tls_gateway(tmp_path, mosquitto.port)
    _, password = provision(gw, "node-p", tmp_path / "node-p")
    gw.start()
    tls_port = listeners(gw)["tls"]["port"]
    try:
        # Raw MQTT CONNECT with the right credentials, in clear: no CONNACK comes back.
        with socket.create_connection(("127.0.0.1", tls_port), timeout=10) as s:
            s.sendall(_connect_packet("node-p", password))
            reply = b""
            while chunk := s.recv(4096):
                reply += chunk
        assert not reply.startswith(b"\x20"), reply  # a TLS alert or nothing, never CONNACK
        # paho, in clear: never connected.
        events: list[str] = []
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="node-p")
        client.username_pw_set("node-p", password)
        client.on_connect = lambda *a: events.append(f"connect {a[3]}")
        client.on_disconnect = lambda *a: events.append("disconnect")
        try:
            client.connect("127.0.0.1", tls_port, keepalive=5)
        except OSError:
            events.append("disconnect")
        client.loop_start()
        assert wait_until(lambda: "disconnect" in events, 20), events
        client.loop_stop()
        assert not any(e == "connect Success" for e in events), events
        assert wait_until(lambda: listeners(gw)["tls"]["tls_failures"] >= 2, 20)
        # The same credentials over TLS, pinning the gateway's certificate: accepted.
        ctx = ssl.create_default_context(cafile=str(tmp_path / "tls" / "ingress.crt"))
        with (
            socket.create_connection(("127.0.0.1", tls_port), timeout=10) as raw,
            ctx.wrap_socket(raw, server_hostname=GID) as s,
        ):
            s.sendall(_connect_packet("node-p", password))
            assert s.recv(4) == b"\x20\x02\x00\x00"  # CONNACK, accepted
        # And the plaintext listener still serves nodes that have not moved yet.
        plain = paho_connects(gw.ingress_port, "node-p", password)
        ls = listeners(gw)
    finally:
        gw.kill()
    assert plain, "the plaintext listener refused a good node"
    assert ls["plain"]["accepted"] >= 1 and ls["tls"]["accepted"] >= 3, ls


def paho_connects(port: int, node: str, password: str) -> bool:
    result: list[str] = []
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=node)
    client.username_pw_set(node, password)
    client.on_connect = lambda *a: result.append(str(a[3]))
    client.connect("127.0.0.1", port, keepalive=5)
    client.loop_start()
    try:
        wait_until(lambda: bool(result), 20)
    finally:
        client.disconnect()
        client.loop_stop()
    return result == ["Success"]


def test_a_missing_certificate_stops_the_gateway_with_one_line(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    missing = tmp_path / "nowhere" / "ingress.crt"
    ingress = {"tls_cert": str(missing), "tls_key": str(missing.with_suffix(".key"))}
    gw = GatewayProc(
        tmp_path, mosquitto.port, gid=GID, nodes={"n": "pw"}, extra={"ingress": ingress}
    )
    gw.start(wait=False)
    assert gw.proc is not None
    assert gw.proc.wait(60) == 1
    errors = [ln for ln in gw.log.read_text().splitlines() if ln.startswith("pubcomp gateway run:")]
    assert len(errors) == 1, gw.log.read_text()[-2000:]
    assert f"gateways.{GID}.ingress.tls_cert {missing}" in errors[0]
    assert "No such file or directory" in errors[0]
    assert "Traceback" not in gw.log.read_text()


def test_the_reconnect_bench_runs_and_prints_its_ratio() -> None:
    bench = Path(__file__).resolve().parent.parent / "bench" / "node_tls.py"
    done = subprocess.run(
        [sys.executable, str(bench), "--connects", "5"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"^tls / plaintext \(median\): \d+\.\dx$", done.stdout, re.M), done.stdout


def test_a_gateway_that_accepts_and_says_nothing_costs_a_timeout_not_a_reset(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """TCP up, then silence (a stalled gateway, a captive portal): the TLS handshake is
    bounded by gateway.timeout_s and the node tries again, long before its watchdog
    (umqtt itself sets no timeout: the node would hang until the watchdog reset it)."""
    gw = tls_gateway(tmp_path, mosquitto.port)
    cfg, _ = provision(gw, "node-s", tmp_path / "node-s")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(silent.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    cfg = for_the_test(cfg, silent.getsockname()[1], rounds=3)
    cfg["gateway"]["timeout_s"] = 1
    cfg["wdt_ms"] = 15000
    node = NodeProc(tmp_path / "flash", cfg)
    try:
        node.start()
        assert wait_until(lambda: len(held) >= 3, 12), (len(held), node.output()[-2000:])
        assert node.proc is not None and node.proc.poll() is None, node.output()[-2000:]
    finally:
        node.kill()
        silent.close()
        for s in held:
            s.close()
    assert "WDT" not in node.output()
