"""A GGUF file's own quantized blocks, re-laid for ONNX Runtime's `com.microsoft.MatMulNBits`, exactly.

Every GGML type this module maps stores, per block of 16 or 32 values along K, unsigned integer codes c
with one float scale s, an integer zero point z and (some types) a float min m, so that

    w = (c - z) * s + m                                     (m = 0 where the type has none)

MatMulNBits computes `(c - z) * s` for 4- or 8-bit codes with uint8 zero points; the min is the
separate term `sum_blocks(m * sum_block(x))` (projection.py adds it as a [T, K/bs] x [K/bs, N] matmul of
the activations' block sums). So the dequantized weight is the GGUF's, value for value: the scales
are the file's fp16 numbers (times the 6-bit sub-scale for K-quants, a product float32 holds exactly),
codes are copied bit for bit. Nothing is rounded again.

| GGML type | block | codes | MatMulNBits bits | zero point | min |
|---|---|---|---|---|---|
| Q4_0 | 32 | 0..15 | 4 | 8 | - |
| Q4_1 | 32 | 0..15 | 4 | 0 | m (fp16) |
| Q5_0 | 32 | 0..31 | 8 | 16 | - |
| Q5_1 | 32 | 0..31 | 8 | 0 | m (fp16) |
| Q8_0 | 32 | q + 128 (q int8) | 8 | 128 | - |
| Q4_K | 32 (8 per 256) | 0..15 | 4 | 0 | -dmin * m6 |
| Q5_K | 32 (8 per 256) | 0..31 | 8 | 0 | -dmin * m6 |
| Q6_K | 16 (16 per 256) | 0..63 | 8 | 32 | - |

5- and 6-bit codes ride in 8-bit MatMulNBits (exact, 1 byte a value instead of 5/8 or 6/8). Q2_K, Q3_K,
IQ4_NL, IQ4_XS and the float types have no entry: `native_blocks` returns None and the caller keeps that
projection in float32 (the values are still the file's). Byte layouts are the ones `gguf.quants`
dequantizes (read from it as facts; this code is ours); tests/test_gguf_native.py checks every type
value for value against `gguf.quants.dequantize`.

K-quants keep their two-level scales as `Factors` too (block_layout stores them so, a quarter of the bytes of
float32 scales): per block an int8 factor, per super-block of 256 values of K a float32, whose product is the
block's float32 scale (or offset) exactly: Q4_K / Q5_K scale = d * sc, offset = -dmin * m; Q6_K scale = d * sc,
offset = -32 * d * sc = sc * (-32 d).

`promote` merges parts of one fused projection (q/k/v, gate/up) that a file stores in different types
(Q4_K_M keeps some v/down projections in Q6_K): the widest codes and the smallest block win, scales,
zero points and mins are repeated per smaller block — still exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from octavo.export.quantize import BlockQuantized, pack_codes

QK_K = 256  # values per K-quant super-block
# GGML type name -> bytes per block (of 32 values, or of 256 for the K types)
_TYPE_SIZE = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
NATIVE_TYPES = tuple(_TYPE_SIZE)


@dataclass(slots=True)
class Factors:
    """A K-quant's scales and offsets as int8 factors of a float32 per super-block (QK_K values of K):
    scales[n, b] == scale_sub[n, b] * scale_super[n, b // (QK_K / block_size)] in float32, exactly, and
    likewise offsets (= mins - zero * scales) with offset_sub and offset_super."""

    scale_sub: np.ndarray  # int8 [N, n_blocks]
    scale_super: np.ndarray  # float32 [N, K / QK_K]
    offset_sub: np.ndarray  # int8 [N, n_blocks]
    offset_super: np.ndarray  # float32 [N, K / QK_K]

    def rows(self, index: slice | np.ndarray) -> "Factors":
        return Factors(self.scale_sub[index], self.scale_super[index], self.offset_sub[index], self.offset_super[index])

    def split_block(self, factor: int) -> "Factors":
        return Factors(np.repeat(self.scale_sub, factor, axis=1), self.scale_super,
                       np.repeat(self.offset_sub, factor, axis=1), self.offset_super)


@dataclass(slots=True)
class Blocks:
    """One weight W [N, K] as w = (codes - zero) * scales + mins, per block of `block_size` along K."""

    codes: np.ndarray  # uint8 [N, n_blocks, block_size], unsigned, < 2**bits
    scales: np.ndarray  # float32 [N, n_blocks]
    zero: np.ndarray  # uint8 [N, n_blocks]
    mins: np.ndarray | None  # float32 [N, n_blocks], or None (all zero)
    bits: int  # 4 or 8: the MatMulNBits width that holds the codes
    types: tuple[str, ...]  # the GGML types it came from (for the manifest)
    factors: Factors | None = None  # the K-quants' two-level scales (None: other types, or a mix with them)

    @property
    def n(self) -> int:
        return int(self.codes.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.codes.shape[2])

    @property
    def k(self) -> int:
        return int(self.codes.shape[1] * self.codes.shape[2])

    def rows(self, index: slice | np.ndarray) -> "Blocks":
        """The rows INDEX (a slice or a permutation): blocks run along K, so rows are independent."""
        mins = None if self.mins is None else self.mins[index]
        factors = None if self.factors is None else self.factors.rows(index)
        return Blocks(self.codes[index], self.scales[index], self.zero[index], mins, self.bits, self.types, factors)

    def split_block(self, block_size: int) -> "Blocks":
        """The same values cut into smaller blocks (scale, zero point and min repeated)."""
        factor = self.block_size // block_size
        if factor == 1:
            return self
        codes = self.codes.reshape(self.n, -1, block_size)
        mins = None if self.mins is None else np.repeat(self.mins, factor, axis=1)
        factors = None if self.factors is None else self.factors.split_block(factor)
        return Blocks(codes, np.repeat(self.scales, factor, axis=1), np.repeat(self.zero, factor, axis=1), mins,
                      self.bits, self.types, factors)

    def dequantize(self) -> np.ndarray:
        """float32 [N, K], computed as the GGUF reference does (the numpy reference for tests)."""
        w = (self.codes.astype(np.float32) - self.zero[..., None].astype(np.float32)) * self.scales[..., None]
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.reshape(self.n, self.k)

    def matmulnbits(self) -> BlockQuantized:
        """Codes, scales and zero points in MatMulNBits' layout (octavo.export.quantize)."""
        return BlockQuantized(pack_codes(self.codes, self.bits), np.ascontiguousarray(self.scales, np.float32),
                              pack_codes(self.zero, self.bits), self.bits, self.block_size, self.k)


def promote(parts: list[Blocks]) -> Blocks:
    """PARTS (same K) stacked along N in one common layout: the widest bits, the smallest block."""
    if len(parts) == 1:
        return parts[0]
    if len({p.k for p in parts}) != 1:
        raise ValueError("parts of a fused projection must share K")
    block = min(p.block_size for p in parts)
    bits = max(p.bits for p in parts)
    split = [p.split_block(block) for p in parts]
    mins = None
    if any(p.mins is not None for p in split):
        mins = np.concatenate([p.mins if p.mins is not None else np.zeros(p.scales.shape, np.float32) for p in split])
    types = tuple(dict.fromkeys(t for p in parts for t in p.types))
    factors = None
    if all(p.factors is not None for p in split):
        f = [p.factors for p in split]
        factors = Factors(*(np.concatenate([getattr(x, name) for x in f]) for name in Factors.__slots__))
    return Blocks(np.concatenate([p.codes for p in split]), np.concatenate([p.scales for p in split]),
                  np.concatenate([p.zero for p in split]), mins, bits, types, factors)


def _f16(raw: np.ndarray) -> np.ndarray:
    """[n, 2] bytes -> float32 [n, 1] (little-endian fp16, as GGUF stores it)."""
    return np.ascontiguousarray(raw).view("<f2").astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] codes: value j in byte j's low nibble, value j+16 in its high nibble."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes (a little-endian uint32, bit j = value j's fifth bit) -> [n, 32] of 0/1."""
    bits = np.ascontiguousarray(qh).view("<u4")  # [n, 1]
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit sub-block scales and 8 six-bit mins, each [n, 8]."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc, mn


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: [n, 128] bytes -> [n, 8, 32]: sub-block 2g in bytes 32g.. low nibbles, 2g+1 high."""
    groups = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (groups & 0x0F).reshape(-1, 8, 32)


