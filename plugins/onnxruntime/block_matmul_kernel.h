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
// | scales  | [N/P, nb, P]          | scale(n, b), float32 or float16                                           |
// | offsets | [N/P, nb, P]          | offset(n, b), same type as scales                                         |
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
#pragma once

#include <cstdint>
#include <memory>

#include "amx.h"

namespace octavo {

constexpr int kPanel = 16;
constexpr int64_t kIntRows = 8;  // rows of the 16-bit decode kernel (decode of up to 8 sequences)

struct BlockWeights {
  const uint8_t* codes = nullptr;
  const void* scales = nullptr;   // float or uint16_t (IEEE half)
  const void* offsets = nullptr;  // same type as scales
  const float* bias = nullptr;    // [N] or null
  bool half_scales = false;
  int bits = 4;                   // 4 or 8
  int64_t k = 0;
  int64_t n = 0;                  // columns of y (the panels cover n rounded up to kPanel)
  int64_t block_size = 32;        // a multiple of 4 that divides k

  int64_t panels() const { return (n + kPanel - 1) / kPanel; }
};

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
  std::unique_ptr<uint16_t[]> xb;       // [rows rounded up to 16, k_padded] x in bfloat16, zero rows past rows
  std::unique_ptr<uint16_t[]> wb;       // [panels, k_padded / 2, 32] W in bfloat16, pairs of k per column
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
// task ranges, so its bits do not depend on them.
// Sizes a's bfloat16 buffers and sets a.bf16; false (a unchanged) where the path is not available.
bool begin_bf16(const BlockWeights& w, Activations& a);
// Fill a.xb rows [first, last) of the padded rows, and a.wb panels [first, last); concurrent calls on disjoint
// ranges are safe.
void bf16_rows(const BlockWeights& w, Activations& a, int64_t first, int64_t last);
void bf16_panels(const BlockWeights& w, Activations& a, int64_t first, int64_t last);
int64_t bf16_task_rows(const Activations& a);  // rows per task: a multiple of 32
void amx_panels(const BlockWeights& w, const Activations& a, const Outputs& y, int64_t first, int64_t last, int64_t r0,
                int64_t r1);
// The file's float32 values of panel p, k in [k0, k1) (multiples of 4), as buf[(k - k0) * 16 + column]: the
// float32 path's dequantization, shared with bf16_panels. Builds without AVX2 have neither path.
void dequantize_panel(const BlockWeights& w, int64_t p, int64_t k0, int64_t k1, float* buf);

}  // namespace octavo
