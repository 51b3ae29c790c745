// octavo.PagedAttention bookkeeping: index checks, the paged KV write, and the work split.
#include <algorithm>
#include <cstring>
#include <sstream>

#include "paged_attention_kernel.h"

namespace octavo {
namespace {

// Target rows (query tokens x query heads of one kv group) per work item; they share K/V rows.
constexpr int64_t kRowsPerItem = 64;
// Enough work items for a thread pool to balance, before kv heads are split across items.
constexpr int64_t kMinItems = 32;

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

}  // namespace octavo
