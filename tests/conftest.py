"""Shared fixtures. Model fixtures are session-scoped: each tiny model is made once per test run."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # make tests/models.py importable as `models`
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the checkout: `benchmarks` (not installed)


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):  # noqa: ANN001, ANN201
    """Factory: hf_model_dir(arch) -> folder of a random HF checkpoint of that architecture (cached)."""
    from models import make_random_model

    made: dict[str, Path] = {}

    def get(arch: str = "llama") -> Path:
        if arch not in made:
            made[arch] = make_random_model(tmp_path_factory.mktemp(f"hf_{arch}"), arch)
        return made[arch]

    return get


@pytest.fixture(scope="session")
def hf_dir(hf_model_dir):  # noqa: ANN001, ANN201
    """The tiny random llama checkpoint that most engine and server tests run."""
    return hf_model_dir("llama")
