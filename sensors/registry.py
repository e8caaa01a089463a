"""Sensor types: each driver module declares its own; everything else reads them here.

A driver module ends with its declaration (sht31.py is a complete example)::

    class SHT31Options(SensorOptions):      # the fleet entry's keys, validated by pydantic
        type: Literal["sht31"]
        bus: int | str = 1
        ...

    SENSOR = SensorType(
        "sht31", SHT31Options, build, needs={Need.I2C},
        summary="Sensirion SHT31 temperature and humidity over I2C",
    )

- the name is the fleet file's ``type:`` (and ``pubcomp sensor test --type``);
- the options model is the entry's keys: ``id`` and ``type`` from ``SensorOptions``,
  the rest the driver's own; ``pubcomp config check`` reports what it refuses with the
  file, the line and the key (gateway/config.py), ``pubcomp sensor test`` likewise;
- ``needs`` is what the caller must provide, as a gpiozero device asks its pin factory
  for pins: ``GPIO`` (an input pin from the gateway's backend: ``Provided.gpio``),
  ``SERIAL`` (a port the driver opens: the ``port`` option), ``I2C`` (a bus the driver
  opens: the ``bus`` option), ``STATE`` (a value the gateway commits with each reading,
  ``Driver.saved_state()``, and hands back as ``Provided.saved`` at the next build);
- ``build(options, provided)`` makes the driver. It imports the hardware library
  (smbus2, pymodbus) when it runs, never at the module's top: declaring a type costs
  nothing, and a gateway without I2C sensors never imports smbus2.

The registry imports every module of this package once, the first time a type is
looked up, and keeps each one's ``SENSOR``. The gateway's config validation and
wiring (gateway/config.py, gateway/drivers.py) and ``pubcomp sensor test`` all derive
from it, so a new sensor type is one module, its test and its section in
docs/sensors.md.
"""

from __future__ import annotations

import enum
import functools
import importlib
import pkgutil
import typing
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from types import ModuleType
from typing import Annotated, Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .api import Driver
from .errors import SensorConfigError
from .pins import PinFactory


class Need(enum.StrEnum):
    """What a sensor type needs its caller to provide (see the module docstring)."""

    GPIO = "gpio"
    SERIAL = "serial"
    I2C = "i2c"
    STATE = "state"


# The option through which a type is given what it needs (its options model must have it).
NEED_OPTION = {Need.GPIO: "pin", Need.SERIAL: "port", Need.I2C: "bus"}


class SensorOptions(BaseModel):
    """A sensor entry of the fleet file: its id, its type, and (in a subclass) the driver's
    options. Unknown keys are refused (with a "did you mean"), entries are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    type: str


@dataclass(frozen=True, slots=True)
class Provided:
    """What the caller (the gateway, ``pubcomp sensor test``) gives a driver for its needs."""

    gpio: PinFactory | None = None  # Need.GPIO
    saved: str | None = None  # Need.STATE: saved with its last committed reading, or None


Opts = TypeVar("Opts", bound=SensorOptions)


@dataclass(frozen=True)
class SensorType(Generic[Opts]):
    """One sensor type, as its driver module declares it (see the module docstring)."""

    name: str
    options: type[Opts]
    build: Callable[[Opts, Provided], Driver]
    needs: AbstractSet[Need] = frozenset()
    summary: str = ""
    # With Need.STATE: the saved value lives in the store under f"{state_key}/{sensor id}".
    state_key: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "needs", frozenset(self.needs))
        where = f"sensor type {self.name!r} ({self.options.__module__})"
        declared = self.options.model_fields.get("type")
        if declared is None or typing.get_args(declared.annotation) != (self.name,):
            raise SensorConfigError(
                f"{where}: its options model {self.options.__name__} must say "
                f'type: Literal["{self.name}"]'
            )
        for need, option in NEED_OPTION.items():
            if need in self.needs and option not in self.options.model_fields:
                raise SensorConfigError(f"{where} needs {need.value}: it has no {option!r} option")
        if (Need.STATE in self.needs) != (self.state_key is not None):
            raise SensorConfigError(f"{where}: Need.STATE and state_key go together")

    def saved_key(self, sensor: str) -> str:
        """Where the gateway keeps this sensor's saved state (Need.STATE)."""
        if self.state_key is None:
            raise SensorConfigError(f"sensor type {self.name!r} saves no state")
        return f"{self.state_key}/{sensor}"

    def parse(self, entry: Mapping[str, Any]) -> Opts:
        """A fleet-file-shaped entry ({id, type, options...}) as this type's options."""
        try:
            return self.options.model_validate(dict(entry))
        except ValidationError as exc:
            raise SensorConfigError(_render(entry.get("id"), exc)) from None


def _render(sensor: Any, exc: ValidationError) -> str:
    problems = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(entry)"
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        problems.append(f"{key}: {msg}")
    return f"sensor {sensor}: " + "; ".join(problems)


def discover(package: ModuleType) -> dict[str, SensorType[Any]]:
    """Every ``SENSOR`` declared by a module of ``package``, by name (sorted)."""
    found: dict[str, SensorType[Any]] = {}
    declared_in: dict[str, str] = {}
    for info in pkgutil.iter_modules(package.__path__):
        if info.ispkg or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        kind = getattr(module, "SENSOR", None)
        if kind is None:
            continue
        if not isinstance(kind, SensorType):
            raise SensorConfigError(f"{module.__name__}.SENSOR is not a SensorType")
        if kind.name in found:
            raise SensorConfigError(
                f"sensor type {kind.name!r} is declared twice: in "
                f"{declared_in[kind.name]} and in {module.__name__}"
            )
        found[kind.name], declared_in[kind.name] = kind, module.__name__
    return dict(sorted(found.items()))


@functools.cache
def sensor_types() -> dict[str, SensorType[Any]]:
    """Every sensor type of this package, by name (found once, on the first call)."""
    return discover(importlib.import_module(__package__ or "pubcomp.sensors"))


def names() -> tuple[str, ...]:
    return tuple(sensor_types())


def get(kind: str) -> SensorType[Any]:
    try:
        return sensor_types()[kind]
    except KeyError:
        raise SensorConfigError(
            f"unknown sensor type {kind!r}; one of {', '.join(sensor_types())}"
        ) from None


def build_from(cfg: SensorOptions, provided: Provided | None = None) -> Driver:
    """The driver for a validated entry (the gateway's fleet file)."""
    kind = get(cfg.type)
    provided = provided or Provided()
    if not isinstance(cfg, kind.options):
        raise SensorConfigError(f"sensor {cfg.id}: its options are not {kind.options.__name__}")
    if Need.GPIO in kind.needs and provided.gpio is None:
        raise SensorConfigError(f"sensor {cfg.id}: type {cfg.type} needs a GPIO backend")
    return kind.build(cfg, provided)


def build(
    kind: str,
    sensor: str,
    options: Mapping[str, Any],
    gpio: PinFactory | None = None,
    saved: str | None = None,
) -> Driver:
    """A driver from a type name and its options as a mapping (``pubcomp sensor test``),
    validated by the type's model as the fleet file's entries are."""
    cfg = get(kind).parse({**options, "id": sensor, "type": kind})
    return build_from(cfg, Provided(gpio=gpio, saved=saved))


def needing(need: Need) -> tuple[str, ...]:
    """The names of the types that need ``need``."""
    return tuple(name for name, kind in sensor_types().items() if need in kind.needs)
