"""benchmarks/compare_peers.py --model FILE.gguf (any GGUF on the real-model workloads) and the
benchmarks/make_gguf.py recipe's checks. Not a speed test: what must hold is that the file given is the
file measured, the workloads asked for are the ones that ran with the sizes asked for, and bad arguments
are refused before anything runs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import compare_peers, make_gguf

ROOT = Path(__file__).resolve().parents[1]


def test_any_gguf_runs_the_chosen_workloads(tmp_path: Path) -> None:
    from octavo.export.embedded import default_model_path

    gguf = default_model_path()
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "benchmarks.compare_peers", "--model", str(gguf), "--tiny", "--peers",
           "octavo,llamacpp", "--llama-server", "", "--workloads", "decode,batch", "--batch-size", "3",
           "--workdir", str(tmp_path / "work"), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["model"]["gguf"] == str(gguf) and report["model"]["name"] == gguf.stem
    names = [w["name"] for w in report["workloads"]]
    assert [n[:5] for n in names] == ["batch", "decod"]
    assert report["workloads"][0]["num_requests"] == 3
    for r in report["results"]:
        assert r["error"] is None and r["output_tokens"] == sum(len(o) for o in r["outputs"]) > 0, r
    assert any("llama.cpp not run" in n for n in report["notes"])


@pytest.mark.parametrize("argv, message", [
    (["--model", "nope.gguf"], "not perf, smollm2 or an existing .gguf"),
    (["--model", "smollm2", "--workloads", "decode,speed"], "speed"),
    (["--model", "smollm2", "--batch-size", "0"], "--batch-size"),
])
def test_bad_arguments_are_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        compare_peers.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_make_gguf_names_the_missing_build_and_unknown_shapes(tmp_path: Path) -> None:
    for tool in (make_gguf.converter, make_gguf.quantizer):
        with pytest.raises(make_gguf.RecipeError, match="build_llama_server.sh"):
            tool(tmp_path)
    with pytest.raises(make_gguf.RecipeError, match="llama-1b"):
        make_gguf.make("llama-70b", ["Q4_K_M"], tmp_path, tmp_path)


def test_shapes_are_the_issues_sizes() -> None:
    """The parameter counts the docs quote follow from the shapes (vocabulary 49,152, untied embeddings)."""
    def params(c: dict, vocab: int = 49152) -> tuple[float, float]:
        h, n = c["hidden_size"], c["num_hidden_layers"]
        hd = c.get("head_dim", h // c["num_attention_heads"])
        attn = h * hd * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
        if "num_experts" in c:
            mlp, active = 3 * h * c["moe_intermediate_size"] * c["num_experts"], c["num_experts_per_tok"] / c["num_experts"]
        else:
            mlp, active = 3 * h * c["intermediate_size"], 1.0
        return (n * (attn + mlp) + 2 * vocab * h) / 1e9, (n * (attn + mlp * active) + 2 * vocab * h) / 1e9

    assert params(make_gguf.SHAPES["llama-1b"].config)[0] == pytest.approx(1.17, abs=0.02)
    assert params(make_gguf.SHAPES["llama-3b"].config)[0] == pytest.approx(3.2, abs=0.2)
    total, active = params(make_gguf.SHAPES["qwen3moe-1b"].config)
    assert total == pytest.approx(0.95, abs=0.03) and active == pytest.approx(0.25, abs=0.03)
