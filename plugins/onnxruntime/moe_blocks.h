// octavo.MoE over block-quantized experts (a GGUF file's own blocks): each expert's gate/up and down projections
// are octavo.BlockMatMul weights (block_matmul_kernel.h's panel layout, one after another per expert), multiplied by
// the same kernel the dense layers use, on only the rows routed to that expert. Routing and the combine are
// moe_kernel.h's; the precision is BlockMatMul's: float32 over the file's values for a prompt's steps, 16-bit
// activations with exact integer sums for decode-only steps and steps of at most kIntRows tokens (int8 activations
// for 4-bit experts where the node's prompt_int8 / decode_int8 ask, block_matmul_int8.cc). The path is
// chosen for the whole step (as the dense layers' BlockMatMul nodes choose it), not per expert, so a token takes the
// same path as the rest of its step's layers, and its output does not depend on how many tokens share its experts.
#pragma once

#include <cstdint>
#include <vector>

#include "block_matmul_kernel.h"
#include "moe_kernel.h"

namespace octavo::moe {

// One projection of every expert: E BlockMatMul weights [n, k], expert e's arrays at e times their size.
struct BlockExperts {
  const uint8_t* codes = nullptr;  // [E, panels, k / 2, 32 * bits / 8]
  const void* scales = nullptr;    // [E, panels, k / block_size, kPanel], float32 or IEEE half
  const void* offsets = nullptr;   // same type and shape as scales (int8 with scale_super)
  const float* scale_super = nullptr;   // two-level scales: [E, panels, nb >> super_shift, kPanel], or null
  const float* offset_super = nullptr;  // with scale_super
  int super_shift = 0;
  bool half_scales = false;
  int bits = 4;
  int64_t k = 0, n = 0, block_size = 32;
  bool small_codes = false;  // 8-bit codes all below 64 (the op checked them): decode_int8 steps may take int8

  BlockWeights expert(int64_t e) const;
};

// A unit of work of one block phase: panels [first, last) and rows [r0, r1) of one expert's grouped rows.
struct BlockTask {
  int32_t expert;
  int64_t first, last, r0, r1;
};

// The state of one call: x's rows grouped by expert, each active expert's prepared activations, the outputs.
struct BlockRun {
  const Routing* routing = nullptr;
  BlockExperts gate_up, down;
  bool integer = false;                // the step takes the 16-bit path (decode-only, or at most kIntRows tokens)
  bool decode = false;
  bool int8 = false;                   // experts on 4-bit blocks of 32 take the int8 path (the node's prompt_int8
                                       // where the step is not INTEGER, its decode_int8 where it is)
  std::vector<float> xg, gu, act, out;  // [R, H], [R, 2I], [R, I], [R, H] in grouped order (R = tokens * top_k)
  std::vector<Activations> a;          // per expert: its rows of xg (gate/up phase), then of act (down phase)
  std::vector<int32_t> active;         // experts with at least one row
  std::vector<BlockTask> tasks;

  // Size the buffers and gather x's rows by expert.
  // INTEGER: the 16-bit path (the caller decides it for the whole step: decode-only, or at most kIntRows tokens).
  // PROMPT_INT8: where the step is not INTEGER, the int8 path for experts it fits (the node's prompt_int8);
  // DECODE_INT8: where it is, the same (the node's decode_int8; experts it does not fit keep the 16-bit path).
  void begin(const Routing& r, const float* x, const BlockExperts& gu_experts, const BlockExperts& down_experts,
             bool decode_step, bool integer_path, bool prompt_int8 = false, bool decode_int8 = false);
  // Prepare active expert i's activations of IN (xg for the gate/up phase, act for the down phase); W: the phase's.
  void prepare(const BlockExperts& w, const float* in, size_t i);
  // The tasks of a phase over W's panels (after every prepare of that phase).
  void plan(const BlockExperts& w);
  // Run task i of a phase: W's panels into OUT ([R, w.n] in grouped order).
  void run(const BlockExperts& w, float* out, size_t i) const;
  // act = silu(gate) * up over grouped rows [g0, g1).
  void activate(int64_t g0, int64_t g1);
};

}  // namespace octavo::moe
