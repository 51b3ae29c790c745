"""What one peer returns for one workload, and the comparison built from all of them.

Throughput counts the tokens the workload asked for (sum of max_tokens) over the wall-clock time of
the whole workload, for every peer alike; tokens a static batch generates past a request's own
max_tokens (padding waste) are work it pays for but not output it gets credit for.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

REFERENCE = "hf-sequential"  # whose greedy tokens the others are checked against ...
FALLBACK_REFERENCE = "hf-static-batch"  # ... or these, on a workload the reference did not run


def reference_outputs(results: list[PeerResult], workload: str) -> tuple[str, list[list[int]]] | None:
    for name in (REFERENCE, FALLBACK_REFERENCE):
        r = next((r for r in results if r.peer == name and r.workload == workload and r.ok and r.outputs), None)
        if r is not None:
            return name, r.outputs
    return None


@dataclass(slots=True)
class PeerResult:
    peer: str
    workload: str
    num_requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0  # tokens the requests asked for and got
    elapsed_s: float = 0.0
    generated_tokens: int = 0  # including static-batch padding waste
    outputs: list[list[int]] = field(default_factory=list)  # greedy token ids per request (workload order)
    error: str | None = None  # set when the peer could not run this workload; the rest is then empty
    extra: dict[str, Any] = field(default_factory=dict)  # peer-specific facts (batch size, slots, latency, ...)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.ok and self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "output_tok_s": self.output_tok_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PeerResult:
        fields = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**fields)


def run_static_batches(peer: str, workload: Any, batch_size: int,
                       generate: Callable[[list[list[int]], int], list[list[int]]]) -> PeerResult:
    """Padded static batching: each batch of `batch_size` requests generates its longest request's length.
    Tokens beyond a request's own length are paid for (generated_tokens) but not credited (output_tokens)."""
    res = PeerResult(peer, workload.name, len(workload.requests), workload.prompt_tokens)
    reqs = workload.requests
    t0 = time.perf_counter()
    for start in range(0, len(reqs), batch_size):
        batch = reqs[start:start + batch_size]
        max_new = max(r.max_tokens for r in batch)
        gen = generate([r.prompt for r in batch], max_new)
        res.outputs.extend(g[: r.max_tokens] for g, r in zip(gen, batch))
        res.generated_tokens += max_new * len(batch)
    res.elapsed_s = time.perf_counter() - t0
    res.output_tokens = sum(len(o) for o in res.outputs)
    res.extra = {"batch_size": batch_size}
    return res


def agreement(a: list[list[int]], b: list[list[int]]) -> float | None:
    """Fraction of requests whose greedy tokens are identical (None when either side has none)."""
    if not a or not b or len(a) != len(b):
        return None
    return sum(x == y for x, y in zip(a, b)) / len(a)


def compare(results: list[PeerResult], ours: str = "octavo") -> dict[str, dict[str, Any]]:
    """Per workload: each peer's output tok/s, octavo/peer ratio and token agreement with the reference."""
    table: dict[str, dict[str, Any]] = {}
    for r in results:
        table.setdefault(r.workload, {})
    for workload, row in table.items():
        by_peer = {r.peer: r for r in results if r.workload == workload}
        mine = by_peer.get(ours)
        ref = reference_outputs(results, workload)
        for name, r in by_peer.items():
            entry: dict[str, Any] = {"ok": r.ok, "output_tokens": r.output_tokens, "elapsed_s": r.elapsed_s,
                                     "output_tok_s": r.output_tok_s, "error": r.error}
            if mine is not None and mine.ok and r.ok and r.output_tok_s > 0:
                entry["octavo_over_peer"] = mine.output_tok_s / r.output_tok_s
            if ref is not None and r.ok and r.outputs:
                entry["agreement_with_hf"] = agreement(r.outputs, ref[1])
                entry["hf_reference"] = ref[0]
            row[name] = entry
    return table


def format_table(table: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'workload':15s} {'peer':26s} {'out tok':>8s} {'time s':>8s} {'out tok/s':>10s} {'octavo/peer':>11s} "
             f"{'same tokens as HF':>17s}"]
    for workload, row in table.items():
        for peer, e in row.items():
            if not e["ok"]:
                lines.append(f"{workload:15s} {peer:26s} not run: {e['error']}")
                continue
            ratio = e.get("octavo_over_peer")
            agree = e.get("agreement_with_hf")
            lines.append(f"{workload:15s} {peer:26s} {e['output_tokens']:8d} {e['elapsed_s']:8.2f} {e['output_tok_s']:10.1f} "
                         f"{(f'{ratio:.2f}x' if ratio is not None else '-'):>11s} "
                         f"{(f'{agree * 100:.0f}%' if agree is not None else '-'):>17s}")
    return "\n".join(lines)
