// octavo.BlockMatMul's bfloat16 path for a prompt's steps (what it computes and when: block_matmul_kernel.h).
//
// AMX tiles: per 32 rows of x and 2 panels (32 columns), four 16 x 16 float32 accumulator tiles (tmm0-3) take
// TDPBF16PS over 32 k at a time (x rows in tmm4-5, the panels' pairs of k in tmm6-7): 16 x 16 x 32
// multiply-adds an instruction, ~23 times the float32 FMA tiles' per cycle on a Sapphire Rapids core. Before the
// tiles run, the step's x is rounded to bfloat16 once (bf16_rows) and each panel's file values are dequantized
// to float32 (the float32 path's dequantize_panel) and rounded to bfloat16 in the tiles' pair-of-k layout by the
// tasks that use it (bf16_panel, once per task: 4 panels x a row block). Without AMX (bf16_dot_usable: Zen 4,
// Cooper Lake, or AMX switched off by octavo_set_amx, amx.h) the same operands run on AVX512-BF16 vectors
// (run_dot): VDPBF16PS adds a pair of products to each of 16 float32 sums, 6 rows x 4 panels of sums in registers;
// ~1.7x the float32 FMA tiles per node at 512-2048 rows on a Zen 4 (2 threads, SmolLM2's shapes), whose 512-bit
// FMAs are two 256-bit halves.
//
// The float32-grade path (the default for a prompt's steps, prompt_amx = 1): x is split into three bfloat16
// pieces that add up to it exactly and multiplied by the codes themselves (integers < 256, exact in bfloat16), so
// AMX forms every product exactly and only its float32 additions round. Per 32 rows x 2 panels and block, 12
// TDPBF16PS (3 pieces x 4 tiles) sum the block into four C tiles, which are stored and scaled into float32
// accumulators (scale * C + offset * block sum of x) while the next block's tiles run. ~1.1-1.5x the float32 FMA
// tiles per node on SmolLM2's shapes at 64-2048 rows, one thread (3 tile instructions per bfloat16 one, and the
// per-block stores and scaling, measured at about a third of the tile rate with the data in L1).
// Functions with AVX-512 or AMX instructions carry OCTAVO_AMX_TARGET (amx.h).
// Written by hand: ONNX Runtime's CPU kernels have no bfloat16 matmul over block-quantized weights, and none
// that computes float32 products on AMX.
#include "block_matmul_kernel.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "amx.h"

#if defined(OCTAVO_AMX)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace octavo {
namespace {

constexpr int64_t kTileK = 32;       // k per tile row: 32 bfloat16 = 64 bytes
constexpr int64_t kTileM = 16;       // rows per tile
constexpr int64_t kDequantK = 1536;  // k per float32 staging buffer of bf16_panels (96 KiB)

// Whether the AMX paths may run in this process (octavo_set_amx, below): the caller's switch, not the CPU's
std::atomic<bool> amx_allowed{true};

#if defined(OCTAVO_AMX)
constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an extended state component
constexpr long kXtileData = 18;             // the tile data state (XFEATURE_XTILEDATA)

// AVX512-BF16 (with F, BW, VL) and the OS saving ZMM state: the bfloat16 prompt paths' vector kernels, for CPUs
// without AMX (Zen 4 and later, Cooper Lake).
bool detect_avx512_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(1, 0, &a, &b, &c, &d) || !(c >> 27 & 1)) return false;  // OSXSAVE
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || a < 1) return false;
  if (!((b >> 16 & 1) && (b >> 30 & 1) && (b >> 31 & 1))) return false;  // F, BW, VL
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  if (!__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) || !(a1 >> 5 & 1)) return false;  // AVX512-BF16
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & 0xE6) == 0xE6;  // the OS saves the opmask and ZMM state
}

bool detect_amx() {
  if (!detect_avx512_bf16()) return false;  // every AMX CPU has it; the bfloat16 paths convert with it
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22 & 1) && (d >> 24 & 1))) return false;  // AMX-BF16, -TILE
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo >> 17 & 3) != 3) return false;  // the OS saves the tile state
  // Linux hands the tile data state (8 KiB per thread) only to a process that asks for it (for every thread)
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXtileData) == 0;
}

bool detect_amx_int8() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 25 & 1);  // AMX-INT8 (beside what detect_amx asks)
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

OCTAVO_AMX_TARGET void load_tiles() {  // the one configuration of every AMX path
  TileConfig config;
  for (int t = 0; t < 8; ++t) {  // every tile 16 rows x 64 bytes: C 16 x 16 float, A 16 x 32 bf16, B 16 pairs x 16
    config.rows[t] = kTileM;
    config.colsb[t] = 64;
  }
  // not _tile_loadconfig: its asm tells GCC it reads 8 bytes of the config, and GCC dropped the stores of the rest
  __asm__ volatile("ldtilecfg %0" : : "m"(config));
}

OCTAVO_AMX_TARGET void release_tiles() { _tile_release(); }

// x rows [first, last) of the padded rows to bfloat16 (nearest even), zeros past k and past rows.
OCTAVO_AMX_TARGET void round_rows(const float* x, int64_t k, int64_t kp, int64_t rows, int64_t first, int64_t last,
                                  uint16_t* xb) {
  for (int64_t r = first; r < last; ++r) {
    uint16_t* out = xb + r * kp;
    if (r >= rows) {
      std::memset(out, 0, static_cast<size_t>(kp) * sizeof(uint16_t));
      continue;
    }
    const float* in = x + r * k;
    for (int64_t i = 0; i < kp; i += 16) {
      const int64_t valid = std::clamp<int64_t>(k - i, 0, 16);
      const __m512 v = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << valid) - 1u), in + i);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// Panel p's float32 values buf[(k - k0) * 16 + c], k in [k0, k1), into its bfloat16 pairs: out[(k / 2) * 32 +
