"""Benchmark results: the per-request record, the summary `vllm bench serve` reports, and its table.

Definitions (as vLLM's): TTFT = first streamed text after the request was sent; ITL = gaps between
consecutive streamed chunks; TPOT = (E2E - TTFT) / (output tokens - 1) per request with > 1 token;
E2E = request sent to last chunk. Throughputs divide by the benchmark's wall-clock duration.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(slots=True)
class RequestResult:
    success: bool = False
    prompt_len: int = 0  # tokens, as the server counted them (usage)
    output_len: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    generated_text: str = ""
    error: str = ""


METRICS = ("ttft", "tpot", "itl", "e2el")
_TITLES = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
           "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}


def summarize(results: list[RequestResult], duration: float, percentiles: tuple[float, ...] = (99.0,)) -> dict[str, Any]:
    """vLLM's keys: completed, duration, totals, throughputs, mean/median/std/pNN of each latency (ms)."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    d = max(duration, 1e-9)
    out: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / d, "output_throughput": total_out / d,
        "total_token_throughput": (total_in + total_out) / d,
    }
    for name, xs in series.items():
        arr = np.asarray(xs, dtype=np.float64) * 1000.0
        have = arr.size > 0
        out[f"mean_{name}_ms"] = float(arr.mean()) if have else 0.0
        out[f"median_{name}_ms"] = float(np.median(arr)) if have else 0.0
        out[f"std_{name}_ms"] = float(arr.std()) if have else 0.0
        for p in percentiles:
            out[f"p{_pct(p)}_{name}_ms"] = float(np.percentile(arr, p)) if have else 0.0
    out["input_lens"] = [r.prompt_len for r in results]
    out["output_lens"] = [r.output_len for r in results]
    out["ttfts"] = [r.ttft for r in results]
    out["itls"] = [r.itl for r in results]
    out["generated_texts"] = [r.generated_text for r in results]
    out["errors"] = [r.error for r in results]
    return out


def _pct(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def serve_table(s: dict[str, Any], percentiles: tuple[float, ...] = (99.0,)) -> str:
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append("{:<40} {:<10}".format(label, format(value, fmt)))

    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    if s.get("max_concurrency") is not None:
        row("Maximum request concurrency:", s["max_concurrency"])
    row("Benchmark duration (s):", s["duration"], ".2f")
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", s["output_throughput"], ".2f")
    row("Total Token throughput (tok/s):", s["total_token_throughput"], ".2f")
    for name in METRICS:
        title, short = _TITLES[name]
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        row(f"Mean {short} (ms):", s[f"mean_{name}_ms"], ".2f")
        row(f"Median {short} (ms):", s[f"median_{name}_ms"], ".2f")
        for p in percentiles:
            row(f"P{_pct(p)} {short} (ms):", s[f"p{_pct(p)}_{name}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


@dataclass(slots=True)
class SpecDecodeSummary:
    """Speculative decoding during a run (vLLM's spec-decode counters, the engine's deltas over the run)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]

    @classmethod
    def between(cls, before: Any, after: Any) -> SpecDecodeSummary | None:
        """The counters' change from engine stats BEFORE to AFTER; None when no draft was verified."""
        drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
        if not drafts:
            return None
        per_pos = [a - b for a, b in zip(after.spec_decode_num_accepted_tokens_per_pos,
                                          before.spec_decode_num_accepted_tokens_per_pos)]
        return cls(drafts, after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
                   after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens, per_pos)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(self.num_draft_tokens, 1)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step gave a request that had drafts (accepted + the target's own), vLLM's."""
        return 1 + self.num_accepted_tokens / self.num_drafts

    def line(self) -> str:
        per_pos = ", ".join(f"{a / self.num_drafts:.2f}" for a in self.accepted_per_position)
        return (f"Speculative decoding: acceptance rate {100 * self.acceptance_rate:.1f}% ({self.num_accepted_tokens}"
                f" of {self.num_draft_tokens} draft tokens), mean acceptance length {self.mean_acceptance_length:.2f},"
                f" per-position acceptance {per_pos}")


@dataclass(slots=True)
class ThroughputResult:
    """`octavo bench throughput`: offline, all requests submitted at once through octavo.LLM."""

    num_requests: int
    elapsed_time: float
    total_prompt_tokens: int
    total_output_tokens: int
    spec_decode: SpecDecodeSummary | None = None  # with --speculative-config, when drafts were verified

    @property
    def total_num_tokens(self) -> int:
        return self.total_prompt_tokens + self.total_output_tokens

    def to_dict(self) -> dict[str, Any]:
        e = max(self.elapsed_time, 1e-9)
        d = asdict(self)
        if self.spec_decode is not None:
            d["spec_decode"].update(acceptance_rate=self.spec_decode.acceptance_rate,
                                    mean_acceptance_length=self.spec_decode.mean_acceptance_length)
        return {**d, "total_num_tokens": self.total_num_tokens,
                "requests_per_second": self.num_requests / e, "tokens_per_second": self.total_num_tokens / e,
                "output_tokens_per_second": self.total_output_tokens / e}

    def table(self) -> str:
        d = self.to_dict()
        return (f"Throughput: {d['requests_per_second']:.2f} requests/s, {d['tokens_per_second']:.2f} total tokens/s, "
                f"{d['output_tokens_per_second']:.2f} output tokens/s\n"
                f"Total num prompt tokens:  {self.total_prompt_tokens}\n"
                f"Total num output tokens:  {self.total_output_tokens}\n"
                f"Elapsed time (s):         {self.elapsed_time:.2f}"
                + (f"\n{self.spec_decode.line()}" if self.spec_decode is not None else ""))


def save_json(path: str | Path, result: dict[str, Any]) -> Path:
    path = Path(path)
    if path.parent != Path():
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
