// octavo.MoE over block-quantized experts (moe_blocks.h).
#include "moe_blocks.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace octavo::moe {

BlockWeights BlockExperts::expert(int64_t e) const {
  BlockWeights w;
  const int64_t panels = (n + kPanel - 1) / kPanel, nb = k / block_size;
  const int64_t code_bytes = panels * (k / 2) * (32 * bits / 8), scale_values = panels * nb * kPanel;
  const int64_t scale_bytes = scale_values * (scale_super != nullptr ? 1 : half_scales ? 2 : 4);
  w.codes = codes + e * code_bytes;
  w.scales = static_cast<const uint8_t*>(scales) + e * scale_bytes;
  w.offsets = static_cast<const uint8_t*>(offsets) + e * scale_bytes;
  if (scale_super != nullptr) {
    const int64_t super_values = panels * (nb >> super_shift) * kPanel;
    w.scale_super = scale_super + e * super_values;
    w.offset_super = offset_super + e * super_values;
    w.super_shift = super_shift;
  }
  w.half_scales = half_scales;
  w.small_codes = small_codes;
  w.bits = bits;
  w.k = k;
  w.n = n;
  w.block_size = block_size;
  return w;
}

void BlockRun::begin(const Routing& r, const float* x, const BlockExperts& gu_experts, const BlockExperts& down_experts,
                     bool decode_step, bool integer_path, bool prompt_int8, bool decode_int8) {
  routing = &r;
  gate_up = gu_experts;
  down = down_experts;
  decode = decode_step;
  integer = integer_path;  // BlockMatMul's rule for the step, whatever an expert's rows
  int8 = integer_path ? decode_int8 : prompt_int8;
  const int64_t rows = r.tokens * r.top_k, h = gu_experts.k, inter = down_experts.k;
  xg.resize(static_cast<size_t>(rows * h));
  gu.resize(static_cast<size_t>(rows * gu_experts.n));
  act.resize(static_cast<size_t>(rows * inter));
  out.resize(static_cast<size_t>(rows * h));
  for (int64_t g = 0; g < rows; ++g) std::memcpy(&xg[g * h], x + r.grouped[g] * h, sizeof(float) * h);
  a.clear();
  a.resize(static_cast<size_t>(r.experts));
  active.clear();
  for (int64_t e = 0; e < r.experts; ++e) {
    if (r.offsets[e + 1] > r.offsets[e]) active.push_back(static_cast<int32_t>(e));
  }
}

void BlockRun::prepare(const BlockExperts& w, const float* in, size_t i) {
  const int32_t e = active[i];
  const int64_t g0 = routing->offsets[e], rows = routing->offsets[e + 1] - g0;
  const BlockWeights we = w.expert(e);
  Activations& ae = a[e];
  ae = Activations{};
  const float* x = in + g0 * w.k;
  if (integer) {  // the 16-bit path's step (begin_activations false: the float32 path)
    if (begin_activations(we, x, rows, decode, ae)) {
      if (int8 && begin_int8(we, ae)) {
        ae.int8 = int8_rows(we, ae, 0, rows);  // false (non-finite x): float32
      } else {
        ae.integer = quantize_rows(we, ae, 0, rows);
      }
    }
    return;
  }
  ae.x = x;
  ae.rows = rows;
  ae.integer = false;
  BlockWeights prompt = we;
  prompt.small_codes = false;  // prompt steps: 4-bit experts only
  if (int8 && begin_int8(prompt, ae)) ae.int8 = int8_rows(prompt, ae, 0, rows);  // false (non-finite x): float32
}

void BlockRun::plan(const BlockExperts& w) {
  tasks.clear();
  const int64_t panels = (w.n + kPanel - 1) / kPanel;
  for (const int32_t e : active) {
    const BlockWeights we = w.expert(e);
    const int64_t rows = routing->offsets[e + 1] - routing->offsets[e];
    const int64_t per_task = block_matmul_task_panels(a[e]), rows_per_task = block_matmul_task_rows(we, a[e]);
    for (int64_t r0 = 0; r0 < rows; r0 += rows_per_task) {
      for (int64_t first = 0; first < panels; first += per_task) {
        tasks.push_back(BlockTask{e, first, std::min(panels, first + per_task), r0, std::min(rows, r0 + rows_per_task)});
      }
    }
  }
}

void BlockRun::run(const BlockExperts& w, float* output, size_t i) const {
  const BlockTask& t = tasks[i];
  Outputs y;
  y.data[0] = output + routing->offsets[t.expert] * w.n;
  y.columns[0] = w.n;
  y.count = 1;
  block_matmul_panels(w.expert(t.expert), a[t.expert], y, t.first, t.last, t.r0, t.r1);
}

void BlockRun::activate(int64_t g0, int64_t g1) {
  const int64_t inter = down.k;
  for (int64_t g = g0; g < g1; ++g) {
    const float* gate = &gu[g * 2 * inter];
    const float* up = gate + inter;
    float* dst = &act[g * inter];
    for (int64_t c = 0; c < inter; ++c) dst[c] = gate[c] / (1.0f + std::exp(-gate[c])) * up[c];
  }
}

}  // namespace octavo::moe
