"""GGUF blocks re-laid for octavo's own `octavo.BlockMatMul` (plugins/onnxruntime/block_matmul_kernel.h).

W = code * scale + offset. For every GGML type gguf_blocks maps, a block's zero point or its min is 0, so
offset = min - zero * scale is exact and W is the file's float32 value, bit for bit (tests/test_block_matmul.py).
The kernel's two paths (16-bit activations for decode steps, float32 for a prompt's steps past 8 rows) and their precision are
described in plugins/onnxruntime/block_matmul_kernel.h.

| array   | shape                 | what                                                                     |
|---------|-----------------------|--------------------------------------------------------------------------|
| codes   | [N/16, K/2, 32*b/8]   | per panel of 16 columns and pair of k: e = 2c + dk for columns c < 8,    |
|         |                       | 16 + 2(c - 8) + dk for c >= 8; 4-bit: byte i = code i | code i+16 << 4, |
|         |                       | the 16 bytes of pairs 2j and 2j+1 interleaved (byte 2i + pair % 2)       |
| scales  | [N/16, nb, 16]        | per column and block; float16 when every scale and offset is one exactly |
| offsets | [N/16, nb, 16]        | min - zero * scale                                                       |

N is padded to a multiple of 16 with zero columns (never written to the output).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from octavo.export.gguf_blocks import Blocks

PANEL = 16  # output columns per panel (kPanel in the kernel)


@dataclass(slots=True)
class PanelWeights:
    codes: np.ndarray  # uint8 [P, K / 2, 32 * bits / 8]
    scales: np.ndarray  # float32 or float16 [P, nb, PANEL]
    offsets: np.ndarray  # same dtype [P, nb, PANEL]
    bits: int
    block_size: int
    k: int
    n: int

    def dequantize(self) -> np.ndarray:
        """float32 [N, K] as the kernel computes it (code * scale + offset, one rounding via float64)."""
        p, k = self.codes.shape[0], self.k
        if self.bits == 8:
            pairs = self.codes
        else:
            bytes_ = self.codes.reshape(p, k // 4, PANEL, 2).transpose(0, 1, 3, 2).reshape(p, k // 2, PANEL)
            pairs = np.concatenate([bytes_ & 0x0F, bytes_ >> 4], axis=2)
        codes = pairs.reshape(p, k // 2, PANEL, 2).transpose(0, 1, 3, 2).reshape(p, k, PANEL)
        block = np.arange(k) // self.block_size
        scales = self.scales.astype(np.float64)[:, block, :]  # [P, K, 16]
        offsets = self.offsets.astype(np.float64)[:, block, :]
        w = (codes.astype(np.float64) * scales + offsets).astype(np.float32)
        return np.ascontiguousarray(w.transpose(0, 2, 1).reshape(p * PANEL, k)[: self.n])


def _panels(a: np.ndarray, n_pad: int) -> np.ndarray:
    """[N, X] -> [N_pad/16, X, 16] (padded with zero rows)."""
    n, x = a.shape
    if n_pad != n:
        a = np.concatenate([a, np.zeros((n_pad - n, x), a.dtype)])
    return np.ascontiguousarray(a.reshape(n_pad // PANEL, PANEL, x).transpose(0, 2, 1))


def _exact_half(*arrays: np.ndarray) -> bool:
    for a in arrays:
        with np.errstate(over="ignore"):
            h = a.astype(np.float16)
        if not np.all(np.isfinite(h)) or not np.array_equal(h.astype(np.float32), a):
            return False
    return True


def panel_weights(blocks: Blocks) -> PanelWeights:
    """BLOCKS in BlockMatMul's layout (float16 scales and offsets where that loses nothing)."""
    n, nb, bs = blocks.codes.shape
    k = nb * bs
    scales = blocks.scales.astype(np.float32)
    offsets = -blocks.zero.astype(np.float32) * scales
    if blocks.mins is not None:
        offsets = offsets + blocks.mins.astype(np.float32)
    if bs % 4:
        raise ValueError(f"BlockMatMul needs a block size that is a multiple of 4, got {bs}")
    n_pad = -(-n // PANEL) * PANEL
    per_k = _panels(blocks.codes.reshape(n, k), n_pad)  # [P, K, 16]
    p = n_pad // PANEL
    codes = per_k.reshape(p, k // 2, 2, PANEL).transpose(0, 1, 3, 2).reshape(p, k // 2, 2 * PANEL)
    if blocks.bits == 4:  # byte i of a pair: codes i and i + 16; the two pairs of four k interleave their bytes
        codes = codes[:, :, :PANEL] | (codes[:, :, PANEL:] << 4)
        codes = codes.reshape(p, k // 4, 2, PANEL).transpose(0, 1, 3, 2).reshape(p, k // 2, PANEL)
    dtype = np.float16 if _exact_half(scales, offsets) else np.float32
    return PanelWeights(np.ascontiguousarray(codes, np.uint8), _panels(scales, n_pad).astype(dtype),
                        _panels(offsets, n_pad).astype(dtype), blocks.bits, bs, k, n)
