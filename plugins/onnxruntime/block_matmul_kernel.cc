// octavo.BlockMatMul's compute (layout, paths and precision: block_matmul_kernel.h).
//
// One panel (16 output columns) at a time, all rows of x against it, on the 16-bit path unless a step refuses it:
// - decode steps (<= kIntRows rows): per pair of k, the 32 codes of the panel widen to int16 and meet the
//   rows' 16-bit activations in _mm256_madd_epi16 (16 multiply-adds an instruction, exact int32 sums); each
//   block's sums are scaled once in float32. The weights are streamed once, at ~11 instructions per 32 (4-bit
//   blocks of up to 256: the codes of columns 8-15 stay 16 x code, which saves a shift per 64 codes).
// - larger decode-only steps (a batch of sequences, one token each): a chunk of whole blocks of each of kGroup
//   panels is widened to int16 once into per-thread buffers (L1/L2), then tiles of 6 rows x 16 columns take
//   each block's exact int32 sums from the buffer (6 x 2 int32 accumulators, two madd + two add per pair of k
//   and row: twice the multiply-adds per instruction of a float32 FMA) and scale them into float32 per block,
//   in the decode kernel's order (a row's y is the same bits in a batch as alone). On AVX2 builds without VNNI
//   each block's pair loop is assembly (integer_sums: GCC spilled a third of the sums to the stack); a 2-core
//   Zen 3 (two madd a cycle, as many as FMAs) with SmolLM2's shapes at 48 rows: 3072 x 576 1121-1128 -> 776-789
//   us, 960 x 576 645 -> 307 us, the Q8_0 LM head 21.8 -> 13.4 ms; the float32 tiles take 926 us on the first.
// - the float32 path (a prompt's or a mixed step past 8 rows, and a step the 16-bit rounding refuses): a chunk
//   of the group's weights is dequantized into float32 buffers, then register-blocked 6 x 16 tiles of y
//   accumulate over them with FMAs.
// AVX2 + FMA intrinsics (x86-64-v3 and later; a scalar loop elsewhere). Builds with AVX-512 (the x86-64-v4
// variant, -march=native on such a CPU) run the two tiled paths 16 columns to a register, 6 rows x 4 panels
// (24 of the 32 registers accumulate; wide_tile, wide_integer_tile), in the same order per output: the same bits
// as the 256-bit tiles. Measured on a 2-core Xeon with AVX-512 + VNNI, SmolLM2's shapes: 1.5-1.75x the 256-bit
// float32 tiles at 64-2048 rows, 1.1-1.45x the 256-bit integer tiles at 16-64 rows.
// Written by hand: ONNX Runtime's own block-quantized matmul (MatMulNBits) is fast on CPU only when it rounds
// the activations to int8.
#include "block_matmul_kernel.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <memory>

#include <unistd.h>

#include "block_params_avx2.h"
#include "half.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define OCTAVO_BLOCK_AVX2 1
#endif

namespace octavo {
namespace {

constexpr float kMinBlockMax = 0x1p-64f;  // smallest nonzero block max |x| the 16-bit path takes
constexpr int64_t pair_bytes(int bits) { return 32 * bits / 8; }  // one panel's codes for a pair of k

#if defined(OCTAVO_BLOCK_AVX2)

constexpr int64_t kChunk = 1536;  // most k values per dequantized panel buffer (96 KiB; SmolLM2's K = 576, 1536: one)
constexpr int kTileRows = 6;      // rows of the register tile: 6 x 2 accumulators + 2 weights + 1 broadcast
constexpr int kIntTileRows = 6;   // rows of an integer tile: 6 x 2 int32 sums + 2 codes + 1 broadcast
constexpr int64_t kGroup = 4;     // panels sharing one pass over a row tile (their chunks: up to 384 KiB, in L2)
// Bytes of x (rows of one chunk) a task of the float32 path takes at most: half the L2 (128 KiB - 1 MiB; 512
// KiB L2 assumed where sysconf does not say). A group's pass over those rows then reads them from L2, and so do
// the thread's next groups over the same rows; with all rows in every task, each group of 64 columns streamed
// x from L3 again (one Ice Lake core: 2048 rows ran at 0.7x the speed of 192). Each group's chunk is
// dequantized again per row block: ~1 % more work at 280 rows.
int64_t row_block_bytes() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return std::clamp<int64_t>((l2 > 0 ? l2 : 512 << 10) / 2, 128 << 10, 1 << 20);
  }();
  return bytes;
}
static_assert(kChunk % 4 == 0, "chunks of whole 4-k steps (dequantize_chunk)");
constexpr int kPrefetchBytes = 8192;  // how far ahead of the codes being read the decode path prefetches
// Largest block whose int32 sums hold 16 x 4-bit codes times 16-bit activations: 2^31 / (32767 * 240) = 273.
constexpr int64_t kMaxScaledBlock = 256;

inline void store_panel(float* dst, int64_t valid, __m256 lo, __m256 hi) {
  if (valid == kPanel) {
    _mm256_storeu_ps(dst, lo);
    _mm256_storeu_ps(dst + 8, hi);
    return;
  }
  alignas(32) float tmp[kPanel];
  _mm256_store_ps(tmp, lo);
  _mm256_store_ps(tmp + 8, hi);
  std::memcpy(dst, tmp, valid * sizeof(float));
}

inline Vec2 load_panel(const float* src, int64_t valid) {
  if (valid == kPanel) return {_mm256_loadu_ps(src), _mm256_loadu_ps(src + 8)};
  alignas(32) float tmp[kPanel] = {};
  std::memcpy(tmp, src, valid * sizeof(float));
  return {_mm256_load_ps(tmp), _mm256_load_ps(tmp + 8)};
}

// The 32 codes of one panel and pair of k as int16 (8-bit codes): c0 = columns 0-7, c1 = columns 8-15, each
// lane pair (k, k+1).
inline void pair_codes(const uint8_t* p, __m256i& c0, __m256i& c1) {
  c0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  c1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
}

// The 64 codes of one panel and four k (4-bit codes, 32 bytes): a0/a1 = pair (k, k+1) columns 0-7 / 8-15,
// b0/b1 = pair (k+2, k+3); nibble i of 16-bit lane m belongs to register i.
inline void quad_codes(const uint8_t* p, __m256i& a0, __m256i& a1, __m256i& b0, __m256i& b1) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i mask = _mm256_set1_epi16(0x0F);
  a0 = _mm256_and_si256(v, mask);
  a1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  b0 = _mm256_and_si256(_mm256_srli_epi16(v, 8), mask);
  b1 = _mm256_srli_epi16(v, 12);
}

// quad_codes for the decode path: the same four registers, but b0 and b1 hold 16 x their codes (no shift).
// The sums they feed are scaled back by 1/16 in float32, which is exact, so the result equals quad_codes'.
// Needs 16 x the int32 headroom (kMaxScaledBlock).
inline void quad_codes_x16(const uint8_t* p, __m256i& a0, __m256i& a1, __m256i& b0, __m256i& b1) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i low = _mm256_set1_epi16(0x000F), high = _mm256_set1_epi16(0x00F0);
  const __m256i v8 = _mm256_srli_epi16(v, 8);
  a0 = _mm256_and_si256(v, low);
  a1 = _mm256_and_si256(v, high);
  b0 = _mm256_and_si256(v8, low);
  b1 = _mm256_and_si256(v8, high);
}

