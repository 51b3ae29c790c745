// octavo.MoE's compute: a sparse Mixture-of-Experts block of SwiGLU experts over float32 weights, where each
// expert multiplies only the rows routed to it.
//
// Per token t (x [T, H], router logits [T, E]):
//   p = softmax(logits[t]) in float32 (max subtracted, exp, times 1 / sum), as transformers' routers compute it;
//   the top_k experts by p, ties broken by the lower expert index (torch.topk leaves the order of ties
//   unspecified; on random weights ties do not occur), their weights p (divided by their sum when normalize);
//   y[t] = sum over the chosen experts, in ascending expert order, of down_e(silu(gate_e(x)) * up_e(x)) * w_e,
//   accumulated into zeros in that order (transformers' index_add_ over the experts it hits, in index order).
// Weights: gate_up [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up, HF's [out, in] layout) and down [E, H, I].
//
// Every dot product runs the same code with the same order of sums for every row, so a token's output does not
// depend on which other tokens share its step (batch invariance, as the dense path has). Work is split over
// (expert, block of rows, block of output columns): a decode step of one token still spreads its top_k experts'
// columns over every thread, a long prompt chunk its rows as well.
#pragma once

#include <cstdint>
#include <vector>

namespace octavo::moe {

struct Routing {
  int64_t tokens = 0, experts = 0, top_k = 0;
  std::vector<int32_t> expert;  // [tokens, top_k]: the chosen experts of each token, ascending
  std::vector<float> weight;    // [tokens, top_k]: their routing weights
  // the (token, choice) pairs grouped by expert: rows of expert e are grouped[offsets[e] .. offsets[e + 1]),
  // in token order; slot[t * top_k + j] is the grouped index of token t's j-th choice
  std::vector<int64_t> offsets;  // [experts + 1]
  std::vector<int64_t> grouped;  // [tokens * top_k]: token index of each grouped row
  std::vector<float> grouped_weight;  // [tokens * top_k]: routing weight of each grouped row
  std::vector<int64_t> slot;     // [tokens * top_k]
};

// Fill R from LOGITS [tokens, experts]: softmax, top-k (ties: lower index), optional renormalisation, grouping.
void route(const float* logits, int64_t tokens, int64_t experts, int64_t top_k, bool normalize, Routing& r);

struct Weights {
  const float* gate_up = nullptr;  // [E, 2I, H]
  const float* down = nullptr;     // [E, H, I]
  int64_t hidden = 0, inter = 0;
};

// A unit of work of one phase: rows [r0, r1) of expert e's grouped rows, output columns [c0, c1).
struct Task {
  int32_t expert;
  int64_t r0, r1, c0, c1;
};

// The tasks of a phase whose outputs have COLUMNS columns per row.
std::vector<Task> plan_tasks(const Routing& r, int64_t columns);

// Phase 1: act[g, c] = silu(x[token(g)] . gate_e[c]) * (x[token(g)] . up_e[c]) for the task's rows and columns.
void expert_up(const Weights& w, const Routing& r, const float* x, float* act, const Task& task);
// Phase 2: out[g, c] = (act[g] . down_e[c]) * weight(g) for the task's rows and columns.
void expert_down(const Weights& w, const Routing& r, const float* act, float* out, const Task& task);
// Phase 3: y[t] = the sum of token t's expert outputs in ascending expert order, for tokens [t0, t1); WEIGHTED:
// each output times its routing weight first (where phase 2 has not applied it).
void combine(const Routing& r, const float* out, int64_t hidden, float* y, int64_t t0, int64_t t1, bool weighted);

}  // namespace octavo::moe
