// octavo.BlockMatMul: y = x @ W^T (+ bias) with W held as block-quantized codes (a GGUF file's own blocks,
// re-laid by octavo/export/block_layout.py): float32 over the file's values, or (decode steps) x rounded to 16
// bits per block with exact integer sums (paths and precision: block_matmul_kernel.h). The compute and the
// layout are in block_matmul_kernel.{h,cc}; this file is the ONNX Runtime glue: shape checks, output, threads.
//
// BlockMatMul(x [..., K] float, codes uint8, scales, offsets (float32 or float16, the same), bias [N] float
//             optional, decode_step bool [1] optional: the step is decode-only, one token per sequence,
//             scale_super, offset_super float [N/16, nb/G, 16] optional: two-level scales, scales and offsets
//             then int8 factors of them, G blocks a super-block, a power of two)
//             -> y [..., N] float;  attributes K, N, bits (4 or 8), block_size (a multiple of 4 that divides K),
//             optional prompt_int8 / decode_int8 (0 or 1): the float32 path's / the 16-bit path's steps on int8
//             activations where the codes are 4-bit in blocks of a multiple of 32 (block_matmul_int8.cc).
// With the attribute splits (ints, summing to N, every one but the last a multiple of the 16-column panel), y is
// written as that many outputs y_o [..., splits[o]] instead (the fused q/k/v or gate/up projections' parts: the
// graph needs no Split after the op). Up to 4 parts.
#include <onnxruntime_c_api.h>

#include <algorithm>
#include <string>
#include <vector>

#include "block_inputs.h"
#include "block_matmul_kernel.h"
#include "block_matmul_op.h"
#include "op_glue.h"

namespace {

constexpr const char* kPrefix = "octavo.BlockMatMul: ";

using octavo::glue::check;
using octavo::glue::describe;
using octavo::glue::fail;
using octavo::glue::Failure;
using octavo::glue::shape_string;

// The int attribute NAME, or FALLBACK where the node has none.
int64_t optional_int(const OrtApi* api, const OrtKernelInfo* info, const char* name, int64_t fallback) {
  int64_t value = 0;
  if (OrtStatus* status = api->KernelInfoGetAttribute_int64(info, name, &value)) {
    api->ReleaseStatus(status);  // absent
    return fallback;
  }
  return value;
}

// The ints attribute NAME, or an empty list where the node has none.
std::vector<int64_t> optional_ints(const OrtApi* api, const OrtKernelInfo* info, const char* name) {
  size_t size = 0;
  if (OrtStatus* status = api->KernelInfoGetAttributeArray_int64(info, name, nullptr, &size)) {
    api->ReleaseStatus(status);  // absent
    return {};
  }
  std::vector<int64_t> values(size);
  check(api, api->KernelInfoGetAttributeArray_int64(info, name, values.data(), &size));
  return values;
}

struct Job {
  const octavo::BlockWeights* weights;
  const octavo::Activations* activations;
  const octavo::Outputs* y;
  int64_t per_task;  // panels
  int64_t panels;
  int64_t rows_per_task;
  int64_t panel_tasks;  // tasks per row block: task i is row block i / panel_tasks, panels (i % panel_tasks) x per_task
};

void run_task(void* user_data, size_t index) {
  const auto* job = static_cast<const Job*>(user_data);
  const int64_t i = static_cast<int64_t>(index);
  const int64_t first = (i % job->panel_tasks) * job->per_task, r0 = (i / job->panel_tasks) * job->rows_per_task;
  octavo::block_matmul_panels(*job->weights, *job->activations, *job->y, first,
                              std::min(job->panels, first + job->per_task), r0, r0 + job->rows_per_task);
}

constexpr int64_t kQuantizeRows = 32;  // rows of x one task rounds to 16 bits

// A pass over x's rows, kQuantizeRows rows a task (rounding x is a pass over all of it: a thread per range of
// rows, not one for the whole step); FILL returns false where a range cannot take the path.
using RowsFill = bool (*)(const octavo::BlockWeights&, octavo::Activations&, int64_t first, int64_t last);

struct RowsJob {
  const octavo::BlockWeights* weights;
  octavo::Activations* activations;
  RowsFill fill;
  int64_t rows;  // the rows the pass covers
  uint8_t* ok;   // per range
};

void rows_task(void* user_data, size_t index) {
  const auto* job = static_cast<const RowsJob*>(user_data);
  const int64_t first = static_cast<int64_t>(index) * kQuantizeRows;
  job->ok[index] = job->fill(*job->weights, *job->activations, first, std::min(job->rows, first + kQuantizeRows));
}

// FILL over rows [0, ROWS) on the session's threads: true when every range could take its path.
bool for_rows(const OrtApi* api, OrtKernelContext* context, const octavo::BlockWeights& w, octavo::Activations& a,
              int64_t rows, RowsFill fill) {
  const int64_t ranges = (rows + kQuantizeRows - 1) / kQuantizeRows;
  std::vector<uint8_t> ok(static_cast<size_t>(ranges), 0);
  RowsJob job{&w, &a, fill, rows, ok.data()};
  octavo::glue::parallel_for(api, context, rows_task, static_cast<size_t>(ranges), &job);
  return std::all_of(ok.begin(), ok.end(), [](uint8_t v) { return v != 0; });
}

bool bf16_rows(const octavo::BlockWeights& w, octavo::Activations& a, int64_t first, int64_t last) {
  octavo::bf16_rows(w, a, first, last);
  return true;
}

bool int_rows(const octavo::BlockWeights& w, octavo::Activations& a, int64_t first, int64_t last) {
  octavo::int_rows(w, a, first, last);
  return true;
}

struct Kernel {
  const OrtApi* api;
  int64_t k, n, bits, block_size;
  std::vector<int64_t> splits;  // columns of each output ({N}: one output)
  bool prompt_bf16;             // the float32 path's steps may take the bfloat16 path (block_matmul_kernel.h)
  bool prompt_amx;              // ... or, otherwise, the float32-grade AMX path (block_matmul_kernel.h)
  bool prompt_int8;             // ... or first, x rounded to int8 per 32 values (block_matmul_int8.cc)
  bool decode_int8;             // the 16-bit path's steps take the int8 path instead (block_matmul_int8.cc)
  octavo::SmallCodes small_codes{};  // 8-bit codes: whether they are all below 64 (decode_int8 nodes)

