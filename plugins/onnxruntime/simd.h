// Portable SIMD helpers built on GCC/Clang vector extensions: the compiler picks the instructions
// for the target (-march=native), no intrinsics. Width follows the widest float vector available.
#pragma once

#include <cstdint>
#include <cstring>

namespace octavo::simd {

#if defined(__AVX512F__)
constexpr int kWidth = 16;
#elif defined(__AVX__)
constexpr int kWidth = 8;
#else
constexpr int kWidth = 4;
#endif

typedef float vf __attribute__((vector_size(kWidth * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(kWidth * sizeof(int32_t))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

inline vf splat(float x) { return vf{} + x; }

// Keeps a loaded vector in a register for its reuses. Without it GCC may fold the load into every
// FMA that uses it, which doubles the loads of the register-blocked micro-kernels (~20% slower
// prefill). An empty asm statement: no instruction is emitted.
inline void keep_in_register(vf& v) {
#if defined(__GNUC__) && defined(__x86_64__) && defined(__AVX512F__)
  __asm__("" : "+v"(v));
#elif defined(__GNUC__) && defined(__x86_64__)
  __asm__("" : "+x"(v));
#else
  (void)v;
#endif
}

inline vf max(vf a, vf b) { return a > b ? a : b; }

inline vf min(vf a, vf b) { return a < b ? a : b; }

inline float reduce_add(vf v) {
  float s = 0.0f;
  for (int i = 0; i < kWidth; ++i) s += v[i];
  return s;
}

inline float reduce_max(vf v) {
  float m = v[0];
  for (int i = 1; i < kWidth; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// Horizontal sums of kWidth vectors at once: lane i of the result is the sum of v[i * stride]'s lanes.
// A tree of pairwise shuffles + adds (kWidth - 1 adds in all) instead of kWidth scalar reductions.
template <int Block>
__attribute__((always_inline)) inline vf fold_pair(vf x, vf y) {  // x, y hold one key per 2*Block lanes; result one per Block lanes
  vi lo, hi;
  for (int q = 0; q < kWidth / Block; ++q) {
    const int source = (q % 2 == 0) ? 0 : kWidth;
    const int base = (q / 2) * 2 * Block;
    for (int l = 0; l < Block; ++l) {
      lo[q * Block + l] = source + base + l;
      hi[q * Block + l] = source + base + Block + l;
    }
  }
  return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}

template <int N, int Stride = 1>
__attribute__((always_inline)) inline vf reduce_lanes(const vf* v) {
  if constexpr (N == 1) {
    return v[0];
  } else {
    return fold_pair<kWidth / N>(reduce_lanes<N / 2, Stride * 2>(v), reduce_lanes<N / 2, Stride * 2>(v + Stride));
  }
}

constexpr float kLog2e = 1.44269504088896341f;
// t + kRound - kRound rounds |t| < 2^22 to the nearest integer (ties to even), whose value the sum's low bits hold
constexpr float kRound = 12582912.0f;  // 1.5 * 2^23

// exp(x) in float, relative error ~1e-7 (Cephes-style polynomial); inputs below -87.3 give exactly 0.
__attribute__((always_inline)) inline vf exp(vf x) {
  const vf lo = splat(-87.3f);
  const vf xc = min(max(x, lo), splat(88.3f));
  const vf rounded = xc * kLog2e + kRound;  // round(x / ln 2)
  const vf n = rounded - kRound;
  vf r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  const vf result = p * two_n;
  // NaN stays NaN (the clamps above turn it into -87.3, whose exp is 1.2e-38): a NaN score then reaches the
  // op's output, and the sampler fails the step, instead of a finite average of the values hiding it
  return x != x ? x : (x < lo ? splat(0.0f) : result);
}

// exp(d) for d <= 0 (a score minus its row's running maximum: the prefill softmax's one exp per score) in fewer
// operations than exp above (15 against ~21): t = d log2(e), n = round(t) by kRound (t + kRound's low bits hold n),
// 2^(t - n) by a degree-5 polynomial fitted to the relative error on [-1/2, 1/2] with p(0) = 1 (a row's maximum
// still gets probability 1), and n added to its exponent bits. Relative error: the polynomial's ~2e-7 plus
// t's rounding, |t| 2^-24 ln 2: <= 1.01e-6 for results above 1e-7, <= 3.65e-6 down to 1e-30 (tests/test_simd_exp.py;
// exp above: ~8e-8 throughout, by a two-part ln 2) — in a softmax, errors far below the float32 sums' own. Exactly
// 0 below t = -126, and for -inf and NaN (clamped first; unlike exp, which keeps NaN: the prefill path still
// carries a NaN query to the output, test_op's NaN test).
__attribute__((always_inline)) inline vf exp_nonpositive(vf d) {
  typedef uint32_t vu __attribute__((vector_size(kWidth * sizeof(uint32_t))));
  const vf t = max(d * kLog2e, splat(-127.0f));  // -inf and NaN -> -127
  const vf r = t + kRound;
  const vf f = t - (r - kRound);  // exact: |t - n| <= 1/2
  vf p = splat(1.3302209554240108e-3f);
  p = p * f + 9.6729323267936707e-3f;
  p = p * f + 5.5506151169538498e-2f;
  p = p * f + 2.4022217094898224e-1f;
  p = p * f + 6.9314706325531006e-1f;
  p = p * f + 1.0f;
  vu bits, n;
  std::memcpy(&bits, &p, sizeof bits);
  std::memcpy(&n, &r, sizeof n);
  bits += n << 23;  // r's mantissa is 2^22 + n: the 2^22 and r's exponent bits shift out of the 32
  vf result;
  std::memcpy(&result, &bits, sizeof result);
  return t < -126.0f ? splat(0.0f) : result;
}

// c * tanh(x / c), via tanh(y) = 1 - 2 / (exp(2y) + 1).
inline vf softcap(vf x, float c) {
  const vf e = exp(x * (2.0f / c));
  return (1.0f - 2.0f / (e + 1.0f)) * c;
}

}  // namespace octavo::simd