// s + the pairwise products of c and x's int16 lanes summed per int32 lane: one VNNI instruction where the
// build has it (AVX512-VNNI with VL, or AVX-VNNI: `-march=native` on such a CPU), madd + add otherwise. The
// same int32 result either way: |x| <= 32767 and codes < 2^8 keep every pair sum and running sum exact.
inline __m256i dot_add(__m256i s, __m256i c, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(s, c, x);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(s, c, x);
#else
  return _mm256_add_epi32(s, _mm256_madd_epi16(c, x));
#endif
}

inline int32_t pair_of(const int16_t* q) {  // two adjacent int16 as one 32-bit lane
  int32_t v;
  std::memcpy(&v, q, sizeof v);
  return v;
}

// Rows [r0, r0 + Rows) of y's panel p on the 16-bit path (Rows <= 4: int32 sums and codes fill the registers).
// X16 (4-bit only): codes of columns 8-15 widened as 16 x code (quad_codes_x16), one shift fewer per 64 codes.
template <int Bits, int Rows, bool X16 = false>
void integer_panel(const BlockWeights& w, const Activations& a, const Outputs& y, int64_t p, int64_t valid, int64_t r0) {
  static_assert(Rows >= 1 && Rows <= 4, "integer rows per pass");
  const int64_t nb = w.k / w.block_size, pairs = w.block_size / 2;
  const uint8_t* codes = w.codes + p * (w.k / 2) * pair_bytes(Bits);
  __m256 ylo[Rows], yhi[Rows];
  for (int r = 0; r < Rows; ++r) ylo[r] = yhi[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i s0[Rows], s1[Rows];
    for (int r = 0; r < Rows; ++r) s0[r] = s1[r] = _mm256_setzero_si256();
    const uint8_t* cb = codes + b * pairs * pair_bytes(Bits);
    const int16_t* q = a.q.get() + r0 * w.k + b * w.block_size;
    if constexpr (Bits == 8) {
#pragma GCC unroll 4
      for (int64_t j = 0; j < pairs; ++j) {
        __m256i c0, c1;
        _mm_prefetch(reinterpret_cast<const char*>(cb + j * pair_bytes(Bits)) + kPrefetchBytes, _MM_HINT_T0);
        pair_codes(cb + j * pair_bytes(Bits), c0, c1);
        for (int r = 0; r < Rows; ++r) {
          const __m256i xb = _mm256_set1_epi32(pair_of(q + r * w.k + 2 * j));
          s0[r] = dot_add(s0[r], c0, xb);
          s1[r] = dot_add(s1[r], c1, xb);
        }
      }
    } else {
#pragma GCC unroll 4
      for (int64_t j = 0; j < pairs; j += 2) {
        __m256i a0, a1, b0, b1;
        _mm_prefetch(reinterpret_cast<const char*>(cb + j * pair_bytes(Bits)) + kPrefetchBytes, _MM_HINT_T0);
        if constexpr (X16) {
          quad_codes_x16(cb + j * pair_bytes(Bits), a0, a1, b0, b1);
        } else {
          quad_codes(cb + j * pair_bytes(Bits), a0, a1, b0, b1);
        }
        for (int r = 0; r < Rows; ++r) {
          const __m256i xa = _mm256_set1_epi32(pair_of(q + r * w.k + 2 * j));
          const __m256i xb = _mm256_set1_epi32(pair_of(q + r * w.k + 2 * j + 2));
          s0[r] = dot_add(dot_add(s0[r], a0, xa), b0, xb);
          s1[r] = dot_add(dot_add(s1[r], a1, xa), b1, xb);
        }
      }
    }
    Vec2 scale = load_params(w, w.scales, w.scale_super, (p * nb + b) * kPanel);
    if constexpr (X16) scale.hi = _mm256_mul_ps(scale.hi, _mm256_set1_ps(0.0625f));  // exact: a power of two
    const Vec2 offset = load_params(w, w.offsets, w.offset_super, (p * nb + b) * kPanel);
    for (int r = 0; r < Rows; ++r) {
      const int64_t at = (r0 + r) * nb + b;
      const __m256 f = _mm256_set1_ps(a.q_scale[at]), sum = _mm256_set1_ps(a.block_sums[at]);
      ylo[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0[r]), _mm256_mul_ps(scale.lo, f), ylo[r]);
      yhi[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1[r]), _mm256_mul_ps(scale.hi, f), yhi[r]);
      ylo[r] = _mm256_fmadd_ps(offset.lo, sum, ylo[r]);
      yhi[r] = _mm256_fmadd_ps(offset.hi, sum, yhi[r]);
    }
  }
  const Vec2 bias = w.bias != nullptr ? load_panel(w.bias + p * kPanel, valid) : Vec2{_mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t stride = 0;
  float* const out = y.panel(p, stride);
  for (int r = 0; r < Rows; ++r) {
    store_panel(out + (r0 + r) * stride, valid, _mm256_add_ps(ylo[r], bias.lo), _mm256_add_ps(yhi[r], bias.hi));
  }
}

// Dequantize k in [k0, k1) (even bounds) of panel p into buf[(k - k0) * 16 + column].
template <int Bits>
void dequantize_chunk(const BlockWeights& w, int64_t p, int64_t k0, int64_t k1, float* buf) {
  const int64_t nb = w.k / w.block_size;
  const uint8_t* codes = w.codes + p * (w.k / 2) * pair_bytes(Bits);
  const __m256i low16 = _mm256_set1_epi32(0xFFFF);
  for (int64_t k = k0; k < k1;) {
    const int64_t b = k / w.block_size;
    const int64_t end = std::min(k1, (b + 1) * w.block_size);
    const Vec2 s = load_params(w, w.scales, w.scale_super, (p * nb + b) * kPanel);
    const Vec2 o = load_params(w, w.offsets, w.offset_super, (p * nb + b) * kPanel);
    const auto put_pair = [&](float* even, __m256i c0, __m256i c1) {  // rows k and k + 1 of the buffer
      _mm256_store_ps(even, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c0, low16)), s.lo, o.lo));
      _mm256_store_ps(even + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c1, low16)), s.hi, o.hi));
      _mm256_store_ps(even + kPanel, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(c0, 16)), s.lo, o.lo));
      _mm256_store_ps(even + kPanel + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(c1, 16)), s.hi, o.hi));
    };
    if constexpr (Bits == 8) {
      for (; k < end; k += 2) {
        __m256i c0, c1;
        pair_codes(codes + (k / 2) * pair_bytes(Bits), c0, c1);
        put_pair(buf + (k - k0) * kPanel, c0, c1);
      }
    } else {
      for (; k < end; k += 4) {
        __m256i a0, a1, b0, b1;
        quad_codes(codes + (k / 2) * pair_bytes(Bits), a0, a1, b0, b1);
        put_pair(buf + (k - k0) * kPanel, a0, a1);
        put_pair(buf + (k + 2 - k0) * kPanel, b0, b1);
      }
    }
  }
}

