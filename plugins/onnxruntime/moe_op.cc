// octavo.MoE: a sparse Mixture-of-Experts block of SwiGLU experts (Qwen3-MoE, Qwen2-MoE's routed experts,
// Mixtral), each expert computing only the rows routed to it. The compute is moe_kernel.{h,cc}; this file is the
// ONNX Runtime glue: shape checks, the output, the three phases on the session's threads.
//
// MoE(x [T, H] float, router_logits [T, E] float, gate_up [E, 2I, H] float, down [E, H, I] float) -> y [T, H]
// attributes: top_k (1 <= top_k <= E), normalize (0 or 1: divide the chosen weights by their sum).
// Block-quantized experts (moe_blocks.h; a GGUF's own blocks): gate_up and down are uint8 codes in BlockMatMul's
// panel layout per expert, [E, panels, K / 2, 32 * bits / 8], followed by inputs 4-7, their scales and offsets
// (float32 or float16, [E, panels, K / block_size, 16]), and optionally 8, decode_step (bool [1], as BlockMatMul's),
// and 9-12, two-level scales (BlockMatMul's scale_super and offset_super per expert, float32 [E, panels, nb / G,
// 16]) of gate_up then down, whose scales and offsets are then int8 factors of them;
// attributes expert_inter (I), gate_up_bits, gate_up_block_size, down_bits, down_block_size.
#include <onnxruntime_c_api.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "block_inputs.h"
#include "moe_blocks.h"
#include "moe_kernel.h"
#include "moe_op.h"
#include "op_glue.h"

namespace {

constexpr const char* kPrefix = "octavo.MoE: ";
constexpr int64_t kCombineTokens = 32;  // tokens per task of the combine
// Tokens one pass takes: a longer step runs in passes of this many, so the scratch of a call is bounded by
// kPassTokens * top_k * (2H + 3I) floats whatever the step's size (a token's result does not depend on its pass).
constexpr int64_t kPassTokens = 1024;

using octavo::glue::check;
using octavo::glue::data_of;
using octavo::glue::describe;
using octavo::glue::fail;
using octavo::glue::Failure;
using octavo::glue::shape_string;
using octavo::glue::TensorInfo;

int64_t int_attribute(const OrtApi* api, const OrtKernelInfo* info, const char* name, int64_t fallback) {
  int64_t value = 0;
  if (OrtStatus* status = api->KernelInfoGetAttribute_int64(info, name, &value)) {
    api->ReleaseStatus(status);
    return fallback;
  }
  return value;
}

struct PhaseJob {
  const octavo::moe::Weights* weights;
  const octavo::moe::Routing* routing;
  const std::vector<octavo::moe::Task>* tasks;
  const float* in;
  float* out;
};

void up_task(void* data, size_t i) {
  const auto* job = static_cast<const PhaseJob*>(data);
  octavo::moe::expert_up(*job->weights, *job->routing, job->in, job->out, (*job->tasks)[i]);
}

void down_task(void* data, size_t i) {
  const auto* job = static_cast<const PhaseJob*>(data);
  octavo::moe::expert_down(*job->weights, *job->routing, job->in, job->out, (*job->tasks)[i]);
}

struct CombineJob {
  const octavo::moe::Routing* routing;
  const float* out;
  int64_t hidden;
  float* y;
  bool weighted;
};

void combine_task(void* data, size_t i) {
  const auto* job = static_cast<const CombineJob*>(data);
  const int64_t t0 = static_cast<int64_t>(i) * kCombineTokens;
  octavo::moe::combine(*job->routing, job->out, job->hidden, job->y, t0,
                       std::min(job->routing->tokens, t0 + kCombineTokens), job->weighted);
}

// The block path's phases: prepare (one active expert a task), the panels, SiLU (kActivateRows rows a task).
constexpr int64_t kActivateRows = 64;

struct BlockJob {
  octavo::moe::BlockRun* run;
  const octavo::moe::BlockExperts* weights;
  const float* in;
  float* out;
};

void prepare_task(void* data, size_t i) {
  auto* job = static_cast<BlockJob*>(data);
  job->run->prepare(*job->weights, job->in, i);
}

void panels_task(void* data, size_t i) {
  const auto* job = static_cast<const BlockJob*>(data);
  job->run->run(*job->weights, job->out, i);
}

void activate_task(void* data, size_t i) {
  auto* job = static_cast<BlockJob*>(data);
  const int64_t rows = job->run->routing->tokens * job->run->routing->top_k, g0 = static_cast<int64_t>(i) * kActivateRows;
  job->run->activate(g0, std::min(rows, g0 + kActivateRows));
}

struct BlockAttributes {
  int64_t inter = 0, gate_up_bits = 0, gate_up_block_size = 0, down_bits = 0, down_block_size = 0;
  bool prompt_int8 = false;  // steps off the 16-bit path: 4-bit experts on the int8 path (block_matmul_int8.cc)
  bool decode_int8 = false;  // the 16-bit path's steps: 4-bit experts on the int8 path instead
};

struct Kernel {
  const OrtApi* api;
  int64_t top_k;
  bool normalize;
  BlockAttributes blocks;  // inter == 0: the node has float experts
  octavo::SmallCodes small_gate_up{}, small_down{};  // 8-bit experts: whether their codes are all below 64

