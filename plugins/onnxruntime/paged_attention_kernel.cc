// octavo.PagedAttention math for one work item: flash-style causal attention with an online
// softmax over chunks of kKeyChunk keys read straight from the paged pool.
//
// Rows are the item's (query token, query head of the group) pairs. Scores are kept transposed,
// [key][row], so the softmax and the prefill score GEMM vectorise across rows:
//   prefill (gemm_item: items of more than 8 tokens and >= 16 rows; on 8-lane vectors, every item of a GQA group of
//     >= 7 heads): scores^T[j][rows] = sum_d K[j][d] * Q^T[d][rows]  (Q^T built once), in register tiles of 6 keys x
//     kVecsPerTile row vectors
//   decode  (few rows): kWidth dot products at a time, summed by one shuffle tree
//   out[row][:] += sum_j p^T[j][row] * V[j][:], in tiles of 6 rows x kVecsPerTile dim vectors
// Prefill items hold up to ~192 rows (paged_attention_plan.cc) and work through each key chunk in
// passes of kRowsPerPass rows: a pass's scores, queries and outputs fit L1, and the chunk's K/V
// rows, fetched from L3 once, are reused from L2 by the next pass (long contexts ~1.2x faster than
// one pass per item). Every tile shape sums in the same order (over d, then over keys), so the
// results do not depend on the tiling.
// run_work_item hands an item to run_prefill_item or run_decode_item (or, for a bfloat16 prompt where AMX
// runs, to run_amx_item); both walk the key chunks with the same helpers (step_slots, widen_chunk, head_rows).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "amx.h"
#include "half.h"
#include "kv_int8.h"
#include "paged_attention_kernel.h"
#include "simd.h"

#if defined(OCTAVO_AMX)
#include <immintrin.h>
#endif

