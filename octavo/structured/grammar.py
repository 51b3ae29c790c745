"""One StructuredOutputsParams -> the llguidance grammar that enforces it, checked (no tokenizer needed).

JSON schemas go through llguidance's own JSON-schema compiler (it refuses schemas it cannot enforce rather
than ignoring keywords); regexes and choices become one-rule Lark grammars; grammars are Lark as written,
or GBNF/EBNF (llama.cpp's `root ::= ...`) translated by llguidance's converter. Everything is validated
here, so a malformed constraint is an error naming its field before the request is queued.
"""
from __future__ import annotations

import json
from typing import Any

from octavo.structured.params import StructuredOutputError, StructuredOutputsParams

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
_VALUE_KEYWORDS = frozenset({"enum", "const", "default", "examples", "required"})  # hold values, not schemas


def build_grammar(p: StructuredOutputsParams) -> str:
    """The llguidance grammar text for P; StructuredOutputError (naming the field) if it is unusable."""
    import llguidance as llg

    kind = p.kind
    try:
        if kind in ("json", "json_object"):
            schema = ANY_JSON_OBJECT if kind == "json_object" else p.json
            if p.disable_additional_properties and isinstance(schema, dict):
                schema = closed_objects(schema)
            options: dict[str, Any] = {}
            if p.disable_any_whitespace:
                options["whitespace_flexible"] = False
            if p.whitespace_pattern is not None:
                options["whitespace_pattern"] = p.whitespace_pattern
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides=options or None)
        elif kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(p.regex)
        elif kind == "choice":
            grammar = llg.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in p.choice))
        else:
            text = p.grammar
            if _is_gbnf(text):
                from llguidance.gbnf_to_lark import gbnf_to_lark

                text = gbnf_to_lark(text)
            grammar = llg.LLMatcher.grammar_from_lark(text)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    except StructuredOutputError:
        raise
    except BaseException as exc:  # noqa: BLE001 - llguidance raises ValueError/RuntimeError, the converter its
        # own, and a Rust panic arrives as pyo3's PanicException (a BaseException): all the constraint's fault
        if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        raise StructuredOutputError(f"invalid {_what(kind)}: {_first_lines(str(exc))}", _field(kind)) from None
    if is_error:
        raise StructuredOutputError(f"invalid {_what(kind)}: {_first_lines(messages[0])}", _field(kind))
    return grammar


def closed_objects(schema: Any) -> Any:
    """SCHEMA with `additionalProperties: false` on every object schema that does not say otherwise
    (vLLM's disable_additional_properties)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _VALUE_KEYWORDS else closed_objects(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _is_gbnf(text: str) -> bool:
    return "::=" in text


def _field(kind: str) -> str:
    return "json" if kind == "json_object" else kind


def _what(kind: str) -> str:
    return {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
            "choice": "choice", "grammar": "grammar"}[kind]


def _first_lines(msg: str, limit: int = 400) -> str:
    msg = msg.strip()
    return msg if len(msg) <= limit else msg[:limit - 3] + "..."
