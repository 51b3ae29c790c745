"""The TensorRT section of scripts/gpu_check.py, and what it carries in from a CPU machine (`--prepare`).

`python scripts/gpu_check.py --prepare out/gpu_check_inputs` (CPU machine, before the GPU session) writes:
  export/         an octavo export of the tiny random llama of tests/models.py (float32 weights);
  expected.json   the CPU path's greedy completions (a fresh `python -m octavo generate` on ONNX Runtime) and
                  transformers' logits of one prefill + one decode step.
The device machine needs neither ONNX Runtime's op library nor transformers for this section: it builds fp32 and
fp16 engines from the carried export (profile pool rows sized from its GPU, `octavo build`'s default), loads each
in TensorRTBackend (which reports what TensorRT says about the aliasing and proves the in-place pool write with
its probe step), compares the step logits with the carried ones, and runs a FRESH `python -m octavo generate
--backend tensorrt` process whose greedy completions must equal the CPU's (fp32). Every number TensorRT reports
(version, device memory, aliasing answer, pool rows, build time) goes into the report.

Runs only where `import tensorrt` works; elsewhere the section says "TensorRT: not available on this machine".
No torch needed (the section runs in its own process).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["the cache is paged", "attention over blocks", "a b c"]
MAX_TOKENS = 16
STEP_PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 64, 8, 1, 30, 77, 120, 9, 14, 200, 6]  # 18 tokens: crosses a block
LOGITS_ATOL = {"float32": 2e-3, "float16": 1.5e-1}
FALLBACK_POOL_BLOCKS = 65536  # profile pool rows tried when the default (sized from the GPU's memory) fails
UNAVAILABLE = "TensorRT: not available on this machine"


def tensorrt_unavailable() -> str | None:
    """None when TensorRT (with its plugin API) imports; else the sentence the report prints, with the reason."""
    try:
        from octavo.tensorrt.trt_import import import_tensorrt

        import_tensorrt()
    except Exception as exc:  # noqa: BLE001 - absent or broken: both mean the section cannot run
        return f"{UNAVAILABLE} ({type(exc).__name__}: {str(exc)[:200]})"
    return None


def generate_texts(model: Path, extra: list[str], env: dict | None = None, timeout: float = 600) -> tuple[list[str], str]:
    """Greedy completions of PROMPTS from a fresh `python -m octavo generate` process, and its output tail."""
    cmd = [sys.executable, "-m", "octavo", "generate", str(model), *PROMPTS, "--max-tokens", str(MAX_TOKENS),
           "--ignore-eos", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    tail = (proc.stdout + proc.stderr)[-3000:]
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd[1:])}` exited with {proc.returncode}: {tail}")
    texts = [line.split(" -> ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("[") and " -> " in line]
    if len(texts) != len(PROMPTS):
        raise RuntimeError(f"expected {len(PROMPTS)} completions from octavo generate, got: {tail}")
    return texts, tail


def _steps(backend) -> tuple[np.ndarray, np.ndarray, int]:  # noqa: ANN001
    """A prefill of STEP_PROMPT over shuffled blocks 3, 9 and one decode step that reads it back from the pool."""
    from octavo.runtime.backends.base import StepInputs

    table = np.array([[3, 9]], np.int32)
    slots = lambda ps: np.array([table[0, p // 16] * 16 + p % 16 for p in ps], np.int64)  # noqa: E731
    n = len(STEP_PROMPT)
    got1 = backend.run(StepInputs(np.array(STEP_PROMPT, np.int64), np.arange(n, dtype=np.int64),
                                  np.array([0, n], np.int32), np.array([0], np.int32), table, slots(range(n)),
                                  np.array([n - 1], np.int64)))
    nxt = int(got1[0].argmax())
    got2 = backend.run(StepInputs(np.array([nxt], np.int64), np.array([n], np.int64), np.array([0, 1], np.int32),
                                  np.array([n], np.int32), table, slots([n]), np.array([0], np.int64)))
    return got1[0], got2[0], nxt


def prepare(folder: Path) -> dict:
    """CPU machine: the carried inputs (see the module docstring). Returns expected.json's content."""
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from models import load_hf, make_random_model

    from octavo.export.exporter import export_model

    folder.mkdir(parents=True, exist_ok=True)
    hf_dir, export = folder / "hf", folder / "export"
    for old in (hf_dir, export):
        shutil.rmtree(old, ignore_errors=True)
    make_random_model(hf_dir, "llama")
    export_model(hf_dir, export, progress=False)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    texts, _ = generate_texts(export, ["--backend", "onnxruntime"], env=env)
    model, _ = load_hf(hf_dir)
    n = len(STEP_PROMPT)
    with torch.no_grad():
        first = model(torch.tensor([STEP_PROMPT])).logits[0, -1].numpy()
        nxt = int(first.argmax())
        second = model(torch.tensor([STEP_PROMPT + [nxt]])).logits[0, n].numpy()
    shutil.rmtree(hf_dir)  # the export is what the device needs
    expected = {"prompts": PROMPTS, "max_tokens": MAX_TOKENS, "cpu_texts": texts, "step_prompt": STEP_PROMPT,
                "next": nxt, "logits_prefill": first.tolist(), "logits_decode": second.tolist(),
                "prepared_unix": time.time()}
    (folder / "expected.json").write_text(json.dumps(expected) + "\n")
    return expected


