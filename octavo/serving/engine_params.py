"""EngineArgs from string parameters, for servers configured by text (Triton's config.pbtxt `parameters`).

Every EngineArgs field except `model` is a parameter, under its own name, converted by its type annotation
(int, float, bool, str, each possibly `| None`, or a Literal of those), so a field added to EngineArgs is a
parameter at once. An empty string means the field's default; an unknown name or a value that does not convert
raises InvalidRequestError naming the parameter.
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


def engine_parameter_names() -> tuple[str, ...]:
    """The EngineArgs fields a string parameter may set, in declaration order (all but `model`)."""
    return tuple(f.name for f in dataclasses.fields(EngineArgs) if f.name != "model")


def engine_args_from_strings(model: str, values: Mapping[str, str], *, where: str = "parameter") -> EngineArgs:
    """EngineArgs(model, **converted VALUES), validated. WHERE names the source in messages ("config.pbtxt
    parameter")."""
    names = engine_parameter_names()
    hints = typing.get_type_hints(EngineArgs)
    kwargs: dict[str, Any] = {}
    for key, text in values.items():
        if key not in names:
            raise InvalidRequestError(f"unknown {where} {key!r}: not an engine argument; known: {', '.join(names)}")
        text = str(text).strip()
        if text == "":
            continue  # the engine's default
        kwargs[key] = _convert(text, hints[key], f"{where} {key}")
    args = EngineArgs(model=model, **kwargs)
    args.validate()
    return args


def _convert(text: str, annotation: Any, what: str) -> Any:
    """TEXT as a value of ANNOTATION (see the module docstring); InvalidRequestError naming WHAT if it is not one."""
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