#if !defined(__AVX512F__)  // the 256-bit tiles (AVX-512 builds take wide_tile / wide_integer_tile)
// R rows of y's panel accumulate x[r, k0:k0+len] @ buf. Named accumulators, not an array: GCC keeps an
// array of __m256 in memory across the loop (a store per FMA).
template <int R>
void tile(const float* x, int64_t k_stride, const float* buf, int64_t len, __m256* lo, __m256* hi) {
  static_assert(R >= 1 && R <= 6, "tile rows");
  __m256 l0 = lo[0], h0 = hi[0], l1, h1, l2, h2, l3, h3, l4, h4, l5, h5;
  if constexpr (R > 1) l1 = lo[1], h1 = hi[1];
  if constexpr (R > 2) l2 = lo[2], h2 = hi[2];
  if constexpr (R > 3) l3 = lo[3], h3 = hi[3];
  if constexpr (R > 4) l4 = lo[4], h4 = hi[4];
  if constexpr (R > 5) l5 = lo[5], h5 = hi[5];
  const float* x1 = x + k_stride;
  const float* x2 = x + 2 * k_stride;
  const float* x3 = x + 3 * k_stride;
  const float* x4 = x + 4 * k_stride;
  const float* x5 = x + 5 * k_stride;
#pragma GCC unroll 4
  for (int64_t k = 0; k < len; ++k) {
    const __m256 w0 = _mm256_load_ps(buf + k * kPanel), w1 = _mm256_load_ps(buf + k * kPanel + 8);
    __m256 b = _mm256_broadcast_ss(x + k);
    l0 = _mm256_fmadd_ps(b, w0, l0);
    h0 = _mm256_fmadd_ps(b, w1, h0);
    if constexpr (R > 1) {
      b = _mm256_broadcast_ss(x1 + k);
      l1 = _mm256_fmadd_ps(b, w0, l1);
      h1 = _mm256_fmadd_ps(b, w1, h1);
    }
    if constexpr (R > 2) {
      b = _mm256_broadcast_ss(x2 + k);
      l2 = _mm256_fmadd_ps(b, w0, l2);
      h2 = _mm256_fmadd_ps(b, w1, h2);
    }
    if constexpr (R > 3) {
      b = _mm256_broadcast_ss(x3 + k);
      l3 = _mm256_fmadd_ps(b, w0, l3);
      h3 = _mm256_fmadd_ps(b, w1, h3);
    }
    if constexpr (R > 4) {
      b = _mm256_broadcast_ss(x4 + k);
      l4 = _mm256_fmadd_ps(b, w0, l4);
      h4 = _mm256_fmadd_ps(b, w1, h4);
    }
    if constexpr (R > 5) {
      b = _mm256_broadcast_ss(x5 + k);
      l5 = _mm256_fmadd_ps(b, w0, l5);
      h5 = _mm256_fmadd_ps(b, w1, h5);
    }
  }
  lo[0] = l0, hi[0] = h0;
  if constexpr (R > 1) lo[1] = l1, hi[1] = h1;
  if constexpr (R > 2) lo[2] = l2, hi[2] = h2;
  if constexpr (R > 3) lo[3] = l3, hi[3] = h3;
  if constexpr (R > 4) lo[4] = l4, hi[4] = h4;
  if constexpr (R > 5) lo[5] = l5, hi[5] = h5;
}

void tile_any(int rows, const float* x, int64_t k_stride, const float* buf, int64_t len, __m256* lo, __m256* hi) {
  switch (rows) {
    case 1: return tile<1>(x, k_stride, buf, len, lo, hi);
    case 2: return tile<2>(x, k_stride, buf, len, lo, hi);
    case 3: return tile<3>(x, k_stride, buf, len, lo, hi);
    case 4: return tile<4>(x, k_stride, buf, len, lo, hi);
    case 5: return tile<5>(x, k_stride, buf, len, lo, hi);
    default: return tile<kTileRows>(x, k_stride, buf, len, lo, hi);
  }
}

#endif

#if defined(__AVX512F__)
// The AVX-512 tile (x86-64-v4 builds, and -march=native on such a CPU): R rows x G panels of y, one 16-float
// register per row and panel (6 x 4 = 24 accumulators + 4 weights + 1 broadcast of the 32 registers). Per k, G
// loads of weights and R broadcasts of x feed R x G 16-wide FMAs: 2.4 FMAs per load, twice the 256-bit tile's
// width and 1.6 x its FMAs per load. Each output still sums over k in order, one FMA per k from the same start,
// so its bits are the 256-bit tile's.
inline __mmask16 panel_mask(int64_t valid) { return static_cast<__mmask16>((1u << valid) - 1u); }


// Rows [0, R) of x (stride k_stride) times the group's buffers over LEN k into y's R x G panels (panel g's first row
// at out[g], rows stride[g] apart): the accumulators start from START (the bias, the first chunk) or from what the
// panels hold (later chunks).
template <int R, int G>
void wide_tile(const float* x, int64_t k_stride, const float* const* buf, int64_t len, float* const* out,
               const int64_t* stride, const int64_t* valid, const __m512* start) {
  static_assert(R >= 1 && R <= 6 && G >= 1 && G <= 4, "wide tile shape");
  __m512 acc[R][G];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      acc[r][g] = start != nullptr ? start[g] : _mm512_maskz_loadu_ps(panel_mask(valid[g]), out[g] + r * stride[g]);
    }
  }
  const float* w[G];
  for (int g = 0; g < G; ++g) w[g] = buf[g];
  for (int64_t k = 0; k < len; ++k) {
    __m512 wk[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) wk[g] = _mm512_load_ps(w[g] + k * kPanel);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * k_stride + k]);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_fmadd_ps(b, wk[g], acc[r][g]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) _mm512_mask_storeu_ps(out[g] + r * stride[g], panel_mask(valid[g]), acc[r][g]);
  }
}

template <int G>
void wide_tile_rows(int rows, const float* x, int64_t k_stride, const float* const* buf, int64_t len,
                    float* const* out, const int64_t* stride, const int64_t* valid, const __m512* start) {
  switch (rows) {
    case 1: return wide_tile<1, G>(x, k_stride, buf, len, out, stride, valid, start);
    case 2: return wide_tile<2, G>(x, k_stride, buf, len, out, stride, valid, start);
    case 3: return wide_tile<3, G>(x, k_stride, buf, len, out, stride, valid, start);
    case 4: return wide_tile<4, G>(x, k_stride, buf, len, out, stride, valid, start);
    case 5: return wide_tile<5, G>(x, k_stride, buf, len, out, stride, valid, start);
    default: return wide_tile<kTileRows, G>(x, k_stride, buf, len, out, stride, valid, start);
  }
}

void wide_tile_any(int rows, int64_t count, const float* x, int64_t k_stride, const float* const* buf, int64_t len,
                   float* const* out, const int64_t* stride, const int64_t* valid, const __m512* start) {
  switch (count) {
    case 1: return wide_tile_rows<1>(rows, x, k_stride, buf, len, out, stride, valid, start);
    case 2: return wide_tile_rows<2>(rows, x, k_stride, buf, len, out, stride, valid, start);
    case 3: return wide_tile_rows<3>(rows, x, k_stride, buf, len, out, stride, valid, start);
    default: return wide_tile_rows<4>(rows, x, k_stride, buf, len, out, stride, valid, start);
  }
}
#endif

// One thread's buffers for a group's chunks (kGroup panels x kChunk k x 16 columns of T: 384 KiB of float,
// 192 KiB of int16, too much for a stack), kept between calls.
template <typename T>
struct alignas(64) GroupBuffers {
  T panel[kGroup][kChunk * kPanel];
};

template <typename T>
GroupBuffers<T>& group_buffers() {
  thread_local std::unique_ptr<GroupBuffers<T>> buffers;
  if (!buffers) buffers = std::make_unique<GroupBuffers<T>>();
  return *buffers;
}

// Per panel of the group [p0, p0 + count): its bias (zero without one) and how many of its 16 columns y has.
// The bias is in the registers of the build's tiles: one 16-float register (AVX-512) or two 8-float ones.
struct GroupColumns {
#if defined(__AVX512F__)
  __m512 bias[kGroup];
#else
  Vec2 bias[kGroup];
#endif
  int64_t valid[kGroup];

