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
| scale_super, offset_super | [N/16, K/256, 16] | K-quants only (two-level scales): float32 per column and super-block of |
|         |                       | 256 values of K; scales and offsets are then int8 factors of them         |

N is padded to a multiple of 16 with zero columns (never written to the output).

K-quants (Q4_K, Q5_K, Q6_K, and fused projections of them) keep the file's two levels: the kernel forms each
block's scale as int8 factor times float32 super-block scale, the product the file's float32 scale is exactly
(panel_weights checks it, else stores float32 scales). Per value that is 0.56 bits of scales at
32-blocks (1.06 at Q6_K's 16) instead of 2 (4): the bytes a decode step streams shrink by a fifth on a Q4_K_M file.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from octavo.export.gguf_blocks import Blocks

PANEL = 16  # output columns per panel (kPanel in the kernel)
SUPER_BLOCK = 256  # values of K per super-block of two-level scales (QK_K)


@dataclass(slots=True)
class PanelWeights:
    codes: np.ndarray  # uint8 [P, K / 2, 32 * bits / 8]
    scales: np.ndarray  # float32 or float16 [P, nb, PANEL] (int8 factors of scale_super)
    offsets: np.ndarray  # same dtype [P, nb, PANEL] (int8 factors of offset_super)
    bits: int
    block_size: int
    k: int
    n: int
    scale_super: np.ndarray | None = None  # float32 [P, K / 256, PANEL]: scales and offsets are int8 factors of these
    offset_super: np.ndarray | None = None

    @property
    def float_scales(self) -> tuple[np.ndarray, np.ndarray]:
        """(scales, offsets) as float64 [P, nb, PANEL], the values the kernel multiplies by."""
        if self.scale_super is None:
            return self.scales.astype(np.float64), self.offsets.astype(np.float64)
        per_super = SUPER_BLOCK // self.block_size
        block = np.arange(self.scales.shape[1]) // per_super
        return (self.scales.astype(np.float64) * self.scale_super.astype(np.float64)[:, block, :],
                self.offsets.astype(np.float64) * self.offset_super.astype(np.float64)[:, block, :])

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
        float_scales, float_offsets = self.float_scales
        scales = float_scales[:, block, :]  # [P, K, 16]
        offsets = float_offsets[:, block, :]
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


def _two_level(blocks: Blocks, scales: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, ...] | None:
    """BLOCKS' factors (sub [N, nb] int8, super [N, K/256] float32, for scales then offsets) where their float32
    products are SCALES and OFFSETS exactly; None otherwise (or without factors). A zero's sign may differ (a Q6_K
    part promoted beside Q4_K has offset -32 * 0 + 0 = +0 where 0 * (-32 d) = -0), which no output's value
    depends on."""
    f = blocks.factors
    if f is None or SUPER_BLOCK % blocks.block_size or blocks.k % SUPER_BLOCK:
        return None
    block = np.arange(scales.shape[1]) // (SUPER_BLOCK // blocks.block_size)
    for sub, sup, want in ((f.scale_sub, f.scale_super, scales), (f.offset_sub, f.offset_super, offsets)):
        if not np.array_equal(sub.astype(np.float32) * sup[:, block], want):
            return None
    return f.scale_sub, f.scale_super, f.offset_sub, f.offset_super


def panel_weights(blocks: Blocks) -> PanelWeights:
    """BLOCKS in BlockMatMul's layout (K-quants: two-level scales; other types float16 scales and offsets where
    that loses nothing, else float32)."""
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
    two_level = _two_level(blocks, scales, offsets)
    if two_level is not None:
        ssub, ssup, osub, osup = (_panels(a, n_pad) for a in two_level)
        return PanelWeights(np.ascontiguousarray(codes, np.uint8), ssub.astype(np.int8), osub.astype(np.int8),
                            blocks.bits, bs, k, n, ssup.astype(np.float32), osup.astype(np.float32))
    dtype = np.float16 if _exact_half(scales, offsets) else np.float32
    return PanelWeights(np.ascontiguousarray(codes, np.uint8), _panels(scales, n_pad).astype(dtype),
                        _panels(offsets, n_pad).astype(dtype), blocks.bits, bs, k, n)