// 2 * c + k % 2].
OCTAVO_AMX_TARGET void round_pairs(const float* buf, int64_t k0, int64_t k1, uint16_t* out) {
  alignas(64) static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                           8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_load_si512(kInterleave);
  for (int64_t k = k0; k < k1; k += 2) {
    const float* even = buf + (k - k0) * kPanel;
    const __m512i pair = (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(even + kPanel), _mm512_load_ps(even));
    _mm512_storeu_si512(out + (k / 2) * 32, _mm512_permutexvar_epi16(order, pair));
  }
}

// The 16 x 16 float32 tile at SRC (stride 16) plus the panel's bias into y rows [row, row + count) of panel p.
OCTAVO_AMX_TARGET void write_tile(const BlockWeights& w, const Outputs& y, int64_t p, int64_t row, int64_t count,
                                  const float* src) {
  const int64_t valid = std::min<int64_t>(kPanel, w.n - p * kPanel);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
  const __m512 bias = w.bias != nullptr ? _mm512_maskz_loadu_ps(mask, w.bias + p * kPanel) : _mm512_setzero_ps();
  int64_t stride = 0;
  float* out = y.panel(p, stride) + row * stride;
  for (int64_t i = 0; i < count; ++i) {
    _mm512_mask_storeu_ps(out + i * stride, mask, _mm512_add_ps(_mm512_load_ps(src + i * kPanel), bias));
  }
}

// The C tiles of RT row tiles x NP panels (tile t * NP + g) zeroed, and stored at C + (t * NP + g) * 256.
template <int RT, int NP>
OCTAVO_AMX_TARGET void zero_tiles() {
  _tile_zero(0);
  if constexpr (NP == 2) _tile_zero(1);
  if constexpr (RT == 2) _tile_zero(2);
  if constexpr (RT == 2 && NP == 2) _tile_zero(3);
}

template <int RT, int NP>
OCTAVO_AMX_TARGET void store_tiles(float* c) {
  _tile_stored(0, c, 64);
  if constexpr (NP == 2) _tile_stored(1, c + 256, 64);
  if constexpr (RT == 2) _tile_stored(2, c + NP * 256, 64);
  if constexpr (RT == 2 && NP == 2) _tile_stored(3, c + 768, 64);
}

// RT x 16 rows of xb at A (row stride kp) against NP panels' pairs (B0, B1): the float32 sums into C (RT * NP
// tiles of 16 x 16: rows t, panel g at c + (t * NP + g) * 256), each over k in order, 32 k an instruction.
template <int RT, int NP>
OCTAVO_AMX_TARGET void tile_block(const uint16_t* a, int64_t kp, const uint16_t* b0, const uint16_t* b1, float* c) {
  const int64_t a_stride = kp * static_cast<int64_t>(sizeof(uint16_t));
  zero_tiles<RT, NP>();
  for (int64_t k = 0; k < kp; k += kTileK) {
    _tile_loadd(4, a + k, a_stride);
    _tile_loadd(6, b0 + (k / 2) * 32, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NP == 2) {
      _tile_loadd(7, b1 + (k / 2) * 32, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (RT == 2) {
      _tile_loadd(5, a + kTileM * kp + k, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NP == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  store_tiles<RT, NP>(c);  // rows t, panel g: c + (t * NP + g) * 256
}

// Panel p's file values (the float32 path's dequantize_panel, through a float32 staging buffer of kDequantK k) as
// bfloat16 pairs of k (round_pairs) at OUT, zeros past k up to KP.
OCTAVO_AMX_TARGET void bf16_panel(const BlockWeights& w, int64_t kp, int64_t p, float* staging, uint16_t* out) {
  for (int64_t k0 = 0; k0 < w.k; k0 += kDequantK) {
    const int64_t k1 = std::min(w.k, k0 + kDequantK);
    dequantize_panel(w, p, k0, k1, staging);
    round_pairs(staging, k0, k1, out);
  }
  std::memset(out + (w.k / 2) * 32, 0, static_cast<size_t>((kp / 2 - w.k / 2) * 32) * sizeof(uint16_t));
}

// Panels [first, last) as bf16_panel gives them, one after another (kp / 2 * 32 values each), through one staging
// buffer: the operands of a task of the bfloat16 path (run_amx, run_dot).
OCTAVO_AMX_TARGET TileBuffer bf16_panels(const BlockWeights& w, int64_t kp, int64_t first, int64_t last) {
  const int64_t panel = kp / 2 * 32;
  TileBuffer panels = tile_buffer((last - first) * panel);
  std::unique_ptr<float[]> buf(new float[static_cast<size_t>(kDequantK * kPanel) + 16]);
  float* staging = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.get()) + 63) & ~uintptr_t{63});
  for (int64_t p = first; p < last; ++p) bf16_panel(w, kp, p, staging, panels.get() + (p - first) * panel);
  return panels;
}

// The task's panels [first, last) (4: block_matmul_task_panels) are dequantized and rounded here, into a buffer of
// the task's own (4 x K x 32 bytes), not the whole matrix once per step: no per-step buffer of N x K x 2 bytes, at
// the cost of one dequantization per row block.
OCTAVO_AMX_TARGET void run_amx(const BlockWeights& w, const Activations& a, const Outputs& y, int64_t first,
                               int64_t last, int64_t r0, int64_t r1) {
  const int64_t kp = a.k_padded, pairs = kp / 2;
  const TileBuffer panels = bf16_panels(w, kp, first, last);
  load_tiles();
  alignas(64) float c[4 * 256];
  for (int64_t p = first; p < last; p += 2) {
    const int np = last - p >= 2 ? 2 : 1;
    const uint16_t* b0 = panels.get() + (p - first) * pairs * 32;
    const uint16_t* b1 = b0 + pairs * 32;
    for (int64_t row = r0; row < r1; row += 2 * kTileM) {
      const int rt = r1 - row > kTileM ? 2 : 1;  // the padded rows (zeros) complete a partial tile
      const uint16_t* x = a.xb.get() + row * kp;
      if (rt == 2 && np == 2) tile_block<2, 2>(x, kp, b0, b1, c);
      if (rt == 2 && np == 1) tile_block<2, 1>(x, kp, b0, b1, c);
      if (rt == 1 && np == 2) tile_block<1, 2>(x, kp, b0, b1, c);
      if (rt == 1 && np == 1) tile_block<1, 1>(x, kp, b0, b1, c);
      for (int t = 0; t < rt; ++t) {
        const int64_t top = row + t * kTileM, count = std::min<int64_t>(kTileM, r1 - top);
        for (int g = 0; g < np; ++g) write_tile(w, y, p + g, top, count, c + (t * np + g) * 256);
      }
    }
  }
  _tile_release();
}

// ---- the bfloat16 path on AVX512-BF16 without AMX (block_matmul_kernel.h, "dot") ----

// R rows of xb from X (row stride KP) x NP panels' bfloat16 pairs (B, PANEL apart): VDPBF16PS, each output's two
// products of a pair of k added to its float32 sum pair by pair, k in order; plus bias, into y.
template <int R, int NP>
OCTAVO_AMX_TARGET void dot_tile(const BlockWeights& w, const Outputs& y, int64_t p, int64_t row, const uint16_t* x,
                                int64_t kp, const uint16_t* b, int64_t panel) {
  __m512 acc[R][NP];
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < NP; ++g) acc[r][g] = _mm512_setzero_ps();
  }
  const int64_t pairs = w.k / 2;  // xb and the panels hold zeros past k
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh bv[NP];
    for (int g = 0; g < NP; ++g) bv[g] = (__m512bh)_mm512_load_si512(b + g * panel + j * 32);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      int32_t pair = 0;
      std::memcpy(&pair, x + r * kp + 2 * j, sizeof pair);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int g = 0; g < NP; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], xv, bv[g]);
    }
  }
  for (int g = 0; g < NP; ++g) {
    const int64_t valid = std::min<int64_t>(kPanel, w.n - (p + g) * kPanel);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    const __m512 bias = w.bias != nullptr ? _mm512_maskz_loadu_ps(mask, w.bias + (p + g) * kPanel) : _mm512_setzero_ps();
    int64_t stride = 0;
    float* out = y.panel(p + g, stride) + row * stride;
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * stride, mask, _mm512_add_ps(acc[r][g], bias));
  }
}

