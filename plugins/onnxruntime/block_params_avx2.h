// BlockMatMul's AVX2 helpers shared by its float32 / 16-bit paths (block_matmul_kernel.cc) and its int8 path
// (block_matmul_int8.cc): one panel's 16 float32 scales or offsets of a block, in two 8-lane registers.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <cstdint>

#include "block_matmul_kernel.h"

namespace octavo {

struct Vec2 {  // one panel of 16 floats
  __m256 lo, hi;
};

// The 16 float32 scales (BASE = w.scales, SUPER = w.scale_super) or offsets (w.offsets, w.offset_super) of the
// block at INDEX = (p * nb + b) * kPanel. Two-level scales: int8 factor times the super-block's float32, one
// rounding (exact for a K-quant's values), the float32 a one-level layout stores.
inline Vec2 load_params(const BlockWeights& w, const void* base, const float* super, int64_t index) {
  if (super != nullptr) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + index));
    const float* s = w.super_at(super, index);
    return {_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_loadu_ps(s)),
            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), _mm256_loadu_ps(s + 8))};
  }
  if (w.half_scales) {
    const auto* h = static_cast<const uint16_t*>(base) + index;
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 8)))};
  }
  const float* f = static_cast<const float*>(base) + index;
  return {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)};
}

}  // namespace octavo

#endif
