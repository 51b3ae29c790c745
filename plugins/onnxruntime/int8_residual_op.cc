// octavo.Int8Residual and octavo.FoldRows: float32-accurate activations for ONNX Runtime's int8 MatMulNBits.
//
// MatMulNBits with accuracy_level 4 (its only fast CPU path) rounds the activations to int8 per block of
// `block_size` values (symmetric: scale = max|a| / 127, q = round(a / scale)) before the integer dot
// products, which costs ~1% relative error per projection. Int8Residual appends, below the T rows of x,
// the T rows of what that rounding loses, r = x - q * scale; MatMulNBits then multiplies all 2T rows in
// one pass over the weights (at decode the weights' bytes, not the rows, set the time), and FoldRows adds
// the two halves back: W·Q(x) + W·Q(r) = W·x up to the rounding of r, ~(1/254)^2 of x. Nothing in ONNX
// Runtime does this (its DynamicQuantizeLinear is per tensor, QuantizeLinear's blocked form needs scales
// computed by more nodes per projection), hence this small kernel.
//
// Int8Residual(x [T, K]) -> (x2 [2T, K], block_sums [T, K / block_size]); with T > max_rows (max_rows > 0)
// x2 is x alone (large prefill chunks, where the doubled compute would cost more than it buys).
// block_sums (optional output) are the sums of x over each block: GGUF types with a per-block min add
// block_sums @ mins. FoldRows(y2 [2T or T, N], x [T, K], extra [T, N] optional) -> y [T, N] =
// y2[:T] + y2[T:] (+ extra); when y2 has T rows (no residual rows), y = y2 (+ extra).
#include <onnxruntime_c_api.h>

#include <cmath>
#include <string>
#include <vector>

#include "int8_residual_op.h"
#include "op_glue.h"

namespace {

constexpr const char* kResidualPrefix = "octavo.Int8Residual: ";
constexpr const char* kFoldPrefix = "octavo.FoldRows: ";

using octavo::glue::check;
using octavo::glue::Failure;
using octavo::glue::fill_common;
using octavo::glue::run;

std::vector<int64_t> dims_of(const OrtApi* api, const OrtValue* value) { return octavo::glue::describe(api, value).dims; }

float* data_of(const OrtApi* api, const OrtValue* value) { return octavo::glue::data_of<float>(api, value); }

int64_t attribute(const OrtApi* api, const OrtKernelInfo* info, const char* name, int64_t fallback) {
  int64_t value = fallback;
  OrtStatus* status = api->KernelInfoGetAttribute_int64(info, name, &value);
  if (status != nullptr) {
    api->ReleaseStatus(status);
    return fallback;
  }
  return value;
}

struct ResidualKernel {
  const OrtApi* api;
  int64_t block_size;
  int64_t max_rows;

  void compute(OrtKernelContext* context) const {
    const OrtValue* input = nullptr;
    check(api, api->KernelContext_GetInput(context, 0, &input));
    const std::vector<int64_t> dims = dims_of(api, input);
    if (dims.size() != 2) throw Failure{ORT_INVALID_ARGUMENT, "x must be [T, K]"};
    const int64_t rows = dims[0], k = dims[1];
    if (k % block_size != 0) {
      throw Failure{ORT_INVALID_ARGUMENT, "K (" + std::to_string(k) + ") is not a multiple of block_size (" +
                                              std::to_string(block_size) + ")"};
    }
    const bool residual = max_rows <= 0 || rows <= max_rows;
    const int64_t out_dims[2] = {residual ? 2 * rows : rows, k};
    OrtValue* output = nullptr;
    check(api, api->KernelContext_GetOutput(context, 0, out_dims, 2, &output));
    size_t outputs = 0;
    check(api, api->KernelContext_GetOutputCount(context, &outputs));
    float* sums = nullptr;
    const int64_t blocks = k / block_size;
    if (outputs > 1) {
      const int64_t sum_dims[2] = {rows, blocks};
      OrtValue* sum_value = nullptr;
      check(api, api->KernelContext_GetOutput(context, 1, sum_dims, 2, &sum_value));
      if (sum_value != nullptr) sums = data_of(api, sum_value);
    }
    const float* x = data_of(api, input);
    float* out = data_of(api, output);
    for (int64_t t = 0; t < rows; ++t) {
      const float* row = x + t * k;
      float* copy = out + t * k;
      float* lost = out + (rows + t) * k;
      for (int64_t b = 0; b < blocks; ++b) {
        const float* v = row + b * block_size;
        float amax = 0.0f, sum = 0.0f;
        for (int64_t i = 0; i < block_size; ++i) {
          amax = std::fmax(amax, std::fabs(v[i]));
          sum += v[i];
        }
        if (sums != nullptr) sums[t * blocks + b] = sum;
        // the rounding MatMulNBits applies (MLAS's int8 quantization of A, per block, round to nearest even)
        const float scale = amax / 127.0f;
        const float inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
        for (int64_t i = 0; i < block_size; ++i) {
          copy[b * block_size + i] = v[i];
          if (residual) lost[b * block_size + i] = v[i] - std::nearbyint(v[i] * inverse) * scale;
        }
      }
    }
  }
};

struct FoldKernel {
  const OrtApi* api;

