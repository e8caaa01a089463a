"""The broker's ACL shipped in examples/mosquitto/acl, with releases (issue 28): the
operator publishes a gateway's release and the keys document, the gateway reads them
and applies the release; no gateway may write a release topic or the keys document
(refused by the broker, 0x87), so the gateway's release stays what the operator
published."""

from __future__ import annotations

from pathlib import Path

from devkit.broker import Mosquitto
from devkit.checker import publish_retained
from pubcomp.sync import release

from .release_helpers import PREFIX, ReleaseGateway, Signer

ACL = Path(__file__).parent.parent / "examples" / "mosquitto" / "acl"
USERS = {"gw-acl": "pw-gw-acl", "gw-other": "pw-gw-other", "ops": "pw-ops"}
SINE = {"id": "sine", "type": "simulated", "signal": "sine", "interval_s": 0.2}


def _publish(port: int, user: str, topic: str, payload: bytes) -> int:
    return publish_retained(port, topic, payload, user, USERS[user])


def test_only_the_operator_may_publish_releases(tmp_path: Path) -> None:
    broker = Mosquitto(tmp_path / "broker", users=USERS, acl_file=ACL).start()
    try:
        signer = Signer(tmp_path)
        login = {"username": "gw-acl", "password": USERS["gw-acl"]}
        gw = ReleaseGateway(
            tmp_path, broker.port, signer, gid="gw-acl", sensors=[SINE], trial_s=10,
            extra={"uplink": login},
        )  # fmt: skip
        topic = release.release_topic(PREFIX, "gw-acl")
        # Taken (0x10: no one subscribed yet, which is success too).
        assert _publish(broker.port, "ops", release.keys_topic(PREFIX), signer.keys()) < 0x80
        first = signer.release("gw-acl", 1, gw.fleet_text())
        assert _publish(broker.port, "ops", topic, first) < 0x80
        gw.start()
        gw.wait_release(state="committed", version=1, timeout=60)
        forged = signer.release("gw-acl", 2, gw.fleet_text(sensors=[]))
        for user in ("gw-acl", "gw-other"):
            for t in (topic, release.chunk_topic(PREFIX, "gw-acl", 0), release.keys_topic(PREFIX)):
                code = _publish(broker.port, user, t, b"" if t.endswith("keys") else forged)
                assert code == 0x87, f"{user} may publish on {t} ({code:#x})"
        # What the gateway holds is still the operator's: release 1, nothing refused.
        assert gw.rel()["version"] == 1 and gw.rel()["refused"] == {}
        assert set(gw.status()["sensors"]) == {"sine"}
        assert gw.terminate() == 0
    finally:
        broker.stop()
