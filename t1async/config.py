"""One declaration per setting: a component's settings are one frozen dataclass whose fields carry their help
(``setting(default, "help")``); from it come the command-line flags, the TOML file's keys and their checks.

    @dataclass(frozen=True)
    class Settings:
        lr: float = setting(1e-4, "learning rate", gt=0)
        advantage: Advantage = setting(Advantage.GAE, "the advantage estimator")

    add_arguments(parser, Settings)              # --lr FLOAT, --advantage {gae,turn}, --config FILE.toml
    cfg = resolve(Settings, args)                # defaults < preset < TOML file < flags, then checked

Flags are named after the fields (``batch_turns`` -> ``--batch-turns``) and typed by the annotation: ``bool`` gives
``--x/--no-x``, an ``Enum`` or ``Literal`` gives choices, ``tuple[str, ...]`` a repeatable flag (or one
comma-separated value with ``sep=","``), ``Path``/``int``/``float``/``str`` their type. Every flag defaults to
"not given", so a value from a preset or the TOML file stands unless a flag overrides it. A TOML file's keys are
the same names (``-`` or ``_``); an unknown key is an error that lists the valid ones. A subclass may set a new
default for an inherited field (``max_new_tokens: int = 128``) and keeps the base's help and bounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from t1async.protocol.errors import ConfigError

__all__ = [
    "setting",
    "add_arguments",
    "load_toml",
    "from_namespace",
    "resolve",
    "check_bounds",
    "to_toml",
    "flag_name",
    "like",
    "code_only",
]

_MISSING: Any = dataclasses.MISSING


def setting(
    default: Any = _MISSING,
    help: str = "",
    *,
    factory: Any = _MISSING,
    metavar: str | None = None,
    group: str | None = None,
    sep: str | None = None,
    choices: Iterable[str] | None = None,
    cli: bool = True,
    repr: bool = True,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
) -> Any:
    """A dataclass field with its help text, flag group and bounds (``ge``/``gt``/``le``, checked on load);
    ``repr=False`` keeps a secret out of the config's repr."""
    meta = {
        "help": help,
        "metavar": metavar,
        "group": group,
        "sep": sep,
        "choices": tuple(choices) if choices is not None else None,
        "cli": cli,
        "ge": ge,
        "gt": gt,
        "le": le,
    }
    if factory is not _MISSING:
        return dataclasses.field(default_factory=factory, repr=repr, metadata=meta)
    return dataclasses.field(default=default, repr=repr, metadata=meta)


def like(cls: type, name: str, default: Any = _MISSING, **changes: Any) -> Any:
    """A field declared as ``cls``'s field ``name`` (its help, bounds, default), under another name or with
    another default: ``sampler_dtype: Dtype = like(SamplerSettings, "dtype", group="samplers")``."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    meta = {**f.metadata, **changes}
    if default is _MISSING:
        default = _default(f)
    return dataclasses.field(default=default, metadata=meta)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


# ------------------------------------------------------------------------------------------ introspection


class _Spec(typing.NamedTuple):
    name: str
    base: Any  # the type without None: bool, int, float, str, Path, an Enum class, tuple, dict
    optional: bool
    choices: tuple[str, ...] | None
    elem: Any  # a tuple's element type
    length: int | None  # a fixed-length tuple's length
    meta: Mapping[str, Any]
    default: Any


def _meta(cls: type, name: str) -> Mapping[str, Any]:
    """The field's metadata, from the nearest class in the MRO that gave it help (a subclass that only changes
    the default keeps its base's help)."""
    for klass in cls.__mro__:
        if dataclasses.is_dataclass(klass):
            for f in dataclasses.fields(klass):
                if f.name == name and f.metadata.get("help"):
                    return f.metadata
    return {}


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return _MISSING


def _specs(cls: type) -> dict[str, _Spec]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        optional = False
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            optional = len(args) < len(typing.get_args(tp))
            tp = args[0] if len(args) == 1 else str
        choices: tuple[str, ...] | None = None
        elem: Any = None
        length = None
        base = tp
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            choices = tuple(str(m.value) for m in tp)
        elif typing.get_origin(tp) is typing.Literal:
            choices = tuple(str(a) for a in typing.get_args(tp))
            base = str
        elif typing.get_origin(tp) is tuple:
            targs = typing.get_args(tp)
            base, elem = tuple, targs[0]
            length = None if len(targs) == 2 and targs[1] is Ellipsis else len(targs)
        elif typing.get_origin(tp) is dict:
            base = dict
        meta = _meta(cls, f.name)
        if meta.get("choices"):
            choices = meta["choices"]
        out[f.name] = _Spec(f.name, base, optional, choices, elem, length, meta, _default(f))
    return out


# ------------------------------------------------------------------------------------------------ values


