// octavo.BlockMatMul's compute: y = x @ W^T (+ bias) over weights stored as per-block integer codes (a GGUF
// file's own blocks), dequantized on the fly.
//
// Layout (written by octavo/export/block_layout.py; P = kPanel = 16 output columns per panel, N padded up to a
// multiple of P, nb = K / block_size, block_size a multiple of 4):
//
// | input   | shape                 | element                                                                   |
// |---------|-----------------------|---------------------------------------------------------------------------|
// | codes   | [N/P, K/2, 32*bits/8] | per panel and pair of k (2j, 2j+1): 32 codes, e = 2*c + (k - 2j) for the  |
// |         |                       | panel's column c < 8, 16 + 2*(c-8) + (k - 2j) for c >= 8; 8-bit: byte e;  |
// |         |                       | 4-bit: pair byte i holds code i (low nibble) and code i + 16 (high), and  |
// |         |                       | pairs 2j, 2j+1 interleave their 16 bytes (byte 2i + pair % 2 of the 32)  |
// | scales  | [N/P, nb, P]          | scale(n, b), float32 or float16; or int8, a factor of scale_super         |
// | offsets | [N/P, nb, P]          | offset(n, b), same type as scales                                         |
// | scale_super, offset_super | [N/P, nb/G, P] | two-level scales (a GGUF's K-quants), float32 per super-block of |
// |         |                       | G blocks (G a power of two): scale(n, b) = int8 scales(n, b) * float32  |
// |         |                       | scale_super(n, b / G), one float32 product (exact for the file's values) |
//
// W[n, k] = code(n, k) * scale(n, b) + offset(n, b): for GGUF blocks (codes - zero) * scale + min with zero = 0
// or min = 0, which is every type octavo maps, this is the file's float32 value exactly.
//
// Two paths (block_matmul_kernel.cc):
// - the 16-bit path: steps of at most kIntRows = 8 rows, and decode-only steps of any size (the graph's
//   decode_step input: one token per sequence). The activations are rounded to 16-bit integers per row and
//   block (scale = max|x| / 32767, error <= 2^-16 of the block's largest value, 256 times finer than
//   MatMulNBits' int8), multiplied by the integer codes in exact int32 sums, and each block's sum is scaled in
//   float32; the offsets multiply the exact float32 block sums of x. Up to 8 rows the weights are read once for
//   all rows; past 8, the codes are widened to int16 a chunk of whole blocks at a time, shared by 6-row tiles.
//   Not for a step with a non-finite value, a nonzero block whose max |x| is below 2^-64, blocks too large for
//   an exact int32 sum (8-bit codes: > 256), or (past 8 rows) blocks longer than a chunk (1536).
// - the float32 path, every other step (a prompt's, so its logits are float32 over the file's exact values):
//   weights dequantized to float32 (the file's values) chunk by chunk, float32 FMA tiles.
// On AMX CPUs (AVX-512 builds, block_matmul_amx.cc) the 16-bit path's decode batches run the same integer sums
// on AMX-INT8 tiles (the same bits), and the float32 path's steps the float32-grade split path below (other last
// bits, a tighter error bound) unless the node says prompt_amx = 0, or the bfloat16 path where prompt_bf16 = 1.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>

#include "amx.h"
#include "half.h"

namespace octavo {

constexpr int kPanel = 16;
constexpr int64_t kIntRows = 8;  // rows of the 16-bit decode kernel (decode of up to 8 sequences)

struct BlockWeights {
  const uint8_t* codes = nullptr;
  const void* scales = nullptr;   // float or uint16_t (IEEE half), or int8_t factors of scale_super
  const void* offsets = nullptr;  // same type as scales
  const float* bias = nullptr;    // [N] or null
  const float* scale_super = nullptr;   // two-level scales: [panels, nb >> super_shift, kPanel], or null
  const float* offset_super = nullptr;  // with scale_super
  int super_shift = 0;                  // log2 of the blocks per super-block
  bool half_scales = false;
  int bits = 4;                   // 4 or 8
  int64_t k = 0;
  int64_t n = 0;                  // columns of y (the panels cover n rounded up to kPanel)
  int64_t block_size = 32;        // a multiple of 4 that divides k
  bool small_codes = false;       // 8-bit codes, every one below 64 (checked by the caller): the int8 path may take them

