"""Typed options: dataclass fields that carry their range, help text and units, validated once.

Every user-facing setting of gradsync (an algorithm's options, the shared part of ``train`` and
``bench``) is a field of an :class:`Options` dataclass declared with :func:`option`. The dataclass
validates itself on construction (``ValueError`` naming the field and the allowed range), builds
itself strictly from a mapping (:meth:`Options.from_mapping`: an unknown key is a ``ValueError``
naming the owner and the allowed keys), and generates its command-line flags
(:func:`add_arguments`), so a setting is declared, validated and documented in one place.

Supported field types: ``bool``, ``int``, ``float``, ``str`` (optionally with ``choices``), each
optionally ``| None``; ``int | str`` / ``float | str`` for numbers that also accept ``"auto"``;
``list[str]`` (comma-separated on the command line) and ``dict`` (not on the command line).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from typing import Any, Iterable, Mapping

from .validation import check_choice, check_float, check_int

AUTO = "auto"
#: The algorithm name a checkpoint gives ``"auto"`` decided on the job's own steps
#: (:class:`~gradsync.profiler.online.OnlineAutoState`).
AUTO_ONLINE = "auto-online"


def option(default: Any = dataclasses.MISSING, help: str = "", *, low: float | None = None,
           high: float | None = None, low_open: bool = False, high_open: bool = False,
           choices: Iterable[Any] | None = None, units: str = "", flag: str | None = None,
           cli: bool = True, default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with validation and help metadata.

    Args:
        default: default value (``None`` allowed for optional fields).
        help: one line for ``--help``.
        low, high: inclusive range bounds for numbers (``low_open``/``high_open`` make them exclusive).
        choices: allowed values for strings.
        units: unit shown in ``--help`` (e.g. ``"MB"``, ``"s"``).
        flag: command-line flag (default ``--`` + the field name with dashes).
        cli: ``False`` keeps the field off the command line.
    """
    meta = {"help": help, "low": low, "high": high, "low_open": low_open, "high_open": high_open,
            "choices": None if choices is None else tuple(choices), "units": units, "flag": flag, "cli": cli}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """What :func:`option` declared about one field, with its resolved type."""

    name: str
    base: type          # bool, int, float, str or list
    optional: bool      # None accepted
    auto: bool          # "auto" accepted besides numbers
    default: Any
    meta: Mapping[str, Any]

    @property
    def flag(self) -> str:
        return self.meta.get("flag") or "--" + self.name.replace("_", "-")

    def allowed(self) -> str:
        """The allowed values in words, for messages and ``--help``."""
        m = self.meta
        if m.get("choices"):
            text = "one of " + ", ".join(map(str, m["choices"]))
        elif self.base in (int, float):
            lo = "-inf" if m.get("low") is None else m["low"]
            hi = "inf" if m.get("high") is None else m["high"]
            kind = "an integer" if self.base is int else "a number"
            text = f"{kind} in {'(' if m.get('low_open') else '['}{lo}, {hi}{')' if m.get('high_open') else ']'}"
        elif self.base is bool:
            text = "true or false"
        else:
            text = "a string"
        if self.auto:
            text += " or 'auto'"
        return text

    def check(self, value: Any, owner: str = "") -> Any:
        """Return ``value`` validated (and converted: ``'4'`` is refused, ``4.0`` becomes ``4``).

        Raises:
            ValueError: naming the field (and ``owner``) and the allowed values.
        """
        name = f"{owner}.{self.name}" if owner else self.name
        m = self.meta
        if value is None:
            if self.optional:
                return None
            raise ValueError(f"{name} must be {self.allowed()}, got None")
        if self.auto and value == AUTO:
            return AUTO
        if self.base is bool:
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")
            return value
        if self.base is int:
            if isinstance(value, str):
                raise ValueError(f"{name} must be {self.allowed()}, got {value!r}")
            return check_int(name, value, m.get("low"), m.get("high")) if not (
                m.get("low_open") or m.get("high_open")) else _open_int(name, value, self)
        if self.base is float:
            if isinstance(value, str):
                raise ValueError(f"{name} must be {self.allowed()}, got {value!r}")
            return check_float(name, value, m.get("low"), m.get("high"),
                               low_inclusive=not m.get("low_open"), high_inclusive=not m.get("high_open"))
        if self.base is list:
            if isinstance(value, str):
                value = [a.strip() for a in value.split(",") if a.strip()]
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"{name} must be a list, got {value!r}")
            return list(value)
        if self.base is dict:
            if not isinstance(value, Mapping):
                raise ValueError(f"{name} must be a mapping, got {value!r}")
            return dict(value)
        if not isinstance(value, str):
            raise ValueError(f"{name} must be {self.allowed()}, got {value!r}")
        if m.get("choices"):
            check_choice(name, value, m["choices"])
        return value

    def parse(self, text: str) -> Any:
        """Convert command-line ``text`` to the field's type (``argparse`` type function)."""
        if self.auto and text == AUTO:
            return AUTO
        try:
            if self.base is int:
                number = float(text)
                if not number.is_integer():
                    raise ValueError
                value: Any = int(number)
            elif self.base is float:
                value = float(text)
                if not math.isfinite(value):
                    raise ValueError
            else:
                value = text
            return self.check(value)
        except ValueError as exc:
            detail = str(exc) if self.base is str else f"must be {self.allowed()}, got {text!r}"
            raise argparse.ArgumentTypeError(detail if self.base is str else f"{self.flag} {detail}") from None


