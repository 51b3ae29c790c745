"""Trace files: one JSON object per engine step (the trace row of docs/demo.md, "Trace files"), one per line.

The engine writes them (EngineArgs.trace_path) and passes the same dicts to step listeners; this module
reads them back and checks each row's shape, so every renderer can trust the fields it uses.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from octavo.errors import TraceFormatError

# field -> accepted types, for the step row and for each entry of its "requests" list
ROW_FIELDS: dict[str, tuple[type, ...]] = {
    "step": (int,),
    "batch_size": (int,),
    "num_tokens": (int,),
    "free_blocks": (int,),
    "total_blocks": (int,),
    "block_size": (int,),
    "requests": (list,),
}
OPTIONAL_ROW_FIELDS: dict[str, Any] = {
    "time": 0.0,
    "duration_s": 0.0,
    "num_waiting": 0,
    "arrived": [],
    "finished": [],
    "preempted": [],
    "held": [],  # ids waiting for a prefix block another request is computing (engines that report it)
}
REQUEST_FIELDS: dict[str, tuple[type, ...]] = {
    "id": (str,),
    "phase": (str,),
    "tokens": (int,),
    "prompt_len": (int,),
    "total_len": (int,),
    "blocks": (int,),
}
# draft_tokens / accepted_tokens: speculative decoding's drafts verified in the step, and how many were accepted
OPTIONAL_REQUEST_FIELDS: dict[str, Any] = {"output_len": 0, "cached": 0, "draft_tokens": 0, "accepted_tokens": 0}
PHASES = ("prefill", "decode")


def _check_fields(obj: dict[str, Any], fields: dict[str, Any], where: str) -> None:
    """Every one of FIELDS ({name: accepted types}) is in OBJ with one of its types (a bool is no number)."""
    for name, types in fields.items():
        if name not in obj:
            raise TraceFormatError(f"{where}: field {name!r} is missing")
        if not isinstance(obj[name], types) or isinstance(obj[name], bool):
            raise TraceFormatError(f"{where}: field {name!r} has the wrong type ({obj[name]!r})")


def check_row(row: Any, where: str = "trace row") -> dict[str, Any]:
    """Validate one trace row and return it with the optional fields filled in (a new dict)."""
    if not isinstance(row, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(row).__name__}")
    _check_fields(row, ROW_FIELDS, where)
    out = {**{k: (list(v) if isinstance(v, list) else v) for k, v in OPTIONAL_ROW_FIELDS.items()}, **row}
    requests = []
    for i, req in enumerate(row["requests"]):
        rwhere = f"{where}, requests[{i}]"
        if not isinstance(req, dict):
            raise TraceFormatError(f"{rwhere}: expected a JSON object")
        _check_fields(req, REQUEST_FIELDS, rwhere)
        if req["phase"] not in PHASES:
            raise TraceFormatError(f"{rwhere}: phase must be one of {PHASES}, got {req['phase']!r}")
        requests.append({**OPTIONAL_REQUEST_FIELDS, **req})
    out["requests"] = requests
    out["finished"] = [_finished_entry(f, where) for f in out["finished"]]
    return out


def _finished_entry(entry: Any, where: str) -> dict[str, str]:
    if isinstance(entry, str):  # tolerate a bare id
        return {"id": entry, "reason": "?"}
    if isinstance(entry, dict) and isinstance(entry.get("id"), str):
        return {"id": entry["id"], "reason": str(entry.get("reason", "?"))}
    raise TraceFormatError(f"{where}: 'finished' entries must be {{'id', 'reason'}} objects, got {entry!r}")


def check_rows(rows: Iterable[Any]) -> list[dict[str, Any]]:
    """Validate a sequence of rows (e.g. collected by a step listener); steps must increase."""
    out: list[dict[str, Any]] = []
    for i, row in enumerate(rows):
        checked = check_row(row, f"trace row {i + 1}")
        if out and checked["step"] <= out[-1]["step"]:
            raise TraceFormatError(
                f"trace row {i + 1}: step {checked['step']} does not follow step {out[-1]['step']} "
                "(one trace file per engine run; write each run to its own file)"
            )
        out.append(checked)
    return out


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """Read a trace file (JSON lines; blank lines ignored) and return its validated rows."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TraceFormatError(
            f"trace file {path} does not exist (write one with `octavo demo --trace {path}` or "
            "`--trace` on generate/serve/bench)"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"cannot read trace file {path}: {exc}") from exc
    raw: list[Any] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{path}:{lineno}: not a JSON line ({exc.msg})") from exc
    if not raw:
        raise TraceFormatError(f"trace file {path} has no rows (did the engine run any step?)")
    try:
        return check_rows(raw)
    except TraceFormatError as exc:
        raise TraceFormatError(f"{path}: {exc}") from exc


def write_trace(rows: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """Write rows as a trace file (same format the engine writes)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
    return path
