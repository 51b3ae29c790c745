// Whether this process may run AMX bfloat16 tiles (block_matmul_amx.cc): the CPU has AMX-TILE, AMX-BF16 and
// AVX512-BF16 (with F, BW, VL), the OS saves their state, and Linux granted this process the tile data state
// (arch_prctl ARCH_REQ_XCOMP_PERM, asked once). The bfloat16 prompt paths of BlockMatMul and PagedAttention
// (nodes with prompt_bf16 = 1) run only where this is true; elsewhere those nodes compute in float32. So do
// BlockMatMul's default AMX paths (block_matmul_kernel.h). octavo_set_amx(0) makes it false for the process:
// every node then computes as on a CPU without AMX.
#pragma once

// The process's AMX switch, exported for the caller to set (octavo's ONNX Runtime backend does, from
// EngineArgs.amx, before it makes a session): 0 = no AMX path from the next node's step on, nonzero = AMX where the
// CPU has it (the default). Returns the switch's previous state (1 = on). One switch per process: the library is
// loaded once however many sessions use it. Only the switch: the decision is the caller's (the library reads no
// environment variable).
extern "C" int octavo_set_amx(int enabled);

namespace octavo {

bool amx_bf16_usable();

// Whether this process may run AVX512-BF16 vector code (VDPBF16PS; with AVX-512 F, BW, VL and the OS saving ZMM
// state) in an AVX-512 build: the bfloat16 prompt paths' kernels where AMX is not usable (a CPU without AMX, such
// as Zen 4 or Cooper Lake, or AMX switched off). Same bfloat16 operands, float32 sums in another order than the
// tiles'.
bool bf16_dot_usable();

// The calling thread's tile configuration for the AMX paths (all 8 tiles 16 rows x 64 bytes: float32 16 x 16
// accumulators, bfloat16 16 x 32 operands, pairs of k for 16 columns), and its release after them (the thread's
// tile state back to its initial, cheap to switch, state). Only after amx_bf16_usable().
void amx_begin_tiles();
void amx_end_tiles();

// The AMX paths are built into AVX-512 builds only (the wheel's x86-64-v4 variant, -march=native on such a
// CPU): every AMX CPU has AVX-512, and the x86-64-v3 build stays free of 512-bit code. Their functions add
// AVX512-BF16 and AMX per function (OCTAVO_AMX_TARGET, no #pragma over a file), so inline library code
// instantiated beside them stays at the build's baseline; callers reach them only after amx_bf16_usable().
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#define OCTAVO_AMX 1
#define OCTAVO_AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))
#define OCTAVO_AMX_INT8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16,amx-int8")))
#endif

}  // namespace octavo
