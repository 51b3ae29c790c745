"""Blockwise weight quantization (int8 / int4) for ONNX Runtime's `com.microsoft.MatMulNBits`.

A linear weight W [N, K] (HF's [out, in] layout) is cut along K into blocks of `block_size` values.
Each block gets its own float32 scale and uint8 zero point (asymmetric, the block's range widened to
include 0 so that 0 stays exact), and every value becomes an unsigned code

    code = clip(round(w / scale) + zero_point, 0, 2**bits - 1),    w ~ (code - zero_point) * scale.

MatMulNBits' layout (checked numerically against `dequantize` in tests/test_quantized.py):
B uint8 [N, n_blocks, block_size * bits / 8], codes packed along K, low bits first (for 4 bits the
first value of a pair is the low nibble); scales [N, n_blocks]; zero points uint8, packed the same way
along the blocks, [N, ceil(n_blocks * bits / 8)]. K need not be a multiple of the block size: the last
block is padded with zeros, which the kernel never reads against A.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from octavo.errors import InvalidRequestError
from octavo.export.quant_options import BLOCK_KERNELS, DEFAULT_QUANT_KERNEL, QUANT_KERNELS, RESIDUAL_ROWS, check_quant_block_size

MS_DOMAIN = "com.microsoft"
# "gguf": a GGUF file's own quantized blocks, re-laid exactly (octavo.export.gguf_blocks); no bits of its own
WEIGHT_FORMATS: dict[str, int | None] = {"fp32": None, "int8": 8, "int4": 4, "gguf": None}
GGUF_NATIVE = "gguf"
ACCURACY_LEVELS = (0, 1, 2, 3, 4)  # 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 compute (MatMulNBits)
# range shrink factors tried per block (least squared error wins): clipping helps 4 bits (weight
# RMSE -13% on SmolLM2's layers), not 8 bits (<1%, so only the full range is tried there)
CLIP_RATIOS: dict[int, tuple[float, ...]] = {4: (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7), 8: (1.0,)}
# QUANT_KERNELS (how quantized weights are multiplied) and RESIDUAL_ROWS live in octavo.export.quant_options
_ROWS_PER_CHUNK = 4096  # rows quantized at once: bounds the float temporaries of a large matrix


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """How an export stores the linear layers' weights. weights="fp32" means no quantization."""

    weights: str = "fp32"  # "fp32" | "int8" | "int4"
    block_size: int = 32  # values of K per scale / zero point: a power of two >= 16
    accuracy_level: int = 4  # MatMulNBits' accuracy_level: 4 lets the CPU kernel compute in int8
    lm_head: bool = False  # quantize the vocabulary projection too (the embedding Gather stays float)
    # "gguf" with accuracy_level 4: undo the kernel's int8 rounding of the activations (octavo.Int8Residual)
    # in steps of at most this many rows; larger steps (long prefill chunks) keep the plain int8 path. 0 = off
    residual_rows: int = RESIDUAL_ROWS
    kernel: str = DEFAULT_QUANT_KERNEL  # one of QUANT_KERNELS

    @property
    def bits(self) -> int | None:
        return WEIGHT_FORMATS.get(self.weights)

    @property
    def enabled(self) -> bool:
        """Any MatMulNBits in the graph (int8, int4 or the GGUF's own blocks)."""
        return self.weights in WEIGHT_FORMATS and self.weights != "fp32"

    @property
    def residual(self) -> bool:
        """Activations corrected for int8 rounding (the GGUF path at accuracy_level 4)."""
        return self.native and self.kernel == "matmulnbits" and self.accuracy_level == 4 and self.residual_rows > 0

    @property
    def block_kernel(self) -> bool:
        """Quantized weights multiplied by octavo.BlockMatMul (no MatMulNBits)."""
        return self.enabled and self.kernel in BLOCK_KERNELS

    @property
    def prompt_bf16(self) -> bool:
        """The block-bf16 kernel: a prompt's BlockMatMul and PagedAttention steps in bfloat16 where AMX runs."""
        return self.block_kernel and self.kernel == "block-bf16"

    @property
    def native(self) -> bool:
        """The GGUF's own blocks (block size and lm_head follow the file, not this config)."""
        return self.weights == GGUF_NATIVE

    def validate(self) -> "QuantConfig":
        if self.weights not in WEIGHT_FORMATS:
            raise InvalidRequestError(f"weights must be one of {sorted(WEIGHT_FORMATS)}, got {self.weights!r}")
        check_quant_block_size(self.block_size)
        if self.residual_rows < 0:
            raise InvalidRequestError(f"residual rows must be >= 0 (0 = off), got {self.residual_rows}")
        if self.kernel not in QUANT_KERNELS:
            raise InvalidRequestError(f"quantized-weight kernel must be one of {QUANT_KERNELS}, got {self.kernel!r}")
        if self.accuracy_level not in ACCURACY_LEVELS:
            raise InvalidRequestError(f"accuracy_level must be one of {ACCURACY_LEVELS}, got {self.accuracy_level}")
        return self

    def describe(self, fallback_layers: Sequence[str] = ()) -> dict[str, object] | None:
        """The manifest's `quantization` entry (None for fp32). FALLBACK_LAYERS: with the block kernel, the
        projections that are MatMulNBits nonetheless (int8/int4 with K not a multiple of the block size:
        BlockMatMul has no partial last block); the entry then says so with `fallback_method`,
        `fallback_accuracy_level` and `fallback_layers`, beside the keys older readers know."""
        if not self.enabled:
            return None
        if fallback_layers and not self.block_kernel:
            raise ValueError("only the block kernel falls back to MatMulNBits")
        fallback: dict[str, object] = {"fallback_method": "MatMulNBits", "fallback_accuracy_level": self.accuracy_level,
                                       "fallback_layers": list(fallback_layers)} if fallback_layers else {}
        arithmetic: dict[str, object] = {"prompt_arithmetic": "bfloat16"} if self.prompt_bf16 else {}
        if self.block_kernel and self.native:
            return {"method": "BlockMatMul", "source": "gguf", "lm_head": self.lm_head, **fallback, **arithmetic}
        if self.block_kernel:
            return {"method": "BlockMatMul", "bits": self.bits, "block_size": self.block_size, "symmetric": False,
                    "lm_head": self.lm_head, **fallback, **arithmetic}
        if self.native:
            return {"method": "MatMulNBits", "source": "gguf", "accuracy_level": self.accuracy_level,
                    "lm_head": self.lm_head, "activation_residual_rows": self.residual_rows if self.residual else 0}
        return {"method": "MatMulNBits", "bits": self.bits, "block_size": self.block_size,
                "accuracy_level": self.accuracy_level, "symmetric": False, "lm_head": self.lm_head}

    def cache_tag(self) -> str:
        """Part of a cache folder's name: '' for fp32, e.g. 'int4-b32-a4' (+ '-head') otherwise."""
        if not self.enabled:
            return ""
        bf16 = "-bf16" if self.prompt_bf16 else ""
        if self.block_kernel and self.native:
            return "gguf-block" + bf16
        if self.block_kernel:
            return f"{self.weights}-b{self.block_size}-block" + ("-head" if self.lm_head else "") + bf16
        if self.native:
            return f"gguf-a{self.accuracy_level}" + (f"-r{self.residual_rows}" if self.residual else "")
        return f"{self.weights}-b{self.block_size}-a{self.accuracy_level}" + ("-head" if self.lm_head else "")