template <int NP>
OCTAVO_AMX_TARGET void dot_rows(const BlockWeights& w, const Outputs& y, int64_t p, int64_t row, int64_t count,
                                const uint16_t* x, int64_t kp, const uint16_t* b, int64_t panel) {
  switch (count) {
    case 1: return dot_tile<1, NP>(w, y, p, row, x, kp, b, panel);
    case 2: return dot_tile<2, NP>(w, y, p, row, x, kp, b, panel);
    case 3: return dot_tile<3, NP>(w, y, p, row, x, kp, b, panel);
    case 4: return dot_tile<4, NP>(w, y, p, row, x, kp, b, panel);
    case 5: return dot_tile<5, NP>(w, y, p, row, x, kp, b, panel);
    default: return dot_tile<6, NP>(w, y, p, row, x, kp, b, panel);
  }
}

// The task's panels [first, last) (at most 4) dequantized and rounded into a buffer of the task's own, as run_amx
// does, then 6 rows x 4 panels at a time: 24 float32 accumulators in registers, a pair of k an instruction.
OCTAVO_AMX_TARGET void run_dot(const BlockWeights& w, const Activations& a, const Outputs& y, int64_t first,
                               int64_t last, int64_t r0, int64_t r1) {
  constexpr int64_t kRows = 6;
  const int64_t kp = a.k_padded, panel = kp / 2 * 32;
  const TileBuffer panels = bf16_panels(w, kp, first, last);
  for (int64_t p = first; p < last; p += 4) {
    const int64_t np = std::min<int64_t>(4, last - p);
    const uint16_t* b = panels.get() + (p - first) * panel;
    for (int64_t row = r0; row < r1; row += kRows) {
      const int64_t count = std::min(kRows, r1 - row);
      const uint16_t* x = a.xb.get() + row * kp;
      switch (np) {
        case 1: dot_rows<1>(w, y, p, row, count, x, kp, b, panel); break;
        case 2: dot_rows<2>(w, y, p, row, count, x, kp, b, panel); break;
        case 3: dot_rows<3>(w, y, p, row, count, x, kp, b, panel); break;
        default: dot_rows<4>(w, y, p, row, count, x, kp, b, panel); break;
      }
    }
  }
}

// ---- the float32-grade path (block_matmul_kernel.h, "split"): x = x0 + x1 + x2 exactly, codes exact in bf16 ----

