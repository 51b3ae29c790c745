"""What a built TensorRT engine folder holds, shared by the builder (which writes it) and the backend (which reads it).

- `tensorrt.json` (`BuildInfo`): the engine file, its dtype and the limits it was built for;
- the names of the pool outputs TensorRT aliases to the pool inputs (`pool_output_name`): the ONNX rewrite makes
  them graph outputs, the backend binds each to its input's address;
- the sizing rules both sides apply: how many KV blocks fit in GPU memory (`pool_blocks_for_memory`), whether the
  engine's own device memory shows TensorRT copying around the in-place plugin (`kv_copy_suspected`), and whether
  the engine's build limits admit the serving options (`check_serving_limits`).

Run-time side of the GPU room: imports neither the builder nor onnx.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from octavo.errors import InvalidRequestError, ModelFormatError

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
    device_memory_bytes: int = 0  # the engine's own device memory (activations) at the profile maxima, 0 = unknown
    kv_pool_bytes_per_layer: int = 0  # one layer's key + value pools at max_num_blocks

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


def pool_blocks_for_memory(free_bytes: int, fraction: float, bytes_per_block: int, max_blocks: int) -> int:
    """How many KV blocks fit in FRACTION of FREE_BYTES (capped by what the engine's profile accepts)."""
    if not 0.0 < fraction <= 1.0:
        raise InvalidRequestError(f"memory fraction must be in (0, 1], got {fraction}")
    return max(0, min(max_blocks, int(free_bytes * fraction) // bytes_per_block))


# Below this, one layer's pools are too small to tell TensorRT's copies from ordinary activation memory.
COPY_CHECK_MIN_BYTES = 256 << 20


def kv_copy_suspected(device_memory_bytes: int, kv_pool_bytes_per_layer: int) -> bool | None:
    """Does the engine reserve device memory of a layer's K/V pools' size? Activations of a step are far smaller
    than a real pool, so an engine that needs that much copies the pools around the aliased plugin (or holds
    them in buffers of its own): every step would move the whole pool. None = the pools are too small to tell."""
    if kv_pool_bytes_per_layer < COPY_CHECK_MIN_BYTES:
        return None
    return device_memory_bytes >= kv_pool_bytes_per_layer


def check_serving_limits(info: BuildInfo, folder: str | Path, *, max_num_seqs: int, max_num_batched_tokens: int,
                         max_model_len: int) -> None:
    """Refuse at start-up serving options the engine's optimization profile cannot run (otherwise every step
    past the limit fails). InvalidRequestError naming each option, its limit, and the rebuild that lifts it."""
    problems = []
    if max_num_seqs > info.max_num_seqs:
        problems.append(f"--max-num-seqs {max_num_seqs} > the engine's {info.max_num_seqs} (rebuild with "
                        f"--max-num-seqs {max_num_seqs})")
    if max_num_seqs > info.max_num_logits:
        problems.append(f"--max-num-seqs {max_num_seqs} > the engine's {info.max_num_logits} logits rows per step")
    if max_num_batched_tokens > info.max_num_tokens:
        problems.append(f"--max-num-batched-tokens {max_num_batched_tokens} > the engine's {info.max_num_tokens} "
                        f"(rebuild with --max-num-tokens {max_num_batched_tokens})")
    context = info.max_blocks_per_seq * info.block_size
    if max_model_len > context:
        problems.append(f"--max-model-len {max_model_len} > the engine's {context} tokens ({info.max_blocks_per_seq} "
                        f"blocks of {info.block_size}; rebuild with --max-blocks-per-seq "
                        f"{-(-max_model_len // info.block_size)})")
    if problems:
        raise InvalidRequestError(f"the TensorRT engine in {folder} was built for smaller limits: " + "; ".join(problems)
                                  + f" — or lower the options (`octavo build {folder} --target tensorrt` rebuilds)")
