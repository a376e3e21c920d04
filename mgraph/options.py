"""Typed op options: each op's options are the keyword parameters of its lowering, typed by their
annotations (``hierarchical: bool``, ``tile: list[int]``, ``chunk_bytes: int``). Values are checked
strictly (pydantic strict mode: ``"no"`` is not a bool, ``True`` is not an int) before any graph is
built, and ``--set key=value`` text is parsed by the option's type, never guessed.

Rules beyond the types, shared by every op: an ``int`` option is a size or count and must be
positive; ``tile`` is exactly two positive ints (rows, cols); a ``list[int]`` shape has positive
entries.
"""

from __future__ import annotations

import json
import math
import re
import typing
from collections.abc import Callable
from functools import cache
from typing import Any

from pydantic import ConfigDict, TypeAdapter, ValidationError

from .errors import OptionError, SizeOptionError

__all__ = ["option_types", "check_options", "parse_option_text", "type_name"]

_STRICT = ConfigDict(strict=True)
_INT = re.compile(r"[+-]?\d+")


def option_types(lower_fn: Callable, names: typing.Iterable[str]) -> dict[str, Any]:
    """The annotated type of each option of ``lower_fn`` (``Any`` where it has none)."""
    try:
        hints = typing.get_type_hints(lower_fn)
    except Exception:  # an annotation naming something its module does not import: untyped
        hints = {}
    return {name: hints.get(name, Any) for name in names}


@cache
def _adapter(tp: Any) -> TypeAdapter:
    return TypeAdapter(tp, config=_STRICT)


def type_name(tp: Any) -> str:
    """How a type reads in messages: ``bool``, ``list[int]``, ``float | None``."""
    if tp is Any:
        return "any JSON value"
    if isinstance(tp, type) and typing.get_origin(tp) is None:
        return tp.__name__
    return str(tp).replace("typing.", "")


def _allows_none(tp: Any) -> bool:
    return tp is Any or type(None) in typing.get_args(tp)


def _base(tp: Any) -> Any:
    """``X | None`` -> ``X``."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return args[0] if len(args) == 1 else tp
    return tp


def _how(op: str, name: str, tp: Any) -> str:
    examples = {
        bool: f"--set {name}=true or {name}=false (Python: True/False)",
        int: f"a positive integer, e.g. --set {name}=64",
        float: f"a number, e.g. --set {name}=0.5",
        str: f"a string, e.g. --set {name}=value",
    }
    base = _base(tp)
    if name == "tile":
        return "two positive ints (rows, cols), e.g. --set tile=128,256 (Python: tile=[128, 256])"
    return examples.get(base, f"a {type_name(tp)}, as JSON after --set {name}=")


def check_options(op: str, types: dict[str, Any], values: dict[str, Any]) -> None:
    """OptionError for the first option in ``values`` whose value breaks its type or rule."""
    for name, value in values.items():
        tp = types.get(name, Any)
        try:
            _adapter(tp).validate_python(value)
        except ValidationError as exc:
            raise OptionError(
                f"{op}: option {name}={value!r} does not have type {type_name(tp)} "
                f"({exc.errors()[0]['msg'].lower()})",
                hint=f"{name} takes {_how(op, name, tp)}",
            ) from None
        _check_rules(op, name, tp, value)


def _check_rules(op: str, name: str, tp: Any, value: Any) -> None:
    base = _base(tp)
    bad = None
    if value is None:
        return
    if base is int and value <= 0:
        bad = "must be positive"
    elif isinstance(value, float) and not math.isfinite(value):
        bad = "must be finite"
    elif name == "tile" and (
        not isinstance(value, list) or len(value) != 2 or any(v <= 0 for v in value)
    ):
        bad = "must be two positive ints (rows, cols)"
    elif base == list[int] and any(v <= 0 for v in value):
        bad = "must hold positive sizes"
    if bad:
        error = OptionError if bad == "must be finite" else SizeOptionError  # sizes are shapes
        raise error(f"{op}: option {name}={value!r} {bad}", hint=f"{name} takes "
                    f"{_how(op, name, tp)}")


def parse_option_text(op: str, name: str, raw: str, tp: Any) -> Any:
    """The value of ``--set name=raw`` for an option of type ``tp``, parsed by that type.

    bool: ``true``/``false`` (any case) only; int: digits; float: a finite number; str: the text;
    ``list[int]``: ``64,128`` or ``[64,128]``; ``X | None``: also ``null``/``none``; anything else:
    JSON. Text that does not parse raises OptionError naming the option and its type.
    """
    text = raw.strip()
    if _allows_none(tp) and text.lower() in ("null", "none"):
        return None
    base = _base(tp)
    value: Any
    if base is bool:
        value = {"true": True, "false": False}.get(text.lower(), raw)
    elif base is int:
        value = int(text) if _INT.fullmatch(text) else raw
    elif base is float:
        try:
            value = float(text)
        except ValueError:
            value = raw
    elif base is str:
        value = raw
    elif base == list[int] and not text.startswith("["):
        parts = [p.strip() for p in text.split(",") if p.strip()]
        value = [int(p) for p in parts] if all(_INT.fullmatch(p) for p in parts) else raw
    else:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = raw if base is Any else _not_json(op, name, raw, tp)
    check_options(op, {name: tp}, {name: value})
    return value


def _not_json(op: str, name: str, raw: str, tp: Any) -> typing.NoReturn:
    raise OptionError(
        f"{op}: option {name}={raw!r} is not valid JSON for a {type_name(tp)}",
        hint=f"{name} takes {_how(op, name, tp)}",
    )
