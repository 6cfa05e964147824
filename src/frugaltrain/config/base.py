"""The config machinery every command shares: sections that check themselves, TOML plus `--set`.

A config is a keyword-only dataclass of sections (`Section` subclasses), each a keyword-only
dataclass with a docstring under every field. A section checks its own fields when it is built
(`check`), the root checks rules across sections in its `__post_init__`, and every error has one
format: `section.key = value: the rule, and the fix` (a `ConfigError`, a ValueError).

    cfg = load(Config, "examples/default.toml", ["outer.H=50", "optim.betas=[0.9,0.95]"])

`--set` values are TOML literals; a bare word (`--set outer.strategy=diloco`) is a string.
Unknown keys, wrong types, non-finite numbers and impossible values are refused before any work.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import tomllib


class ConfigError(ValueError):
    """A user-facing configuration error: names the key, the value and the fix."""


def require(ok: bool, key: str, value: Any, rule: str) -> None:
    """Raise `key = value: rule` unless `ok` (the one error format)."""
    if not ok:
        raise ConfigError(f"{key} = {value!r}: {rule}")


@dataclasses.dataclass(kw_only=True)
class Section:
    """A config section: checks its own fields when built. `section` is its name in TOML."""

    section: ClassVar[str] = ""
    moved: ClassVar[dict[str, str]] = {}  # keys now in another section -> their new full key

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            numbers = value if isinstance(value, (list, tuple)) else [value]
            if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
                raise ConfigError(f"{self.key(f.name)} = {value!r}: must be a finite number")
        self.check()

    def check(self) -> None:
        """The section's own rules (override); raise through `require`, `at_least`, `one_of`."""

    def key(self, name: str) -> str:
        return f"{self.section}.{name}" if self.section else name

    def require(self, ok: bool, name: str, rule: str) -> None:
        require(ok, self.key(name), getattr(self, name), rule)

    def at_least(self, name: str, low: float, note: str = "") -> None:
        rule = f"must be at least {low}" if low != 0 else "must be >= 0"
        self.require(getattr(self, name) >= low, name, rule + (f" ({note})" if note else ""))

    def positive(self, name: str) -> None:
        self.require(getattr(self, name) > 0, name, "must be positive")

    def one_of(self, name: str, choices: Iterable[Any]) -> None:
        choices = list(choices)
        self.require(
            getattr(self, name) in choices, name, f"choose one of {', '.join(map(str, choices))}"
        )


# ---------------------------------------------------------------- loading


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotated type `tp`; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(key, value, arg)
            except ConfigError:
                pass
        raise ConfigError(f"{key} = {value!r}: expected {tp}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key} = {value!r}: expected nothing")
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} = {value!r}: expected a list like [0.9, 0.95]")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(key, v, args[0]) for v in value)
        if len(value) != len(args):
            raise ConfigError(f"{key} = {value!r}: expected {len(args)} values")
        return tuple(_coerce(key, v, a) for v, a in zip(value, args, strict=True))
    if origin is list:
        (arg,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} = {value!r}: expected a list")
        return [_coerce(key, v, arg) for v in value]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{key} = {value!r}: expected true or false")
    if tp in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{key} = {value!r}: expected {_type_name(tp)}, got a boolean")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(
            f"{key} = {value!r}: expected {_type_name(tp)}, got {type(value).__name__}"
        )
    return value


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. outer.H=50")
    key, raw = item.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word such as diloco is taken as a string
    return key.strip().split("."), value


def _merge(tree: dict, path: list[str], value: Any) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
        if not isinstance(tree, dict):
            raise ConfigError(f"{'.'.join(path)}: {part} is a value, not a section")
    tree[path[-1]] = value


def _build(cls: type, raw: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            moved = getattr(cls, "moved", {}).get(key)  # to another section: its full key
            if moved:
                raise ConfigError(f"unknown key {prefix}{key}: it is now {moved}")
            moved = _moved_to(hints, key)
            if issubclass(cls, Section) and moved:
                raise ConfigError(f"unknown key {prefix}{key}: it is now {prefix}{moved}")
            near = ", ".join(sorted(fields))
            raise ConfigError(f"unknown key {prefix}{key}; valid keys here: {near}")
    kwargs = {}
    for name, value in raw.items():
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{prefix}{name} is a section; write [{prefix}{name}] keys")
            kwargs[name] = _build(tp, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(f"{prefix}{name}", value, tp)
    return cls(**kwargs)


def _moved_to(hints: dict, key: str) -> str | None:
    """`sub.key` when a nested section of this one holds `key` (a key that moved down a level)."""
    for name, tp in hints.items():
        if dataclasses.is_dataclass(tp) and key in {f.name for f in dataclasses.fields(tp)}:
            return f"{name}.{key}"
    return None


def with_overrides(raw: dict | None, overrides: list[str] | None) -> dict:
    """A nested dict (a TOML file's tables) with `key=value` overrides applied, unvalidated."""
    tree: dict = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (raw or {}).items()}
    for item in overrides or []:
        path, value = _parse_override(item)
        _merge(tree, path, value)
    return tree


def build_config(cls: type, raw: dict | None = None, overrides: list[str] | None = None) -> Any:
    """Build dataclass `cls` from a nested dict plus `key=value` overrides; validate all."""
    return _build(cls, with_overrides(raw, overrides), "")


def read_toml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist; pass an existing .toml file")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from e


def load(cls: type, path: str | Path | None = None, overrides: list[str] | None = None) -> Any:
    """Build config class `cls` from an optional TOML file plus `--set` overrides."""
    return build_config(cls, read_toml(path) if path else {}, overrides)


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (`PROG: error: MESSAGE; see PROG
    --help`, exit code 2), like every other input error, instead of usage plus the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def add_set_flag(parser: argparse.ArgumentParser, example: str = "outer.H=50") -> None:
    """The repeatable `--set KEY=VALUE` flag every command that reads a config takes."""
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config key, e.g. --set {example} (repeatable)",
    )


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def to_toml(cfg: Any) -> str:
    """Render a config of sections as TOML; `load` reads it back equal."""
    return "".join(section_toml(name, values) for name, values in to_dict(cfg).items())


def section_toml(name: str, values: dict) -> str:
    """`[name]` with its keys, then each nested section as its own table `[name.sub]`."""
    plain = {k: v for k, v in values.items() if not isinstance(v, dict)}
    lines = [f"[{name}]"] + [f"{key} = {_toml_value(value)}" for key, value in plain.items()]
    nested = (section_toml(f"{name}.{k}", v) for k, v in values.items() if isinstance(v, dict))
    return "\n".join(lines) + "\n\n" + "".join(nested)


def flat_items(values: dict, prefix: str = "") -> dict:
    """A nested config dict as {dotted key: value}, e.g. {"outer.fgd.mix1": "complete"}."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(flat_items(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")
