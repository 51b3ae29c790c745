// ONNX Runtime glue for octavo.PagedAttention: the OrtCustomOp schema (with the pool inputs aliased
// to the pool outputs, so the caller's KV pool is written in place and never copied), input checks
// that turn bad shapes into an ORT error status, and the thread-pool fan-out of the work items.
// The op is registered three times under the same name, with float32, float16 and int8 pools (key_cache,
// value_cache and their aliased outputs); ORT merges them into one schema whose pool type is a constraint and
// picks the kernel by the graph's pool type. int8 pools carry a 2-byte scale after each head row, so their
// last dimension is head_dim + 2 (kv_int8.h); head_dim is then the pool's last dimension minus 2.
// Optional inputs 9-11 (position_ids int64 [T], cos_cache and sin_cache float32 [P, head_dim / 2]): the rotary
// embedding of query and key in rotate-half form, applied here before anything reads them (the ONNX Runtime
// backend's rewrite, octavo/runtime/backends/ort_fusions.py, moves the graph's RotaryEmbedding nodes into this
// op: six nodes a layer fewer per step). The exported graph and the TensorRT path never use them.
// Uses only the C API (no link against libonnxruntime): the OrtApi comes from RegisterCustomOps.
#include <onnxruntime_c_api.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "block_gather_op.h"
#include "block_matmul_op.h"
#include "int8_residual_op.h"
#include "moe_op.h"
#include "op_glue.h"
#include "paged_attention_kernel.h"

static_assert(ORT_API_VERSION >= 20,
              "ONNX Runtime headers >= 1.20 are needed (OrtCustomOp::GetAliasMap); point ORT_INCLUDE_DIR at newer ones");

