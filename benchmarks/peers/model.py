"""The comparison's model: a random-weight Llama made with transformers from a config, and the same
weights converted for each peer (octavo export, onnxruntime-genai's model builder, GGUF F32).

The init range is large (DESIGN.md: 0.3-0.6) so greedy outputs depend on the context and are far from
fp32 ties, which makes "every peer produced the same tokens" a meaningful check. The tokenizer is a
byte-level BPE vocabulary of the model's full size with a single merge: every peer is fed token ids
directly, the tokenizer only has to exist (octavo detokenizes, llama.cpp needs tokenizer.ggml.* and refuses
a byte-level vocabulary without a tokenizer.ggml.merges key, which GGUF cannot store empty).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
MERGE = ("\u0120", "\u0120")  # byte-level "space" + "space"; its result is the first token after the bytes
TOKENIZER_VERSION = 2  # part of the cache key: 1 had no merges (llama.cpp could not load its GGUF)


@dataclass(slots=True, frozen=True)
class PerfModelConfig:
    vocab_size: int = 32000
    hidden_size: int = 512
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 1536
    max_position_embeddings: int = 2048
    initializer_range: float = 0.4
    seed: int = 0

    @classmethod
    def tiny(cls) -> PerfModelConfig:
        """For the fast test: same shape family, seconds to run."""
        return cls(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                   max_position_embeddings=1024)

    @property
    def key(self) -> str:
        fields = {**asdict(self), "tokenizer_version": TOKENIZER_VERSION}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def linear_params_per_token(self) -> int:
        """Weights one token multiplies through: q/k/v/o, gate/up/down per layer, plus the LM head."""
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        per_layer = h * (self.num_heads * d) * 2 + h * (self.num_kv_heads * d) * 2 + 3 * h * i
        return self.num_layers * per_layer + h * self.vocab_size

    def matmul_flops_per_token(self) -> int:
        return 2 * self.linear_params_per_token()


def make_tokenizer_json(vocab_size: int) -> dict:
    """A byte-level BPE tokenizer.json: 3 specials, the 256 byte symbols, the one merge's result, then
    filler tokens."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    vocab.setdefault("".join(MERGE), len(vocab))
    n = 0
    while len(vocab) < vocab_size:
        vocab.setdefault(f"tok{n}", len(vocab))
        n += 1
    if len(vocab) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the {len(vocab)} base symbols")
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, t in enumerate(SPECIAL_TOKENS)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [list(MERGE)]},
    }


def make_hf_model(path: Path, cfg: PerfModelConfig) -> Path:
    """config.json + model.safetensors + tokenizer files of a random Llama with CFG, written to PATH."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=1e-5, rope_theta=10000.0,
        initializer_range=cfg.initializer_range, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(cfg.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    (path / "tokenizer.json").write_text(json.dumps(make_tokenizer_json(cfg.vocab_size)))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": "</s>", "add_bos_token": False, "model_max_length": cfg.max_position_embeddings}))
    return path


@dataclass(slots=True)
class ModelSet:
    """The perf model in each peer's format; a conversion that failed leaves None and its reason."""

    config: PerfModelConfig
    hf_dir: Path
    octavo_dir: Path
    genai_dir: Path | None = None
    genai_error: str | None = None
    gguf_path: Path | None = None
    gguf_error: str | None = None


def prepare_models(workdir: Path, cfg: PerfModelConfig, *, genai: bool = True, gguf: bool = False) -> ModelSet:
    """Make (once; cached in WORKDIR/<config key>/) the HF model and its conversions."""
    from octavo.export import export_model

    root = workdir / f"llama-{cfg.hidden_size}x{cfg.num_layers}-v{cfg.vocab_size}-{cfg.key}"
    hf_dir = root / "hf"
    if not (hf_dir / "model.safetensors").is_file():
        log.info("making the random HF model in %s", hf_dir)
        make_hf_model(hf_dir, cfg)
    octavo_dir = root / "octavo"
    if not (octavo_dir / "octavo.json").is_file():
        export_model(hf_dir, octavo_dir, progress=False, overwrite=True)
    models = ModelSet(cfg, hf_dir, octavo_dir)
    if genai:
        models.genai_dir, models.genai_error = _genai_model(hf_dir, root / "genai")
    if gguf:
        models.gguf_path, models.gguf_error = _gguf_model(hf_dir, root / "model-f32.gguf")
    return models


def _genai_model(hf_dir: Path, out: Path) -> tuple[Path | None, str | None]:
    """onnxruntime-genai's model builder, fp32 for the CPU EP (run as its documented module)."""
    if (out / "genai_config.json").is_file():
        return out, None
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(hf_dir), "-o", str(out),
           "-p", "fp32", "-e", "cpu", "-c", str(out.parent / "genai-cache")]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "TQDM_DISABLE": "1"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"model builder did not run: {exc}"
    if proc.returncode != 0 or not (out / "genai_config.json").is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, f"onnxruntime-genai model builder failed (exit {proc.returncode}): {tail[0][:300]}"
    return out, None


def _gguf_model(hf_dir: Path, out: Path) -> tuple[Path | None, str | None]:
    """GGUF F32 with octavo's own writer (llama.cpp's tensor layout and tokenizer keys)."""
    if out.is_file():
        return out, None
    try:
        from octavo.export.gguf_writer import write_gguf

        tmp = out.with_suffix(".tmp")
        write_gguf(hf_dir, tmp, tensor_type="F32", name="octavo-perf")
        tmp.replace(out)
    except Exception as exc:  # noqa: BLE001 - reported, the comparison goes on without llama.cpp
        return None, f"GGUF conversion failed: {type(exc).__name__}: {exc}"
    return out, None
