"""An honest KV-memory report from trace rows: slots allocated (blocks × block_size) vs tokens held.

The seed claims "zero waste". Paging removes the static reservation for the longest possible sequence,
but the last block of every request is only partly filled (internal fragmentation, < block_size slots
per request). This module measures both, next to what a static max-length allocation would reserve.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from octavo.tracing.spans import RequestSpan
from octavo.tracing.textgrid import grid
from octavo.tracing.timeline import label_of


@dataclass(slots=True)
class RequestMemory:
    id: str
    tokens: int  # total_len at its last scheduled step
    blocks: int
    slots: int  # blocks * block_size

    @property
    def unused(self) -> int:
        return self.slots - self.tokens


@dataclass(slots=True)
class MemoryReport:
    block_size: int
    total_blocks: int
    peak_step: int
    peak_used_blocks: int  # total - free at the peak step (the pool's view)
    peak_request_blocks: int  # sum of blocks held after the peak step by the requests scheduled in it
    peak_tokens: int  # sum of total_len of those requests (tokens in their KV cache)
    requests: list[RequestMemory]
    num_requests: int
    static_padded_slots: int  # num_requests * (max prompt_len + max output_len)
    max_prompt: int
    max_output: int
    static_max_len_slots: int | None  # max_num_seqs * max_model_len, when known
    max_num_seqs: int | None
    max_model_len: int | None
    pool_slot_steps: int  # sum over steps of the pool's used blocks * block_size
    request_slot_steps: int  # sum over steps of the blocks * block_size each holding request has
    token_slot_steps: int  # sum over steps of the tokens those requests hold
    static_slot_steps: int  # static_padded_slots held for every step of the run
    bytes_per_slot: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def peak_slots(self) -> int:
        return self.peak_used_blocks * self.block_size

    @property
    def peak_unused(self) -> int:
        return self.peak_request_blocks * self.block_size - self.peak_tokens


def holding(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The row's scheduled requests that still hold their blocks after the step (not finished in it)."""
    done = {f["id"] for f in row["finished"]}
    return [q for q in row["requests"] if q["id"] not in done]


def memory_report(
    rows: list[dict[str, Any]],
    spans: list[RequestSpan],
    *,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
    bytes_per_slot: int | None = None,
) -> MemoryReport:
    """Measure the run's KV memory. Requires at least one row."""
    bs = rows[0]["block_size"]
    peak = max(rows, key=lambda r: (r["total_blocks"] - r["free_blocks"], -r["step"]))
    used = lambda r: r["total_blocks"] - r["free_blocks"]  # noqa: E731
    max_prompt = max((s.prompt_len for s in spans), default=0)
    max_output = max((s.output_len for s in spans), default=0)
    static_padded = len(spans) * (max_prompt + max_output)
    report = MemoryReport(
        block_size=bs,
        total_blocks=max(r["total_blocks"] for r in rows),
        peak_step=peak["step"],
        peak_used_blocks=used(peak),
        peak_request_blocks=sum(r["blocks"] for r in holding(peak)),
        peak_tokens=sum(r["total_len"] for r in holding(peak)),
        requests=[RequestMemory(s.id, s.total_len, s.last_blocks, s.last_blocks * bs) for s in spans if s.last_blocks],
        num_requests=len(spans),
        static_padded_slots=static_padded,
        max_prompt=max_prompt,
        max_output=max_output,
        static_max_len_slots=max_num_seqs * max_model_len if max_num_seqs and max_model_len else None,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        pool_slot_steps=sum(used(r) * bs for r in rows),
        request_slot_steps=sum(sum(q["blocks"] for q in holding(r)) * bs for r in rows),
        token_slot_steps=sum(sum(q["total_len"] for q in holding(r)) for r in rows),
        static_slot_steps=static_padded * len(rows),
        bytes_per_slot=bytes_per_slot,
    )
    if report.peak_used_blocks != report.peak_request_blocks:
        report.notes.append(
            f"at step {report.peak_step} the pool had {report.peak_used_blocks} blocks in use while the requests "
            f"scheduled in it held {report.peak_request_blocks}: "
            + ("prefix-cache blocks shared by several requests count once in the pool"
               if report.peak_used_blocks < report.peak_request_blocks
               else "requests not scheduled that step (waiting for budget) also hold blocks")
        )
    return report


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _size(slots: int, bytes_per_slot: int | None) -> str:
    if not bytes_per_slot:
        return ""
    n = slots * bytes_per_slot
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f" ({n:.1f} {unit})" if unit != "B" else f" ({n} B)"
        n /= 1024
    return ""


