// Schema of octavo.BlockGather (block_gather_op.cc), registered beside PagedAttention.
#pragma once

#include <onnxruntime_c_api.h>

namespace octavo {

const OrtCustomOp& block_gather_schema();

}  // namespace octavo
