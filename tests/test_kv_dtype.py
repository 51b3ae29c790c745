"""Opt-in float16 KV cache (EngineArgs.kv_cache_dtype="float16") on the onnxruntime backend, end to end:
logits and greedy tokens against HF transformers (float32 throughout), the pool contents, pool sizing,
and refusal of unknown dtypes.

Tolerances, measured on the tiny random models of tests/models.py (initializer_range 0.4, which makes
them far more sensitive to small perturbations than trained models): storing K/V in fp16 (relative
rounding error <= 2^-11) moves the logits (magnitude ~15) by at most ~0.10 over a 507-token prompt and
its decode steps (float32 pools: ~2e-4). LOGIT_ATOL leaves 2.5x margin. A greedy token can then flip
only where HF's top-2 logits are closer than twice the logit error: such near-ties are the documented
exception (measured: 1 of 26 requests on llama at margin 0.011, 2 of 26 on qwen2 at margins 5e-4);
every other token must equal HF's.
"""
from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest
from engine_helpers import exported, hf_reference, random_requests, seed10_requests
from step_inputs import one_sequence

from octavo import LLM, SamplingParams
from octavo.errors import InvalidRequestError
from octavo.export.manifest import Manifest
from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend
from octavo.runtime.model_setup import default_num_blocks, make_backend
from octavo.runtime.engine_args import EngineArgs

ARCHS = ["llama", "qwen2"]
LOGIT_ATOL = 0.25  # fp16 pool vs HF fp32 logits (measured max ~0.10)
NEAR_TIE = 0.1     # HF top-1/top-2 margin below which a flipped greedy token is accepted
MAX_NEAR_TIES = 4  # of the 26 requests


@pytest.fixture(scope="module", params=ARCHS)
def model(request, hf_model_dir):  # noqa: ANN001, ANN201
    hf = hf_model_dir(request.param)
    return hf, exported(hf)


def _hf_logits(hf_dir, tokens: list[int]) -> np.ndarray:  # noqa: ANN001
    import torch
    from models import load_hf

    hf_model = load_hf(hf_dir)[0]
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].numpy()


def test_logits_close_to_hf_and_pool_holds_fp16_rounding(model) -> None:  # noqa: ANN001
    """Prefill 300 tokens (every position's logits), then 6 decode steps that read the fp16 history.
    Layer 0's K/V do not depend on the pool dtype, so its fp16 pool must hold exactly the fp16 rounding
    of what a float32 pool holds after the same steps."""
    hf_dir, folder = model
    manifest = Manifest.load(folder)
    half = OnnxRuntimeBackend(folder, manifest, num_blocks=32, block_size=16, num_threads=2, kv_cache_dtype="float16")
    full = OnnxRuntimeBackend(folder, manifest, num_blocks=32, block_size=16, num_threads=2)
    assert half.key_caches[0].dtype == np.float16 and full.key_caches[0].dtype == np.float32
    rng = np.random.default_rng(5)
    prompt = rng.integers(5, manifest.vocab_size, 300).tolist()
    table = rng.permutation(32)[:20]  # 20 blocks of 16 > 306 positions, in shuffled order
    tokens = prompt + hf_reference(hf_dir, prompt, 6)
    want = _hf_logits(hf_dir, tokens)

    got = [half.run(one_sequence(prompt, 0, table, 16, all_logits=True))]
    full.run(one_sequence(prompt, 0, table, 16, all_logits=True))
    for pos in range(len(prompt), len(tokens)):
        got.append(half.run(one_sequence(tokens[pos:pos + 1], pos, table, 16)))
        full.run(one_sequence(tokens[pos:pos + 1], pos, table, 16))
    got_logits = np.concatenate(got)
    np.testing.assert_allclose(got_logits, want[:len(got_logits)], atol=LOGIT_ATOL, rtol=0)
    assert np.abs(got_logits - want[:len(got_logits)]).max() > 1e-4, "fp16 pools should not be float32-exact"

    for half_pool, full_pool in ((half.key_caches[0], full.key_caches[0]), (half.value_caches[0], full.value_caches[0])):
        np.testing.assert_array_equal(half_pool.view(np.uint16), full_pool.astype(np.float16).view(np.uint16))
        assert np.count_nonzero(half_pool) > 0
    half.close()
    full.close()


def _generate(llm: LLM, reqs: list[tuple[list[int], int]]) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_total_blocks, "blocks leaked"
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_tokens_match_hf_except_near_ties(model) -> None:  # noqa: ANN001
    """The seed's 10-request mix + 16 random requests, all at once, with float16 pools: every token as HF's
    up to a first difference, which must be a near-tie in HF's own logits; batch-invariant as with
    float32 pools (each request alone gives the same tokens)."""
    hf_dir, folder = model
    llm = LLM(str(folder), num_blocks=256, max_num_seqs=64, kv_cache_dtype="float16")
    assert llm.engine.backend.key_caches[0].dtype == np.float16
    reqs = seed10_requests(llm.get_tokenizer()) + random_requests(16, seed=1)
    together = _generate(llm, reqs)
    near_ties = []
    for i, ((prompt, max_tokens), got) in enumerate(zip(reqs, together)):
        ref = hf_reference(hf_dir, prompt, max_tokens)
        if got == ref:
            continue
        k = next(j for j in range(max_tokens) if got[j] != ref[j])
        logits = _hf_logits(hf_dir, prompt + ref[:k])[-1]
        margin = float(logits[ref[k]] - logits[got[k]])
        assert margin < NEAR_TIE, f"request {i}: token {k} is {got[k]}, HF's is {ref[k]} by a margin of {margin:.4f}"
        near_ties.append((i, k, margin))
    assert len(near_ties) <= MAX_NEAR_TIES, near_ties
    alone = [_generate(llm, [r])[0] for r in reqs[:12]]
    assert alone == together[:12]


