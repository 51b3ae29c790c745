"""`make eval-smoke` as a (slow) test: lm-evaluation-harness against `octavo serve` and against lm-eval's own hf
backend on the same SmolLM2 GGUF must give the same multiple-choice accuracy (benchmarks/eval/smoke.py checks the
per-item ties). Needs lm-eval's venv (.venv-eval: `make eval-smoke` builds it); skipped without it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EVAL_PYTHON = ROOT / ".venv-eval" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_lm_eval_local_completions_equals_hf(tmp_path) -> None:  # noqa: ANN001
    if not EVAL_PYTHON.is_file():
        pytest.skip("lm-eval's venv .venv-eval is missing (make eval-smoke creates it)")
    proc = subprocess.run([str(EVAL_PYTHON), "-m", "benchmarks.eval.smoke", "--octavo-python",
                           sys.executable, "--out", str(tmp_path)], capture_output=True, text=True, timeout=3500,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["mc"]["acc_octavo"] == report["mc"]["acc_hf"] and report["mc"]["items"] == 50