def _open_int(name: str, value: Any, spec: FieldSpec) -> int:
    v = check_int(name, value)
    m = spec.meta
    if (m.get("low") is not None and (v < m["low"] or (m.get("low_open") and v == m["low"]))) or (
            m.get("high") is not None and (v > m["high"] or (m.get("high_open") and v == m["high"]))):
        raise ValueError(f"{name} must be {spec.allowed()}, got {v}")
    return v


def _resolve(tp: Any) -> tuple[type, bool, bool]:
    """(base type, optional, auto) of an annotation such as ``int | str | None``."""
    args = typing.get_args(tp) if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union else (tp,)
    optional = type(None) in args
    rest = [a for a in args if a is not type(None)]
    if typing.get_origin(rest[0]) is list:
        return list, optional, False
    if typing.get_origin(rest[0]) is dict or rest[0] is dict:
        return dict, optional, False
    if len(rest) == 2 and str in rest:
        number = next(a for a in rest if a is not str)
        return number, optional, True
    if len(rest) != 1 or rest[0] not in (bool, int, float, str):
        raise TypeError(f"unsupported option type {tp!r}")
    return rest[0], optional, False


def field_specs(cls: type) -> list[FieldSpec]:
    """The :class:`FieldSpec` of every field of the options dataclass ``cls``, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        base, optional, auto = _resolve(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        out.append(FieldSpec(f.name, base, optional, auto, default, f.metadata))
    return out


class Options:
    """Base of options dataclasses (declare the subclass with ``@dataclass`` and :func:`option`
    fields). Fields are validated in ``__post_init__``; ``OWNER`` names the owner in messages."""

    OWNER = ""

    def __post_init__(self) -> None:
        for spec in field_specs(type(self)):
            object.__setattr__(self, spec.name, spec.check(getattr(self, spec.name), self.OWNER))

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None = None, owner: str | None = None):
        """Build from ``values``, refusing keys that are not fields.

        Raises:
            ValueError: for an unknown key (naming ``owner`` and the allowed keys) or a bad value.
        """
        values = dict(values or {})
        unknown = sorted(set(values) - set(cls.keys()))
        if unknown:
            who = owner or cls.OWNER or cls.__name__
            allowed = ", ".join(cls.keys()) or "none"
            raise ValueError(f"{who} does not take option(s) {', '.join(unknown)}; allowed: {allowed}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def add_arguments(parser: argparse.ArgumentParser | Any, cls: type, *, use_defaults: bool = True,
                  skip: Iterable[str] = (), seen: set[str] | None = None,
                  defaults: Mapping[str, Any] | None = None) -> list[FieldSpec]:
    """Add one flag per command-line field of options dataclass ``cls`` to ``parser``.

    With ``use_defaults=False`` every flag defaults to ``None`` ("not given": the owner's default
    applies), which is how algorithm options are generated. ``seen`` collects the flags already added
    (a field shared by several algorithms becomes one flag). Returns the specs of the added flags.
    """
    skip = set(skip)
    seen = set() if seen is None else seen
    defaults = defaults or {}
    added = []
    for spec in field_specs(cls):
        if spec.name in skip or not spec.meta.get("cli", True) or spec.name in seen:
            continue
        seen.add(spec.name)
        m = spec.meta
        default = defaults.get(spec.name, spec.default if use_defaults else None)
        text = m.get("help", "")
        if m.get("units"):
            text += f" ({m['units']})"
        if spec.base is not str or m.get("choices") or spec.auto:
            text += f"; {spec.allowed()}"
        if not use_defaults and spec.name not in defaults:
            text += f" (default {spec.default!r})"
        kwargs: dict[str, Any] = {"dest": spec.name, "default": default, "help": text.replace("%", "%%")}
        if spec.base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif spec.base is list:
            kwargs["type"] = lambda s: [a.strip() for a in s.split(",") if a.strip()]
            kwargs["metavar"] = "A,B,..."
        else:
            kwargs["type"] = spec.parse
            kwargs["metavar"] = spec.name.upper()
        parser.add_argument(spec.flag, **kwargs)
        added.append(spec)
    return added


def values_from_args(cls: type, args: argparse.Namespace, *, given_only: bool = False) -> dict[str, Any]:
    """The fields of ``cls`` found in ``args`` (only those not ``None`` with ``given_only``)."""
    out = {}
    for name in cls.keys() if issubclass(cls, Options) else [f.name for f in dataclasses.fields(cls)]:
        if hasattr(args, name):
            value = getattr(args, name)
            if given_only and value is None:
                continue
            out[name] = value
    return out
