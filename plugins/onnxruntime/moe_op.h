// Schema of octavo.MoE (moe_op.cc), registered beside PagedAttention.
#pragma once

#include <onnxruntime_c_api.h>

namespace octavo {

const OrtCustomOp& moe_schema();

}  // namespace octavo