namespace {

constexpr const char* kDomain = "octavo";
constexpr const char* kOpName = "PagedAttention";
constexpr const char* kPrefix = "octavo.PagedAttention: ";

enum Input : size_t {
  kQuery, kKey, kValue, kKeyCache, kValueCache, kCuSeqlens, kPastSeqlens, kBlockTable, kSlotMapping, kNumInputs,
  kPositionIds = kNumInputs, kCosCache, kSinCache, kNumAllInputs  // optional, all three or none
};
enum Output : size_t { kOutput, kKeyCacheOut, kValueCacheOut, kNumOutputs };

const char* const kInputNames[kNumAllInputs] = {"query", "key", "value", "key_cache", "value_cache",
                                                "cumulative_sequence_length", "past_seqlens", "block_table",
                                                "slot_mapping", "position_ids", "cos_cache", "sin_cache"};

ONNXTensorElementDataType pool_type(octavo::KvType kv_type) {
  switch (kv_type) {
    case octavo::KvType::kFloat16: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    case octavo::KvType::kInt8: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
    default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
}

ONNXTensorElementDataType input_type(size_t index, octavo::KvType kv_type) {
  switch (index) {
    case kCuSeqlens:
    case kPastSeqlens:
    case kBlockTable:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    case kSlotMapping:
    case kPositionIds:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    case kKeyCache:
    case kValueCache:
      return pool_type(kv_type);
    default:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
}

ONNXTensorElementDataType output_type(size_t index, octavo::KvType kv_type) {
  return index == kOutput ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : pool_type(kv_type);
}

using octavo::glue::check;
using octavo::glue::data_of;
using octavo::glue::describe;
using octavo::glue::fail;
using octavo::glue::parallel_for;
using octavo::glue::shape_string;
using octavo::glue::TensorInfo;
using octavo::glue::Failure;

void expect_rank(const TensorInfo& info, size_t index, size_t rank) {
  if (info.dims.size() != rank) {
    fail(std::string(kInputNames[index]) + " must have rank " + std::to_string(rank) + ", got shape " +
         shape_string(info.dims));
  }
}

void expect_dim(const TensorInfo& info, size_t index, size_t axis, int64_t expected, const char* why) {
  if (info.dims[axis] != expected) {
    fail(std::string(kInputNames[index]) + " has shape " + shape_string(info.dims) + " but dimension " +
         std::to_string(axis) + " must be " + std::to_string(expected) + " (" + why + ")");
  }
}

// x [tokens, heads * D] rotated into out (same shape): per head, for i < D / 2, with c, s = cos, sin[pos][i]:
// out[i] = x[i] c + (-x[i + D/2]) s, out[i + D/2] = x[i + D/2] c + x[i] s -- the exported graph's rotate-half
// arithmetic (two products, one sum; not contracted into FMAs).
__attribute__((optimize("fp-contract=off"))) void rotate(const float* x, int64_t tokens, int64_t heads, int64_t D,
                                                          const int64_t* positions, const float* cos,
                                                          const float* sin, float* out) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    const float* c = cos + positions[t] * half;
    const float* s = sin + positions[t] * half;
    for (int64_t h = 0; h < heads; ++h) {
      const float* a = x + (t * heads + h) * D;
      float* o = out + (t * heads + h) * D;
      for (int64_t i = 0; i < half; ++i) {
        const float lo = a[i], hi = a[i + half];
        o[i] = lo * c[i] + -hi * s[i];
        o[i + half] = hi * c[i] + lo * s[i];
      }
    }
  }
}

// rotate() over ranges of kRotateTokens tokens, q and k, on the thread pool (a prompt's step: 2048 tokens x 12
// heads of SmolLM2 is 1.5 M elements a layer).
constexpr int64_t kRotateTokens = 64;
struct RotateJob {
  const float* q;
  const float* k;
  int64_t tokens, q_heads, kv_heads, head_dim;
  const int64_t* positions;
  const float* cos;
  const float* sin;
  float* q_out;
  float* k_out;
};

void rotate_range(void* user_data, size_t index) {
  const auto* job = static_cast<const RotateJob*>(user_data);
  const int64_t t0 = static_cast<int64_t>(index) * kRotateTokens, n = std::min(kRotateTokens, job->tokens - t0);
  const int64_t qr = job->q_heads * job->head_dim, kr = job->kv_heads * job->head_dim;
  rotate(job->q + t0 * qr, n, job->q_heads, job->head_dim, job->positions + t0, job->cos, job->sin, job->q_out + t0 * qr);
  rotate(job->k + t0 * kr, n, job->kv_heads, job->head_dim, job->positions + t0, job->cos, job->sin, job->k_out + t0 * kr);
}

struct ParallelJob {
  const octavo::StepTensors* tensors;
  const octavo::AttentionParams* params;
  const octavo::WorkPlan* plan;
  const octavo::PartialResults* partials;
};

void run_item(void* user_data, size_t index) {
  const auto* job = static_cast<const ParallelJob*>(user_data);
  const auto& items = job->plan->items;
  octavo::run_work_item(*job->tensors, *job->params, items[index], *job->partials,
                        index + 1 < items.size() ? &items[index + 1] : nullptr);
}

void run_combine(void* user_data, size_t index) {
  const auto* job = static_cast<const ParallelJob*>(user_data);
  octavo::combine_split(*job->tensors, *job->params, job->plan->splits[index], *job->partials);
}

struct PagedAttentionKernel {
  const OrtApi* api;
  octavo::AttentionParams params;
  octavo::KvType kv_type;