def _scalar(spec: _Spec, tp: Any, value: Any, where: str) -> Any:
    flag = f"{where}{flag_name(spec.name)}"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(f"{flag} must be {_either(spec.choices or ())}, got {value!r}") from None
    if spec.choices is not None and str(value) not in spec.choices:
        raise ConfigError(f"{flag} must be {_either(spec.choices)}, got {value!r}")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{flag} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{flag} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{flag} must be a number, got {value!r}")
        return float(value)
    if tp is Path:
        if not isinstance(value, (str, Path)):
            raise ConfigError(f"{flag} must be a path (a string), got {value!r}")
        return Path(value)
    if tp is str and not isinstance(value, str):
        raise ConfigError(f"{flag} must be a string, got {value!r}")
    return value


def _either(choices: Iterable[str]) -> str:
    c = list(choices)
    return " or ".join(c) if len(c) <= 2 else "one of " + ", ".join(c)


def _coerce(spec: _Spec, value: Any, where: str) -> Any:
    if value is None and spec.optional:
        return None
    vals: Any
    if spec.base is tuple:
        vals = [value] if isinstance(value, (str, Path)) else value
        if not isinstance(vals, (list, tuple)):
            raise ConfigError(f"{where}{flag_name(spec.name)} must be a list, got {value!r}")
        if spec.meta.get("sep"):
            vals = [p.strip() for v in vals for p in str(v).split(spec.meta["sep"]) if p.strip()]
        if spec.length is not None and len(vals) != spec.length:
            raise ConfigError(f"{where}{flag_name(spec.name)} takes {spec.length} values, got {value!r}")
        return tuple(_scalar(spec, spec.elem, v, where) for v in vals)
    if spec.base is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}{flag_name(spec.name)} must be a table, got {value!r}")
        return dict(value)
    return _bounded(spec, _scalar(spec, spec.base, value, where), f"{where}{flag_name(spec.name)}")


def _bounded(spec: _Spec, value: Any, flag: str) -> Any:
    m = spec.meta
    if value is None or not isinstance(value, (int, float)) or isinstance(value, bool):
        return value
    if m.get("ge") is not None and not value >= m["ge"]:
        raise ConfigError(f"{flag} must be >= {m['ge']:g}, got {value}")
    if m.get("gt") is not None and not value > m["gt"]:
        raise ConfigError(f"{flag} must be > {m['gt']:g}, got {value}")
    if m.get("le") is not None and not value <= m["le"]:
        raise ConfigError(f"{flag} must be <= {m['le']:g}, got {value}")
    return value


def check_bounds(obj: Any, owner: str | None = None) -> None:
    """Each field of ``obj`` against its ``ge``/``gt``/``le``; errors name it as its flag (``--batch-turns``), or
    as ``owner.batch_turns`` if ``owner`` is given."""
    for spec in _specs(type(obj)).values():
        label = f"{owner}.{spec.name}" if owner else flag_name(spec.name)
        _bounded(spec, getattr(obj, spec.name), label)


# --------------------------------------------------------------------------------------------------- flags


def add_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    exclude: Iterable[str] = (),
    config_flag: bool = True,
    group: str | None = None,
    order: Iterable[str] = (),
) -> None:
    """A flag for each field of ``cls`` (not in ``exclude``, not ``cli=False``), in argument groups by the
    fields' ``group`` (else ``group``, else none; those in ``order`` first, in that order); each defaults to
    "not given" (argparse.SUPPRESS)."""
    if config_flag:
        parser.add_argument(
            "--config",
            type=Path,
            default=None,
            metavar="FILE.toml",
            help="read settings from a TOML file, keys named as the flags (flags win)",
        )
    skip = set(exclude)
    groups: dict[str | None, Any] = {g: parser.add_argument_group(g) for g in order}
    for spec in _specs(cls).values():
        if spec.name in skip or not spec.meta.get("cli", True) or spec.base is dict:
            continue
        g = spec.meta.get("group") or group
        if g not in groups:
            groups[g] = parser.add_argument_group(g) if g else parser
        kw: dict[str, Any] = {"dest": spec.name, "default": argparse.SUPPRESS, "help": _help(spec)}
        metavar = spec.meta.get("metavar") or _METAVARS.get(spec.elem if spec.base is tuple else spec.base)
        if metavar and spec.choices is None and spec.base is not bool:
            kw["metavar"] = metavar
        if spec.base is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif spec.base is tuple:
            kw["type"] = _argtype(spec.elem)
            if spec.meta.get("sep"):
                kw["type"] = str
            elif spec.length is not None:
                kw["nargs"] = spec.length
            else:
                kw["action"] = "append"
        else:
            kw["type"] = _argtype(spec.base)
            if spec.choices is not None:
                kw["type"] = str
                kw["choices"] = spec.choices
        groups[g].add_argument(flag_name(spec.name), **kw)


_METAVARS: dict[Any, str] = {int: "N", float: "NUM", Path: "PATH", str: "TEXT"}


