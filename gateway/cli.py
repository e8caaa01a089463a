"""Commands of the gateway part: ``pubcomp config``, ``pubcomp gateway run|make-cert``,
``pubcomp node provision|update``, ``pubcomp status``."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    cfg = sub.add_parser("config", help="the fleet configuration file")
    csub = cfg.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = csub.add_parser("check", help="validate a fleet file; print every problem")
    check.add_argument("fleet", help="fleet YAML file")
    check.set_defaults(handler=_run("config_check"))
    show = csub.add_parser("show", help="one gateway's effective configuration, secrets masked")
    show.add_argument("fleet", help="fleet YAML file")
    show.add_argument("--gateway", help="gateway id (default: this host's name)")
    show.set_defaults(handler=_run("config_show"))
    hp = csub.add_parser("hash-password", help="hash a node password for the fleet file")
    hp.add_argument("--password-file", help="read the password from a file (default: prompt)")
    hp.set_defaults(handler=_run("hash_password"))

    gw = sub.add_parser("gateway", help="the gateway daemon")
    gsub = gw.add_subparsers(dest="gateway_command", metavar="ACTION", required=True)
    run = gsub.add_parser("run", help="run the gateway (the systemd service's command)")
    _fleet_args(run)
    run.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    run.set_defaults(handler=_run("gateway_run"))

    mc = gsub.add_parser(
        "make-cert", help="the ingress's TLS key and certificate (self-signed, or by a site CA)"
    )
    mc.add_argument("--gateway", required=True, help="gateway id (the certificate's first name)")
    mc.add_argument("--out-dir", required=True, help="where ingress.key and ingress.crt go")
    mc.add_argument(
        "--name",
        action="append",
        metavar="HOST_OR_IP",
        help="another name or IP address nodes may use for the gateway (repeatable)",
    )
    mc.add_argument("--days", type=int, default=3650, help="validity in days (default 3650)")
    mc.add_argument("--ca-cert", help="sign with this site CA certificate (PEM) ...")
    mc.add_argument("--ca-key", help="... and its key (PEM, unencrypted)")
    mc.add_argument("--force", action="store_true", help="replace an existing key and certificate")
    mc.set_defaults(handler=_run_in("tls", "make_cert_command"))

    node = sub.add_parser("node", help="microcontroller nodes of a gateway")
    nsub = node.add_subparsers(dest="node_command", metavar="ACTION", required=True)
    pv = nsub.add_parser(
        "provision",
        help="new password, its hash in the fleet file, the node's config.json (also rotates)",
    )
    _fleet_args(pv)
    pv.add_argument("--node", required=True, metavar="NODE-ID", help="the node's id")
    pv.add_argument("--wifi-ssid", help="the site's Wi-Fi network")
    pv.add_argument("--wifi-password-file", help="a file holding the Wi-Fi password")
    pv.add_argument("--out", metavar="DIR", help="where config.json goes (default nodes/NODE-ID)")
    pv.add_argument(
        "--address", help="the gateway's address for nodes (default ingress.node_address)"
    )
    pv.add_argument("--template", help="a config.json to start from (sensors, sampling)")
    pv.add_argument(
        "--plaintext",
        action="store_true",
        help="no TLS: the node's password crosses Wi-Fi in clear",
    )
    pv.set_defaults(handler=_run_in("provision", "provision_command"))

    up = nsub.add_parser(
        "update",
        help="new software for nodes, through the gateway, in waves (run on the gateway)",
    )
    _fleet_args(up)
    which = up.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--node", action="append", metavar="NODE-ID", help="a node to update (repeatable)"
    )
    which.add_argument("--all", action="store_true", help="every node of the gateway")
    up.add_argument(
        "--files",
        required=True,
        metavar="DIR|VERSION",
        help="the library to offer (firmware/lib: compiled with mpy-cross), an ESP32 image "
        "(--format image), or the version of a set made before",
    )
    up.add_argument(
        "--format",
        choices=("mpy", "py", "image"),
        default="mpy",
        help="mpy (default: as deploy.sh copies), py (sources: the host port, or any board), "
        "or image (--files is a MicroPython app image for an ESP32's OTA partition)",
    )
    up.add_argument("--label", help="what the set is, as the status shows it (default: its path)")
    up.add_argument(
        "--waves",
        default="1,100%",
        help="cumulative wave ends, counts or shares of the nodes (default 1,100%%: a canary)",
    )
    up.add_argument(
        "--timeout", type=float, default=900.0, help="seconds a wave may take (default 900)"
    )
    up.add_argument(
        "--max-failures",
        type=int,
        default=0,
        help="failed nodes a wave may have before the rollout halts (default 0)",
    )
    up.add_argument(
        "--chunk", type=int, default=1024, help="bytes per chunk (default 1024; 64-16384)"
    )
    up.add_argument("--no-wait", action="store_true", help="offer to every node at once and exit")
    up.set_defaults(handler=_run_in("nodeupdate", "node_update"))

    st = sub.add_parser("status", help="the running gateway's state, as a table")
    _fleet_args(st)
    st.add_argument("--json", action="store_true", help="print the raw status JSON")
    st.set_defaults(handler=_run("status"))


def _fleet_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, metavar="FLEET.yaml", help="the fleet file")
    p.add_argument("--gateway", help="gateway id (default: this host's name)")


def _run_in(module: str, name: str) -> str:
    return f"{__package__}.{module}:{name}"


def _run(name: str) -> str:
    return _run_in("commands", name)
