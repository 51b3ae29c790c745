"""HF transformers peer: greedy `generate` one request at a time, and padded static batching.

Static batching (what serving looked like before continuous batching): requests are taken in workload
order in batches of `batch_size`, left-padded to the batch's longest prompt with an attention mask,
and the whole batch generates the batch's largest max_tokens; each request keeps its first max_tokens.
EOS is ignored (min_new_tokens = max_new_tokens), so every request produces exactly what it asked for.
One request at a time on a one-request workload also reports TTFT and decode tok/s, timed by a streamer
that reads the clock as each token comes out of `generate`.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.peers.requests import IdWorkload
from benchmarks.peers.result import PeerResult, run_static_batches
from benchmarks.peers.streamed import decode_stats

PAD_ID = 2


def load(hf_dir: Path, threads: int) -> Any:
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, use_safetensors=True)
    model.eval()
    return model


class TokenClock:
    """A `generate` streamer that only reads the clock: its first put() is the prompt, each later one a token."""

    def __init__(self) -> None:
        self.puts: list[float] = []

    def put(self, value: Any) -> None:  # noqa: ARG002 - the tokens come back from generate anyway
        self.puts.append(time.perf_counter())

    def end(self) -> None:
        pass

    @property
    def token_times(self) -> list[float]:
        return self.puts[1:]


def _generate(model: Any, prompts: list[list[int]], max_new: int,
              streamer: TokenClock | None = None) -> tuple[list[list[int]], int]:
    """Left-padded batch -> (generated ids per row, padded prompt length)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                             do_sample=False, pad_token_id=PAD_ID, eos_token_id=None, streamer=streamer)
    return out[:, width:].tolist(), width


def run_sequential(model: Any, workload: IdWorkload) -> PeerResult:
    res = PeerResult("hf-sequential", workload.name, len(workload.requests), workload.prompt_tokens)
    clock = TokenClock() if len(workload.requests) == 1 else None
    t0 = time.perf_counter()
    for r in workload.requests:
        (gen,), _ = _generate(model, [r.prompt], r.max_tokens, clock)
        res.outputs.append(gen[: r.max_tokens])
        res.generated_tokens += len(gen)
    res.elapsed_s = time.perf_counter() - t0
    res.output_tokens = sum(len(o) for o in res.outputs)
    if clock is not None and clock.token_times:
        times = clock.token_times
        res.extra.update(decode_stats(len(times), t0, times[0], times[-1]))
    return res


def run_static(model: Any, workload: IdWorkload, batch_size: int) -> PeerResult:
    return run_static_batches("hf-static-batch", workload, batch_size,
                              lambda prompts, max_new: _generate(model, prompts, max_new)[0])


def warm_up(model: Any) -> None:
    _generate(model, [[5, 6, 7, 8], [9, 10]], 4)


def top2_margins(model: Any, sequences: list[list[int]]) -> list[float]:
    """HF's own gap between its best and second-best next-token logit after each sequence: how close
    to a tie greedy decoding was where another engine picked a different token."""
    import torch

    out = []
    with torch.inference_mode():
        for seq in sequences:
            top = torch.topk(model(torch.tensor([seq])).logits[0, -1], 2).values
            out.append(float(top[0] - top[1]))
    return out