  GroupColumns(const BlockWeights& w, int64_t p0, int64_t count) {
    for (int64_t g = 0; g < count; ++g) {
      valid[g] = std::min<int64_t>(kPanel, w.n - (p0 + g) * kPanel);
#if defined(__AVX512F__)
      bias[g] = w.bias != nullptr ? _mm512_maskz_loadu_ps(panel_mask(valid[g]), w.bias + (p0 + g) * kPanel)
                                  : _mm512_setzero_ps();
#else
      bias[g] = w.bias != nullptr ? load_panel(w.bias + (p0 + g) * kPanel, valid[g])
                                  : Vec2{_mm256_setzero_ps(), _mm256_setzero_ps()};
#endif
    }
  }
};

// Panels [p0, p0 + count) (count <= kGroup) over all rows, a chunk of k at a time: the chunk's weights of
// every panel in the group are dequantized once, then each 6-row tile of x (in L1) meets all of them. Each
// output sums over k in order, one FMA per k, so the chunk length does not change its bits.
template <int Bits>
void buffered_group(const BlockWeights& w, const float* x, int64_t rows, const Outputs& y, int64_t row0, int64_t p0,
                    int64_t count) {
  auto& buf = group_buffers<float>().panel;
  const GroupColumns columns(w, p0, count);
  const auto& [bias, valid] = columns;
  float* panel_out[kGroup] = {};  // each panel's row row0
  int64_t stride[kGroup] = {};
  for (int64_t g = 0; g < count; ++g) panel_out[g] = y.panel(p0 + g, stride[g]) + row0 * stride[g];
  // chunks of equal length (multiples of 4, at most kChunk): each chunk is one more pass of the tiles over y
  // (at 2048 rows, megabytes out of L2), so a short last one costs a whole pass for a few k (K = 2048 is 2 x 1024,
  // not 1536 + 512)
  const int64_t chunks = (w.k + kChunk - 1) / kChunk;
  const int64_t chunk = std::min(kChunk, ((w.k + chunks - 1) / chunks + 3) / 4 * 4);
  for (int64_t k0 = 0; k0 < w.k; k0 += chunk) {
    const int64_t k1 = std::min(w.k, k0 + chunk);
    for (int64_t g = 0; g < count; ++g) dequantize_chunk<Bits>(w, p0 + g, k0, k1, buf[g]);
#if defined(__AVX512F__)
    static_assert(kGroup == 4, "wide_tile_any takes groups of up to 4 panels");
    const float* panels[kGroup] = {buf[0], buf[1], buf[2], buf[3]};
    for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
      const int n_rows = static_cast<int>(std::min<int64_t>(kTileRows, rows - r0));
      float* out[kGroup];
      for (int64_t g = 0; g < count; ++g) out[g] = panel_out[g] + r0 * stride[g];
      wide_tile_any(n_rows, count, x + r0 * w.k + k0, w.k, panels, k1 - k0, out, stride, valid, k0 == 0 ? bias : nullptr);
    }
#else
    for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
      const int n_rows = static_cast<int>(std::min<int64_t>(kTileRows, rows - r0));
      for (int64_t g = 0; g < count; ++g) {
        float* out = panel_out[g] + r0 * stride[g];
        __m256 lo[kTileRows], hi[kTileRows];
        for (int r = 0; r < n_rows; ++r) {
          const Vec2 start = k0 == 0 ? bias[g] : load_panel(out + r * stride[g], valid[g]);
          lo[r] = start.lo;
          hi[r] = start.hi;
        }
        tile_any(n_rows, x + r0 * w.k + k0, w.k, buf[g], k1 - k0, lo, hi);
        for (int r = 0; r < n_rows; ++r) store_panel(out + r * stride[g], valid[g], lo[r], hi[r]);
      }
    }
#endif
  }
}

// The codes of k in [k0, k1) (multiples of 4) of panel p widened to int16, in the order the decode path
// reads them: pair (k, k+1) at buf[(k - k0) / 2 * 32]: columns 0-7 then 8-15, each lane pair (k, k+1).
template <int Bits>
void widen_chunk(const BlockWeights& w, int64_t p, int64_t k0, int64_t k1, int16_t* buf) {
  const uint8_t* codes = w.codes + p * (w.k / 2) * pair_bytes(Bits);
  auto* out = reinterpret_cast<__m256i*>(buf);
  if constexpr (Bits == 8) {
    for (int64_t k = k0; k < k1; k += 2, out += 2) pair_codes(codes + (k / 2) * pair_bytes(Bits), out[0], out[1]);
  } else {
    for (int64_t k = k0; k < k1; k += 4, out += 4) {
      quad_codes(codes + (k / 2) * pair_bytes(Bits), out[0], out[1], out[2], out[3]);
    }
  }
}

#if !defined(__AVX512F__)
#if !defined(__AVXVNNI__) && !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define OCTAVO_INT_TILE_ASM 1
// The exact int32 sums of an R-row tile over one block's PAIRS pairs of k (pairs >= 1), in assembly, into
// sums[2r] (columns 0-7) and sums[2r + 1] (8-15) of row r. GCC (12, 13) hoists every row's broadcast ahead of the
// multiply-adds whatever the source says (6 + 2 + 12 > 16 registers at 6 rows) and keeps a third of the sums on
// the stack, a store and a reload per pair (the 6-row tile then ran at 0.8x the float32 FMA tiles at 48 rows,
// where madd does twice their multiply-adds a cycle on Zen 3); at 1, 2 and 5 rows it spilled too. Here the sums
// stay in ymm0-11: per pair, two loads of codes (ymm12-13), then per row a broadcast of its pair of x (ymm14) and
// 2 madd + 2 add. Builds with VNNI keep the intrinsics (one instruction a multiply-add, no scratch register).
#define OCTAVO_ZERO(i) "vpxor %%xmm" #i ", %%xmm" #i ", %%xmm" #i "\n\t"
#define OCTAVO_STORE(i) "vmovdqa %%ymm" #i ", " #i "*32(%[sums])\n\t"
#define OCTAVO_ROW(addr, s, t)                  \
  "vpbroadcastd " addr ", %%ymm14\n\t"          \
  "vpmaddwd %%ymm14, %%ymm12, %%ymm15\n\t"      \
  "vpaddd %%ymm15, %%ymm" #s ", %%ymm" #s "\n\t" \
  "vpmaddwd %%ymm14, %%ymm13, %%ymm14\n\t"      \
  "vpaddd %%ymm14, %%ymm" #t ", %%ymm" #t "\n\t"
