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


def test_chat_banner_reset_confirmation_and_unknown_commands(folder, monkeypatch, capsys) -> None:  # noqa: ANN001
    """The REPL lists its commands, /reset says what it cleared, an unknown /command is an error that never reaches
    the model (the conversation stays as it was), and '//' sends a message starting with '/'."""
    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\n/reste\n/reset\n/help\n//etc\n/quit\n"))
    assert main(["chat", str(folder), "--temperature", "0", "--max-tokens", "4", "--ignore-eos",
                 "--num-blocks", "32"]) == 0
    out = capsys.readouterr().out
    banner = out.split("\n")[:5]
    assert banner[0].startswith(f"octavo chat: {folder}") and all(
        any(line.lstrip().startswith(cmd) for line in banner) for cmd in ("/reset", "/help", "/exit"))
    assert "[unknown command /reste; commands: /reset, /help, /exit, /quit." in out
    assert "[conversation cleared: 1 turn forgotten]" in out
    assert out.count("octavo chat:") == 2  # /help shows the banner again
    assert out.count("assistant> ") == 2  # "hello there" and "/etc": the typo and the commands went nowhere
    ref = LLM(str(folder), num_blocks=32).chat([{"role": "user", "content": "/etc"}],
                                               SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                                               use_tqdm=False)[0].outputs[0].text
    assert "assistant> " + ref in out  # after /reset: a fresh conversation holding only "/etc"


def test_a_missing_model_file_is_reported_as_missing(tmp_path, capsys) -> None:  # noqa: ANN001
    missing = tmp_path / "nonexistent.gguf"
    assert main(["generate", str(missing), "hi"]) == 2
    err = capsys.readouterr().err
    assert f"{missing} does not exist" in err and "is not a model" not in err
