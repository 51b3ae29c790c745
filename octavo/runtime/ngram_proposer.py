"""NgramProposer: draft tokens by prompt lookup (vLLM's "ngram" method, llama.cpp's lookup decoding).

The last n tokens of a request (prompt + output), for n from prompt_lookup_max down to prompt_lookup_min,
are looked up earlier in the same tokens; at the first (earliest) place they occur, the tokens that followed
them there are the draft. Text that repeats its context (a summary quoting it, code being edited, a
rewrite) gets long drafts that the target mostly accepts; other text gets none, and costs nothing.

One scan: the positions holding the last token are found once with numpy, and each longer n only checks
the survivors one token further back (O(context) per request per step, no Python loop over the context).
"""
from __future__ import annotations

import numpy as np

from octavo.runtime.request import Request


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, req: Request, k: int) -> list[int]:
        """Up to K draft tokens to follow REQ's tokens ([] when its suffix occurs nowhere earlier)."""
        if k < 1 or req.num_tokens <= self.min_n:
            return []
        return propose_ngram(np.asarray(req.prompt_token_ids + req.output_token_ids, np.int64),
                             self.min_n, self.max_n, k)


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The K tokens after the earliest earlier occurrence of the longest suffix of TOKENS of length
    MIN_N..MAX_N (fewer if the context ends sooner; [] if none occurs)."""
    length = len(tokens)
    # ends[i]: where an earlier occurrence of the suffix would end; it must leave a token after it
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    matched: dict[int, np.ndarray] = {1: ends}
    for n in range(2, min(max_n, length - 1) + 1):  # survivors of n - 1 that also match one token further back
        ends = ends[ends >= n - 1]
        ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
        if not ends.size:
            break
        matched[n] = ends
    for n in range(min(max_n, max(matched)), min_n - 1, -1):
        if n in matched and matched[n].size:
            start = int(matched[n][0]) + 1
            return tokens[start: start + k].tolist()
    return []
