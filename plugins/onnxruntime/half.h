// IEEE 754 binary16 ("fp16") <-> float32 conversion for float16 KV pools.
//
// The pools hold raw binary16 bit patterns (uint16_t). Writing rounds to nearest, ties to even (what
// numpy's astype(float16) does); reading widens exactly. With F16C (any -march that has it: haswell,
// znver*, ...) 8 or 16 values convert per instruction; otherwise portable scalar code does the same
// rounding bit by bit (infinities, NaN, subnormals included).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "simd.h"

namespace octavo::half {

inline uint32_t bits_of(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  return x;
}

inline float float_of(uint32_t x) {
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}

// float32 -> binary16, round to nearest even; overflow gives infinity, NaN stays NaN (quiet).
inline uint16_t from_float(float f) {
  const uint32_t x = bits_of(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) {  // infinity or NaN (keep the top payload bits, force quiet)
    return sign | 0x7c00u | (ax > 0x7f800000u ? static_cast<uint16_t>(0x0200u | ((ax >> 13) & 0x3ffu)) : 0u);
  }
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520: rounds past the largest half (65504)
  if (ax < 0x38800000u) {  // below 2^-14: a subnormal half (or zero); its units are 2^-24
    // |f| * 2^24 is exact (a power-of-two scale, no overflow); nearbyint rounds half to even.
    const float units = std::nearbyint(float_of(ax) * 16777216.0f);
    return sign | static_cast<uint16_t>(units);  // 1024 units is the smallest normal, encoded alike
  }
  // Normal: rebias the exponent (127 -> 15) and drop 13 mantissa bits, rounding to nearest even;
  // a carry out of the mantissa correctly bumps the exponent.
  const uint32_t rounded = ax + 0xfffu + ((ax >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - (112u << 23)) >> 13);
}

// binary16 -> float32, exact.
inline float to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float magnitude = static_cast<float>(mantissa) * (1.0f / 16777216.0f);
    return float_of(sign | bits_of(magnitude));
  }
  if (exponent == 31) return float_of(sign | 0x7f800000u | (mantissa << 13));
  return float_of(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// dst[0..n) = fp16(src[0..n)).
inline void from_floats(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
#endif
  for (; i < n; ++i) dst[i] = from_float(src[i]);
}

// dst[0..n) = float(src[0..n)).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 flags _mm512_cvtph_ps's own undefined source
#endif
inline void to_floats(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  }
#endif
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#endif
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// simd::kWidth float16 values widened into one float vector (exact).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
inline simd::vf load_widened(const uint16_t* src) {
#if defined(__F16C__) && defined(__AVX512F__)
  static_assert(simd::kWidth == 16);
  return reinterpret_cast<simd::vf>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))));
#elif defined(__F16C__) && defined(__AVX__)
  static_assert(simd::kWidth == 8);
  return reinterpret_cast<simd::vf>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
#else
  simd::vf v;
  for (int i = 0; i < simd::kWidth; ++i) v[i] = to_float(src[i]);
  return v;
#endif
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

}  // namespace octavo::half
