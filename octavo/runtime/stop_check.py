"""The token stops of a request (vLLM's check_stop): whether the token just committed ends it, and why.

Read by the scheduler's commit (Scheduler.update_from_output), which finishes the request; stop strings
are found later, in the text, by the output processor.
"""
from __future__ import annotations

from collections.abc import Set

from octavo.runtime.request import Request


def check_stop(req: Request, tok: int, eos_token_ids: Set[int], max_model_len: int | None,
               grammar_done: bool) -> tuple[str | None, int | None]:
    """(finish reason, stop token) for REQ whose last output token is TOK; (None, None) while it goes on.
    A stop token or EOS counts only once min_tokens are out; GRAMMAR_DONE: its output completed its
    grammar (nothing but EOS could follow)."""
    p = req.params
    min_done = req.num_output_tokens >= p.min_tokens
    if min_done and tok in p.stop_token_ids:
        return "stop", tok
    if (min_done and not p.ignore_eos and tok in eos_token_ids) or grammar_done:
        return "stop", None
    if req.num_output_tokens >= req.max_tokens or (max_model_len is not None and req.num_tokens >= max_model_len):
        return "length", None
    return None, None