#define OCTAVO_R1 OCTAVO_ROW("(%[qa])", 0, 1)
#define OCTAVO_R2 OCTAVO_R1 OCTAVO_ROW("(%[qa], %[stride])", 2, 3)
#define OCTAVO_R3 OCTAVO_R2 OCTAVO_ROW("(%[qa], %[stride], 2)", 4, 5)
#define OCTAVO_R4 OCTAVO_R3 OCTAVO_ROW("(%[qc])", 6, 7)
#define OCTAVO_R5 OCTAVO_R4 OCTAVO_ROW("(%[qc], %[stride])", 8, 9)
#define OCTAVO_R6 OCTAVO_R5 OCTAVO_ROW("(%[qc], %[stride], 2)", 10, 11)
#define OCTAVO_Z1 OCTAVO_ZERO(0) OCTAVO_ZERO(1)
#define OCTAVO_Z2 OCTAVO_Z1 OCTAVO_ZERO(2) OCTAVO_ZERO(3)
#define OCTAVO_Z3 OCTAVO_Z2 OCTAVO_ZERO(4) OCTAVO_ZERO(5)
#define OCTAVO_Z4 OCTAVO_Z3 OCTAVO_ZERO(6) OCTAVO_ZERO(7)
#define OCTAVO_Z5 OCTAVO_Z4 OCTAVO_ZERO(8) OCTAVO_ZERO(9)
#define OCTAVO_Z6 OCTAVO_Z5 OCTAVO_ZERO(10) OCTAVO_ZERO(11)
#define OCTAVO_S1 OCTAVO_STORE(0) OCTAVO_STORE(1)
#define OCTAVO_S2 OCTAVO_S1 OCTAVO_STORE(2) OCTAVO_STORE(3)
#define OCTAVO_S3 OCTAVO_S2 OCTAVO_STORE(4) OCTAVO_STORE(5)
#define OCTAVO_S4 OCTAVO_S3 OCTAVO_STORE(6) OCTAVO_STORE(7)
#define OCTAVO_S5 OCTAVO_S4 OCTAVO_STORE(8) OCTAVO_STORE(9)
#define OCTAVO_S6 OCTAVO_S5 OCTAVO_STORE(10) OCTAVO_STORE(11)
#define OCTAVO_INT_SUMS(R)                                                                                     \
  asm volatile(OCTAVO_Z##R "1:\n\t"                                                                            \
               "vmovdqa (%[c]), %%ymm12\n\t"                                                                   \
               "vmovdqa 32(%[c]), %%ymm13\n\t" OCTAVO_R##R                                                     \
               "add $4, %[qa]\n\t"                                                                             \
               "add $4, %[qc]\n\t"                                                                             \
               "add $64, %[c]\n\t"                                                                             \
               "dec %[n]\n\t"                                                                                  \
               "jnz 1b\n\t" OCTAVO_S##R                                                                        \
               : [qa] "+r"(qa), [qc] "+r"(qc), [c] "+r"(cb), [n] "+r"(pairs)                                   \
               : [stride] "r"(stride), [sums] "r"(sums)                                                         \
               : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", \
                 "xmm12", "xmm13", "xmm14", "xmm15", "memory", "cc")

template <int R>
inline void integer_sums(const int16_t* qb, int64_t k, const __m256i* cb, int64_t pairs, __m256i* sums) {
  const int16_t* qa = qb;          // rows 0-2
  const int16_t* qc = qb + 3 * k;  // rows 3-5 (not read below 4 rows)
  const int64_t stride = k * static_cast<int64_t>(sizeof(int16_t));
  if constexpr (R == 1) OCTAVO_INT_SUMS(1);
  if constexpr (R == 2) OCTAVO_INT_SUMS(2);
  if constexpr (R == 3) OCTAVO_INT_SUMS(3);
  if constexpr (R == 4) OCTAVO_INT_SUMS(4);
  if constexpr (R == 5) OCTAVO_INT_SUMS(5);
  if constexpr (R == 6) OCTAVO_INT_SUMS(6);
}
#undef OCTAVO_INT_SUMS
#undef OCTAVO_ZERO
#undef OCTAVO_STORE
#undef OCTAVO_ROW
#undef OCTAVO_R1
#undef OCTAVO_R2
#undef OCTAVO_R3
#undef OCTAVO_R4
#undef OCTAVO_R5
#undef OCTAVO_R6
#undef OCTAVO_Z1
#undef OCTAVO_Z2
#undef OCTAVO_Z3
#undef OCTAVO_Z4
#undef OCTAVO_Z5
#undef OCTAVO_Z6
#undef OCTAVO_S1
#undef OCTAVO_S2
#undef OCTAVO_S3
#undef OCTAVO_S4
#undef OCTAVO_S5
#undef OCTAVO_S6
#endif

// One block of integer_tile: R rows' exact int32 sums of codes x 16-bit activations over the block's pairs of k
// (_mm256_madd_epi16: 16 multiply-adds an instruction, two a cycle on Zen 3 against two 8-wide FMAs), then the
// block's float32 scaling into lo / hi (R x 16 floats, in memory) in integer_panel's order: scaled sums, then the
// offsets' term (a row's y is the same bits whichever kernel and batch it is in). A function of its own, as
// wide_integer_block: inside the loop over blocks GCC kept the sums on the stack.
template <int R, int Pairs>
__attribute__((noinline)) void integer_block(const BlockWeights& w, const int16_t* __restrict qb,
                                             const float* __restrict q_scale, const float* __restrict block_sums,
                                             int64_t nb, int64_t p, int64_t b, const __m256i* __restrict cb,
                                             __m256* __restrict lo, __m256* __restrict hi) {
  const int64_t k = w.k, pairs = Pairs > 0 ? Pairs : w.block_size / 2;
  alignas(32) __m256i sums[2 * R];
#if defined(OCTAVO_INT_TILE_ASM)
  integer_sums<R>(qb, k, cb, pairs, sums);
#else  // VNNI builds: one vpdpwssd a multiply-add
  for (int i = 0; i < 2 * R; ++i) sums[i] = _mm256_setzero_si256();
  for (int64_t j = 0; j < pairs; ++j) {
    const __m256i c0 = _mm256_load_si256(cb + 2 * j), c1 = _mm256_load_si256(cb + 2 * j + 1);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_set1_epi32(pair_of(qb + r * k + 2 * j));
      sums[2 * r] = dot_add(sums[2 * r], c0, x);
      sums[2 * r + 1] = dot_add(sums[2 * r + 1], c1, x);
    }
  }
#endif
  const Vec2 scale = load_params(w, w.scales, w.scale_super, (p * nb + b) * kPanel);
  const Vec2 offset = load_params(w, w.offsets, w.offset_super, (p * nb + b) * kPanel);
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    const __m256 f = _mm256_set1_ps(q_scale[r * nb + b]), sum = _mm256_set1_ps(block_sums[r * nb + b]);
    lo[r] = _mm256_fmadd_ps(offset.lo, sum, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[2 * r]), _mm256_mul_ps(scale.lo, f), lo[r]));
    hi[r] = _mm256_fmadd_ps(offset.hi, sum, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[2 * r + 1]), _mm256_mul_ps(scale.hi, f), hi[r]));
  }
}

// R rows (from r0) of one panel over blocks [b0, b1) (their widened codes at buf), a block at a time.
template <int R, int Pairs>
void integer_tile(const BlockWeights& w, const Activations& a, int64_t r0, int64_t p, int64_t b0, int64_t b1,
                  const int16_t* buf, __m256* lo, __m256* hi) {
  static_assert(R >= 1 && R <= 6, "integer tile rows");
  const int64_t nb = w.k / w.block_size, pairs = Pairs > 0 ? Pairs : w.block_size / 2;
  const int16_t* q = a.q.get() + r0 * w.k;
  const float* q_scale = a.q_scale.get() + r0 * nb;
  const float* block_sums = a.block_sums.get() + r0 * nb;
  for (int64_t b = b0; b < b1; ++b) {
    integer_block<R, Pairs>(w, q + b * w.block_size, q_scale, block_sums, nb, p, b,
                            reinterpret_cast<const __m256i*>(buf) + (b - b0) * pairs * 2, lo, hi);
  }
}

