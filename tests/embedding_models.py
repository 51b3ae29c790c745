"""Tiny random embedding checkpoints in sentence-transformers' layout (modules.json, 1_Pooling/config.json,
2_Normalize), and sentence-transformers itself as the reference that reads them."""
from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

_MODES = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def make_embedding_model(path: str | Path, base: str | Path, pooling: str = "last", normalize: bool = True) -> Path:
    """A copy of the HF checkpoint BASE with sentence-transformers' modules: Transformer, Pooling (POOLING),
    and Normalize when NORMALIZE."""
    path = Path(path)
    shutil.copytree(base, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    flags = {mode: mode == _MODES[pooling] for mode in _MODES.values()}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": config["hidden_size"],
                                                                 **flags}))
    return path


@functools.cache
def _st_model(folder: str):  # noqa: ANN202
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(folder, device="cpu")
    model.tokenizer.pad_token = "<unk>"  # the tiny tokenizer has none; the attention mask keeps pads out
    return model


def st_embeddings(folder: str | Path, texts: list[str]):  # noqa: ANN201 - numpy [len(texts), hidden]
    """sentence-transformers' embeddings of TEXTS by the model in FOLDER (its own pooling and normalization)."""
    return _st_model(str(folder)).encode(texts, batch_size=4)