  void compute(OrtKernelContext* context) const {
    const OrtValue* inputs[kNumAllInputs] = {};
    TensorInfo infos[kNumAllInputs];
    const size_t input_count = read_inputs(context, inputs, infos);
    octavo::StepTensors t = step_tensors(inputs, infos);
    std::vector<float> rotated;  // the rotary inputs' query and key, rotated: [T, num_heads * D] then [T, kv * D]
    if (input_count == kNumAllInputs) rotate_inputs(context, inputs, infos, t, rotated);

    // Outputs. The pool outputs are declared aliases of the pool inputs, so ORT hands back the
    // input buffers; should it ever hand out fresh buffers, they receive a copy after the write.
    const int64_t out_dims[2] = {t.num_tokens, params.num_heads * t.head_dim};
    OrtValue* out = nullptr;
    check(api, api->KernelContext_GetOutput(context, kOutput, out_dims, 2, &out));
    OrtValue* key_out = nullptr;
    OrtValue* value_out = nullptr;
    const std::vector<int64_t>& pool_dims = infos[kKeyCache].dims;
    check(api, api->KernelContext_GetOutput(context, kKeyCacheOut, pool_dims.data(), pool_dims.size(), &key_out));
    check(api, api->KernelContext_GetOutput(context, kValueCacheOut, pool_dims.data(), pool_dims.size(), &value_out));
    t.output = data_of<float>(api, out);

    octavo::write_new_kv(t, params);
    if (t.num_tokens > 0) attend(context, t);

    const size_t pool_bytes = static_cast<size_t>(octavo::kv_head_bytes(kv_type, t.head_dim) * t.num_blocks *
                                                  t.block_size * params.kv_num_heads);
    void* key_out_data = data_of<void>(api, key_out);
    void* value_out_data = data_of<void>(api, value_out);
    if (key_out_data != t.key_cache && pool_bytes) std::memcpy(key_out_data, t.key_cache, pool_bytes);
    if (value_out_data != t.value_cache && pool_bytes) std::memcpy(value_out_data, t.value_cache, pool_bytes);
  }

  // The inputs (kNumInputs, or kNumAllInputs with the rotary ones) and their element types, checked; returns how
  // many there are.
  size_t read_inputs(OrtKernelContext* context, const OrtValue* (&inputs)[kNumAllInputs],
                     TensorInfo (&infos)[kNumAllInputs]) const {
    size_t input_count = 0;
    check(api, api->KernelContext_GetInputCount(context, &input_count));
    if (input_count != kNumInputs && input_count != kNumAllInputs) {
      fail("expects " + std::to_string(kNumInputs) + " inputs (or " + std::to_string(kNumAllInputs) +
           " with position_ids, cos_cache and sin_cache), got " + std::to_string(input_count));
    }
    for (size_t i = 0; i < input_count; ++i) {
      check(api, api->KernelContext_GetInput(context, i, &inputs[i]));
      if (inputs[i] == nullptr) fail(std::string("input ") + kInputNames[i] + " is missing");
      infos[i] = describe(api, inputs[i]);
      if (infos[i].type != input_type(i, kv_type)) {
        fail(std::string(kInputNames[i]) + " has element type " + std::to_string(infos[i].type) + ", expected " +
             std::to_string(input_type(i, kv_type)) + " (1=float32, 10=float16, 3=int8, 6=int32, 7=int64)");
      }
    }
    return input_count;
  }

