"""One StructuredOutputsParams -> the llguidance grammar that enforces it, checked (no tokenizer needed).

JSON schemas go through llguidance's own JSON-schema compiler (it refuses schemas it cannot enforce rather
than ignoring keywords); regexes become one-rule Lark grammars, choices one terminal whose alternatives are the
choices (the lexer takes tens of thousands; as rule alternatives the parser stops at 2,000); grammars are Lark
as written, or GBNF/EBNF (llama.cpp's `root ::= ...`) translated by llguidance's converter. The constraint
passes ConstraintLimits (limits.py) before any of it is handed to llguidance. Native error messages are cut to
their first line (a Rust panic's backtrace never reaches a client).
"""
from __future__ import annotations

import json
import re
from typing import Any

from octavo.structured.limits import ConstraintLimits, check_limits, check_translated_lark, is_gbnf
from octavo.structured.params import StructuredOutputError, StructuredOutputsParams

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
_VALUE_KEYWORDS = frozenset({"enum", "const", "default", "examples", "required"})  # hold values, not schemas


def build_grammar(p: StructuredOutputsParams, limits: ConstraintLimits = ConstraintLimits()) -> str:  # noqa: B008 - frozen
    """The llguidance grammar text for P; StructuredOutputError (naming the field) if it is unusable or passes
    LIMITS. Native calls: llguidance's converters and validator (run it where a deep recursion is safe:
    compile_workers.py)."""
    import llguidance as llg

    check_limits(p, limits)
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
                "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in p.choice))
        else:
            text = p.grammar
            if is_gbnf(text):
                from llguidance.gbnf_to_lark import gbnf_to_lark

                text = gbnf_to_lark(text)
                check_translated_lark(text, limits)
            grammar = llg.LLMatcher.grammar_from_lark(text)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(
            grammar, limits=llg.LLParserLimits(verbose_errors=False))
    except StructuredOutputError:
        raise
    except BaseException as exc:  # noqa: BLE001 - llguidance raises ValueError/RuntimeError, the converter its
        # own, and a Rust panic arrives as pyo3's PanicException (a BaseException): all the constraint's fault
        if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        raise StructuredOutputError(f"invalid {_what(kind)}: {error_text(str(exc))}", _field(kind)) from None
    if is_error:
        raise StructuredOutputError(f"invalid {_what(kind)}: {error_text(messages[0])}", _field(kind))
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


def _field(kind: str) -> str:
    return "json" if kind == "json_object" else kind


def _what(kind: str) -> str:
    return {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
            "choice": "choice", "grammar": "grammar"}[kind]


def error_text(msg: str, limit: int = 400) -> str:
    """A native error message for a client: a Rust panic's backtrace and source locations dropped, cut to LIMIT
    characters."""
    msg = _BACKTRACE.split(msg, maxsplit=1)[0]
    msg = "\n".join(line for line in msg.strip().splitlines() if not _SOURCE_LINE.search(line)).strip()
    msg = msg or "unknown error"
    return msg if len(msg) <= limit else msg[:limit - 3] + "..."


_BACKTRACE = re.compile(r"\n?\s*(?:stack backtrace:|note: run with `RUST_BACKTRACE)")
_SOURCE_LINE = re.compile(r"\.rs:\d+(?::\d+)?\b|^\s*\d+: (?:0x[0-9a-f]+ - )?[\w:<>]+::")
