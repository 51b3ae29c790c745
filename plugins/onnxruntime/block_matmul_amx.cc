// octavo.BlockMatMul's bfloat16 path for a prompt's steps (what it computes and when: block_matmul_kernel.h).
//
// AMX tiles: per 32 rows of x and 2 panels (32 columns), four 16 x 16 float32 accumulator tiles (tmm0-3) take
// TDPBF16PS over 32 k at a time (x rows in tmm4-5, the panels' pairs of k in tmm6-7): 16 x 16 x 32
// multiply-adds an instruction, ~23 times the float32 FMA tiles' per cycle on a Sapphire Rapids core. Before the
// tiles run, the step's x is rounded to bfloat16 once (bf16_rows) and each panel's file values are dequantized
// to float32 (the float32 path's dequantize_panel) and rounded to bfloat16 in the tiles' pair-of-k layout once
// per step (bf16_panels), both a task per range and shared by every task.
// Functions with AVX-512 or AMX instructions carry OCTAVO_AMX_TARGET (amx.h).
// Written by hand: ONNX Runtime's CPU kernels have no bfloat16 matmul over block-quantized weights.
#include "block_matmul_kernel.h"

#include <algorithm>
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

#if defined(OCTAVO_AMX)
constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an extended state component
constexpr long kXtileData = 18;             // the tile data state (XFEATURE_XTILEDATA)

bool detect_amx() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(1, 0, &a, &b, &c, &d) || !(c >> 27 & 1)) return false;  // OSXSAVE
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool avx512 = (b >> 16 & 1) && (b >> 30 & 1) && (b >> 31 & 1);  // F, BW, VL
  const bool amx = (d >> 22 & 1) && (d >> 24 & 1);                      // AMX-BF16, AMX-TILE
  if (!avx512 || !amx || a < 1) return false;
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  if (!__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) || !(a1 >> 5 & 1)) return false;  // AVX512-BF16
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  const uint64_t xcr0 = (static_cast<uint64_t>(hi) << 32) | lo;
  if ((xcr0 & 0xE6) != 0xE6 || (xcr0 >> 17 & 3) != 3) return false;  // the OS saves ZMM and tile state
  // Linux hands the tile data state (8 KiB per thread) only to a process that asks for it (for every thread)
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXtileData) == 0;
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

// RT x 16 rows of xb at A (row stride kp) against NP panels' pairs (B0, B1): the float32 sums into C (RT * NP
// tiles of 16 x 16: rows t, panel g at c + (t * NP + g) * 256), each over k in order, 32 k an instruction.
template <int RT, int NP>
OCTAVO_AMX_TARGET void tile_block(const uint16_t* a, int64_t kp, const uint16_t* b0, const uint16_t* b1, float* c) {
  const int64_t a_stride = kp * static_cast<int64_t>(sizeof(uint16_t));
  _tile_zero(0);
  if constexpr (NP == 2) _tile_zero(1);
  if constexpr (RT == 2) _tile_zero(2);
  if constexpr (RT == 2 && NP == 2) _tile_zero(3);
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
  _tile_stored(0, c, 64);  // rows t, panel g: c + (t * NP + g) * 256
  if constexpr (NP == 2) _tile_stored(1, c + 256, 64);
  if constexpr (RT == 2) _tile_stored(2, c + NP * 256, 64);
  if constexpr (RT == 2 && NP == 2) _tile_stored(3, c + 768, 64);
}

OCTAVO_AMX_TARGET void run_amx(const BlockWeights& w, const Activations& a, const Outputs& y, int64_t first,
                               int64_t last, int64_t r0, int64_t r1) {
  load_tiles();
  alignas(64) float c[4 * 256];
  const int64_t kp = a.k_padded, pairs = kp / 2;
  for (int64_t p = first; p < last; p += 2) {
    const int np = last - p >= 2 ? 2 : 1;
    const uint16_t* b0 = a.wb.get() + p * pairs * 32;
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
  static const bool usable = detect_amx();
  return usable;
#else
  return false;
#endif
}

bool begin_bf16(const BlockWeights& w, Activations& a) {
#if defined(OCTAVO_AMX) && defined(__AVX2__) && defined(__FMA__)  // dequantize_panel needs the AVX2 build
  if (a.rows < 1 || !amx_bf16_usable()) return false;
  a.k_padded = (w.k + kTileK - 1) / kTileK * kTileK;
  const int64_t rows = (a.rows + kTileM - 1) / kTileM * kTileM;
  a.xb.reset(new uint16_t[static_cast<size_t>(rows * a.k_padded)]);  // not zeroed: bf16_rows writes all of it
  a.wb.reset(new uint16_t[static_cast<size_t>(w.panels() * a.k_padded / 2 * 32)]);
  a.bf16 = true;
  return true;
#else
  (void)w, (void)a;
  return false;
#endif
}

void bf16_rows(const BlockWeights& w, Activations& a, int64_t first, int64_t last) {
#if defined(OCTAVO_AMX)
  const int64_t padded = (a.rows + kTileM - 1) / kTileM * kTileM;
  round_rows(a.x, w.k, a.k_padded, a.rows, first, std::min(last, padded), a.xb.get());
#else
  (void)w, (void)a, (void)first, (void)last;
#endif
}

void bf16_panels(const BlockWeights& w, Activations& a, int64_t first, int64_t last) {
#if defined(OCTAVO_AMX)
  if (first >= last) return;
  const int64_t pairs = a.k_padded / 2;
  std::unique_ptr<float[]> buf(new float[static_cast<size_t>(kDequantK * kPanel) + 16]);
  float* staging = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.get()) + 63) & ~uintptr_t{63});
  for (int64_t p = first; p < last; ++p) {
    uint16_t* out = a.wb.get() + p * pairs * 32;
    for (int64_t k0 = 0; k0 < w.k; k0 += kDequantK) {
      const int64_t k1 = std::min(w.k, k0 + kDequantK);
      dequantize_panel(w, p, k0, k1, staging);
      round_pairs(staging, k0, k1, out);
    }
    std::memset(out + (w.k / 2) * 32, 0, static_cast<size_t>((pairs - w.k / 2) * 32) * sizeof(uint16_t));
  }
#else
  (void)w, (void)a, (void)first, (void)last;
#endif
}

int64_t bf16_task_rows(const Activations& a) {
  // about 512 KiB of bfloat16 x per task (in L2 while the task's panels pass over it)
  const int64_t rows = (512 << 10) / (2 * std::max<int64_t>(a.k_padded, 1)) / (2 * kTileM) * (2 * kTileM);
  return std::max<int64_t>(2 * kTileM, rows);
}

void amx_panels(const BlockWeights& w, const Activations& a, const Outputs& y, int64_t first, int64_t last, int64_t r0,
                int64_t r1) {
#if defined(OCTAVO_AMX)
  run_amx(w, a, y, first, last, r0, std::min(r1, a.rows));
#else
  (void)w, (void)a, (void)y, (void)first, (void)last, (void)r0, (void)r1;
#endif
}

}  // namespace octavo