def build_case(inputs: Path, work: Path, dtype: str, max_num_blocks: int | None = None) -> dict:
    """Build DTYPE's engine from a copy of the carried export with `octavo build`'s defaults."""
    from octavo.tensorrt.builder import TensorRTBuildOptions, build_engine
    from octavo.tensorrt.engine_info import BuildInfo, kv_copy_suspected

    folder = work / f"export_{dtype}"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(inputs / "export", folder)
    build_engine(folder, TensorRTBuildOptions(dtype=dtype, max_num_blocks=max_num_blocks))
    info = BuildInfo.load(folder)
    return {"status": "ok", "tensorrt_version": info.tensorrt_version, "build_seconds": info.build_seconds,
            "max_num_blocks": info.max_num_blocks, "device_memory_bytes": info.device_memory_bytes,
            "kv_pool_bytes_per_layer": info.kv_pool_bytes_per_layer,
            "copies_suspected": kv_copy_suspected(info.device_memory_bytes, info.kv_pool_bytes_per_layer),
            "engine_bytes": (folder / info.engine_file).stat().st_size}


def backend_case(inputs: Path, work: Path, dtype: str, num_blocks: int | None = None) -> dict:
    """Load the engine (probe step included), run a prefill + decode, compare with the carried logits."""
    from octavo.export.manifest import Manifest
    from octavo.tensorrt.backend import TensorRTBackend

    folder = work / f"export_{dtype}"
    if not (folder / "tensorrt.json").is_file():
        return {"status": "skipped", "reason": f"no {dtype} engine (its build case failed)"}
    expected = json.loads((inputs / "expected.json").read_text())
    backend = TensorRTBackend(folder, Manifest.load(folder), num_blocks=num_blocks)
    try:
        row = {"num_blocks": backend.num_blocks, "device_memory_bytes": backend.device_memory_bytes,
               "aliasing_reported": backend.aliasing_reported, "in_place_verified": backend.in_place_verified}
        first, second, nxt = _steps(backend)
    finally:
        backend.close()
    e1 = float(np.abs(first - np.array(expected["logits_prefill"], np.float32)).max())
    e2 = float(np.abs(second - np.array(expected["logits_decode"], np.float32)).max())
    same = nxt == expected["next"] and int(second.argmax()) == int(np.argmax(expected["logits_decode"]))
    ok = same and max(e1, e2) <= LOGITS_ATOL[dtype] and row["in_place_verified"]
    reported = sum(1 for out, inp in row["aliasing_reported"].items() if inp == out.removesuffix(".out"))
    row.update(status="ok" if ok else "failed", prefill_max_abs_err=e1, decode_max_abs_err=e2,
               atol=LOGITS_ATOL[dtype], argmax_equal=same,
               aliasing_reported_count=f"{reported}/{len(row['aliasing_reported'])}")
    return row


def generate_case(inputs: Path, work: Path, dtype: str, extra: list[str] | None = None) -> dict:
    """A fresh `octavo generate --backend tensorrt` process; its greedy texts must equal the carried CPU ones."""
    folder = work / f"export_{dtype}"
    if not (folder / "tensorrt.json").is_file():
        return {"status": "skipped", "reason": f"no {dtype} engine (its build case failed)"}
    expected = json.loads((inputs / "expected.json").read_text())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    texts, tail = generate_texts(folder, ["--backend", "tensorrt", *(extra or [])], env=env)
    matched = sum(a == b for a, b in zip(texts, expected["cpu_texts"]))
    row = {"status": "ok" if matched == len(texts) else "failed", "matched": f"{matched}/{len(texts)}",
           "output_tail": tail[-600:]}
    if matched != len(texts):
        row["texts"], row["cpu_texts"] = texts, expected["cpu_texts"]
    return row


def run_section(report, inputs: Path, work: Path, *, max_num_blocks: int | None = None,  # noqa: ANN001
                num_blocks: int | None = None) -> None:
    """The whole section, each case isolated and saved (report: gpu_check.Report)."""
    reason = tensorrt_unavailable()
    if reason is not None:
        report.data["tensorrt"] = {"status": "unavailable", "reason": reason}
        report.save()
        return
    if not (inputs / "expected.json").is_file():
        report.data["tensorrt"] = {"status": "error", "error": f"{inputs}/expected.json missing: run "
                                   f"`python scripts/gpu_check.py --prepare {inputs}` on a CPU machine and carry it"}
        report.save()
        return
    work.mkdir(parents=True, exist_ok=True)
    generate_extra = ["--num-blocks", str(num_blocks)] if num_blocks else []
    for dtype in ("float32", "float16"):
        row = report.case("tensorrt", f"build_{dtype}", lambda d=dtype: build_case(inputs, work, d, max_num_blocks),
                          min_left=60)
        if row.get("status") == "error" and max_num_blocks is None:  # the GPU-sized profile failed: a small one
            report.case("tensorrt", f"build_{dtype}_pool{FALLBACK_POOL_BLOCKS}",
                        lambda d=dtype: build_case(inputs, work, d, FALLBACK_POOL_BLOCKS), min_left=60)
        report.case("tensorrt", f"backend_{dtype}", lambda d=dtype: backend_case(inputs, work, d, num_blocks), min_left=20)
        if dtype == "float32":  # greedy text equality is only a fair test in fp32 (random-model logits are close)
            report.case("tensorrt", "generate_float32",
                        lambda: generate_case(inputs, work, "float32", generate_extra), min_left=30)