inline __m512 widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// x rows [first, last) of the padded rows as three bfloat16 pieces (xb + piece * piece_stride) and each block's
// float32 sum; false where a value is not finite, |x| >= 2^100 (products with codes up to 255 must stay finite in
// float32) or a nonzero |x| < 2^-100 (its last piece would be a bfloat16 subnormal, which AMX reads as zero).
OCTAVO_AMX_TARGET bool split_rows_range(const BlockWeights& w, Activations& a, int64_t first, int64_t last) {
  const int64_t kp = a.k_padded, nb = w.k / w.block_size, stride = a.piece_stride;
  const __m512 huge = _mm512_set1_ps(0x1p100f), tiny = _mm512_set1_ps(0x1p-100f), zero = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (int64_t r = first; r < last; ++r) {
    uint16_t* out = a.xb.get() + r * kp;
    float* sums = a.block_sums.get() + r * nb;
    if (r >= a.rows) {
      for (int piece = 0; piece < 3; ++piece) std::memset(out + piece * stride, 0, static_cast<size_t>(kp) * 2);
      std::memset(sums, 0, static_cast<size_t>(nb) * sizeof(float));
      continue;
    }
    const float* in = a.x + r * w.k;
    for (int64_t b = 0; b < nb; ++b) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t i = b * w.block_size; i < (b + 1) * w.block_size; i += 16) {
        const __m512 v = _mm512_loadu_ps(in + i);
        const __m512 mag = _mm512_abs_ps(v);
        bad |= _mm512_cmp_ps_mask(mag, huge, _CMP_NLT_UQ);  // also nan
        bad |= _mm512_cmp_ps_mask(mag, tiny, _CMP_LT_OQ) & _mm512_cmp_ps_mask(mag, zero, _CMP_NEQ_OQ);
        sum = _mm512_add_ps(sum, v);
        const __m256i h0 = (__m256i)_mm512_cvtneps_pbh(v);
        const __m512 r1 = _mm512_sub_ps(v, widen_bf16(h0));   // exact: the bits below x0's 8
        const __m256i h1 = (__m256i)_mm512_cvtneps_pbh(r1);
        const __m512 r2 = _mm512_sub_ps(r1, widen_bf16(h1));  // exact, and at most 8 significant bits
        const __m256i h2 = (__m256i)_mm512_cvtneps_pbh(r2);   // exactly r2
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), h0);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + stride + i), h1);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * stride + i), h2);
      }
      sums[b] = _mm512_reduce_add_ps(sum);
    }
  }
  return bad == 0;
}

// 32 signed 16-bit codes (in the pair's element order) as 32 bfloat16 (exact: |code| < 256).
OCTAVO_AMX_TARGET inline __m512i codes_bf16(__m512i codes) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(codes)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(codes, 1)));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// The block's 16 float32 scales or offsets (block_matmul_kernel.cc's load_params, two-level scales included).
OCTAVO_AMX_TARGET inline __m512 load_params(const BlockWeights& w, const void* base, const float* super, int64_t index) {
  if (super != nullptr) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + index));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_loadu_ps(w.super_at(super, index)));
  }
  if (w.half_scales) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + index)));
  }
  return _mm512_loadu_ps(static_cast<const float*>(base) + index);
}

// Block b of panel p: where a column's offset is exactly -z * scale for an integer z in [1, 255] (a zero point:
// Q4_0's 8, Q5_0's 16, Q8_0's 128, the int8 / int4 exports'), its codes become code - z and its offset 0, the
// same weights exactly; the term scale * C + offset * (block sum) then does not cancel. Returns z per element of
// a pair ((z_c, z_c) in 32-bit lane c) and writes the offsets the split path uses to OFFSETS (16).
OCTAVO_AMX_TARGET inline __m512i zero_points(const BlockWeights& w, int64_t p, int64_t b, float* offsets) {
  const int64_t index = (p * (w.k / w.block_size) + b) * kPanel;
  const __m512 scale = load_params(w, w.scales, w.scale_super, index);
  const __m512 offset = load_params(w, w.offsets, w.offset_super, index);
  const __m512 z = _mm512_roundscale_ps(_mm512_div_ps(_mm512_sub_ps(_mm512_setzero_ps(), offset), scale),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __mmask16 exact = _mm512_cmp_ps_mask(z, _mm512_set1_ps(1.0f), _CMP_GE_OQ) &
                    _mm512_cmp_ps_mask(z, _mm512_set1_ps(255.0f), _CMP_LE_OQ);
  exact &= _mm512_cmp_ps_mask(_mm512_fmadd_ps(z, scale, offset), _mm512_setzero_ps(), _CMP_EQ_OQ);  // z s + o == 0
  _mm512_storeu_ps(offsets, _mm512_mask_mov_ps(offset, exact, _mm512_setzero_ps()));
  const __m512i zi = _mm512_maskz_cvtps_epi32(exact, z);
  return _mm512_or_si512(zi, _mm512_slli_epi32(zi, 16));
}

// Panel p's codes (minus their zero points, zero_points) as bfloat16 in the tiles' pair-of-k layout:
// out[(k / 2) * 32 + e], e = 2c + k % 2 -- the element order the codes input already has for every pair
// (block_matmul_kernel.h); the split path's offsets of the panel into OFFSETS ([nb][16]).
OCTAVO_AMX_TARGET void code_pairs(const BlockWeights& w, int64_t p, uint16_t* out, float* offsets) {
  const int64_t pairs = w.k / 2, block_pairs = w.block_size / 2;
  if (w.bits == 8) {
    const uint8_t* c = w.codes + p * pairs * 32;
    for (int64_t b = 0; b * block_pairs < pairs; ++b) {
      const __m512i z = zero_points(w, p, b, offsets + b * kPanel);
      for (int64_t j = b * block_pairs; j < (b + 1) * block_pairs; ++j) {
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + j * 32)));
        _mm512_storeu_si512(out + j * 32, codes_bf16(_mm512_sub_epi16(v, z)));
      }
    }
    return;
  }
  // 4-bit: pairs 2q and 2q + 1 share 32 bytes; byte 2i + (pair % 2) holds element i (low nibble) and i + 16
  alignas(64) static constexpr uint16_t kEven[32] = {0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                                     32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62};
  const __m512i even = _mm512_load_si512(kEven), odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
  const __m512i mask = _mm512_set1_epi16(15);
  const uint8_t* c = w.codes + p * pairs * 16;
  for (int64_t b = 0; b * block_pairs < pairs; ++b) {
    const __m512i z = zero_points(w, p, b, offsets + b * kPanel);
    for (int64_t j = b * block_pairs; j < (b + 1) * block_pairs; j += 2) {  // blocks hold an even number of pairs
      const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + j * 16)));
      const __m512i lo = _mm512_and_si512(bytes, mask), hi = _mm512_srli_epi16(bytes, 4);
      _mm512_storeu_si512(out + j * 32, codes_bf16(_mm512_sub_epi16(_mm512_permutex2var_epi16(lo, even, hi), z)));
      _mm512_storeu_si512(out + (j + 1) * 32, codes_bf16(_mm512_sub_epi16(_mm512_permutex2var_epi16(lo, odd, hi), z)));
    }
  }
}

