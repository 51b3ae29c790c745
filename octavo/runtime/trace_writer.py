"""The engine's JSONL trace: one line per step (EngineArgs.trace_path), written by a step listener."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from octavo.runtime.step_record import StepRecord


class JsonlTraceWriter:
    def __init__(self, path: str | Path) -> None:
        self._file = open(path, "w")  # noqa: SIM115 - open for the engine's lifetime, closed by close()

    def __call__(self, record: StepRecord) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record.trace_row()) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
