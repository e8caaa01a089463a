"""``pubcomp node provision``: a node's password, its hash in the fleet file, its config.json.

The password is made here, hashed into the fleet file, and written only into
the node's config.json (mode 0600): never to the terminal, a log or the fleet
file. Provisioning a node that is already in the fleet file replaces its hash:
that is password rotation.

It also writes the node's **update key** (gateway/nodesets.py): derived from
the password as the node derives it, in ``node-keys/{gateway}/{node}.key``
beside the fleet file (mode 0600), for `pubcomp node update` to sign the
node's software offers with. Rotating the password rotates the key.

The fleet file is edited as text, one line at a time, so its comments, its
flow-style entries and its layout stay as the operator wrote them (a YAML
round-trip rewraps long flow mappings and re-indents sequences). The edit is
checked by loading the result: it must equal the old file's data with only
this node's entry added or changed.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import secrets
import sys
from pathlib import Path
from typing import Any

import yaml

from .config import Fleet, GatewayConfig, _Loader
from .credentials import hash_password
from .errors import CertError, ConfigError, ProvisionError
from .nodesets import key_file, update_key, write_key
from .tls import first_certificate, server_name

PASSWORD_BYTES = 24  # 32 URL-safe characters, 192 bits
# A new node's settings (firmware/lib/pubnode/config.py DEFAULTS); a node that
# already has a config.json in --out keeps its own.
NODE_DEFAULTS: dict[str, Any] = {
    "wifi": {"ssid": "", "password": "", "timeout_s": 20},
    "gateway": {"host": "", "port": 1883, "keepalive_s": 60, "timeout_s": 10},
    "node": {"id": "", "password": ""},
    "interval_s": 10,
    "buffer_readings": 500,
    "spill": {"mode": "overflow", "dir": "spill", "segments": 4, "segment_bytes": 32768},
    "deep_sleep": False,
    "ntp": True,
    "wdt_ms": 30000,
    "led": {"pin": None, "active_high": True},
    "sensors": [],
}


# ------------------------------------------------------------------ the fleet file


def _last_line_end(text: str, node: yaml.Node) -> int:
    """The index just past the last line that ``node`` occupies (before its newline)."""
    while True:
        if isinstance(node, yaml.MappingNode) and node.value and not node.flow_style:
            node = node.value[-1][1]
        elif isinstance(node, yaml.SequenceNode) and node.value and not node.flow_style:
            node = node.value[-1]
        else:
            break
    end = text.find("\n", node.end_mark.index)
    return len(text) if end < 0 else end


def _key(mapping: yaml.MappingNode, name: str) -> tuple[yaml.Node, yaml.Node] | None:
    for k, v in mapping.value:
        if isinstance(k, yaml.ScalarNode) and k.value == name:
            return k, v
    return None


def edit_fleet_text(text: str, path: Path, gid: str, node_id: str, pw_hash: str) -> str:
    """The fleet file's text with ``node_id``'s hash added under ``gid`` (or replaced)."""
    entry = f'{{id: {node_id}, password_hash: "{pw_hash}"}}'
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    gateways = _key(root, "gateways") if isinstance(root, yaml.MappingNode) else None
    gw = _key(gateways[1], gid) if gateways and isinstance(gateways[1], yaml.MappingNode) else None
    if gw is None:
        raise ProvisionError(f"{path}: gateways.{gid}: no such gateway")
    gk, gv = gw
    where = f"{path}:{gk.start_mark.line + 1}: gateways.{gid}"
    if not isinstance(gv, yaml.MappingNode) or gv.flow_style or not gv.value:
        raise ProvisionError(f"{where}: not a block mapping; add the node by hand")
    nodes = _key(gv, "nodes")
    if nodes is None:
        # A `nodes:` key after the gateway's last line, indented like its other keys.
        at = _last_line_end(text, gv)
        ind = " " * gv.start_mark.column
        return text[:at] + f"\n{ind}nodes:\n{ind}  - {entry}" + text[at:]
    nk, seq = nodes
    where = f"{path}:{nk.start_mark.line + 1}: gateways.{gid}.nodes"
    if isinstance(seq, yaml.ScalarNode) and seq.value in ("", "~", "null"):
        # `nodes:` with nothing after it
        at = text.find("\n", nk.end_mark.index)
        at = len(text) if at < 0 else at
        ind = " " * nk.start_mark.column
        return text[:at] + f"\n{ind}  - {entry}" + text[at:]
    if not isinstance(seq, yaml.SequenceNode):
        raise ProvisionError(f"{where}: expected a list")
    for item in seq.value:
        if not isinstance(item, yaml.MappingNode):
            continue
        got = _key(item, "id")
        if got is None or got[1].value != node_id:
            continue
        hashed = _key(item, "password_hash")
        if hashed is None or not isinstance(hashed[1], yaml.ScalarNode):
            line = item.start_mark.line + 1
            raise ProvisionError(
                f"{path}:{line}: gateways.{gid}.nodes: {node_id}: no password_hash"
            )
        v = hashed[1]
        return text[: v.start_mark.index] + f'"{pw_hash}"' + text[v.end_mark.index :]
    if seq.flow_style:
        close = seq.end_mark.index - 1  # the "]"
        sep = ", " if seq.value else ""
        return text[:close] + sep + entry + text[close:]
    at = _last_line_end(text, seq)
    ind = " " * seq.start_mark.column  # the column of the items' "-"
    return text[:at] + f"\n{ind}- {entry}" + text[at:]


def _load(text: str) -> Any:
    loader = _Loader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _expected(old: Any, gid: str, node_id: str, pw_hash: str) -> Any:
    want = copy.deepcopy(old)
    gw = want["gateways"][gid]
    nodes = gw.get("nodes") or []
    for n in nodes:
        if isinstance(n, dict) and n.get("id") == node_id:
            n["password_hash"] = pw_hash
            break
    else:
        nodes.append({"id": node_id, "password_hash": pw_hash})
    gw["nodes"] = nodes
    return want


def _write_atomically(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ------------------------------------------------------------------ the node's config


def _tls_material(cfg: GatewayConfig, fleet: Path) -> tuple[int, str, str | None]:
    """(port, PEM the node pins, server name) of the gateway's TLS listener."""
    ing = cfg.ingress
    key = f"{fleet}: gateways.{cfg.id}.ingress"
    if not ing.tls_cert:
        raise ProvisionError(
            f"{key}.tls_cert: not set: the gateway has no TLS listener (pubcomp gateway "
            "make-cert), or pass --plaintext to send the node's password in clear"
        )
    port = ing.tls_port if ing.tls_port is not None else ing.port
    pin_key, pin_path = ("tls_ca", ing.tls_ca) if ing.tls_ca else ("tls_cert", ing.tls_cert)
    try:
        pin = first_certificate(Path(pin_path).read_bytes(), f"{key}.{pin_key} {pin_path}")
        name = server_name(Path(ing.tls_cert).read_bytes())
    except OSError as exc:
        raise ProvisionError(f"{key}.{pin_key}: {exc.filename}: {exc.strerror}") from None
    except CertError as exc:
        raise ProvisionError(str(exc)) from None
    return port, pin.decode(), name