def test_kv_cache_memory_gives_twice_the_blocks(model) -> None:  # noqa: ANN001
    _, folder = model
    manifest = Manifest.load(folder)
    per_block = manifest.kv_bytes_per_block(16)
    assert manifest.kv_bytes_per_block(16, "float32") == per_block == 2 * manifest.kv_bytes_per_block(16, "float16")
    memory = 100 * per_block + 7
    engines = {dtype: LLM(str(folder), kv_cache_memory=memory, kv_cache_dtype=dtype).engine
               for dtype in ("auto", "float16")}
    assert engines["auto"].num_blocks == 100 and engines["float16"].num_blocks == 200
    for engine in engines.values():
        pools = engine.backend.key_caches + engine.backend.value_caches
        assert engine.stats().num_total_blocks == engine.num_blocks
        assert sum(p.nbytes for p in pools) == 100 * per_block <= memory
    # The default size (no memory given) is capped in bytes, so it too holds twice the blocks when capped.
    args = EngineArgs(model=str(folder), max_num_seqs=10**6)
    capped32 = default_num_blocks(args, manifest, 1024)
    capped16 = default_num_blocks(dataclasses.replace(args, kv_cache_dtype="float16"), manifest, 1024)
    assert capped16 in (2 * capped32, 2 * capped32 + 1)


@pytest.mark.parametrize("dtype", ["q8_0", "bfloat16", "fp16", "Float32", "INT8", ""])
def test_unknown_kv_cache_dtype_refused(model, dtype: str) -> None:  # noqa: ANN001
    _, folder = model
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be 'auto'.*'float32', 'float16' or 'int8'"):
        EngineArgs(model=str(folder), kv_cache_dtype=dtype).validate()
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):
        LLM(str(folder), kv_cache_dtype=dtype)


def test_auto_is_float16_for_a_ggufs_own_blocks_only(hf_model_dir, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """"auto" (the default): float16 pools for a quantized GGUF run on its own blocks (llama.cpp's K/V type for
    the same file), float32 for the same file exported to fp32 or int4 and for HF exports; "float32" keeps
    float32 pools on the GGUF's blocks. The memory sizing follows the pool actually made."""
    from octavo.export.gguf_writer import write_gguf
    from octavo.runtime.kv_dtype import auto_kv_cache_dtype

    monkeypatch.setenv("OCTAVO_CACHE", str(tmp_path / "cache"))
    path = write_gguf(hf_model_dir("llama"), tmp_path / "m.Q4_1.gguf", tensor_type="Q4_1")
    pools = {}
    for name, kwargs in {"gguf": {}, "gguf-float32": {"kv_cache_dtype": "float32"}, "fp32": {"weights": "fp32"},
                         "int4": {"weights": "int4"}, "hf": {"model": str(hf_model_dir("llama"))}}.items():
        llm = LLM(**{"model": str(path), **kwargs}, num_threads=1, kv_cache_memory=1 << 20)
        engine = llm.engine
        manifest = Manifest.load(engine.model_dir)
        dtype = engine.backend.key_caches[0].dtype
        assert engine.num_blocks == (1 << 20) // manifest.kv_bytes_per_block(16, dtype.name)
        if "kv_cache_dtype" not in kwargs:
            assert auto_kv_cache_dtype(manifest) == dtype.name
        pools[name] = dtype.name
        llm.close()
    assert pools == {"gguf": "float16", "gguf-float32": "float32", "fp32": "float32", "int4": "float32", "hf": "float32"}


def test_cli_flag_reaches_engine_args() -> None:
    from octavo.commands.serve import add_engine_arguments, engine_args

    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("model")
    add_engine_arguments(parser)
    assert engine_args(parser.parse_args(["m"])).kv_cache_dtype == "auto"
    assert engine_args(parser.parse_args(["m", "--kv-cache-dtype", "float16"])).kv_cache_dtype == "float16"
    assert engine_args(parser.parse_args(["m", "--kv-cache-dtype", "float32"])).kv_cache_dtype == "float32"
    assert engine_args(parser.parse_args(["m", "--kv-cache-dtype", "int8"])).kv_cache_dtype == "int8"
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        parser.parse_args(["m", "--kv-cache-dtype", "q8_0"])


def test_tensorrt_pool_dtype_comes_from_the_engine(model, tmp_path) -> None:  # noqa: ANN001
    """No TensorRT here, so only what runs before the engine loads: the pool is sized at the engine's
    dtype (an fp16 engine gets twice the blocks of the manifest's fp32 for the same memory), and a
    kv_cache_dtype the engine was not built for is refused with what to do."""
    from octavo.tensorrt.engine_info import BuildInfo

    _, folder = model
    manifest = Manifest.load(folder)
    args = EngineArgs(model=str(folder), backend="tensorrt", kv_cache_memory=64 * manifest.kv_bytes_per_block(16))
    assert default_num_blocks(args, manifest, 1024, "float16") == 128
    info = BuildInfo(engine_file="model.float32.engine", dtype="float32", block_size=16, max_num_tokens=64,
                     max_num_seqs=8, max_blocks_per_seq=8, max_num_logits=8, max_num_blocks=64,
                     compute_capability=90, tensorrt_version="10", build_seconds=0.0)
    info.save(tmp_path)
    with pytest.raises(InvalidRequestError, match="built with|float32.*octavo build --dtype"):
        make_backend(dataclasses.replace(args, kv_cache_dtype="float16"), tmp_path, manifest, 1024)
