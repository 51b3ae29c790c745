// octavo.BlockGather: rows of a block-quantized matrix, dequantized to float32: the token embedding of a GGUF kept
// in the file's own blocks (octavo/export/graph.py) instead of a float32 copy (4 bytes a value where Q4_K holds
// 0.56). The layout is octavo.BlockMatMul's (block_matmul_kernel.h): row n of W [N, K] is column n % 16 of panel
// n / 16, so this reads only the bytes of the rows asked for.
//
// BlockGather(ids int64 [...], codes uint8 [N/16, K/2, 32*bits/8], scales, offsets (float32, float16, or int8
//             with the two-level supers), scale_super, offset_super float [N/16, nb/G, 16] optional)
//             -> y [..., K] float;  attributes K, N (the rows: an id must lie in [0, N)), bits (4 or 8), block_size.
// Each value is fma(code, scale, offset) in float32 (one rounding; the file's exact value for every GGML type the
// exporter maps, as BlockMatMul's float path computes it), so y has the values of a Gather over a float32 copy
// (a zero may carry the other sign: 8d - 8d is +0 where (8 - 8) * d is -0 for d < 0). Portable scalar code (the
// layout's scalar accessors code_at / param_at): a step gathers at most its tokens' rows, K values each, which costs
// microseconds beside the step's matmuls; tokens are split over ORT's threads.
#include <onnxruntime_c_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "block_gather_op.h"
#include "block_inputs.h"
#include "block_matmul_kernel.h"
#include "op_glue.h"

namespace {

constexpr const char* kPrefix = "octavo.BlockGather: ";
constexpr int64_t kTokensPerTask = 16;

using octavo::glue::check;
using octavo::glue::describe;
using octavo::glue::fail;
using octavo::glue::Failure;
using octavo::glue::shape_string;

// Row ROW of W into OUT (K floats).
void gather_row(const octavo::BlockWeights& w, int64_t row, float* out) {
  const int64_t p = row / octavo::kPanel, nb = w.k / w.block_size;
  const int c = static_cast<int>(row % octavo::kPanel);
  const uint8_t* panel = w.codes + p * (w.k / 2) * (32 * w.bits / 8);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t index = (p * nb + b) * octavo::kPanel + c;
    const float scale = octavo::param_at(w, w.scales, w.scale_super, index);
    const float offset = octavo::param_at(w, w.offsets, w.offset_super, index);
    for (int64_t k = b * w.block_size; k < (b + 1) * w.block_size; ++k) {
      out[k] = std::fma(static_cast<float>(octavo::code_at(panel, w.bits, c, k)), scale, offset);
    }
  }
}

struct Job {
  const octavo::BlockWeights* w;
  const int64_t* ids;
  int64_t count;
  float* y;
};

void gather_task(void* data, size_t i) {
  const auto* job = static_cast<const Job*>(data);
  const int64_t t0 = static_cast<int64_t>(i) * kTokensPerTask;
  for (int64_t t = t0; t < job->count && t < t0 + kTokensPerTask; ++t) gather_row(*job->w, job->ids[t], job->y + t * job->w->k);
}

struct Kernel {
  const OrtApi* api;
  int64_t k, n, bits, block_size;