  // The step's tensors (all but the output) from the required inputs, their shapes and indices checked.
  // Shapes: pools fix head_dim (int8 pools: their last dimension minus the scale's 2 bytes) and kv heads;
  // everything else must agree with them.
  octavo::StepTensors step_tensors(const OrtValue* const* inputs, const TensorInfo* infos) const {
    expect_rank(infos[kKeyCache], kKeyCache, 4);
    const int64_t num_blocks = infos[kKeyCache].dims[0];
    const int64_t block_size = infos[kKeyCache].dims[1];
    const int64_t head_dim = infos[kKeyCache].dims[3] - (kv_type == octavo::KvType::kInt8 ? 2 : 0);
    expect_dim(infos[kKeyCache], kKeyCache, 2, params.kv_num_heads, "kv_num_heads attribute");
    if (block_size <= 0 || head_dim <= 0) {
      fail("key_cache has an empty dimension: " + shape_string(infos[kKeyCache].dims) +
           (kv_type == octavo::KvType::kInt8 ? " (an int8 pool's last dimension is head_dim + 2: codes, then a float16 "
                                               "scale)" : ""));
    }
    if (infos[kValueCache].dims != infos[kKeyCache].dims) {
      fail("value_cache shape " + shape_string(infos[kValueCache].dims) + " differs from key_cache shape " +
           shape_string(infos[kKeyCache].dims));
    }
    expect_rank(infos[kQuery], kQuery, 2);
    const int64_t num_tokens = infos[kQuery].dims[0];
    expect_dim(infos[kQuery], kQuery, 1, params.num_heads * head_dim, "num_heads * head_dim");
    for (size_t i : {kKey, kValue}) {
      expect_rank(infos[i], i, 2);
      expect_dim(infos[i], i, 0, num_tokens, "tokens, as in query");
      expect_dim(infos[i], i, 1, params.kv_num_heads * head_dim, "kv_num_heads * head_dim");
    }
    expect_rank(infos[kCuSeqlens], kCuSeqlens, 1);
    const int64_t num_seqs = infos[kCuSeqlens].dims[0] - 1;
    if (num_seqs < 0) fail("cumulative_sequence_length must hold at least one element (B+1)");
    expect_rank(infos[kPastSeqlens], kPastSeqlens, 1);
    expect_dim(infos[kPastSeqlens], kPastSeqlens, 0, num_seqs, "B = len(cumulative_sequence_length) - 1");
    expect_rank(infos[kBlockTable], kBlockTable, 2);
    expect_dim(infos[kBlockTable], kBlockTable, 0, num_seqs, "B = len(cumulative_sequence_length) - 1");
    expect_rank(infos[kSlotMapping], kSlotMapping, 1);
    expect_dim(infos[kSlotMapping], kSlotMapping, 0, num_tokens, "tokens, as in query");

    octavo::StepTensors t;
    t.num_tokens = num_tokens;
    t.num_seqs = num_seqs;
    t.head_dim = head_dim;
    t.num_blocks = num_blocks;
    t.block_size = block_size;
    t.max_blocks = infos[kBlockTable].dims[1];
    t.query = data_of<const float>(api, inputs[kQuery]);
    t.key = data_of<const float>(api, inputs[kKey]);
    t.value = data_of<const float>(api, inputs[kValue]);
    t.key_cache = data_of<void>(api, inputs[kKeyCache]);
    t.value_cache = data_of<void>(api, inputs[kValueCache]);
    t.kv_type = kv_type;
    t.cumulative_sequence_length = data_of<const int32_t>(api, inputs[kCuSeqlens]);
    t.past_seqlens = data_of<const int32_t>(api, inputs[kPastSeqlens]);
    t.block_table = data_of<const int32_t>(api, inputs[kBlockTable]);
    t.slot_mapping = data_of<const int64_t>(api, inputs[kSlotMapping]);

    const std::string problem = octavo::validate_indices(t);
    if (!problem.empty()) fail(problem);
    return t;
  }