namespace octavo {
namespace {

using simd::kWidth;
using simd::vf;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Keys scored together before one online-softmax update.
constexpr int64_t kKeyChunk = 64;
// Which path an item takes (gemm_item), by its tokens and its GQA group (query heads per kv head):
// | group                         | tokens <= kExactTokens      | more tokens                                   |
// | >= kGemmGroup (8-lane builds) | GEMM                        | GEMM                                          |
// | narrower                      | dot products (decode's)     | GEMM from kGemmRows rows (tokens x group) on  |
// Each path sums a row the same way whatever the item's other rows, so a token's output is the bits its one-token
// decode gives wherever both take one path: a speculative verification of up to kExactTokens tokens (1 + 7
// drafts) always, a wide group always. A wide group's token fills (most of) a vector of GEMM rows: measured
// (decode, float16 pools, 2-core AVX2 EPYC) groups of 8 1.26-1.38x and of 7 1.16x the dot products' speed at
// batch 48 / 200-300 keys, 1.3x for one sequence of 4096 keys; groups of 3 and 4 (half-empty vectors) ran 0.7-0.9x
// on the GEMM.
constexpr int64_t kGemmRows = 16;
constexpr int64_t kGemmGroup = 7;
constexpr int64_t kExactTokens = 8;
// GEMM rows are processed in passes of this many (a multiple of every vector width): one pass's
// queries, scores and outputs stay in L1 while a chunk's key/value rows, read once from L3 per
// item, serve all of the item's passes from L2.
constexpr int64_t kRowsPerPass = 64;
// Register blocking of the micro-kernels: 6 broadcast operands x kVecsPerTile vectors = 12
// accumulators with 8 lanes (16 registers), 24 with 16 lanes (32 registers). Two FMA pipes of
// latency 4 need 8 independent chains just to stay busy; 12 leave slack for loads that come late
// from L2 (with everything in L1, 4 x 2 and 6 x 2 tiles both run at ~95% of the FMA peak; in place
// the 6 x 2 tiles measured ~1.0-1.2x, on a noisy machine).
constexpr int kKeysPerTile = 6;   // GEMM scores: keys per tile (broadcast operands)
constexpr int kRowsPerTile = 6;   // out += p v: rows per tile (broadcast operands)
constexpr int kVecsPerTile = kWidth >= 16 ? 4 : 2;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Per-thread scratch, reused across calls so the hot path does not allocate.
// rows_p = rows rounded up to kWidth; dim_p = head_dim rounded up to kWidth.
struct Scratch {
  std::vector<float> q;        // per head: [head_dim][rows_p] (GEMM path) or [rows][head_dim] (decode), scaled
  std::vector<float> out;      // [heads][rows][dim_p] unnormalised outputs
  std::vector<float> row_max;  // [heads][rows_p]
  std::vector<float> row_sum;  // [heads][rows_p]
  std::vector<float> alpha;    // [rows_p] rescale factors of the current chunk
  std::vector<float> scores;   // [kKeyChunk][pass width] scores, then probabilities (one head and pass at a time)
  std::vector<float> v_pad;    // [kKeyChunk][dim_p] value rows when head_dim % kWidth != 0
  std::vector<float> k_conv;   // [kKeyChunk][heads][dim_p] the chunk's key rows, widened (float16 and int8 pools)
  std::vector<float> v_conv;   // [kKeyChunk][heads][dim_p] ... value rows (padding columns zero)
  std::vector<float> zeros;    // [head_dim] stands in for missing keys of a short chunk
  std::vector<int64_t> slots;  // [kKeyChunk] pool slot of each key of the chunk
  std::vector<int64_t> next_slots;  // [kKeyChunk] ... of the next chunk (GEMM path; -1 past the end)
  std::vector<const float*> k_rows, v_rows;  // [kKeyChunk] this head's pool rows of the chunk's keys
  std::vector<const uint16_t*> k_rows16, v_rows16;  // ... read straight from a float16 pool (decode)
  std::vector<uint16_t> zeros16;  // [head_dim] float16 zeros
  std::vector<const int8_t*> k_rows8, v_rows8;  // ... the codes of an int8 pool's rows (decode)
  std::vector<float> k_scales, v_scales;        // [kKeyChunk] their scales
  std::vector<float> pv_probs;                  // [rows][kKeyChunk] probabilities times the value rows' scales
  std::vector<int8_t> zeros8;                   // [head_dim] int8 zeros
  std::vector<int64_t> pf_lines;  // decode: byte offsets of the lines P . V asks for (Prefetches)
};

Scratch& thread_scratch() {
  thread_local Scratch scratch;
  return scratch;
}

// scores^T[i][col..col + NV*kWidth) = sum_d k_rows[i][d] * q_t[d][col..] for KB keys; q_t rows are
// q_stride floats apart, score rows width.
template <int KB, int NV>
void qk_gemm_tile(const float* const* k_rows, const float* __restrict__ q_t, int64_t q_stride, int64_t width,
                  int64_t head_dim, int64_t col, float* __restrict__ scores) {
  vf acc[KB][NV] = {};
  for (int64_t d = 0; d < head_dim; ++d) {
    vf q[NV];
    for (int v = 0; v < NV; ++v) {
      q[v] = simd::load(q_t + d * q_stride + col + v * kWidth);
      simd::keep_in_register(q[v]);
    }
    for (int i = 0; i < KB; ++i) {
      const float k = k_rows[i][d];
      for (int v = 0; v < NV; ++v) acc[i][v] += k * q[v];
    }
  }
  for (int i = 0; i < KB; ++i)
    for (int v = 0; v < NV; ++v) simd::store(scores + i * width + col + v * kWidth, acc[i][v]);
}

// KB keys' scores for `width` (a multiple of kWidth) query columns.
template <int KB>
void qk_gemm_keys(const float* const* k_rows, const float* q_t, int64_t q_stride, int64_t width, int64_t head_dim,
                  float* scores) {
  int64_t col = 0;
  for (; col + kVecsPerTile * kWidth <= width; col += kVecsPerTile * kWidth)
    qk_gemm_tile<KB, kVecsPerTile>(k_rows, q_t, q_stride, width, head_dim, col, scores);
  switch ((width - col) / kWidth) {
    case 0: break;
    case 1: qk_gemm_tile<KB, 1>(k_rows, q_t, q_stride, width, head_dim, col, scores); break;
    case 2: qk_gemm_tile<KB, 2>(k_rows, q_t, q_stride, width, head_dim, col, scores); break;
    default: qk_gemm_tile<KB, 3>(k_rows, q_t, q_stride, width, head_dim, col, scores); break;
  }
}

// Key/value rows are read as float32 (float pools, widened scratch) or straight from a float16
// pool, widened in registers; both give the same floats.
inline vf load_row(const float* p) { return simd::load(p); }
inline vf load_row(const uint16_t* p) { return half::load_widened(p); }
inline vf load_row(const int8_t* p) { return kv_int8::load_widened(p); }  // an int8 row's codes (scale apart)
inline float value_of(const float* p) { return *p; }
inline float value_of(const uint16_t* p) { return half::to_float(*p); }
inline float value_of(const int8_t* p) { return static_cast<float>(*p); }

// Decode scores of G rows (q: G rows of head_dim, scores: their rows, kKeyChunk apart): kWidth / G keys of all G
// rows at once share every key load, their sums in one vector register each (lanes past G x kWidth / G stay zero),
// summed together by one shuffle tree. Each (row, key) sum is formed as it is for G = 1 (the same products in the
// same order, the same lane tree), so which G a row is scored with does not change a bit.
template <int G, typename T>
void qk_rows(const T* const* k_rows, const T* zeros, const float* q, int64_t head_dim, int64_t keys, float* scores) {
  constexpr int kKeys = kWidth / G;
  const int64_t D = head_dim;
  const int64_t vector_dims = D / kWidth * kWidth;  // the rest (head_dim % kWidth) is summed in scalar
  for (int64_t j0 = 0; j0 < keys; j0 += kKeys) {
    const T* k[kKeys];
    for (int l = 0; l < kKeys; ++l) k[l] = j0 + l < keys ? k_rows[j0 + l] : zeros;
    vf acc[kWidth];  // [row 0: keys 0..kKeys) [row 1: keys 0..kKeys) ... [zeros]
    for (int i = G * kKeys; i < kWidth; ++i) acc[i] = simd::splat(0.0f);
    vf qv[G];
    for (int g = 0; g < G; ++g) qv[g] = simd::load(q + g * D);
    for (int l = 0; l < kKeys; ++l) {
      const vf kv = load_row(k[l]);
      for (int g = 0; g < G; ++g) acc[g * kKeys + l] = qv[g] * kv;
    }
    for (int64_t d = kWidth; d < vector_dims; d += kWidth) {  // kWidth independent FMA chains
      for (int g = 0; g < G; ++g) qv[g] = simd::load(q + g * D + d);
      for (int l = 0; l < kKeys; ++l) {
        const vf kv = load_row(k[l] + d);
        for (int g = 0; g < G; ++g) acc[g * kKeys + l] += qv[g] * kv;
      }
    }
    vf sums = simd::reduce_lanes<kWidth>(acc);
    if (vector_dims < D) {
      for (int l = 0; l < kKeys; ++l) {
        for (int g = 0; g < G; ++g) {
          float tail = 0.0f;
          for (int64_t d = vector_dims; d < D; ++d) tail += q[g * D + d] * value_of(k[l] + d);
          sums[g * kKeys + l] += tail;
        }
      }
    }
    float lanes[kWidth];
    simd::store(lanes, sums);
    const int64_t n = std::min<int64_t>(kKeys, keys - j0);  // a row's scores end at kKeyChunk
    for (int g = 0; g < G; ++g) std::memcpy(scores + g * kKeyChunk + j0, lanes + g * kKeys, sizeof(float) * n);
  }
}

// Decode: scores[m][j] (row-major, kKeyChunk per row) for few rows. An odd number of rows of 3 or more (GQA
// groups of 3, 5, ...) starts with a triple, then rows go in pairs (GQA groups of 2, any even count), and a last
// single row alone: so no row of a group walks the chunk's keys a second time on its own.
template <typename T>
void qk_dot(const T* const* k_rows, const T* zeros, const float* q, int64_t rows, int64_t head_dim, int64_t keys,
            float* scores) {
  const int64_t D = head_dim;
  if (D < kWidth) {
    for (int64_t j = 0; j < keys; ++j) {
      for (int64_t m = 0; m < rows; ++m) {
        const float* qm = q + m * D;
        const T* k = k_rows[j];
        float acc = 0.0f;
        for (int64_t d = 0; d < D; ++d) acc += qm[d] * value_of(k + d);
        scores[m * kKeyChunk + j] = acc;
      }
    }
    return;
  }
  int64_t m0 = 0;
  if (rows >= 3 && rows % 2 == 1) {
    qk_rows<3>(k_rows, zeros, q, D, keys, scores);
    m0 = 3;
  }
  for (; m0 + 2 <= rows; m0 += 2) qk_rows<2>(k_rows, zeros, q + m0 * D, D, keys, scores + m0 * kKeyChunk);
  if (m0 < rows) qk_rows<1>(k_rows, zeros, q + m0 * D, D, keys, scores + m0 * kKeyChunk);
}

// Where probability (key j, row r) lives: probs[j * key_stride + r * row_stride].
struct ProbLayout {
  int64_t key_stride;
  int64_t row_stride;
};

// Cache lines a decode chunk's P . V asks for (the next chunk's K and V rows), per_key at each key.
struct Prefetches {
  const char* k = nullptr;        // the pools
  const char* v = nullptr;
  const int64_t* lines = nullptr;  // byte offsets of the lines, the same in both pools
  int64_t count = 0;
  int64_t per_key = 0;
};

// out[r][col..col + NV*kWidth) += sum_j prob(j, r) * v_rows[j][col..] for RB rows. ASK (decode): ask for PF's lines
// on the way (a template flag: the prefill tiles, without it, measured ~10 % faster than with an empty list).
template <int RB, int NV, typename T, bool Ask>
void pv_tile(const float* __restrict__ probs, ProbLayout layout, const T* const* v_rows, int64_t keys, int64_t col,
             float* __restrict__ out, int64_t dim_p, Prefetches pf) {
  vf acc[RB][NV] = {};
  for (int64_t j = 0; j < keys; ++j) {
    if constexpr (Ask) {
      for (int64_t l = j * pf.per_key; l < std::min(pf.count, (j + 1) * pf.per_key); ++l) {
        __builtin_prefetch(pf.k + pf.lines[l], 0, 2);
        __builtin_prefetch(pf.v + pf.lines[l], 0, 2);
      }
    }
    if constexpr (NV > kVecsPerTile) {
      // a wide tile (pv_vectors): the rows' probabilities first, then one value vector at a time, RB x NV
      // accumulators + RB + 1 registers (3 x 4 on AVX2: 16 of 16), where loading all NV vectors first would spill
      vf p[RB];
      for (int r = 0; r < RB; ++r) p[r] = simd::splat(probs[j * layout.key_stride + r * layout.row_stride]);
      for (int i = 0; i < NV; ++i) {
        const vf v = load_row(v_rows[j] + col + i * kWidth);
        for (int r = 0; r < RB; ++r) acc[r][i] += p[r] * v;
      }
    } else {  // NV value vectors + one probability at a time (6 rows x kVecsPerTile: 15 of 16 registers on AVX2)
      vf v[NV];
      for (int i = 0; i < NV; ++i) v[i] = load_row(v_rows[j] + col + i * kWidth);
      for (int r = 0; r < RB; ++r) {
        const float p = probs[j * layout.key_stride + r * layout.row_stride];
        for (int i = 0; i < NV; ++i) acc[r][i] += p * v[i];
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < NV; ++i) {
      float* o = out + r * dim_p + col + i * kWidth;
      simd::store(o, simd::load(o) + acc[r][i]);
    }
}

// Dim vectors of a P . V tile of RB rows: kVecsPerTile, or on 8-lane vectors with few rows (decode: a GQA group's
// 1-3 rows) as many as 12 accumulators hold, so each key's value row is walked in fewer passes (SmolLM2's 3 rows of
// 64 dims: 2 passes instead of 4; 1 row: 1).
template <int RB>
constexpr int pv_vectors() {
  if constexpr (kWidth != 8 || RB > 3) return kVecsPerTile;
  return RB == 1 ? 8 : 4;
}

template <int RB, typename T, bool Ask>
void pv_rows(const float* probs, ProbLayout layout, const T* const* v_rows, int64_t keys, float* out, int64_t dim_p,
             Prefetches pf) {
  int64_t col = 0;
  constexpr int kWide = pv_vectors<RB>();
  if constexpr (kWide != kVecsPerTile) {
    for (; col + kWide * kWidth <= dim_p; col += kWide * kWidth, pf = {})  // the first tile asks
      pv_tile<RB, kWide, T, Ask>(probs, layout, v_rows, keys, col, out, dim_p, pf);
  }
  for (; col + kVecsPerTile * kWidth <= dim_p; col += kVecsPerTile * kWidth, pf = {})
    pv_tile<RB, kVecsPerTile, T, Ask>(probs, layout, v_rows, keys, col, out, dim_p, pf);
  switch ((dim_p - col) / kWidth) {
    case 0: break;
    case 1: pv_tile<RB, 1, T, Ask>(probs, layout, v_rows, keys, col, out, dim_p, pf); break;
    case 2: pv_tile<RB, 2, T, Ask>(probs, layout, v_rows, keys, col, out, dim_p, pf); break;
    default: pv_tile<RB, 3, T, Ask>(probs, layout, v_rows, keys, col, out, dim_p, pf); break;
  }
}

// out[m][:] += sum_j prob(j, m) * v_rows[j][:] for all rows: kRowsPerTile-row tiles, then one tile
// of the rest (decode: a GQA group's rows share every V load).
template <typename T, bool Ask = false>
void pv_chunk(const float* probs, ProbLayout layout, const T* const* v_rows, int64_t rows, int64_t keys, float* out,
              int64_t dim_p, Prefetches pf = {}) {
  int64_t m = 0;
  for (; m + kRowsPerTile <= rows; m += kRowsPerTile, pf = {})  // the first tile asks for PF's lines
    pv_rows<kRowsPerTile, T, Ask>(probs + m * layout.row_stride, layout, v_rows, keys, out + m * dim_p, dim_p, pf);
  const float* const p = probs + m * layout.row_stride;
  float* const o = out + m * dim_p;
  static_assert(kRowsPerTile == 6, "the tail below covers 1..5 rows");
  switch (rows - m) {
    case 0: break;
    case 1: pv_rows<1, T, Ask>(p, layout, v_rows, keys, o, dim_p, pf); break;
    case 2: pv_rows<2, T, Ask>(p, layout, v_rows, keys, o, dim_p, pf); break;
    case 3: pv_rows<3, T, Ask>(p, layout, v_rows, keys, o, dim_p, pf); break;
    case 4: pv_rows<4, T, Ask>(p, layout, v_rows, keys, o, dim_p, pf); break;
    default: pv_rows<5, T, Ask>(p, layout, v_rows, keys, o, dim_p, pf); break;
  }
}

// Masks scores^T of keys [c0, c0 + keys) that a row may not see: keys after its position
// (causal) or at/before position - window. Column i is the item's row m = row0 + i, query token
// m / group at pos_first + m / group; for each key the hidden rows form a prefix (causal) and a
// suffix (window).
void mask_chunk(float* scores, int64_t width, int64_t keys, int64_t c0, int64_t pos_first, int64_t row0,
                int64_t group, int64_t window) {
  for (int64_t j = 0; j < keys; ++j) {
    const int64_t key = c0 + j;
    float* row = scores + j * width;
    const int64_t first_seeing = std::clamp<int64_t>((key - pos_first) * group - row0, 0, width);
    std::fill(row, row + first_seeing, kNegInf);
    if (window > 0) {
      const int64_t last_seeing = std::clamp<int64_t>((key + window - pos_first) * group - row0, 0, width);
      std::fill(row + last_seeing, row + width, kNegInf);
    }
  }
}

// Online softmax over NV column vectors of one chunk's scores^T (from column c): scores become probabilities;
// per-row max/sum are updated and the factor each row's running output must be rescaled by is left in alpha.
// NV vectors at once: the max and the sum over keys are chains of dependent operations, one per vector, and one
// vector at a time waited on their latency (perf: the max loop alone was ~4 % of a long prefill's attention).
// NV = 4: 1.03-1.09x the op on SmolLM2's prefill shapes (AVX-512 Xeon). Each lane still sums its keys in order:
// the same bits whatever NV.
template <int NV>
void softmax_columns(float* scores, int64_t width, int64_t keys, int64_t c, float* row_max, float* row_sum,
                     float* alpha) {
  vf chunk_max[NV], base[NV], sum[NV];
  for (int v = 0; v < NV; ++v) chunk_max[v] = simd::splat(kNegInf);
  for (int64_t j = 0; j < keys; ++j) {
    for (int v = 0; v < NV; ++v) chunk_max[v] = simd::max(chunk_max[v], simd::load(scores + j * width + c + v * kWidth));
  }
  for (int v = 0; v < NV; ++v) {
    const vf old_max = simd::load(row_max + c + v * kWidth);
    const vf new_max = simd::max(old_max, chunk_max[v]);
    // Rows that have seen nothing yet keep max -inf; subtracting 0 instead keeps exp(-inf) = 0.
    base[v] = new_max == simd::splat(kNegInf) ? simd::splat(0.0f) : new_max;
    simd::store(alpha + c + v * kWidth, simd::exp(old_max - base[v]));
    simd::store(row_max + c + v * kWidth, new_max);
    sum[v] = simd::splat(0.0f);
  }
  for (int64_t j = 0; j < keys; ++j) {
    for (int v = 0; v < NV; ++v) {
      float* x = scores + j * width + c + v * kWidth;
      const vf prob = simd::exp_nonpositive(simd::load(x) - base[v]);
      simd::store(x, prob);
      sum[v] += prob;
    }
  }
  for (int v = 0; v < NV; ++v) {
    float* rs = row_sum + c + v * kWidth;
    simd::store(rs, simd::load(rs) * simd::load(alpha + c + v * kWidth) + sum[v]);
  }
}

void softmax_chunk(float* scores, int64_t width, int64_t keys, float* row_max, float* row_sum, float* alpha) {
  int64_t c = 0;
  for (; c + 4 * kWidth <= width; c += 4 * kWidth) softmax_columns<4>(scores, width, keys, c, row_max, row_sum, alpha);
  switch ((width - c) / kWidth) {
    case 0: break;
    case 1: softmax_columns<1>(scores, width, keys, c, row_max, row_sum, alpha); break;
    case 2: softmax_columns<2>(scores, width, keys, c, row_max, row_sum, alpha); break;
    default: softmax_columns<3>(scores, width, keys, c, row_max, row_sum, alpha); break;
  }
}

// Decode variant of mask + online softmax, on row-major scores [rows][kKeyChunk]: row m sees keys
// [lo, hi) of the chunk. Leaves the rescale factor of each row in alpha.
void softmax_rows(float* scores, int64_t rows, int64_t keys, int64_t c0, int64_t pos_first, int64_t group,
                  int64_t window, float* row_max, float* row_sum, float* alpha) {
  for (int64_t m = 0; m < rows; ++m) {
    float* row = scores + m * kKeyChunk;
    const int64_t pos = pos_first + m / group;
    const int64_t lo = std::clamp<int64_t>((window > 0 ? pos - window + 1 : 0) - c0, 0, keys);
    const int64_t hi = std::clamp<int64_t>(pos + 1 - c0, 0, keys);
    std::fill(row, row + lo, kNegInf);
    std::fill(row + hi, row + kKeyChunk, kNegInf);
    vf vmax = simd::splat(kNegInf);
    for (int64_t c = 0; c < kKeyChunk; c += kWidth) vmax = simd::max(vmax, simd::load(row + c));
    const float new_max = std::max(row_max[m], simd::reduce_max(vmax));
    const float base = new_max == kNegInf ? 0.0f : new_max;
    vf sum = simd::splat(0.0f);
    for (int64_t c = 0; c < kKeyChunk; c += kWidth) {
      const vf prob = simd::exp(simd::load(row + c) - base);
      simd::store(row + c, prob);
      sum += prob;
    }
    alpha[m] = row_max[m] == kNegInf ? 0.0f : std::exp(row_max[m] - base);
    row_max[m] = new_max;
    row_sum[m] = row_sum[m] * alpha[m] + simd::reduce_add(sum);
  }
}

// Pool slots of keys [c0, c0 + keys) of a sequence, walking its block table (no division per key).
void chunk_slots(const StepTensors& t, const int32_t* table, int64_t c0, int64_t keys, int64_t* slots) {
  const int64_t bs = t.block_size;
  int64_t block = c0 / bs, offset = c0 % bs;
  int64_t base = static_cast<int64_t>(table[block]) * bs;
  for (int64_t j = 0; j < keys; ++j) {
    slots[j] = base + offset;
    if (++offset == bs && j + 1 < keys) {  // never reads a table entry past the chunk's last block
      offset = 0;
      base = static_cast<int64_t>(table[++block]) * bs;
    }
  }
}

// Asks for bytes [first, first + span) of the K and V pool rows of `count` slots (negative: none).
void prefetch_rows(const StepTensors& t, int64_t slot_bytes, const int64_t* slots, int64_t count, int64_t first,
                   int64_t span) {
  for (int64_t j = 0; j < count; ++j) {
    if (slots[j] < 0) continue;
    const int64_t off = slots[j] * slot_bytes + first;
    for (int64_t b = 0; b < span; b += 64) {
      __builtin_prefetch(static_cast<const char*>(t.key_cache) + off + b, 0, 2);
      __builtin_prefetch(static_cast<const char*>(t.value_cache) + off + b, 0, 2);
    }
  }
}

// Appends the byte offsets of the 64-byte lines [first, first + bytes) of COUNT pool slots' rows (SLOT_BYTES each;
// the slots chunk_slots found) to LINES: what prefetch_rows would ask for at once, for Prefetches to spread.
void slot_lines(const int64_t* slots, int64_t count, int64_t slot_bytes, int64_t first, int64_t bytes,
                std::vector<int64_t>& lines) {
  for (int64_t j = 0; j < count; ++j) {
    for (int64_t b = 0; b < bytes; b += 64) lines.push_back(slots[j] * slot_bytes + first + b);
  }
}

// Whether an item of TOKENS query tokens of a GQA group of GROUP heads takes the GEMM (prefill) path (the table at
// kGemmRows).
inline bool gemm_item(int64_t tokens, int64_t group) {
  if (kWidth == 8 && group >= kGemmGroup) return true;
  return tokens > kExactTokens && tokens * group >= kGemmRows;
}

// Keys [lo, hi) any query token of ITEM sees (causal, the sliding window, the item's part of a split range).
std::pair<int64_t, int64_t> item_keys(const StepTensors& t, const AttentionParams& p, const WorkItem& item) {
  const int64_t past = t.past_seqlens[item.seq], seq_begin = t.cumulative_sequence_length[item.seq];
  const int64_t pos_first = past + (item.token_begin - seq_begin), pos_last = past + (item.token_end - 1 - seq_begin);
  const int64_t window = p.sliding_window;
  return {std::max(item.key_begin, window > 0 ? std::max<int64_t>(0, pos_first - window + 1) : 0),
          std::min(item.key_end, pos_last + 1)};
}

// out[m][:] *= alpha[m] for `rows` running outputs (rows whose maximum did not move are left alone).
void rescale(float* out, const float* alpha, int64_t rows, int64_t dim_p) {
  for (int64_t m = 0; m < rows; ++m) {
    const float a = alpha[m];
    if (a == 1.0f) continue;
    float* o = out + m * dim_p;
    for (int64_t d = 0; d < dim_p; d += kWidth) simd::store(o + d, simd::load(o + d) * a);
  }
}

// ---- One work item on the float32 path: prefill (gemm_item: the GEMM) or decode (the dot products). ----

// What both paths derive from an item once.
struct ItemShape {
  int64_t D;               // head_dim
  int64_t dim_p;           // head_dim rounded up to kWidth
  int64_t group;           // query heads per kv head
  int64_t rows;            // row m = token (m / group), query head (m % group) of the kv head
  int64_t rows_p;          // rows rounded up to kWidth
  int64_t heads;           // the item's kv heads
  int64_t kv_row;          // elements of one pool slot (all kv heads; float32 and float16 pools)
  int64_t q_stride;        // floats of one token's query (and output) row (all query heads)
  int64_t head_bytes;      // bytes of one kv head's row in a pool slot (kv_head_bytes)
  int64_t slot_bytes;      // bytes of one pool slot (all kv heads)
  int64_t pos_first;       // absolute position of the item's first query token
  int64_t key_lo, key_hi;  // the keys any of its tokens sees (item_keys)
  const int32_t* table;    // its sequence's block table row
  bool f16;                // float16 pools
  bool q8;                 // int8 pools
  bool widened;            // the pool rows are widened into k_conv / v_conv before use (f16 or q8; widen_chunk)
  bool direct_v;           // value rows are read straight from the pool (head_dim a multiple of kWidth)
};

ItemShape item_shape(const StepTensors& t, const AttentionParams& p, const WorkItem& item) {
  ItemShape g;
  g.D = t.head_dim;
  g.dim_p = round_up(g.D, kWidth);
  g.group = p.num_heads / p.kv_num_heads;
  g.rows = (item.token_end - item.token_begin) * g.group;
  g.rows_p = round_up(g.rows, kWidth);
  g.heads = item.kv_head_end - item.kv_head_begin;
  g.kv_row = p.kv_num_heads * g.D;
  g.q_stride = p.num_heads * g.D;
  g.head_bytes = kv_head_bytes(t.kv_type, g.D);
  g.slot_bytes = p.kv_num_heads * g.head_bytes;
  const int64_t past = t.past_seqlens[item.seq], seq_begin = t.cumulative_sequence_length[item.seq];
  g.pos_first = past + (item.token_begin - seq_begin);
  const auto [key_lo, key_hi] = item_keys(t, p, item);
  g.key_lo = key_lo;
  g.key_hi = key_hi;
  g.table = t.block_table + item.seq * t.max_blocks;
  g.f16 = t.kv_type == KvType::kFloat16;
  g.q8 = t.kv_type == KvType::kInt8;
  g.widened = g.f16 || g.q8;
  g.direct_v = g.D % kWidth == 0;
  return g;
}

// The thread's scratch sized for an item of shape G whose queries take Q_SIZE floats a head, its running outputs,
// maxima and sums reset. DIRECT (decode, float16 or int8 pools, head_dim a multiple of the vector width): the pool
// rows are read in registers; other float16 / int8 items widen them into k_conv / v_conv first.
Scratch& item_scratch(const ItemShape& g, int64_t q_size, bool direct) {
  Scratch& s = thread_scratch();
  s.q.assign(g.heads * q_size, 0.0f);
  s.out.assign(g.heads * g.rows * g.dim_p, 0.0f);
  s.row_max.assign(g.heads * g.rows_p, kNegInf);
  s.row_sum.assign(g.heads * g.rows_p, 0.0f);
  s.alpha.resize(g.rows_p);
  s.scores.resize(kKeyChunk * std::min(g.rows_p, kRowsPerPass));  // also holds [rows][kKeyChunk] (decode)
  s.slots.resize(kKeyChunk);
  s.next_slots.resize(kKeyChunk);
  s.k_rows.resize(kKeyChunk);
  s.v_rows.resize(kKeyChunk);
  s.zeros.assign(g.D, 0.0f);
  if (direct && g.f16) {
    s.k_rows16.resize(kKeyChunk);
    s.v_rows16.resize(kKeyChunk);
    s.zeros16.assign(g.D, 0);
  }
  if (direct && g.q8) {
    s.k_rows8.resize(kKeyChunk);
    s.v_rows8.resize(kKeyChunk);
    s.k_scales.resize(kKeyChunk);
    s.v_scales.resize(kKeyChunk);
    s.pv_probs.resize(g.rows * kKeyChunk);
    s.zeros8.assign(g.D, 0);
  }
  if (!g.direct_v && !g.widened) s.v_pad.assign(kKeyChunk * g.dim_p, 0.0f);
  if (g.widened && !direct) {
    s.k_conv.resize(kKeyChunk * g.dim_p * g.heads);
    s.v_conv.resize(kKeyChunk * g.dim_p * g.heads);
    if (!g.direct_v) std::fill(s.v_conv.begin(), s.v_conv.end(), 0.0f);
  }
  return s;
}

// The item's queries times the scale, kv head h's at q + h * q_size: [rows][D] for decode, or TRANSPOSED for the
// GEMM path, [D][rows_p] (the columns past rows stay as item_scratch left them: zero).
template <bool Transposed>
void scale_queries(const StepTensors& t, const AttentionParams& p, const WorkItem& item, const ItemShape& g,
                   int64_t q_size, float* q) {
  const int64_t D = g.D;
  for (int64_t h = 0; h < g.heads; ++h) {
    float* dst = q + h * q_size;
    for (int64_t m = 0; m < g.rows; ++m) {
      const float* src = t.query + (item.token_begin + m / g.group) * g.q_stride +
                         ((item.kv_head_begin + h) * g.group + m % g.group) * D;
      if constexpr (Transposed) {
        for (int64_t d = 0; d < D; ++d) dst[d * g.rows_p + m] = src[d] * p.scale;
      } else {
        for (int64_t d = 0; d < D; ++d) dst[m * D + d] = src[d] * p.scale;
      }
    }
  }
}

// The pool slots of the chunk at C0 (KEYS keys) in s.slots, and of the next chunk in s.next_slots; returns the next
// chunk's keys (<= 0: this is the last). The pool rows (all heads of the item) of the first chunk are asked for
// here, and those of the next one while this chunk is computed: the GEMM path a key tile at a time (gemm_scores),
// decode a few lines per key of P . V (decode_lines). A burst of hundreds of prefetches stalls on the few outstanding
// misses the core tracks (decode batches asking for the whole next chunk at its start ran at ~1/3 of the DRAM
// bandwidth).
int64_t step_slots(const StepTensors& t, const WorkItem& item, const ItemShape& g, int64_t c0, int64_t keys,
                   Scratch& s) {
  if (c0 != g.key_lo) {
    std::swap(s.slots, s.next_slots);  // found by the previous chunk
  } else {
    chunk_slots(t, g.table, c0, keys, s.slots.data());
    prefetch_rows(t, g.slot_bytes, s.slots.data(), keys, item.kv_head_begin * g.head_bytes, g.heads * g.head_bytes);
  }
  const int64_t next_keys = std::min(g.key_hi - (c0 + kKeyChunk), kKeyChunk);
  if (next_keys > 0) chunk_slots(t, g.table, c0 + kKeyChunk, next_keys, s.next_slots.data());
  return next_keys;
}

// float16 and int8 pools: the chunk's key and value rows of all the item's heads widened into k_conv / v_conv
// ([key][head][dim_p]), walking each slot row in pool order (one contiguous run per slot, consecutive slots of a
// block adjacent), which the hardware prefetchers follow far better than a head-by-head stride (~12% faster decode
// from DRAM than widening per head, scripts/bench_op.py --large). int8 rows are dequantized (exact: kv_int8.h).
void widen_chunk(const StepTensors& t, const WorkItem& item, const ItemShape& g, int64_t keys, Scratch& s) {
  if (g.q8) {
    const uint8_t* const key_q8 = static_cast<const uint8_t*>(t.key_cache);
    const uint8_t* const value_q8 = static_cast<const uint8_t*>(t.value_cache);
    const int64_t first = item.kv_head_begin * g.head_bytes;
    for (int64_t j = 0; j < keys; ++j) {
      const int64_t row0 = s.slots[j] * g.slot_bytes + first;
      for (int64_t h = 0; h < g.heads; ++h) {
        kv_int8::dequantize_row(key_q8 + row0 + h * g.head_bytes, g.D, s.k_conv.data() + (j * g.heads + h) * g.dim_p);
        kv_int8::dequantize_row(value_q8 + row0 + h * g.head_bytes, g.D, s.v_conv.data() + (j * g.heads + h) * g.dim_p);
      }
    }
    return;
  }
  const uint16_t* const key_f16 = static_cast<const uint16_t*>(t.key_cache);
  const uint16_t* const value_f16 = static_cast<const uint16_t*>(t.value_cache);
  const int64_t D = g.D, dim_p = g.dim_p, heads = g.heads, kv_row = g.kv_row;
  const int64_t first = item.kv_head_begin * D;
  for (int64_t j = 0; j < keys; ++j) {
    float* kd = s.k_conv.data() + j * heads * dim_p;
    float* vd = s.v_conv.data() + j * heads * dim_p;
    if (dim_p == D) {
      half::to_floats(key_f16 + s.slots[j] * kv_row + first, kd, heads * D);
      half::to_floats(value_f16 + s.slots[j] * kv_row + first, vd, heads * D);
    } else {
      for (int64_t h = 0; h < heads; ++h) {
        half::to_floats(key_f16 + s.slots[j] * kv_row + first + h * D, kd + h * dim_p, D);
        half::to_floats(value_f16 + s.slots[j] * kv_row + first + h * D, vd + h * dim_p, D);
      }
    }
  }
}

// The item's head H's rows of the chunk's KEYS keys: with DIRECT, float16 pool rows in s.k_rows16 / s.v_rows16 or
// int8 pool rows' codes in s.k_rows8 / s.v_rows8 and their scales in s.k_scales / s.v_scales; else float rows in
// s.k_rows / s.v_rows: the widened ones (float16 and int8 pools) or a float32 pool's own, value rows copied into
// v_pad when head_dim is not a multiple of kWidth (widened rows are already padded to dim_p).
void head_rows(const StepTensors& t, const WorkItem& item, const ItemShape& g, int64_t h, int64_t keys,
               bool direct, Scratch& s) {
  const int64_t head_offset = (item.kv_head_begin + h) * g.D;
  if (direct && g.q8) {
    const uint8_t* const key_q8 = static_cast<const uint8_t*>(t.key_cache);
    const uint8_t* const value_q8 = static_cast<const uint8_t*>(t.value_cache);
    const int64_t head_byte = (item.kv_head_begin + h) * g.head_bytes;
    for (int64_t j = 0; j < keys; ++j) {
      const uint8_t* k = key_q8 + s.slots[j] * g.slot_bytes + head_byte;
      const uint8_t* v = value_q8 + s.slots[j] * g.slot_bytes + head_byte;
      s.k_rows8[j] = reinterpret_cast<const int8_t*>(k);
      s.v_rows8[j] = reinterpret_cast<const int8_t*>(v);
      s.k_scales[j] = kv_int8::scale_of(k, g.D);
      s.v_scales[j] = kv_int8::scale_of(v, g.D);
    }
  } else if (direct) {
    const uint16_t* const key_f16 = static_cast<const uint16_t*>(t.key_cache);
    const uint16_t* const value_f16 = static_cast<const uint16_t*>(t.value_cache);
    for (int64_t j = 0; j < keys; ++j) {
      s.k_rows16[j] = key_f16 + s.slots[j] * g.kv_row + head_offset;
      s.v_rows16[j] = value_f16 + s.slots[j] * g.kv_row + head_offset;
    }
  } else if (g.widened) {  // widened by widen_chunk, [key][head][dim_p]
    for (int64_t j = 0; j < keys; ++j) {
      s.k_rows[j] = s.k_conv.data() + (j * g.heads + h) * g.dim_p;
      s.v_rows[j] = s.v_conv.data() + (j * g.heads + h) * g.dim_p;
    }
  } else {
    const float* const key_f32 = static_cast<const float*>(t.key_cache);
    const float* const value_f32 = static_cast<const float*>(t.value_cache);
    for (int64_t j = 0; j < keys; ++j) {
      s.k_rows[j] = key_f32 + s.slots[j] * g.kv_row + head_offset;
      s.v_rows[j] = value_f32 + s.slots[j] * g.kv_row + head_offset;
    }
    if (!g.direct_v) {
      for (int64_t j = 0; j < keys; ++j) {
        std::memcpy(s.v_pad.data() + j * g.dim_p, s.v_rows[j], sizeof(float) * g.D);
        s.v_rows[j] = s.v_pad.data() + j * g.dim_p;
      }
    }
  }
}

// scores = softcap * tanh(scores / softcap) for COUNT scores (a multiple of kWidth).
inline void apply_softcap(float* scores, int64_t count, const AttentionParams& p) {
  for (int64_t i = 0; i < count; i += kWidth) simd::store(scores + i, simd::softcap(simd::load(scores + i), p.softcap));
}

// The item's result: one part of a split key range leaves its unnormalised rows, their maxima and sums in its
// partial slot (for combine_split); a whole item writes its output rows, normalised.
void write_item(const StepTensors& t, const WorkItem& item, const ItemShape& g, const PartialResults& partials,
                const Scratch& s) {
  const int64_t D = g.D, rows = g.rows, rows_p = g.rows_p, dim_p = g.dim_p, group = g.group;
  if (item.partial >= 0) {
    for (int64_t h = 0; h < g.heads; ++h) {
      for (int64_t m = 0; m < rows; ++m) {
        const int64_t r = h * rows + m;
        partials.max[item.partial * partials.row_stride + r] = s.row_max[h * rows_p + m];
        partials.sum[item.partial * partials.row_stride + r] = s.row_sum[h * rows_p + m];
        std::memcpy(partials.out + item.partial * partials.out_stride + r * D, s.out.data() + r * dim_p,
                    sizeof(float) * D);
      }
    }
    return;
  }
  for (int64_t h = 0; h < g.heads; ++h) {
    for (int64_t m = 0; m < rows; ++m) {
      float* dst = t.output + (item.token_begin + m / group) * g.q_stride + ((item.kv_head_begin + h) * group + m % group) * D;
      const float inv = 1.0f / s.row_sum[h * rows_p + m];
      const float* acc = s.out.data() + (h * rows + m) * dim_p;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) dst[d] = acc[d] * inv;
    }
  }
}

// Prefill, step 1 of a pass: the raw scores^T [pass_keys][width] of the pass's WIDTH columns QP of Q^T (rows_p
// apart), a tile of kKeysPerTile keys at a time. ASK (the last pass of the head): asks for the next chunk's rows of
// this kv HEAD on the way, a key tile at a time.
void gemm_scores(const StepTensors& t, const ItemShape& g, Scratch& s, const float* qp, int64_t width,
                 int64_t pass_keys, int64_t head, bool ask) {
  const int64_t* const next = s.next_slots.data();
  const int64_t slot_bytes = g.slot_bytes, head_bytes = head * g.head_bytes, row_bytes = g.head_bytes;
  float* const scores = s.scores.data();
  int64_t j = 0;
  for (; j + kKeysPerTile <= pass_keys; j += kKeysPerTile) {
    if (ask) prefetch_rows(t, slot_bytes, next + j, kKeysPerTile, head_bytes, row_bytes);
    qk_gemm_keys<kKeysPerTile>(s.k_rows.data() + j, qp, g.rows_p, width, g.D, scores + j * width);
  }
  if (ask) prefetch_rows(t, slot_bytes, next + j, kKeyChunk - j, head_bytes, row_bytes);
  const float* const* const k = s.k_rows.data() + j;
  float* const sc = scores + j * width;
  static_assert(kKeysPerTile == 6, "the tail below covers 1..5 keys");
  switch (pass_keys - j) {  // one tile of the rest
    case 0: break;
    case 1: qk_gemm_keys<1>(k, qp, g.rows_p, width, g.D, sc); break;
    case 2: qk_gemm_keys<2>(k, qp, g.rows_p, width, g.D, sc); break;
    case 3: qk_gemm_keys<3>(k, qp, g.rows_p, width, g.D, sc); break;
    case 4: qk_gemm_keys<4>(k, qp, g.rows_p, width, g.D, sc); break;
    default: qk_gemm_keys<5>(k, qp, g.rows_p, width, g.D, sc); break;
  }
}

// Prefill: the item's head H over the chunk at C0 (KEYS keys, its rows in s.k_rows / s.v_rows), the rows in passes
// of kRowsPerPass: each pass scores, normalises and accumulates its rows on its own, while the chunk's K/V rows
// stay in cache for the next pass.
void prefill_head_chunk(const StepTensors& t, const AttentionParams& p, const WorkItem& item, const ItemShape& g,
                        Scratch& s, int64_t h, int64_t c0, int64_t keys) {
  const int64_t rows = g.rows, rows_p = g.rows_p, dim_p = g.dim_p, group = g.group, pos_first = g.pos_first;
  const int64_t window = p.sliding_window;
  float* const scores = s.scores.data();
  float* const out = s.out.data() + h * rows * dim_p;
  const float* const q = s.q.data() + h * g.D * rows_p;
  float* const row_max = s.row_max.data() + h * rows_p;
  float* const row_sum = s.row_sum.data() + h * rows_p;
  for (int64_t r0 = 0; r0 < rows_p; r0 += kRowsPerPass) {
    const int64_t width = std::min(rows_p - r0, kRowsPerPass);
    const int64_t pass_rows = std::min(rows, r0 + width) - r0;
    const int64_t first = pos_first + r0 / group, last = pos_first + (r0 + pass_rows - 1) / group;
    if (c0 > last || (window > 0 && c0 + keys - 1 <= first - window)) continue;  // sees none of it
    const int64_t pass_keys = std::min(keys, last + 1 - c0);  // keys after the pass's last token: unseen
    // 1. Raw scores (the last pass asks for the next chunk's rows).
    gemm_scores(t, g, s, q + r0, width, pass_keys, item.kv_head_begin + h, r0 + width == rows_p);
    // 2. Softcap, mask and online softmax (scores become probabilities).
    if (p.softcap > 0.0f) apply_softcap(scores, pass_keys * width, p);
    // Whether some row of the pass cannot see some key of this chunk.
    if (c0 + pass_keys - 1 > first || (window > 0 && c0 <= last - window))
      mask_chunk(scores, width, pass_keys, c0, pos_first, r0, group, window);
    softmax_chunk(scores, width, pass_keys, row_max + r0, row_sum + r0, s.alpha.data());
    rescale(out + r0 * dim_p, s.alpha.data(), pass_rows, dim_p);
    // 3. out += probabilities x values.
    pv_chunk(scores, ProbLayout{width, 1}, s.v_rows.data(), pass_rows, pass_keys, out + r0 * dim_p, dim_p);
  }
}

// A prefill item (gemm_item): per key chunk, the rows' scores as a GEMM against the transposed queries.
void run_prefill_item(const StepTensors& t, const AttentionParams& p, const WorkItem& item,
                      const PartialResults& partials, const ItemShape& g) {
  const int64_t q_size = g.D * g.rows_p;
  Scratch& s = item_scratch(g, q_size, false);
  scale_queries<true>(t, p, item, g, q_size, s.q.data());
  for (int64_t c0 = g.key_lo; c0 < g.key_hi; c0 += kKeyChunk) {
    const int64_t keys = std::min(g.key_hi - c0, kKeyChunk);
    const int64_t next_keys = step_slots(t, item, g, c0, keys, s);
    std::fill(s.next_slots.begin() + std::max<int64_t>(next_keys, 0), s.next_slots.end(), -1);  // none to ask for
    if (g.widened) widen_chunk(t, item, g, keys, s);
    for (int64_t h = 0; h < g.heads; ++h) {
      head_rows(t, item, g, h, keys, false, s);
      prefill_head_chunk(t, p, item, g, s, h, c0, keys);
    }
  }
  write_item(t, item, g, partials, s);
}

// Decode: the byte offsets of the lines of the next chunk in s.pf_lines (at the last chunk: of the first chunk of
// NEXT, the item this thread likely takes next, when that is a decode item too), asked for a few per key during
// this chunk's P . V, head by head.
void decode_lines(const StepTensors& t, const AttentionParams& p, const WorkItem& item, const WorkItem* next,
                  const ItemShape& g, int64_t next_keys, Scratch& s) {
  const int64_t slot_bytes = g.slot_bytes, head_bytes = g.head_bytes;
  s.pf_lines.clear();
  if (next_keys > 0) {
    slot_lines(s.next_slots.data(), next_keys, slot_bytes, item.kv_head_begin * head_bytes, g.heads * head_bytes,
               s.pf_lines);
  } else if (next != nullptr && !gemm_item(next->token_end - next->token_begin, g.group)) {
    const auto [next_lo, next_hi] = item_keys(t, p, *next);
    const int64_t first_keys = std::min(next_hi - next_lo, kKeyChunk);
    if (first_keys > 0) {  // the item's loop ends here: next_slots is free
      chunk_slots(t, t.block_table + next->seq * t.max_blocks, next_lo, first_keys, s.next_slots.data());
      slot_lines(s.next_slots.data(), first_keys, slot_bytes, next->kv_head_begin * head_bytes,
                 (next->kv_head_end - next->kv_head_begin) * head_bytes, s.pf_lines);
    }
  }
}

// Decode: the item's head H over the chunk at C0 (KEYS keys; with DIRECT, the pool rows head_rows left: float16
// rows or int8 codes and scales, else float rows in s.k_rows / s.v_rows): 1. raw scores, 2. softcap, mask and
// online softmax, 3. out += probabilities x values, asking on the way for the head's share of s.pf_lines.
// int8 rows: a key's scale multiplies its row's dot product with the codes, a value's scale its probability
// (the softmax sums stay the unscaled probabilities').
void decode_head_chunk(const StepTensors& t, const AttentionParams& p, const ItemShape& g, Scratch& s, int64_t h,
                       int64_t c0, int64_t keys, bool direct) {
  const int64_t rows = g.rows, dim_p = g.dim_p, heads = g.heads;
  float* const scores = s.scores.data();
  float* const out = s.out.data() + h * rows * dim_p;
  const float* const q = s.q.data() + h * rows * g.D;
  float* const row_max = s.row_max.data() + h * g.rows_p;
  float* const row_sum = s.row_sum.data() + h * g.rows_p;
  if (direct && g.q8) {
    qk_dot(s.k_rows8.data(), s.zeros8.data(), q, rows, g.D, keys, scores);
    for (int64_t m = 0; m < rows; ++m) {
      for (int64_t j = 0; j < keys; ++j) scores[m * kKeyChunk + j] *= s.k_scales[j];
    }
  } else if (direct) {
    qk_dot(s.k_rows16.data(), s.zeros16.data(), q, rows, g.D, keys, scores);
  } else {
    qk_dot(s.k_rows.data(), s.zeros.data(), q, rows, g.D, keys, scores);
  }
  if (p.softcap > 0.0f) apply_softcap(scores, rows * kKeyChunk, p);
  softmax_rows(scores, rows, keys, c0, g.pos_first, g.group, p.sliding_window, row_max, row_sum, s.alpha.data());
  rescale(out, s.alpha.data(), rows, dim_p);
  const ProbLayout layout{1, kKeyChunk};
  const int64_t lines = static_cast<int64_t>(s.pf_lines.size());
  const int64_t share = (lines + heads - 1) / heads, l0 = std::min(lines, h * share);
  const Prefetches pf{static_cast<const char*>(t.key_cache), static_cast<const char*>(t.value_cache),
                      s.pf_lines.data() + l0, std::min(lines - l0, share), (share + keys - 1) / keys};
  if (direct && g.q8) {
    float* const probs = s.pv_probs.data();
    for (int64_t m = 0; m < rows; ++m) {
      for (int64_t j = 0; j < keys; ++j) probs[m * kKeyChunk + j] = scores[m * kKeyChunk + j] * s.v_scales[j];
    }
    pv_chunk<int8_t, true>(probs, layout, s.v_rows8.data(), rows, keys, out, dim_p, pf);
  } else if (direct) {
    pv_chunk<uint16_t, true>(scores, layout, s.v_rows16.data(), rows, keys, out, dim_p, pf);
  } else {
    pv_chunk<float, true>(scores, layout, s.v_rows.data(), rows, keys, out, dim_p, pf);
  }
}

// A decode item (not gemm_item: a token's GQA group, a few tokens): per key chunk, kWidth-wide dot products.
void run_decode_item(const StepTensors& t, const AttentionParams& p, const WorkItem& item,
                     const PartialResults& partials, const WorkItem* next, const ItemShape& g) {
  // float16 and int8 pools are read in registers; when head_dim is not a multiple of the vector width they are
  // widened into k_conv / v_conv first, as the GEMM path does.
  const bool direct = g.widened && g.direct_v;
  const int64_t q_size = g.rows * g.D;
  Scratch& s = item_scratch(g, q_size, direct);
  scale_queries<false>(t, p, item, g, q_size, s.q.data());
  for (int64_t c0 = g.key_lo; c0 < g.key_hi; c0 += kKeyChunk) {
    const int64_t keys = std::min(g.key_hi - c0, kKeyChunk);
    const int64_t next_keys = step_slots(t, item, g, c0, keys, s);
    decode_lines(t, p, item, next, g, next_keys, s);
    if (g.widened && !direct) widen_chunk(t, item, g, keys, s);
    for (int64_t h = 0; h < g.heads; ++h) {
      head_rows(t, item, g, h, keys, direct, s);
      decode_head_chunk(t, p, g, s, h, c0, keys, direct);
    }
  }
  write_item(t, item, g, partials, s);
}

#if defined(OCTAVO_AMX)
// The bfloat16 path of a prompt's item (AttentionParams::prompt_bf16; amx.h), head by head, key chunk by key
// chunk, in passes of 16 rows, all in the transposed layout of the float32 GEMM path (scores^T [key][row]):
//   S^T[64 keys][16 rows] = K · Q^T: A = the chunk's keys in bfloat16 (as they lie), B = the pass's scaled
//     queries in bfloat16 pairs of dims (built once per head), 4 accumulator tiles over head_dim / 32
//   softcap, mask (mask_chunk) and the online softmax across the 16 rows in float32 (softmax_16)
//   out^T[head_dim][16 rows] = out^T * alpha + V^T · P^T: A = the chunk's values transposed (built once per head
//     and chunk, shared by every pass), B = the probabilities in bfloat16 pairs of keys; up to 4 accumulator
//     tiles (64 dims) at a time, stored and added to the float32 running output.
// The passes run in a two-stage pipeline: pass i's scores are computed before pass i - 1's P · V, whose
// operand was stored a pass earlier (a tile load right after the vector stores that wrote its operand waits
// for them). Each output sums over keys in chunk order and within a chunk in the tiles' order: its bits do not
// depend on how the rows are split into items or passes.
constexpr int64_t kAmxRows = 16;

struct AmxScratch {
  std::vector<uint32_t> q_t;    // [passes][D / 32][16 pairs of dims][16 rows] scaled queries, bfloat16 pairs
  std::vector<float> out_t;     // [rows_16 / 16][D][16] unnormalised outputs, transposed per pass of 16 rows
  std::vector<float> row_max;   // [rows_16]
  std::vector<float> row_sum;   // [rows_16]
  std::vector<float> alpha;     // [2 slots][16]
  std::vector<float> scores;    // [kKeyChunk][16] scores^T, then probabilities
  std::vector<uint16_t> p_t;    // [2 slots][2 key steps][16 pairs of keys][32] probabilities, bfloat16 pairs
  std::vector<float> pv;        // [D][16 rows] one pass's P · V
  std::vector<uint16_t> keys;   // [kKeyChunk][D] the chunk's keys in bfloat16
  std::vector<uint16_t> v_t;    // [D / 16][2 key steps][16 dims][32 keys] values transposed
  std::vector<int64_t> slots;   // [kKeyChunk]
  std::vector<int64_t> next_slots;  // [kKeyChunk] the next chunk's
};

AmxScratch& amx_scratch() {
  thread_local AmxScratch scratch;
  return scratch;
}

OCTAVO_AMX_TARGET inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
OCTAVO_AMX_TARGET inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 32 floats (A: the first 16, B: the next) to bfloat16 at DST, in order.
OCTAVO_AMX_TARGET inline void store_bf16(uint16_t* dst, __m512 a, __m512 b) {
  _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

// A and B to bfloat16, interleaved (a0, b0, a1, b1, ...): one row of a pairs tile.
OCTAVO_AMX_TARGET inline void store_pairs(uint16_t* dst, __m512 a, __m512 b) {
  alignas(64) static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                           8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pair = (__m512i)_mm512_cvtne2ps_pbh(b, a);
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), pair));
}

// 2^t for 16 floats (t <= 0: a score minus its row's max, in base 2): 2^n * p(r), n = round(t), r = t - n in
// [-1/2, 1/2], p of degree 4 fitted to 2^r (relative error 2.7e-6, far below the bfloat16 rounding the
// probabilities then take); exactly 0 below -126 (and for -inf: masked keys); NaN stays NaN.
OCTAVO_AMX_TARGET inline __m512 exp2_16(__m512 t) {
  const __mmask16 live = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(0.009570101276040077f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.05591786280274391f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.240247443318367f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.6931217908859253f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.9999992847442627f));
  return _mm512_maskz_scalef_ps(live, p, n);
}