// One block's sums of x's three pieces times the codes: RT x 16 rows (tile t at x + t * 16 rows) by NP panels,
// into C tiles t * NP + g, the smallest piece first, 32 k an instruction, the block's k in order.
template <int RT, int NP>
OCTAVO_AMX_TARGET void split_issue(const uint16_t* x, int64_t a_stride, int64_t piece, int64_t tile_rows,
                                   const uint16_t* b0, const uint16_t* b1, int64_t k0, int64_t k1) {
  zero_tiles<RT, NP>();
  for (int64_t k = k0; k < k1; k += kTileK) {
    _tile_loadd(6, b0 + (k / 2) * 32, 64);
    if constexpr (NP == 2) _tile_loadd(7, b1 + (k / 2) * 32, 64);
    for (int64_t pc = 2; pc >= 0; --pc) {
      const uint16_t* a = x + pc * piece + k;
      _tile_loadd(4, a, a_stride);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (NP == 2) _tile_dpbf16ps(1, 4, 7);
      if constexpr (RT == 2) {
        _tile_loadd(5, a + tile_rows, a_stride);
        _tile_dpbf16ps(2, 5, 6);
        if constexpr (NP == 2) _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
}

// acc[t][g][r] += scale(b) * C[t][g][r] + offset(b) * sum_{t, r}(b), in that order (FIRST: acc starts at 0, as
// the additions to +0.0f would give, but without reading it).
template <int RT, int NP, bool First>
OCTAVO_AMX_TARGET void split_scale(const BlockWeights& w, const float* offsets, int64_t p, int64_t b, const float* c,
                                   const float* sums, int64_t nb, float* acc) {
  for (int g = 0; g < NP; ++g) {
    const int64_t index = ((p + g) * nb + b) * kPanel;
    const __m512 scale = load_params(w, w.scales, w.scale_super, index);
    const __m512 offset = _mm512_loadu_ps(offsets + (g * nb + b) * kPanel);
    for (int t = 0; t < RT; ++t) {
      const float* ct = c + (t * NP + g) * 256;
      float* at = acc + (t * NP + g) * 256;
      const float* st = sums + t * kTileM * nb + b;
#pragma GCC unroll 16
      for (int r = 0; r < kTileM; ++r) {
        __m512 v = First ? _mm512_mul_ps(scale, _mm512_load_ps(ct + r * 16))
                         : _mm512_fmadd_ps(scale, _mm512_load_ps(ct + r * 16), _mm512_load_ps(at + r * 16));
        v = _mm512_fmadd_ps(offset, _mm512_set1_ps(st[r * nb]), v);
        _mm512_store_ps(at + r * 16, v);
      }
    }
  }
}

// RT x 16 rows from ROW (COUNT of them real) x NP panels from P on the split path; B0 (B1): the panels' codes in
// bfloat16 pairs (code_pairs), OFFSETS their split offsets ([NP][nb][16]).
template <int RT, int NP>
OCTAVO_AMX_TARGET void split_tile(const BlockWeights& w, const Activations& a, const Outputs& y, int64_t p, int64_t row,
                                  int64_t count, const uint16_t* b0, const uint16_t* b1, const float* offsets) {
  const int64_t kp = a.k_padded, nb = w.k / w.block_size, bs = w.block_size;
  const uint16_t* x = a.xb.get() + row * kp;
  const float* sums = a.block_sums.get() + row * nb;
  const int64_t stride = kp * static_cast<int64_t>(sizeof(uint16_t)), piece = a.piece_stride, tile_rows = kTileM * kp;
  constexpr int kTiles = RT * NP;
  alignas(64) float acc[kTiles * 256];
  alignas(64) float c[2][kTiles * 256];
  const auto scale = [&](int64_t b) {  // block b's sums (in c[b & 1]) into acc; block 0 starts it
    if (b == 0) return split_scale<RT, NP, true>(w, offsets, p, 0, c[0], sums, nb, acc);
    split_scale<RT, NP, false>(w, offsets, p, b, c[b & 1], sums, nb, acc);
  };
  // block b's tiles run while block b - 1's sums (stored to the other buffer) are scaled
  split_issue<RT, NP>(x, stride, piece, tile_rows, b0, b1, 0, bs);
  store_tiles<RT, NP>(c[0]);
  for (int64_t b = 1; b < nb; ++b) {
    split_issue<RT, NP>(x, stride, piece, tile_rows, b0, b1, b * bs, (b + 1) * bs);
    scale(b - 1);
    store_tiles<RT, NP>(c[b & 1]);
  }
  scale(nb - 1);
  for (int t = 0; t < RT; ++t) {
    const int64_t top = row + t * kTileM, rows = std::min<int64_t>(kTileM, count - t * kTileM);
    for (int g = 0; g < NP; ++g) write_tile(w, y, p + g, top, rows, acc + (t * NP + g) * 256);
  }
}

// The task's panels [first, last) (a group of 4: block_matmul_task_panels) are converted to bfloat16 code pairs
// here, into a buffer of the task's own (4 x K x 32 bytes: 72 KiB at K = 576, 512 KiB at 4096), not once per
// step for the whole matrix: no per-step buffer of the weights' size, at the cost of one conversion per row block.
OCTAVO_AMX_TARGET void run_split(const BlockWeights& w, const Activations& a, const Outputs& y, int64_t first,
                                 int64_t last, int64_t r0, int64_t r1) {
  const int64_t pairs = w.k / 2, nb = w.k / w.block_size, panels = last - first;
  TileBuffer codes = tile_buffer(panels * pairs * 32);
  std::unique_ptr<float[]> offsets(new float[static_cast<size_t>(panels * nb * kPanel)]);
  for (int64_t g = 0; g < panels; ++g) {
    code_pairs(w, first + g, codes.get() + g * pairs * 32, offsets.get() + g * nb * kPanel);
  }
  load_tiles();
  for (int64_t p = first; p < last; p += 2) {
    const bool two = last - p >= 2;
    const uint16_t* b0 = codes.get() + (p - first) * pairs * 32;
    const uint16_t* b1 = two ? b0 + pairs * 32 : nullptr;
    const float* off = offsets.get() + (p - first) * nb * kPanel;
    for (int64_t row = r0; row < r1; row += 2 * kTileM) {
      const int64_t count = std::min<int64_t>(2 * kTileM, r1 - row);
      if (count > kTileM) {
        two ? split_tile<2, 2>(w, a, y, p, row, count, b0, b1, off) : split_tile<2, 1>(w, a, y, p, row, count, b0, b1, off);
      } else {
        two ? split_tile<1, 2>(w, a, y, p, row, count, b0, b1, off) : split_tile<1, 1>(w, a, y, p, row, count, b0, b1, off);
      }
    }
  }
  _tile_release();
}

// ---- the 16-bit path's decode batches on AMX-INT8 (block_matmul_kernel.h, "amx_int") ----

OCTAVO_AMX_INT8_TARGET void load_int_tiles() {
  TileConfig config;
  for (int t = 0; t < 4; ++t) {  // C: 16 x 16 int32
    config.rows[t] = kTileM;
    config.colsb[t] = 64;
  }
  for (int t = 4; t < 6; ++t) {  // A: 16 rows x 32 k bytes (x's low bytes, high bytes)
    config.rows[t] = kTileM;
    config.colsb[t] = 32;
  }
  for (int t = 6; t < 8; ++t) {  // B: 8 quads of k x 16 columns x 4 bytes (a panel's codes)
    config.rows[t] = kTileK / 4;
    config.colsb[t] = 64;
  }
  __asm__ volatile("ldtilecfg %0" : : "m"(config));
}

// Panel p's codes as bytes in the tiles' quad-of-k layout: out[(k / 4) * 64 + 4 * c + k % 4].
OCTAVO_AMX_INT8_TARGET void code_quads(const BlockWeights& w, int64_t p, uint8_t* out) {
  const int64_t quads = w.k / 4;
  if (w.bits == 8) {  // quad j = pairs 2j, 2j + 1: their 16-bit units (a column's 2 k) interleaved
    alignas(64) static constexpr uint16_t kUnits[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i order = _mm512_load_si512(kUnits);
    const uint8_t* c = w.codes + p * (w.k / 2) * 32;
    for (int64_t j = 0; j < quads; ++j) {
      _mm512_storeu_si512(out + j * 64, _mm512_permutexvar_epi16(order, _mm512_loadu_si512(c + j * 64)));
    }
    return;
  }
  // 4-bit: quad j's 32 bytes hold, for column c < 8, its 4 k in the low nibbles of bytes 4c, 4c + 2, 4c + 1,
  // 4c + 3 (pair 2j k 0, k 1, pair 2j + 1 k 0, k 1), and for c >= 8 in the high nibbles of bytes 4(c - 8) + ...
  const __m512i order = _mm512_set4_epi32(0x0F0D0E0C, 0x0B090A08, 0x07050604, 0x03010200);
  const __m256i nibble = _mm256_set1_epi8(15);
  const uint8_t* c = w.codes + p * (w.k / 2) * 16;
  for (int64_t j = 0; j < quads; ++j) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + j * 32));
    const __m256i lo = _mm256_and_si256(bytes, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    _mm512_storeu_si512(out + j * 64, _mm512_shuffle_epi8(both, order));
  }
}

// One block's int32 sums over 16 rows x NP panels: low bytes x codes into C tiles 0 (1), high bytes into 2 (3).
template <int NP>
OCTAVO_AMX_INT8_TARGET void int_issue(const uint8_t* lo, const uint8_t* hi, int64_t k_stride, const uint8_t* b0,
                                      const uint8_t* b1, int64_t k0, int64_t k1) {
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (NP == 2) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t k = k0; k < k1; k += kTileK) {
    _tile_loadd(6, b0 + (k / 4) * 64, 64);
    if constexpr (NP == 2) _tile_loadd(7, b1 + (k / 4) * 64, 64);
    _tile_loadd(4, lo + k, k_stride);
    _tile_dpbuud(0, 4, 6);
    if constexpr (NP == 2) _tile_dpbuud(1, 4, 7);
    _tile_loadd(5, hi + k, k_stride);
    _tile_dpbsud(2, 5, 6);
    if constexpr (NP == 2) _tile_dpbsud(3, 5, 7);
  }
}

template <int NP>
OCTAVO_AMX_INT8_TARGET void int_store(int32_t* c) {  // low sums of panel g at c + g * 256, high at c + 512 + g * 256
  _tile_stored(0, c, 64);
  _tile_stored(2, c + 512, 64);
  if constexpr (NP == 2) {
    _tile_stored(1, c + 256, 64);
    _tile_stored(3, c + 768, 64);
  }
}

// acc = offset * block_sum + (float(256 * high + low) * (scale * x_scale) + acc): the 16-bit tiles' operations on
// the same int32 sums (wide_integer_block), so the same bits; FIRST: acc starts at +0.0f as there.
template <int NP, bool First>
OCTAVO_AMX_INT8_TARGET void int_scale(const BlockWeights& w, const Activations& a, int64_t p, int64_t row,
                                      int64_t count, int64_t b, const int32_t* c, float* acc) {
  const int64_t nb = w.k / w.block_size;
  for (int g = 0; g < NP; ++g) {
    const int64_t index = ((p + g) * nb + b) * kPanel;
    const __m512 scale = load_params(w, w.scales, w.scale_super, index);
    const __m512 offset = load_params(w, w.offsets, w.offset_super, index);
    for (int64_t r = 0; r < count; ++r) {
      const __m512i low = _mm512_load_si512(c + g * 256 + r * 16), high = _mm512_load_si512(c + 512 + g * 256 + r * 16);
      const __m512i sums = _mm512_add_epi32(_mm512_slli_epi32(high, 8), low);
      const __m512 f = _mm512_set1_ps(a.q_scale[(row + r) * nb + b]), sum = _mm512_set1_ps(a.block_sums[(row + r) * nb + b]);
      const __m512 before = First ? _mm512_setzero_ps() : _mm512_load_ps(acc + g * 256 + r * 16);
      _mm512_store_ps(acc + g * 256 + r * 16,
                      _mm512_fmadd_ps(offset, sum, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(scale, f), before)));
    }
  }
}

