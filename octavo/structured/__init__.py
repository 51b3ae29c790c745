"""Structured outputs: JSON schema, regex, choice and grammar constraints enforced while decoding
(llguidance), per request, under continuous batching. See docs/structured_outputs.md."""
from octavo.structured.params import StructuredOutputError, StructuredOutputsParams

__all__ = ["StructuredOutputError", "StructuredOutputsParams"]