def _argtype(tp: Any) -> Any:
    if tp in (int, float, Path):
        return tp
    return str


def _help(spec: _Spec) -> str:
    text = str(spec.meta.get("help") or "")
    if "default" in text or spec.default is _MISSING or spec.base is bool and spec.default is False:
        return text.replace("%", "%%")
    d = spec.default
    if d is None or d == () or d == "":
        return text.replace("%", "%%")
    shown = d.value if isinstance(d, enum.Enum) else ",".join(map(str, d)) if isinstance(d, tuple) else d
    if isinstance(shown, float):
        shown = f"{shown:g}"
    if spec.base is bool:
        shown = "on" if d else "off"
    return f"{text} (default {shown})".replace("%", "%%")


def from_namespace(cls: type, args: argparse.Namespace, where: str = "") -> dict[str, Any]:
    """The fields of ``cls`` given on the command line (set and not None), checked."""
    specs = _specs(cls)
    out = {}
    for name, spec in specs.items():
        v = getattr(args, name, None)
        if v is not None:
            out[name] = _coerce(spec, v, where)
    return out


# ---------------------------------------------------------------------------------------------------- TOML


def load_toml(path: Path, cls: type, *, section: str | None = None, exclude: Iterable[str] = ()) -> dict[str, Any]:
    """The settings of a TOML file for ``cls`` (top level, or under ``[section]`` if it has one), checked: a key
    that names no setting is an error listing the valid ones."""
    try:
        doc = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML: {exc}") from None
    if section is not None and isinstance(doc.get(section), dict):
        doc = doc[section]
    return from_mapping(cls, doc, where=f"--config {path}: ", exclude=exclude)


def from_mapping(cls: type, doc: Mapping[str, Any], *, where: str = "", exclude: Iterable[str] = ()) -> dict[str, Any]:
    """``doc``'s keys (``-`` or ``_``) as checked field values of ``cls``; an unknown key is an error."""
    specs = {k: v for k, v in _specs(cls).items() if k not in set(exclude)}
    out = {}
    for key, value in doc.items():
        name = key.replace("-", "_")
        if name not in specs:
            known = sorted(k.replace("_", "-") for k in specs)
            near = difflib.get_close_matches(key.replace("_", "-"), known, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"{where}unknown setting {key!r}{hint}; valid settings: {', '.join(known)}")
        out[name] = _coerce(specs[name], value, where)
    return out


def to_toml(values: Mapping[str, Any] | Any, *, header: str = "") -> str:
    """A TOML document of ``values`` (a mapping or a dataclass instance); None values are left out (the
    reader's default stands)."""
    if dataclasses.is_dataclass(values) and not isinstance(values, type):
        values = {f.name: getattr(values, f.name) for f in dataclasses.fields(values)}
    assert isinstance(values, Mapping)
    lines = [f"# {line}" for line in header.splitlines()]
    tables = []
    for k, v in values.items():
        if v is None:
            continue
        if isinstance(v, Mapping):
            if v:
                tables.append(f"\n[{k}]\n" + "\n".join(f"{_key(a)} = {_value(b)}" for a, b in v.items()))
            continue
        lines.append(f"{k} = {_value(v)}")
    return "\n".join(lines) + "\n" + "".join(t + "\n" for t in tables)


def _key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else _value(k)


def _value(v: Any) -> str:
    if isinstance(v, enum.Enum):
        v = v.value
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    s = str(v)
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


# ---------------------------------------------------------------------------------------------------- merge


def resolve(
    cls: type,
    args: argparse.Namespace,
    *,
    preset: Mapping[str, Any] | None = None,
    section: str | None = None,
    exclude: Iterable[str] = (),
    **fixed: Any,
) -> Any:
    """``cls`` from its defaults, then ``preset``, then ``args.config``'s TOML file, then the flags given in
    ``args``, then ``fixed``."""
    values: dict[str, Any] = {}
    if preset:
        values.update(from_mapping(cls, preset, where="preset: "))
    path = getattr(args, "config", None)
    if path is not None:
        values.update(load_toml(Path(path), cls, section=section, exclude=exclude))
    values.update(from_namespace(cls, args))
    values.update(fixed)
    missing = [
        flag_name(f.name)
        for f in dataclasses.fields(cls)
        if f.init and f.name not in values and _default(f) is _MISSING
    ]
    if missing:
        raise ConfigError(f"missing required setting(s) {', '.join(missing)}: give the flag or the key in --config")
    cfg = cls(**values)
    check_bounds(cfg)  # every resolved config, whichever CLI resolved it
    return cfg


def code_only(cls: type) -> tuple[str, ...]:
    """The fields of ``cls`` that code sets and no command line or TOML file does (``cli=False``)."""
    return tuple(f.name for f in dataclasses.fields(cls) if not f.metadata.get("cli", True))
