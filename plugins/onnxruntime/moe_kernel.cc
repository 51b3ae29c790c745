// octavo.MoE's compute (moe_kernel.h): routing, the two expert phases and the combine.
#include "moe_kernel.h"

#include <algorithm>
#include <cmath>

namespace octavo::moe {

namespace {

constexpr int64_t kRows = 16;     // grouped rows per task
constexpr int64_t kColumns = 64;  // output columns per task
constexpr int kLanes = 16;        // independent partial sums of a dot product

// a . b over N values: kLanes partial sums in a fixed order, then a fixed tree. The same code for every row, so
// a row's result never depends on the rows beside it.
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  }
  for (int l = 0; i < n; ++i, ++l) acc[l] += a[i] * b[i];
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
  }
  return acc[0];
}

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

}  // namespace

void route(const float* logits, int64_t tokens, int64_t experts, int64_t top_k, bool normalize, Routing& r) {
  r.tokens = tokens;
  r.experts = experts;
  r.top_k = top_k;
  r.expert.assign(static_cast<size_t>(tokens * top_k), 0);
  r.weight.assign(static_cast<size_t>(tokens * top_k), 0.0f);
  std::vector<float> p(static_cast<size_t>(experts));
  std::vector<uint8_t> taken(static_cast<size_t>(experts));
  std::vector<int32_t> order(static_cast<size_t>(top_k));
  std::vector<float> chosen(static_cast<size_t>(top_k));
  std::vector<int64_t> count(static_cast<size_t>(experts) + 1, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* l = logits + t * experts;
    float top = l[0];
    for (int64_t e = 1; e < experts; ++e) top = std::max(top, l[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < experts; ++e) {
      p[e] = std::exp(l[e] - top);
      sum += p[e];
    }
    const float inverse = 1.0f / sum;
    for (int64_t e = 0; e < experts; ++e) p[e] *= inverse;
    std::fill(taken.begin(), taken.end(), 0);
    float total = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) {  // the j-th largest; on a tie the lower index (strict >)
      int64_t best = -1;
      for (int64_t e = 0; e < experts; ++e) {
        if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
      }
      taken[best] = 1;
      order[j] = static_cast<int32_t>(best);
      chosen[j] = p[best];
      total += p[best];  // in descending order, as transformers sums torch.topk's values
    }
    // ascending expert order, the order transformers accumulates the experts' outputs in
    std::vector<int64_t> idx(static_cast<size_t>(top_k));
    for (int64_t j = 0; j < top_k; ++j) idx[j] = j;
    std::sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return order[a] < order[b]; });
    for (int64_t j = 0; j < top_k; ++j) {
      r.expert[t * top_k + j] = order[idx[j]];
      r.weight[t * top_k + j] = normalize ? chosen[idx[j]] / total : chosen[idx[j]];
      ++count[order[idx[j]] + 1];
    }
  }
  r.offsets.assign(static_cast<size_t>(experts) + 1, 0);
  for (int64_t e = 0; e < experts; ++e) r.offsets[e + 1] = r.offsets[e] + count[e + 1];
  std::vector<int64_t> next(r.offsets.begin(), r.offsets.end() - 1);
  r.grouped.assign(static_cast<size_t>(tokens * top_k), 0);
  r.grouped_weight.assign(static_cast<size_t>(tokens * top_k), 0.0f);
  r.slot.assign(static_cast<size_t>(tokens * top_k), 0);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t g = next[r.expert[t * top_k + j]]++;
      r.grouped[g] = t;
      r.grouped_weight[g] = r.weight[t * top_k + j];
      r.slot[t * top_k + j] = g;
    }
  }
}

std::vector<Task> plan_tasks(const Routing& r, int64_t columns) {
  std::vector<Task> tasks;
  for (int64_t e = 0; e < r.experts; ++e) {
    for (int64_t r0 = r.offsets[e]; r0 < r.offsets[e + 1]; r0 += kRows) {
      const int64_t r1 = std::min(r.offsets[e + 1], r0 + kRows);
      for (int64_t c0 = 0; c0 < columns; c0 += kColumns) {
        tasks.push_back(Task{static_cast<int32_t>(e), r0, r1, c0, std::min(columns, c0 + kColumns)});
      }
    }
  }
  return tasks;
}

void expert_up(const Weights& w, const Routing& r, const float* x, float* act, const Task& task) {
  const int64_t h = w.hidden, n = w.inter;
  const float* gate = w.gate_up + static_cast<int64_t>(task.expert) * 2 * n * h;
  const float* up = gate + n * h;
  for (int64_t g = task.r0; g < task.r1; ++g) {
    const float* row = x + r.grouped[g] * h;
    for (int64_t c = task.c0; c < task.c1; ++c) {
      act[g * n + c] = silu(dot(row, gate + c * h, h)) * dot(row, up + c * h, h);
    }
  }
}

void expert_down(const Weights& w, const Routing& r, const float* act, float* out, const Task& task) {
  const int64_t h = w.hidden, n = w.inter;
  const float* down = w.down + static_cast<int64_t>(task.expert) * h * n;
  for (int64_t g = task.r0; g < task.r1; ++g) {
    const float* row = act + g * n;
    for (int64_t c = task.c0; c < task.c1; ++c) out[g * h + c] = dot(row, down + c * n, n) * r.grouped_weight[g];
  }
}

void combine(const Routing& r, const float* out, int64_t hidden, float* y, int64_t t0, int64_t t1, bool weighted) {
  for (int64_t t = t0; t < t1; ++t) {
    float* dst = y + t * hidden;
    std::fill(dst, dst + hidden, 0.0f);
    for (int64_t j = 0; j < r.top_k; ++j) {
      const int64_t g = r.slot[t * r.top_k + j];
      const float* src = out + g * hidden;
      if (weighted) {
        const float weight = r.grouped_weight[g];
        for (int64_t c = 0; c < hidden; ++c) dst[c] += src[c] * weight;
      } else {
        for (int64_t c = 0; c < hidden; ++c) dst[c] += src[c];
      }
    }
  }
}

}  // namespace octavo::moe