@dataclass(slots=True)
class BlockQuantized:
    """One weight matrix in MatMulNBits' layout (see the module docstring)."""

    packed: np.ndarray  # uint8 [N, n_blocks, block_size * bits / 8]
    scales: np.ndarray  # float32 [N, n_blocks]
    zero_points: np.ndarray  # uint8 [N, ceil(n_blocks * bits / 8)]
    bits: int
    block_size: int
    k: int  # the true K (the last block may be padding)

    @property
    def n(self) -> int:
        return int(self.packed.shape[0])

    @property
    def n_blocks(self) -> int:
        return int(self.packed.shape[1])

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes + self.zero_points.nbytes


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack uint8 codes < 2**bits along the last axis, low bits first: [..., n] -> [..., n * bits / 8]."""
    if bits == 8:
        return codes.astype(np.uint8, copy=False)
    if bits != 4:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.zeros((*codes.shape[:-1], 1), codes.dtype)], axis=-1)
    low, high = codes[..., 0::2].astype(np.uint8), codes[..., 1::2].astype(np.uint8)
    return low | (high << 4)


def unpack_codes(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of pack_codes: the first COUNT codes along the last axis."""
    if bits == 8:
        return packed[..., :count]
    codes = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.uint8)
    codes[..., 0::2], codes[..., 1::2] = packed & 0x0F, packed >> 4
    return codes[..., :count]


