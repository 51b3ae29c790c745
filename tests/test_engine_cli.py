"""`octavo generate` and `octavo chat` on the exported test model vs octavo.LLM (itself checked vs HF)."""
from __future__ import annotations

import io
import json

import pytest
from engine_helpers import exported

from octavo import LLM, SamplingParams
from octavo.cli import main


@pytest.fixture(scope="module")
def folder(hf_model_dir):  # noqa: ANN001, ANN201
    return exported(hf_model_dir("llama"))


def test_generate_streams_the_greedy_text_and_writes_a_trace(folder, tmp_path, capsys) -> None:  # noqa: ANN001
    trace = tmp_path / "t.jsonl"
    rc = main(["generate", str(folder), "The quick brown fox", "--max-tokens", "12", "--ignore-eos",
               "--num-blocks", "32", "--trace", str(trace)])
    assert rc == 0
    out = capsys.readouterr()
    ref = LLM(str(folder), num_blocks=32).generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=12,
                                                                                       ignore_eos=True), use_tqdm=False)
    assert out.out == ref[0].outputs[0].text + "\n"
    assert "12 tokens" in out.err
    rows = [json.loads(x) for x in trace.read_text().splitlines()]
    assert len(rows) == 12 and rows[-1]["finished"][0]["reason"] == "length"


def test_generate_batch_and_bad_input(folder, capsys) -> None:  # noqa: ANN001
    assert main(["generate", str(folder), "a b", "c d", "-n", "2", "--temperature", "0.7", "--seed", "1",
                 "--max-tokens", "4", "--num-blocks", "32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [x.split()[0] for x in lines] == ["[0.0]", "[0.1]", "[1.0]", "[1.1]"]
    assert main(["generate", str(folder), "x", "--top-p", "0", "--num-blocks", "32"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_chat_repl(folder, monkeypatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\n/reset\nhello there\n/exit\n"))
    assert main(["chat", str(folder), "--temperature", "0", "--max-tokens", "6", "--ignore-eos", "--num-blocks", "32"]) == 0
    out = capsys.readouterr().out
    ref = LLM(str(folder), num_blocks=32).chat([{"role": "user", "content": "hello there"}],
                                               SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    text = ref[0].outputs[0].text
    assert out.count("assistant> " + text) == 2  # same answer after /reset
