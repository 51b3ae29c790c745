// octavo.MoE: a sparse Mixture-of-Experts block of SwiGLU experts (Qwen3-MoE, Qwen2-MoE's routed experts,
// Mixtral), each expert computing only the rows routed to it. The compute is moe_kernel.{h,cc}; this file is the
// ONNX Runtime glue: shape checks, the output, the three phases on the session's threads.
//
// MoE(x [T, H] float, router_logits [T, E] float, gate_up [E, 2I, H] float, down [E, H, I] float) -> y [T, H]
// attributes: top_k (1 <= top_k <= E), normalize (0 or 1: divide the chosen weights by their sum).
#include <onnxruntime_c_api.h>

#include <algorithm>
#include <string>
#include <vector>

#include "moe_kernel.h"
#include "moe_op.h"
#include "op_glue.h"

namespace {

constexpr const char* kPrefix = "octavo.MoE: ";
constexpr int64_t kCombineTokens = 32;  // tokens per task of the combine

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
};

void combine_task(void* data, size_t i) {
  const auto* job = static_cast<const CombineJob*>(data);
  const int64_t t0 = static_cast<int64_t>(i) * kCombineTokens;
  octavo::moe::combine(*job->routing, job->out, job->hidden, job->y, t0,
                       std::min(job->routing->tokens, t0 + kCombineTokens));
}

struct Kernel {
  const OrtApi* api;
  int64_t top_k;
  bool normalize;

  void compute(OrtKernelContext* context) const {
    const OrtValue* values[4] = {};
    for (size_t i = 0; i < 4; ++i) {
      check(api, api->KernelContext_GetInput(context, i, &values[i]));
      if (values[i] == nullptr) fail("input " + std::to_string(i) + " is missing");
    }
    const TensorInfo x = describe(api, values[0]), logits = describe(api, values[1]);
    const TensorInfo gate_up = describe(api, values[2]), down = describe(api, values[3]);
    for (const TensorInfo* t : {&x, &logits, &gate_up, &down}) {
      if (t->type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) fail("every input must be float32");
    }
    if (x.dims.size() != 2) fail("x must be [T, H], got " + shape_string(x.dims));
    if (gate_up.dims.size() != 3 || gate_up.dims[1] % 2 != 0 || gate_up.dims[2] != x.dims[1]) {
      fail("gate_up must be [E, 2I, H] with H = " + std::to_string(x.dims[1]) + ", got " + shape_string(gate_up.dims));
    }
    const int64_t tokens = x.dims[0], hidden = x.dims[1], experts = gate_up.dims[0], inter = gate_up.dims[1] / 2;
    if (logits.dims != std::vector<int64_t>{tokens, experts}) {
      fail("router_logits must be [T, E] = " + shape_string({tokens, experts}) + ", got " + shape_string(logits.dims));
    }
    if (down.dims != std::vector<int64_t>{experts, hidden, inter}) {
      fail("down must be [E, H, I] = " + shape_string({experts, hidden, inter}) + ", got " + shape_string(down.dims));
    }
    if (top_k > experts) fail("top_k " + std::to_string(top_k) + " exceeds the " + std::to_string(experts) + " experts");
    OrtValue* output = nullptr;
    check(api, api->KernelContext_GetOutput(context, 0, x.dims.data(), x.dims.size(), &output));
    float* y = data_of<float>(api, output);
    if (tokens == 0) return;

    octavo::moe::Routing routing;
    octavo::moe::route(data_of<const float>(api, values[1]), tokens, experts, top_k, normalize, routing);
    const octavo::moe::Weights w{data_of<const float>(api, values[2]), data_of<const float>(api, values[3]), hidden,
                                 inter};
    const int64_t rows = tokens * top_k;
    std::vector<float> act(static_cast<size_t>(rows * inter)), out(static_cast<size_t>(rows * hidden));
    const std::vector<octavo::moe::Task> up_tasks = octavo::moe::plan_tasks(routing, inter);
    PhaseJob up{&w, &routing, &up_tasks, data_of<const float>(api, values[0]), act.data()};
    octavo::glue::parallel_for(api, context, up_task, up_tasks.size(), &up);
    const std::vector<octavo::moe::Task> down_tasks = octavo::moe::plan_tasks(routing, hidden);
    PhaseJob dn{&w, &routing, &down_tasks, act.data(), out.data()};
    octavo::glue::parallel_for(api, context, down_task, down_tasks.size(), &dn);
    CombineJob combine{&routing, out.data(), hidden, y};
    octavo::glue::parallel_for(api, context, combine_task,
                               static_cast<size_t>((tokens + kCombineTokens - 1) / kCombineTokens), &combine);
  }
};

struct MoEOp : OrtCustomOp {
  MoEOp() : OrtCustomOp{} {
    octavo::glue::fill_common(*this);
    GetName = [](const OrtCustomOp*) { return "MoE"; };
    GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 4; };
    GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
    GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    CreateKernelV2 = [](const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo* info, void** kernel) -> OrtStatus* {
      try {
        const int64_t top_k = int_attribute(api, info, "top_k", 0);
        const int64_t normalize = int_attribute(api, info, "normalize", 0);
        if (top_k < 1) fail("top_k must be a positive integer, got " + std::to_string(top_k));
        if (normalize != 0 && normalize != 1) fail("normalize must be 0 or 1, got " + std::to_string(normalize));
        *kernel = new Kernel{api, top_k, normalize == 1};
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