# each parser: raw blocks [n, type_size] -> (codes [n, sub, bs], scales [n, sub], zero, mins or None, bits), and
# the K types' factors (scale_sub [n, sub], scale_super [n, 1], offset_sub [n, sub], offset_super [n, 1])
def _q4_0(b: np.ndarray):
    return _nibbles_32(b[:, 2:])[:, None], _f16(b[:, :2]), 8, None, 4, None


def _q4_1(b: np.ndarray):
    return _nibbles_32(b[:, 4:])[:, None], _f16(b[:, :2]), 0, _f16(b[:, 2:4]), 4, None


def _q5_0(b: np.ndarray):
    codes = _nibbles_32(b[:, 6:]) | (_high_bits_32(b[:, 2:6]) << 4)
    return codes[:, None], _f16(b[:, :2]), 16, None, 8, None


def _q5_1(b: np.ndarray):
    codes = _nibbles_32(b[:, 8:]) | (_high_bits_32(b[:, 4:8]) << 4)
    return codes[:, None], _f16(b[:, :2]), 0, _f16(b[:, 2:4]), 8, None


def _q8_0(b: np.ndarray):
    codes = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes[:, None], _f16(b[:, :2]), 128, None, 8, None


def _q4_k(b: np.ndarray):
    sc, mn = _k_scale_min(b[:, 4:16])
    scales = _f16(b[:, :2]) * sc.astype(np.float32)
    mins = -(_f16(b[:, 2:4]) * mn.astype(np.float32))
    return _k_low_nibbles(b[:, 16:]), scales, 0, mins, 4, (sc, _f16(b[:, :2]), mn, -_f16(b[:, 2:4]))


