// Schema of octavo.BlockMatMul (block_matmul_op.cc), registered beside PagedAttention.
#pragma once

#include <onnxruntime_c_api.h>

namespace octavo {

const OrtCustomOp& block_matmul_schema();

}  // namespace octavo
