// octavo.BlockMatMul's int8 path, for 4-bit codes in blocks of a multiple of 32 (and, on decode_int8 steps, 8-bit
// codes below 64 in blocks of 16 or 32: int8_tile8 below), with x rounded to int8 per row and 32 values, as
// llama.cpp multiplies a quantized file (its Q8 activations). Which steps take it is the node's:
//   prompt_int8 = 1 (EngineArgs.prompt_activations "int8"): the steps the float32 path would take (a prompt's, a
//                   mixed step's past 8 rows);
//   decode_int8 = 1 (EngineArgs.decode_activations "int8"): the steps the 16-bit path would take (decode, decode
//                   batches, speculative verification, any step of at most 8 rows).
// The arithmetic:
//   s = max|x| / 127 over the 32 values, q = rint(x * (127 / max|x|)) in [-127, 127] (0 where the max is 0)
//   y[n] = sum over blocks b of scale(n, b) * sum over the block's 32-groups g of s_g * (sum_k q[k] * code(n, k))
//          + offset(n, b) * (float32 sum of x over the block), + bias
// The integer sums are exact (vpmaddubsw: 4-bit codes times int8 pairs, 3810 at most, 8 of them summed in int16,
// 30480 < 32767; vpmaddwd to int32), so the only rounding beyond the float32 path's is x's own (<= 1/254 of its
// group's largest value). Per 64 multiply-adds (16 columns x 4 k) and row: one broadcast, two vpmaddubsw and two
// int16 adds, where the float32 tiles take eight FMAs and four broadcasts and the 16-bit path four vpmaddwd, four
// int32 adds and the widening of the codes; the 4-bit codes are split once per 4 k for all the tile's rows (tiles of
// 4 rows, one of 5 where the rows leave 1 over).
// Each output sums over k in order whatever the task ranges and the other rows: its bits depend only on its row.
// x is laid out per row in quads of k as (x[k], x[k+2], x[k+1], x[k+3]), the order of the nibbles of the panel's
// 4-bit layout (code_at in block_matmul_kernel.h): byte 2m of a quad's 32 code bytes holds column m / 2 at k + m % 2
// (low nibble: columns 0-7, high: 8-15) and byte 2m + 1 the same column at k + 2 + m % 2.
// Written by hand: no library offers a matmul over this layout; AVX2 only (other builds: the float32 path).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "block_matmul_kernel.h"
#include "block_params_avx2.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define OCTAVO_INT8_AVX2 1
#endif

namespace octavo {

#if defined(OCTAVO_INT8_AVX2)
namespace {

constexpr int64_t kGroupK = 32;     // k values per activation scale
constexpr int kRowsPerTile = 4;     // rows sharing one split of the codes: 8 int16 sums + codes + broadcast
constexpr int64_t kTaskRows = 64;   // rows per task: 64 x k bytes of x stay in L2 across a task's panels
constexpr int64_t kPrefetchBytes = 2048;  // how far ahead of the codes being read a one- or two-row tile prefetches

// One panel (16 columns) and R rows of one 32-group at k0 (a multiple of 32): the exact int32 sums per column,
// columns 0-7 in lo[r], 8-15 in hi[r].
template <int R>
inline void group_sums(const uint8_t* codes, const int8_t* const* x, int64_t k0, __m256i* lo, __m256i* hi) {
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256i s_lo[R], s_hi[R];
  for (int r = 0; r < R; ++r) s_lo[r] = s_hi[r] = _mm256_setzero_si256();
  const uint8_t* c = codes + (k0 / 4) * 32;
#pragma GCC unroll 8
  for (int q = 0; q < 8; ++q) {  // 8 quads of k: 32 bytes of codes each
    // one or two rows (decode): the codes stream from memory once; asking for each line kPrefetchBytes ahead
    // measured 1.18x on a one-row decode step (the hardware's prefetch alone keeps too few lines in flight)
    if (R <= 2 && q % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(c + q * 32 + kPrefetchBytes), _MM_HINT_T0);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + q * 32));
    const __m256i v_lo = _mm256_and_si256(v, mask);
    const __m256i v_hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    for (int r = 0; r < R; ++r) {
      int32_t pattern;
      std::memcpy(&pattern, x[r] + k0 + 4 * q, sizeof pattern);
      const __m256i xb = _mm256_set1_epi32(pattern);
      s_lo[r] = _mm256_add_epi16(s_lo[r], _mm256_maddubs_epi16(v_lo, xb));
      s_hi[r] = _mm256_add_epi16(s_hi[r], _mm256_maddubs_epi16(v_hi, xb));
      // keep the running sums in registers: without this GCC forms all 16 products of a row first and parks
      // them on the stack (the sums are the same integers either way)
      asm("" : "+x"(s_lo[r]), "+x"(s_hi[r]));
    }
  }
  for (int r = 0; r < R; ++r) {  // lanes 2c, 2c + 1: column c at k, k + 2 and at k + 1, k + 3
    lo[r] = _mm256_madd_epi16(s_lo[r], ones);
    hi[r] = _mm256_madd_epi16(s_hi[r], ones);
  }
}

