"""scripts/gpu_check.py, the one prepared GPU check: its CPU smoke path end to end, and the report
machinery (written after every case, one failing case isolated, a time budget that skips, not hangs)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _load_script():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("octavo_gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_smoke_cpu_passes_and_reports_every_section(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke-cpu", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    verdict = proc.stdout.strip().splitlines()[-2]
    assert verdict.startswith("PASS: kernel_jit 4/4, aot_launch 1/1"), verdict
    report = json.loads(out.read_text())
    assert report["pass"] is True
    assert report["env"]["device"].startswith("cpu")
    rows = report["kernel_jit"]
    assert set(rows) == {"smoke_prefill", "smoke_decode_bf16", "smoke_window_fp32", "smoke_big_pool_top_ids"}
    for name, row in rows.items():
        assert row["status"] == "ok", (name, row)
        assert row["cache_max_abs_err"] == 0.0 and row["max_abs_err"] <= row["tolerance"]
    assert rows["smoke_big_pool_top_ids"]["pool_blocks"] == 300  # sequences used the top block ids
    aot = report["aot_launch"]["compile_only_sm90"]
    assert aot["status"] == "ok", aot
    assert aot["ptx_params"] == 15  # exactly TensorRT's arguments (Triton's compile declares its 2 scratch pointers too)
    assert aot["triton_ptx_params"] >= 15
    if importlib.util.find_spec("tensorrt") is None:  # the report says so, and PASS does not cover it
        assert report["tensorrt"]["status"] == "unavailable"
        assert verdict.endswith("TensorRT: not available on this machine — the engine build, plugin and TensorRT "
                                "backend were NOT checked"), verdict
    assert aot["wide_loads"] > 0 and aot["shared"] <= 48 * 1024


def test_report_is_rewritten_after_every_case_and_isolates_failures(tmp_path: Path) -> None:
    gpu_check = _load_script()
    path = tmp_path / "r.json"
    report = gpu_check.Report(path, deadline=gpu_check.time.monotonic() + 600)
    seen = []

    def good() -> dict:
        return {"status": "ok"}

    def bad() -> dict:
        seen.append(json.loads(path.read_text()))  # the previous case is already on disk
        raise RuntimeError("boom")

    report.case("kernel_jit", "first", good)
    report.case("kernel_jit", "second", bad)
    report.case("kernel_jit", "third", good)
    assert seen[0]["kernel_jit"]["first"]["status"] == "ok"
    on_disk = json.loads(path.read_text())["kernel_jit"]
    assert on_disk["second"]["status"] == "error" and "RuntimeError: boom" in on_disk["second"]["error"]
    assert on_disk["third"]["status"] == "ok"
    ok, lines = gpu_check.summarize({"env": {}, "kernel_jit": on_disk})
    assert not ok and any("second" in line and "error" in line for line in lines)


def test_time_budget_skips_remaining_cases(tmp_path: Path) -> None:
    gpu_check = _load_script()
    report = gpu_check.Report(tmp_path / "r.json", deadline=gpu_check.time.monotonic() + 1)
    row = report.case("bandwidth", "b256_ctx32768", lambda: pytest.fail("must not run"), min_left=15)
    assert row["status"] == "skipped" and "time budget" in row["reason"]
    ok, lines = gpu_check.summarize({"env": {}, "bandwidth": {"b1_ctx512": {"status": "ok", "jit_gbps": 1.0,
                                     "aot_gbps": 1.0, "copy_gbps": 1.0, "peak_gbps": 3350.0}, "b256_ctx32768": row}})
    assert ok and lines[-1] == "PASS: bandwidth 1/1"  # skipped is neither a failure nor counted as passed


def test_case_comparison_catches_a_pool_that_was_not_written() -> None:
    """The check can fail: the uploaded case before any kernel ran has the new K/V missing from the pool."""
    torch = pytest.importorskip("torch")
    gpu_check = _load_script()
    case = gpu_check.SMOKE_CASES[-1]  # big pool, top block ids
    host = gpu_check.make_case(case)
    expected = gpu_check.reference(case, host, torch)
    dev = gpu_check.DeviceCase.upload(case, host, torch, "cpu")
    assert int(dev.tensors["block_table"].min()) >= 300 - (host["key_cache"].shape[0])  # remapped to the top ids
    fake_output = torch.from_numpy(expected[0])
    row = dev.compare(case, fake_output, expected)
    assert row["status"] == "failed" and row["cache_max_abs_err"] > 0
    assert row["max_abs_err"] == 0.0


def test_verdict_covers_only_what_ran() -> None:
    gpu_check = _load_script()
    ran = {"status": "ok", "max_abs_err": 0.0, "tolerance": 1e-4, "cache_max_abs_err": 0.0}
    unavailable = {"status": "unavailable", "reason": "TensorRT: not available on this machine (ImportError: x)"}
    ok, lines = gpu_check.summarize({"env": {}, "kernel_jit": {"a": ran}, "tensorrt": unavailable})
    assert ok and lines[-1].startswith("PASS: kernel_jit 1/1. TensorRT: not available on this machine")
    assert "NOT checked" in lines[-1] and "tensorrt" not in lines[-1].split(".")[0]
    ok, lines = gpu_check.summarize({"env": {}, "tensorrt": unavailable})
    assert not ok and lines[-1].startswith("FAIL: nothing ran")  # nothing checked is not a pass
    missing = {"status": "error", "error": "expected.json missing"}
    ok, lines = gpu_check.summarize({"env": {}, "kernel_jit": {"a": ran}, "tensorrt": missing})
    assert not ok  # TensorRT present but the section could not run: a failure, not a skip


def test_a_crashing_section_process_is_recorded_and_the_next_section_still_runs(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """Sections run in their own processes (a sticky CUDA error poisons a whole context). Here, without a
    GPU, each section's process dies at its first CUDA call: both deaths are recorded, neither stops the run."""
    pytest.importorskip("torch")
    gpu_check = _load_script()
    report = gpu_check.Report(tmp_path / "r.json", deadline=gpu_check.time.monotonic() + 600)
    report.data["started_unix"] = 0
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    gpu_check.run_sections_isolated(report, ["kernel_jit", "bandwidth"])
    on_disk = json.loads((tmp_path / "r.json").read_text())
    for section in ("kernel_jit", "bandwidth"):
        process = on_disk[section]["process"]
        assert process["status"] == "error" and "section process ended with 1" in process["error"], process
    ok, _ = gpu_check.summarize(on_disk)
    assert not ok


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_tensorrt_section_runs_against_the_standin_with_prepared_inputs(tmp_path: Path) -> None:
    """What the GPU session's tensorrt section will do, end to end on CPU: --prepare (CPU greedy texts from a
    fresh `octavo generate` on ONNX Runtime, transformers logits), then the section with the TensorRT stand-in:
    fp32/fp16 builds, the backend's aliasing report and probe, logits vs transformers, and a fresh-process
    `octavo generate --backend tensorrt` whose completions must equal the CPU's."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    inputs = tmp_path / "inputs"
    done = subprocess.run([sys.executable, str(SCRIPT), "--prepare", str(inputs)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "tensorrt_standin"), env["PYTHONPATH"]])
    code = ("import sys, time; from pathlib import Path; sys.path.insert(0, 'scripts'); import gpu_check, "
            "gpu_check_tensorrt as g; r = gpu_check.Report(Path(sys.argv[1]), time.monotonic() + 600); "
            "g.run_section(r, Path(sys.argv[2]), Path(sys.argv[3]), max_num_blocks=64, num_blocks=16)")
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-c", code, str(report), str(inputs), str(tmp_path / "work")],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(report.read_text())["tensorrt"]
    assert {name: row["status"] for name, row in rows.items()} == dict.fromkeys(
        ["build_float32", "backend_float32", "generate_float32", "build_float16", "backend_float16"], "ok"), rows
    assert rows["generate_float32"]["matched"] == "3/3"
    assert rows["backend_float32"]["in_place_verified"] and rows["backend_float32"]["aliasing_reported_count"] == "0/4"
