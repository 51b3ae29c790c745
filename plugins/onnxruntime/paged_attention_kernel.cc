// octavo.PagedAttention math: paged KV writes, then flash-style (online softmax) causal attention.
#include "paged_attention_kernel.h"

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

namespace octavo {
namespace {

using simd::kWidth;
using simd::vf;

// Keys scored together before one online-softmax update (a multiple of every vector width).
constexpr int64_t kKeyChunk = 64;
// Target rows (query tokens x heads of one kv group) per work item; K/V rows are shared by them.
constexpr int64_t kRowsPerItem = 64;
// From this many rows on, K chunks are transposed once and scored as a small GEMM; below it
// (decode), each row takes dot products straight from the pool.
constexpr int64_t kGemmRows = 16;
// Register blocking: rows per micro-tile, vectors per micro-tile (16 or 8 accumulators).
constexpr int kTileRows = 4;
constexpr int kTileVecs = kWidth >= 16 ? 4 : 2;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Enough work items for a thread pool to balance, before kv heads are split across items.
constexpr int64_t kMinItems = 32;

// Per-thread scratch, reused across calls so the hot path does not allocate.
// Per-head state is indexed [head in item][row ...].
struct Scratch {
  std::vector<float> q;        // [heads, rows, head_dim] scaled queries
  std::vector<float> out;      // [heads, rows, padded head_dim] unnormalised outputs
  std::vector<float> row_max;  // [heads, rows]
  std::vector<float> row_sum;  // [heads, rows]
  std::vector<float> scores;   // [rows, kKeyChunk] scores, then probabilities (one head at a time)
  std::vector<float> k_t;      // [head_dim, kKeyChunk] transposed key chunk (GEMM path)
  std::vector<float> v_pad;    // [kKeyChunk, padded head_dim] value chunk when head_dim % kWidth != 0
  std::vector<float> zeros;    // [head_dim] stands in for missing keys of a short chunk
  std::vector<int64_t> slots;  // [kKeyChunk] pool slot of each key of the chunk
  std::vector<const float*> k_rows, v_rows;  // [kKeyChunk] this head's pool rows of the chunk's keys
};

Scratch& thread_scratch() {
  thread_local Scratch scratch;
  return scratch;
}

inline float dot(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  int64_t d = 0;
  float tail = 0.0f;
  if (n >= kWidth) {
    vf acc = simd::load(a) * simd::load(b);
    for (d = kWidth; d + kWidth <= n; d += kWidth) acc += simd::load(a + d) * simd::load(b + d);
    tail = simd::reduce_add(acc);
  }
  for (; d < n; ++d) tail += a[d] * b[d];
  return tail;
}

// scores[r][c..c+kTileVecs*kWidth) = q[r] . k_t[:, c..] for RB rows (GEMM path).
template <int RB>
void qk_tile(const float* __restrict__ q, int64_t head_dim, const float* __restrict__ k_t,
             float* __restrict__ scores) {
  for (int64_t c = 0; c < kKeyChunk; c += kTileVecs * kWidth) {
    vf acc[RB][kTileVecs] = {};
    for (int64_t d = 0; d < head_dim; ++d) {
      vf k[kTileVecs];
      for (int v = 0; v < kTileVecs; ++v) k[v] = simd::load(k_t + d * kKeyChunk + c + v * kWidth);
      for (int r = 0; r < RB; ++r) {
        const float qd = q[r * head_dim + d];
        for (int v = 0; v < kTileVecs; ++v) acc[r][v] += qd * k[v];
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int v = 0; v < kTileVecs; ++v) simd::store(scores + r * kKeyChunk + c + v * kWidth, acc[r][v]);
  }
}

// out[r][col..col+NV*kWidth) += sum_j probs[r][j] * v_rows[j][col..] for RB rows.
template <int RB, int NV>
void pv_tile(const float* __restrict__ probs, const float* const* v_rows, int64_t keys, int64_t col,
             float* __restrict__ out, int64_t out_stride) {
  vf acc[RB][NV] = {};
  for (int64_t j = 0; j < keys; ++j) {
    vf v[NV];
    for (int i = 0; i < NV; ++i) v[i] = simd::load(v_rows[j] + col + i * kWidth);
    for (int r = 0; r < RB; ++r) {
      const float p = probs[r * kKeyChunk + j];
      for (int i = 0; i < NV; ++i) acc[r][i] += p * v[i];
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < NV; ++i) {
      float* o = out + r * out_stride + col + i * kWidth;
      simd::store(o, simd::load(o) + acc[r][i]);
    }
}

template <int RB>
void pv_rows(const float* probs, const float* const* v_rows, int64_t keys, int64_t padded_dim, float* out,
             int64_t out_stride) {
  int64_t col = 0;
  for (; col + kTileVecs * kWidth <= padded_dim; col += kTileVecs * kWidth)
    pv_tile<RB, kTileVecs>(probs, v_rows, keys, col, out, out_stride);
  switch ((padded_dim - col) / kWidth) {
    case 0: break;
    case 1: pv_tile<RB, 1>(probs, v_rows, keys, col, out, out_stride); break;
    case 2: pv_tile<RB, 2>(probs, v_rows, keys, col, out, out_stride); break;
    default: pv_tile<RB, 3>(probs, v_rows, keys, col, out, out_stride); break;  // kTileVecs == 4 only
  }
}

}  // namespace

std::string validate_indices(const StepTensors& t) {
  std::ostringstream err;
  const int32_t* cu = t.cumulative_sequence_length;
  if (cu[0] != 0) {
    err << "cumulative_sequence_length[0] must be 0, got " << cu[0];
    return err.str();
  }
  for (int64_t b = 0; b < t.num_seqs; ++b) {
    if (cu[b + 1] < cu[b]) {
      err << "cumulative_sequence_length must be non-decreasing, but [" << b + 1 << "]=" << cu[b + 1]
          << " < [" << b << "]=" << cu[b];
      return err.str();
    }
  }
  if (cu[t.num_seqs] != t.num_tokens) {
    err << "cumulative_sequence_length[-1]=" << cu[t.num_seqs] << " must equal the number of query tokens "
        << t.num_tokens;
    return err.str();
  }
  for (int64_t b = 0; b < t.num_seqs; ++b) {
    const int64_t past = t.past_seqlens[b];
    if (past < 0) {
      err << "past_seqlens[" << b << "]=" << past << " is negative";
      return err.str();
    }
    const int64_t total = past + (cu[b + 1] - cu[b]);
    const int64_t blocks_needed = (total + t.block_size - 1) / t.block_size;
    if (blocks_needed > t.max_blocks) {
      err << "sequence " << b << " holds " << total << " tokens, which needs " << blocks_needed
          << " blocks of " << t.block_size << " but block_table has only " << t.max_blocks << " columns";
      return err.str();
    }
    const int32_t* row = t.block_table + b * t.max_blocks;
    for (int64_t i = 0; i < blocks_needed; ++i) {
      if (row[i] < 0 || row[i] >= t.num_blocks) {
        err << "block_table[" << b << "][" << i << "]=" << row[i] << " is outside the pool of " << t.num_blocks
            << " blocks";
        return err.str();
      }
    }
  }
  const int64_t num_slots = t.num_blocks * t.block_size;
  for (int64_t i = 0; i < t.num_tokens; ++i) {
    if (t.slot_mapping[i] >= num_slots) {
      err << "slot_mapping[" << i << "]=" << t.slot_mapping[i] << " is outside the pool of " << num_slots
          << " slots";
      return err.str();
    }
  }
  return std::string();
}

void write_new_kv(const StepTensors& t, const AttentionParams& p) {
  const int64_t row = p.kv_num_heads * t.head_dim;
  for (int64_t i = 0; i < t.num_tokens; ++i) {
    const int64_t slot = t.slot_mapping[i];
    if (slot < 0) continue;
    std::memcpy(t.key_cache + slot * row, t.key + i * row, sizeof(float) * row);
    std::memcpy(t.value_cache + slot * row, t.value + i * row, sizeof(float) * row);
  }
}

std::vector<WorkItem> plan_work(const StepTensors& t, const AttentionParams& p) {
  const int64_t group = p.num_heads / p.kv_num_heads;
  const int32_t tile = static_cast<int32_t>(std::max<int64_t>(1, kRowsPerItem / group));
  struct Tile {
    int32_t seq, begin, end;
    int64_t cost;  // query tokens x keys they see
  };
  std::vector<Tile> tiles;
  for (int64_t b = 0; b < t.num_seqs; ++b) {
    const int32_t begin = t.cumulative_sequence_length[b];
    const int32_t end = t.cumulative_sequence_length[b + 1];
    for (int32_t tile_begin = begin; tile_begin < end; tile_begin += tile) {
      const int32_t tile_end = std::min(end, tile_begin + tile);
      int64_t keys = t.past_seqlens[b] + (tile_end - begin);
      if (p.sliding_window > 0) keys = std::min<int64_t>(keys, p.sliding_window + (tile_end - tile_begin));
      tiles.push_back({static_cast<int32_t>(b), tile_begin, tile_end, keys * (tile_end - tile_begin)});
    }
  }
  // As many kv heads per item as still leaves kMinItems items (a divisor of kv_num_heads).
  int64_t heads_per_item = p.kv_num_heads;
  while (heads_per_item > 1 &&
         (p.kv_num_heads % heads_per_item != 0 ||
          static_cast<int64_t>(tiles.size()) * (p.kv_num_heads / heads_per_item) < kMinItems)) {
    --heads_per_item;
  }
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
  std::vector<WorkItem> items;
  items.reserve(tiles.size() * (p.kv_num_heads / heads_per_item));
  for (const Tile& tl : tiles) {
    for (int64_t g = 0; g < p.kv_num_heads; g += heads_per_item) {
      items.push_back({tl.seq, tl.begin, tl.end, static_cast<int32_t>(g), static_cast<int32_t>(g + heads_per_item)});
    }
  }
  return items;
}

namespace {

// Scores [rows, kKeyChunk] of one kv head's rows against the chunk's keys (columns >= keys: junk).
void score_chunk(Scratch& s, int64_t rows, int64_t head_dim, int64_t keys, const float* q, float* scores) {
  const int64_t D = head_dim;
  if (rows >= kGemmRows) {
    for (int64_t j = 0; j < keys; ++j)
      for (int64_t d = 0; d < D; ++d) s.k_t[d * kKeyChunk + j] = s.k_rows[j][d];
    for (int64_t j = keys; j < kKeyChunk; ++j)  // stale columns of a short last chunk
      for (int64_t d = 0; d < D; ++d) s.k_t[d * kKeyChunk + j] = 0.0f;
    int64_t m = 0;
    for (; m + kTileRows <= rows; m += kTileRows) qk_tile<kTileRows>(q + m * D, D, s.k_t.data(), scores + m * kKeyChunk);
    for (; m < rows; ++m) qk_tile<1>(q + m * D, D, s.k_t.data(), scores + m * kKeyChunk);
  } else if (D % kWidth == 0) {
    // kWidth keys at a time: kWidth vector dot products, reduced together by one shuffle tree.
    for (int64_t j0 = 0; j0 < keys; j0 += kWidth) {
      const float* k[kWidth];
      for (int l = 0; l < kWidth; ++l) k[l] = j0 + l < keys ? s.k_rows[j0 + l] : s.zeros.data();
      for (int64_t m = 0; m < rows; ++m) {
        const float* qm = q + m * D;
        vf acc[kWidth];
        const vf q0 = simd::load(qm);
        for (int l = 0; l < kWidth; ++l) acc[l] = q0 * simd::load(k[l]);
        for (int64_t d = kWidth; d < D; d += kWidth) {  // kWidth independent FMA chains
          const vf qd = simd::load(qm + d);
          for (int l = 0; l < kWidth; ++l) acc[l] += qd * simd::load(k[l] + d);
        }
        simd::store(scores + m * kKeyChunk + j0, simd::reduce_lanes<kWidth>(acc));
      }
    }
  } else {
    for (int64_t j = 0; j < keys; ++j)
      for (int64_t m = 0; m < rows; ++m) scores[m * kKeyChunk + j] = dot(q + m * D, s.k_rows[j], D);
  }
}

}  // namespace

void run_work_item(const StepTensors& t, const AttentionParams& p, const WorkItem& item) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t D = t.head_dim;
  const int64_t padded_dim = round_up(D, kWidth);
  const int64_t group = p.num_heads / p.kv_num_heads;
  const int64_t num_q = item.token_end - item.token_begin;
  const int64_t rows = num_q * group;  // row = token * group + r
  const int64_t heads = item.kv_head_end - item.kv_head_begin;
  const bool direct_v = D % kWidth == 0;  // value rows read straight from the pool
  const int64_t seq_begin = t.cumulative_sequence_length[item.seq];
  const int64_t past = t.past_seqlens[item.seq];
  const int64_t window = p.sliding_window;
  const int32_t* table = t.block_table + item.seq * t.max_blocks;
  const int64_t kv_row = p.kv_num_heads * D;
  const int64_t q_stride = p.num_heads * D;

  Scratch& s = thread_scratch();
  s.q.resize(heads * rows * D);
  s.out.assign(heads * rows * padded_dim, 0.0f);
  s.row_max.assign(heads * rows, kNegInf);
  s.row_sum.assign(heads * rows, 0.0f);
  s.scores.resize(rows * kKeyChunk);
  s.slots.resize(kKeyChunk);
  s.k_rows.resize(kKeyChunk);
  s.v_rows.resize(kKeyChunk);
  s.zeros.assign(D, 0.0f);
  if (rows >= kGemmRows) s.k_t.resize(D * kKeyChunk);
  if (!direct_v) s.v_pad.assign(kKeyChunk * padded_dim, 0.0f);

  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < num_q; ++i) {
      const float* src = t.query + (item.token_begin + i) * q_stride + (item.kv_head_begin + h) * group * D;
      float* dst = s.q.data() + (h * rows + i * group) * D;
      const float scale = p.scale;
#pragma omp simd
      for (int64_t d = 0; d < group * D; ++d) dst[d] = src[d] * scale;
    }
  }