// Rows [r0, r0 + R) of panel p's outputs: columns 0-7 in lo[r], 8-15 in hi[r], plus the bias.
template <int R>
void store_rows(const BlockWeights& w, const Outputs& y, int64_t p, int64_t r0, const __m256* lo, const __m256* hi) {
  const int64_t valid = std::min<int64_t>(kPanel, w.n - p * kPanel);
  alignas(32) float bias[kPanel] = {};
  if (w.bias != nullptr) std::memcpy(bias, w.bias + p * kPanel, valid * sizeof(float));
  int64_t stride = 0;
  float* const out = y.panel(p, stride);
  for (int r = 0; r < R; ++r) {
    alignas(32) float row[kPanel];
    _mm256_store_ps(row, _mm256_add_ps(lo[r], _mm256_load_ps(bias)));
    _mm256_store_ps(row + 8, _mm256_add_ps(hi[r], _mm256_load_ps(bias + 8)));
    std::memcpy(out + (r0 + r) * stride, row, valid * sizeof(float));
  }
}

// Rows [r0, r0 + R) of panel p.
template <int R>
void int8_tile(const BlockWeights& w, const Activations& a, const Outputs& y, int64_t p, int64_t r0) {
  const int64_t nb = w.k / w.block_size, groups = w.k / kGroupK, per_block = w.block_size / kGroupK;
  const uint8_t* codes = w.codes + p * (w.k / 2) * 16;
  const int8_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = a.x8.get() + (r0 + r) * w.k;
  __m256 y_lo[R], y_hi[R];
  for (int r = 0; r < R; ++r) y_lo[r] = y_hi[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (per_block == 1) {  // blocks of 32 (Q4_0, Q4_1, Q4_K's sub-blocks): y += isum * (s * scale) + offset * sum
      __m256i lo[R], hi[R];
      group_sums<R>(codes, x, b * kGroupK, lo, hi);
      const Vec2 scale = load_params(w, w.scales, w.scale_super, (p * nb + b) * kPanel);
      const Vec2 offset = load_params(w, w.offsets, w.offset_super, (p * nb + b) * kPanel);
      for (int r = 0; r < R; ++r) {
        const __m256 s = _mm256_set1_ps(a.x8_scale[(r0 + r) * groups + b]);
        const __m256 sum = _mm256_set1_ps(a.block_sums[(r0 + r) * nb + b]);
        y_lo[r] = _mm256_fmadd_ps(offset.lo, sum, _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[r]), _mm256_mul_ps(s, scale.lo), y_lo[r]));
        y_hi[r] = _mm256_fmadd_ps(offset.hi, sum, _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[r]), _mm256_mul_ps(s, scale.hi), y_hi[r]));
      }
      continue;
    }
    __m256 b_lo[R], b_hi[R];  // the block's sum of s_g * integer sums
    for (int r = 0; r < R; ++r) b_lo[r] = b_hi[r] = _mm256_setzero_ps();
    for (int64_t g = b * per_block; g < (b + 1) * per_block; ++g) {
      __m256i lo[R], hi[R];
      group_sums<R>(codes, x, g * kGroupK, lo, hi);
      for (int r = 0; r < R; ++r) {
        const __m256 s = _mm256_set1_ps(a.x8_scale[(r0 + r) * groups + g]);
        b_lo[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[r]), s, b_lo[r]);
        b_hi[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[r]), s, b_hi[r]);
      }
    }
    const Vec2 scale = load_params(w, w.scales, w.scale_super, (p * nb + b) * kPanel);
    const Vec2 offset = load_params(w, w.offsets, w.offset_super, (p * nb + b) * kPanel);
    for (int r = 0; r < R; ++r) {
      const __m256 sum = _mm256_set1_ps(a.block_sums[(r0 + r) * nb + b]);
      y_lo[r] = _mm256_fmadd_ps(offset.lo, sum, _mm256_fmadd_ps(b_lo[r], scale.lo, y_lo[r]));
      y_hi[r] = _mm256_fmadd_ps(offset.hi, sum, _mm256_fmadd_ps(b_hi[r], scale.hi, y_hi[r]));
    }
  }
  store_rows<R>(w, y, p, r0, y_lo, y_hi);
}

