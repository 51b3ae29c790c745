"""Benchmarks: workloads are deterministic and well-formed; `octavo bench serve` against our server and
`octavo bench throughput` print their tables and write JSON whose numbers add up."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from engine_helpers import exported

from octavo.bench.workloads import (SEED10, Vocab, jsonl_workload, load_workload, random_workload, seed10_workload,
                                    shared_prefix_workload)
from octavo.cli import main
from octavo.errors import InvalidRequestError

SHARED_SEED10 = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "seed10.json"


@pytest.fixture(scope="module")
def model_dir(hf_model_dir):  # noqa: ANN001, ANN201
    return exported(hf_model_dir("llama"))  # exported once per session, shared with the engine tests


# ------------------------------------------------------------------------------------------------
# workloads


def test_random_workload_seeded_lengths_and_ids() -> None:
    vocab = Vocab(100, frozenset({0, 1, 2}))
    a = random_workload(50, 20, 10, 0.5, seed=3, vocab=vocab)
    assert a == random_workload(50, 20, 10, 0.5, seed=3, vocab=vocab)
    assert a != random_workload(50, 20, 10, 0.5, seed=4, vocab=vocab)
    assert all(10 <= len(r.prompt) <= 30 and 5 <= r.max_tokens <= 15 and r.ignore_eos for r in a)
    assert len({len(r.prompt) for r in a}) > 5  # lengths really vary
    assert all(3 <= t < 100 for r in a for t in r.prompt)
    exact = random_workload(5, 7, 4, 0.0, vocab=vocab)
    assert [len(r.prompt) for r in exact] == [7] * 5 and [r.max_tokens for r in exact] == [4] * 5
    words = random_workload(3, 12, 4, seed=1)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 12 for r in words)
    with pytest.raises(InvalidRequestError):
        random_workload(3, 12, 4, range_ratio=1.5)


def test_seed10_matches_the_seed_profile() -> None:
    reqs = seed10_workload()
    assert [r.max_tokens for r in reqs] == [4, 8, 16, 16, 24, 32, 32, 48, 48, 64]
    assert all(r.ignore_eos for r in reqs)
    if SHARED_SEED10.is_file():  # the embedded profile is the shared one
        shared = json.loads(SHARED_SEED10.read_text())["requests"]
        assert [(s["type"], s["prompt_tokens"], s["generation_tokens"]) for s in shared] == \
               [(k, p, g) for k, p, g, _ in SEED10]
    assert reqs[1].prompt.count("fox") == 50
    assert len(seed10_workload(25)) == 25


def test_shared_prefix_and_jsonl(tmp_path) -> None:  # noqa: ANN001
    reqs = shared_prefix_workload(6, prefix_len=40, output_len=5, seed=2)
    prefix = reqs[0].prompt[:reqs[0].prompt.index("Question")]
    assert len(prefix.split()) > 40 and all(r.prompt.startswith(prefix) for r in reqs)
    assert len({r.prompt for r in reqs}) == 6
    f = tmp_path / "w.jsonl"
    f.write_text('{"prompt": "hi", "max_tokens": 3}\n\n{"prompt": [5, 6], "max_tokens": 2, "ignore_eos": false}\n')
    got = jsonl_workload(f)
    assert [(r.prompt, r.max_tokens, r.ignore_eos) for r in got] == [("hi", 3, True), ([5, 6], 2, False)]
    assert load_workload(str(f), num_prompts=1)[0].prompt == "hi"
    f.write_text('{"prompt": "hi", "max_tokens": "3"}\n')
    with pytest.raises(InvalidRequestError, match=":1:"):
        jsonl_workload(f)
    with pytest.raises(InvalidRequestError, match="unknown workload"):
        load_workload("nope")


# ------------------------------------------------------------------------------------------------
# bench serve / bench throughput


def _check_summary(s: dict, n: int, want_out: int, want_in: int) -> None:
    assert s["completed"] == n and s["failed"] == 0 and not any(s["errors"])
    assert s["total_output_tokens"] == sum(s["output_lens"]) == want_out  # ignore_eos: exactly max_tokens each
    assert s["total_input_tokens"] == sum(s["input_lens"]) == want_in
    d = s["duration"]
    assert s["request_throughput"] == pytest.approx(n / d)
    assert s["output_throughput"] == pytest.approx(want_out / d)
    assert s["total_token_throughput"] == pytest.approx((want_in + want_out) / d)
    ttfts = np.array(s["ttfts"]) * 1000
    assert s["mean_ttft_ms"] == pytest.approx(ttfts.mean()) and s["median_ttft_ms"] == pytest.approx(np.median(ttfts))
    itls = np.array([x for xs in s["itls"] for x in xs]) * 1000
    assert len(itls) <= want_out - n and s["mean_itl_ms"] == pytest.approx(itls.mean())
    for m in ("ttft", "e2el"):
        assert 0 < s[f"median_{m}_ms"] <= s[f"p99_{m}_ms"], m
    # TPOT and ITL can be 0 for a request whose tokens came in one chunk (the server coalesces unread deltas)
    for m in ("tpot", "itl"):
        assert 0 <= s[f"median_{m}_ms"] <= s[f"p99_{m}_ms"], m
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert s[f"std_{m}_ms"] >= 0
    assert s["mean_ttft_ms"] <= s["mean_e2el_ms"] and max(ttfts) <= d * 1000
    assert s["p99_e2el_ms"] <= d * 1000 + 1


def test_bench_serve_against_our_server(model_dir, tmp_path, capsys) -> None:  # noqa: ANN001
    from octavo.runtime.async_engine import AsyncEngine
    from octavo.runtime.engine_args import EngineArgs
    from octavo.serving.state import ServerConfig
    from octavo.serving.background import ServerThread
    from octavo.serving.server import OpenAIServer

    ea = EngineArgs(model=str(model_dir), num_blocks=256, max_num_seqs=16, num_threads=1)
    srv = OpenAIServer(ServerConfig(served_model_names=("tiny",), api_key="k"), lambda: AsyncEngine(ea))
    out = tmp_path / "serve.json"
    args = ["--workload", "random", "--num-prompts", "24", "--input-len", "16", "--output-len", "8",
            "--range-ratio", "0.5", "--seed", "5"]
    with ServerThread(srv) as s:
        gen_before = _gen_tokens(s.base_url)
        code = main(["bench", "serve", "--base-url", s.base_url, "--api-key", "k", "--tokenizer", str(model_dir),
                     "--request-rate", "200", "--max-concurrency", "8", "--save-result", str(out), *args])
        gen_after = _gen_tokens(s.base_url)
    assert code == 0
    table = capsys.readouterr().out
    for label in ("Successful requests:", "Benchmark duration (s):", "Request throughput (req/s):",
                  "Output token throughput (tok/s):", "Total Token throughput (tok/s):", "Mean TTFT (ms):",
                  "Median TPOT (ms):", "P99 ITL (ms):", "Mean E2EL (ms):"):
        assert label in table
    s = json.loads(out.read_text())
    reqs = random_workload(24, 16, 8, 0.5, seed=5, vocab=Vocab.from_tokenizer_file(model_dir / "tokenizer.json"))
    want_out = sum(r.max_tokens for r in reqs)
    _check_summary(s, 24, want_out, sum(len(r.prompt) for r in reqs))
    assert gen_after - gen_before == want_out  # the server's own counter agrees
    assert s["max_concurrency"] == 8 and s["model_id"] == "tiny"


def _gen_tokens(url: str) -> float:
    text = httpx.get(url + "/metrics", headers={"Authorization": "Bearer k"}).text
    return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith("octavo:generation_tokens_total")))


def test_bench_throughput_offline(model_dir, tmp_path, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "tp.json"
    code = main(["bench", "throughput", str(model_dir), "--workload", "shared-prefix", "--num-prompts", "12",
                 "--prefix-len", "30", "--output-len", "6", "--num-blocks", "256", "--num-threads", "1",
                 "--save-result", str(out)])
    assert code == 0
    assert "Throughput:" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["num_requests"] == 12 and r["total_output_tokens"] == 12 * 6
    assert r["total_num_tokens"] == r["total_prompt_tokens"] + r["total_output_tokens"]
    assert r["tokens_per_second"] == pytest.approx(r["total_num_tokens"] / r["elapsed_time"])
    assert r["requests_per_second"] == pytest.approx(12 / r["elapsed_time"])


# ------------------------------------------------------------------------------------------------
# roofline on a GGUF's own blocks (octavo.BlockMatMul)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_roofline_counts_block_matmul_weights(hf_model_dir, tmp_path: Path, qtype: str) -> None:  # noqa: ANN001
    """A GGUF exported on its own blocks has no Gemm left: the roofline's FLOPs are transformers' linear
    layers (every projection and lm_head, K x N each) and its bytes the codes + scales + offsets the graph
    stores; the profiled share of kernel time and the projections' GFLOP/s include BlockMatMul."""
    import onnx
    import torch
    from models import load_hf

    from benchmarks.roofline import _profiled_shares, gemm_weights
    from octavo.export import export_model
    from octavo.export.gguf_writer import write_gguf
    from octavo.export.manifest import Manifest

    src = hf_model_dir("llama")
    path = write_gguf(src, tmp_path / f"m.{qtype}.gguf", tensor_type=qtype)
    out = tmp_path / "out"
    export_model(path, out, progress=False)
    manifest = Manifest.load(out)
    model = onnx.load(str(out / manifest.onnx_file))  # with the weights: their real sizes
    values = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    blocks = [n for n in model.graph.node if n.op_type == "BlockMatMul"]
    assert blocks and not [n for n in model.graph.node if n.op_type in ("Gemm", "MatMul", "MatMulNBits")]

    linear = [m.weight for m in load_hf(src)[0].modules() if isinstance(m, torch.nn.Linear)]
    want_bytes = sum(values[name].nbytes for n in blocks for name in n.input[1:4])
    codes = sum(values[n.input[1]].nbytes for n in blocks)
    elements, nbytes = gemm_weights(out, manifest)
    assert elements == sum(w.numel() for w in linear)
    assert nbytes == want_bytes
    bits = 4 if qtype == "Q4_0" else 8
    assert codes >= elements * bits // 8  # the codes alone (N padded to panels of 16), scales and offsets beside
    assert nbytes - codes < codes  # ... which take less than the codes

    shares, kernel_gflops = _profiled_shares(out, manifest, threads=1, batch=2, context=16, block_size=16,
                                             flops=2.0 * elements * 2)
    assert shares.get("BlockMatMul", 0.0) > 0.0
    assert kernel_gflops is not None and kernel_gflops > 0.0
