"""simd.h's two exponentials against float64, compiled on their own (no ONNX Runtime): exp_nonpositive, the prefill
softmax's exp of scores minus their running max, and exp, the decode softmax's. test_op only sees them through the
op's outputs at 1e-5; this holds each to the error bound docs/op.md states, over every float32 exponent of its
range, and checks the special values the softmax relies on (-inf gives 0, 0 gives exactly 1; NaN gives 0 from
exp_nonpositive, NaN from exp).

The program sweeps d from -104 to 0 (all results in float32's normal range and down to 0), evaluating a vector of
kWidth inputs at a time, the way the kernel does, and prints the worst relative errors; the reference is the C
library's exp in double.
"""
from __future__ import annotations

import math
import subprocess

import pytest

from octavo.oplib_build import SOURCE_DIR, find_compiler

PROGRAM = r"""
#include <cmath>
#include <cstdio>
#include <limits>
#include "simd.h"
using namespace octavo::simd;

template <typename F>
void sweep(const char* name, F fn) {
  // relative error of results >= 1e-7 and of results >= 1e-30; absolute error of smaller ones (down to 0)
  double worst_above = 0.0, worst_normal = 0.0, worst_tiny = 0.0;
  float where_above = 0.0f, where_normal = 0.0f;
  long count = 0;
  float in[kWidth];
  int filled = 0;
  auto flush = [&]() {
    vf d;
    for (int i = 0; i < kWidth; ++i) d[i] = i < filled ? in[i] : 0.0f;
    const vf e = fn(d);
    for (int i = 0; i < filled; ++i) {
      const double want = std::exp(static_cast<double>(in[i]));
      const double got = e[i];
      ++count;
      if (want < 1e-30) {
        worst_tiny = std::fmax(worst_tiny, std::fabs(got - want));
        continue;
      }
      const double rel = std::fabs(got - want) / want;
      if (want >= 1e-7 && rel > worst_above) { worst_above = rel; where_above = in[i]; }
      if (rel > worst_normal) { worst_normal = rel; where_normal = in[i]; }
    }
    filled = 0;
  };
  // every 64th float32 from -104 up to 0: all exponents, the mantissa finely
  for (float x = -104.0f; x < 0.0f; ) {
    in[filled++] = x;
    if (filled == kWidth) flush();
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    bits -= 64;  // toward zero (negative floats: smaller magnitude)
    std::memcpy(&x, &bits, sizeof x);
    if (!(x < 0.0f)) break;
  }
  flush();
  vf s = vf{} + 0.0f;  // the special values: -inf, NaN, 0, far below the range
  s[0] = -std::numeric_limits<float>::infinity();
  s[1] = std::numeric_limits<float>::quiet_NaN();
  s[2] = 0.0f;
  s[3] = -200.0f;
  const vf e = fn(s);
  std::printf("%s %ld %.9g %.9g %.9g %.9g %.9g %.9g %.9g %.9g %.9g\n", name, count, worst_above, where_above,
              worst_normal, where_normal, worst_tiny, (double)e[0], (double)e[1], (double)e[2], (double)e[3]);
}

int main() {
  sweep("exp_nonpositive", [](vf d) { return exp_nonpositive(d); });
  sweep("exp", [](vf d) { return exp(d); });
}
"""


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory) -> dict[str, list[float]]:
    folder = tmp_path_factory.mktemp("simd_exp")
    source = folder / "sweep.cc"
    source.write_text(PROGRAM)
    binary = folder / "sweep"
    # the op's own flags that matter here: -O3 and the native vector width (what `make op` builds)
    subprocess.run([find_compiler(), "-O3", "-std=c++17", "-march=native", f"-I{SOURCE_DIR}", str(source), "-o",
                    str(binary)], check=True, capture_output=True, text=True)
    out = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
    result = {}
    for line in out.splitlines():
        name, *values = line.split()
        result[name] = [float(v) for v in values]
    return result


# (name, bound above 1e-7, bound down to 1e-30): docs/op.md. exp_nonpositive: <= 1.01e-6 for probabilities above
# 1e-7, a few ulps more down to 1e-30 (t = x log2 e rounds once); exp (the decode softmax's and softcap's, a longer
# polynomial): ~8.3e-8 on its non-positive half. Below 1e-30 both are at most 1e-30 off.
BOUNDS = [("exp_nonpositive", 1.01e-6, 4e-6), ("exp", 1e-7, 1e-7)]


@pytest.mark.parametrize("name,above_bound,normal_bound", BOUNDS)
def test_exp_error_bound(sweeps: dict[str, list[float]], name: str, above_bound: float, normal_bound: float) -> None:
    count, above, where_above, normal, where_normal, tiny, *_ = sweeps[name]
    assert count > 1_000_000
    assert above <= above_bound, f"{name}: relative error {above:.3g} at d = {where_above}"
    assert normal <= normal_bound, f"{name}: relative error {normal:.3g} at d = {where_normal}"
    assert tiny <= 1e-30


def test_exp_nonpositive_special_values(sweeps: dict[str, list[float]]) -> None:
    *_, neg_inf, nan, zero, far = sweeps["exp_nonpositive"]
    assert neg_inf == 0.0 and nan == 0.0  # a masked score (-inf) and a NaN contribute nothing
    assert zero == 1.0  # the running max itself: exactly 1
    assert far == 0.0


def test_exp_special_values(sweeps: dict[str, list[float]]) -> None:
    *_, neg_inf, nan, zero, far = sweeps["exp"]
    assert neg_inf == 0.0 and far == 0.0
    assert math.isnan(nan)  # a NaN score must reach the output (test_op: the decode softmax hid it before)
    assert zero == 1.0