// 8-bit codes below 64 (w.small_codes: Q6_K, Q5_0, Q5_1, Q5_K), rows [r0, r0 + R) of panel p. x is in natural
// order here (quads k, k+1, k+2, k+3). Per quad of k the two pairs' 32 code bytes (column c at byte 2c + k % 2)
// interleave by 16 bits into columns (0-3, 8-11) and (4-7, 12-15), four k of one column a 32-bit lane, so one
// vpmaddubsw and one vpmaddwd give each column's int32 sum; two quads add in int16 first (4 products of a code
// < 64 and |q| <= 127: 32004 < 32767). The float32 accumulators keep that column order until the store.
template <int R>
void int8_tile8(const BlockWeights& w, const Activations& a, const Outputs& y, int64_t p, int64_t r0) {
  const int64_t nb = w.k / w.block_size, groups = w.k / kGroupK, quads = w.block_size / 4;
  const uint8_t* codes = w.codes + p * (w.k / 2) * 32;
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = a.x8.get() + (r0 + r) * w.k;
  __m256 y_a[R], y_b[R];  // columns 0-3, 8-11 and 4-7, 12-15
  for (int r = 0; r < R; ++r) y_a[r] = y_b[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t k0 = b * w.block_size;
    const uint8_t* c = codes + (k0 / 2) * 32;
    __m256i acc_a[R], acc_b[R];
    for (int r = 0; r < R; ++r) acc_a[r] = acc_b[r] = _mm256_setzero_si256();
    for (int64_t q = 0; q < quads; q += 2) {
      __m256i s_a[R], s_b[R];
      for (int h = 0; h < 2; ++h) {
        const uint8_t* cq = c + (q + h) * 64;
        if (R <= 2) _mm_prefetch(reinterpret_cast<const char*>(cq + kPrefetchBytes), _MM_HINT_T0);
        const __m256i p0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cq));
        const __m256i p1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cq + 32));
        const __m256i u_a = _mm256_unpacklo_epi16(p0, p1), u_b = _mm256_unpackhi_epi16(p0, p1);
        for (int r = 0; r < R; ++r) {
          int32_t pattern;
          std::memcpy(&pattern, x[r] + k0 + 4 * (q + h), sizeof pattern);
          const __m256i xb = _mm256_set1_epi32(pattern);
          const __m256i m_a = _mm256_maddubs_epi16(u_a, xb), m_b = _mm256_maddubs_epi16(u_b, xb);
          s_a[r] = h == 0 ? m_a : _mm256_add_epi16(s_a[r], m_a);
          s_b[r] = h == 0 ? m_b : _mm256_add_epi16(s_b[r], m_b);
        }
      }
      for (int r = 0; r < R; ++r) {
        acc_a[r] = _mm256_add_epi32(acc_a[r], _mm256_madd_epi16(s_a[r], ones));
        acc_b[r] = _mm256_add_epi32(acc_b[r], _mm256_madd_epi16(s_b[r], ones));
      }
    }
    const Vec2 scale = load_params(w, w.scales, w.scale_super, (p * nb + b) * kPanel);
    const Vec2 offset = load_params(w, w.offsets, w.offset_super, (p * nb + b) * kPanel);
    const __m256 scale_a = _mm256_permute2f128_ps(scale.lo, scale.hi, 0x20);
    const __m256 scale_b = _mm256_permute2f128_ps(scale.lo, scale.hi, 0x31);
    const __m256 offset_a = _mm256_permute2f128_ps(offset.lo, offset.hi, 0x20);
    const __m256 offset_b = _mm256_permute2f128_ps(offset.lo, offset.hi, 0x31);
    for (int r = 0; r < R; ++r) {  // y += isum * (s * scale) + offset * sum, as the 4-bit tiles
      const __m256 s = _mm256_set1_ps(a.x8_scale[(r0 + r) * groups + k0 / kGroupK]);
      const __m256 sum = _mm256_set1_ps(a.block_sums[(r0 + r) * nb + b]);
      y_a[r] = _mm256_fmadd_ps(offset_a, sum, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc_a[r]), _mm256_mul_ps(s, scale_a), y_a[r]));
      y_b[r] = _mm256_fmadd_ps(offset_b, sum, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc_b[r]), _mm256_mul_ps(s, scale_b), y_b[r]));
    }
  }
  __m256 y_lo[R], y_hi[R];  // back in column order
  for (int r = 0; r < R; ++r) {
    y_lo[r] = _mm256_permute2f128_ps(y_a[r], y_b[r], 0x20);
    y_hi[r] = _mm256_permute2f128_ps(y_a[r], y_b[r], 0x31);
  }
  store_rows<R>(w, y, p, r0, y_lo, y_hi);
}

}  // namespace

