"""gateway/release_render.py: a gateway's effective configuration as a release carries
it, and the history and keys folder a release is kept in (sync/releasedir.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

from pubcomp.gateway.config import Fleet
from pubcomp.gateway.errors import ConfigError
from pubcomp.gateway.release_render import render
from pubcomp.sync import release as rel
from pubcomp.sync.releasedir import History, KeyDir, ReleaseDirError, Target, load_signing_key

FLEET = """\
fleet: coast
defaults:
  uplink:
    broker: mqtt://cloud.example:1883
    password: !secret secrets/uplink-password
    batch: 50
  store: {quota_mb: 100}
  gpio: simulated
gateways:
  gw-1:
    uplink: {batch: 20, landed_key: !secret gw-1-landed.key}
    sensors:
      - {id: tide, type: simulated, signal: sine, unit: m, interval_s: 10}
  gw-2:
    uplink: {username: "${GW2_USER}"}
"""


def write(tmp: Path, text: str = FLEET) -> Path:
    (tmp / "secrets").mkdir(exist_ok=True)
    (tmp / "secrets" / "uplink-password").write_text("s3cret-value\n")
    f = tmp / "fleet.yaml"
    f.write_text(text)
    return f


def test_rendered_config_has_the_defaults_merged_and_secrets_as_references(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GW2_USER", "coast-2")
    f = write(tmp_path)
    (tmp_path / "gw-1-landed.key").write_text("ab" * 32 + "\n")
    r1, r2 = render(str(f))
    assert "s3cret-value" not in r1.config and "abab" not in r1.config
    doc = yaml.safe_load(r1.config.replace("!secret", ""))
    assert list(doc) == ["fleet", "gateways"] and list(doc["gateways"]) == ["gw-1"]
    up = doc["gateways"]["gw-1"]["uplink"]
    assert up["batch"] == 20 and up["broker"] == "mqtt://cloud.example:1883"
    assert "!secret 'secrets/uplink-password'" in r1.config
    assert "${GW2_USER}" in r2.config and "coast-2" not in r2.config
    assert r1.sha256 == rel.sha256_hex(r1.config)
    assert (r1.prefix, r1.status_topic) == ("telemetry", "telemetry/gw-1/status")
    assert not r1.notes


def test_rendered_config_reads_back_as_the_same_effective_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the gateway will do with it: gateway/config.py, its secrets beside the file.
    monkeypatch.setenv("GW2_USER", "coast-2")
    f = write(tmp_path)
    (tmp_path / "gw-1-landed.key").write_text("ab" * 32 + "\n")
    r1 = render(str(f), ["gw-1"])[0]
    there = tmp_path / "on-gateway"
    there.mkdir()
    write(there, r1.config)
    (there / "gw-1-landed.key").write_text("ab" * 32 + "\n")
    assert Fleet(there / "fleet.yaml").gateway("gw-1") == Fleet(f).gateway("gw-1")


def test_a_secret_missing_on_this_machine_is_a_note_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GW2_USER", raising=False)
    f = write(tmp_path)
    r1, r2 = render(str(f))
    assert any("gw-1-landed.key" in n and "the gateway resolves it" in n for n in r1.notes)
    assert any("GW2_USER" in n for n in r2.notes)


def test_validation_errors_name_the_file_and_line_as_config_check_does(tmp_path: Path) -> None:
    f = write(
        tmp_path, FLEET.replace("batch: 20", "batch: 0").replace("interval_s: 10", "intervl_s: 10")
    )
    (tmp_path / "gw-1-landed.key").write_text("ab" * 32 + "\n")
    with pytest.raises(ConfigError) as exc:
        render(str(f), ["gw-1"])
    text = "\n".join(exc.value.problems)
    assert f"{f}:11: gateways.gw-1.uplink.batch" in text
    assert (
        f"{f}:13: gateways.gw-1.sensors[0].intervl_s: unknown key (did you mean 'interval_s'?)"
        in text
    )


def test_a_secret_written_in_clear_is_refused(tmp_path: Path) -> None:
    f = write(tmp_path, FLEET.replace("!secret secrets/uplink-password", "hunter2"))
    with pytest.raises(ConfigError) as exc:
        render(str(f), ["gw-2"])
    assert "gateways.gw-2.uplink.password: a secret in clear would travel" in exc.value.problems[0]


def test_an_unknown_gateway_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no gateway 'gw-9'"):
        render(str(write(tmp_path)), ["gw-9"])


# ------------------------------------------------------------------ history and keys


def _sign(version: int, t: Target) -> bytes:
    return rel.encode(
        {
            "signed": rel.release_document(
                fleet="coast",
                gateway=t.gateway,
                version=version,
                config="x",
                created=datetime.now(UTC),
                expires=datetime.now(UTC) + timedelta(days=1),
            ),
            "signatures": [{"keyid": "00", "sig": "00"}],
        }
    )


def test_versions_only_go_up_and_never_below_what_the_fleet_has_seen(tmp_path: Path) -> None:
    h = History(tmp_path / "h")
    t = [Target("gw-1", "telemetry", "telemetry/gw-1/status", rel.sha256_hex("x"))]
    assert h.add("coast", "now", t, _sign).version == 1
    assert h.add("coast", "now", t, _sign).version == 2
    # A history lost or copied from elsewhere: the broker showed version 40.
    assert h.add("coast", "now", t, _sign, at_least=40).version == 41
    assert History(tmp_path / "h").counter() == 41
    assert h.versions() == [1, 2, 41]
    assert h.find("gw-1", rel.sha256_hex("x")).version == 41  # type: ignore[union-attr]
    assert h.find("gw-1", rel.sha256_hex("x"), below=41).version == 2  # type: ignore[union-attr]
    assert not list(h.path.glob("*.tmp"))


def test_keys_folder_init_rotate_and_a_retired_signing_key(tmp_path: Path) -> None:
    kd = KeyDir(tmp_path / "keys")
    _key, path = kd.init(datetime.now(UTC) + timedelta(days=10))
    assert (kd.path / "root.key").stat().st_mode & 0o777 == 0o600
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_signing_key(path)[1].version == 1
    with pytest.raises(ReleaseDirError, match="already holds a root key"):
        kd.init(datetime.now(UTC) + timedelta(days=10))
    _new, new_path = kd.rotate(datetime.now(UTC) + timedelta(days=10))
    doc = load_signing_key(new_path)[1]
    assert doc.version == 2 and len(doc.keys) == 1
    with pytest.raises(ReleaseDirError, match="not in the keys document version 2"):
        load_signing_key(path)
    # What a gateway does with it: the root's public key accepts the document.
    t = rel.Trust(rel.load_public((kd.path / "root.pub").read_text()))
    assert t.accept_keys(kd.doc_path.read_bytes(), datetime.now(UTC))
