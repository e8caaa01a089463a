"""Connection options: TLS with client certificates and a password file against a real
Mosquitto; keepalive, Receive Maximum, Maximum Packet Size and Maximum QoS against the
scripted broker; QoS 1 mode."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devkit.broker import Mosquitto, free_port
from devkit.checker import Checker, exactly_once_report
from devkit.store_helpers import append
from devkit.uplink_helpers import fill_store, run_uplink, start_uplink, stop_after
from pubcomp.sync.packets import Publish
from pubcomp.sync.store import Reading, Store
from pubcomp.sync.uplink import UplinkConfig
from tests.test_uplink_bad_peers import FakeBroker, run_uplink_against


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1, a client certificate, and a stranger CA."""
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "other-ca"):
        openssl(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-keyout",
            str(d / f"{ca}.key"),
            "-out",
            str(d / f"{ca}.crt"),
            "-subj",
            f"/CN={ca}",
        )
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "")):
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(d / f"{name}.key"),
            "-out",
            str(d / f"{name}.csr"),
            "-subj",
            f"/CN={name}",
        )
        extfile = d / f"{name}.ext"
        extfile.write_text(ext + "\n")
        openssl(
            "x509",
            "-req",
            "-in",
            str(d / f"{name}.csr"),
            "-CA",
            str(d / "ca.crt"),
            "-CAkey",
            str(d / "ca.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            str(d / f"{name}.crt"),
            "-extfile",
            str(extfile),
        )
    return {p.stem + p.suffix.replace(".", "_"): p for p in d.iterdir()}


@pytest.fixture
def tls_broker(tmp_path: Path, pki: dict[str, Path]) -> Iterator[tuple[Mosquitto, int]]:
    tls_port = free_port()
    extra = (
        f"listener {tls_port} 127.0.0.1\n"
        f"cafile {pki['ca_crt']}\ncertfile {pki['server_crt']}\nkeyfile {pki['server_key']}\n"
        "require_certificate true\n"
    )
    broker = Mosquitto(tmp_path / "broker", extra_config=extra).start()
    yield broker, tls_port
    broker.kill()


def test_mqtts_with_client_certificate_delivers(
    tmp_path: Path, tls_broker: tuple[Mosquitto, int], pki: dict[str, Path]
) -> None:
    broker, tls_port = tls_broker
    checker = Checker(broker.port, "telemetry/#").start()
    store = tmp_path / "gw.db"
    expected = fill_store(store, 500)
    try:
        res = run_uplink(
            store,
            f"mqtts://127.0.0.1:{tls_port}",
            "--ca-file",
            str(pki["ca_crt"]),
            "--cert-file",
            str(pki["client_crt"]),
            "--key-file",
            str(pki["client_key"]),
        )
        assert res.returncode == 0, res.stderr
        counts = checker.wait_for(expected, 20)
    finally:
        checker.stop()
    assert exactly_once_report(counts, expected)["missing"] == 0


def test_mqtts_with_an_unknown_ca_is_refused_and_retried(
    tmp_path: Path, tls_broker: tuple[Mosquitto, int], pki: dict[str, Path]
) -> None:
    _, tls_port = tls_broker
    store = tmp_path / "gw.db"
    fill_store(store, 10)
    proc = start_uplink(
        store, f"mqtts://127.0.0.1:{tls_port}", "--ca-file", str(pki["other-ca_crt"])
    )
    summary = stop_after(proc, 2)
    assert "CERTIFICATE_VERIFY_FAILED" in (summary["last_error"] or "")
    assert summary["backlog"] == 10  # nothing lost while it cannot connect
    assert proc.returncode == 0  # SIGTERM: a clean exit


@pytest.fixture
def auth_broker(tmp_path: Path) -> Iterator[Mosquitto]:
    pwfile = tmp_path / "passwd"
    for user, pw in (("gw1", "right horse"), ("checker", "c")):
        subprocess.run(
            ["mosquitto_passwd", "-b", *(["-c"] if user == "gw1" else []), str(pwfile), user, pw],
            check=True,
        )
    broker = Mosquitto(tmp_path / "broker", extra_config=f"password_file {pwfile}\n")
    broker.start()
    yield broker
    broker.kill()


def test_password_is_read_from_a_file(tmp_path: Path, auth_broker: Mosquitto) -> None:
    # The generated config says allow_anonymous true; a password file still checks
    # the users it lists, so a wrong password for gw1 is refused.
    checker = Checker(auth_broker.port, "telemetry/#", username="checker", password="c").start()
    store = tmp_path / "gw.db"
    expected = fill_store(store, 100)
    good, bad = tmp_path / "pw", tmp_path / "wrong"
    good.write_text("right horse\n")  # a trailing newline, as editors write it
    bad.write_text("wrong horse\n")
    try:
        proc = start_uplink(
            store, auth_broker.url, "--username", "gw1", "--password-file", str(bad)
        )
        error = str(stop_after(proc, 1.5)["last_error"])
        assert "refused the connection: not authorized (code 0x87)" in error
        res = run_uplink(store, auth_broker.url, "--username", "gw1", "--password-file", str(good))
        assert res.returncode == 0, res.stderr
        counts = checker.wait_for(expected, 20)
    finally:
        checker.stop()
    assert exactly_once_report(counts, expected)["missing"] == 0


def test_receive_maximum_is_never_exceeded_5_0_3_3_4_7(tmp_path: Path) -> None:
    broker = FakeBroker(connack_props={"receive_maximum": 3})
    _, expected = run_uplink_against(tmp_path, broker, n=300)
    assert broker.max_outstanding == 3
    assert set(broker.delivered) == expected


def test_maximum_packet_size_is_honoured(tmp_path: Path) -> None:
    broker = FakeBroker(connack_props={"maximum_packet_size": 2048})
    _, expected = run_uplink_against(
        tmp_path, broker, n=300, config=UplinkConfig(batch=100, end_to_end=False)
    )
    pubs = [p for p in broker.seen if isinstance(p, Publish)]
    assert max(len(p.payload) for p in pubs) <= 2048 - 512
    assert set(broker.delivered) == expected


def test_maximum_qos_1_downgrades_the_uplink_5_0_3_2_2_11(tmp_path: Path) -> None:
    def puback(pub: Publish, n: int) -> list[Any]:
        from pubcomp.sync.packets import Puback

        return [Puback(pub.packet_id)]  # type: ignore[arg-type]

    broker = FakeBroker(puback, connack_props={"maximum_qos": 1})
    up, expected = run_uplink_against(tmp_path, broker)
    assert {p.qos for p in broker.seen if isinstance(p, Publish)} == {1}
    assert up.metrics()["qos"] == 1
    assert set(broker.delivered) == expected


def test_keepalive_timeout_reconnects(tmp_path: Path) -> None:
    """A broker that stops answering (no PINGRESP, no acks) is left after 1.5 keepalives."""
    answered = [0]

    def stall_once(pub: Publish, n: int) -> list[Any]:
        from pubcomp.sync.packets import Pubrec

        answered[0] += 1
        return [] if answered[0] == 2 else [Pubrec(pub.packet_id)]  # type: ignore[arg-type]

    broker = FakeBroker(stall_once, answer_pings=False)
    up, expected = run_uplink_against(tmp_path, broker, n=50, keepalive=1, timeout=20)
    assert "keepalive" in (up.status.last_error or "")
    assert set(broker.delivered) == expected


def test_qos1_mode_against_mosquitto_with_kills(tmp_path: Path, mosquitto: Mosquitto) -> None:
    """QoS 1 for clouds without QoS 2: nothing lost across kills; any duplicate carries the
    same reading id (the cloud dedup absorbs it)."""
    checker = Checker(mosquitto.port, "telemetry/#").start()
    store = tmp_path / "gw.db"
    expected = fill_store(store, 2000)
    try:
        for crash in ("publish_written:5", "publish_persisted:9"):
            res = run_uplink(store, mosquitto.url, "--qos", "1", "--batch", "10", crash_at=crash)
            assert res.returncode == -signal.SIGKILL
        res = run_uplink(store, mosquitto.url, "--qos", "1", "--batch", "10")
        assert res.returncode == 0, res.stderr
        counts = checker.wait_for(expected, 20)
    finally:
        checker.stop()
    report = exactly_once_report(counts, expected)
    assert report["missing"] == 0 and report["unexpected"] == 0, report


def test_a_row_larger_than_the_broker_takes_is_split_and_sent_whole(tmp_path: Path) -> None:
    """A node's 100 readings are one outbox row (about 11 kB of JSON); a broker that takes
    2 kB packets gets them in several PUBLISHes, each reading once, with its own id."""
    with Store(tmp_path / "gw.db", gateway_id="gw1") as store:
        first, last = append(
            store, (Reading(f"s{i}", float(i), "2026-11-21T00:00:00.000Z", "C") for i in range(100))
        )
        big = {f"gw1/{store.epoch}/{seq}" for seq in range(first, last + 1)}
        assert len(store.waiting_rows(0, 100)) == 1
    broker = FakeBroker(connack_props={"maximum_packet_size": 2048})
    _, expected = run_uplink_against(
        tmp_path, broker, n=5, config=UplinkConfig(batch=100, end_to_end=False)
    )
    pubs = [p for p in broker.seen if isinstance(p, Publish)]
    assert len(pubs) > 5 and max(len(p.payload) for p in pubs) <= 2048 - 512
    assert set(broker.delivered) == expected | big
    assert set(broker.delivered.values()) == {1}
