// octavo.PagedAttention bookkeeping: index checks, the paged KV write, and the work split.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <thread>

#include "half.h"
#include "kv_int8.h"
#include "paged_attention_kernel.h"

namespace octavo {
namespace {

// Target rows (query tokens x query heads of one kv group) per work item; they share K/V rows.
// The kernel works through them in passes of 64 rows per key chunk, so three passes share each
// chunk's K/V rows fetched once from L3 (64-row items: ~1.2x slower at contexts beyond L2).
constexpr int64_t kRowsPerItem = 192;
// Work items per hardware thread a thread pool needs to balance (it hands them out largest first)
// before kv heads are split across items. An item holding all of a sequence's kv heads reads each
// pool slot row whole; one item per kv head reads a third of every row (SmolLM2: 3 kv heads), and
// the other items fetch the rest again from DRAM: decode steps of 8-30 sequences of 300-500 keys,
// cache cold, ran 1.02-1.20x faster with whole rows than with the old fixed 32 items (2 threads;
// 1.06-1.12x on one). Results are the same bits either way: each head is computed on its own.
constexpr int64_t kItemsPerThread = 4;
constexpr int64_t kMinItemsFloor = 8;
// Key ranges of single-tile sequences (decode, short chunks) are split into parts of this many keys (a multiple
// of the kernel's key chunk), at fixed offsets from the first key: [lo, lo + 512), [lo + 512, lo + 1024), ... The
// parts a token sees are then the same whether it is decoded alone or with later tokens of its sequence (a
// speculative verification): those tokens only add parts it sees no key of, which combine_split skips, so its
// output keeps the bits of its one-token decode (parts sized by the key count moved their bounds with it).
// 512 rather than 256: as fast for one sequence of 700-4,096 keys (8 parts at 4,096 keep both threads busy) and
// no extra part for a decode batch at 257-511 keys (2-core AVX2 EPYC, float16 pools; 256 cost 2-4 % there).
constexpr int64_t kKeysPerPart = 512;

int64_t min_items() {
  static const int64_t n = std::max<int64_t>(kMinItemsFloor, kItemsPerThread * std::thread::hardware_concurrency());
  return n;
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
    if (t.kv_type == KvType::kInt8) {
      const int64_t head_bytes = kv_int8::row_bytes(t.head_dim), slot_bytes = p.kv_num_heads * head_bytes;
      for (int64_t h = 0; h < p.kv_num_heads; ++h) {
        kv_int8::quantize_row(t.key + i * row + h * t.head_dim, t.head_dim,
                              static_cast<uint8_t*>(t.key_cache) + slot * slot_bytes + h * head_bytes);
        kv_int8::quantize_row(t.value + i * row + h * t.head_dim, t.head_dim,
                              static_cast<uint8_t*>(t.value_cache) + slot * slot_bytes + h * head_bytes);
      }
    } else if (t.kv_type == KvType::kFloat16) {
      half::from_floats(t.key + i * row, static_cast<uint16_t*>(t.key_cache) + slot * row, row);
      half::from_floats(t.value + i * row, static_cast<uint16_t*>(t.value_cache) + slot * row, row);
    } else {
      std::memcpy(static_cast<float*>(t.key_cache) + slot * row, t.key + i * row, sizeof(float) * row);
      std::memcpy(static_cast<float*>(t.value_cache) + slot * row, t.value + i * row, sizeof(float) * row);
    }
  }
}

WorkPlan plan_work(const StepTensors& t, const AttentionParams& p) {
  const int64_t group = p.num_heads / p.kv_num_heads;
  const int32_t tile = static_cast<int32_t>(std::max<int64_t>(1, kRowsPerItem / group));
  struct Tile {
    int32_t seq, begin, end;
    int64_t key_lo, key_hi;  // keys any of its tokens sees
    int64_t cost;            // query tokens x keys
    int64_t parts;           // key-range parts (see below)
  };
  std::vector<Tile> tiles;
  for (int64_t b = 0; b < t.num_seqs; ++b) {
    const int32_t begin = t.cumulative_sequence_length[b];
    const int32_t end = t.cumulative_sequence_length[b + 1];
    const int64_t past = t.past_seqlens[b];
    for (int32_t tile_begin = begin; tile_begin < end; tile_begin += tile) {
      const int32_t tile_end = std::min(end, tile_begin + tile);
      const int64_t first = past + (tile_begin - begin);
      const int64_t key_hi = past + (tile_end - begin);
      const int64_t key_lo = p.sliding_window > 0 ? std::max<int64_t>(0, first - p.sliding_window + 1) : 0;
      // A sequence with one tile (decode, a short chunk) but a long context has too little work
      // per item for a thread pool: its keys are split into parts, combined afterwards. The split
      // depends only on the sequence itself, never on the rest of the batch, so a sequence's
      // result is bit-identical whatever batch it runs in.
      const bool single_tile = tile_begin == begin && tile_end == end;
      const int64_t parts = single_tile ? std::max<int64_t>(1, (key_hi - key_lo + kKeysPerPart - 1) / kKeysPerPart)
                                        : 1;
      tiles.push_back({static_cast<int32_t>(b), tile_begin, tile_end, key_lo, key_hi,
                       (key_hi - key_lo) * (tile_end - tile_begin), parts});
    }
  }
  // As many kv heads per item as still leaves min_items() items, key parts counted (a divisor of
  // kv_num_heads). Which heads share an item never changes a result.
  int64_t units = 0;
  for (const Tile& tl : tiles) units += tl.parts;
  int64_t heads_per_item = p.kv_num_heads;
  while (heads_per_item > 1 &&
         (p.kv_num_heads % heads_per_item != 0 || units * (p.kv_num_heads / heads_per_item) < min_items())) {
    --heads_per_item;
  }

  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
  WorkPlan plan;
  for (const Tile& tl : tiles) {
    const int64_t parts = tl.parts;
    for (int64_t g = 0; g < p.kv_num_heads; g += heads_per_item) {
      const WorkItem whole{tl.seq, tl.begin, tl.end, static_cast<int32_t>(g), static_cast<int32_t>(g + heads_per_item),
                           0, std::numeric_limits<int64_t>::max(), -1};
      if (parts == 1) {
        plan.items.push_back(whole);
        continue;
      }
      SplitGroup split{whole, static_cast<int32_t>(plan.num_partials), 0};
      for (int64_t k = tl.key_lo; k < tl.key_hi; k += kKeysPerPart) {
        WorkItem part = whole;
        part.key_begin = k;
        part.key_end = std::min(tl.key_hi, k + kKeysPerPart);
        part.partial = static_cast<int32_t>(plan.num_partials++);
        plan.items.push_back(part);
        ++split.parts;
      }
      plan.partial_rows = std::max<int64_t>(plan.partial_rows, heads_per_item * (tl.end - tl.begin) * group);
      plan.splits.push_back(split);
    }
  }
  return plan;
}

void combine_split(const StepTensors& t, const AttentionParams& p, const SplitGroup& split,
                   const PartialResults& partials) {
  const WorkItem& item = split.whole;
  const int64_t D = t.head_dim;
  const int64_t group = p.num_heads / p.kv_num_heads;
  const int64_t rows = (item.token_end - item.token_begin) * group;
  const int64_t heads = item.kv_head_end - item.kv_head_begin;
  const int64_t q_stride = p.num_heads * D;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t m = 0; m < rows; ++m) {
      const int64_t r = h * rows + m;
      float top = -std::numeric_limits<float>::infinity();
      for (int32_t i = 0; i < split.parts; ++i) top = std::max(top, partials.max[(split.first_partial + i) * partials.row_stride + r]);
      float* dst = t.output + (item.token_begin + m / group) * q_stride + ((item.kv_head_begin + h) * group + m % group) * D;
      std::fill(dst, dst + D, 0.0f);
      float total = 0.0f;
      for (int32_t i = 0; i < split.parts; ++i) {
        const int64_t slot = split.first_partial + i;
        const float part_max = partials.max[slot * partials.row_stride + r];
        if (part_max == -std::numeric_limits<float>::infinity()) continue;  // saw no key of this part
        const float weight = std::exp(part_max - top);
        total += weight * partials.sum[slot * partials.row_stride + r];
        const float* src = partials.out + slot * partials.out_stride + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[d] += weight * src[d];
      }
      const float inv = 1.0f / total;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) dst[d] *= inv;
    }
  }
}

}  // namespace octavo
