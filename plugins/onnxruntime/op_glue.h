// Shared ONNX Runtime custom-op glue of octavo's ops (PagedAttention, Int8Residual, FoldRows, BlockMatMul): an
// exception carrying an OrtErrorCode and its conversion to an OrtStatus, status checking, tensor type/shape/data
// queries, ORT's thread pool with a serial fallback, and the OrtCustomOp callbacks they all set the same way.
#pragma once

#include <onnxruntime_c_api.h>

#include <exception>
#include <string>
#include <vector>

namespace octavo::glue {

// Thrown inside a kernel, turned into an OrtStatus at the C boundary (run).
struct Failure {
  OrtErrorCode code;
  std::string message;
};

[[noreturn]] inline void fail(const std::string& message, OrtErrorCode code = ORT_INVALID_ARGUMENT) {
  throw Failure{code, message};
}

inline void check(const OrtApi* api, OrtStatus* status) {
  if (status == nullptr) return;
  Failure f{api->GetErrorCode(status), api->GetErrorMessage(status)};
  api->ReleaseStatus(status);
  throw f;
}

struct TensorInfo {
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  std::vector<int64_t> dims;
};

inline TensorInfo describe(const OrtApi* api, const OrtValue* value) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  check(api, api->GetTensorTypeAndShape(value, &info));
  TensorInfo out;
  size_t rank = 0;
  OrtStatus* status = api->GetTensorElementType(info, &out.type);
  if (status == nullptr) status = api->GetDimensionsCount(info, &rank);
  if (status == nullptr) {
    out.dims.resize(rank);
    status = api->GetDimensions(info, out.dims.data(), rank);
  }
  api->ReleaseTensorTypeAndShapeInfo(info);
  check(api, status);
  return out;
}

template <typename T>
T* data_of(const OrtApi* api, const OrtValue* value) {
  void* ptr = nullptr;
  check(api, api->GetTensorMutableData(const_cast<OrtValue*>(value), &ptr));
  return static_cast<T*>(ptr);
}

inline std::string shape_string(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// fn(data, 0..count-1) on ORT's intra-op thread pool, or serially if there is none.
inline void parallel_for(const OrtApi* api, OrtKernelContext* context, void (*fn)(void*, size_t), size_t count,
                         void* data) {
  if (count == 0) return;
  if (count > 1) {
    OrtStatus* status = api->KernelContext_ParallelFor(context, fn, count, 0, data);
    if (status == nullptr) return;
    api->ReleaseStatus(status);
  }
  for (size_t i = 0; i < count; ++i) fn(data, i);
}

// KernelComputeV2 for a kernel with `api` and `compute(context)`: exceptions become a status prefixed PREFIX.
template <typename Kernel>
OrtStatus* run(void* kernel, OrtKernelContext* context, const char* prefix) {
  auto* k = static_cast<Kernel*>(kernel);
  try {
    k->compute(context);
    return nullptr;
  } catch (const Failure& f) {
    return k->api->CreateStatus(f.code, (std::string(prefix) + f.message).c_str());
  } catch (const std::exception& e) {
    return k->api->CreateStatus(ORT_FAIL, (std::string(prefix) + e.what()).c_str());
  }
}

// Every callback but the name, arity, characteristics and kernel ones: float tensors in and out (override
// GetInputType / GetOutputType after this for other types), CPU, no aliasing, any opset version.
inline void fill_common(OrtCustomOp& op) {
  op.version = ORT_API_VERSION;
  op.CreateKernel = nullptr;
  op.KernelCompute = nullptr;
  op.GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return nullptr; };
  op.GetInputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; };
  op.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
  op.GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op.InferOutputShapeFn = nullptr;
  op.GetStartVersion = [](const OrtCustomOp*) { return 1; };
  op.GetEndVersion = [](const OrtCustomOp*) { return 1 << 30; };
  op.GetMayInplace = [](int** input_index, int** output_index) -> size_t {
    *input_index = nullptr;
    *output_index = nullptr;
    return 0;
  };
  op.ReleaseMayInplace = [](int*, int*) {};
  op.GetAliasMap = [](int** input_index, int** output_index) -> size_t {
    *input_index = nullptr;
    *output_index = nullptr;
    return 0;
  };
  op.ReleaseAliasMap = [](int*, int*) {};
}

}  // namespace octavo::glue
