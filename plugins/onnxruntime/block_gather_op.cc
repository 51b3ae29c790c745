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
// (a zero may carry the other sign: 8d - 8d is +0 where (8 - 8) * d is -0 for d < 0). Portable scalar code: a step gathers at most its tokens' rows, K values each, which costs microseconds
// beside the step's matmuls; tokens are split over ORT's threads.
#include <onnxruntime_c_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "block_gather_op.h"
#include "block_inputs.h"
#include "half.h"
#include "op_glue.h"

namespace {

constexpr const char* kPrefix = "octavo.BlockGather: ";
constexpr int kPanel = 16;
constexpr int64_t kTokensPerTask = 16;

using octavo::glue::check;
using octavo::glue::describe;
using octavo::glue::fail;
using octavo::glue::Failure;
using octavo::glue::shape_string;

enum class ParamType { kFloat, kHalf, kInt8 };

struct Matrix {
  const uint8_t* codes = nullptr;
  const void* scales = nullptr;
  const void* offsets = nullptr;
  const float* scale_super = nullptr;  // two-level scales (kInt8): scale = int8 * super of its 2^shift blocks
  const float* offset_super = nullptr;
  ParamType type = ParamType::kFloat;
  int super_shift = 0;
  int64_t k = 0, n = 0, bits = 4, block_size = 32;

  // The float32 scale (or offset: OFFSET) of column c of panel p, block b.
  float param(bool offset, int64_t p, int64_t b, int c) const {
    const int64_t nb = k / block_size, index = (p * nb + b) * kPanel + c;
    const void* base = offset ? offsets : scales;
    switch (type) {
      case ParamType::kHalf: return octavo::half::to_float(static_cast<const uint16_t*>(base)[index]);
      case ParamType::kInt8: {
        const float* super = offset ? offset_super : scale_super;
        const int64_t s = (((p * nb + b) >> super_shift) * kPanel) + c;
        return static_cast<float>(static_cast<const int8_t*>(base)[index]) * super[s];
      }
      default: return static_cast<const float*>(base)[index];
    }
  }

  // Row N of W into OUT (K floats).
  void row(int64_t row, float* out) const {
    const int64_t p = row / kPanel;
    const int c = static_cast<int>(row % kPanel);
    const int64_t pair_bytes = 32 * bits / 8;
    const uint8_t* panel = codes + p * (k / 2) * pair_bytes;
    const int lane = c < 8 ? 2 * c : 16 + 2 * (c - 8);  // element of (column c, even k) in a pair's 32
    for (int64_t b = 0; b < k / block_size; ++b) {
      const float scale = param(false, p, b, c), offset = param(true, p, b, c);
      for (int64_t kk = b * block_size; kk < (b + 1) * block_size; ++kk) {
        const int e = lane + static_cast<int>(kk & 1);
        int code;
        if (bits == 8) {
          code = panel[(kk / 2) * pair_bytes + e];
        } else {  // byte i of a pair holds codes i (low nibble) and i + 16; pairs 2j, 2j+1 interleave their bytes
          const uint8_t byte = panel[(kk / 4) * 32 + 2 * (e % 16) + (kk / 2) % 2];
          code = e < 16 ? (byte & 15) : (byte >> 4);
        }
        out[kk] = std::fma(static_cast<float>(code), scale, offset);
      }
    }
  }
};

struct Job {
  const Matrix* w;
  const int64_t* ids;
  int64_t count;
  float* y;
};

void gather_task(void* data, size_t i) {
  const auto* job = static_cast<const Job*>(data);
  const int64_t t0 = static_cast<int64_t>(i) * kTokensPerTask;
  for (int64_t t = t0; t < job->count && t < t0 + kTokensPerTask; ++t) job->w->row(job->ids[t], job->y + t * job->w->k);
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
    const int64_t panels = (n + kPanel - 1) / kPanel, nb = k / block_size;
    const std::vector<int64_t> want_codes{panels, k / 2, 32 * bits / 8}, want_scales{panels, nb, kPanel};
    if (codes.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 || codes.dims != want_codes) {
      fail("codes must be uint8 " + shape_string(want_codes) + ", got " + shape_string(codes.dims));
    }
    Matrix w;
    w.k = k;
    w.n = n;
    w.bits = bits;
    w.block_size = block_size;
    const bool two_level = values[4] != nullptr || values[5] != nullptr;
    if (two_level) {
      if (values[4] == nullptr || values[5] == nullptr) fail("scale_super and offset_super come together");
      if (scales.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8) fail("with scale_super, scales must be int8");
      w.super_shift = octavo::block_inputs::super_shift(describe(api, values[4]), describe(api, values[5]), {panels},
                                                        nb, "");
      w.type = ParamType::kInt8;
      w.scale_super = octavo::glue::data_of<const float>(api, values[4]);
      w.offset_super = octavo::glue::data_of<const float>(api, values[5]);
    } else if (scales.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) {
      w.type = ParamType::kHalf;
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