// Online softmax of one pass: scores^T [64][16] (keys past KEYS are masked here) become probabilities; the 16
// rows' max and sum are updated and each row's rescale factor is left in ALPHA. Four independent max and sum
// chains over the keys.
OCTAVO_AMX_TARGET void softmax_16(float* scores, int64_t keys, float* row_max, float* row_sum, float* alpha) {
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  for (int64_t j = keys; j < kKeyChunk; ++j) _mm512_storeu_ps(scores + j * 16, neg_inf);
  __m512 m[4] = {neg_inf, neg_inf, neg_inf, neg_inf};
  for (int64_t j = 0; j < kKeyChunk; j += 4) {
    for (int i = 0; i < 4; ++i) m[i] = _mm512_max_ps(m[i], _mm512_loadu_ps(scores + (j + i) * 16));
  }
  const __m512 old_max = _mm512_loadu_ps(row_max);
  const __m512 new_max = _mm512_max_ps(old_max, _mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3])));
  // rows that have seen nothing yet keep max -inf; subtracting 0 instead keeps exp(-inf) = 0
  const __m512 base = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(new_max, neg_inf, _CMP_EQ_OQ), new_max,
                                           _mm512_setzero_ps());
  const __m512 log2e = _mm512_set1_ps(1.44269504089f);
  const __m512 base2 = _mm512_mul_ps(base, log2e);  // e^(x - base) = 2^(x log2 e - base log2 e): one FMA a score
  const __m512 a = exp2_16(_mm512_mul_ps(_mm512_sub_ps(old_max, base), log2e));
  _mm512_storeu_ps(alpha, a);
  _mm512_storeu_ps(row_max, new_max);
  __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t j = 0; j < kKeyChunk; j += 4) {
    for (int i = 0; i < 4; ++i) {
      float* x = scores + (j + i) * 16;
      const __m512 prob = exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(x), log2e, base2));
      _mm512_storeu_ps(x, prob);
      sum[i] = _mm512_add_ps(sum[i], prob);
    }
  }
  const __m512 total = _mm512_add_ps(_mm512_add_ps(sum[0], sum[1]), _mm512_add_ps(sum[2], sum[3]));
  _mm512_storeu_ps(row_sum, _mm512_fmadd_ps(_mm512_loadu_ps(row_sum), a, total));
}