  // The rotary inputs (position_ids, cos_cache, sin_cache) checked, and T's query and key rotated into ROTATED on
  // the thread pool; T then reads them there.
  void rotate_inputs(OrtKernelContext* context, const OrtValue* const* inputs, const TensorInfo* infos,
                     octavo::StepTensors& t, std::vector<float>& rotated) const {
    const int64_t num_tokens = t.num_tokens, head_dim = t.head_dim;
    expect_rank(infos[kPositionIds], kPositionIds, 1);
    expect_dim(infos[kPositionIds], kPositionIds, 0, num_tokens, "tokens, as in query");
    if (head_dim % 2 != 0) fail("the rotary inputs need an even head_dim, got " + std::to_string(head_dim));
    expect_rank(infos[kCosCache], kCosCache, 2);
    expect_dim(infos[kCosCache], kCosCache, 1, head_dim / 2, "head_dim / 2");
    if (infos[kSinCache].dims != infos[kCosCache].dims) {
      fail("sin_cache shape " + shape_string(infos[kSinCache].dims) + " differs from cos_cache shape " +
           shape_string(infos[kCosCache].dims));
    }
    const int64_t table_rows = infos[kCosCache].dims[0];
    const int64_t* positions = data_of<const int64_t>(api, inputs[kPositionIds]);
    for (int64_t i = 0; i < num_tokens; ++i) {
      if (positions[i] < 0 || positions[i] >= table_rows) {
        fail("position_ids[" + std::to_string(i) + "] = " + std::to_string(positions[i]) +
             " is outside the rotary tables' " + std::to_string(table_rows) + " positions");
      }
    }
    const int64_t q_size = num_tokens * params.num_heads * head_dim;
    rotated.resize(static_cast<size_t>(q_size + num_tokens * params.kv_num_heads * head_dim));
    const float* cos = data_of<const float>(api, inputs[kCosCache]);
    const float* sin = data_of<const float>(api, inputs[kSinCache]);
    RotateJob job{t.query, t.key, num_tokens, params.num_heads, params.kv_num_heads, head_dim, positions,
                  cos, sin, rotated.data(), rotated.data() + q_size};
    parallel_for(api, context, rotate_range, static_cast<size_t>((num_tokens + kRotateTokens - 1) / kRotateTokens),
                 &job);
    t.query = rotated.data();
    t.key = rotated.data() + q_size;
  }

  // Attention for T's tokens (their K/V already in the pools): the work plan's items on the thread pool, then the
  // combination of the parts of split key ranges.
  void attend(OrtKernelContext* context, const octavo::StepTensors& t) const {
    const octavo::WorkPlan plan = octavo::plan_work(t, params);
    octavo::PartialResults partials;
    std::vector<float> partial_memory;
    if (plan.num_partials > 0) {
      partials.row_stride = plan.partial_rows;
      partials.out_stride = plan.partial_rows * t.head_dim;
      partial_memory.resize(static_cast<size_t>(plan.num_partials * (partials.out_stride + 2 * partials.row_stride)));
      partials.out = partial_memory.data();
      partials.max = partials.out + plan.num_partials * partials.out_stride;
      partials.sum = partials.max + plan.num_partials * partials.row_stride;
    }
    ParallelJob job{&t, &params, &plan, &partials};
    parallel_for(api, context, run_item, plan.items.size(), &job);
    parallel_for(api, context, run_combine, plan.splits.size(), &job);
  }
};

OrtStatus* to_status(const OrtApi* api, const Failure& e) {
  return api->CreateStatus(e.code, (std::string(kPrefix) + e.message).c_str());
}

bool read_int_attribute(const OrtApi* api, const OrtKernelInfo* info, const char* name, int64_t* out) {
  OrtStatus* status = api->KernelInfoGetAttribute_int64(info, name, out);
  if (status == nullptr) return true;
  api->ReleaseStatus(status);
  return false;
}

bool read_float_attribute(const OrtApi* api, const OrtKernelInfo* info, const char* name, float* out) {
  OrtStatus* status = api->KernelInfoGetAttribute_float(info, name, out);
  if (status == nullptr) return true;
  api->ReleaseStatus(status);
  return false;
}

octavo::AttentionParams read_params(const OrtApi* api, const OrtKernelInfo* info) {
  octavo::AttentionParams p;
  if (!read_int_attribute(api, info, "num_heads", &p.num_heads)) fail("attribute num_heads (int) is required");
  if (!read_int_attribute(api, info, "kv_num_heads", &p.kv_num_heads)) {
    fail("attribute kv_num_heads (int) is required");
  }
  if (!read_float_attribute(api, info, "scale", &p.scale)) fail("attribute scale (float) is required");
  read_int_attribute(api, info, "sliding_window", &p.sliding_window);
  read_float_attribute(api, info, "softcap", &p.softcap);
  if (p.num_heads <= 0 || p.kv_num_heads <= 0 || p.num_heads % p.kv_num_heads != 0) {
    fail("num_heads (" + std::to_string(p.num_heads) + ") must be a positive multiple of kv_num_heads (" +
         std::to_string(p.kv_num_heads) + ")");
  }
  if (p.sliding_window < 0) fail("sliding_window must be >= 0 (0 = no window)");
  if (p.softcap < 0.0f) fail("softcap must be >= 0 (0 = no softcap)");
  int64_t prompt_bf16 = 0;
  read_int_attribute(api, info, "prompt_bf16", &prompt_bf16);
  if (prompt_bf16 != 0 && prompt_bf16 != 1) fail("prompt_bf16 must be 0 or 1, got " + std::to_string(prompt_bf16));
  p.prompt_bf16 = prompt_bf16 == 1;
  return p;
}

// The custom-op schema for one pool type. All callbacks are plain functions (they find the pool type
// through the OrtCustomOp pointer they get); the struct itself is immutable.
struct PagedAttentionOp : OrtCustomOp {
  octavo::KvType kv_type;

