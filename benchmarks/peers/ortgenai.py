"""onnxruntime-genai peer: its batched Generator on the CPU EP, the model from its own model builder.

A genai Generator runs one static batch: the prompts are padded with the config's pad token (genai
derives the attention mask from it), all rows grow to one max_length, and min_length = max_length keeps
EOS out. Padding goes on the right: measured here (0.18), right-padded rows reproduce each prompt's
unbatched greedy output, left-padded rows do not. Batches are taken in workload order; each request keeps its first max_tokens outputs.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.peers.requests import IdWorkload
from benchmarks.peers.result import PeerResult, run_static_batches

NAME = "onnxruntime-genai"
MAX_BATCH = 32  # onnxruntime-genai 0.18 refuses batch_size > 32 ("must be in [1, 32]")


def load(genai_dir: Path, threads: int) -> tuple[Any, int]:
    """(og.Model with `threads` intra-op threads, pad token id)."""
    import onnxruntime_genai as og

    config = og.Config(str(genai_dir))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    pad = json.loads((genai_dir / "genai_config.json").read_text())["model"]["pad_token_id"]
    return og.Model(config), int(pad[0] if isinstance(pad, list) else pad)


def _generate(model: Any, pad: int, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    import numpy as np
    import onnxruntime_genai as og

    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad, dtype=np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=width + max_new, min_length=width + max_new,
                              batch_size=len(prompts))
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    while not gen.is_done():
        gen.generate_next_token()
    return [list(map(int, gen.get_sequence(i)[width:])) for i in range(len(prompts))]


def run(loaded: tuple[Any, int], workload: IdWorkload, batch_size: int) -> PeerResult:
    model, pad = loaded
    return run_static_batches(NAME, workload, batch_size,
                              lambda prompts, max_new: _generate(model, pad, prompts, max_new))


def warm_up(loaded: tuple[Any, int]) -> None:
    model, pad = loaded
    _generate(model, pad, [[5, 6, 7, 8], [9, 10]], 4)