template <int NP>
OCTAVO_AMX_INT8_TARGET void int_tile(const BlockWeights& w, const Activations& a, const Outputs& y, int64_t p,
                                     int64_t row, const uint8_t* b0, const uint8_t* b1) {
  const int64_t nb = w.k / w.block_size, bs = w.block_size, count = std::min<int64_t>(kTileM, a.rows - row);
  const uint8_t* lo = a.xlo.get() + row * w.k;
  const uint8_t* hi = a.xhi.get() + row * w.k;
  alignas(64) float acc[NP * 256];
  alignas(64) int32_t c[2][1024];
  const auto scale = [&](int64_t b) {  // block b's sums (in c[b & 1]) into acc; block 0 starts it
    if (b == 0) return int_scale<NP, true>(w, a, p, row, count, 0, c[0], acc);
    int_scale<NP, false>(w, a, p, row, count, b, c[b & 1], acc);
  };
  // block b's tiles run while block b - 1's sums (stored to the other buffer) are scaled
  int_issue<NP>(lo, hi, w.k, b0, b1, 0, bs);
  int_store<NP>(c[0]);
  for (int64_t b = 1; b < nb; ++b) {
    int_issue<NP>(lo, hi, w.k, b0, b1, b * bs, (b + 1) * bs);
    scale(b - 1);
    int_store<NP>(c[b & 1]);
  }
  scale(nb - 1);
  for (int g = 0; g < NP; ++g) write_tile(w, y, p + g, row, count, acc + g * 256);  // + bias, as the 16-bit tiles
}