  static octavo::KvType kv_type_of(const OrtCustomOp* op) { return static_cast<const PagedAttentionOp*>(op)->kv_type; }

  explicit PagedAttentionOp(octavo::KvType type) : OrtCustomOp{}, kv_type(type) {
    version = ORT_API_VERSION;
    CreateKernel = nullptr;
    KernelCompute = nullptr;
    GetName = [](const OrtCustomOp*) { return kOpName; };
    GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return nullptr; };  // CPU
    GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return kNumAllInputs; };
    GetInputType = [](const OrtCustomOp* op, size_t i) { return input_type(i, kv_type_of(op)); };
    GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return kNumOutputs; };
    GetOutputType = [](const OrtCustomOp* op, size_t i) { return output_type(i, kv_type_of(op)); };
    GetInputCharacteristic = [](const OrtCustomOp*, size_t i) {
      return i < kNumInputs ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
    };
    GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
    GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
    GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
    GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
    GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
    CreateKernelV2 = [](const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** kernel) -> OrtStatus* {
      try {
        *kernel = new PagedAttentionKernel{api, read_params(api, info), kv_type_of(op)};
        return nullptr;
      } catch (const Failure& e) {
        return to_status(api, e);
      } catch (const std::exception& e) {
        return api->CreateStatus(ORT_FAIL, (std::string(kPrefix) + e.what()).c_str());
      }
    };
    KernelComputeV2 = [](void* kernel, OrtKernelContext* context) {
      return octavo::glue::run<PagedAttentionKernel>(kernel, context, kPrefix);
    };
    KernelDestroy = [](void* kernel) { delete static_cast<PagedAttentionKernel*>(kernel); };
    InferOutputShapeFn = nullptr;
    GetStartVersion = [](const OrtCustomOp*) { return 1; };
    GetEndVersion = [](const OrtCustomOp*) { return 1 << 30; };
    GetMayInplace = [](int** input_index, int** output_index) -> size_t {
      *input_index = nullptr;
      *output_index = nullptr;
      return 0;
    };
    ReleaseMayInplace = [](int*, int*) {};
    // key_cache (input 3) -> key_cache_out (output 1), value_cache (4) -> value_cache_out (2).
    GetAliasMap = [](int** input_index, int** output_index) -> size_t {
      *input_index = new int[2]{static_cast<int>(kKeyCache), static_cast<int>(kValueCache)};
      *output_index = new int[2]{static_cast<int>(kKeyCacheOut), static_cast<int>(kValueCacheOut)};
      return 2;
    };
    ReleaseAliasMap = [](int* input_index, int* output_index) {
      delete[] input_index;
      delete[] output_index;
    };
  }
};

const PagedAttentionOp& op_schema(octavo::KvType kv_type) {
  static const PagedAttentionOp float32_op(octavo::KvType::kFloat32);
  static const PagedAttentionOp float16_op(octavo::KvType::kFloat16);
  static const PagedAttentionOp int8_op(octavo::KvType::kInt8);
  switch (kv_type) {
    case octavo::KvType::kFloat16: return float16_op;
    case octavo::KvType::kInt8: return int8_op;
    default: return float32_op;
  }
}

