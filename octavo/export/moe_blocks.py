"""Block-quantized experts for octavo.MoE (plugins/onnxruntime/moe_blocks.h): each expert's projection in
octavo.BlockMatMul's panel layout (octavo.export.block_layout), the experts stacked along a new first axis:
codes [E, panels, K / 2, 32 * bits / 8], scales and offsets [E, panels, K / block_size, 16]. Every expert of one
projection comes from one 3-D GGUF tensor, so they share the type, the bits and the block size; scales are float16
only where every expert's are exactly (else float32 for all, which loses nothing)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from octavo.export.block_layout import PanelWeights, panel_weights
from octavo.export.gguf_blocks import Blocks, promote


@dataclass(slots=True)
class StackedPanels:
    codes: np.ndarray  # uint8 [E, panels, K / 2, 32 * bits / 8]
    scales: np.ndarray  # float16 or float32 [E, panels, nb, 16], or int8 factors of scale_super
    offsets: np.ndarray  # same dtype and shape
    bits: int
    block_size: int
    types: tuple[str, ...]  # the GGML types they came from
    scale_super: np.ndarray | None = None  # float32 [E, panels, K / 256, 16] (two-level scales), or None
    offset_super: np.ndarray | None = None


def _float_scales(p: PanelWeights) -> tuple[np.ndarray, np.ndarray]:
    """P's scales and offsets as stored, or (two-level) their float32 products."""
    if p.scale_super is None:
        return p.scales, p.offsets
    scales, offsets = p.float_scales
    return scales.astype(np.float32), offsets.astype(np.float32)


def stack_experts(experts: list[list[Blocks]]) -> StackedPanels:
    """EXPERTS[e] = the parts of expert e's projection stacked along N (gate and up, or down alone), as Blocks."""
    panels = [panel_weights(promote(parts)) for parts in experts]
    first = panels[0]
    if any((p.bits, p.block_size, p.k, p.n) != (first.bits, first.block_size, first.k, first.n) for p in panels):
        raise ValueError("the experts of one projection must share their quantization layout")
    types = tuple(sorted({t for parts in experts for b in parts for t in b.types}))
    if all(p.scale_super is not None for p in panels):
        return StackedPanels(np.stack([p.codes for p in panels]), np.stack([p.scales for p in panels]),
                             np.stack([p.offsets for p in panels]), first.bits, first.block_size, types,
                             np.stack([p.scale_super for p in panels]), np.stack([p.offset_super for p in panels]))
    dtype = np.float16 if all(p.scales.dtype == np.float16 for p in panels) else np.float32
    return StackedPanels(np.stack([p.codes for p in panels]), np.stack([_float_scales(p)[0].astype(dtype) for p in panels]),
                         np.stack([_float_scales(p)[1].astype(dtype) for p in panels]), first.bits, first.block_size, types)
