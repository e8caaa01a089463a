"""`pubcomp node provision` and `pubcomp gateway make-cert` as an operator runs them, on a
copy of examples/fleet.yaml (comments, flow-style entries, a !secret): the fleet file
changes by exactly the node's line, the password is only in the node's config.json,
rotating replaces the hash, and bad input is one line naming the file and the key."""

from __future__ import annotations

import difflib
import json
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from pubcomp.gateway.config import Fleet
from pubcomp.gateway.credentials import verify_password
from pubcomp.gateway.nodesets import update_key

ROOT = Path(__file__).resolve().parent.parent
GID = "gw-coast-7"


def pubcomp(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pubcomp", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.fixture
def fleet(tmp_path: Path) -> Path:
    """examples/fleet.yaml with gw-coast-7 given a TLS listener beside its plaintext one."""
    shutil.copytree(ROOT / "examples" / "secrets", tmp_path / "secrets")
    done = pubcomp("gateway", "make-cert", "--gateway", GID, "--out-dir", str(tmp_path / "tls"),
                   "--name", "192.168.7.1")  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = (ROOT / "examples" / "fleet.yaml").read_text()
    anchor = "    uplink:\n      client_id: gw-coast-7\n"
    assert anchor in text
    ingress = (
        "    ingress:\n"
        f"      tls_cert: {tmp_path / 'tls' / 'ingress.crt'}\n"
        f"      tls_key: {tmp_path / 'tls' / 'ingress.key'}\n"
        "      tls_port: 8883       # plaintext 1883 stays open while nodes move over\n"
        "      node_address: 192.168.7.1\n"
    )
    path = tmp_path / "fleet.yaml"
    path.write_text(text.replace(anchor, anchor + ingress))
    return path


def provision(
    fleet: Path, node: str, *extra: str, gid: str = GID
) -> subprocess.CompletedProcess[str]:
    out = fleet.parent / "nodes" / node
    return pubcomp("node", "provision", "--config", str(fleet), "--gateway", gid,
                   "--node", node, "--out", str(out), *extra)  # fmt: skip


def changed_lines(before: str, after: str) -> list[str]:
    diff = difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
    return [ln for ln in diff if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]


def node_hash(fleet: Path, node: str, gid: str = GID) -> str:
    return next(n.password_hash for n in Fleet(fleet).gateway(gid).nodes if n.id == node)


def test_a_new_node_is_one_added_line_and_a_ready_config(fleet: Path) -> None:
    before = fleet.read_text()
    wifi = fleet.parent / "wifi-pw"
    wifi.write_text("cabinet-wifi-secret\n")
    done = provision(fleet, "node-9", "--wifi-ssid", "cabinet-7", "--wifi-password-file", str(wifi))
    assert done.returncode == 0, done.stderr
    after = fleet.read_text()
    lines = changed_lines(before, after)
    assert len(lines) == 1 and lines[0].startswith('+      - {id: node-9, password_hash: "scrypt$')
    # It went in after node-8, and every comment of the file is still there.
    assert after.index("id: node-9") > after.index("id: node-8")
    assert [ln for ln in before.splitlines() if "#" in ln] == [
        ln for ln in after.splitlines() if "#" in ln
    ]
    config = fleet.parent / "nodes" / "node-9" / "config.json"
    cfg = json.loads(config.read_text())
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    password = cfg["node"]["password"]
    assert len(password) >= 32 and cfg["node"]["id"] == "node-9"
    assert verify_password(password, node_hash(fleet, "node-9"))
    gw = cfg["gateway"]
    assert (gw["host"], gw["port"], gw["tls"], gw["server_hostname"]) == (
        "192.168.7.1",
        8883,
        True,
        GID,
    )
    assert gw["ca"] == (fleet.parent / "tls" / "ingress.crt").read_text()
    assert cfg["wifi"]["ssid"] == "cabinet-7" and cfg["wifi"]["password"] == "cabinet-wifi-secret"
    assert cfg["interval_s"] == 10 and cfg["spill"]["mode"] == "overflow"
    # The password is in config.json only: not on the terminal, not in the fleet file.
    assert password not in done.stdout + done.stderr + after
    assert "cabinet-wifi-secret" not in done.stdout + done.stderr
    check = pubcomp("config", "check", str(fleet))
    assert check.returncode == 0, check.stderr
    # The update key (pubcomp node update signs the node's software with it): derived from
    # the password as the node derives it, beside the fleet file, for the owner only.
    key = fleet.parent / "node-keys" / GID / "node-9.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert key.read_text().strip() == update_key(password, "node-9").hex()
    assert f"update key: {key}" in done.stdout


def test_rotating_replaces_the_hash_and_keeps_the_nodes_settings(fleet: Path) -> None:
    assert provision(fleet, "node-7").returncode == 0  # node-7 is already in the file
    config = fleet.parent / "nodes" / "node-7" / "config.json"
    cfg = json.loads(config.read_text())
    cfg["sensors"] = [{"kind": "ds18b20", "name": "t-probe", "pin": 4}]  # set up by hand
    cfg["interval_s"] = 30
    config.write_text(json.dumps(cfg))
    first, before = cfg["node"]["password"], fleet.read_text()
    done = provision(fleet, "node-7")
    assert done.returncode == 0, done.stderr
    after = fleet.read_text()
    lines = changed_lines(before, after)
    assert len(lines) == 2 and all("id: node-7, password_hash:" in ln for ln in lines), lines
    rotated = json.loads(config.read_text())
    second = rotated["node"]["password"]
    assert second != first
    assert verify_password(second, node_hash(fleet, "node-7"))
    assert not verify_password(first, node_hash(fleet, "node-7"))  # the old one is dead
    assert rotated["sensors"] == cfg["sensors"] and rotated["interval_s"] == 30
    assert "password replaced" in done.stdout
    assert second not in done.stdout + done.stderr + after
    assert [n.id for n in Fleet(fleet).gateway(GID).nodes] == ["node-7", "node-8"]
    key = (fleet.parent / "node-keys" / GID / "node-7.key").read_text().strip()
    assert key == update_key(second, "node-7").hex()  # rotated with the password


def test_a_gateway_without_nodes_gets_a_nodes_list(fleet: Path) -> None:
    before = fleet.read_text()
    done = provision(fleet, "tide-1", "--plaintext", "--address", "10.1.2.3", gid="gw-harbour-2")
    assert done.returncode == 0, done.stderr
    lines = changed_lines(before, fleet.read_text())
    assert lines[0] == "+    nodes:" and lines[1].startswith("+      - {id: tide-1, ")
    assert len(lines) == 2
    cfg = json.loads((fleet.parent / "nodes" / "tide-1" / "config.json").read_text())
    assert cfg["gateway"]["host"] == "10.1.2.3" and cfg["gateway"]["port"] == 1883
    assert "tls" not in cfg["gateway"]
    assert verify_password(cfg["node"]["password"], node_hash(fleet, "tide-1", "gw-harbour-2"))


@pytest.mark.parametrize(
    ("node", "args", "gid", "expected"),
    [
        ("node-x", (), "gw-nope", "no gateway 'gw-nope' under gateways"),
        ("bad id!", (), GID, "--node 'bad id!': expected 1-64 of"),
        ("node-x", ("--address", "10.0.0.1"), "gw-harbour-2", "ingress.tls_cert: not set"),
        ("node-x", ("--plaintext",), "gw-harbour-2", "ingress.node_address: not set"),
    ],
)
def test_bad_input_is_one_line_and_changes_nothing(
    fleet: Path, node: str, args: tuple[str, ...], gid: str, expected: str
) -> None:
    before = fleet.read_text()
    done = provision(fleet, node, *args, gid=gid)
    assert done.returncode == 1
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and expected in err[0], done.stderr
    assert err[0].startswith("pubcomp node provision: ")
    if not node.startswith("bad"):
        assert f"{fleet}: " in err[0] and "gateways" in err[0], err[0]  # the file and the key
    assert fleet.read_text() == before
    assert not (fleet.parent / "nodes").exists()


def test_make_cert_key_names_and_refusal_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "tls"
    done = pubcomp("gateway", "make-cert", "--gateway", "gw-1", "--out-dir", str(out),
                   "--name", "gw-1.local", "--name", "10.0.0.7")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE((out / "ingress.key").stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate((out / "ingress.crt").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["gw-1", "gw-1.local"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    fp = cert.fingerprint(hashes.SHA256()).hex(":")
    assert fp in done.stdout
    again = pubcomp("gateway", "make-cert", "--gateway", "gw-1", "--out-dir", str(out))
    assert again.returncode == 1 and "exists; pass --force" in again.stderr
    assert x509.load_pem_x509_certificate((out / "ingress.crt").read_bytes()) == cert


def test_make_cert_signed_by_a_site_ca(tmp_path: Path) -> None:
    import datetime as dt

    ca_key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "site CA")])
    now = dt.datetime.now(dt.UTC)
    ca = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(ca_key.public_key()).serial_number(1)
        .not_valid_before(now).not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    (tmp_path / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "ca.key").write_bytes(
        ca_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    ca_args = ("--ca-cert", str(tmp_path / "ca.crt"), "--ca-key", str(tmp_path / "ca.key"))
    out = str(tmp_path / "tls")
    done = pubcomp("gateway", "make-cert", "--gateway", "gw-2", "--out-dir", out, *ca_args)
    assert done.returncode == 0, done.stderr
    assert "tls_ca:" in done.stdout
    cert = x509.load_pem_x509_certificate((tmp_path / "tls" / "ingress.crt").read_bytes())
    cert.verify_directly_issued_by(ca)  # raises if the CA did not sign it
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_ingress_tls_keys_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(
        "fleet: f\ngateways:\n  gw:\n    uplink: {broker: 'mqtt://127.0.0.1:1883'}\n"
        "    ingress:\n      tls_port: 8883\n"
    )
    done = pubcomp("config", "check", str(path))
    assert done.returncode == 1
    assert f"{path}:5: gateways.gw.ingress: Value error, tls_port needs tls_cert" in done.stderr
