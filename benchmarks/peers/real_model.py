"""The comparison's real model: the embedded SmolLM2-135M-Instruct Q4_1 GGUF or any GGUF given (compare_peers
--model FILE.gguf), and an HF folder made from it for the peers that cannot read GGUF (vLLM CPU, HF transformers).

The HF folder is transformers' own reading of the GGUF (its config, its dequantization and un-permuting
of q/k, its tokenizer), saved as float32 safetensors: the same weights the GGUF holds, dequantized, with
none of octavo's GGUF reader in the path, so the HF and vLLM rows are an independent reference. It is
made once and cached under the perf workdir, keyed by the GGUF's size and name.

octavo and llama-server take the .gguf itself (octavo picks its own default for a GGUF; llama-server
runs the file's Q4_1 blocks natively).
"""
from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CONVERTER_VERSION = 1  # part of the cache folder's name: bump when the folder's content changes


@dataclass(slots=True, frozen=True)
class RealModel:
    """The real model in each peer's format; hf_dir is None (and hf_error says why) if conversion failed."""

    name: str
    gguf_path: Path
    hf_dir: Path | None
    hf_error: str | None
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int


def hf_folder_from_gguf(gguf_path: Path, out: Path) -> Path:
    """Write OUT (config.json, model.safetensors, tokenizer files) from GGUF_PATH with transformers' GGUF
    loader, float32. Built in a sibling temp folder and renamed, so a crash never leaves half a folder.

    The weights go through `load_gguf_checkpoint` + `load_state_dict` rather than
    `from_pretrained(gguf_file=...)`, which insists on `accelerate` for no benefit on a CPU."""
    import numpy as np
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf_path.parent), gguf_path.name
    # use_safetensors: nothing here reads a .bin, but no from_pretrained in octavo may ever torch.load one
    config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name, use_safetensors=True)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    state = {k: torch.as_tensor(np.asarray(v, dtype=np.float32)) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if unexpected or set(missing) - ({"lm_head.weight"} if tied else set()):
        raise ValueError(f"{name}: transformers' GGUF tensors do not fit its model: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    model.tie_weights()
    model.eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name, use_safetensors=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    cfg_path = tmp / "config.json"  # vLLM reads the dtype from here unless told; say float32 outright
    cfg = json.loads(cfg_path.read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def prepare_smollm2(workdir: Path, *, hf: bool = True) -> RealModel:
    """The embedded SmolLM2 GGUF, and (HF=True) its HF folder, made once under WORKDIR."""
    from octavo.export.embedded import EMBEDDED_NAME, default_model_path

    return prepare_gguf(default_model_path(), workdir, hf=hf, name=EMBEDDED_NAME)


def prepare_gguf(gguf_path: Path, workdir: Path, *, hf: bool = True, name: str | None = None) -> RealModel:
    """Any GGUF (named NAME, default its file name), and (HF=True) its HF folder, made once under WORKDIR."""
    from octavo.export.gguf_reader import read_gguf

    ckpt = read_gguf(gguf_path)  # metadata only (tensors are dequantized lazily, none are touched here)
    hf_dir: Path | None = None
    error: str | None = None
    if hf:
        target = workdir / f"{gguf_path.stem}-{gguf_path.stat().st_size}-hf-v{CONVERTER_VERSION}"
        if not (target / "config.json").is_file():
            log.info("converting %s to an HF folder in %s (transformers' GGUF loader, float32)", gguf_path.name, target)
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                hf_folder_from_gguf(gguf_path, target)
            except Exception as exc:  # noqa: BLE001 - reported; octavo and llama.cpp still run on the GGUF
                error = f"GGUF -> HF conversion failed: {type(exc).__name__}: {exc}"
        if error is None:
            hf_dir = target
    cfg = ckpt.config
    return RealModel(name or gguf_path.stem, gguf_path, hf_dir, error, int(cfg["vocab_size"]), ckpt.bos_token_id,
                     tuple(ckpt.eos_token_ids), int(cfg.get("max_position_embeddings") or 2048))
