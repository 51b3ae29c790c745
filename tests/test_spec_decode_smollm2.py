"""Speculative decoding on the embedded SmolLM2 GGUF (slow): greedy output token for token the same with n-gram
speculation as without, on text that repeats its prompt (most drafts accepted) and on text that does not."""
from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams

pytestmark = pytest.mark.slow

TEXT = ("The engine keeps a paged KV cache: fixed-size blocks and a block table per sequence. Requests join and "
        "leave the batch every step, and long prompts are prefilled in chunks beside running decodes. ")
CHATS = [[{"role": "user", "content": "Repeat the following text exactly, word for word:\n\n" + TEXT * 2}],
         [{"role": "user", "content": "Write a short poem about the sea."}],
         [{"role": "user", "content": "Fix the bug and return the whole function:\n\ndef mean(xs):\n"
                                      "    total = 0\n    for x in xs:\n        total += x\n    return total / len(x)\n"}]]


def test_greedy_is_unchanged_and_repeats_are_accepted() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=96)
    base = LLM("smollm2-135m-instruct")
    want = [o.outputs[0].token_ids for o in base.chat(CHATS, params, use_tqdm=False)]
    base.engine.close()
    spec = LLM("smollm2-135m-instruct", speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                             "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    got = [o.outputs[0].token_ids for o in spec.chat(CHATS, params, use_tqdm=False)]  # all three in one batch
    assert got == want
    alone = spec.chat(CHATS[0], params, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == want[0]
    st = spec.engine.stats()
    assert st.spec_decode_num_accepted_tokens > 0.5 * st.spec_decode_num_draft_tokens > 10