  void compute(OrtKernelContext* context) const {
    size_t count = 0;
    check(api, api->KernelContext_GetInputCount(context, &count));
    const OrtValue* values[8] = {};
    for (size_t i = 0; i < count && i < 8; ++i) check(api, api->KernelContext_GetInput(context, i, &values[i]));
    for (size_t i = 0; i < 4; ++i) {
      if (values[i] == nullptr) fail("input " + std::to_string(i) + " is missing");
    }
    const octavo::glue::TensorInfo x = describe(api, values[0]), codes = describe(api, values[1]);
    const octavo::glue::TensorInfo scales = describe(api, values[2]), offsets = describe(api, values[3]);
    if (x.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) fail("x must be float32");
    if (x.dims.empty() || x.dims.back() != k) fail("x " + shape_string(x.dims) + " must end in K = " + std::to_string(k));
    const int64_t panels = (n + octavo::kPanel - 1) / octavo::kPanel, nb = k / block_size;
    const std::vector<int64_t> want_codes{panels, k / 2, 32 * bits / 8}, want_scales{panels, nb, octavo::kPanel};
    if (codes.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 || codes.dims != want_codes) {
      fail("codes must be uint8 " + shape_string(want_codes) + ", got " + shape_string(codes.dims));
    }
    const bool two_level = values[6] != nullptr || values[7] != nullptr;
    const bool half = scales.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    if (two_level) {
      if (scales.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8 || scales.dims != want_scales) {
        fail("with scale_super, scales must be int8 " + shape_string(want_scales) + ", got " + shape_string(scales.dims));
      }
    } else if ((!half && scales.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) || scales.dims != want_scales) {
      fail("scales must be float32 or float16 (int8 with scale_super) " + shape_string(want_scales) + ", got " +
           shape_string(scales.dims));
    }
    if (offsets.type != scales.type || offsets.dims != want_scales) {
      fail("offsets must have the scales' type and shape " + shape_string(want_scales) + ", got " + shape_string(offsets.dims));
    }
    octavo::BlockWeights w;
    if (two_level) {
      if (values[6] == nullptr || values[7] == nullptr) fail("scale_super and offset_super come together");
      w.super_shift = octavo::block_inputs::super_shift(describe(api, values[6]), describe(api, values[7]), {panels},
                                                        nb, "");
      w.scale_super = octavo::glue::data_of<const float>(api, values[6]);
      w.offset_super = octavo::glue::data_of<const float>(api, values[7]);
    }
    w.codes = octavo::glue::data_of<const uint8_t>(api, values[1]);
    w.scales = octavo::glue::data_of<const void>(api, values[2]);
    w.offsets = octavo::glue::data_of<const void>(api, values[3]);
    w.half_scales = half;
    w.bits = static_cast<int>(bits);
    w.k = k;
    w.n = n;
    w.block_size = block_size;
    if (count > 4 && values[4] != nullptr) {
      const octavo::glue::TensorInfo bias = describe(api, values[4]);
      if (bias.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || bias.dims != std::vector<int64_t>{n}) {
        fail("bias must be float32 [" + std::to_string(n) + "], got " + shape_string(bias.dims));
      }
      w.bias = octavo::glue::data_of<const float>(api, values[4]);
    }
    bool decode = false;
    if (count > 5 && values[5] != nullptr) {
      const octavo::glue::TensorInfo flag = describe(api, values[5]);
      if (flag.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL || flag.dims != std::vector<int64_t>{1}) {
        fail("decode_step must be bool [1], got " + shape_string(flag.dims));
      }
      decode = *octavo::glue::data_of<const bool>(api, values[5]);
    }
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < x.dims.size(); ++i) rows *= x.dims[i];
    std::vector<int64_t> out_dims = x.dims;
    octavo::Outputs y;
    for (const int64_t columns : splits) {
      out_dims.back() = columns;
      OrtValue* output = nullptr;
      check(api, api->KernelContext_GetOutput(context, static_cast<size_t>(y.count), out_dims.data(), out_dims.size(),
                                              &output));
      y.data[y.count] = octavo::glue::data_of<float>(api, output);
      y.columns[y.count++] = columns;
    }
    if (rows == 0) return;
    octavo::Activations activations;
    bool int8_tried = false;
    if (octavo::begin_activations(w, octavo::glue::data_of<const float>(api, values[0]), rows, decode, activations)) {
      // a step the 16-bit path may take: the int8 path instead where the node asks (a non-finite x: float32)
      w.small_codes = decode_int8 && bits == 8 &&
                      small_codes.check(w.codes, panels * (k / 2) * 32);  // scanned once (Q6_K, Q5_x: yes; Q8_0: no)
      if (decode_int8 && octavo::begin_int8(w, activations)) {
        int8_tried = true;
        activations.int8 = for_rows(api, context, w, activations, rows, octavo::int8_rows);
      } else {
        activations.integer = for_rows(api, context, w, activations, rows, octavo::quantize_rows);
        if (octavo::begin_amx_int(w, activations)) for_rows(api, context, w, activations, octavo::amx_rows(rows), int_rows);
      }
    }
    if (prompt_int8 && !int8_tried && !activations.integer && octavo::begin_int8(w, activations)) {
      activations.int8 = for_rows(api, context, w, activations, rows, octavo::int8_rows);
    }
    if (activations.int8) {
      // the int8 path (block_matmul_int8.cc)
    } else if (prompt_bf16 && !activations.integer && octavo::begin_bf16(w, activations)) {
      for_rows(api, context, w, activations, octavo::amx_rows(rows), bf16_rows);
    } else if (prompt_amx && !activations.integer && octavo::begin_split(w, activations)) {
      // a value the split path refuses (not finite, huge, tiny): the whole step takes the float32 path
      activations.split = for_rows(api, context, w, activations, octavo::amx_rows(rows), octavo::split_rows);
    }
    const int64_t per_task = octavo::block_matmul_task_panels(activations);
    const int64_t rows_per_task = octavo::block_matmul_task_rows(w, activations);
    const int64_t panel_tasks = (panels + per_task - 1) / per_task, row_tasks = (rows + rows_per_task - 1) / rows_per_task;
    Job job{&w, &activations, &y, per_task, panels, rows_per_task, panel_tasks};
    octavo::glue::parallel_for(api, context, run_task, static_cast<size_t>(panel_tasks * row_tasks), &job);
  }
};

