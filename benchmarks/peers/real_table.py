"""The real-model comparison's table: each workload measured by its own metric, and octavo's speed over
each peer's (> 1: octavo is faster), from results of one run.

    batchN        output tok/s of N requests sent at once (the workload's tokens / its wall clock)
    decodeP+N     decode tok/s of one request, the first token left out: (N - 1) / (t_last - t_first)
    prefillP      seconds for one long-prompt request (speed ratio = peer seconds / octavo seconds)

Rounds use distinct random prompts (nothing of a timed prompt is ever cached); each (peer, workload)
keeps its best round. Greedy-token agreement is measured on the first round, against HF transformers
one request at a time on the same weights (where it ran).
"""
from __future__ import annotations

from typing import Any

from benchmarks.peers.result import REFERENCE, PeerResult, agreement
from benchmarks.peers.vllm import NAME as VLLM  # the float32 server's row: issue 18's targets are against it

OURS = "octavo"


def kind(workload: str) -> str:
    for k in ("batch", "decode", "prefill"):
        if workload.startswith(k):
            return k
    raise ValueError(f"not a real-model workload: {workload!r}")


def metric(r: PeerResult) -> float | None:
    """The workload's own number for R: tok/s (batch, decode) or seconds (prefill)."""
    if not r.ok:
        return None
    k = kind(r.workload)
    if k == "batch":
        return r.output_tok_s or None
    if k == "decode":
        return r.extra.get("decode_tok_s")
    return r.elapsed_s or None


def speed(r: PeerResult) -> float | None:
    """Bigger is faster, whatever the metric: tok/s as is, seconds inverted."""
    m = metric(r)
    if m is None:
        return None
    return 1.0 / m if kind(r.workload) == "prefill" else m


UNITS = {"batch": "output tok/s", "decode": "decode tok/s", "prefill": "seconds"}


def first_round_agreement(results: list[PeerResult]) -> dict[tuple[str, str], float]:
    """(peer, workload) -> share of requests with HF's greedy tokens, on round 0's prompts."""
    ref = {r.workload: r.outputs for r in results
           if r.peer == REFERENCE and r.ok and r.outputs and r.extra.get("round", 0) == 0}
    out: dict[tuple[str, str], float] = {}
    for r in results:
        if r.extra.get("round", 0) == 0 and r.ok and r.outputs and r.workload in ref:
            a = agreement(r.outputs, ref[r.workload])
            if a is not None:
                out[(r.peer, r.workload)] = a
    return out


def best_rounds(results: list[PeerResult]) -> list[PeerResult]:
    """One result per (peer, workload): its fastest round by the workload's metric; every round's number
    goes to extra["rounds"]."""
    best: dict[tuple[str, str], PeerResult] = {}
    rounds: dict[tuple[str, str], list[float]] = {}
    for r in results:
        key = (r.peer, r.workload)
        m = metric(r)
        if m is not None:
            rounds.setdefault(key, []).append(m)
        cur = best.get(key)
        if cur is None or ((speed(r) or 0.0) > (speed(cur) or 0.0)):
            best[key] = r
    for key, r in best.items():
        if len(rounds.get(key, [])) > 1:
            r.extra["rounds"] = rounds[key]
    return list(best.values())


def build(results: list[PeerResult], agree: dict[tuple[str, str], float]) -> dict[str, dict[str, Any]]:
    """workload -> peer -> {ok, error, metric, unit, octavo_speedup, agreement_with_hf, ttft_s, ...}."""
    table: dict[str, dict[str, Any]] = {}
    for r in results:
        table.setdefault(r.workload, {})
    for workload, row in table.items():
        by_peer = {r.peer: r for r in results if r.workload == workload}
        ours = speed(by_peer[OURS]) if OURS in by_peer else None
        for name, r in by_peer.items():
            s = speed(r)
            row[name] = {"ok": r.ok and s is not None, "error": r.error, "metric": metric(r),
                         "unit": UNITS[kind(workload)], "elapsed_s": r.elapsed_s, "output_tokens": r.output_tokens,
                         "output_tok_s": r.output_tok_s, "ttft_s": r.extra.get("ttft_s"),
                         "octavo_speedup": ours / s if ours and s else None,
                         "agreement_with_hf": agree.get((name, workload))}
            if r.ok and s is None:
                row[name]["error"] = "no timing for this workload's metric"
    return table