  void compute(OrtKernelContext* context) const {
    size_t count = 0;
    check(api, api->KernelContext_GetInputCount(context, &count));
    const OrtValue* values[13] = {};
    for (size_t i = 0; i < count && i < 13; ++i) check(api, api->KernelContext_GetInput(context, i, &values[i]));
    for (size_t i = 0; i < 4; ++i) {
      if (values[i] == nullptr) fail("input " + std::to_string(i) + " is missing");
    }
    const TensorInfo x = describe(api, values[0]), logits = describe(api, values[1]);
    if (x.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || logits.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
      fail("x and router_logits must be float32");
    }
    if (x.dims.size() != 2) fail("x must be [T, H], got " + shape_string(x.dims));
    if (logits.dims.size() != 2 || logits.dims[0] != x.dims[0]) {
      fail("router_logits must be [T, E] with T = " + std::to_string(x.dims[0]) + ", got " + shape_string(logits.dims));
    }
    const int64_t tokens = x.dims[0], hidden = x.dims[1], experts = logits.dims[1];
    if (top_k > experts) fail("top_k " + std::to_string(top_k) + " exceeds the " + std::to_string(experts) + " experts");
    OrtValue* output = nullptr;
    check(api, api->KernelContext_GetOutput(context, 0, x.dims.data(), x.dims.size(), &output));
    float* y = data_of<float>(api, output);
    if (blocks.inter > 0) {
      return compute_blocks(context, values, count, tokens, hidden, experts, y);
    }
    const TensorInfo gate_up = describe(api, values[2]), down = describe(api, values[3]);
    if (gate_up.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || down.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
      fail("gate_up and down must be float32 (or uint8 codes with the expert_inter attribute)");
    }
    if (gate_up.dims.size() != 3 || gate_up.dims[0] != experts || gate_up.dims[1] % 2 != 0 || gate_up.dims[2] != hidden) {
      fail("gate_up must be [E, 2I, H] with E = " + std::to_string(experts) + ", H = " + std::to_string(hidden) +
           ", got " + shape_string(gate_up.dims));
    }
    const int64_t inter = gate_up.dims[1] / 2;
    if (down.dims != std::vector<int64_t>{experts, hidden, inter}) {
      fail("down must be [E, H, I] = " + shape_string({experts, hidden, inter}) + ", got " + shape_string(down.dims));
    }
    const octavo::moe::Weights w{data_of<const float>(api, values[2]), data_of<const float>(api, values[3]), hidden,
                                 inter};
    const float* x_data = data_of<const float>(api, values[0]);
    const float* logits_data = data_of<const float>(api, values[1]);
    for (int64_t t0 = 0; t0 < tokens; t0 += kPassTokens) {
      const int64_t n = std::min(tokens - t0, kPassTokens);
      octavo::moe::Routing routing;
      octavo::moe::route(logits_data + t0 * experts, n, experts, top_k, normalize, routing);
      const int64_t rows = n * top_k;
      std::vector<float> act(static_cast<size_t>(rows * inter)), out(static_cast<size_t>(rows * hidden));
      const std::vector<octavo::moe::Task> up_tasks = octavo::moe::plan_tasks(routing, inter);
      PhaseJob up{&w, &routing, &up_tasks, x_data + t0 * hidden, act.data()};
      octavo::glue::parallel_for(api, context, up_task, up_tasks.size(), &up);
      const std::vector<octavo::moe::Task> down_tasks = octavo::moe::plan_tasks(routing, hidden);
      PhaseJob dn{&w, &routing, &down_tasks, act.data(), out.data()};
      octavo::glue::parallel_for(api, context, down_task, down_tasks.size(), &dn);
      combine(context, routing, out.data(), hidden, y + t0 * hidden, false);
    }
  }

  void combine(OrtKernelContext* context, const octavo::moe::Routing& routing, const float* out, int64_t hidden,
               float* y, bool weighted) const {
    CombineJob job{&routing, out, hidden, y, weighted};
    octavo::glue::parallel_for(api, context, combine_task,
                               static_cast<size_t>((routing.tokens + kCombineTokens - 1) / kCombineTokens), &job);
  }

