"""What a built TensorRT engine folder holds, shared by the builder (which writes it) and the backend (which reads it).

- `tensorrt.json` (`BuildInfo`): the engine file, its dtype and the limits it was built for;
- the names of the pool outputs TensorRT aliases to the pool inputs (`pool_output_name`): the ONNX rewrite makes
  them graph outputs, the backend binds each to its input's address.

Run-time side of the GPU room: imports neither the builder nor onnx.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from octavo.errors import ModelFormatError

BUILD_INFO_NAME = "tensorrt.json"
POOL_OUTPUT_SUFFIX = ".out"  # graph output aliased to pool input NAME is NAME + ".out"


def pool_output_name(pool_input: str) -> str:
    """The graph output TensorRT aliases to the pool input POOL_INPUT (bind both to one address)."""
    return pool_input + POOL_OUTPUT_SUFFIX


@dataclass(slots=True)
class BuildInfo:
    """tensorrt.json: what was built and the limits the runtime must respect."""

    engine_file: str
    dtype: str
    block_size: int
    max_num_tokens: int
    max_num_seqs: int
    max_blocks_per_seq: int
    max_num_logits: int
    max_num_blocks: int
    compute_capability: int
    tensorrt_version: str
    build_seconds: float

    def save(self, folder: Path) -> Path:
        path = folder / BUILD_INFO_NAME
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, folder: str | Path) -> "BuildInfo":
        path = Path(folder) / BUILD_INFO_NAME
        if not path.is_file():
            raise ModelFormatError(f"{folder} has no TensorRT engine ({BUILD_INFO_NAME} missing); "
                                   f"build one with `octavo build {folder} --target tensorrt`")
        try:
            return cls(**json.loads(path.read_text()))
        except (ValueError, TypeError) as exc:
            raise ModelFormatError(f"{path} is not a valid build description: {exc}") from exc
