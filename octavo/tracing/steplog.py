"""The per-step log, one compact line per engine step (what the seed's trace printed, condensed)."""
from __future__ import annotations

from typing import Any

HEADER = (
    "step batch tokens  free/total wait | per request  id:prompt_len/total_len/blocks"
    "  (* prefill this step, (cN) N prompt tokens from the prefix cache, ✓ finished this step, ✗ preempted)"
)


def format_step(row: dict[str, Any]) -> str:
    finished = {f["id"] for f in row["finished"]}
    cells = []
    for req in row["requests"]:
        mark = ("*" if req["phase"] == "prefill" else "") + ("✓" if req["id"] in finished else "")
        if req["phase"] == "prefill" and req["cached"]:
            mark += f"(c{req['cached']})"
        cells.append(f"{req['id']}:{req['prompt_len']}/{req['total_len']}/{req['blocks']}{mark}")
    cells += [f"{rid}✗" for rid in row["preempted"]]
    head = (
        f"{row['step']:>4} {row['batch_size']:>5} {row['num_tokens']:>6} "
        f"{row['free_blocks']:>5}/{row['total_blocks']:<5} {row['num_waiting']:>4}"
    )
    return f"{head} | {' '.join(cells)}"


def format_step_log(rows: list[dict[str, Any]]) -> str:
    return "\n".join([HEADER, *map(format_step, rows)])
