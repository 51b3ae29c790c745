"""Read an HF model folder (config.json + *.safetensors + tokenizer files) into a neutral Checkpoint.

Safety first: pickle checkpoints (.bin/.pt/.pth/.ckpt) are refused and never opened, and every file the
folder names (weights index entries included) must stay inside the folder after resolving `..` and
symlinks. The one exception is the Hugging Face hub cache layout, where snapshots/<rev>/* are symlinks
into the same repository's blobs/ folder.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from octavo.errors import ModelFormatError
from octavo.export.checkpoint import Checkpoint
from octavo.export.paths import inside
from octavo.export.safetensors_file import SafetensorsFile

log = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
INDEX_NAME = "model.safetensors.index.json"


def _hub_blobs(folder: Path) -> list[Path]:
    """The HF hub cache's blobs/ folder when FOLDER is one of its snapshots (their files link there)."""
    root = folder.resolve()
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        return [root.parent.parent / "blobs"]
    return []


def safe_path(folder: Path, name: str) -> Path:
    """FOLDER/NAME, refusing names that escape FOLDER (absolute, '..', or a symlink pointing out)."""
    return inside(folder, name, subject="the checkpoint file", fix="weights must live inside the folder",
                  also_allowed=_hub_blobs(folder))


def _read_json(folder: Path, name: str) -> Any:
    path = safe_path(folder, name)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{path}: cannot read JSON ({exc})") from exc


def _refuse_pickle(folder: Path) -> None:
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    raise ModelFormatError(
        f"{folder} has no .safetensors weights"
        + (f", only pickle checkpoints ({', '.join(pickles)})" if pickles else "")
        + ". octavo refuses pickle files because loading them can run arbitrary code; convert the model "
        "to safetensors (e.g. `model.save_pretrained(dir, safe_serialization=True)` in a trusted "
        "environment) or use a GGUF file"
    )


def _weight_files(folder: Path) -> dict[str, Path]:
    """weight file name -> safe path, from the index's weight_map or the folder's *.safetensors."""
    if (folder / INDEX_NAME).exists():
        index = _read_json(folder, INDEX_NAME)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelFormatError(f"{folder / INDEX_NAME}: 'weight_map' is missing or empty")
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(p.name for p in folder.glob("*.safetensors"))
        if not names:
            _refuse_pickle(folder)
    files: dict[str, Path] = {}
    for name in names:
        path = safe_path(folder, name)
        if not str(name).endswith(".safetensors"):
            raise ModelFormatError(
                f"{folder}: weights file {name!r} is not a .safetensors file; pickle checkpoints are "
                f"refused because loading them can run arbitrary code"
            )
        if not path.is_file():
            raise ModelFormatError(f"{path} is named by the checkpoint but does not exist")
        files[name] = path
    return files


def _chat_template(folder: Path) -> str | None:
    if (folder / "chat_template.jinja").is_file():
        return safe_path(folder, "chat_template.jinja").read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        if not (folder / name).is_file():
            continue
        template = _read_json(folder, name)
        template = template.get("chat_template") if isinstance(template, dict) else None
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if isinstance(template, str):
            return template
    return None


def _extra_eos(folder: Path) -> list[int]:
    if not (folder / "generation_config.json").is_file():
        return []
    value = _read_json(folder, "generation_config.json").get("eos_token_id")
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def read_hf_folder(folder: str | Path) -> Checkpoint:
    """Open an HF model folder lazily: headers are validated now, tensors are read on demand."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ModelFormatError(f"{folder} is not an HF model folder: config.json is missing")
    config = _read_json(folder, "config.json")
    if not isinstance(config, dict):
        raise ModelFormatError(f"{folder / 'config.json'} is not a JSON object")

    owner: dict[str, SafetensorsFile] = {}
    for path in _weight_files(folder).values():
        shard = SafetensorsFile(path)
        for name in shard.names():
            owner[name] = shard

    if not (folder / "tokenizer.json").is_file():
        raise ModelFormatError(
            f"{folder}: tokenizer.json is missing; octavo needs the fast (HF tokenizers) tokenizer file — "
            f"save it with `AutoTokenizer.from_pretrained(...).save_pretrained(dir)`"
        )
    tokenizer_json = safe_path(folder, "tokenizer.json").read_text(encoding="utf-8")

    def get_tensor(name: str) -> np.ndarray:
        return owner[name].get(name)

    log.info("read %s: %d tensors in %d files", folder, len(owner), len({id(s) for s in owner.values()}))
    return Checkpoint(
        config=config,
        tensor_names=frozenset(owner),
        get_tensor=get_tensor,
        tokenizer_json=tokenizer_json,
        chat_template=_chat_template(folder),
        source=str(folder),
        extra_eos_token_ids=_extra_eos(folder),
    )