def node_config(
    cfg: GatewayConfig,
    fleet: Path,
    node_id: str,
    password: str,
    base: dict[str, Any],
    *,
    address: str | None,
    plaintext: bool,
    wifi_ssid: str | None,
    wifi_password: str | None,
) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in NODE_DEFAULTS.items():
        out.setdefault(k, copy.deepcopy(v))
    ing = cfg.ingress
    host = address or ing.node_address
    if not host:
        host = ing.host if ing.host not in ("", "0.0.0.0", "::") else None
    if not host:
        raise ProvisionError(
            f"{fleet}: gateways.{cfg.id}.ingress.node_address: not set (the address nodes reach "
            "the gateway at); set it or pass --address"
        )
    gw = dict(out.get("gateway") or {})
    for k in ("tls", "ca", "server_hostname"):
        gw.pop(k, None)
    if plaintext:
        port = ing.port if not (ing.tls_cert and ing.tls_port is None) else None
        if port is None:
            raise ProvisionError(
                f"{fleet}: gateways.{cfg.id}.ingress: no plaintext listener (tls_cert is set "
                "and tls_port is not)"
            )
    else:
        port, pin, name = _tls_material(cfg, fleet)
        gw.update(tls=True, ca=pin, server_hostname=name or host)
    if port == 0:
        raise ProvisionError(f"{fleet}: gateways.{cfg.id}.ingress: port 0 is chosen at start-up")
    gw.update(host=host, port=port)
    out["gateway"] = {**NODE_DEFAULTS["gateway"], **gw}
    out["node"] = {"id": node_id, "password": password}
    wifi = {**NODE_DEFAULTS["wifi"], **(out.get("wifi") or {})}
    if wifi_ssid is not None:
        wifi["ssid"] = wifi_ssid
    if wifi_password is not None:
        wifi["password"] = wifi_password
    out["wifi"] = wifi
    return out


