"""One config schema idiom for the daemon, the plugin and the router: keys are dataclass fields.

A field made with :func:`key` is a config key; its :class:`Key` metadata (doc, scope, parser,
choices, check) drives parsing, validation, error messages and the generated reference
(docs/configuration.md). Loading is one step per source (uvicorn's ``Config`` as data):
:func:`parse_layer` turns one source's raw mapping (a TOML file, a JSON object, flags, the
environment) into typed values, naming the source and the key in every error.

Types are strict. A value from a typed source (TOML, JSON, flags) must already have the key's
type: ``unavailable_fail = "false"`` is an error, not ``True``. Only a text source (environment
variables) has its strings converted, with ``text=True``.

Neutral ground: the plugin imports this, so it imports nothing but the standard library.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ConfigError", "Key", "KeyDoc", "Parser", "Check", "key", "parsers_of", "parse_layer",
    "check_fields", "docs_of", "describe", "markdown_table", "unknown_key",
    "accepts_strings", "p_str", "p_int", "p_float", "p_bool", "p_port", "p_mode", "p_upper", "takes_strings",
    "int_in", "check_port", "check_choice", "check_positive", "check_non_negative",
    "check_count", "check_nonempty",
]

Parser = Callable[[Any], Any]  # raw value -> typed value; TypeError/ValueError say what is wrong
Check = Callable[[str, Any], None]  # (key name, typed value) -> None, or ConfigError


class ConfigError(ValueError):
    """A configuration value is missing, unknown or malformed: the message names it."""


# --------------------------------------------------------------------------- parsers

_STRING_PARSERS: set[Parser] = set()


def accepts_strings(parser: Parser) -> bool:
    """Does ``parser`` take a string from a typed source (see :func:`takes_strings`)?"""
    return parser in _STRING_PARSERS


def takes_strings(parser: Parser) -> Parser:
    """Mark a parser whose typed input is a string (a str key, a name list...): strings from
    a typed source reach it; for every other parser they are a type error."""
    _STRING_PARSERS.add(parser)
    return parser


@takes_strings
def p_str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError("expected a string")
    return v


def p_int(v: Any) -> int:
    if isinstance(v, str):  # text sources only (parse_layer refuses strings from typed ones)
        try:
            return int(v.strip(), 0)
        except ValueError:
            raise ValueError("expected an integer") from None
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError("expected an integer")
    return v


def p_bool(v: Any) -> bool:
    """true/false; from the environment also 1/0, yes/no."""
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "0", "false", "no"):
        return v.strip().lower() in ("1", "true", "yes")
    raise TypeError("expected true or false")


def p_port(v: Any) -> int:
    port = p_int(v)
    if not 0 <= port <= 65535:
        raise ValueError("must be a port number in 0..65535")
    return port


def p_float(v: Any) -> float:
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            raise ValueError("expected a number") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError("expected a number")
    return float(v)


def p_mode(v: Any) -> int:
    """TOML 0o600 arrives as int; env '0600' / '600' / '0o600' are octal."""
    if isinstance(v, str):
        try:
            return int(v.strip().lower().removeprefix("0o"), 8)
        except ValueError:
            raise ValueError("expected an octal mode such as 0600") from None
    return p_int(v)


@takes_strings
def p_upper(v: Any) -> str:
    return p_str(v).upper()


def int_in(lo: int, hi: int) -> Parser:
    """An integer in [lo, hi] (one message for every wrong value: type or range)."""
    def parse(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"must be an integer in [{lo}, {hi}]")
        return v
    return parse


PARSERS: dict[Any, Parser] = {str: p_str, int: p_int, float: p_float, bool: p_bool}
TYPE_NAMES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


# --------------------------------------------------------------------------- checks

def check_port(key: str, port: Any, allow_zero: bool = True) -> None:
    lo = 0 if allow_zero else 1
    if not isinstance(port, int) or isinstance(port, bool) or not lo <= port <= 65535:
        raise ConfigError(f"{key} must be an integer in {lo}..65535, got {port!r}")


def check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}, got {value!r}")


def check_positive(key: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{key} must be a finite number > 0, got {value!r}")


def check_non_negative(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0:
        raise ConfigError(f"{key} must be >= 0, got {value}")


def check_count(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{key} must be a non-negative integer, got {value!r}")


def check_nonempty(key: str, value: Any) -> None:
    if not value:
        raise ConfigError(f"{key} is empty")


# --------------------------------------------------------------------------- schema

@dataclass(frozen=True)
class Key:
    """A config key's schema, kept in its dataclass field's metadata (``key(...)``)."""

    doc: str
    scope: str
    parse: Parser | None = None  # None: from the field's type hint
    choices: tuple[str, ...] | None = None
    check: Check | None = None
    type_name: str | None = None  # for the reference; None: from the type hint
    shown_default: str | None = None  # for the reference; None: the field's default


def key(default: Any = dataclasses.MISSING, doc: str = "", *, scope: str = "",
        parse: Parser | None = None, choices: tuple[str, ...] | None = None,
        check: Check | None = None, factory: Callable[[], Any] | None = None,
        type_name: str | None = None, shown_default: str | None = None) -> Any:
    """A dataclass field that is also a config key."""
    meta = {"key": Key(doc, scope, parse, choices, check, type_name, shown_default)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _key_fields(cls: type, scopes: tuple[str, ...]) -> Iterable[tuple[dataclasses.Field[Any], Key, Any]]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        k = f.metadata.get("key")
        if k is not None and (not scopes or k.scope in scopes):
            args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
            yield f, k, (args[0] if len(args) == 1 else hints[f.name])


def parsers_of(cls: type, *scopes: str) -> dict[str, Parser]:
    """Key name -> parser of ``cls``'s key fields (in ``scopes``; none given: all)."""
    return {f.name: k.parse or PARSERS[hint] for f, k, hint in _key_fields(cls, scopes)}