// r[i][j] -> r[j][i] for 16 x 16 floats: pairs interleaved, then quads, then 128-bit lanes across registers.
OCTAVO_AMX_TARGET inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + k], 128-bit lane L: rows 4i .. 4i + 3 of column 4L + k
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88);
    t[4 + k] = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xDD);
    t[8 + k] = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88);
    t[12 + k] = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xDD);
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0xDD);
    r[4 + k] = _mm512_shuffle_f32x4(t[4 + k], t[12 + k], 0x88);
    r[12 + k] = _mm512_shuffle_f32x4(t[4 + k], t[12 + k], 0xDD);
  }
}

// The chunk's keys (bfloat16, as they lie) and values (transposed) of one head (ROWS[j]: key j's row of the
// head, j < keys; zeros past keys).
template <typename T>
OCTAVO_AMX_TARGET void amx_chunk_operands(const T* const* k_rows, const T* const* v_rows, int64_t keys, int64_t D,
                                          AmxScratch& s) {
  uint16_t* kb = s.keys.data();
  for (int64_t j = 0; j < kKeyChunk; ++j) {
    if (j >= keys) {
      std::memset(kb + j * D, 0, sizeof(uint16_t) * D);
      continue;
    }
    for (int64_t d = 0; d < D; d += 32) store_bf16(kb + j * D + d, load16(k_rows[j] + d), load16(k_rows[j] + d + 16));
  }
  // V^T tile (dt, ks): row i = dim dt * 16 + i, columns = keys ks * 32 .. + 31; 16 x 16 blocks transposed
  for (int64_t dt = 0; dt < D / 16; ++dt) {
    for (int64_t kg = 0; kg < kKeyChunk / 16; ++kg) {
      __m512 r[16];
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t j = kg * 16 + i;
        r[i] = j < keys ? load16(v_rows[j] + dt * 16) : _mm512_setzero_ps();
      }
      transpose16(r);
      uint16_t* dst = s.v_t.data() + (dt * 2 + kg / 2) * 512 + (kg % 2) * 16;
      for (int64_t i = 0; i < 16; ++i) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i * 32), (__m256i)_mm512_cvtneps_pbh(r[i]));
      }
    }
  }
}