  void compute(OrtKernelContext* context) const {
    size_t count = 0;
    check(api, api->KernelContext_GetInputCount(context, &count));
    const OrtValue* values[6] = {};
    for (size_t i = 0; i < count && i < 6; ++i) check(api, api->KernelContext_GetInput(context, i, &values[i]));
    for (size_t i = 0; i < 4; ++i) {
      if (values[i] == nullptr) fail("input " + std::to_string(i) + " is missing");
    }
    const octavo::glue::TensorInfo ids = describe(api, values[0]), codes = describe(api, values[1]);
    const octavo::glue::TensorInfo scales = describe(api, values[2]), offsets = describe(api, values[3]);
    if (ids.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64) fail("ids must be int64");
    const int64_t panels = (n + octavo::kPanel - 1) / octavo::kPanel, nb = k / block_size;
    const std::vector<int64_t> want_codes{panels, k / 2, 32 * bits / 8}, want_scales{panels, nb, octavo::kPanel};
    if (codes.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 || codes.dims != want_codes) {
      fail("codes must be uint8 " + shape_string(want_codes) + ", got " + shape_string(codes.dims));
    }
    octavo::BlockWeights w;
    w.k = k;
    w.n = n;
    w.bits = static_cast<int>(bits);
    w.block_size = block_size;
    const bool two_level = values[4] != nullptr || values[5] != nullptr;
    if (two_level) {
      if (values[4] == nullptr || values[5] == nullptr) fail("scale_super and offset_super come together");
      if (scales.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8) fail("with scale_super, scales must be int8");
      w.super_shift = octavo::block_inputs::super_shift(describe(api, values[4]), describe(api, values[5]), {panels},
                                                        nb, "");
      w.scale_super = octavo::glue::data_of<const float>(api, values[4]);
      w.offset_super = octavo::glue::data_of<const float>(api, values[5]);
    } else if (scales.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) {
      w.half_scales = true;
    } else if (scales.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
      fail("scales must be float32 or float16 (int8 with scale_super)");
    }
    if (scales.dims != want_scales) {
      fail("scales must be " + shape_string(want_scales) + ", got " + shape_string(scales.dims));
    }
    if (offsets.type != scales.type || offsets.dims != want_scales) {
      fail("offsets must have the scales' type and shape " + shape_string(want_scales) + ", got " +
           shape_string(offsets.dims));
    }
    w.codes = octavo::glue::data_of<const uint8_t>(api, values[1]);
    w.scales = octavo::glue::data_of<const void>(api, values[2]);
    w.offsets = octavo::glue::data_of<const void>(api, values[3]);

    int64_t tokens = 1;
    for (const int64_t d : ids.dims) tokens *= d;
    const int64_t* id = octavo::glue::data_of<const int64_t>(api, values[0]);
    for (int64_t t = 0; t < tokens; ++t) {
      if (id[t] < 0 || id[t] >= n) {
        fail("id " + std::to_string(id[t]) + " is outside [0, " + std::to_string(n) + ") (the vocabulary)");
      }
    }
    std::vector<int64_t> out_dims = ids.dims;
    out_dims.push_back(k);
    OrtValue* output = nullptr;
    check(api, api->KernelContext_GetOutput(context, 0, out_dims.data(), out_dims.size(), &output));
    if (tokens == 0) return;
    Job job{&w, id, tokens, octavo::glue::data_of<float>(api, output)};
    octavo::glue::parallel_for(api, context, gather_task,
                               static_cast<size_t>((tokens + kTokensPerTask - 1) / kTokensPerTask), &job);
  }
};

struct BlockGatherOp : OrtCustomOp {
  BlockGatherOp() : OrtCustomOp{} {
    octavo::glue::fill_common(*this);
    GetName = [](const OrtCustomOp*) { return "BlockGather"; };
    GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 6; };
    GetInputType = [](const OrtCustomOp*, size_t i) {
      switch (i) {
        case 0: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
        case 1: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
        case 2:
        case 3: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;  // float32, float16 or int8, checked at run time
        default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
      }
    };
    GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
    GetInputCharacteristic = [](const OrtCustomOp*, size_t i) {
      return i < 4 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
    };
    GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    CreateKernelV2 = [](const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo* info, void** kernel) -> OrtStatus* {
      try {
        using octavo::block_inputs::attribute;
        const int64_t k = attribute(api, info, "K"), n = attribute(api, info, "N");
        const int64_t bits = attribute(api, info, "bits"), block_size = attribute(api, info, "block_size");
        octavo::block_inputs::check_layout(k, n, bits, block_size);
        *kernel = new Kernel{api, k, n, bits, block_size};
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

const OrtCustomOp& block_gather_schema() {
  static const BlockGatherOp op;
  return op;
}

}  // namespace octavo