def docs_of(*classes: type) -> dict[str, str]:
    return {f.name: k.doc for cls in classes for f, k, _ in _key_fields(cls, ())}


@dataclass(frozen=True)
class KeyDoc:
    """One key as the reference shows it."""

    name: str
    type: str
    default: str
    doc: str
    scope: str


def _default_text(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        v = f.default
    elif f.default_factory is not dataclasses.MISSING:
        v = f.default_factory()
    else:
        return "required"
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return repr(v)


def describe(cls: type, *scopes: str) -> list[KeyDoc]:
    """``cls``'s keys (in ``scopes``), in field order, for the generated reference."""
    out = []
    for f, k, hint in _key_fields(cls, scopes):
        if k.type_name:
            type_name = k.type_name
        elif k.choices:
            type_name = " | ".join(f'"{c}"' for c in k.choices)
        else:
            type_name = TYPE_NAMES.get(hint, "string")
        default = k.shown_default if k.shown_default is not None else _default_text(f)
        out.append(KeyDoc(f.name, type_name, default, k.doc, k.scope))
    return out


def markdown_table(keys: Iterable[KeyDoc], name_of: Callable[[str], str] = str) -> str:
    """The reference table of ``keys`` (docs/configuration.md is made of these)."""
    def cell(text: str) -> str:
        return " ".join(text.split()).replace("|", "\\|")

    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    rows += [f"| `{name_of(k.name)}` | {cell(k.type)} | {cell(k.default)} | {cell(k.doc)} |"
             for k in keys]
    return "\n".join(rows) + "\n"


def check_fields(obj: Any, where: str) -> None:
    """Every key field's choices and check, in field order."""
    for f in dataclasses.fields(obj):
        k = f.metadata.get("key")
        if k is None:
            continue
        name = f"{where}: {f.name}" if where else f.name
        value = getattr(obj, f.name)
        if k.choices is not None:
            check_choice(name, value, k.choices)
        if k.check is not None and value is not None:
            k.check(name, value)


def unknown_key(where: str, name: str, known: Iterable[str]) -> ConfigError:
    near = difflib.get_close_matches(name, list(known), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return ConfigError(f"{where}: unknown key {name!r}{hint}")


def parse_layer(where: str, raw: Mapping[str, Any], known: Mapping[str, Parser], *,
                name_of: Callable[[str], str] = str, text: bool = False,
                unknown: Callable[[str, str], ConfigError] | None = None) -> dict[str, Any]:
    """One source's raw values -> typed values. ``text``: the source gives strings (the
    environment), converted by each parser; otherwise a string for a key whose parser does
    not take strings is a type error. Errors name ``where`` and the key."""
    out: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in known:
            raise (unknown or (lambda w, n: unknown_key(w, n, known)))(where, name)
        parser = known[name]
        if isinstance(value, str) and not text and parser not in _STRING_PARSERS:
            try:  # the parser's own "expected ..." for a value of the wrong type
                parser(object())
                expected = "expected a value that is not a string"
            except (TypeError, ValueError) as e:
                expected = str(e)
            raise ConfigError(f"{where}: {name_of(name)}: {expected}, not a string; got {value!r}")
        try:
            out[name] = parser(value)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: {name_of(name)}: {e}; got {value!r}") from None
    return out
