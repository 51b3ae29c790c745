"""Chat-sized token-id requests for the SLO search: the same lengths at every point, fresh ids per point.

Lengths (prompt uniform in e.g. 64..512 tokens, output in 32..256) come from the seed alone, so every
point of every engine does the same amount of work. The token ids are drawn again for each point (from
the seed and the point's index), so no engine's prefix cache or slot prompt cache can reuse one point's
prompts in the next. Ids avoid the tokenizer's special tokens; output lengths are fixed (ignore_eos).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from octavo.bench.workloads import BenchRequest
from octavo.errors import InvalidRequestError


@dataclass(slots=True, frozen=True)
class ChatShape:
    num_requests: int = 64
    prompt: tuple[int, int] = (64, 512)  # tokens, inclusive range
    output: tuple[int, int] = (32, 256)
    seed: int = 0

    def __post_init__(self) -> None:
        for lo, hi in (self.prompt, self.output):
            if not 1 <= lo <= hi:
                raise InvalidRequestError(f"length ranges need 1 <= low <= high: {self}")
        if self.num_requests < 2:
            raise InvalidRequestError("a point needs at least 2 requests")

    def lengths(self) -> list[tuple[int, int]]:
        rng = random.Random(self.seed)
        return [(rng.randint(*self.prompt), rng.randint(*self.output)) for _ in range(self.num_requests)]

    def describe(self) -> str:
        return (f"{self.num_requests} requests per point, prompts uniform in {self.prompt[0]}..{self.prompt[1]} "
                f"tokens, outputs {self.output[0]}..{self.output[1]} (fixed, EOS ignored), greedy")


def point_requests(shape: ChatShape, point: int, allowed_ids: list[int]) -> list[BenchRequest]:
    """The requests of the POINT-th measured point (0, 1, ...): shape's lengths, ids of that point."""
    rng = random.Random(f"{shape.seed}/{point}")
    return [BenchRequest([rng.choice(allowed_ids) for _ in range(n_in)], n_out, True, f"p{point}-{i}")
            for i, (n_in, n_out) in enumerate(shape.lengths())]


def mean_request(shape: ChatShape, allowed_ids: list[int]) -> BenchRequest:
    """One request of the mean lengths (calibration at zero load)."""
    lengths = shape.lengths()
    n_in = round(sum(p for p, _ in lengths) / len(lengths))
    n_out = round(sum(o for _, o in lengths) / len(lengths))
    rng = random.Random(f"{shape.seed}/calibrate")
    return BenchRequest([rng.choice(allowed_ids) for _ in range(n_in)], n_out, True, "calibrate")


def allowed_ids(model: str) -> list[int]:
    """Token ids of MODEL's tokenizer (an HF / export folder with tokenizer.json, or a .gguf) that are not
    special or added tokens."""
    from pathlib import Path

    from tokenizers import Tokenizer

    path = Path(model)
    if path.is_file():  # GGUF: the token types of its vocabulary (1 = normal; control / user-defined are not)
        import numpy as np
        from gguf import GGUFReader

        field = GGUFReader(path, "r").fields.get("tokenizer.ggml.token_type")
        if field is None:
            raise InvalidRequestError(f"{model}: the GGUF has no tokenizer.ggml.token_type")
        types = np.concatenate([field.parts[i] for i in field.data])
        ids = [int(i) for i in np.flatnonzero(types == 1)]
    elif (path / "tokenizer.json").is_file():
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        special = set(tok.get_added_tokens_decoder())
        ids = [i for i in range(tok.get_vocab_size(with_added_tokens=True)) if i not in special]
    else:
        raise InvalidRequestError(f"{model}: no tokenizer.json there and not a .gguf file")
    if not ids:
        raise InvalidRequestError(f"{model}: the tokenizer has no ordinary tokens to draw prompts from")
    return ids