OCTAVO_AMX_INT8_TARGET void run_int(const BlockWeights& w, const Activations& a, const Outputs& y, int64_t first,
                                    int64_t last) {
  ByteBuffer quads = byte_buffer(2 * w.k * 16);  // two panels' codes: 18 KiB at K = 576
  load_int_tiles();
  for (int64_t p = first; p < last; p += 2) {
    const bool two = last - p >= 2;
    code_quads(w, p, quads.get());
    if (two) code_quads(w, p + 1, quads.get() + w.k * 16);
    for (int64_t row = 0; row < a.rows; row += kTileM) {
      if (two) {
        int_tile<2>(w, a, y, p, row, quads.get(), quads.get() + w.k * 16);
      } else {
        int_tile<1>(w, a, y, p, row, quads.get(), nullptr);
      }
    }
  }
  _tile_release();
}

// x's 16-bit values (a.q) of rows [first, last) of the padded rows as their low (unsigned) and high (signed) bytes.
OCTAVO_AMX_INT8_TARGET void int_rows_range(const BlockWeights& w, Activations& a, int64_t first, int64_t last) {
  for (int64_t r = first; r < last; ++r) {
    uint8_t* lo = a.xlo.get() + r * w.k;
    uint8_t* hi = a.xhi.get() + r * w.k;
    if (r >= a.rows) {
      std::memset(lo, 0, static_cast<size_t>(w.k));
      std::memset(hi, 0, static_cast<size_t>(w.k));
      continue;
    }
    const int16_t* q = a.q.get() + r * w.k;
    for (int64_t i = 0; i < w.k; i += 32) {  // k is a multiple of the block size, so of 32
      const __m512i v = _mm512_loadu_si512(q + i);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i), _mm512_cvtepi16_epi8(v));  // truncates: the low byte
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
    }
  }
}
#endif

}  // namespace

void amx_begin_tiles() {
#if defined(OCTAVO_AMX)
  load_tiles();
#endif
}

void amx_end_tiles() {
#if defined(OCTAVO_AMX)
  release_tiles();
#endif
}