template <int Pairs>
void integer_tile_rows(int rows, const BlockWeights& w, const Activations& a, int64_t r0, int64_t p, int64_t b0,
                       int64_t b1, const int16_t* buf, __m256* lo, __m256* hi) {
  switch (rows) {
    case 1: return integer_tile<1, Pairs>(w, a, r0, p, b0, b1, buf, lo, hi);
    case 2: return integer_tile<2, Pairs>(w, a, r0, p, b0, b1, buf, lo, hi);
    case 3: return integer_tile<3, Pairs>(w, a, r0, p, b0, b1, buf, lo, hi);
    case 4: return integer_tile<4, Pairs>(w, a, r0, p, b0, b1, buf, lo, hi);
    case 5: return integer_tile<5, Pairs>(w, a, r0, p, b0, b1, buf, lo, hi);
    default: return integer_tile<kIntTileRows, Pairs>(w, a, r0, p, b0, b1, buf, lo, hi);
  }
}

// Blocks of 32 (every GGUF type octavo maps but Q6_K's 16): a pair loop of known length, unrolled by 4 (GCC
// spills the sums when it unrolls all 16 or none: measured 0.6x).
void integer_tile_any(int rows, const BlockWeights& w, const Activations& a, int64_t r0, int64_t p, int64_t b0,
                      int64_t b1, const int16_t* buf, __m256* lo, __m256* hi) {
  if (w.block_size == 32) return integer_tile_rows<16>(rows, w, a, r0, p, b0, b1, buf, lo, hi);
  integer_tile_rows<0>(rows, w, a, r0, p, b0, b1, buf, lo, hi);
}

#endif

#if defined(__AVX512F__)
// The AVX-512 integer tile: R rows x G panels over blocks [b0, b1), one register of 16 int32 sums per row and
// panel (6 x 4 = 24 + 4 codes + 1 broadcast of the 32 registers; a panel's pair of k is one 64-byte load of its
// widened codes). Per block, the same exact int32 sums as integer_tile, scaled into ACC (R x G, row-major) in
// integer_tile's order: the same bits.
typedef int32_t wide_sums __attribute__((vector_size(64)));  // 16 int32 (__m512i is 8 x int64 to GCC)

inline wide_sums dot_add_wide(wide_sums s, __m512i c, __m512i x) {
#if defined(__AVX512VNNI__)
  return reinterpret_cast<wide_sums>(_mm512_dpwssd_epi32(reinterpret_cast<__m512i>(s), c, x));
#else
  return s + reinterpret_cast<wide_sums>(_mm512_madd_epi16(c, x));
#endif
}

inline __m512 load_params_wide(const BlockWeights& w, const void* base, const float* super, int64_t index) {
  if (super != nullptr) {  // two-level scales, as load_params
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + index));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_loadu_ps(w.super_at(super, index)));
  }
  if (w.half_scales) {
    return _mm512_maskz_cvtph_ps(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + index)));
  }
  return _mm512_loadu_ps(static_cast<const float*>(base) + index);
}

// One block of wide_integer_tile: its exact int32 sums (R x G registers), then scaled into ACC in integer_tile's
// order, from the registers. The first pair's madd starts each sum (the same int32 lanes as dpwssd from zero): a
// zeroed array of sums in memory cost a memset of R x G x 64 bytes a block. A function of its own: with the sums
// inside the loop over blocks, GCC 12 copied or spilled every sum once per pair.
template <int R, int G, int Pairs>
__attribute__((noinline)) void wide_integer_block(const BlockWeights& w, const int16_t* __restrict qb,
                                                  const float* q_scale, const float* block_sums, int64_t nb,
                                                  int64_t p0, int64_t b, const int16_t* const* cb,
                                                  __m512* __restrict acc) {
  const int64_t k = w.k, pairs = Pairs > 0 ? Pairs : w.block_size / 2;
  const int16_t* c0 = cb[0];
  const int16_t* c1 = cb[G > 1 ? 1 : 0];
  const int16_t* c2 = cb[G > 2 ? 2 : 0];
  const int16_t* c3 = cb[G > 3 ? 3 : 0];
  auto load_codes = [&](int64_t j, __m512i* c) {
    c[0] = _mm512_load_si512(c0 + j * 2 * kPanel);
    if constexpr (G > 1) c[1] = _mm512_load_si512(c1 + j * 2 * kPanel);
    if constexpr (G > 2) c[2] = _mm512_load_si512(c2 + j * 2 * kPanel);
    if constexpr (G > 3) c[3] = _mm512_load_si512(c3 + j * 2 * kPanel);
  };
  wide_sums sums[R][G];
  {
    __m512i c[G];
    load_codes(0, c);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_set1_epi32(pair_of(qb + r * k));
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) sums[r][g] = reinterpret_cast<wide_sums>(_mm512_madd_epi16(c[g], x));
    }
  }
  for (int64_t j = 1; j < pairs; ++j) {
    __m512i c[G];
    load_codes(j, c);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_set1_epi32(pair_of(qb + r * k + 2 * j));
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) sums[r][g] = dot_add_wide(sums[r][g], c[g], x);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    const __m512 scale = load_params_wide(w, w.scales, w.scale_super, ((p0 + g) * nb + b) * kPanel);
    const __m512 offset = load_params_wide(w, w.offsets, w.offset_super, ((p0 + g) * nb + b) * kPanel);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 f = _mm512_set1_ps(q_scale[r * nb + b]), sum = _mm512_set1_ps(block_sums[r * nb + b]);
      acc[r * G + g] = _mm512_fmadd_ps(offset, sum, _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(0xFFFF, reinterpret_cast<__m512i>(sums[r][g])),
                                                                    _mm512_mul_ps(scale, f), acc[r * G + g]));
    }
  }
}

template <int R, int G, int Pairs>
void wide_integer_tile(const BlockWeights& w, const Activations& a, int64_t r0, int64_t p0, int64_t b0, int64_t b1,
                       const int16_t* const* buf, __m512* acc) {
  static_assert(R >= 1 && R <= 6 && G >= 1 && G <= 4, "wide integer tile shape");
  const int64_t nb = w.k / w.block_size, pairs = Pairs > 0 ? Pairs : w.block_size / 2;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t at = (b - b0) * pairs * 2 * kPanel;  // int16 of the block's first pair in each buffer
    const int16_t* cb[G];
    for (int g = 0; g < G; ++g) cb[g] = buf[g] + at;
    wide_integer_block<R, G, Pairs>(w, a.q.get() + r0 * w.k + b * w.block_size, a.q_scale.get() + r0 * nb,
                                    a.block_sums.get() + r0 * nb, nb, p0, b, cb, acc);
  }
}

template <int G, int Pairs>
void wide_integer_rows(int rows, const BlockWeights& w, const Activations& a, int64_t r0, int64_t p0, int64_t b0,
                       int64_t b1, const int16_t* const* buf, __m512* acc) {
  switch (rows) {
    case 1: return wide_integer_tile<1, G, Pairs>(w, a, r0, p0, b0, b1, buf, acc);
    case 2: return wide_integer_tile<2, G, Pairs>(w, a, r0, p0, b0, b1, buf, acc);
    case 3: return wide_integer_tile<3, G, Pairs>(w, a, r0, p0, b0, b1, buf, acc);
    case 4: return wide_integer_tile<4, G, Pairs>(w, a, r0, p0, b0, b1, buf, acc);
    case 5: return wide_integer_tile<5, G, Pairs>(w, a, r0, p0, b0, b1, buf, acc);
    default: return wide_integer_tile<kIntTileRows, G, Pairs>(w, a, r0, p0, b0, b1, buf, acc);
  }
}

