"""The tool-call parsers by their `--tool-call-parser` names (vLLM's), each made for one request's tools.

  hermes, llama3_json   serving/tool_parsers.py
  mistral               serving/tool_parser_mistral.py
  pythonic              serving/tool_parser_pythonic.py
  qwen3_coder           serving/tool_parser_qwen3_coder.py (reads values by the tools' parameter schemas)
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from octavo.serving.tool_parser_mistral import MistralParser, mistral_call_id
from octavo.serving.tool_parser_pythonic import PythonicParser
from octavo.serving.tool_parser_qwen3_coder import Qwen3CoderParser
from octavo.serving.tool_parsers import HermesParser, Llama3JsonParser
from octavo.serving.tools import new_call_id

TOOL_CALL_PARSERS: dict[str, Callable[[list[dict[str, Any]] | None], Any]] = {
    "hermes": lambda tools: HermesParser(),
    "llama3_json": lambda tools: Llama3JsonParser(),
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "qwen3_coder": Qwen3CoderParser,
}
# parsers whose markers are special tokens: a request with tools keeps special tokens in its text
KEEPS_SPECIAL_TOKENS = frozenset({"mistral"})


def get_parser(name: str, tools: list[dict[str, Any]] | None = None) -> Any:
    """The parser NAME for a request with TOOLS (ValueError naming the choices if unknown)."""
    try:
        make = TOOL_CALL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(TOOL_CALL_PARSERS)}") from None
    return make(tools)


def call_id_maker(name: str | None) -> Callable[[], str]:
    """How calls are named under parser NAME (forced calls too): Mistral's templates want 9 letters and digits."""
    return mistral_call_id if name == "mistral" else new_call_id


__all__ = ["KEEPS_SPECIAL_TOKENS", "TOOL_CALL_PARSERS", "call_id_maker", "get_parser"]