// scores^T[64][16] = the chunk's keys times the pass's query pairs Q_T ([D / 32][16][16]).
OCTAVO_AMX_TARGET void amx_scores(const uint16_t* kb, int64_t D, const uint32_t* q_t, float* scores) {
  const int64_t k_stride = D * static_cast<int64_t>(sizeof(uint16_t));
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t ds = 0; ds < D / 32; ++ds) {
    const uint16_t* a = kb + ds * 32;
    _tile_loadd(6, q_t + ds * 256, 64);
    _tile_loadd(4, a, k_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, a + 16 * D, k_stride);
    _tile_dpbf16ps(1, 5, 6);
    _tile_loadd(7, a + 32 * D, k_stride);
    _tile_dpbf16ps(2, 7, 6);
    _tile_loadd(4, a + 48 * D, k_stride);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, scores, 64);
  _tile_stored(1, scores + 256, 64);
  _tile_stored(2, scores + 512, 64);
  _tile_stored(3, scores + 768, 64);
}

// pv[t][16 dims][16 rows] = V^T (dim tiles dt0 .. dt0 + NT) times the probability pairs P_T ([2][16][32]).
template <int NT>
OCTAVO_AMX_TARGET void amx_values(const uint16_t* v_t, const uint16_t* p_t, int64_t dt0, float* pv) {
  _tile_zero(0);
  if constexpr (NT > 1) _tile_zero(1);
  if constexpr (NT > 2) _tile_zero(2);
  if constexpr (NT > 3) _tile_zero(3);
  for (int64_t ks = 0; ks < 2; ++ks) {
    const uint16_t* a = v_t + (dt0 * 2 + ks) * 512;
    _tile_loadd(6, p_t + ks * 512, 64);
    _tile_loadd(4, a, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT > 1) {
      _tile_loadd(5, a + 1024, 64);
      _tile_dpbf16ps(1, 5, 6);
    }
    if constexpr (NT > 2) {
      _tile_loadd(7, a + 2048, 64);
      _tile_dpbf16ps(2, 7, 6);
    }
    if constexpr (NT > 3) {
      _tile_loadd(4, a + 3072, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  _tile_stored(0, pv, 64);
  if constexpr (NT > 1) _tile_stored(1, pv + 256, 64);
  if constexpr (NT > 2) _tile_stored(2, pv + 512, 64);
  if constexpr (NT > 3) _tile_stored(3, pv + 768, 64);
}

// The same two products on AVX512-BF16 vectors (no AMX here, or OCTAVO_AMX=0; amx.h): a register holds one key's
// (or dim's) 16 rows, VDPBF16PS adds a pair of dims (keys) a step, in order; the same operands and layouts.
// scores^T[64][16] = the chunk's keys times the pass's query pairs Q_T, 16 keys at a time.
OCTAVO_AMX_TARGET void dot_scores(const uint16_t* kb, int64_t D, const uint32_t* q_t, float* scores) {
  for (int64_t j0 = 0; j0 < kKeyChunk; j0 += 16) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t pair = 0; pair < D / 2; ++pair) {  // q_t's [D / 32][16 pairs][16 rows]: pair after pair
      const __m512bh q = (__m512bh)_mm512_loadu_si512(q_t + pair * 16);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        int32_t k = 0;
        std::memcpy(&k, kb + (j0 + i) * D + 2 * pair, sizeof k);
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(k), q);
      }
    }
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(scores + (j0 + i) * 16, acc[i]);
  }
}

