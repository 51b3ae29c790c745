// Whether this process may run AMX bfloat16 tiles (block_matmul_amx.cc): the CPU has AMX-TILE, AMX-BF16 and
// AVX512-BF16 (with F, BW, VL), the OS saves their state, and Linux granted this process the tile data state
// (arch_prctl ARCH_REQ_XCOMP_PERM, asked once). The bfloat16 prompt paths of BlockMatMul and PagedAttention
// (nodes with prompt_bf16 = 1) run only where this is true; elsewhere those nodes compute in float32.
#pragma once

namespace octavo {

bool amx_bf16_usable();

// The calling thread's tile configuration for the AMX paths (all 8 tiles 16 rows x 64 bytes: float32 16 x 16
// accumulators, bfloat16 16 x 32 operands, pairs of k for 16 columns), and its release after them (the thread's
// tile state back to its initial, cheap to switch, state). Only after amx_bf16_usable().
void amx_begin_tiles();
void amx_end_tiles();

// The target of every function that runs AVX-512 BF16 or AMX instructions: set per function (no #pragma over
// a file), so the files build into every variant and inline library code instantiated beside them stays at
// the build's baseline; callers reach those functions only after amx_bf16_usable().
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define OCTAVO_AMX 1
#define OCTAVO_AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))
#endif

}  // namespace octavo