bool codes_below_64(const uint8_t* codes, int64_t bytes) {
  uint8_t any = 0;
  for (int64_t i = 0; i < bytes; ++i) any |= codes[i];
  return (any & 0xC0) == 0;
}

bool begin_int8(const BlockWeights& w, Activations& a) {
  const bool fits4 = w.bits == 4 && w.block_size % kGroupK == 0;
  // 8-bit: blocks of 16 or 32 (every GGUF type's), one activation scale a block (int8_tile8)
  const bool fits8 = w.bits == 8 && w.small_codes && (w.block_size == 16 || w.block_size == kGroupK);
  if (!(fits4 || fits8) || a.rows < 1) return false;
  a.x8.reset(new int8_t[static_cast<size_t>(a.rows * w.k)]);
  a.x8_scale.reset(new float[static_cast<size_t>(a.rows * (w.k / kGroupK))]);
  a.block_sums.reset(new float[static_cast<size_t>(a.rows * (w.k / w.block_size))]);
  return true;
}

bool int8_rows(const BlockWeights& w, Activations& a, int64_t first, int64_t last) {
  const int64_t groups = w.k / kGroupK, per_block = std::max<int64_t>(1, w.block_size / kGroupK);
  const int64_t halves = w.block_size < kGroupK ? kGroupK / w.block_size : 1;  // blocks of 16: two a group
  for (int64_t r = first; r < last; ++r) {
    const float* xr = a.x + r * w.k;
    int8_t* q = a.x8.get() + r * w.k;
    for (int64_t g = 0; g < groups; ++g) {
      const float* v = xr + g * kGroupK;
      float amax = 0.0f, sum = 0.0f;
      for (int64_t i = 0; i < kGroupK; ++i) {
        amax = std::max(amax, std::fabs(v[i]));
        sum += v[i];
      }
      if (!std::isfinite(amax) || !std::isfinite(sum)) return false;  // inf / nan: the float32 path
      const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
      if (!std::isfinite(inverse)) return false;  // a max so small that 127 / max overflows
      a.x8_scale[r * groups + g] = amax / 127.0f;
      // block sums as the float32 path forms none: a plain float32 sum of the block's values in order
      if (halves > 1) {
        const int64_t per = kGroupK / halves;
        for (int64_t h = 0; h < halves; ++h) {
          float part = 0.0f;
          for (int64_t i = 0; i < per; ++i) part += v[h * per + i];
          a.block_sums[r * (w.k / w.block_size) + g * halves + h] = part;
        }
      } else {
        if (g % per_block == 0) a.block_sums[r * (groups / per_block) + g / per_block] = 0.0f;
        a.block_sums[r * (groups / per_block) + g / per_block] += sum;
      }
      int8_t lane[kGroupK];
      for (int64_t i = 0; i < kGroupK; ++i) {
        const float e = std::min(127.0f, std::max(-127.0f, v[i] * inverse));
        lane[i] = static_cast<int8_t>(std::nearbyint(e));
      }
      if (w.bits == 8) {  // natural order (int8_tile8)
        std::memcpy(q + g * kGroupK, lane, sizeof lane);
        continue;
      }
      for (int64_t j = 0; j < kGroupK; j += 4) {  // quads as the 4-bit codes lie: k, k + 2, k + 1, k + 3
        q[g * kGroupK + j] = lane[j];
        q[g * kGroupK + j + 1] = lane[j + 2];
        q[g * kGroupK + j + 2] = lane[j + 1];
        q[g * kGroupK + j + 3] = lane[j + 3];
      }
    }
  }
  return true;
}