bool amx_bf16_usable() {
#if defined(OCTAVO_AMX)
  // switched off: no AMX path (the FMA / VNNI tiles everywhere: the bits of a CPU without AMX), and no tile
  // permission asked of Linux while it stays off
  if (!amx_allowed.load(std::memory_order_relaxed)) return false;
  static const bool usable = detect_amx();
  return usable;
#else
  return false;
#endif
}

bool bf16_dot_usable() {
#if defined(OCTAVO_AMX)
  static const bool usable = detect_avx512_bf16();
  return usable;
#else
  return false;
#endif
}

bool begin_bf16(const BlockWeights& w, Activations& a) {
#if defined(OCTAVO_AMX) && defined(__AVX2__) && defined(__FMA__)  // dequantize_panel needs the AVX2 build
  if (a.rows < 1) return false;
  if (!amx_bf16_usable()) {
    if (!bf16_dot_usable()) return false;
    a.bf16_dot = true;  // no AMX here (or switched off): the AVX512-BF16 kernel
  }
  a.k_padded = (w.k + kTileK - 1) / kTileK * kTileK;
  const int64_t rows = amx_rows(a.rows);
  a.xb = tile_buffer(rows * a.k_padded);  // not zeroed: bf16_rows writes all of it
  a.bf16 = true;
  return true;
#else
  (void)w, (void)a;
  return false;
#endif
}

void bf16_rows(const BlockWeights& w, Activations& a, int64_t first, int64_t last) {
#if defined(OCTAVO_AMX)
  const int64_t padded = amx_rows(a.rows);
  round_rows(a.x, w.k, a.k_padded, a.rows, first, std::min(last, padded), a.xb.get());
#else
  (void)w, (void)a, (void)first, (void)last;
#endif
}

int64_t bf16_task_rows(const Activations& a) {
  // about 512 KiB of bfloat16 x per task (in L2 while the task's panels pass over it)
  const int64_t rows = (512 << 10) / (2 * std::max<int64_t>(a.k_padded, 1)) / (2 * kTileM) * (2 * kTileM);
  return std::max<int64_t>(2 * kTileM, rows);
}

bool begin_split(const BlockWeights& w, Activations& a) {
#if defined(OCTAVO_AMX)
  if (a.rows < 1 || w.block_size % kTileK != 0 || !amx_bf16_usable()) return false;
  a.k_padded = w.k;  // a multiple of the block size, so of 32
  const int64_t rows = amx_rows(a.rows), nb = w.k / w.block_size;
  a.piece_stride = rows * a.k_padded;
  a.xb = tile_buffer(3 * a.piece_stride);  // not zeroed: split_rows writes all of it
  a.block_sums.reset(new float[static_cast<size_t>(rows * nb)]);
  a.split = true;
  return true;
#else
  (void)w, (void)a;
  return false;
#endif
}

bool split_rows(const BlockWeights& w, Activations& a, int64_t first, int64_t last) {
#if defined(OCTAVO_AMX)
  return split_rows_range(w, a, first, std::min(last, amx_rows(a.rows)));
#else
  (void)w, (void)a, (void)first, (void)last;
  return false;
#endif
}

int64_t split_task_rows(const BlockWeights& w, const Activations& a) {
  // about 768 KiB of x's pieces per task (in L2 while the task's panels pass over it)
  const int64_t rows = (768 << 10) / (6 * std::max<int64_t>(w.k, 1)) / (2 * kTileM) * (2 * kTileM);
  return std::max<int64_t>(2 * kTileM, rows);
}

bool begin_amx_int(const BlockWeights& w, Activations& a) {
#if defined(OCTAVO_AMX)
  static const bool int8 = detect_amx_int8();
  if (!a.integer || a.rows <= kIntRows || w.block_size % kTileK != 0 || !int8 || !amx_bf16_usable()) return false;
  const int64_t rows = amx_rows(a.rows);
  a.xlo = byte_buffer(rows * w.k);  // not zeroed: int_rows writes all of it
  a.xhi = byte_buffer(rows * w.k);
  a.amx_int = true;
  return true;
#else
  (void)w, (void)a;
  return false;
#endif
}

void int_rows(const BlockWeights& w, Activations& a, int64_t first, int64_t last) {
#if defined(OCTAVO_AMX)
  const int64_t padded = amx_rows(a.rows);
  int_rows_range(w, a, first, std::min(last, padded));
#else
  (void)w, (void)a, (void)first, (void)last;
#endif
}

void amx_int_panels(const BlockWeights& w, const Activations& a, const Outputs& y, int64_t first, int64_t last) {
#if defined(OCTAVO_AMX)
  run_int(w, a, y, first, last);
#else
  (void)w, (void)a, (void)y, (void)first, (void)last;
#endif
}

void amx_panels(const BlockWeights& w, const Activations& a, const Outputs& y, int64_t first, int64_t last, int64_t r0,
                int64_t r1) {
#if defined(OCTAVO_AMX)
  if (a.split) return run_split(w, a, y, first, last, r0, std::min(r1, a.rows));
  if (a.bf16_dot) return run_dot(w, a, y, first, last, r0, std::min(r1, a.rows));
  run_amx(w, a, y, first, last, r0, std::min(r1, a.rows));
#else
  (void)w, (void)a, (void)y, (void)first, (void)last, (void)r0, (void)r1;
#endif
}

}  // namespace octavo

extern "C" __attribute__((visibility("default")))
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("arch=x86-64")))  // may run before RegisterCustomOps' CPU check
#endif
int octavo_set_amx(int enabled) {
  return octavo::amx_allowed.exchange(enabled != 0, std::memory_order_relaxed) ? 1 : 0;
}
