// octavo.PagedAttention math: paged KV writes, then flash-style (online softmax) causal attention.
#include "paged_attention_kernel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

namespace octavo {
namespace {

constexpr int64_t kKeyChunk = 64;      // keys scored together before one softmax rescale
constexpr int64_t kTokenTile = 16;     // query tokens of one sequence per work item (prefill)

inline float dot(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < n; ++d) acc += a[d] * b[d];
  return acc;
}

inline void scale_in_place(float* __restrict__ x, float s, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) x[d] *= s;
}

inline void axpy(float* __restrict__ y, float a, const float* __restrict__ x, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) y[d] += a * x[d];
}

// Per-thread scratch, reused across calls so the hot path does not allocate.
struct Scratch {
  std::vector<float> q;       // [rows, head_dim] scaled queries
  std::vector<float> acc;     // [rows, head_dim] unnormalised outputs
  std::vector<float> row_max; // [rows]
  std::vector<float> row_sum; // [rows]
  std::vector<float> scores;  // [kKeyChunk]
  std::vector<const float*> k_rows, v_rows;  // [kKeyChunk]
};

Scratch& thread_scratch() {
  thread_local Scratch scratch;
  return scratch;
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
  std::vector<WorkItem> items;
  for (int64_t b = 0; b < t.num_seqs; ++b) {
    const int32_t begin = t.cumulative_sequence_length[b];
    const int32_t end = t.cumulative_sequence_length[b + 1];
    // Later tiles see more keys: emit them first so the pool's tail is made of small items.
    for (int32_t tile_end = end; tile_end > begin;) {
      const int32_t tile_begin = std::max<int32_t>(begin, tile_end - static_cast<int32_t>(kTokenTile));
      for (int32_t g = 0; g < p.kv_num_heads; ++g) items.push_back({static_cast<int32_t>(b), g, tile_begin, tile_end});
      tile_end = tile_begin;
    }
  }
  return items;
}

void run_work_item(const StepTensors& t, const AttentionParams& p, const WorkItem& item) {
  const int64_t D = t.head_dim;
  const int64_t group = p.num_heads / p.kv_num_heads;
  const int64_t num_q = item.token_end - item.token_begin;
  const int64_t rows = num_q * group;  // row = token * group + r
  const int64_t seq_begin = t.cumulative_sequence_length[item.seq];
  const int64_t past = t.past_seqlens[item.seq];
  const int64_t window = p.sliding_window;
  const bool capped = p.softcap > 0.0f;
  const float inv_cap = capped ? 1.0f / p.softcap : 0.0f;
  const int32_t* table = t.block_table + item.seq * t.max_blocks;
  const int64_t kv_row = p.kv_num_heads * D;
  const int64_t head_offset = item.kv_head * D;

  Scratch& s = thread_scratch();
  s.q.resize(rows * D);
  s.acc.assign(rows * D, 0.0f);
  s.row_max.assign(rows, -std::numeric_limits<float>::infinity());
  s.row_sum.assign(rows, 0.0f);
  s.scores.resize(kKeyChunk);
  s.k_rows.resize(kKeyChunk);
  s.v_rows.resize(kKeyChunk);

  const int64_t q_stride = p.num_heads * D;
  for (int64_t i = 0; i < num_q; ++i) {
    const float* src = t.query + (item.token_begin + i) * q_stride + item.kv_head * group * D;
    for (int64_t r = 0; r < group; ++r) {
      float* dst = s.q.data() + (i * group + r) * D;
      const float* q = src + r * D;
      const float scale = p.scale;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) dst[d] = q[d] * scale;
    }
  }

  // Absolute positions of the tile's first and last query tokens.
  const int64_t pos_first = past + (item.token_begin - seq_begin);
  const int64_t pos_last = past + (item.token_end - 1 - seq_begin);
  const int64_t key_lo = window > 0 ? std::max<int64_t>(0, pos_first - window + 1) : 0;
  const int64_t key_hi = pos_last + 1;  // exclusive

  for (int64_t c0 = key_lo; c0 < key_hi; c0 += kKeyChunk) {
    const int64_t c1 = std::min(key_hi, c0 + kKeyChunk);
    for (int64_t j = c0; j < c1; ++j) {
      const int64_t slot = static_cast<int64_t>(table[j / t.block_size]) * t.block_size + j % t.block_size;
      s.k_rows[j - c0] = t.key_cache + slot * kv_row + head_offset;
      s.v_rows[j - c0] = t.value_cache + slot * kv_row + head_offset;
    }
    for (int64_t i = 0; i < num_q; ++i) {
      const int64_t pos = pos_first + i;
      const int64_t lo = std::max(c0, window > 0 ? pos - window + 1 : int64_t{0});
      const int64_t hi = std::min(c1, pos + 1);
      if (lo >= hi) continue;
      for (int64_t r = 0; r < group; ++r) {
        const int64_t m = i * group + r;
        const float* q = s.q.data() + m * D;
        float* sc = s.scores.data();
        float chunk_max = -std::numeric_limits<float>::infinity();
        for (int64_t j = lo; j < hi; ++j) {
          float x = dot(q, s.k_rows[j - c0], D);
          if (capped) x = p.softcap * std::tanh(x * inv_cap);
          sc[j - lo] = x;
          chunk_max = std::max(chunk_max, x);
        }
        const float old_max = s.row_max[m];
        const float new_max = std::max(old_max, chunk_max);
        float* acc = s.acc.data() + m * D;
        if (new_max > old_max && old_max != -std::numeric_limits<float>::infinity()) {
          const float alpha = std::exp(old_max - new_max);
          s.row_sum[m] *= alpha;
          scale_in_place(acc, alpha, D);
        }
        s.row_max[m] = new_max;
        float sum = 0.0f;
        for (int64_t j = lo; j < hi; ++j) {
          const float w = std::exp(sc[j - lo] - new_max);
          sum += w;
          axpy(acc, w, s.v_rows[j - c0], D);
        }
        s.row_sum[m] += sum;
      }
    }
  }

  for (int64_t i = 0; i < num_q; ++i) {
    float* dst = t.output + (item.token_begin + i) * q_stride + item.kv_head * group * D;
    for (int64_t r = 0; r < group; ++r) {
      const int64_t m = i * group + r;
      const float inv = 1.0f / s.row_sum[m];
      const float* acc = s.acc.data() + m * D;
      float* out = dst + r * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) out[d] = acc[d] * inv;
    }
  }
}

}  // namespace octavo