  int64_t panels() const { return (n + kPanel - 1) / kPanel; }
  // The float32 super-block scales (SUPER: scale_super or offset_super) of the block at INDEX = (p * nb + b) *
  // kPanel: (p * nb + b) >> shift = p * (nb >> shift) + (b >> shift), nb being a multiple of the super-block.
  const float* super_at(const float* super, int64_t index) const {
    return super + ((index / kPanel) >> super_shift) * kPanel;
  }
};

// Scalar access to the layout (the portable fallback, octavo.BlockGather): the code of column C of a panel whose
// codes start at PANEL_CODES, at k.
inline int code_at(const uint8_t* panel_codes, int bits, int c, int64_t k) {
  const int e = (c < 8 ? 2 * c : 16 + 2 * (c - 8)) + static_cast<int>(k & 1);
  if (bits == 8) return panel_codes[(k / 2) * 32 + e];  // 32 bytes a pair of k
  const uint8_t byte = panel_codes[(k / 4) * 32 + 2 * (e % 16) + (k / 2) % 2];
  return e < 16 ? (byte & 15) : (byte >> 4);
}

// The float32 scale (BASE = w.scales, SUPER = w.scale_super) or offset (w.offsets, w.offset_super) of one column:
// INDEX = (p * nb + b) * kPanel + c. Two-level scales: one float32 product, as the vector loads form it.
inline float param_at(const BlockWeights& w, const void* base, const float* super, int64_t index) {
  if (super != nullptr) {
    return static_cast<float>(static_cast<const int8_t*>(base)[index]) * w.super_at(super, index)[index % kPanel];
  }
  if (w.half_scales) return half::to_float(static_cast<const uint16_t*>(base)[index]);
  return static_cast<const float*>(base)[index];
}

// y's N columns, as one tensor or split at panel boundaries into up to kMax tensors (the fused q/k/v or gate/up
// projections' parts, written where the graph reads them: no Split after the op). Each is row-major [rows,
// columns[o]]; every part but the last has a multiple of kPanel columns, so each panel lies in one part.
struct Outputs {
  static constexpr int kMax = 4;
  float* data[kMax] = {};
  int64_t columns[kMax] = {};
  int count = 0;

  // Column 0 of panel p at row 0, and the row stride of the part that holds it.
  float* panel(int64_t p, int64_t& stride) const {
    for (int o = 0; o + 1 < count; ++o) {
      const int64_t panels = columns[o] / kPanel;
      if (p < panels) {
        stride = columns[o];
        return data[o] + p * kPanel;
      }
      p -= panels;
    }
    stride = columns[count - 1];
    return data[count - 1] + p * kPanel;
  }
};

bool codes_below_64(const uint8_t* codes, int64_t bytes);  // every byte < 64 (block_matmul_int8.cc)

// Whether a node's 8-bit codes are all below 64 (codes_below_64), scanned once per codes tensor (an initializer's
// data stays where it is for the session's life) and remembered; safe to call from concurrent runs.
class SmallCodes {
 public:
  bool check(const uint8_t* codes, int64_t bytes) const {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (codes != codes_ || bytes != bytes_) {
      small_ = codes_below_64(codes, bytes);
      codes_ = codes;
      bytes_ = bytes;
    }
    return small_;
  }

 private:
  mutable std::mutex mutex_;
  mutable const uint8_t* codes_ = nullptr;
  mutable int64_t bytes_ = 0;
  mutable bool small_ = false;
};

// Buffers of the AMX paths: 64-byte aligned, so that every 64-byte tile row is one cache line (new[] gives 16).
struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};
using TileBuffer = std::unique_ptr<uint16_t[], AlignedFree>;
inline TileBuffer tile_buffer(int64_t elements) {
  const size_t bytes = (static_cast<size_t>(elements) * sizeof(uint16_t) + 63) / 64 * 64;
  return TileBuffer(static_cast<uint16_t*>(std::aligned_alloc(64, bytes)));
}
using ByteBuffer = std::unique_ptr<uint8_t[], AlignedFree>;
inline ByteBuffer byte_buffer(int64_t bytes) {
  return ByteBuffer(static_cast<uint8_t*>(std::aligned_alloc(64, (static_cast<size_t>(bytes) + 63) / 64 * 64)));
}

// Rows the AMX paths' buffers hold: ROWS rounded up to a tile's 16 (zero rows past them).
inline int64_t amx_rows(int64_t rows) { return (rows + 15) / 16 * 16; }

