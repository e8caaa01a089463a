"""The fleet file: one YAML for every gateway, validated with pydantic v2.

Layout::

    fleet: coast-north
    defaults: {uplink: ..., store: ..., ingress: ..., health: ..., gpio: auto}
    gateways:
      gw-7: {uplink: {client_id: gw-7}, sensors: [...], nodes: [...]}

A gateway's effective configuration is ``defaults`` deep-merged with its own
section. Every error names the file, the line, the key path and what was
expected; an unknown key gets a "did you mean". Secrets never sit in the file:
``!secret path/to/file`` (relative to the fleet file) or ``${ENV_VAR}``.
"""

from __future__ import annotations

import difflib
import os
import re
import socket
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from pubcomp.sensors.registry import SensorOptions, sensor_types
from pubcomp.sync.wire import parse_key

from .errors import ConfigError

Pos = dict[tuple[Any, ...], int]  # key path -> 1-based line


# ------------------------------------------------------------------ models


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class UplinkSection(_Model):
    broker: str
    client_id: str | None = None  # default: the gateway id
    protocol: Literal["5", "3.1.1"] = "5"
    qos: Literal[1, 2] = 2
    topic_prefix: str = "telemetry"
    batch: Annotated[int, Field(ge=1, le=10_000)] = 100
    max_bytes: Annotated[int, Field(ge=1024)] = 128 * 1024
    # A message short of a full batch waits this long for more readings: fewer,
    # fuller messages, so fewer session transitions to commit (docs/architecture.md).
    linger_ms: Annotated[float, Field(ge=0, le=60_000)] = 500
    # On `systemctl stop`: deliver what waits for up to this long (then it stays stored).
    drain_on_stop_s: Annotated[float, Field(ge=0, le=60)] = 5
    # A message the broker refuses (PUBACK/PUBREC >= 0x80, not a permanent reason) is
    # sent again under a new id after a back-off (0.5 s doubling to 30 s); after this
    # many refusals it goes to the dead letters (counted, in status and metrics).
    max_refusals: Annotated[int, Field(ge=1, le=1000)] = 10
    # End to end (docs/architecture.md, rule 9): a reading the broker completed stays in
    # the store until the cloud ingest says it is landed; one not landed within
    # landed_timeout_s is published again (the wait doubling while nothing lands, up to
    # an hour). false: readings go at the broker's PUBCOMP (a cloud without pubcomp's
    # ingest); the status says so.
    end_to_end: bool = True
    landed_timeout_s: Annotated[float, Field(ge=1, le=3600)] = 120
    # This gateway's acknowledgement key (64 hex digits, `pubcomp ingest landed-key`):
    # with it, only an ingest holding the fleet's master key can make it let readings go.
    landed_key: SecretStr | None = None
    keepalive: Annotated[int, Field(ge=0, le=65535)] = 30
    username: str | None = None
    password: SecretStr | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    @field_validator("landed_key")
    @classmethod
    def _key(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None:
            parse_key(v.get_secret_value(), "landed_key")
        return v

    @field_validator("broker")
    @classmethod
    def _url(cls, v: str) -> str:
        if not re.match(r"^(mqtts?|tcp|ssl)://[^/@]+$", v):
            raise ValueError("expected mqtt://host:port or mqtts://host:port, no credentials")
        return v


class StoreSection(_Model):
    path: str = "/var/lib/pubcomp/gateway.db"
    quota_mb: Annotated[float, Field(gt=0)] | None = None
    policy: Literal["refuse_new", "drop_oldest"] = "refuse_new"
    # How long a node's PUBACK may wait for other messages to share its fsync.
    commit_delay_ms: Annotated[float, Field(ge=0, le=1000)] = 20  # bench/wear.py
    # A node that sends seldom may have its PUBACK held for 5 % of the time between its
    # messages, up to this long, so a quiet fleet's messages share fsyncs (0: never
    # longer than commit_delay_ms).
    commit_delay_max_ms: Annotated[float, Field(ge=0, le=10_000)] = 500  # bench/wear.py
    # How long sensor readings (nobody waits for them) may wait for a commit.
    sensor_delay_ms: Annotated[float, Field(ge=0, le=60_000)] = 1000
    # The card's rated endurance, for the projected life on the status page.
    flash_endurance_tbw: Annotated[float, Field(gt=0)] = 10.0
    # An audit trail: one JSON line per committed sensor reading, appended after its
    # commit (gateway/commitlog.py; docs/operations.md). Unset: none. It grows unbounded.
    commit_log: str | None = None


class IngressSection(_Model):
    """Where nodes connect. Listeners (``Ingress.listeners``):

    - ``tls_cert`` unset: one plaintext listener on ``port``;
    - ``tls_cert`` set, ``tls_port`` unset: one TLS listener on ``port``;
    - ``tls_cert`` and ``tls_port`` set: plaintext on ``port`` and TLS on
      ``tls_port`` side by side, while nodes move over (docs/operations.md).
    """

    enabled: bool = True
    host: str = "0.0.0.0"
    port: Annotated[int, Field(ge=0, le=65535)] = 1883
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_port: Annotated[int, Field(ge=0, le=65535)] | None = None
    # The certificate nodes pin (`pubcomp node provision` ships it): a site CA that
    # signed tls_cert; unset, tls_cert itself (self-signed, `pubcomp gateway make-cert`).
    tls_ca: str | None = None
    # The address nodes use to reach this gateway (`pubcomp node provision`).
    node_address: str | None = None
    max_payload_bytes: Annotated[int, Field(ge=64)] = 64 * 1024
    max_readings_per_message: Annotated[int, Field(ge=1)] = 500
    max_messages_per_second: Annotated[float, Field(gt=0)] = 50.0
    # What one client may cost (docs/failure-model.md, "Hostile clients"). Connections
    # over a limit are closed at once and counted (pubcomp_ingress_refused_connections_total),
    # never logged one by one. max_connections plus 256 must fit the process's file
    # descriptor limit (the unit's LimitNOFILE=1024): the gateway checks at start.
    max_connections: Annotated[int, Field(ge=1, le=65_000)] = 256
    # Connections not yet logged in (TLS handshake, CONNECT, password check: 10 s at most).
    max_pending_logins: Annotated[int, Field(ge=1)] = 64
    max_pending_logins_per_address: Annotated[int, Field(ge=1)] = 8
    # A client that reads nothing of what the gateway sends it for this long is closed.
    write_timeout_s: Annotated[float, Field(gt=0, le=300)] = 10.0

    @model_validator(mode="after")
    def _limits(self) -> IngressSection:
        if self.max_pending_logins > self.max_connections:
            raise ValueError(
                f"max_pending_logins {self.max_pending_logins} is more than "
                f"max_connections {self.max_connections}"
            )
        return self

    @model_validator(mode="after")
    def _tls(self) -> IngressSection:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together (pubcomp gateway make-cert)")
        if self.tls_port is not None and not self.tls_cert:
            raise ValueError("tls_port needs tls_cert and tls_key")
        if self.tls_ca and not self.tls_cert:
            raise ValueError("tls_ca needs tls_cert and tls_key")
        if self.tls_port is not None and self.tls_port == self.port and self.port != 0:
            raise ValueError(f"tls_port {self.tls_port} is also the plaintext port")
        return self


class HealthSection(_Model):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 9101


class StatusSection(_Model):
    """The gateway's health, published to the cloud broker (gateway/fleetstatus.py).

    A retained QoS 1 message on its own connection (the uplink's broker, TLS and
    credentials; client id ``{gateway}-status``), with a Will that marks the
    gateway offline. Sent at each connection, when something changes (at most
    every ``min_interval_s``) and at least every ``heartbeat_s``.
    """

    enabled: bool = True
    # Default: {uplink.topic_prefix}/{gateway}/status (docs/wire-format.md).
    topic: str | None = None
    min_interval_s: Annotated[float, Field(ge=1, le=3600)] = 10.0
    heartbeat_s: Annotated[float, Field(ge=5, le=86400)] = 300.0

    @field_validator("topic")
    @classmethod
    def _topic(cls, v: str | None) -> str | None:
        if v is not None and (not v or "+" in v or "#" in v or v.startswith("$")):
            raise ValueError("expected a topic name: not empty, no wildcards, not under $")
        return v

    @model_validator(mode="after")
    def _intervals(self) -> StatusSection:
        if self.heartbeat_s < self.min_interval_s:
            raise ValueError(
                f"heartbeat_s {self.heartbeat_s:g} is shorter than min_interval_s "
                f"{self.min_interval_s:g}"
            )
        return self


GpioName = Literal["auto", "rpigpio", "gpiozero", "simulated"]


# Each sensor type's options model is declared by its driver module (sensors/registry.py);
# the fleet file's `sensors:` entries are their union, told apart by `type`.
_SENSOR_MODELS: dict[str, type[SensorOptions]] = {
    name: kind.options for name, kind in sensor_types().items()
}
SENSOR_TYPES = tuple(_SENSOR_MODELS)

if typing.TYPE_CHECKING:
    SensorConfig = SensorOptions
else:
    SensorConfig = Annotated[
        typing.Union[tuple(dict.fromkeys(_SENSOR_MODELS.values()))],  # noqa: UP007
        Field(discriminator="type"),
    ]


class NodeConfig(_Model):
    id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    # Produced by `pubcomp config hash-password`; never the password itself.
    password_hash: Annotated[str, Field(pattern=r"^scrypt\$")]


class GatewayConfig(_Model):
    """A gateway's effective configuration: defaults merged with its own section."""

    id: str
    fleet: str
    uplink: UplinkSection
    store: StoreSection = StoreSection()
    ingress: IngressSection = IngressSection()
    health: HealthSection = HealthSection()
    status: StatusSection = StatusSection()
    gpio: GpioName = "auto"
    sensors: list[SensorConfig] = []
    nodes: list[NodeConfig] = []

    def client_id(self) -> str:
        return self.uplink.client_id or self.id

    def status_topic(self) -> str:
        return self.status.topic or f"{self.uplink.topic_prefix}/{self.id}/status"


SECTIONS = ("uplink", "store", "ingress", "health", "status", "gpio")
TOP_KEYS = ("fleet", "defaults", "gateways")
GATEWAY_KEYS = (*SECTIONS, "sensors", "nodes")


# ------------------------------------------------------------------ loading


@dataclass(frozen=True)
class _SecretRef:
    path: str
    line: int


class _Loader(yaml.SafeLoader):
    pass


def _secret(loader: _Loader, node: yaml.Node) -> _SecretRef:
    return _SecretRef(loader.construct_scalar(node), node.start_mark.line + 1)  # type: ignore[arg-type]


_Loader.add_constructor("!secret", _secret)
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _positions(node: yaml.Node, path: tuple[Any, ...], out: Pos) -> None:
    out[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = k.value
            out[(*path, key)] = k.start_mark.line + 1
            _positions(v, (*path, key), out)
            out[(*path, key)] = k.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _positions(item, (*path, i), out)


def load_yaml(path: Path) -> tuple[Any, Pos]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror}"]) from None
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([f"{where}: YAML syntax error: {problem}"]) from None
    finally:
        loader.dispose()
    pos: Pos = {}
    if node is not None:
        _positions(node, (), pos)
    return data, pos


@dataclass
class _Resolver:
    """Replaces !secret and ${ENV} with their values, collecting what is missing."""

    file: Path
    pos: Pos
    errs: list[str]
    shown: Any  # effective path -> the path as written in the file

    def __call__(self, value: Any, path: tuple[Any, ...] = ()) -> Any:
        if isinstance(value, dict):
            return {k: self(v, (*path, k)) for k, v in value.items()}
        if isinstance(value, list):
            return [self(v, (*path, i)) for i, v in enumerate(value)]
        if isinstance(value, _SecretRef):
            secret = (self.file.parent / value.path).resolve()
            try:
                return secret.read_text(encoding="utf-8").rstrip("\r\n")
            except OSError as exc:
                self.errs.append(
                    f"{self.file}:{value.line}: {_dotted(self.shown(path))}: secret file "
                    f"{secret}: {exc.strerror}"
                )
                return None
        if isinstance(value, str) and "${" in value:
            return _ENV.sub(lambda m: self._env(m.group(1), path), value)
        return value

    def _env(self, name: str, path: tuple[Any, ...]) -> str:
        if name in os.environ:
            return os.environ[name]
        shown = self.shown(path)
        self.errs.append(
            f"{self.file}:{_line(self.pos, shown)}: {_dotted(shown)}: environment variable "
            f"{name} is not set"
        )
        return ""


def _dotted(path: tuple[Any, ...]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top)"


def _line(pos: Pos, path: tuple[Any, ...]) -> int:
    while path and path not in pos:
        path = path[:-1]
    return pos.get(path, 1)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _suggest(key: str, choices: Any) -> str:
    close = difflib.get_close_matches(str(key), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """Every pydantic model inside an annotation (list[X], X | None, Annotated unions)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _model_at(loc: tuple[Any, ...], data: Any) -> type[BaseModel] | None:
    """The model that holds the last key of ``loc`` (to suggest a known key for a typo)."""
    model: type[BaseModel] | None = GatewayConfig
    cur = data
    for part in loc[:-1]:
        if isinstance(part, str):
            if model is None and isinstance(cur, dict):
                model = _SENSOR_MODELS.get(str(cur.get("type")))  # inside a sensor entry
            field = model.model_fields.get(part) if model else None
            candidates = _models_in(field.annotation) if field else []
            model = candidates[0] if len(candidates) == 1 else None
        cur = cur[part] if isinstance(cur, dict | list) and _has(cur, part) else None
    if model is None and isinstance(cur, dict):
        model = _SENSOR_MODELS.get(str(cur.get("type")))
    return model


def _has(container: Any, key: Any) -> bool:
    if isinstance(container, list):
        return isinstance(key, int) and key < len(container)
    return key in container


def _strip_tags(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """pydantic puts the union tag in the path (sensors.0.pulse.pin): take it out."""
    return tuple(
        p
        for i, p in enumerate(loc)
        if not (i >= 2 and loc[i - 2] == "sensors" and isinstance(loc[i - 1], int))
        or p not in _SENSOR_MODELS
    )


class Fleet:
    """A parsed fleet file: ``gateway(id)`` gives one gateway's effective config."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        data, self.pos = load_yaml(self.path)
        errs: list[str] = []

        def where(p: tuple[Any, ...]) -> str:
            return f"{self.path}:{_line(self.pos, p)}"

        if not isinstance(data, dict):
            raise ConfigError([f"{self.path}:1: expected a mapping with {', '.join(TOP_KEYS)}"])
        for key in data:
            if key not in TOP_KEYS:
                errs.append(f"{where((key,))}: {key}: unknown key{_suggest(key, TOP_KEYS)}")
        self.name = data.get("fleet")
        if not isinstance(self.name, str) or not self.name:
            errs.append(f"{where(('fleet',))}: fleet: expected the fleet's name (a string)")
        self.defaults = data.get("defaults") or {}
        if not isinstance(self.defaults, dict):
            errs.append(f"{where(('defaults',))}: defaults: expected a mapping")
            self.defaults = {}
        for key in self.defaults:
            if key not in SECTIONS:
                errs.append(
                    f"{where(('defaults', key))}: defaults.{key}: unknown key"
                    f"{_suggest(key, SECTIONS)}"
                )
        self.gateways = data.get("gateways") or {}
        if not isinstance(self.gateways, dict) or not self.gateways:
            errs.append(f"{where(('gateways',))}: gateways: expected at least one gateway")
            self.gateways = {}
        if errs:
            raise ConfigError(errs)

    def gateway_ids(self) -> list[str]:
        return [str(g) for g in self.gateways]

    def pick(self, gateway: str | None) -> str:
        """``--gateway ID``, else this host's name, else the fleet's only gateway."""
        if gateway is None and len(self.gateways) == 1:
            host = socket.gethostname()
            return host if host in self.gateways else next(iter(self.gateways))
        wanted = gateway or socket.gethostname()
        if wanted not in self.gateways:
            how = "--gateway" if gateway else "the host name (use --gateway ID)"
            raise ConfigError(
                [
                    f"{self.path}: no gateway {wanted!r} under gateways (picked by {how}); "
                    f"known: {', '.join(self.gateway_ids())}{_suggest(wanted, self.gateway_ids())}"
                ]
            )
        return wanted

    def gateway(self, gid: str) -> GatewayConfig:
        own = self.gateways.get(gid) or {}
        errs: list[str] = []
        if not isinstance(own, dict):
            line = _line(self.pos, ("gateways", gid))
            raise ConfigError([f"{self.path}:{line}: gateways.{gid}: expected a mapping"])
        raw_defaults = {k: v for k, v in self.defaults.items() if k in SECTIONS}
        merged = _merge(raw_defaults, own)
        merged = {"id": str(gid), "fleet": self.name, **merged}
        merged = _Resolver(self.path, self.pos, errs, lambda p: self._shown(gid, p))(merged)
        try:
            cfg = GatewayConfig.model_validate(merged)
        except ValidationError as exc:
            errs += [self._render(gid, e, merged) for e in exc.errors()]
            cfg = None
        if cfg is not None:
            errs += self._check_unique(gid, cfg)
        if errs or cfg is None:
            raise ConfigError(errs)
        return cfg

    def check(self) -> list[str]:
        """Every problem in the file (all gateways), as printable lines."""
        problems: list[str] = []
        for gid in self.gateway_ids():
            try:
                self.gateway(gid)
            except ConfigError as exc:
                problems += exc.problems
        return list(dict.fromkeys(problems))  # the same defaults error once, not per gateway

    # -- error rendering

    def _shown(self, gid: str, loc: tuple[Any, ...]) -> tuple[Any, ...]:
        """Where an effective key was written: the gateway's own section, else defaults."""
        own = ("gateways", gid, *loc)
        if own not in self.pos and ("defaults", *loc) in self.pos:
            return ("defaults", *loc)
        return own

    def _render(self, gid: str, err: Any, merged: dict[str, Any]) -> str:
        loc = _strip_tags(tuple(err["loc"]))
        shown = self._shown(gid, loc)
        msg = err["msg"]
        kind = err["type"]
        if kind == "extra_forbidden":
            model = _model_at(loc, merged)
            known = [f for f in (model.model_fields if model else {}) if f not in ("id", "fleet")]
            msg = f"unknown key{_suggest(loc[-1], known)}"
        elif kind == "missing":
            msg = "missing: this key is required"
        elif kind == "union_tag_invalid":
            tag = err["ctx"]["tag"]
            msg = f"unknown sensor type {tag!r}; expected one of {', '.join(SENSOR_TYPES)}"
        elif kind == "union_tag_not_found":
            msg = f"missing 'type'; expected one of {', '.join(SENSOR_TYPES)}"
        return f"{self.path}:{_line(self.pos, shown)}: {_dotted(shown)}: {msg}"

    def _check_unique(self, gid: str, cfg: GatewayConfig) -> list[str]:
        errs = []
        groups: tuple[tuple[str, Sequence[SensorOptions | NodeConfig]], ...] = (
            ("sensors", cfg.sensors),
            ("nodes", cfg.nodes),
        )
        for kind, items in groups:
            seen: dict[str, int] = {}
            for i, item in enumerate(items):
                if item.id in seen:
                    path = ("gateways", gid, kind, i, "id")
                    errs.append(
                        f"{self.path}:{_line(self.pos, path)}: {_dotted(path)}: duplicate id "
                        f"{item.id!r} (also {kind}[{seen[item.id]}])"
                    )
                seen.setdefault(item.id, i)
        return errs


def sensor_options(sensor: SensorOptions) -> dict[str, Any]:
    """A sensor entry's options as a mapping (sensors.registry.build takes them so, as
    ``pubcomp sensor test --option`` gives them)."""
    return sensor.model_dump(exclude={"id", "type"}, exclude_none=True)