int64_t int8_task_rows(const Activations& a) { return std::max<int64_t>(1, std::min(a.rows, kTaskRows)); }

void int8_panels(const BlockWeights& w, const Activations& a, const Outputs& y, int64_t first, int64_t last,
                 int64_t r0, int64_t r1) {
  if (w.bits == 8) {  // tiles of 2 rows (their int16 and int32 sums fill the registers), then 1
    for (int64_t p = first; p < last; ++p) {
      int64_t r = r0;
      for (; r + 2 <= r1; r += 2) int8_tile8<2>(w, a, y, p, r);
      if (r < r1) int8_tile8<1>(w, a, y, p, r);
    }
    return;
  }
  for (int64_t p = first; p < last; ++p) {
    int64_t r = r0;
    if ((r1 - r) % kRowsPerTile == 1 && r1 - r > kRowsPerTile) {  // 5, 9, ... rows: one tile of 5 (a verification
      int8_tile<kRowsPerTile + 1>(w, a, y, p, r);                  // step of 4 drafts reads the codes once)
      r += kRowsPerTile + 1;
    }
    for (; r + kRowsPerTile <= r1; r += kRowsPerTile) int8_tile<kRowsPerTile>(w, a, y, p, r);
    switch (r1 - r) {
      case 0: break;
      case 1: int8_tile<1>(w, a, y, p, r); break;
      case 2: int8_tile<2>(w, a, y, p, r); break;
      default: int8_tile<3>(w, a, y, p, r); break;
    }
  }
}

#else  // no AVX2: the float32 path takes these steps

bool codes_below_64(const uint8_t*, int64_t) { return false; }
bool begin_int8(const BlockWeights&, Activations&) { return false; }
bool int8_rows(const BlockWeights&, Activations&, int64_t, int64_t) { return false; }
int64_t int8_task_rows(const Activations& a) { return std::max<int64_t>(1, a.rows); }
void int8_panels(const BlockWeights&, const Activations&, const Outputs&, int64_t, int64_t, int64_t, int64_t) {}

#endif

}  // namespace octavo