  // One projection's block inputs (codes at CODES, scales and offsets at SCALES, SCALES + 1, two-level scales'
  // supers at SUPERS, SUPERS + 1 where given): checked, described.
  octavo::moe::BlockExperts block_experts(const OrtValue* const* values, size_t codes, size_t scales, size_t supers,
                                          int64_t experts, int64_t k, int64_t n, int64_t bits, int64_t block_size,
                                          const char* what) const {
    if (values[scales] == nullptr || values[scales + 1] == nullptr) {
      fail(std::string(what) + ": quantized experts need their scales and offsets inputs");
    }
    const TensorInfo c = describe(api, values[codes]), s = describe(api, values[scales]);
    const TensorInfo o = describe(api, values[scales + 1]);
    if (k % block_size != 0) {
      fail(std::string(what) + ": block_size " + std::to_string(block_size) + " does not divide K = " + std::to_string(k));
    }
    const int64_t panels = (n + octavo::kPanel - 1) / octavo::kPanel;
    const std::vector<int64_t> want_codes{experts, panels, k / 2, 32 * bits / 8};
    const std::vector<int64_t> want_scales{experts, panels, k / block_size, octavo::kPanel};
    if (c.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 || c.dims != want_codes) {
      fail(std::string(what) + " codes must be uint8 " + shape_string(want_codes) + ", got " + shape_string(c.dims));
    }
    const bool half = s.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    const bool two_level = values[supers] != nullptr || values[supers + 1] != nullptr;
    const bool type_ok = two_level ? s.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8
                                   : half || s.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    if (!type_ok || s.dims != want_scales || o.type != s.type || o.dims != want_scales) {
      fail(std::string(what) + " scales and offsets must be " + (two_level ? "int8 (with supers) " : "float32 or float16 ") +
           shape_string(want_scales) + ", got " + shape_string(s.dims) + " and " + shape_string(o.dims));
    }
    octavo::moe::BlockExperts e;
    if (two_level) {
      if (values[supers] == nullptr || values[supers + 1] == nullptr) {
        fail(std::string(what) + ": scale_super and offset_super come together");
      }
      e.super_shift = octavo::block_inputs::super_shift(describe(api, values[supers]), describe(api, values[supers + 1]),
                                                        {experts, panels}, k / block_size, std::string(what) + " ");
      e.scale_super = data_of<const float>(api, values[supers]);
      e.offset_super = data_of<const float>(api, values[supers + 1]);
    }
    e.codes = data_of<const uint8_t>(api, values[codes]);
    e.scales = data_of<const void>(api, values[scales]);
    e.offsets = data_of<const void>(api, values[scales + 1]);
    e.half_scales = half;
    e.bits = static_cast<int>(bits);
    e.k = k;
    e.n = n;
    e.block_size = block_size;
    return e;
  }

  void compute_blocks(OrtKernelContext* context, const OrtValue* const* values, size_t count, int64_t tokens,
                      int64_t hidden, int64_t experts, float* y) const {
    const int64_t inter = blocks.inter;
    octavo::moe::BlockExperts gu = block_experts(values, 2, 4, 9, experts, hidden, 2 * inter,
                                                 blocks.gate_up_bits, blocks.gate_up_block_size, "gate_up");
    // down's codes are input 3, its scales and offsets inputs 6 and 7, its supers 11 and 12
    const OrtValue* down_values[8] = {nullptr, nullptr, nullptr, values[3], values[6], values[7], values[11], values[12]};
    octavo::moe::BlockExperts dn = block_experts(down_values, 3, 4, 6, experts, inter, hidden, blocks.down_bits,
                                                 blocks.down_block_size, "down");
    if (blocks.decode_int8) {  // 8-bit experts below 64 (Q6_K, Q5_x) may take the int8 path on decode steps
      for (auto [e, check] : {std::pair{&gu, &small_gate_up}, std::pair{&dn, &small_down}}) {
        e->small_codes = e->bits == 8 && check->check(e->codes, experts * ((e->n + octavo::kPanel - 1) / octavo::kPanel) *
                                                                    (e->k / 2) * 32);
      }
    }
    bool decode = false;
    if (count > 8 && values[8] != nullptr) {
      const TensorInfo flag = describe(api, values[8]);
      if (flag.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL || flag.dims != std::vector<int64_t>{1}) {
        fail("decode_step must be bool [1], got " + shape_string(flag.dims));
      }
      decode = *data_of<const bool>(api, values[8]);
    }
    const float* x = data_of<const float>(api, values[0]);
    const float* logits_data = data_of<const float>(api, values[1]);
    for (int64_t t0 = 0; t0 < tokens; t0 += kPassTokens) {
      const int64_t n = std::min(tokens - t0, kPassTokens);
      octavo::moe::Routing routing;
      octavo::moe::route(logits_data + t0 * experts, n, experts, top_k, normalize, routing);
      octavo::moe::BlockRun run;
      // the path is the step's (all TOKENS), whatever this pass's share of them
      run.begin(routing, x + t0 * hidden, gu, dn, decode, decode || tokens <= octavo::kIntRows, blocks.prompt_int8,
                blocks.decode_int8);
      block_pass(context, run, y + t0 * hidden);
    }
  }