// pv[D][16 rows] = V^T times the probability pairs of slot SLOT, 16 dims at a time.
OCTAVO_AMX_TARGET void dot_issue_values(AmxScratch& s, int slot, int64_t D) {
  const uint16_t* p_t = s.p_t.data() + slot * 1024;
  for (int64_t dt = 0; dt < D / 16; ++dt) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t ks = 0; ks < 2; ++ks) {
      const uint16_t* v = s.v_t.data() + (dt * 2 + ks) * 512;  // [16 dims][32 keys]
      for (int64_t pair = 0; pair < 16; ++pair) {
        const __m512bh prob = (__m512bh)_mm512_loadu_si512(p_t + ks * 512 + pair * 32);
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {
          int32_t value = 0;
          std::memcpy(&value, v + i * 32 + 2 * pair, sizeof value);
          acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(value), prob);
        }
      }
    }
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(s.pv.data() + dt * 256 + i * 16, acc[i]);
  }
}

// P · V of pipeline slot SLOT's probabilities, issued: the tiles into s.pv (amx_add_values adds them later, so
// the vector work between the two overlaps the tiles).
OCTAVO_AMX_TARGET void amx_issue_values(AmxScratch& s, int slot, int64_t D) {
  const uint16_t* p_t = s.p_t.data() + slot * 1024;
  const int64_t dim_tiles = D / 16;
  for (int64_t dt0 = 0; dt0 < dim_tiles; dt0 += 4) {
    float* const pv = s.pv.data() + dt0 * 256;
    switch (std::min<int64_t>(4, dim_tiles - dt0)) {
      case 1: amx_values<1>(s.v_t.data(), p_t, dt0, pv); break;
      case 2: amx_values<2>(s.v_t.data(), p_t, dt0, pv); break;
      case 3: amx_values<3>(s.v_t.data(), p_t, dt0, pv); break;
      default: amx_values<4>(s.v_t.data(), p_t, dt0, pv); break;
    }
  }
}