  void compute(OrtKernelContext* context) const {
    const OrtValue* y2 = nullptr;
    const OrtValue* x = nullptr;
    check(api, api->KernelContext_GetInput(context, 0, &y2));
    check(api, api->KernelContext_GetInput(context, 1, &x));
    size_t inputs = 0;
    check(api, api->KernelContext_GetInputCount(context, &inputs));
    const OrtValue* extra = nullptr;
    if (inputs > 2) check(api, api->KernelContext_GetInput(context, 2, &extra));
    const std::vector<int64_t> dims = dims_of(api, y2);
    const int64_t rows = dims_of(api, x).at(0);
    if (dims.size() != 2 || (dims[0] != rows && dims[0] != 2 * rows)) {
      throw Failure{ORT_INVALID_ARGUMENT, "y2 must have T or 2T rows for x's T = " + std::to_string(rows)};
    }
    const int64_t n = dims[1];
    if (extra != nullptr) {
      const std::vector<int64_t> e = dims_of(api, extra);
      if (e.size() != 2 || e[0] != rows || e[1] != n) throw Failure{ORT_INVALID_ARGUMENT, "extra must be [T, N]"};
    }
    const int64_t out_dims[2] = {rows, n};
    OrtValue* output = nullptr;
    check(api, api->KernelContext_GetOutput(context, 0, out_dims, 2, &output));
    const float* top = data_of(api, y2);
    const float* bottom = dims[0] == 2 * rows ? top + rows * n : nullptr;
    const float* add = extra != nullptr ? data_of(api, extra) : nullptr;
    float* out = data_of(api, output);
    const int64_t count = rows * n;
    for (int64_t i = 0; i < count; ++i) {
      float v = top[i];
      if (bottom != nullptr) v += bottom[i];
      if (add != nullptr) v += add[i];
      out[i] = v;
    }
  }
};

struct ResidualOp : OrtCustomOp {
  ResidualOp() : OrtCustomOp{} {
    fill_common(*this);
    GetName = [](const OrtCustomOp*) { return "Int8Residual"; };
    GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
    GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 2; };
    GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    GetOutputCharacteristic = [](const OrtCustomOp*, size_t i) {
      return i == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
    };
    CreateKernelV2 = [](const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo* info, void** kernel) -> OrtStatus* {
      const int64_t block_size = attribute(api, info, "block_size", 32);
      if (block_size < 1) return api->CreateStatus(ORT_INVALID_ARGUMENT, "octavo.Int8Residual: block_size must be >= 1");
      *kernel = new ResidualKernel{api, block_size, attribute(api, info, "max_rows", 0)};
      return nullptr;
    };
    KernelComputeV2 = [](void* kernel, OrtKernelContext* context) { return run<ResidualKernel>(kernel, context, kResidualPrefix); };
    KernelDestroy = [](void* kernel) { delete static_cast<ResidualKernel*>(kernel); };
  }
};

struct FoldOp : OrtCustomOp {
  FoldOp() : OrtCustomOp{} {
    fill_common(*this);
    GetName = [](const OrtCustomOp*) { return "FoldRows"; };
    GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 3; };
    GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
    GetInputCharacteristic = [](const OrtCustomOp*, size_t i) {
      return i < 2 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
    };
    GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    CreateKernelV2 = [](const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo*, void** kernel) -> OrtStatus* {
      *kernel = new FoldKernel{api};
      return nullptr;
    };
    KernelComputeV2 = [](void* kernel, OrtKernelContext* context) { return run<FoldKernel>(kernel, context, kFoldPrefix); };
    KernelDestroy = [](void* kernel) { delete static_cast<FoldKernel*>(kernel); };
  }
};

}  // namespace

namespace octavo {

const OrtCustomOp& int8_residual_schema() {
  static const ResidualOp op;
  return op;
}

const OrtCustomOp& fold_rows_schema() {
  static const FoldOp op;
  return op;
}

}  // namespace octavo