// x [rows, k] prepared once per call, shared by every panel (read-only while the panels run).
struct Activations {
  const float* x = nullptr;
  int64_t rows = 0;
  bool integer = false;                 // the 16-bit path (every value finite, no tiny nonzero block)
  std::unique_ptr<int16_t[]> q;         // [rows, k]
  std::unique_ptr<float[]> q_scale;     // [rows, nb]
  std::unique_ptr<float[]> block_sums;  // [rows, nb] float32 sums of x per block
  // the bfloat16 path (block_matmul_amx.cc), a prompt's steps where the node asks for it and AMX runs here
  bool bf16 = false;
  int64_t k_padded = 0;                 // k rounded up to a multiple of 32 (one tile's k), zeros past k
  bool bf16_dot = false;                // ... on AVX512-BF16 vectors (no AMX here, or switched off)
  TileBuffer xb;                        // [rows rounded up to 16, k_padded] x in bfloat16, zero rows past rows
  // the float32-grade AMX path (block_matmul_amx.cc): xb holds x's three bfloat16 pieces, piece_stride apart,
  // block_sums [rows rounded up to 16, nb] the float32 block sums of x (each task converts its panels' codes)
  bool split = false;
  int64_t piece_stride = 0;
  // the 16-bit path's decode batches on AMX-INT8 (block_matmul_amx.cc): q's low and high bytes, [rows rounded up
  // to 16, k], zero rows past rows
  bool amx_int = false;
  ByteBuffer xlo, xhi;
  // the int8 path (block_matmul_int8.cc): x rounded to int8 per row and 32 values, [rows, k] in quads of k laid as
  // the 4-bit codes pair them; x8_scale [rows, k / 32]; block_sums [rows, nb] float32 sums of x per block
  bool int8 = false;
  std::unique_ptr<int8_t[]> x8;
  std::unique_ptr<float[]> x8_scale;
};

// Sizes a's buffers and returns true when the 16-bit path may take this step; quantize_rows then fills rows
// [first, last) (concurrent calls on disjoint ranges are safe) and returns false when one of them cannot take
// it (a non-finite value, a tiny nonzero block): the caller sets a.integer to the AND of every range's result.
// DECODE: the step is decode-only (the 16-bit path may then take more than kIntRows rows).
bool begin_activations(const BlockWeights& w, const float* x, int64_t rows, bool decode, Activations& a);
bool quantize_rows(const BlockWeights& w, Activations& a, int64_t first, int64_t last);

// Panels, and rows, the caller should hand one thread at a time. Tasks should be ordered row block first: a
// thread that takes consecutive tasks then reuses the row block's x from its cache. The 16-bit paths take all
// rows in one task.
int64_t block_matmul_task_panels(const Activations& a);
int64_t block_matmul_task_rows(const BlockWeights& w, const Activations& a);

// y [r0:r1, n] = x[r0:r1] @ W^T (+ bias) for the panels [first, last); concurrent calls on disjoint ranges are
// safe. Every output's bits are the same whatever the ranges.
void block_matmul_panels(const BlockWeights& w, const Activations& a, const Outputs& y, int64_t first, int64_t last,
                         int64_t r0, int64_t r1);

