"""What a release's configuration must pass on this gateway before it is staged.

- **Validation**: the text is a fleet file (gateway/config.py) that holds this
  gateway, every problem with the file (where it will be kept), the line and the key;
  ``!secret`` paths are relative to the gateway's own configuration folder (the
  ``--config`` file's), where its local secret files are: a release names them, never
  carries them.
- **Nothing a release may not move**: the store's path (the apply state and every
  waiting reading are in it) and the gateway's id. Moving those is a visit.
- **Drivers in check mode**: every sensor entry is built by its type's builder
  (sensors/registry.py) without being started, on simulated pins: the running gateway
  holds the real ones. A GPIO backend other than the running one is loaded and closed
  at once, so a release that names ``rpigpio`` on a board without RPi.GPIO is refused
  here, not discovered by a gateway that cannot start.
"""

from __future__ import annotations

from pathlib import Path

from pubcomp.sensors.errors import GPIOUnavailable, SensorError
from pubcomp.sensors.pins import make_factory
from pubcomp.sensors.pins.simulated import SimulatedFactory
from pubcomp.sensors.registry import Need, Provided, build_from, get

from .config import Fleet, GatewayConfig, _dotted, _line
from .errors import ConfigError


def parse_release_config(
    text: str, path: Path, gateway: str, secrets_dir: Path
) -> tuple[Fleet, GatewayConfig]:
    """The release's effective configuration for ``gateway``; ``ConfigError`` (every
    problem, as ``pubcomp config check`` prints them) when it is not valid."""
    fleet = Fleet(path, text=text, secrets_dir=secrets_dir)
    if gateway not in fleet.gateway_ids():
        has = ", ".join(fleet.gateway_ids())
        raise ConfigError([f"{path}:1: gateways: no gateway {gateway!r} (it has {has})"])
    problems = fleet.check()
    if problems:
        raise ConfigError(problems)
    return fleet, fleet.gateway(gateway)


def unmovable(new: GatewayConfig, running: GatewayConfig) -> list[str]:
    out = []
    if Path(new.store.path).resolve() != Path(running.store.path).resolve():
        out.append(
            f"store.path: {new.store.path} is not the running gateway's {running.store.path} "
            "(the store holds the apply state and every waiting reading: moving it is a visit)"
        )
    if new.id != running.id:
        out.append(f"gateway id {new.id!r} is not {running.id!r}")
    return out


def check_drivers(fleet: Fleet, cfg: GatewayConfig, running_gpio: str) -> list[str]:
    """Every sensor built, none started; the problems as ``file:line: key: why``."""
    problems: list[str] = []

    def where(*path: object) -> str:
        shown = fleet._shown(cfg.id, tuple(path))
        return f"{fleet.path}:{_line(fleet.pos, shown)}: {_dotted(shown)}"

    needs_gpio = any(Need.GPIO in get(s.type).needs for s in cfg.sensors)
    if needs_gpio and cfg.gpio not in (running_gpio, "simulated"):
        try:
            make_factory(cfg.gpio).close()
        except (GPIOUnavailable, SensorError, OSError) as exc:
            problems.append(f"{where('gpio')}: GPIO backend {cfg.gpio!r} cannot be loaded: {exc}")
            return problems
    pins = SimulatedFactory()
    try:
        for i, s in enumerate(cfg.sensors):
            try:
                gpio = pins if Need.GPIO in get(s.type).needs else None
                build_from(s, Provided(gpio=gpio, saved=None))
            except Exception as exc:  # a builder may raise anything: each is a refusal
                problems.append(
                    f"{where('sensors', i)}: sensor {s.id} ({s.type}) cannot be built: "
                    f"{type(exc).__name__}: {exc}"
                )
    finally:
        pins.close()
    return problems
