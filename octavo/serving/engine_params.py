"""EngineArgs from string parameters, for servers configured by text (Triton's config.pbtxt `parameters`).

Every EngineArgs field except `model` is a parameter, under its own name, converted by its type annotation
(int, float, bool, str, each possibly `| None`, or a Literal of those), so a field added to EngineArgs is a
parameter at once. An empty string means the field's default; an unknown name or a value that does not convert
raises InvalidRequestError naming the parameter. Byte sizes (kv_cache_memory) also take 512M / 2G.

The command line's engine flags (octavo/commands/engine_flags.py) parse their values with the same
`convert_value`, and `octavo triton` writes them back with `value_text`, so a flag and a config.pbtxt parameter
of one field always accept the same text.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from octavo.errors import InvalidRequestError
from octavo.runtime.engine_args import EngineArgs

BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
NONE_WORDS = ("none", "null")  # for fields that may be None: the explicit way to say so
BYTE_FIELDS = frozenset({"kv_cache_memory"})  # integers that also take a unit: 512M, 2G, 1.5GiB
_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def engine_parameter_names() -> tuple[str, ...]:
    """The EngineArgs fields a string parameter may set, in declaration order (all but `model`)."""
    return tuple(f.name for f in dataclasses.fields(EngineArgs) if f.name != "model")


def engine_args_from_strings(model: str, values: Mapping[str, str], *, where: str = "parameter") -> EngineArgs:
    """EngineArgs(model, **converted VALUES), validated. WHERE names the source in messages ("config.pbtxt
    parameter")."""
    names = engine_parameter_names()
    kwargs: dict[str, Any] = {}
    for key, text in values.items():
        if key not in names:
            raise InvalidRequestError(f"unknown {where} {key!r}: not an engine argument; known: {', '.join(names)}")
        text = str(text).strip()
        if text == "":
            continue  # the engine's default
        kwargs[key] = convert_value(key, text, f"{where} {key}")
    args = EngineArgs(model=model, **kwargs)
    args.validate()
    return args


def convert_value(name: str, text: str, what: str | None = None) -> Any:
    """TEXT as a value of the EngineArgs field NAME (see the module docstring); InvalidRequestError naming WHAT
    (default: the field) if it is not one."""
    what = what or name
    annotation = typing.get_type_hints(EngineArgs)[name]
    if name in BYTE_FIELDS and text.lower() not in NONE_WORDS:
        return parse_bytes(text, what)
    return _convert(text, annotation, what)


def value_text(value: Any) -> str:
    """A field's value as the text convert_value reads back (true/false, none, numbers, strings)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def parse_bytes(text: str, what: str = "size") -> int:
    """'1073741824', '512M', '2G', '1.5GiB' -> bytes."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        value = float(t[:-1]) * _UNITS[t[-1]] if t and t[-1] in _UNITS else int(t)
    except ValueError:
        raise InvalidRequestError(f"{what} must be a byte size such as 1073741824, 512M or 2G; got {text!r}") from None
    return int(value)


def _convert(text: str, annotation: Any, what: str) -> Any:
    """TEXT as a value of ANNOTATION; InvalidRequestError naming WHAT if it is not one."""
    options = list(typing.get_args(annotation)) if _is_union(annotation) else [annotation]
    if type(None) in options:
        if text.lower() in NONE_WORDS:
            return None
        options.remove(type(None))
    if len(options) != 1:
        raise InvalidRequestError(f"{what} has a type ({annotation}) that cannot be set from text")
    kind = options[0]
    if typing.get_origin(kind) is typing.Literal:
        allowed = typing.get_args(kind)
        for choice in allowed:
            if str(choice) == text:
                return choice
        raise InvalidRequestError(f"{what} must be one of {', '.join(map(str, allowed))}; got {text!r}")
    if kind is bool:
        if text.lower() not in BOOL_WORDS:
            raise InvalidRequestError(f"{what} must be true or false, got {text!r}")
        return BOOL_WORDS[text.lower()]
    if kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            raise InvalidRequestError(f"{what} must be {'an integer' if kind is int else 'a number'}, "
                                      f"got {text!r}") from None
    if kind is str:
        return text
    raise InvalidRequestError(f"{what} has a type ({annotation}) that cannot be set from text")


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)