def targets(table: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Issue 18's 'done means' on the real model: octavo's speed over the peer named, None when not measured.
    vLLM's float32 row is the one the issue measured and set targets against; a vLLM row in another dtype
    (compare_peers --vllm-dtype float32,bfloat16) gets lines of its own beside them, without a target."""
    def up(prefix: str, peer: str, exact: bool = False) -> float | None:
        row = next((r for w, r in table.items() if w.startswith(prefix)), {})
        found = [e["octavo_speedup"] for p, e in row.items()
                 if (p == peer if exact else p.startswith(peer)) and e.get("octavo_speedup")]
        return min(found, default=None)  # several llama-server -np rows: the one closest to octavo counts

    def vs_faster(prefix: str, vllm: str) -> float | None:
        found = [v for v in (up(prefix, "llama.cpp"), up(prefix, vllm, exact=True)) if v is not None]
        return min(found, default=None)

    def variant(prefix: str, name: str, base: float | None) -> float | None:
        """BASE (octavo's default over a peer) for the octavo row NAME instead: base / (default over NAME)."""
        row = next((r for w, r in table.items() if w.startswith(prefix)), {})
        ratio = row.get(name, {}).get("octavo_speedup")
        return base / ratio if base is not None and ratio else None

    checks = {
        "decode: octavo / llama-server >= 1.2": up("decode", "llama.cpp"),
        f"batch: octavo / {VLLM} >= 1.5": up("batch", VLLM, exact=True),
        "batch: octavo / llama-server (best -np) >= 2": up("batch", "llama.cpp"),
        "prefill: octavo / faster of llama-server and vLLM >= 1.5": vs_faster("prefill", VLLM),
    }
    bf16 = "octavo --quant-kernel block-bf16"  # compare_peers --octavo-kernels block-bf16: AMX CPUs' prompt path
    has_bf16 = any(bf16 in row for row in table.values())
    if has_bf16:
        checks[f"batch: {bf16} / {VLLM} >= 1.5"] = variant("batch", bf16, up("batch", VLLM, exact=True))
        checks[f"prefill: {bf16} / faster of llama-server and vLLM >= 1.5"] = variant(
            "prefill", bf16, vs_faster("prefill", VLLM))
    others = sorted({p for row in table.values() for p in row if p.startswith(VLLM + " ")})
    for other in others:  # e.g. "vLLM CPU bfloat16": every layer of vLLM in that dtype
        for prefix in ("batch", "prefill"):
            base = up(prefix, other, exact=True)
            checks[f"{prefix}: octavo / {other} (no target)"] = base
            if has_bf16:
                checks[f"{prefix}: {bf16} / {other} (no target)"] = variant(prefix, bf16, base)
    return checks


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(table: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'workload':16s} {'peer':34s} {'metric':>10s} {'unit':14s} {'TTFT s':>7s} {'octavo/peer':>11s} "
             f"{'same tokens as HF':>17s}"]
    for workload, row in table.items():
        for peer, e in row.items():
            if not e["ok"]:
                lines.append(f"{workload:16s} {peer:34s} not run: {e['error']}")
                continue
            agree = e.get("agreement_with_hf")
            lines.append(f"{workload:16s} {peer:34s} {e['metric']:10.2f} {e['unit']:14s} {_fmt(e['ttft_s'], '7.2f'):>7s} "
                         f"{(_fmt(e['octavo_speedup'], '.2f') + 'x') if e['octavo_speedup'] else '-':>11s} "
                         f"{(_fmt(agree * 100, '.0f') + '%') if agree is not None else '-':>17s}")
    return "\n".join(lines)


def markdown(table: dict[str, dict[str, Any]], checks: dict[str, float | None], header: str) -> str:
    lines = [header, "", "| workload | peer | metric | unit | TTFT (s) | octavo / peer (speed) | same tokens as HF |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: |"]
    for workload, row in table.items():
        for peer, e in row.items():
            if not e["ok"]:
                lines.append(f"| {workload} | {peer} | not run: {e['error']} | | | | |")
                continue
            agree = e.get("agreement_with_hf")
            lines.append(f"| {workload} | {peer} | {e['metric']:.2f} | {e['unit']} | {_fmt(e['ttft_s'], '.2f')} | "
                         f"{_fmt(e['octavo_speedup'], '.2f')}x | {'-' if agree is None else f'{agree * 100:.0f}%'} |")
    lines += ["", "| target | measured |", "| --- | ---: |"]
    lines += [f"| {k} | {'not measured' if v is None else f'{v:.2f}'} |" for k, v in checks.items()]
    return "\n".join(lines) + "\n"