def _quantize_rows(w: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes uint8 [n, nb, bs], scales float32 [n, nb], zero points uint8 [n, nb]) of rows W [n, K].

    Each block's range [min(lo, 0), max(hi, 0)] is tried shrunk by every factor of CLIP_RATIOS[bits]
    (clipping a few outliers buys a finer grid for the rest); the factor with the least squared
    error wins, per block."""
    n, k = w.shape
    n_blocks = -(-k // block_size)
    padded = np.zeros((n, n_blocks * block_size), np.float32)
    padded[:, :k] = w
    blocks = padded.reshape(n, n_blocks, block_size)
    qmax = np.float32((1 << bits) - 1)
    lo = np.minimum(blocks.min(axis=2), 0.0)
    hi = np.maximum(blocks.max(axis=2), 0.0)
    best_err = np.full((n, n_blocks), np.inf, np.float32)
    best_codes = np.zeros(blocks.shape, np.uint8)
    best_scales = np.zeros((n, n_blocks), np.float32)
    best_zero = np.zeros((n, n_blocks), np.float32)
    for ratio in CLIP_RATIOS[bits]:
        scales = ((hi - lo) * np.float32(ratio) / qmax).astype(np.float32)
        safe = np.where(scales > 0, scales, np.float32(1.0))
        zero = np.clip(np.rint(-lo * np.float32(ratio) / safe), 0, qmax)
        codes = np.clip(np.rint(blocks / safe[..., None]) + zero[..., None], 0, qmax)
        err = np.square(blocks - (codes - zero[..., None]) * scales[..., None]).sum(axis=2)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_codes[better] = codes[better]
        best_scales = np.where(better, scales, best_scales)
        best_zero = np.where(better, zero, best_zero)
    return best_codes, best_scales, best_zero.astype(np.uint8)


def quantize(weight: np.ndarray, bits: int, block_size: int) -> BlockQuantized:
    """Asymmetric blockwise quantization of W [N, K] along K (see the module docstring)."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    w = np.asarray(weight, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight [N, K], got shape {w.shape}")
    n, k = w.shape
    n_blocks = -(-k // block_size)
    packed = np.empty((n, n_blocks, block_size * bits // 8), np.uint8)
    scales = np.empty((n, n_blocks), np.float32)
    zero_points = np.empty((n, -(-n_blocks * bits // 8)), np.uint8)
    for start in range(0, n, _ROWS_PER_CHUNK):
        rows = slice(start, min(n, start + _ROWS_PER_CHUNK))
        codes, scales[rows], zero = _quantize_rows(w[rows], bits, block_size)
        packed[rows] = pack_codes(codes, bits)
        zero_points[rows] = pack_codes(zero, bits)
    return BlockQuantized(packed, scales, zero_points, bits, block_size, k)


def unpacked(q: BlockQuantized) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [N, nb, bs], zero points uint8 [N, nb]) of Q, unpacked."""
    return unpack_codes(q.packed, q.bits, q.block_size), unpack_codes(q.zero_points, q.bits, q.n_blocks)


def dequantize(q: BlockQuantized) -> np.ndarray:
    """The float32 [N, K] weight that MatMulNBits multiplies by (the numpy reference)."""
    codes, zero = unpacked(q)  # [N, nb, bs], [N, nb]
    w = (codes.astype(np.float32) - zero[..., None].astype(np.float32)) * q.scales[..., None]
    return w.reshape(q.n, -1)[:, : q.k]


def concat(parts: list[BlockQuantized]) -> BlockQuantized:
    """Stack quantized matrices along N (fused q/k/v or gate/up): blocks run along K, so rows are independent."""
    first = parts[0]
    if any((p.bits, p.block_size, p.k) != (first.bits, first.block_size, first.k) for p in parts):
        raise ValueError("parts must share bits, block size and K")
    if len(parts) == 1:
        return first
    return BlockQuantized(
        np.concatenate([p.packed for p in parts]), np.concatenate([p.scales for p in parts]),
        np.concatenate([p.zero_points for p in parts]), first.bits, first.block_size, first.k,
    )
