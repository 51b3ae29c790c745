"""StructuredOutputsParams: what a request's output must match (vLLM's shape, field for field).

Exactly one constraint: `json` (a JSON schema, as a dict or its text), `regex`, `choice` (one of these
strings), `grammar` (Lark, or GBNF/EBNF with `::=` rules) or `json_object` (any JSON object). The options
shape how JSON is written. `structural_tag` is vLLM's and recognised, but not implemented here: it is an
error rather than a silently unconstrained output. `disable_fallback` is accepted and means nothing (there
is one grammar engine, llguidance: nothing to fall back to).
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

from octavo.errors import InvalidRequestError

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# how the error of a request whose output's constraint failed mid-generation begins (a parser limit met on the
# way, e.g.): the server answers it with a 400 `constraint_failed` rather than a 500
CONSTRAINT_FAILED = "the output's constraint failed"


class StructuredOutputError(InvalidRequestError):
    """A constraint that cannot be used: malformed schema/regex/grammar, or an option we do not implement.
    FIELD names the StructuredOutputsParams field at fault (the server maps it to the request's name)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(slots=True)
class StructuredOutputsParams:
    json: str | dict | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if self.json_object is False:  # {"json_object": false} asks for nothing
            self.json_object = None
        if isinstance(self.json, str):
            try:
                self.json = _json.loads(self.json)
            except ValueError as exc:
                raise StructuredOutputError(f"the JSON schema is not valid JSON: {exc}", "json") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise StructuredOutputError(f"the JSON schema must be an object, got {_show(self.json)}", "json")
        for name in ("regex", "grammar", "whitespace_pattern", "structural_tag"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise StructuredOutputError(f"{name} must be a string, got {_show(v)}", name)
        for name in ("regex", "grammar"):
            if getattr(self, name) == "":
                raise StructuredOutputError(f"{name} must not be empty", name)
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise StructuredOutputError("choice must be a non-empty list of non-empty strings", "choice")
            self.choice = list(self.choice)
        for name in ("json_object", "disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise StructuredOutputError(f"{name} must be a boolean, got {_show(v)}", name)
        given = [c for c in CONSTRAINTS if getattr(self, c) is not None]
        if not given:
            raise StructuredOutputError(
                f"structured outputs need exactly one constraint ({', '.join(CONSTRAINTS[:5])}); none is set", "json")
        if len(given) > 1:
            raise StructuredOutputError(
                f"structured outputs take exactly one constraint, got {len(given)}: {', '.join(given)}", given[1])
        if self.structural_tag is not None:
            raise StructuredOutputError("structural_tag is not supported by this server; use json, regex, "
                                        "choice or grammar", "structural_tag")
        if self.whitespace_pattern is not None and self.kind not in ("json", "json_object"):
            raise StructuredOutputError("whitespace_pattern applies to json / json_object only", "whitespace_pattern")

    @classmethod
    def from_dict(cls, d: Any) -> StructuredOutputsParams:
        """From a request body's `structured_outputs` object; unknown keys are an error (a typo would
        otherwise be a silently unconstrained output)."""
        if isinstance(d, StructuredOutputsParams):
            return d
        if not isinstance(d, dict):
            raise StructuredOutputError(f"structured_outputs must be an object, got {_show(d)}", "json")
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise StructuredOutputError(
                f"unknown structured_outputs field(s): {', '.join(unknown)} (known: "
                f"{', '.join(cls.__dataclass_fields__)})", unknown[0])
        return cls(**d)

    @property
    def kind(self) -> str:
        return next(c for c in CONSTRAINTS if getattr(self, c) is not None)

    def cache_key(self) -> str:
        """Identifies the compiled grammar: the constraint and every option that changes it."""
        return _json.dumps([self.kind, getattr(self, self.kind), self.disable_any_whitespace,
                            self.disable_additional_properties, self.whitespace_pattern],
                           sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _show(v: object) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."
