"""The contract between the engine and a backend: one call per step over packed, unpadded arrays."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(slots=True)
class StepInputs:
    """Graph inputs of one step (see DESIGN.md, "The ONNX contract"). T tokens, B sequences."""

    input_ids: np.ndarray  # int64 [T]
    position_ids: np.ndarray  # int64 [T]
    cumulative_sequence_length: np.ndarray  # int32 [B+1]
    past_seqlens: np.ndarray  # int32 [B]
    block_table: np.ndarray  # int32 [B, max_blocks]
    slot_mapping: np.ndarray  # int64 [T]
    logits_indices: np.ndarray  # int64 [N]
    hidden_indices: np.ndarray | None = None  # int64 [H]: rows whose hidden states an embedding export returns
    lora_slots: np.ndarray | None = None  # int64 [T]: each token's LoRA slot (0 = base); None: all base


class Backend(Protocol):
    """Runs the exported model. Owns the KV pools (num_blocks x block_size slots per layer)."""

    num_blocks: int
    block_size: int
    vocab_size: int

    def run(self, inputs: StepInputs) -> np.ndarray:
        """Run one step; write new K/V into the pools in place; return float32 logits [N, vocab]."""
        ...

    def close(self) -> None:
        """Release the session and the pools."""
        ...