def format_memory_report(m: MemoryReport) -> str:
    bs, bps = m.block_size, m.bytes_per_slot
    pool = m.total_blocks * bs
    out = [
        f"KV cache: {m.total_blocks} blocks × {bs} slots = {pool} slots{_size(pool, bps)}"
        + (f"; one slot = one token's K and V in every layer = {bps} B" if bps else ""),
        f"Peak (step {m.peak_step}): {m.peak_used_blocks} blocks = {m.peak_slots} slots in use{_size(m.peak_slots, bps)}; "
        f"the requests held {m.peak_request_blocks} blocks = {m.peak_request_blocks * bs} slots for {m.peak_tokens} "
        f"tokens: {m.peak_unused} slots ({_pct(m.peak_unused, m.peak_request_blocks * bs)}) allocated but empty.",
        "",
        "Per request, at its last step (sum: over requests, each at its own last step): slots = blocks × block_size; "
        "unused = the empty tail of its last block",
    ]
    body = [[label_of(r.id), str(r.tokens), str(r.blocks), str(r.slots), str(r.unused), _pct(r.unused, r.slots)]
            for r in m.requests]
    tot_tokens = sum(r.tokens for r in m.requests)
    tot_slots = sum(r.slots for r in m.requests)
    body.append(["sum", str(tot_tokens), str(sum(r.blocks for r in m.requests)), str(tot_slots),
                 str(tot_slots - tot_tokens), _pct(tot_slots - tot_tokens, tot_slots)])
    out.append(grid(["seq", "tokens", "blocks", "slots", "unused", "unused %"], body, right={1, 2, 3, 4, 5}))
    out += [
        "",
        "What a static (max-length) allocation would have reserved instead:",
        f"  batch × (max prompt + max output) = {m.num_requests} × ({m.max_prompt} + {m.max_output}) = "
        f"{m.static_padded_slots} slots{_size(m.static_padded_slots, bps)}, "
        + (f"{m.static_padded_slots / m.peak_slots:.1f}× the paged peak" if m.peak_slots else "-"),
    ]
    if m.static_max_len_slots:
        out.append(
            f"  max_num_seqs × max_model_len = {m.max_num_seqs} × {m.max_model_len} = {m.static_max_len_slots} slots"
            f"{_size(m.static_max_len_slots, bps)}, "
            + (f"{m.static_max_len_slots / m.peak_slots:.1f}× the paged peak" if m.peak_slots else "-")
        )
    slack = m.request_slot_steps - m.token_slot_steps
    out += [
        f"Over the whole run (slots × steps): requests held {m.request_slot_steps} slots for {m.token_slot_steps} "
        f"tokens ({_pct(slack, m.request_slot_steps)} slack in last blocks); the pool had {m.pool_slot_steps} in use"
        + (" (a prefix block shared by several requests counts once)" if m.pool_slot_steps < m.request_slot_steps else "")
        + f"; a static padded allocation would hold {m.static_slot_steps}.",
        f"Not zero waste: paging removes the reservation for lengths a request never reaches, but each running "
        f"request's last block is partly empty (at most {bs - 1} slots each) — {m.peak_unused} slots at the peak.",
    ]
    out += [f"Note: {n}" for n in m.notes]
    return "\n".join(out)
