// int8 KV pools: one row per (pool slot, kv head) of head_dim signed 8-bit codes followed by the row's scale,
// an IEEE binary16 (2 bytes, little endian), so a row takes head_dim + 2 bytes (float16: 2 * head_dim).
//
//   scale = fp16(max_d |x[d]| / 127)            (round to nearest even; capped at 65504, the largest half)
//   code[d] = clamp(rint(x[d] / float(scale)), -127, 127)   (ties to even; 0 everywhere when the scale is 0)
//   x'[d] = code[d] * float(scale)              (exact in float32: 8 bits times an 11-bit significand)
//
// Per row, not per group of 32 as llama.cpp's q8_0: one scale per head row keeps the row within one
// cache-friendly run and costs 2 bytes per head_dim (64: 0.52x the bytes of float16; 128: 0.51x). NaN does not
// survive the round trip (it is ignored by the maximum and saturates to +127); infinities saturate too.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "half.h"
#include "simd.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace octavo::kv_int8 {

constexpr int64_t kScaleBytes = 2;
constexpr uint16_t kMaxHalf = 0x7bff;  // 65504

inline int64_t row_bytes(int64_t head_dim) { return head_dim + kScaleBytes; }

// The scale of a row: its float value (what dequantization multiplies by).
inline float scale_of(const uint8_t* row, int64_t head_dim) {
  uint16_t bits;
  std::memcpy(&bits, row + head_dim, sizeof(bits));
  return half::to_float(bits);
}

// x[0..head_dim) into ROW (head_dim codes, then the scale).
inline void quantize_row(const float* x, int64_t head_dim, uint8_t* row) {
  float amax = 0.0f;
  for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::fabs(x[d]));  // a NaN compares false: ignored
  uint16_t bits = half::from_float(amax / 127.0f);
  if ((bits & 0x7fff) > kMaxHalf) bits = kMaxHalf;  // an infinite maximum
  const float scale = half::to_float(bits);
  int8_t* codes = reinterpret_cast<int8_t*>(row);
  for (int64_t d = 0; d < head_dim; ++d) {
    const float q = scale == 0.0f ? 0.0f : std::nearbyint(x[d] / scale);
    codes[d] = static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, q)));  // std::min(127, NaN) is 127
  }
  std::memcpy(row + head_dim, &bits, sizeof(bits));
}

// dst[0..head_dim) = the row's codes times its scale.
inline void dequantize_row(const uint8_t* row, int64_t head_dim, float* dst) {
  const float scale = scale_of(row, head_dim);
  const int8_t* codes = reinterpret_cast<const int8_t*>(row);
#pragma omp simd
  for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(codes[d]) * scale;
}

// simd::kWidth codes widened into one float vector (exact). GCC's __builtin_convertvector of an int8 vector
// converts lane by lane in scalar code, hence the intrinsics where the build has them.
inline simd::vf load_widened(const int8_t* src) {
#if defined(__AVX512F__)
  static_assert(simd::kWidth == 16);
  return reinterpret_cast<simd::vf>(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)))));
#elif defined(__AVX2__)
  static_assert(simd::kWidth == 8);
  return reinterpret_cast<simd::vf>(
      _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)))));
#else
  simd::vf v;
  for (int i = 0; i < simd::kWidth; ++i) v[i] = static_cast<float>(src[i]);
  return v;
#endif
}

}  // namespace octavo::kv_int8