def _q5_k(b: np.ndarray):
    sc, mn = _k_scale_min(b[:, 4:16])
    high = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1  # [n, 8, 32]
    codes = _k_low_nibbles(b[:, 48:]) | (high << 4)
    scales = _f16(b[:, :2]) * sc.astype(np.float32)
    mins = -(_f16(b[:, 2:4]) * mn.astype(np.float32))
    return codes, scales, 0, mins, 8, (sc, _f16(b[:, :2]), mn, -_f16(b[:, 2:4]))


def _q6_k(b: np.ndarray):
    low = (b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 0x03
    codes = (low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << 4)).reshape(-1, 16, 16)
    sc = b[:, 192:208].view(np.int8)
    d = _f16(b[:, 208:210])
    scales = d * sc.astype(np.float32)
    return codes, scales, 32, None, 8, (sc, d, sc, d * np.float32(-32.0))


_PARSERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
            "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def parse_blocks(type_name: str, raw: np.ndarray, n: int, k: int) -> Blocks | None:
    """RAW: a 2-D GGUF tensor's bytes, [N, bytes per row] (numpy order, rows = HF's out). None when
    TYPE_NAME has no exact MatMulNBits layout."""
    parser = _PARSERS.get(type_name)
    if parser is None:
        return None
    size = _TYPE_SIZE[type_name]
    values_per_block = QK_K if type_name.endswith("_K") else 32
    if k % values_per_block or raw.size != n * (k // values_per_block) * size:
        raise ValueError(f"{type_name} tensor of shape [{n}, {k}] has {raw.size} bytes")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, size)
    codes, scales, zero, mins, bits, two_level = parser(blocks)
    sub_blocks = codes.shape[1] * (k // values_per_block)
    bs = codes.shape[2]
    scales = scales.reshape(n, sub_blocks).astype(np.float32)
    factors = None
    if two_level is not None:
        ssub, ssup, osub, osup = two_level
        supers = k // values_per_block
        factors = Factors(ssub.reshape(n, sub_blocks).astype(np.int8), ssup.reshape(n, supers).astype(np.float32),
                          osub.reshape(n, sub_blocks).astype(np.int8), osup.reshape(n, supers).astype(np.float32))
    return Blocks(
        codes=codes.reshape(n, sub_blocks, bs).astype(np.uint8, copy=False),
        scales=scales,
        zero=np.full((n, sub_blocks), zero, np.uint8),
        mins=None if mins is None else mins.reshape(n, sub_blocks).astype(np.float32),
        bits=bits,
        types=(type_name,),
        factors=factors,
    )
