"""How an embedding model pools: sentence-transformers' `modules.json` + `1_Pooling/config.json` -> PoolingConfig.

A checkpoint saved by sentence-transformers (Qwen3-Embedding, gte, e5, ...) lists its modules in `modules.json`:
a Transformer, a Pooling module (whose folder holds `config.json` with one `pooling_mode_*` flag set) and
optionally a Normalize module. `read_pooling_config(folder)` reads them; an export with a PoolingConfig
(found there, or asked for with `octavo export --pooling`) writes it into the manifest and gives the graph a
`hidden_states` output (docs/serving.md, "Embeddings"). The engine pools the rows itself (runtime/pooling.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from octavo.errors import ModelFormatError

POOLING_TYPES = ("last", "mean", "cls")
# sentence-transformers' pooling_mode_* flags -> our pooling type (the modes we do not pool are refused)
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
_ALLOWED_MODULES = ("sentence_transformers.models.Transformer", _POOLING_MODULE, _NORMALIZE_MODULE)


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """The model's default pooling: which rows of the final-normed hidden states make an embedding, and
    whether it is L2-normalized."""

    type: str  # "last" | "mean" | "cls"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.type not in POOLING_TYPES:
            raise ModelFormatError(f"pooling type {self.type!r} is not one of {', '.join(POOLING_TYPES)}")

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, "normalize": self.normalize}

    @classmethod
    def from_json(cls, data: Any, where: str = "octavo.json") -> "PoolingConfig":
        if not isinstance(data, dict) or not isinstance(data.get("type"), str) \
                or not isinstance(data.get("normalize", True), bool):
            raise ModelFormatError(f"{where}: pooling must be {{'type': 'last'|'mean'|'cls', 'normalize': bool}}, "
                                   f"got {data!r}")
        return cls(data["type"], data.get("normalize", True))


def read_pooling_config(folder: str | Path) -> PoolingConfig | None:
    """The pooling of the sentence-transformers model in FOLDER, or None when it has no modules.json.
    A pipeline this export cannot reproduce (a Dense layer, max pooling, ...) is a ModelFormatError."""
    folder = Path(folder)
    modules_path = folder / "modules.json"
    if not modules_path.is_file():
        return None
    modules = _json(modules_path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ModelFormatError(f"{modules_path}: expected a list of modules")
    kinds = [str(m.get("type", "")) for m in modules]
    other = [k for k in kinds if k not in _ALLOWED_MODULES]
    if other:
        raise ModelFormatError(f"{modules_path}: module(s) {other} after the transformer are not supported "
                               "(octavo pools the final hidden states: Pooling and Normalize only)")
    pooling = [m for m in modules if m.get("type") == _POOLING_MODULE]
    if len(pooling) != 1:
        raise ModelFormatError(f"{modules_path}: expected one {_POOLING_MODULE} module, found {len(pooling)}")
    sub = str(pooling[0].get("path", ""))
    config_path = (folder / sub / "config.json").resolve()
    if not config_path.is_relative_to(folder.resolve()) or not config_path.is_file():
        raise ModelFormatError(f"{modules_path}: the Pooling module's config {sub!r}/config.json is missing")
    config = _json(config_path)
    if not isinstance(config, dict):
        raise ModelFormatError(f"{config_path}: expected a JSON object")
    unsupported = [k for k in _ST_UNSUPPORTED if config.get(k)]
    if unsupported:
        raise ModelFormatError(f"{config_path}: {unsupported[0]} is not supported (octavo pools last, mean or cls)")
    modes = [ours for key, ours in _ST_MODES.items() if config.get(key)]
    if len(modes) != 1:
        raise ModelFormatError(f"{config_path}: expected exactly one of {', '.join(_ST_MODES)} set, got {modes}")
    if config.get("include_prompt") is False:
        raise ModelFormatError(f"{config_path}: include_prompt false is not supported")
    return PoolingConfig(modes[0], normalize=_NORMALIZE_MODULE in kinds)


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{path}: cannot read JSON ({exc})") from exc


__all__ = ["POOLING_TYPES", "PoolingConfig", "read_pooling_config"]
