// octavo.PagedAttention — the attention math, independent of ONNX Runtime.
//
// Layout (row-major; activations float32, pools float32, float16 or int8):
//   query  [T, num_heads * head_dim]        key/value [T, kv_num_heads * head_dim]
//   pools  [num_blocks, block_size, kv_num_heads, head_dim]  (slot s = block * block_size + offset);
//          int8 pools [num_blocks, block_size, kv_num_heads, head_dim + 2]: each head row's codes, then its scale
//          (kv_int8.h)
//   cumulative_sequence_length int32 [B+1], past_seqlens int32 [B],
//   block_table int32 [B, max_blocks], slot_mapping int64 [T]
// Token i of sequence b has absolute position past_seqlens[b] + i and attends causally over
// positions 0..itself (limited to the last `sliding_window` positions when that is > 0).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace octavo {

struct AttentionParams {
  int64_t num_heads = 0;
  int64_t kv_num_heads = 0;
  float scale = 1.0f;
  int64_t sliding_window = 0;  // 0: unlimited
  float softcap = 0.0f;        // 0: none; else scores = softcap * tanh(scores / softcap)
  // A prompt's items (>= 16 rows, head_dim a multiple of 32) may take the bfloat16 path where AMX runs
  // (amx.h): queries, keys, values and probabilities rounded to bfloat16, products summed in float32 by AMX
  // tiles; the softmax stays float32. Elsewhere, and for decode items, float32 as without it.
  bool prompt_bf16 = false;
};

// Element type of the KV pools. float16 pools hold IEEE binary16 bits: new K/V are rounded to
// nearest even on write and widened to float32 on read; int8 pools hold each head row quantized with its own
// scale (kv_int8.h), dequantized to float32 on read. All arithmetic stays float32.
enum class KvType { kFloat32, kFloat16, kInt8 };

// Bytes of one (slot, kv head) row of HEAD_DIM values in a pool of TYPE.
inline int64_t kv_head_bytes(KvType type, int64_t head_dim) {
  switch (type) {
    case KvType::kFloat16: return 2 * head_dim;
    case KvType::kInt8: return head_dim + 2;
    default: return 4 * head_dim;
  }
}

// Borrowed pointers to one call's tensors plus their sizes.
struct StepTensors {
  const float* query = nullptr;
  const float* key = nullptr;
  const float* value = nullptr;
  void* key_cache = nullptr;    // float* (kFloat32), uint16_t* (kFloat16) or uint8_t* rows (kInt8)
  void* value_cache = nullptr;
  KvType kv_type = KvType::kFloat32;
  const int32_t* cumulative_sequence_length = nullptr;
  const int32_t* past_seqlens = nullptr;
  const int32_t* block_table = nullptr;
  const int64_t* slot_mapping = nullptr;
  float* output = nullptr;

  int64_t num_tokens = 0;
  int64_t num_seqs = 0;
  int64_t head_dim = 0;
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int64_t max_blocks = 0;
};

// One unit of parallel work: query tokens [token_begin, token_end) (packed indices, all in
// sequence `seq`) against kv heads [kv_head_begin, kv_head_end), each with all the query heads of
// its group, over the keys at positions [key_begin, key_end) (clipped to what each token sees).
// Several kv heads per item let one pass over a chunk of pool rows serve all of them.
// An item with partial >= 0 covers one part of a split key range: instead of the output it writes
// its unnormalised result, row maxima and row sums to that slot of PartialResults.
struct WorkItem {
  int32_t seq;
  int32_t token_begin;
  int32_t token_end;
  int32_t kv_head_begin;
  int32_t kv_head_end;
  int64_t key_begin;
  int64_t key_end;
  int32_t partial;  // -1: writes the final output rows
};

// Items that together cover one (tokens, kv heads) pair whose keys were split; combined afterwards.
struct SplitGroup {
  WorkItem whole;         // the unsplit item (keys: everything)
  int32_t first_partial;  // its parts use partial slots [first_partial, first_partial + parts)
  int32_t parts;
};

// Memory for the parts of split items; slot i: out at out + i * out_stride ([heads][rows][head_dim]),
// max/sum at max/sum + i * row_stride ([heads][rows]).
struct PartialResults {
  float* out = nullptr;
  float* max = nullptr;
  float* sum = nullptr;
  int64_t out_stride = 0;
  int64_t row_stride = 0;
};

struct WorkPlan {
  std::vector<WorkItem> items;    // most expensive first (for a dynamic thread pool)
  std::vector<SplitGroup> splits;  // run after all items
  int64_t num_partials = 0;
  int64_t partial_rows = 0;  // heads x rows, the most any split item has
};

// Checks the index tensors against each other and the pool; returns "" when consistent, else a
// message naming the first problem. Reads only; must pass before anything is written.
std::string validate_indices(const StepTensors& t);

// Copies the new tokens' K/V rows into the pools at slot_mapping (negative slots are skipped),
// rounded to fp16 for float16 pools, quantized per head row for int8 pools.
void write_new_kv(const StepTensors& t, const AttentionParams& p);

// Splits the step into independent work items. When there are too few (small batches, long
// contexts) the key ranges are split too ("flash decoding") and the parts combined afterwards.
WorkPlan plan_work(const StepTensors& t, const AttentionParams& p);

// Computes one work item (reads the pools; writes only its output rows or its partial slot).
// NEXT (or null): the item this thread will likely take next; a decode item asks for its first keys while it ends.
void run_work_item(const StepTensors& t, const AttentionParams& p, const WorkItem& item, const PartialResults& partials,
                   const WorkItem* next = nullptr);

// Merges the parts of one split group into its output rows.
void combine_split(const StepTensors& t, const AttentionParams& p, const SplitGroup& group,
                   const PartialResults& partials);

}  // namespace octavo