struct BlockMatMulOp : OrtCustomOp {
  BlockMatMulOp() : OrtCustomOp{} {
    octavo::glue::fill_common(*this);
    GetName = [](const OrtCustomOp*) { return "BlockMatMul"; };
    GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 8; };
    GetInputType = [](const OrtCustomOp*, size_t i) {
      switch (i) {
        case 1: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
        case 5: return ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL;
        case 2:
        case 3: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;  // float32, float16 or int8, checked at run time
        default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
      }
    };
    GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return octavo::Outputs::kMax; };
    GetInputCharacteristic = [](const OrtCustomOp*, size_t i) {
      return i < 4 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
    };
    GetOutputCharacteristic = [](const OrtCustomOp*, size_t i) {
      return i == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;  // outputs 1-3: the parts of splits
    };
    CreateKernelV2 = [](const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo* info, void** kernel) -> OrtStatus* {
      try {
        using octavo::block_inputs::attribute;
        const int64_t k = attribute(api, info, "K"), n = attribute(api, info, "N");
        const int64_t bits = attribute(api, info, "bits"), block_size = attribute(api, info, "block_size");
        octavo::block_inputs::check_layout(k, n, bits, block_size);
        std::vector<int64_t> splits = optional_ints(api, info, "splits");
        if (splits.empty()) splits = {n};
        if (splits.size() > static_cast<size_t>(octavo::Outputs::kMax)) {
          fail("splits has " + std::to_string(splits.size()) + " parts; at most " + std::to_string(octavo::Outputs::kMax));
        }
        int64_t total = 0;
        for (size_t i = 0; i < splits.size(); ++i) {
          if (splits[i] <= 0 || (i + 1 < splits.size() && splits[i] % octavo::kPanel != 0)) {
            fail("splits " + shape_string(splits) + ": every part must be positive and all but the last a multiple of " +
                 std::to_string(octavo::kPanel));
          }
          total += splits[i];
        }
        if (total != n) fail("splits " + shape_string(splits) + " must sum to N = " + std::to_string(n));
        size_t outputs = 0;
        check(api, api->KernelInfo_GetOutputCount(info, &outputs));
        if (outputs != splits.size()) {
          fail("the node has " + std::to_string(outputs) + " outputs; splits " + shape_string(splits) + " needs " +
               std::to_string(splits.size()));
        }
        const int64_t prompt_bf16 = optional_int(api, info, "prompt_bf16", 0);
        if (prompt_bf16 != 0 && prompt_bf16 != 1) fail("prompt_bf16 must be 0 or 1, got " + std::to_string(prompt_bf16));
        const int64_t prompt_amx = optional_int(api, info, "prompt_amx", 1);
        if (prompt_amx != 0 && prompt_amx != 1) fail("prompt_amx must be 0 or 1, got " + std::to_string(prompt_amx));
        const int64_t prompt_int8 = optional_int(api, info, "prompt_int8", 0);
        if (prompt_int8 != 0 && prompt_int8 != 1) fail("prompt_int8 must be 0 or 1, got " + std::to_string(prompt_int8));
        const int64_t decode_int8 = optional_int(api, info, "decode_int8", 0);
        if (decode_int8 != 0 && decode_int8 != 1) fail("decode_int8 must be 0 or 1, got " + std::to_string(decode_int8));
        *kernel = new Kernel{api, k, n, bits, block_size, std::move(splits), prompt_bf16 == 1, prompt_amx == 1,
                             prompt_int8 == 1, decode_int8 == 1};
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

const OrtCustomOp& block_matmul_schema() {
  static const BlockMatMulOp op;
  return op;
}

}  // namespace octavo