template <int Pairs>
void wide_integer_group_tile(int rows, int64_t count, const BlockWeights& w, const Activations& a, int64_t r0,
                             int64_t p0, int64_t b0, int64_t b1, const int16_t* const* buf, __m512* acc) {
  switch (count) {
    case 1: return wide_integer_rows<1, Pairs>(rows, w, a, r0, p0, b0, b1, buf, acc);
    case 2: return wide_integer_rows<2, Pairs>(rows, w, a, r0, p0, b0, b1, buf, acc);
    case 3: return wide_integer_rows<3, Pairs>(rows, w, a, r0, p0, b0, b1, buf, acc);
    default: return wide_integer_rows<4, Pairs>(rows, w, a, r0, p0, b0, b1, buf, acc);
  }
}

// integer_tile_any's choice (a pair loop of known length for blocks of 32) for a whole group of panels.
void wide_integer_any(int rows, int64_t count, const BlockWeights& w, const Activations& a, int64_t r0, int64_t p0,
                      int64_t b0, int64_t b1, const int16_t* const* buf, __m512* acc) {
  if (w.block_size == 32) return wide_integer_group_tile<16>(rows, count, w, a, r0, p0, b0, b1, buf, acc);
  wide_integer_group_tile<0>(rows, count, w, a, r0, p0, b0, b1, buf, acc);
}
#endif

// buffered_group on the 16-bit path (steps of more than kIntRows rows): a chunk of whole blocks of each
// panel's codes is widened to int16 once (L1/L2), then each tile of kIntTileRows rows meets all of them.
template <int Bits>
void integer_group(const BlockWeights& w, const Activations& a, const Outputs& y, int64_t p0, int64_t count) {
  auto& buf = group_buffers<int16_t>().panel;
  const GroupColumns columns(w, p0, count);
  const auto& [bias, valid] = columns;
  float* panel_out[kGroup] = {};
  int64_t stride[kGroup] = {};
  for (int64_t g = 0; g < count; ++g) panel_out[g] = y.panel(p0 + g, stride[g]);
  const int64_t nb = w.k / w.block_size;
  const int64_t chunk_blocks = kChunk / w.block_size;  // >= 1: begin_activations keeps block_size <= kChunk
  const int64_t chunks = (nb + chunk_blocks - 1) / chunk_blocks;
  const int64_t per_chunk = (nb + chunks - 1) / chunks;  // blocks: chunks of one length, as buffered_group
  for (int64_t b0 = 0; b0 < nb; b0 += per_chunk) {
    const int64_t b1 = std::min(nb, b0 + per_chunk);
    for (int64_t g = 0; g < count; ++g) widen_chunk<Bits>(w, p0 + g, b0 * w.block_size, b1 * w.block_size, buf[g]);
#if defined(__AVX512F__)
    static_assert(kGroup == 4, "wide_integer_any takes groups of up to 4 panels");
    const int16_t* panels[kGroup] = {buf[0], buf[1], buf[2], buf[3]};
    const bool last = b1 == nb;
    for (int64_t r0 = 0; r0 < a.rows; r0 += kIntTileRows) {
      const int n_rows = static_cast<int>(std::min<int64_t>(kIntTileRows, a.rows - r0));
      __m512 acc[kIntTileRows * kGroup];
      for (int r = 0; r < n_rows; ++r) {
        for (int64_t g = 0; g < count; ++g) {
          acc[r * count + g] = b0 == 0 ? _mm512_setzero_ps()
                                       : _mm512_maskz_loadu_ps(panel_mask(valid[g]), panel_out[g] + (r0 + r) * stride[g]);
        }
      }
      wide_integer_any(n_rows, count, w, a, r0, p0, b0, b1, panels, acc);
      for (int r = 0; r < n_rows; ++r) {
        for (int64_t g = 0; g < count; ++g) {
          // the bias (zero without one) added after the last block, as the 256-bit tiles do
          const __m512 v = last ? _mm512_add_ps(acc[r * count + g], bias[g]) : acc[r * count + g];
          _mm512_mask_storeu_ps(panel_out[g] + (r0 + r) * stride[g], panel_mask(valid[g]), v);
        }
      }
    }
#else
    for (int64_t r0 = 0; r0 < a.rows; r0 += kIntTileRows) {
      const int n_rows = static_cast<int>(std::min<int64_t>(kIntTileRows, a.rows - r0));
      for (int64_t g = 0; g < count; ++g) {
        float* out = panel_out[g] + r0 * stride[g];
        __m256 lo[kIntTileRows], hi[kIntTileRows];
        for (int r = 0; r < n_rows; ++r) {
          const Vec2 start = b0 == 0 ? Vec2{_mm256_setzero_ps(), _mm256_setzero_ps()}
                                     : load_panel(out + r * stride[g], valid[g]);
          lo[r] = start.lo;
          hi[r] = start.hi;
        }
        integer_tile_any(n_rows, w, a, r0, p0 + g, b0, b1, buf[g], lo, hi);
        const bool last = b1 == nb;
        for (int r = 0; r < n_rows; ++r) {
          store_panel(out + r * stride[g], valid[g], last ? _mm256_add_ps(lo[r], bias[g].lo) : lo[r],
                      last ? _mm256_add_ps(hi[r], bias[g].hi) : hi[r]);
        }
      }
    }
#endif
  }
}

template <int Bits, bool X16>
void integer_range(const BlockWeights& w, const Activations& a, const Outputs& y, int64_t first, int64_t last) {
  for (int64_t p = first; p < last; ++p) {
    const int64_t valid = std::min<int64_t>(kPanel, w.n - p * kPanel);
    for (int64_t r0 = 0; r0 < a.rows; r0 += 4) {  // a second pass re-reads the panel's codes from L1
      switch (std::min<int64_t>(4, a.rows - r0)) {
        case 1: integer_panel<Bits, 1, X16>(w, a, y, p, valid, r0); break;
        case 2: integer_panel<Bits, 2, X16>(w, a, y, p, valid, r0); break;
        case 3: integer_panel<Bits, 3, X16>(w, a, y, p, valid, r0); break;
        default: integer_panel<Bits, 4, X16>(w, a, y, p, valid, r0); break;
      }
    }
  }
}

// Rows [r0, r1) of panels [first, last); the 16-bit paths take all rows (block_matmul_task_rows).
template <int Bits>
void run_range(const BlockWeights& w, const Activations& a, const Outputs& y, int64_t first, int64_t last, int64_t r0,
               int64_t r1) {
  if (!a.integer) {
    for (int64_t p = first; p < last; p += kGroup) {
      buffered_group<Bits>(w, a.x + r0 * w.k, r1 - r0, y, r0, p, std::min(kGroup, last - p));
    }
    return;
  }
  if (a.rows > kIntRows) {
    for (int64_t p = first; p < last; p += kGroup) integer_group<Bits>(w, a, y, p, std::min(kGroup, last - p));
    return;
  }
  if constexpr (Bits == 4) {
    if (w.block_size <= kMaxScaledBlock) return integer_range<Bits, true>(w, a, y, first, last);
  }
  integer_range<Bits, false>(w, a, y, first, last);
}

#else  // portable scalar fallback (builds without AVX2 + FMA): float32, one value at a time

// The float32 scales (or offsets) of panel p, block b (index = (p * nb + b) * kPanel).
inline void params_at(const BlockWeights& w, const void* base, const float* super, int64_t index, float* out) {
  for (int c = 0; c < kPanel; ++c) out[c] = param_at(w, base, super, index + c);
}