  // One pass of the block path over RUN's tokens (begun), into Y.
  void block_pass(OrtKernelContext* context, octavo::moe::BlockRun& run, float* y) const {
    const octavo::moe::Routing& routing = *run.routing;
    const int64_t rows = routing.tokens * routing.top_k, hidden = run.gate_up.k;
    BlockJob up{&run, &run.gate_up, run.xg.data(), run.gu.data()};
    octavo::glue::parallel_for(api, context, prepare_task, run.active.size(), &up);
    run.plan(run.gate_up);
    octavo::glue::parallel_for(api, context, panels_task, run.tasks.size(), &up);
    octavo::glue::parallel_for(api, context, activate_task, static_cast<size_t>((rows + kActivateRows - 1) / kActivateRows),
                               &up);
    BlockJob down{&run, &run.down, run.act.data(), run.out.data()};
    octavo::glue::parallel_for(api, context, prepare_task, run.active.size(), &down);
    run.plan(run.down);
    octavo::glue::parallel_for(api, context, panels_task, run.tasks.size(), &down);
    combine(context, routing, run.out.data(), hidden, y, true);
  }
};

struct MoEOp : OrtCustomOp {
  MoEOp() : OrtCustomOp{} {
    octavo::glue::fill_common(*this);
    GetName = [](const OrtCustomOp*) { return "MoE"; };
    GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 13; };
    GetInputType = [](const OrtCustomOp*, size_t i) {
      switch (i) {
        case 0:
        case 1: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
        case 8: return ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL;
        default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;  // float experts or uint8 codes; checked at run time
      }
    };
    GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
    GetInputCharacteristic = [](const OrtCustomOp*, size_t i) {
      return i < 4 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
    };
    GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    CreateKernelV2 = [](const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo* info, void** kernel) -> OrtStatus* {
      try {
        const int64_t top_k = int_attribute(api, info, "top_k", 0);
        const int64_t normalize = int_attribute(api, info, "normalize", 0);
        if (top_k < 1) fail("top_k must be a positive integer, got " + std::to_string(top_k));
        if (normalize != 0 && normalize != 1) fail("normalize must be 0 or 1, got " + std::to_string(normalize));
        BlockAttributes blocks;
        blocks.inter = int_attribute(api, info, "expert_inter", 0);
        if (blocks.inter < 0) fail("expert_inter must be positive, got " + std::to_string(blocks.inter));
        if (blocks.inter > 0) {
          blocks.gate_up_bits = int_attribute(api, info, "gate_up_bits", 0);
          blocks.down_bits = int_attribute(api, info, "down_bits", 0);
          blocks.gate_up_block_size = int_attribute(api, info, "gate_up_block_size", 0);
          blocks.down_block_size = int_attribute(api, info, "down_block_size", 0);
          for (const int64_t bits : {blocks.gate_up_bits, blocks.down_bits}) {
            if (bits != 4 && bits != 8) fail("gate_up_bits and down_bits must be 4 or 8, got " + std::to_string(bits));
          }
          for (const int64_t size : {blocks.gate_up_block_size, blocks.down_block_size}) {
            if (size <= 0 || size % 4 != 0) {
              fail("gate_up_block_size and down_block_size must be positive multiples of 4, got " + std::to_string(size));
            }
          }
          if (blocks.inter % 2 != 0) fail("expert_inter must be even (codes pair k), got " + std::to_string(blocks.inter));
        }
        const int64_t prompt_int8 = int_attribute(api, info, "prompt_int8", 0);
        if (prompt_int8 != 0 && prompt_int8 != 1) fail("prompt_int8 must be 0 or 1, got " + std::to_string(prompt_int8));
        blocks.prompt_int8 = prompt_int8 == 1;
        const int64_t decode_int8 = int_attribute(api, info, "decode_int8", 0);
        if (decode_int8 != 0 && decode_int8 != 1) fail("decode_int8 must be 0 or 1, got " + std::to_string(decode_int8));
        blocks.decode_int8 = decode_int8 == 1;
        *kernel = new Kernel{api, top_k, normalize == 1, blocks};
        return nullptr;
      } catch (const Failure& f) {
        return api->CreateStatus(f.code, (std::string(kPrefix) + f.message).c_str());
      }
    };
    KernelComputeV2 = [](void* kernel, OrtKernelContext* context) {
      return octavo::glue::run<Kernel>(kernel, context, kPrefix);
    };
    KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
  }
};

}  // namespace

namespace octavo {

const OrtCustomOp& moe_schema() {
  static const MoEOp op;
  return op;
}

}  // namespace octavo
