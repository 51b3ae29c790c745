"""Files octavo needs besides its Python modules: the Triton Inference Server model-repository template
(model_repo/) and the C++ sources of the ONNX Runtime op (plugins/onnxruntime/).

They live at the root of a source checkout, outside the package, where the people who edit them expect them. A
wheel carries copies inside the package, under octavo/_data/ (setup.py's build_py puts them there), so an installed
octavo finds them without a checkout. `data_path` looks inside the package first, then in the checkout.
"""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path

PACKAGED_DATA = "_data"


def package_dir() -> Path:
    """The installed (or checked-out) `octavo` package folder."""
    return Path(str(files("octavo")))


def checkout_root() -> Path:
    """The folder above the package: the repository root when octavo runs from a checkout."""
    return package_dir().parent


def in_checkout() -> bool:
    """True when octavo runs from a source checkout (editable install, PYTHONPATH), not an installed wheel."""
    return (checkout_root() / "pyproject.toml").is_file() and (checkout_root() / "plugins").is_dir()


def data_path(relative: str) -> Path:
    """Where RELATIVE (e.g. "model_repo/octavo") is: the package's copy, else the checkout's (which may not exist;
    callers say what is missing)."""
    packaged = package_dir() / PACKAGED_DATA / relative
    if packaged.exists():
        return packaged
    return checkout_root() / relative
