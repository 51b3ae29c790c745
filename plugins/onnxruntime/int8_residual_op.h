// Schemas of octavo.Int8Residual and octavo.FoldRows (int8_residual_op.cc), registered beside PagedAttention.
#pragma once

#include <onnxruntime_c_api.h>

namespace octavo {

const OrtCustomOp& int8_residual_schema();
const OrtCustomOp& fold_rows_schema();

}  // namespace octavo