# ------------------------------------------------------------------ the command


def provision(args: argparse.Namespace) -> tuple[Path, bool, list[str]]:
    """Do it; (config.json written, whether the node was new, notes for the operator).

    The update key is written with the node's config.json, before the fleet file."""
    fleet_path = Path(args.config)
    try:
        fleet = Fleet(fleet_path)
        gid = fleet.pick(args.gateway)
        cfg = fleet.gateway(gid)
    except ConfigError as exc:
        raise ProvisionError(exc.problems[0]) from None
    if not _valid_id(args.node):
        raise ProvisionError(f"--node {args.node!r}: expected 1-64 of A-Z a-z 0-9 _ . -")
    out_dir = Path(args.out) if args.out else Path("nodes") / args.node
    out_file = out_dir / "config.json"
    base: dict[str, Any] = {}
    src = out_file if out_file.exists() else (Path(args.template) if args.template else None)
    if src is not None:
        try:
            base = json.loads(src.read_text())
        except OSError as exc:
            raise ProvisionError(f"{src}: cannot read: {exc.strerror}") from None
        except ValueError as exc:
            raise ProvisionError(f"{src}: not valid JSON: {exc}") from None
        if not isinstance(base, dict):
            raise ProvisionError(f"{src}: must hold a JSON object")
    wifi_password = None
    if args.wifi_password_file:
        try:
            wifi_password = Path(args.wifi_password_file).read_text().rstrip("\r\n")
        except OSError as exc:
            raise ProvisionError(f"--wifi-password-file {exc.filename}: {exc.strerror}") from None

    password = secrets.token_urlsafe(PASSWORD_BYTES)
    new_cfg = node_config(
        cfg,
        fleet_path,
        args.node,
        password,
        base,
        address=args.address,
        plaintext=args.plaintext,
        wifi_ssid=args.wifi_ssid,
        wifi_password=wifi_password,
    )
    pw_hash = hash_password(password)

    text = fleet_path.read_text(encoding="utf-8")
    old = _load(text)
    new_text = edit_fleet_text(text, fleet_path, gid, args.node, pw_hash)
    if _load(new_text) != _expected(old, gid, args.node, pw_hash):
        raise ProvisionError(f"{fleet_path}: gateways.{gid}.nodes: could not edit it safely")
    was_new = not any(n.id == args.node for n in cfg.nodes)

    # The node's config first: a fleet file that names a password no config holds
    # would lock the node out; the other way round only wastes a password.
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_atomically(out_file, (json.dumps(new_cfg, indent=2) + "\n").encode(), 0o600)
    key_path = key_file(fleet_path, gid, args.node)
    write_key(key_path, update_key(password, args.node))
    mode = fleet_path.stat().st_mode & 0o777
    _write_atomically(fleet_path, new_text.encode("utf-8"), mode)

    notes = [f"update key: {key_path} (mode 0600; `pubcomp node update` signs with it)"]
    if not new_cfg["wifi"]["ssid"]:
        notes.append("wifi.ssid is empty: pass --wifi-ssid or edit the config")
    if not new_cfg["wifi"]["password"]:
        notes.append("wifi.password is empty: pass --wifi-password-file or edit the config")
    if not new_cfg["sensors"]:
        notes.append("sensors is empty: add the node's sensors (docs/firmware.md)")
    return out_file, was_new, notes


def _valid_id(node: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", node) is not None


def provision_command(args: argparse.Namespace) -> int:
    try:
        out_file, was_new, notes = provision(args)
    except ProvisionError as exc:
        print(f"pubcomp node provision: {exc}", file=sys.stderr)
        return 1
    what = "added to" if was_new else "password replaced in"
    print(f"node {args.node}: {what} {args.config} (gateway {args.gateway or 'by host name'})")
    print(f"config for the board: {out_file} (mode 0600; holds the node's password)")
    for n in notes:
        print(f"note: {n}")
    print(f"next: firmware/deploy.sh PORT {out_file}")
    print("then restart the gateway to load the new hash: systemctl restart pubcomp-gateway")
    return 0