// Domains must outlive every session that uses them; they are released when the library unloads.
struct DomainRegistry {
  std::mutex mutex;
  std::vector<std::pair<const OrtApi*, OrtCustomOpDomain*>> domains;
  ~DomainRegistry() {
    for (auto& entry : domains) entry.first->ReleaseCustomOpDomain(entry.second);
  }
};

DomainRegistry& registry() {
  static DomainRegistry r;
  return r;
}

// The instruction-set extensions this build was compiled for, when the CPU lacks one (nullptr otherwise).
// A portable wheel ships one build per x86-64 level and octavo picks the right one; this check turns a
// wrong pick (or a -march=native build copied to an older machine) into a clear error instead of an
// illegal instruction later. Compiled for the x86-64 baseline so that the check itself runs anywhere.
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("arch=x86-64"))) const char* missing_cpu_feature() {
  __builtin_cpu_init();
#if defined(__AVX__)
  if (!__builtin_cpu_supports("avx")) return "avx";
#endif
#if defined(__AVX2__)
  if (!__builtin_cpu_supports("avx2")) return "avx2";
#endif
#if defined(__FMA__)
  if (!__builtin_cpu_supports("fma")) return "fma";
#endif
#if defined(__BMI2__)
  if (!__builtin_cpu_supports("bmi2")) return "bmi2";
#endif
#if defined(__AVX512F__)
  if (!__builtin_cpu_supports("avx512f")) return "avx512f";
#endif
#if defined(__AVX512BW__)
  if (!__builtin_cpu_supports("avx512bw")) return "avx512bw";
#endif
#if defined(__AVX512DQ__)
  if (!__builtin_cpu_supports("avx512dq")) return "avx512dq";
#endif
#if defined(__AVX512VL__)
  if (!__builtin_cpu_supports("avx512vl")) return "avx512vl";
#endif
  return nullptr;
}
#else
const char* missing_cpu_feature() { return nullptr; }
#endif

OrtStatus* register_ops(OrtSessionOptions* options, const OrtApi* api) {
  OrtCustomOpDomain* domain = nullptr;
  if (OrtStatus* status = api->CreateCustomOpDomain(kDomain, &domain)) return status;
  {
    DomainRegistry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    r.domains.emplace_back(api, domain);
  }
  for (octavo::KvType kv_type : {octavo::KvType::kFloat32, octavo::KvType::kFloat16, octavo::KvType::kInt8}) {
    if (OrtStatus* status = api->CustomOpDomain_Add(domain, &op_schema(kv_type))) return status;
  }
  for (const OrtCustomOp* op : {&octavo::int8_residual_schema(), &octavo::fold_rows_schema(),
                              &octavo::block_matmul_schema(), &octavo::moe_schema(), &octavo::block_gather_schema()}) {
    if (OrtStatus* status = api->CustomOpDomain_Add(domain, op)) return status;
  }
  return api->AddCustomOpDomain(options, domain);
}

}  // namespace

extern "C" __attribute__((visibility("default")))
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("arch=x86-64")))  // runs before the CPU check has passed
#endif
OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) return nullptr;  // cannot even build a status; ORT logs the missing op later
  if (const char* feature = missing_cpu_feature()) {
    // Only libc here: out-of-line code of this library was compiled for the features being checked.
    char message[320];
    std::snprintf(message, sizeof message,
                  "%sthis build of the library needs the CPU feature %s, which this CPU lacks: let octavo pick its "
                  "packaged build for this CPU (unset OCTAVO_OP_LIBRARY) or build one here with "
                  "`python -m octavo.oplib_build`",
                  kPrefix, feature);
    return api->CreateStatus(ORT_FAIL, message);
  }
  return register_ops(options, api);
}