  // Absolute positions of the item's first and last query tokens, and the keys any of them sees.
  const int64_t pos_first = past + (item.token_begin - seq_begin);
  const int64_t pos_last = past + (item.token_end - 1 - seq_begin);
  const int64_t key_lo = window > 0 ? std::max<int64_t>(0, pos_first - window + 1) : 0;
  const int64_t key_hi = pos_last + 1;  // exclusive

  for (int64_t c0 = key_lo; c0 < key_hi; c0 += kKeyChunk) {
    const int64_t keys = std::min(key_hi - c0, kKeyChunk);
    for (int64_t j = 0; j < keys; ++j) {
      const int64_t pos = c0 + j;
      s.slots[j] = static_cast<int64_t>(table[pos / t.block_size]) * t.block_size + pos % t.block_size;
    }
    // Ask for the next chunk's pool rows (all heads of the item) while this one is computed.
    const int64_t next_hi = std::min(key_hi, c0 + 2 * kKeyChunk);
    const int64_t span = heads * D;
    for (int64_t pos = c0 + kKeyChunk; pos < next_hi; ++pos) {
      const int64_t slot = static_cast<int64_t>(table[pos / t.block_size]) * t.block_size + pos % t.block_size;
      const float* k = t.key_cache + slot * kv_row + item.kv_head_begin * D;
      const float* v = t.value_cache + slot * kv_row + item.kv_head_begin * D;
      for (int64_t d = 0; d < span; d += 16) {
        __builtin_prefetch(k + d, 0, 2);
        __builtin_prefetch(v + d, 0, 2);
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t head_offset = (item.kv_head_begin + h) * D;
      for (int64_t j = 0; j < keys; ++j) {
        s.k_rows[j] = t.key_cache + s.slots[j] * kv_row + head_offset;
        s.v_rows[j] = t.value_cache + s.slots[j] * kv_row + head_offset;
      }
      float* const scores = s.scores.data();
      float* const out = s.out.data() + h * rows * padded_dim;
      float* const row_max = s.row_max.data() + h * rows;
      float* const row_sum = s.row_sum.data() + h * rows;

      // 1. Raw scores [rows, keys].
      score_chunk(s, rows, D, keys, s.q.data() + h * rows * D, scores);

      // 2. Softcap, causal / window mask, online softmax: scores become probabilities.
      for (int64_t m = 0; m < rows; ++m) {
        float* row = scores + m * kKeyChunk;
        const int64_t pos = pos_first + m / group;
        // Visible keys of this row within the chunk: [lo, hi).
        const int64_t lo = std::clamp<int64_t>((window > 0 ? pos - window + 1 : 0) - c0, 0, keys);
        const int64_t hi = std::clamp<int64_t>(pos + 1 - c0, 0, keys);
        if (lo >= hi) {
          std::fill(row, row + kKeyChunk, 0.0f);
          continue;
        }
        if (p.softcap > 0.0f)
          for (int64_t c = 0; c < kKeyChunk; c += kWidth) simd::store(row + c, simd::softcap(simd::load(row + c), p.softcap));
        std::fill(row, row + lo, kNegInf);
        std::fill(row + hi, row + kKeyChunk, kNegInf);
        vf vmax = simd::splat(kNegInf);
        for (int64_t c = 0; c < kKeyChunk; c += kWidth) vmax = simd::max(vmax, simd::load(row + c));
        const float old_max = row_max[m];
        const float new_max = std::max(old_max, simd::reduce_max(vmax));
        if (new_max > old_max && old_max != kNegInf) {
          const float alpha = std::exp(old_max - new_max);
          row_sum[m] *= alpha;
          float* o = out + m * padded_dim;
          for (int64_t d = 0; d < padded_dim; d += kWidth) simd::store(o + d, simd::load(o + d) * alpha);
        }
        row_max[m] = new_max;
        vf sum = simd::splat(0.0f);
        for (int64_t c = 0; c < kKeyChunk; c += kWidth) {
          const vf prob = simd::exp(simd::load(row + c) - new_max);
          simd::store(row + c, prob);
          sum += prob;
        }
        row_sum[m] += simd::reduce_add(sum);
      }

      // 3. out += probabilities x values.
      if (!direct_v) {
        for (int64_t j = 0; j < keys; ++j) {
          std::memcpy(s.v_pad.data() + j * padded_dim, s.v_rows[j], sizeof(float) * D);
          s.v_rows[j] = s.v_pad.data() + j * padded_dim;
        }
      }
      const float* const* v_rows = s.v_rows.data();
      int64_t m = 0;
      for (; m + kTileRows <= rows; m += kTileRows)
        pv_rows<kTileRows>(scores + m * kKeyChunk, v_rows, keys, padded_dim, out + m * padded_dim, padded_dim);
      for (; m < rows; ++m) pv_rows<1>(scores + m * kKeyChunk, v_rows, keys, padded_dim, out + m * padded_dim, padded_dim);
    }
  }

  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t m = 0; m < rows; ++m) {
      const int64_t i = m / group, r = m % group;
      float* dst = t.output + (item.token_begin + i) * q_stride + ((item.kv_head_begin + h) * group + r) * D;
      const float inv = 1.0f / s.row_sum[h * rows + m];
      const float* acc = s.out.data() + (h * rows + m) * padded_dim;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) dst[d] = acc[d] * inv;
    }
  }
}

}  // namespace octavo
