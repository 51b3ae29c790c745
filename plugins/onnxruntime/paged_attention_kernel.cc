// octavo.PagedAttention math for one work item: flash-style causal attention with an online
// softmax over chunks of kKeyChunk keys read straight from the paged pool.
//
// Rows are the item's (query token, query head of the group) pairs. Scores are kept transposed,
// [key][row], so the softmax and the prefill score GEMM vectorise across rows:
//   prefill (>= kGemmRows rows): scores^T[j][rows] = sum_d K[j][d] * Q^T[d][rows]  (Q^T built once)
//   decode  (few rows): kWidth dot products at a time, summed by one shuffle tree
//   out[row][:] += sum_j p^T[j][row] * V[j][:]
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "half.h"
#include "paged_attention_kernel.h"
#include "simd.h"

namespace octavo {
namespace {

using simd::kWidth;
using simd::vf;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Keys scored together before one online-softmax update.
constexpr int64_t kKeyChunk = 64;
// From this many rows on, scores are computed as a GEMM vectorised across rows.
constexpr int64_t kGemmRows = 16;
// Register blocking of the micro-kernels (at most 16 accumulators with 16 lanes, 8 with fewer).
constexpr int kKeysPerTile = 4;   // GEMM scores: keys per tile (broadcast operands)
constexpr int kRowsPerTile = 4;   // out += p v: rows per tile (broadcast operands)
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
  std::vector<float> scores;   // [kKeyChunk][rows_p] scores, then probabilities (one head at a time)
  std::vector<float> v_pad;    // [kKeyChunk][dim_p] value rows when head_dim % kWidth != 0
  std::vector<float> k_conv;   // [kKeyChunk][heads][dim_p] the chunk's key rows, widened (float16 pools)
  std::vector<float> v_conv;   // [kKeyChunk][heads][dim_p] ... value rows (padding columns zero)
  std::vector<float> zeros;    // [head_dim] stands in for missing keys of a short chunk
  std::vector<int64_t> slots;  // [kKeyChunk] pool slot of each key of the chunk
  std::vector<const float*> k_rows, v_rows;  // [kKeyChunk] this head's pool rows of the chunk's keys
  std::vector<const uint16_t*> k_rows16, v_rows16;  // ... read straight from a float16 pool (decode)
  std::vector<uint16_t> zeros16;  // [head_dim] float16 zeros
};

Scratch& thread_scratch() {
  thread_local Scratch scratch;
  return scratch;
}

// scores^T[j0 + i][col..col + NV*kWidth) = sum_d k_rows[j0 + i][d] * q_t[d][col..] for KB keys.
template <int KB, int NV>
void qk_gemm_tile(const float* const* k_rows, const float* __restrict__ q_t, int64_t rows_p, int64_t head_dim,
                  int64_t col, float* __restrict__ scores) {
  vf acc[KB][NV] = {};
  for (int64_t d = 0; d < head_dim; ++d) {
    vf q[NV];
    for (int v = 0; v < NV; ++v) {
      q[v] = simd::load(q_t + d * rows_p + col + v * kWidth);
      simd::keep_in_register(q[v]);
    }
    for (int i = 0; i < KB; ++i) {
      const float k = k_rows[i][d];
      for (int v = 0; v < NV; ++v) acc[i][v] += k * q[v];
    }
  }
  for (int i = 0; i < KB; ++i)
    for (int v = 0; v < NV; ++v) simd::store(scores + i * rows_p + col + v * kWidth, acc[i][v]);
}

template <int KB>
void qk_gemm_keys(const float* const* k_rows, const float* q_t, int64_t rows_p, int64_t head_dim, float* scores) {
  int64_t col = 0;
  for (; col + kVecsPerTile * kWidth <= rows_p; col += kVecsPerTile * kWidth)
    qk_gemm_tile<KB, kVecsPerTile>(k_rows, q_t, rows_p, head_dim, col, scores);
  switch ((rows_p - col) / kWidth) {
    case 0: break;
    case 1: qk_gemm_tile<KB, 1>(k_rows, q_t, rows_p, head_dim, col, scores); break;
    case 2: qk_gemm_tile<KB, 2>(k_rows, q_t, rows_p, head_dim, col, scores); break;
    default: qk_gemm_tile<KB, 3>(k_rows, q_t, rows_p, head_dim, col, scores); break;
  }
}

// Key/value rows are read as float32 (float pools, widened scratch) or straight from a float16
// pool, widened in registers; both give the same floats.
inline vf load_row(const float* p) { return simd::load(p); }
inline vf load_row(const uint16_t* p) { return half::load_widened(p); }
inline float value_of(const float* p) { return *p; }
inline float value_of(const uint16_t* p) { return half::to_float(*p); }

// Decode: scores[m][j] (row-major, kKeyChunk per row) for few rows, kWidth keys at a time with
// one shuffle-tree reduction.
template <typename T>
void qk_dot(const T* const* k_rows, const T* zeros, const float* q, int64_t rows, int64_t head_dim, int64_t keys,
            float* scores) {
  const int64_t D = head_dim;
  const int64_t vector_dims = D / kWidth * kWidth;  // the rest (head_dim % kWidth) is summed in scalar
  if (vector_dims == 0) {
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
  // Rows in pairs: kWidth / 2 keys of two rows at once share every key load (GQA groups of 2, or
  // any even number of rows). The sums are formed exactly as one row at a time would form them.
  constexpr int kHalf = kWidth / 2;
  int64_t m0 = 0;
  for (; m0 + 2 <= rows; m0 += 2) {
    const float* q0 = q + m0 * D;
    const float* q1 = q0 + D;
    for (int64_t j0 = 0; j0 < keys; j0 += kHalf) {
      const T* k[kHalf];
      for (int l = 0; l < kHalf; ++l) k[l] = j0 + l < keys ? k_rows[j0 + l] : zeros;
      vf acc[kWidth];  // [row 0: keys 0..kHalf) [row 1: keys 0..kHalf)
      const vf qa = simd::load(q0);
      const vf qb = simd::load(q1);
      for (int l = 0; l < kHalf; ++l) {
        const vf kv = load_row(k[l]);
        acc[l] = qa * kv;
        acc[kHalf + l] = qb * kv;
      }
      for (int64_t d = kWidth; d < vector_dims; d += kWidth) {
        const vf qad = simd::load(q0 + d);
        const vf qbd = simd::load(q1 + d);
        for (int l = 0; l < kHalf; ++l) {
          const vf kv = load_row(k[l] + d);
          acc[l] += qad * kv;
          acc[kHalf + l] += qbd * kv;
        }
      }
      vf sums = simd::reduce_lanes<kWidth>(acc);
      if (vector_dims < D) {
        for (int l = 0; l < kHalf; ++l) {
          float tail0 = 0.0f, tail1 = 0.0f;
          for (int64_t d = vector_dims; d < D; ++d) {
            tail0 += q0[d] * value_of(k[l] + d);
            tail1 += q1[d] * value_of(k[l] + d);
          }
          sums[l] += tail0;
          sums[kHalf + l] += tail1;
        }
      }
      float lanes[kWidth];
      simd::store(lanes, sums);
      std::memcpy(scores + m0 * kKeyChunk + j0, lanes, sizeof(float) * kHalf);
      std::memcpy(scores + (m0 + 1) * kKeyChunk + j0, lanes + kHalf, sizeof(float) * kHalf);
    }
  }
  if (m0 == rows) return;
  for (int64_t j0 = 0; j0 < keys; j0 += kWidth) {
    const T* k[kWidth];
    for (int l = 0; l < kWidth; ++l) k[l] = j0 + l < keys ? k_rows[j0 + l] : zeros;
    for (int64_t m = m0; m < rows; ++m) {
      const float* qm = q + m * D;
      vf acc[kWidth];
      const vf q0 = simd::load(qm);
      for (int l = 0; l < kWidth; ++l) acc[l] = q0 * load_row(k[l]);
      for (int64_t d = kWidth; d < vector_dims; d += kWidth) {  // kWidth independent FMA chains
        const vf qd = simd::load(qm + d);
        for (int l = 0; l < kWidth; ++l) acc[l] += qd * load_row(k[l] + d);
      }
      vf sums = simd::reduce_lanes<kWidth>(acc);
      if (vector_dims < D) {
        for (int l = 0; l < kWidth; ++l) {
          float tail = 0.0f;
          for (int64_t d = vector_dims; d < D; ++d) tail += qm[d] * value_of(k[l] + d);
          sums[l] += tail;
        }
      }
      simd::store(scores + m * kKeyChunk + j0, sums);
    }
  }
}

// Where probability (key j, row r) lives: probs[j * key_stride + r * row_stride].
struct ProbLayout {
  int64_t key_stride;
  int64_t row_stride;
};

// out[r][col..col + NV*kWidth) += sum_j prob(j, r) * v_rows[j][col..] for RB rows.
template <int RB, int NV, typename T>
void pv_tile(const float* __restrict__ probs, ProbLayout layout, const T* const* v_rows, int64_t keys, int64_t col,
             float* __restrict__ out, int64_t dim_p) {
  vf acc[RB][NV] = {};
  for (int64_t j = 0; j < keys; ++j) {
    vf v[NV];
    for (int i = 0; i < NV; ++i) v[i] = load_row(v_rows[j] + col + i * kWidth);
    for (int r = 0; r < RB; ++r) {
      const float p = probs[j * layout.key_stride + r * layout.row_stride];
      for (int i = 0; i < NV; ++i) acc[r][i] += p * v[i];
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < NV; ++i) {
      float* o = out + r * dim_p + col + i * kWidth;
      simd::store(o, simd::load(o) + acc[r][i]);
    }
}

template <int RB, typename T>
void pv_rows(const float* probs, ProbLayout layout, const T* const* v_rows, int64_t keys, float* out, int64_t dim_p) {
  int64_t col = 0;
  for (; col + kVecsPerTile * kWidth <= dim_p; col += kVecsPerTile * kWidth)
    pv_tile<RB, kVecsPerTile, T>(probs, layout, v_rows, keys, col, out, dim_p);
  switch ((dim_p - col) / kWidth) {
    case 0: break;
    case 1: pv_tile<RB, 1, T>(probs, layout, v_rows, keys, col, out, dim_p); break;
    case 2: pv_tile<RB, 2, T>(probs, layout, v_rows, keys, col, out, dim_p); break;
    default: pv_tile<RB, 3, T>(probs, layout, v_rows, keys, col, out, dim_p); break;
  }
}

// out[m][:] += sum_j prob(j, m) * v_rows[j][:] for all rows: 4-row tiles, then 2, then 1.
template <typename T>
void pv_chunk(const float* probs, ProbLayout layout, const T* const* v_rows, int64_t rows, int64_t keys, float* out,
              int64_t dim_p) {
  int64_t m = 0;
  for (; m + kRowsPerTile <= rows; m += kRowsPerTile)
    pv_rows<kRowsPerTile>(probs + m * layout.row_stride, layout, v_rows, keys, out + m * dim_p, dim_p);
  if (m + 2 <= rows) {  // decode with GQA groups of 2 (or a tail of 2): both rows share each V load
    pv_rows<2>(probs + m * layout.row_stride, layout, v_rows, keys, out + m * dim_p, dim_p);
    m += 2;
  }
  for (; m < rows; ++m) pv_rows<1>(probs + m * layout.row_stride, layout, v_rows, keys, out + m * dim_p, dim_p);
}

// Masks scores^T of keys [c0, c0 + keys) that row m may not see: keys after its position
// (causal) or at/before position - window. Row m is query token m / group at pos_first + m / group;
// for each key the hidden rows form a prefix (causal) and a suffix (window).
void mask_chunk(float* scores, int64_t rows_p, int64_t keys, int64_t c0, int64_t pos_first, int64_t group,
                int64_t window) {
  for (int64_t j = 0; j < keys; ++j) {
    const int64_t key = c0 + j;
    float* row = scores + j * rows_p;
    const int64_t first_seeing = std::clamp<int64_t>((key - pos_first) * group, 0, rows_p);
    std::fill(row, row + first_seeing, kNegInf);
    if (window > 0) {
      const int64_t last_seeing = std::clamp<int64_t>((key + window - pos_first) * group, 0, rows_p);
      std::fill(row + last_seeing, row + rows_p, kNegInf);
    }
  }
}

// Online softmax over one chunk: scores^T become probabilities; per-row max/sum are updated and
// the factor each row's running output must be rescaled by is left in alpha.
void softmax_chunk(float* scores, int64_t rows_p, int64_t keys, float* row_max, float* row_sum, float* alpha) {
  for (int64_t c = 0; c < rows_p; c += kWidth) {
    vf chunk_max = simd::splat(kNegInf);
    for (int64_t j = 0; j < keys; ++j) chunk_max = simd::max(chunk_max, simd::load(scores + j * rows_p + c));
    const vf old_max = simd::load(row_max + c);
    const vf new_max = simd::max(old_max, chunk_max);
    // Rows that have seen nothing yet keep max -inf; subtracting 0 instead keeps exp(-inf) = 0.
    const vf base = new_max == simd::splat(kNegInf) ? simd::splat(0.0f) : new_max;
    const vf scale = simd::exp(old_max - base);
    vf sum = simd::splat(0.0f);
    for (int64_t j = 0; j < keys; ++j) {
      float* x = scores + j * rows_p + c;
      const vf prob = simd::exp(simd::load(x) - base);
      simd::store(x, prob);
      sum += prob;
    }
    simd::store(row_max + c, new_max);
    simd::store(row_sum + c, simd::load(row_sum + c) * scale + sum);
    simd::store(alpha + c, scale);
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

}  // namespace

void run_work_item(const StepTensors& t, const AttentionParams& p, const WorkItem& item, const PartialResults& partials) {
  const int64_t D = t.head_dim;
  const int64_t dim_p = round_up(D, kWidth);
  const int64_t group = p.num_heads / p.kv_num_heads;
  const int64_t num_q = item.token_end - item.token_begin;
  const int64_t rows = num_q * group;  // row m = token (m / group), query head (m % group) of the kv head
  const int64_t rows_p = round_up(rows, kWidth);
  const int64_t heads = item.kv_head_end - item.kv_head_begin;
  const bool gemm = rows >= kGemmRows;
  const bool direct_v = D % kWidth == 0;  // value rows are read straight from the pool
  const bool f16 = t.kv_type == KvType::kFloat16;
  // float16 decode reads the pool rows in registers; prefill (GEMM) and head_dim not a multiple of
  // the vector width widen them into k_conv / v_conv first.
  const bool f16_direct = f16 && !gemm && direct_v;
  const int64_t seq_begin = t.cumulative_sequence_length[item.seq];
  const int64_t past = t.past_seqlens[item.seq];
  const int64_t window = p.sliding_window;
  const int32_t* table = t.block_table + item.seq * t.max_blocks;
  const int64_t kv_row = p.kv_num_heads * D;
  const int64_t q_stride = p.num_heads * D;
  const int64_t q_size = gemm ? D * rows_p : rows * D;

  Scratch& s = thread_scratch();
  s.q.assign(heads * q_size, 0.0f);
  s.out.assign(heads * rows * dim_p, 0.0f);
  s.row_max.assign(heads * rows_p, kNegInf);
  s.row_sum.assign(heads * rows_p, 0.0f);
  s.alpha.resize(rows_p);
  s.scores.resize(kKeyChunk * rows_p);  // also holds [rows][kKeyChunk] on the decode path
  s.slots.resize(kKeyChunk);
  s.k_rows.resize(kKeyChunk);
  s.v_rows.resize(kKeyChunk);
  s.zeros.assign(D, 0.0f);
  if (f16_direct) {
    s.k_rows16.resize(kKeyChunk);
    s.v_rows16.resize(kKeyChunk);
    s.zeros16.assign(D, 0);
  }
  if (!direct_v && !f16) s.v_pad.assign(kKeyChunk * dim_p, 0.0f);
  if (f16 && !f16_direct) {
    s.k_conv.resize(kKeyChunk * dim_p * heads);
    s.v_conv.resize(kKeyChunk * dim_p * heads);
    if (!direct_v) std::fill(s.v_conv.begin(), s.v_conv.end(), 0.0f);
  }
  const float* const key_f32 = static_cast<const float*>(t.key_cache);
  const float* const value_f32 = static_cast<const float*>(t.value_cache);
  const uint16_t* const key_f16 = static_cast<const uint16_t*>(t.key_cache);
  const uint16_t* const value_f16 = static_cast<const uint16_t*>(t.value_cache);
  const int64_t itemsize = kv_itemsize(t.kv_type);

  // Scaled queries, transposed for the GEMM path.
  for (int64_t h = 0; h < heads; ++h) {
    float* dst = s.q.data() + h * q_size;
    for (int64_t m = 0; m < rows; ++m) {
      const float* src = t.query + (item.token_begin + m / group) * q_stride +
                         ((item.kv_head_begin + h) * group + m % group) * D;
      if (gemm) {
        for (int64_t d = 0; d < D; ++d) dst[d * rows_p + m] = src[d] * p.scale;
      } else {
        for (int64_t d = 0; d < D; ++d) dst[m * D + d] = src[d] * p.scale;
      }
    }
  }

  // Absolute positions of the item's first and last query tokens, and the keys any of them sees.
  const int64_t pos_first = past + (item.token_begin - seq_begin);
  const int64_t pos_last = past + (item.token_end - 1 - seq_begin);
  const int64_t key_lo = std::max(item.key_begin, window > 0 ? std::max<int64_t>(0, pos_first - window + 1) : 0);
  const int64_t key_hi = std::min(item.key_end, pos_last + 1);  // exclusive

  for (int64_t c0 = key_lo; c0 < key_hi; c0 += kKeyChunk) {
    const int64_t keys = std::min(key_hi - c0, kKeyChunk);
    {  // pool slot of each key, walking the block table (no division per key)
      const int64_t bs = t.block_size;
      int64_t block = c0 / bs, offset = c0 % bs;
      int64_t base = static_cast<int64_t>(table[block]) * bs;
      int64_t* slots = s.slots.data();
      for (int64_t j = 0; j < keys; ++j) {
        slots[j] = base + offset;
        if (++offset == bs && j + 1 < keys) {  // never reads a table entry past the chunk's last block
          offset = 0;
          base = static_cast<int64_t>(table[++block]) * bs;
        }
      }
    }
    // Ask for the pool rows (all heads of the item) of this chunk, when it is the first, and of
    // the next one, so many cache lines are in flight while this chunk is computed head by head.
    const int64_t span = heads * D * itemsize;  // bytes of one slot row the item reads
    {
      const int64_t bs = t.block_size;
      const int64_t p0 = c0 == key_lo ? c0 : c0 + kKeyChunk, p1 = std::min(key_hi, c0 + 2 * kKeyChunk);
      if (p0 < p1) {
        int64_t block = p0 / bs, offset = p0 % bs;
        int64_t base = static_cast<int64_t>(table[block]) * bs;
        for (int64_t pos = p0; pos < p1; ++pos) {
          const int64_t off = ((base + offset) * kv_row + item.kv_head_begin * D) * itemsize;
          for (int64_t b = 0; b < span; b += 64) {
            __builtin_prefetch(static_cast<const char*>(t.key_cache) + off + b, 0, 2);
            __builtin_prefetch(static_cast<const char*>(t.value_cache) + off + b, 0, 2);
          }
          if (++offset == bs && pos + 1 < p1) {
            offset = 0;
            base = static_cast<int64_t>(table[++block]) * bs;
          }
        }
      }
    }
    // float16 pools: widen the chunk's rows for all the item's heads at once, walking each slot row
    // in pool order (one contiguous run per slot, consecutive slots of a block adjacent), which the
    // hardware prefetchers follow far better than a head-by-head stride (~12% faster decode from
    // DRAM than widening per head, scripts/bench_op.py --large).
    if (f16 && !f16_direct) {
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
    // Whether some row of the item cannot see some key of this chunk.
    const bool needs_mask = c0 + keys - 1 > pos_first || (window > 0 && c0 <= pos_last - window);

    for (int64_t h = 0; h < heads; ++h) {
      const int64_t head_offset = (item.kv_head_begin + h) * D;
      if (f16_direct) {
        for (int64_t j = 0; j < keys; ++j) {
          s.k_rows16[j] = key_f16 + s.slots[j] * kv_row + head_offset;
          s.v_rows16[j] = value_f16 + s.slots[j] * kv_row + head_offset;
        }
      } else if (f16) {  // rows widened above, [key][head][dim_p]
        for (int64_t j = 0; j < keys; ++j) {
          s.k_rows[j] = s.k_conv.data() + (j * heads + h) * dim_p;
          s.v_rows[j] = s.v_conv.data() + (j * heads + h) * dim_p;
        }
      } else {
        for (int64_t j = 0; j < keys; ++j) {
          s.k_rows[j] = key_f32 + s.slots[j] * kv_row + head_offset;
          s.v_rows[j] = value_f32 + s.slots[j] * kv_row + head_offset;
        }
      }
      float* const scores = s.scores.data();
      float* const out = s.out.data() + h * rows * dim_p;
      const float* const q = s.q.data() + h * q_size;

      // 1. Raw scores, 2. softcap, mask and online softmax (scores become probabilities).
      float* const row_max = s.row_max.data() + h * rows_p;
      float* const row_sum = s.row_sum.data() + h * rows_p;
      const int64_t score_count = gemm ? keys * rows_p : rows * kKeyChunk;
      if (gemm) {
        int64_t j = 0;
        for (; j + kKeysPerTile <= keys; j += kKeysPerTile)
          qk_gemm_keys<kKeysPerTile>(s.k_rows.data() + j, q, rows_p, D, scores + j * rows_p);
        for (; j < keys; ++j) qk_gemm_keys<1>(s.k_rows.data() + j, q, rows_p, D, scores + j * rows_p);
      } else {
        if (f16_direct) {
          qk_dot(s.k_rows16.data(), s.zeros16.data(), q, rows, D, keys, scores);
        } else {
          qk_dot(s.k_rows.data(), s.zeros.data(), q, rows, D, keys, scores);
        }
      }
      if (p.softcap > 0.0f) {
        for (int64_t i = 0; i < score_count; i += kWidth)
          simd::store(scores + i, simd::softcap(simd::load(scores + i), p.softcap));
      }
      if (gemm) {
        if (needs_mask) mask_chunk(scores, rows_p, keys, c0, pos_first, group, window);
        softmax_chunk(scores, rows_p, keys, row_max, row_sum, s.alpha.data());
      } else {
        softmax_rows(scores, rows, keys, c0, pos_first, group, window, row_max, row_sum, s.alpha.data());
      }
      for (int64_t m = 0; m < rows; ++m) {  // rescale the running outputs
        const float a = s.alpha[m];
        if (a == 1.0f) continue;
        float* o = out + m * dim_p;
        for (int64_t d = 0; d < dim_p; d += kWidth) simd::store(o + d, simd::load(o + d) * a);
      }

      // 3. out += probabilities x values.
      if (!direct_v && !f16) {  // widened fp16 rows are already padded
        for (int64_t j = 0; j < keys; ++j) {
          std::memcpy(s.v_pad.data() + j * dim_p, s.v_rows[j], sizeof(float) * D);
          s.v_rows[j] = s.v_pad.data() + j * dim_p;
        }
      }
      const ProbLayout layout = gemm ? ProbLayout{rows_p, 1} : ProbLayout{1, kKeyChunk};
      if (f16_direct) {
        pv_chunk(scores, layout, s.v_rows16.data(), rows, keys, out, dim_p);
      } else {
        pv_chunk(scores, layout, s.v_rows.data(), rows, keys, out, dim_p);
      }
    }
  }

  if (item.partial >= 0) {  // one part of a split key range: leave the raw result for combine_split
    for (int64_t h = 0; h < heads; ++h) {
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

  // Normalise and write this item's output rows.
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t m = 0; m < rows; ++m) {
      float* dst = t.output + (item.token_begin + m / group) * q_stride + ((item.kv_head_begin + h) * group + m % group) * D;
      const float inv = 1.0f / s.row_sum[h * rows_p + m];
      const float* acc = s.out.data() + (h * rows + m) * dim_p;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) dst[d] = acc[d] * inv;
    }
  }
}

}  // namespace octavo
