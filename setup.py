"""Build hooks for setuptools (metadata is in pyproject.toml; why setuptools: docs/install.md).

- build_ext compiles the ONNX Runtime custom op (plugins/onnxruntime/*.cc) with octavo.oplib_build, the same code
  `make op` runs: into the wheel, the portable builds chosen at load time (x86-64: AVX2/FMA/F16C and AVX-512);
  for an editable install, the -march=native build in the checkout's octavo/_lib/ (what `make op` builds).
- build_py copies the data files that live outside the package in a checkout (the Triton model template, the
  op's C++ sources) into octavo/_data/ of the wheel (octavo.resources finds them).
- The wheel is tagged py3-none-<platform>: it holds a native library but no CPython extension module.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent
DATA_FOLDERS = ("model_repo", "plugins/onnxruntime")


def _op_builder():  # noqa: ANN202 - a module
    """octavo.oplib_build from this source tree (stdlib-only imports, so it runs in pip's build environment)."""
    sys.path.insert(0, str(HERE))
    from octavo import oplib_build

    return oplib_build


class BinaryDistribution(Distribution):
    """Has a platform-specific part (the op library), so the wheel is not tagged pure Python."""

    def has_ext_modules(self) -> bool:
        return True


class BuildOp(build_ext):
    """Builds the custom-op library instead of CPython extensions (there are none)."""

    def run(self) -> None:
        op = _op_builder()
        import logging

        logging.basicConfig(level=logging.INFO, format="octavo op build: %(message)s")
        if self.editable_mode or self.inplace:
            op.build_library()  # the checkout's octavo/_lib/liboctavo_ort.so, -march=native
            return
        # Built in build_temp (with the fingerprints that skip unchanged rebuilds); only the libraries go in.
        target = Path(self.build_lib) / "octavo" / "_lib"
        target.mkdir(parents=True, exist_ok=True)
        for library in op.build_packaged(Path(self.build_temp) / "octavo-op"):
            shutil.copy2(library, target / library.name)

    def get_outputs(self) -> list[str]:
        if self.editable_mode or self.inplace:
            return []
        folder = Path(self.build_lib) / "octavo" / "_lib"
        return [str(folder / variant.file_name) for variant in _op_builder().packaged_variants()]


class BuildPy(build_py):
    """Also copies the checkout's data folders into octavo/_data/ (not for editable installs: they use the
    checkout's own folders)."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        for relative in DATA_FOLDERS:
            target = Path(self.build_lib) / "octavo" / "_data" / relative
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(HERE / relative, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))


class BdistWheel(bdist_wheel):
    def get_tag(self) -> tuple[str, str, str]:
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(
    distclass=BinaryDistribution,
    cmdclass={"build_ext": BuildOp, "build_py": BuildPy, "bdist_wheel": BdistWheel},
)
