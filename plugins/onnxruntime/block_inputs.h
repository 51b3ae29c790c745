// Checks shared by the ops that read octavo.BlockMatMul's weight layout (block_matmul_kernel.h): BlockMatMul,
// BlockGather and MoE's block experts. Their attributes and the two-level scales' supers are checked one way.
#pragma once

#include <onnxruntime_c_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "op_glue.h"

namespace octavo::block_inputs {

// The int attribute NAME (required: ORT's error where it is absent).
inline int64_t attribute(const OrtApi* api, const OrtKernelInfo* info, const char* name) {
  int64_t value = 0;
  glue::check(api, api->KernelInfoGetAttribute_int64(info, name, &value));
  return value;
}

// A layout's attributes: K and N positive, bits 4 or 8, block_size a positive multiple of 4 that divides K.
inline void check_layout(int64_t k, int64_t n, int64_t bits, int64_t block_size) {
  if (k <= 0 || n <= 0) glue::fail("K and N must be positive");
  if (bits != 4 && bits != 8) glue::fail("bits must be 4 or 8, got " + std::to_string(bits));
  if (block_size <= 0 || block_size % 4 != 0 || k % block_size != 0) {
    glue::fail("block_size (" + std::to_string(block_size) + ") must be a multiple of 4 that divides K (" +
               std::to_string(k) + ")");
  }
}

// Two-level scales: SS and OS (scale_super, offset_super) must be float32 LEAD + [nb / G, 16], G blocks a
// super-block, a power of two dividing nb. Returns log2(G). WHAT: what the message names first ("" or a part).
inline int super_shift(const glue::TensorInfo& ss, const glue::TensorInfo& os, std::vector<int64_t> lead, int64_t nb,
                       const std::string& what) {
  const size_t rank = lead.size() + 2;
  const int64_t supers = ss.dims.size() == rank ? ss.dims[lead.size()] : 0;
  int shift = 0;
  while (supers > 0 && (supers << shift) < nb) ++shift;
  std::string want = "[";
  for (const int64_t d : lead) want += std::to_string(d) + ", ";
  lead.push_back(supers);
  lead.push_back(16);
  if (ss.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || supers <= 0 || (supers << shift) != nb || ss.dims != lead ||
      os.type != ss.type || os.dims != ss.dims) {
    glue::fail(what + "scale_super and offset_super must be float32 " + want + "nb / G, 16] with G a power of two "
               "dividing nb = " + std::to_string(nb) + ", got " + glue::shape_string(ss.dims) + " and " +
               glue::shape_string(os.dims));
  }
  return shift;
}

}  // namespace octavo::block_inputs
