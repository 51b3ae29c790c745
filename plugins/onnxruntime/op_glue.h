// Shared ONNX Runtime custom-op glue of octavo's small ops (Int8Residual, FoldRows, BlockMatMul): an exception
// carrying an OrtErrorCode, status checking, and the OrtCustomOp callbacks they all set the same way.
#pragma once

#include <onnxruntime_c_api.h>

#include <string>

namespace octavo::glue {

struct Failure {
  OrtErrorCode code;
  std::string message;
};

inline void check(const OrtApi* api, OrtStatus* status) {
  if (status == nullptr) return;
  Failure f{api->GetErrorCode(status), api->GetErrorMessage(status)};
  api->ReleaseStatus(status);
  throw f;
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
