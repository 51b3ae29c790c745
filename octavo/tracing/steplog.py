"""The per-step log, one compact line per engine step (what the seed's trace printed, condensed)."""
from __future__ import annotations

from typing import Any

from octavo.tracing.names import short_ids

HEADER = (
    "step batch tokens  free/total wait | per request  id:prompt_len/total_len/blocks"
    "  (* prefill this step, (cN) N prompt tokens from the prefix cache, ✓ finished this step, ✗ preempted)"
)


def format_step(row: dict[str, Any], names: dict[str, str] | None = None) -> str:
    """One row as a log line; NAMES: display names for long request ids (names.short_ids)."""
    names = names or {}
    finished = {f["id"] for f in row["finished"]}
    cells = []
    for req in row["requests"]:
        mark = ("*" if req["phase"] == "prefill" else "") + ("✓" if req["id"] in finished else "")
        if req["phase"] == "prefill" and req["cached"]:
            mark += f"(c{req['cached']})"
        cells.append(f"{names.get(req['id'], req['id'])}:{req['prompt_len']}/{req['total_len']}/{req['blocks']}{mark}")
    cells += [f"{names.get(rid, rid)}✗" for rid in row["preempted"]]
    head = (
        f"{row['step']:>4} {row['batch_size']:>5} {row['num_tokens']:>6} "
        f"{row['free_blocks']:>5}/{row['total_blocks']:<5} {row['num_waiting']:>4}"
    )
    return f"{head} | {' '.join(cells)}"


def format_step_log(rows: list[dict[str, Any]]) -> str:
    names = short_ids([q["id"] for r in rows for q in r["requests"]] + [i for r in rows for i in r["preempted"]])
    return "\n".join([HEADER, *(format_step(r, names) for r in rows)])