template <int Bits>
void run_range(const BlockWeights& w, const Activations& a, const Outputs& y, int64_t first, int64_t last, int64_t r0,
               int64_t r1) {
  const int64_t nb = w.k / w.block_size;
  float acc[kPanel], scale[kPanel], offset[kPanel];
  for (int64_t p = first; p < last; ++p) {
    const int64_t valid = std::min<int64_t>(kPanel, w.n - p * kPanel);
    const uint8_t* codes = w.codes + p * (w.k / 2) * pair_bytes(Bits);
    for (int64_t r = r0; r < r1; ++r) {
      for (int c = 0; c < kPanel; ++c) acc[c] = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        params_at(w, w.scales, w.scale_super, (p * nb + b) * kPanel, scale);
        params_at(w, w.offsets, w.offset_super, (p * nb + b) * kPanel, offset);
        for (int64_t k = b * w.block_size; k < (b + 1) * w.block_size; ++k) {
          for (int c = 0; c < kPanel; ++c) {
            acc[c] += a.x[r * w.k + k] * std::fma(static_cast<float>(code_at(codes, Bits, c, k)), scale[c], offset[c]);
          }
        }
      }
      int64_t stride = 0;
      float* const out = y.panel(p, stride) + r * stride;
      for (int64_t c = 0; c < valid; ++c) out[c] = acc[c] + (w.bias ? w.bias[p * kPanel + c] : 0.0f);
    }
  }
}

#endif

}  // namespace

void dequantize_panel(const BlockWeights& w, int64_t p, int64_t k0, int64_t k1, float* buf) {
#if defined(OCTAVO_BLOCK_AVX2)
  if (w.bits == 8) {
    dequantize_chunk<8>(w, p, k0, k1, buf);
  } else {
    dequantize_chunk<4>(w, p, k0, k1, buf);
  }
#else
  (void)w, (void)p, (void)k0, (void)k1, (void)buf;
#endif
}

bool begin_activations(const BlockWeights& w, const float* x, int64_t rows, bool decode, Activations& a) {
  a.x = x;
  a.rows = rows;
  a.integer = false;
#if defined(OCTAVO_BLOCK_AVX2)
  if (rows < 1) return false;
  // A block's int32 sum holds block_size products of |q| <= 32767 and codes < 2^bits: exact only while that
  // fits (8-bit codes: blocks of up to 256; every GGUF block is 16 or 32). Larger blocks take the float32 path,
  // as do blocks longer than a widened chunk on the tiled path.
  if (32767 * ((int64_t{1} << w.bits) - 1) * w.block_size > INT32_MAX) return false;
  if (rows > kIntRows && (!decode || w.block_size > kChunk)) return false;
  const int64_t nb = w.k / w.block_size;
  a.q.reset(new int16_t[static_cast<size_t>(rows * w.k)]);  // not zeroed: every element is written
  a.q_scale.reset(new float[static_cast<size_t>(rows * nb)]);
  a.block_sums.reset(new float[static_cast<size_t>(rows * nb)]);
  return true;
#else
  (void)w, (void)decode;
  return false;
#endif
}

bool quantize_rows(const BlockWeights& w, Activations& a, int64_t first, int64_t last) {
#if defined(OCTAVO_BLOCK_AVX2)
  const int64_t nb = w.k / w.block_size;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t r = first; r < last; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = a.x + r * w.k + b * w.block_size;
      __m256 vmax = _mm256_setzero_ps(), vsum = _mm256_setzero_ps();
      for (int64_t i = 0; i < w.block_size; i += 8) {  // block sizes are multiples of 4: a 4-wide tail
        const __m256 e = i + 8 <= w.block_size ? _mm256_loadu_ps(v + i)
                                               : _mm256_castps128_ps256(_mm_loadu_ps(v + i));
        const __m256 lanes = i + 8 <= w.block_size ? e : _mm256_insertf128_ps(e, _mm_setzero_ps(), 1);
        vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, lanes));
        vsum = _mm256_add_ps(vsum, lanes);
      }
      alignas(32) float mx[8], sm[8];
      _mm256_store_ps(mx, vmax);
      _mm256_store_ps(sm, vsum);
      float amax = 0.0f, sum = 0.0f;
      for (int i = 0; i < 8; ++i) {
        amax = std::max(amax, mx[i]);
        sum += sm[i];
      }
      if (!std::isfinite(amax) || !std::isfinite(sum)) return false;  // inf / nan: the float32 path propagates them
      // a nonzero block below 2^-64: 32767 / max would overflow (from ~1e-34) and max / 32767 times a weight
      // scale would be subnormal, losing the per-block relative precision; the float32 path keeps it
      if (amax > 0.0f && amax < kMinBlockMax) return false;
      const float inverse = amax > 0.0f ? 32767.0f / amax : 0.0f;
      a.q_scale[r * nb + b] = amax / 32767.0f;
      a.block_sums[r * nb + b] = sum;
      int16_t* q = a.q.get() + r * w.k + b * w.block_size;
      const __m128 inv = _mm_set1_ps(inverse), top = _mm_set1_ps(32767.0f), bottom = _mm_set1_ps(-32767.0f);
      for (int64_t i = 0; i < w.block_size; i += 4) {  // round to nearest even (MXCSR default), as lrint
        const __m128 e = _mm_min_ps(_mm_max_ps(_mm_mul_ps(_mm_loadu_ps(v + i), inv), bottom), top);
        const __m128i q32 = _mm_cvtps_epi32(e);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi32(q32, q32));
      }
    }
  }
  return true;
#else
  (void)w, (void)a, (void)first, (void)last;
  return false;
#endif
}

int64_t block_matmul_task_panels(const Activations& a) {
  if (a.bf16 || a.split || a.int8) return 4;
#if defined(OCTAVO_BLOCK_AVX2)
  return a.integer && a.rows <= kIntRows ? 1 : kGroup;
#else
  (void)a;
  return 1;
#endif
}

int64_t block_matmul_task_rows(const BlockWeights& w, const Activations& a) {
  if (a.bf16) return bf16_task_rows(a);
  if (a.split) return split_task_rows(w, a);
  if (a.int8) return int8_task_rows(a);
#if defined(OCTAVO_BLOCK_AVX2)
  if (a.integer) return std::max<int64_t>(1, a.rows);
  const int64_t x_row_bytes = std::min(w.k, kChunk) * static_cast<int64_t>(sizeof(float));
  const int64_t rows = std::max<int64_t>(1, row_block_bytes() / x_row_bytes / kTileRows) * kTileRows;
  return std::max<int64_t>(1, std::min(a.rows, rows));
#else
  (void)w;
  return std::max<int64_t>(1, a.rows);
#endif
}

void block_matmul_panels(const BlockWeights& w, const Activations& a, const Outputs& y, int64_t first, int64_t last,
                         int64_t r0, int64_t r1) {
  r1 = std::min(r1, a.rows);
  if (r0 >= r1 || first >= last) return;
  if (a.integer && r0 != 0) return;  // the 16-bit paths run all rows in the first row block's tasks
  if (a.bf16 || a.split) return amx_panels(w, a, y, first, last, r0, r1);
  if (a.int8) return int8_panels(w, a, y, first, last, r0, r1);
  if (a.amx_int) return amx_int_panels(w, a, y, first, last);
  if (w.bits == 8) {
    run_range<8>(w, a, y, first, last, r0, r1);
  } else {
    run_range<4>(w, a, y, first, last, r0, r1);
  }
}

}  // namespace octavo