// The pass of rows [r0, r0 + 16): out^T = out^T * alpha (slot SLOT's) + the P · V in s.pv. A pass's out^T is
// one contiguous [D][16] block (4 KiB at D = 64), and the pointers are taken once: a column-strided out^T
// (D rows of rows_16) missed L1 on every d, and the thread_local was looked up again per d.
OCTAVO_AMX_TARGET void amx_add_values(AmxScratch& s, int slot, int64_t r0, int64_t D) {
  const __m512 a = _mm512_loadu_ps(s.alpha.data() + slot * kAmxRows);
  float* const out = s.out_t.data() + (r0 / 16) * D * 16;
  const float* const pv = s.pv.data();
  for (int64_t d = 0; d < D; ++d) {
    _mm512_storeu_ps(out + d * 16, _mm512_fmadd_ps(_mm512_loadu_ps(out + d * 16), a, _mm512_loadu_ps(pv + d * 16)));
  }
}

// TILES: the AMX tiles (amx_bf16_usable), else the AVX512-BF16 vectors (dot_scores, dot_issue_values).
template <typename T, bool Tiles>
OCTAVO_AMX_TARGET void run_amx_item(const StepTensors& t, const AttentionParams& p, const WorkItem& item,
                                    const PartialResults& partials) {
  const int64_t D = t.head_dim;
  const int64_t group = p.num_heads / p.kv_num_heads;
  const int64_t rows = (item.token_end - item.token_begin) * group;
  const int64_t rows_16 = round_up(rows, kAmxRows);
  const int64_t seq_begin = t.cumulative_sequence_length[item.seq];
  const int64_t past = t.past_seqlens[item.seq];
  const int64_t window = p.sliding_window;
  const int32_t* table = t.block_table + item.seq * t.max_blocks;
  const int64_t kv_row = p.kv_num_heads * D, q_stride = p.num_heads * D, d_steps = D / 32;
  const int64_t pos_first = past + (item.token_begin - seq_begin);
  const auto [key_lo, key_hi] = item_keys(t, p, item);
  const T* const key_pool = static_cast<const T*>(t.key_cache);
  const T* const value_pool = static_cast<const T*>(t.value_cache);

  AmxScratch& s = amx_scratch();
  s.q_t.resize(rows_16 * D / 2);
  s.out_t.resize(D * rows_16);
  s.row_max.resize(rows_16);
  s.row_sum.resize(rows_16);
  s.alpha.resize(2 * kAmxRows);
  s.scores.resize(kKeyChunk * kAmxRows);
  s.p_t.resize(2 * 1024);
  s.pv.resize(D * 16);
  s.keys.resize(kKeyChunk * D);
  s.v_t.resize(kKeyChunk * D);
  s.slots.resize(kKeyChunk);
  s.next_slots.resize(kKeyChunk);
  const T* k_rows[kKeyChunk];
  const T* v_rows[kKeyChunk];
  alignas(64) uint32_t pairs[16];
  if constexpr (Tiles) amx_begin_tiles();
  const auto scores_of = [&](int64_t r0, float* scores) {
    const uint32_t* q = s.q_t.data() + (r0 / 16) * d_steps * 256;
    if constexpr (Tiles) return amx_scores(s.keys.data(), D, q, scores);
    dot_scores(s.keys.data(), D, q, scores);
  };
  const auto issue_values = [&](int slot) {
    if constexpr (Tiles) return amx_issue_values(s, slot, D);
    dot_issue_values(s, slot, D);
  };
  for (int64_t h = 0; h < item.kv_head_end - item.kv_head_begin; ++h) {
    const int64_t kv_head = item.kv_head_begin + h, head_offset = kv_head * D;
    const __m512 scale = _mm512_set1_ps(p.scale);
    for (int64_t m = 0; m < rows_16; ++m) {  // scaled queries, bfloat16 pairs of dims, [pass][ds][pair][row]
      uint32_t* dst = s.q_t.data() + (m / 16) * d_steps * 256 + m % 16;
      const float* src = t.query + (item.token_begin + m / group) * q_stride + (kv_head * group + m % group) * D;
      for (int64_t ds = 0; ds < d_steps; ++ds) {
        if (m < rows) {
          store_bf16(reinterpret_cast<uint16_t*>(pairs), _mm512_mul_ps(_mm512_loadu_ps(src + ds * 32), scale),
                     _mm512_mul_ps(_mm512_loadu_ps(src + ds * 32 + 16), scale));
        } else {
          std::memset(pairs, 0, sizeof pairs);
        }
        for (int64_t r = 0; r < 16; ++r) dst[ds * 256 + r * 16] = pairs[r];
      }
    }
    std::fill(s.out_t.begin(), s.out_t.end(), 0.0f);
    std::fill(s.row_max.begin(), s.row_max.end(), kNegInf);
    std::fill(s.row_sum.begin(), s.row_sum.end(), 0.0f);
    for (int64_t c0 = key_lo; c0 < key_hi; c0 += kKeyChunk) {
      const int64_t keys = std::min(key_hi - c0, kKeyChunk);
      chunk_slots(t, table, c0, keys, s.slots.data());
      for (int64_t j = 0; j < keys; ++j) {
        k_rows[j] = key_pool + s.slots[j] * kv_row + head_offset;
        v_rows[j] = value_pool + s.slots[j] * kv_row + head_offset;
      }
      amx_chunk_operands<T>(k_rows, v_rows, keys, D, s);
      const int64_t next_keys = std::min(key_hi - (c0 + kKeyChunk), kKeyChunk);
      if (next_keys > 0) chunk_slots(t, table, c0 + kKeyChunk, next_keys, s.next_slots.data());
      int64_t prefetched = 0;
      int64_t pending = -1;
      int slot = 0;
      for (int64_t r0 = 0; r0 < rows; r0 += kAmxRows) {
        const int64_t pass_rows = std::min(kAmxRows, rows - r0);
        const int64_t first = pos_first + r0 / group, last = pos_first + (r0 + pass_rows - 1) / group;
        if (c0 > last || (window > 0 && c0 + keys - 1 <= first - window)) continue;  // sees none of it
        float* const scores = s.scores.data();
        scores_of(r0, scores);
        if (pending >= 0) issue_values(1 - slot);
        if (next_keys > 0 && prefetched < next_keys) {  // the next chunk's rows, a few keys per pass
          const int64_t upto = std::min(next_keys, prefetched + 8);
          for (; prefetched < upto; ++prefetched) {
            const char* k = reinterpret_cast<const char*>(key_pool + s.next_slots[prefetched] * kv_row + head_offset);
            const char* v = reinterpret_cast<const char*>(value_pool + s.next_slots[prefetched] * kv_row + head_offset);
            for (int64_t b = 0; b < static_cast<int64_t>(D * sizeof(T)); b += 64) {
              __builtin_prefetch(k + b, 0, 2);
              __builtin_prefetch(v + b, 0, 2);
            }
          }
        }
        if (p.softcap > 0.0f) {
          for (int64_t i = 0; i < keys * kAmxRows; i += kWidth)
            simd::store(scores + i, simd::softcap(simd::load(scores + i), p.softcap));
        }
        if (c0 + keys - 1 > first || (window > 0 && c0 <= last - window))
          mask_chunk(scores, kAmxRows, keys, c0, pos_first, r0, group, window);
        softmax_16(scores, keys, s.row_max.data() + r0, s.row_sum.data() + r0, s.alpha.data() + slot * kAmxRows);
        uint16_t* const p_t = s.p_t.data() + slot * 1024;
        for (int64_t ks = 0; ks < 2; ++ks) {
          for (int64_t r = 0; r < 16; ++r) {
            const float* even = scores + (ks * 32 + 2 * r) * 16;
            store_pairs(p_t + (ks * 16 + r) * 32, _mm512_loadu_ps(even), _mm512_loadu_ps(even + 16));
          }
        }
        if (pending >= 0) amx_add_values(s, 1 - slot, pending, D);
        pending = r0;
        slot = 1 - slot;
      }
      if (pending >= 0) {
        issue_values(1 - slot);
        amx_add_values(s, 1 - slot, pending, D);
      }
    }
    for (int64_t m = 0; m < rows; ++m) {
      const float* acc = s.out_t.data() + (m / 16) * D * 16 + m % 16;  // column m of its pass's out^T
      if (item.partial >= 0) {  // one part of a split key range: the raw result for combine_split
        const int64_t r = h * rows + m;
        partials.max[item.partial * partials.row_stride + r] = s.row_max[m];
        partials.sum[item.partial * partials.row_stride + r] = s.row_sum[m];
        float* dst = partials.out + item.partial * partials.out_stride + r * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = acc[d * 16];
        continue;
      }
      float* dst = t.output + (item.token_begin + m / group) * q_stride + (kv_head * group + m % group) * D;
      const float inv = 1.0f / s.row_sum[m];
      for (int64_t d = 0; d < D; ++d) dst[d] = acc[d * 16] * inv;
    }
  }
  if constexpr (Tiles) amx_end_tiles();
}
#endif

}  // namespace

void run_work_item(const StepTensors& t, const AttentionParams& p, const WorkItem& item, const PartialResults& partials,
                   const WorkItem* next) {
  const ItemShape g = item_shape(t, p, item);
  const int64_t tokens = g.rows / g.group;
  const bool gemm = gemm_item(tokens, g.group);
#if defined(OCTAVO_AMX)
  // bfloat16 for prompt items only (> kExactTokens tokens), never for a decode item that kGemmGroup sends to the GEMM
  if (p.prompt_bf16 && gemm && tokens > kExactTokens && g.D % 32 == 0 && !g.q8) {  // int8 pools: float32
    if (amx_bf16_usable()) {
      if (g.f16) return run_amx_item<uint16_t, true>(t, p, item, partials);
      return run_amx_item<float, true>(t, p, item, partials);
    }
    if (bf16_dot_usable()) {
      if (g.f16) return run_amx_item<uint16_t, false>(t, p, item, partials);
      return run_amx_item<float, false>(t, p, item, partials);
    }
  }
#endif
  if (gemm) return run_prefill_item(t, p, item, partials, g);
  run_decode_item(t, p, item, partials, next, g);
}

}  // namespace octavo
