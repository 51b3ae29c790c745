"""Helpers shared by the engine tests: exported test models, seed-mix prompts, cached HF references."""
from __future__ import annotations

import json
import random
from pathlib import Path

from octavo.runtime.sampling_params import SamplingParams

SEED10 = Path("/work/shared/workloads/seed10.json")
_EXPORTED: dict[Path, Path] = {}
_HF: dict[Path, object] = {}
_REFS: dict[tuple, list[int]] = {}

# the seed's 10 requests (prompt tokens, generation tokens), used when the workload file is absent
SEED10_FALLBACK = [(2, 4), (507, 8), (7, 16), (10, 16), (14, 24), (9, 32), (187, 32), (10, 48), (8, 48), (6, 64)]
KIND_TEXT = {
    "Short answer": "What is 6 times 7?",
    "Long context": "The quick brown fox jumps over the lazy dog. ",
    "Short Q&A": "What is the capital of France? ",
    "Translation": "Translate to French: good morning, how are you today? ",
    "Math problem": "Solve: if x + 3 = 7 then x = 4. ",
    "Medium Q&A": "Once upon a time there was a small engine. ",
    "Multi-turn": "<|im_start|>user\nHéllo wörld<|im_end|>\n<|im_start|>assistant\nParis is the capital.<|im_end|>\n",
    "Code generation": "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)\n",
    "Long generation": "Write an essay about memory and paging. ",
    "Essay": "Write an essay about the history of computing. ",
}


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy decoding of exactly max_tokens tokens (EOS ignored): what the HF references compare against."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def llm_greedy(folder: Path, prompts: list[list[int]], max_tokens: int, **engine_args: object) -> list[list[int]]:
    """octavo.LLM's greedy continuation (exactly max_tokens, EOS ignored) of each token-id prompt, in order."""
    from octavo.runtime.llm import LLM

    llm = LLM(str(folder), **engine_args)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens), use_tqdm=False)
    finally:
        llm.close()
    return [list(o.outputs[0].token_ids) for o in outs]


def exported(hf_dir: Path) -> Path:
    """Export a test checkpoint once per session (next to it)."""
    if hf_dir not in _EXPORTED:
        from octavo.export import export_model

        out = Path(f"{hf_dir}_octavo")
        export_model(hf_dir, out, progress=False, overwrite=True)
        _EXPORTED[hf_dir] = out
    return _EXPORTED[hf_dir]


def seed10_requests(tokenizer) -> list[tuple[list[int], int]]:  # noqa: ANN001
    """The seed's mix: prompts of exactly the seed's token lengths, written like its request kinds."""
    spec = SEED10_FALLBACK
    kinds = list(KIND_TEXT.values())
    if SEED10.is_file():
        data = json.loads(SEED10.read_text())["requests"]
        spec = [(r["prompt_tokens"], r["generation_tokens"]) for r in data]
        kinds = [next((v for k, v in KIND_TEXT.items() if r["type"].startswith(k)), "Hello. ") for r in data]
    out = []
    for (n_prompt, n_gen), text in zip(spec, kinds):
        ids = tokenizer.encode(text)
        while len(ids) < n_prompt:
            ids = ids + tokenizer.encode(text)
        out.append((ids[:n_prompt], n_gen))
    return out


def random_requests(n: int, seed: int, vocab: int = 384, max_prompt: int = 200, max_gen: int = 32) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(5, vocab) for _ in range(rng.randrange(1, max_prompt))], rng.randrange(1, max_gen))
            for _ in range(n)]


def shared_prefix_requests(n: int, seed: int, prefix_len: int = 70) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(5, 384) for _ in range(prefix_len)]
    return [(prefix + [rng.randrange(5, 384) for _ in range(rng.randrange(1, 40))], rng.randrange(4, 20))
            for _ in range(n)]


def hf_reference(hf_dir: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers greedy continuation, computed once per session per (model, prompt, length)."""
    from models import hf_greedy, load_hf

    key = (hf_dir, tuple(prompt), max_tokens)
    if key not in _REFS:
        if hf_dir not in _HF:
            _HF[hf_dir] = load_hf(hf_dir)[0]
        _REFS[key] = hf_greedy(_HF[hf_dir], prompt, max_tokens)
    return _REFS[key]


def prefill_logits(folder: Path, ids: list[int], block_size: int = 16) -> "np.ndarray":
    """An export's logits for every position of IDS, prefilled in one step over a reversed block table."""
    import numpy as np

    from octavo.export.manifest import Manifest
    from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend
    from step_inputs import one_sequence

    blocks = -(-len(ids) // block_size)
    backend = OnnxRuntimeBackend(folder, Manifest.load(folder), num_blocks=blocks, block_size=block_size, num_threads=1,
                                 kv_cache_dtype="float32")  # the weights' exactness, whatever "auto" picks
    try:
        table = np.arange(blocks, dtype=np.int32)[::-1]
        return backend.run(one_sequence(ids, 0, table, block_size, all_logits=True))
    finally:
        backend.close()


def hf_prompt_logits(src: Path, ids: list[int]) -> "np.ndarray":
    """transformers' logits for every position of IDS (the checkpoint in SRC, float32)."""
    import torch
    from models import load_hf

    with torch.no_grad():
        return load_hf(src)[0](torch.tensor([ids])).logits[0].numpy()
