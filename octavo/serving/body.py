"""The request body: raw bytes -> JSON (strict UTF-8, no lone surrogates), and `Body`, typed getters over its
object. Everything here answers a malformed body with a 400 naming the parameter (never a 500 from deeper in);
`show` and `listed` write offending values into those messages. The routes that read a body all parse it here:
the generation routes (serving/routes.py, through serving/protocol.py), the tokenizer routes
(serving/tokenize_routes.py).
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

from octavo.serving.api_error import bad_request

# Surrogate escapes (\\uD800-\\uDFFF) in a JSON text. SUSPECT finds, in one scan, every escape that may stand alone
# (a high half not followed by a low one, a low half not preceded by a high one, a high half after another
# backslash, which may escape it) and some that do not; an exact look follows only then. The exact look reads
# escapes left to right as the decoder does: escaped backslashes and valid pairs removed, any surrogate escape
# left is a real one, and unpaired.
_SUSPECT = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
                      r"|\\u[dD][c-fC-F](?<!\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F])"
                      r"|\\\\u[dD][89abAB]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_BACKSLASH_OR_PAIR = re.compile(r"\\\\|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def parse_json_body(raw: bytes) -> Any:
    """The request body as JSON in strict UTF-8, or a 400. Checked on the raw text, never by re-serialising:
    strict decoding rejects encoded surrogates, so a lone surrogate can only come from a \\uD800-style escape
    not paired with the next one (json.loads joins a pair into one character)."""
    try:  # strict UTF-8 (json.loads(bytes) would let encoded surrogates through)
        text = raw.decode("utf-8")
        body = json.loads(text)
    except (ValueError, UnicodeError, RecursionError) as exc:  # JSONDecodeError, int digits limit, nesting
        raise bad_request(f"the request body is not valid JSON in UTF-8: {str(exc)[:200]}",
                          code="invalid_json") from None
    lone = _lone_surrogate_escape(text)
    if lone is not None:
        raise bad_request(f"the request body is not valid JSON in UTF-8: it holds the lone surrogate {lone} "
                          "(a \\uD800-\\uDFFF escape that is not part of a high-low pair): surrogates not allowed",
                          code="invalid_json")
    return body


def _lone_surrogate_escape(text: str) -> str | None:
    """The first unpaired surrogate escape of a valid JSON text (backslashes occur only in its strings' escapes),
    else None."""
    if _SUSPECT.search(text) is None:  # the common case, escaped pairs (emoji from ASCII-only clients) included
        return None
    found = _SURROGATE_ESCAPE.search(_BACKSLASH_OR_PAIR.sub("", text))
    return None if found is None else found.group()


class Body:
    """Typed getters over a JSON object; each raises a 400 naming the parameter."""

    def __init__(self, body: Any) -> None:
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        self.d: dict[str, Any] = body

    def present(self, name: str) -> bool:
        return self.d.get(name) is not None

    def boolean(self, name: str, default: bool) -> bool:
        return self._typed(name, default, bool, "a boolean")

    def integer(self, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
        v = self.d.get(name)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            raise bad_request(f"'{name}' must be an integer, got {show(v)}", name)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise bad_request(f"'{name}' must be an integer {_range(lo, hi)}, got {v}", name)
        return v

    def number(self, name: str, default: float, lo: float | None = None, hi: float | None = None,
               lo_open: bool = False) -> float:
        v = self.d.get(name)
        if v is None:
            return default
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise bad_request(f"'{name}' must be a finite number, got {show(v)}", name)
        if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
            left = "(" if lo_open else "["
            raise bad_request(f"'{name}' must be in {left}{_bound(lo)}, {_bound(hi)}], got {v}", name)
        return float(v)

    def string(self, name: str, default: str | None) -> str | None:
        return self._typed(name, default, str, "a string")

    def _typed(self, name: str, default: Any, kind: type, what: str) -> Any:
        """The field NAME if it is a KIND, DEFAULT if absent or null; else a 400 saying it must be WHAT."""
        v = self.d.get(name)
        if v is None:
            return default
        if not isinstance(v, kind):
            raise bad_request(f"'{name}' must be {what}, got {show(v)}", name)
        return v

    def int_list(self, name: str) -> list[int]:
        v = self.d.get(name)
        if v is None:
            return []
        if not isinstance(v, list) or any(not isinstance(x, int) or isinstance(x, bool) for x in v):
            raise bad_request(f"'{name}' must be a list of integers", name)
        return v


def show(v: Any) -> str:
    """V as a 400 message quotes it: its repr, cut to 40 characters."""
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _bound(b: float | None) -> str:
    return "inf" if b is None else str(b)


def _range(lo: int | None, hi: int | None) -> str:
    """'between 0 and 20' / '>= 1' / '<= 5', with 2^63-style powers for the int64 limits."""
    def power(x: int) -> str:
        for k in (63, 64):
            if x in (2**k - 1, -(2**k)):
                return f"{'-' if x < 0 else ''}2^{k}{'-1' if x > 0 else ''}"
        return str(x)

    if lo is not None and hi is not None:
        return f"between {power(lo)} and {power(hi)}"
    return f">= {power(lo)}" if lo is not None else f"<= {power(hi)}" if hi is not None else ""


def listed(items: list[Any], quote: bool = True, limit: int = 20) -> str:
    """Up to LIMIT items, comma-separated (the count of the rest after them)."""
    shown = [show(x) if quote else str(x) for x in items[:limit]]
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(shown) + more


__all__ = ["Body", "listed", "parse_json_body", "show"]
