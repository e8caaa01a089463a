"""The fleet file: every error names the file, the line, the key path and what was expected."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pubcomp.gateway import credentials
from pubcomp.gateway.config import ConfigError, Fleet, sensor_options
from pubcomp.gateway.credentials import hash_password, verify_password
from pubcomp.sensors.pins.simulated import SimulatedFactory
from pubcomp.sensors.registry import build

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "fleet.yaml"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "fleet.yaml"
    p.write_text(textwrap.dedent(text).lstrip())
    return p


BASE = """
fleet: test
defaults:
  uplink: {broker: "mqtt://cloud:1883"}
gateways:
  gw1:
"""


def problems(path: Path) -> list[str]:
    try:
        return Fleet(path).check()
    except ConfigError as exc:
        return exc.problems


def test_the_shipped_example_is_valid_and_covers_every_sensor_type() -> None:
    fleet = Fleet(EXAMPLE)
    assert fleet.check() == []
    assert len(fleet.gateway_ids()) == 2
    types = {s.type for g in fleet.gateway_ids() for s in fleet.gateway(g).sensors}
    assert types == {
        "pulse",
        "digital",
        "ds18b20",
        "pms5003",
        "sds011",
        "nmea",
        "modbus",
        "simulated",
    }
    gw = fleet.gateway("gw-coast-7")
    assert gw.nodes and gw.uplink.password is not None
    assert gw.uplink.password.get_secret_value() == "cloud-password-for-examples-only"
    assert fleet.gateway("gw-harbour-2").store.policy == "drop_oldest"  # override
    assert fleet.gateway("gw-harbour-2").store.quota_mb == 2000  # from defaults


def test_every_example_sensor_builds_a_driver() -> None:
    fleet = Fleet(EXAMPLE)
    gpio = SimulatedFactory()
    for gid in fleet.gateway_ids():
        for s in fleet.gateway(gid).sensors:
            driver = build(s.type, s.id, sensor_options(s), gpio)
            assert driver.sensor == s.id


def test_typo_in_a_key(tmp_path: Path) -> None:
    p = write(
        tmp_path, BASE + "    sensors:\n      - {id: rain, type: pulse, pin: 17, scael: 0.2}\n"
    )
    assert problems(p) == [
        f"{p}:7: gateways.gw1.sensors[0].scael: unknown key (did you mean 'scale'?)"
    ]


def test_typo_in_a_defaults_section_and_at_the_top(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        BASE.replace("defaults:", "defaults:\n  stroe: {}") + "    gpio: auto\n" + "gatways: {}\n",
    )
    assert problems(p) == [
        f"{p}:8: gatways: unknown key (did you mean 'gateways'?)",
        f"{p}:3: defaults.stroe: unknown key (did you mean 'store'?)",
    ]


def test_wrong_type(tmp_path: Path) -> None:
    p = write(tmp_path, BASE + "    uplink: {batch: many, qos: 3}\n")
    assert problems(p) == [
        f"{p}:6: gateways.gw1.uplink.qos: Input should be 1 or 2",
        f"{p}:6: gateways.gw1.uplink.batch: Input should be a valid integer, unable to parse "
        "string as an integer",
    ]


def test_unknown_sensor_type_and_missing_key(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        BASE + "    sensors:\n      - {id: x, type: thermometer}\n"
        "      - {id: pm, type: pms5003}\n",
    )
    assert problems(p) == [
        f"{p}:7: gateways.gw1.sensors[0]: unknown sensor type 'thermometer'; expected one of "
        "digital, ds18b20, modbus, nmea, pms5003, pulse, sds011, sht31, simulated",
        f"{p}:8: gateways.gw1.sensors[1].port: missing: this key is required",
    ]


def test_missing_gateway(tmp_path: Path) -> None:
    p = write(tmp_path, BASE + "    gpio: auto\n")
    with pytest.raises(ConfigError) as err:
        Fleet(p).pick("gw9")
    assert err.value.problems == [
        f"{p}: no gateway 'gw9' under gateways (picked by --gateway); known: gw1 "
        "(did you mean 'gw1'?)"
    ]


def test_missing_secret_file_and_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PUBCOMP_TEST_USER", raising=False)
    p = write(
        tmp_path,
        BASE + "    uplink:\n      password: !secret pw.txt\n"
        "      username: ${PUBCOMP_TEST_USER}\n",
    )
    assert problems(p) == [
        f"{p}:7: gateways.gw1.uplink.password: secret file {tmp_path / 'pw.txt'}: "
        "No such file or directory",
        f"{p}:8: gateways.gw1.uplink.username: environment variable PUBCOMP_TEST_USER is not set",
    ]
    (tmp_path / "pw.txt").write_text("s3cret\n")
    monkeypatch.setenv("PUBCOMP_TEST_USER", "gw-user")
    cfg = Fleet(p).gateway("gw1")
    assert cfg.uplink.password is not None and cfg.uplink.password.get_secret_value() == "s3cret"
    assert cfg.uplink.username == "gw-user"


def test_plain_node_passwords_are_refused(tmp_path: Path) -> None:
    p = write(tmp_path, BASE + "    nodes:\n      - {id: n1, password: hunter2}\n")
    assert problems(p) == [
        f"{p}:7: gateways.gw1.nodes[0].password_hash: missing: this key is required",
        f"{p}:7: gateways.gw1.nodes[0].password: unknown key (did you mean 'password_hash'?)",
    ]


def test_duplicate_sensor_ids(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        BASE + "    sensors:\n      - {id: a, type: simulated}\n      - {id: a, type: simulated}\n",
    )
    assert problems(p) == [f"{p}:8: gateways.gw1.sensors[1].id: duplicate id 'a' (also sensors[0])"]


def test_yaml_syntax_error_has_a_line(tmp_path: Path) -> None:
    p = write(tmp_path, "fleet: t\ngateways:\n  gw1: {uplink: {broker: x}\n")
    assert problems(p) == [
        f"{p}:4: YAML syntax error: expected ',' or '}}', but got '<stream end>'"
    ]


def test_node_password_hashes() -> None:
    h = hash_password("node-7-secret")
    assert h.startswith("scrypt$") and "node-7-secret" not in h
    assert verify_password("node-7-secret", h) and not verify_password("node-7-secreT", h)
    assert not verify_password("x", "not-a-hash")


def test_verifier_remembers_only_a_password_that_verified(monkeypatch: pytest.MonkeyPatch) -> None:
    h = hash_password("right")
    calls: list[bytes] = []
    real = credentials.verify_password
    monkeypatch.setattr(
        credentials, "verify_password", lambda pw, h: calls.append(pw) or real(pw, h)
    )
    v = credentials.Verifier()

    async def checks() -> list[bool]:
        return [
            await v.verify("n1", "right", h),  # scrypt
            await v.verify("n1", b"right", h),  # remembered: no scrypt
            await v.verify("n1", "wrong", h),  # scrypt, refused
            await v.verify("n2", "right", h),  # another node: its own check
        ]

    assert asyncio.run(checks()) == [True, True, False, True]
    assert calls == [b"right", b"wrong", b"right"]


def test_config_commands(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pubcomp", "config", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    ok = run("check", str(EXAMPLE))
    assert ok.returncode == 0 and "2 gateway(s)" in ok.stdout
    shown = run("show", str(EXAMPLE), "--gateway", "gw-coast-7")
    assert shown.returncode == 0
    assert "password: '**********'" in shown.stdout
    assert "cloud-password-for-examples-only" not in shown.stdout
    bad = write(tmp_path, BASE + "    uplink: {qos: 3}\n    sensors: [{id: x, type: nope}]\n")
    res = run("check", str(bad))
    assert res.returncode == 1 and "2 problem(s)" in res.stderr  # all errors at once