// The bfloat16 path for a prompt's steps (nodes with prompt_bf16 = 1; block_matmul_amx.cc): x and the
// dequantized weights rounded to bfloat16 (nearest even), their products summed in float32 by AMX tiles
// (TDPBF16PS, 32 k per instruction). Taken only where the float32 path would be (not the 16-bit steps), and only
// on a CPU with AMX-BF16 + AVX512-BF16 whose kernel lets this process use the tile registers (Linux asks once).
// Rows are tiled 32 at a time, 2 panels a tile: each output's sum runs over k in the same order whatever the
// task ranges, so its bits do not depend on them. Where AMX is not usable but AVX512-BF16 is (Zen 4, Cooper
// Lake, AMX switched off; bf16_dot_usable in amx.h), the same operands on VDPBF16PS vectors (a.bf16_dot): 6 rows x
// 4 panels of float32 sums in registers, a pair of k an instruction, k in order (the same independence of the
// ranges; other last bits than the tiles').
// Sizes a's bfloat16 buffers and sets a.bf16; false (a unchanged) where the path is not available.
bool begin_bf16(const BlockWeights& w, Activations& a);
// Fill a.xb rows [first, last) of the padded rows (each task rounds its own panels' weights); concurrent calls on
// disjoint ranges are safe.
void bf16_rows(const BlockWeights& w, Activations& a, int64_t first, int64_t last);
int64_t bf16_task_rows(const Activations& a);  // rows per task: a multiple of 32
// The float32-grade AMX path for the float32 path's steps (nodes with prompt_amx = 1, the default): each x is
// split into three bfloat16 pieces x0 + x1 + x2 that add up to it exactly (24 bits of significand = 3 x 8), and
// the codes (integers < 256) are exact in bfloat16, so every product AMX forms is exact; per block and output,
// C = sum over the block's k of (x2 + x1 + x0) * code in float32 (TDPBF16PS, smallest piece first), then y +=
// scale * C + offset * (float32 block sum of x), over the blocks in order. Where offset = -z * scale exactly
// (a zero point z in [1, 255]), code - z and offset 0 take their place: the same weights, no cancelling term. The error is float32 rounding of
// 3 * block_size + nb sums, as the float32 path's over K, but not its bits. Blocks must be a multiple of 32 (not
// Q6_K's 16); a step with a non-finite x, |x| >= 2^100 or a nonzero |x| < 2^-100 takes the float32 path.
// Rows are tiled 32 at a time, 2 panels a tile: an output's bits do not depend on the task ranges or on the
// other rows of the step.
// The 16-bit path's steps of more than kIntRows rows (decode batches) on AMX-INT8 tiles, where the CPU has them
// and blocks are a multiple of 32: each 16-bit x = 256 * high + low (high signed, low unsigned bytes), so a block's
// int32 sum of x * code is 256 * (high x code, TDPBSUD) + (low x code, TDPBUUD), the 16-bit tiles' integer
// exactly, scaled by the same float32 operations in the same order: the same bits as the 16-bit tiles (and so a
// row's bits still do not depend on its batch). Sets a.amx_int after the 16-bit path took the step; int_rows
// then fills the bytes of rows [first, last) of the padded rows (concurrent calls on disjoint ranges are safe).
bool begin_amx_int(const BlockWeights& w, Activations& a);
// The int8 path (block_matmul_int8.cc; nodes with prompt_int8 = 1, 4-bit codes, blocks of a multiple of 32, AVX2
// builds): the float32 path's steps with x rounded to int8 per 32 values (as llama.cpp multiplies), exact integer
// sums scaled in float32. begin_int8 sizes a's buffers (false: not this layout or build); int8_rows fills rows
// [first, last) (false: a non-finite value, the step takes the float32 path); the caller sets a.int8 to the AND.
// 8-bit codes below 64 (Q6_K, Q5_0, Q5_1, Q5_K; not Q8_0) also take it where the caller has checked them
// (codes_below_64) and set w.small_codes: the node's decode_int8 steps only, blocks of 16 or 32.
bool begin_int8(const BlockWeights& w, Activations& a);
bool int8_rows(const BlockWeights& w, Activations& a, int64_t first, int64_t last);
int64_t int8_task_rows(const Activations& a);
void int8_panels(const BlockWeights& w, const Activations& a, const Outputs& y, int64_t first, int64_t last,
                 int64_t r0, int64_t r1);
void int_rows(const BlockWeights& w, Activations& a, int64_t first, int64_t last);
void amx_int_panels(const BlockWeights& w, const Activations& a, const Outputs& y, int64_t first, int64_t last);
bool begin_split(const BlockWeights& w, Activations& a);
// Fill rows [first, last) of the padded rows (false: a value the path refuses, the step must take the float32
// path); concurrent calls on disjoint ranges are safe.
bool split_rows(const BlockWeights& w, Activations& a, int64_t first, int64_t last);
int64_t split_task_rows(const BlockWeights& w, const Activations& a);  // a multiple of 32
void amx_panels(const BlockWeights& w, const Activations& a, const Outputs& y, int64_t first, int64_t last, int64_t r0,
                int64_t r1);
// The file's float32 values of panel p, k in [k0, k1) (multiples of 4), as buf[(k - k0) * 16 + column]: the
// float32 path's dequantization, shared with the bfloat16 path. Builds without AVX2 have neither path.
void dequantize_panel(const BlockWeights& w, int64_t p, int64_t k0, int64_t k1, float* buf);

}  // namespace octavo
