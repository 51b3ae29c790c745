"""Which op library octavo loads (octavo.runtime.backends.oplib): a native build, else the widest packaged build
this CPU runs, else a clear error (the real builds: tests/test_package.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from octavo.errors import OpLibraryError
from octavo.runtime.backends import oplib
from octavo.runtime.backends.oplib import LIBRARY_NAME, X86_64_V3, X86_64_V4, library_path, select_variant

AVX2 = frozenset(X86_64_V3.cpu_flags | {"sse2", "sse4_2"})
AVX512 = frozenset(X86_64_V4.cpu_flags | {"sse2"})


@pytest.fixture
def shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A library folder holding the two x86-64 packaged builds (empty files: only their names matter here)."""
    monkeypatch.setattr(oplib, "packaged_variants", lambda: (X86_64_V4, X86_64_V3))
    monkeypatch.delenv(oplib.LIBRARY_ENV, raising=False)
    for variant in (X86_64_V4, X86_64_V3):
        (tmp_path / variant.file_name).write_bytes(b"")
    monkeypatch.setattr(oplib, "library_dir", lambda: tmp_path)
    return tmp_path


def test_widest_build_the_cpu_runs(shipped: Path) -> None:
    assert select_variant(shipped, AVX512) == shipped / X86_64_V4.file_name
    assert select_variant(shipped, AVX2) == shipped / X86_64_V3.file_name
    assert select_variant(shipped, AVX2 | {"avx512f"}) == shipped / X86_64_V3.file_name  # v4 needs all five
    assert select_variant(shipped, None) == shipped / X86_64_V3.file_name  # unknown: the narrowest


def test_cpu_without_avx2_is_told_how_to_build(shipped: Path) -> None:
    with pytest.raises(OpLibraryError, match=r"lacks .*avx2.*python -m octavo.oplib_build"):
        select_variant(shipped, frozenset({"sse2", "avx", "fma"}))


def test_native_build_and_override_win(shipped: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(oplib, "cpu_flags", lambda: AVX512)
    assert library_path() == shipped / X86_64_V4.file_name
    (shipped / LIBRARY_NAME).write_bytes(b"")
    assert library_path() == shipped / LIBRARY_NAME
    other = tmp_path / "elsewhere.so"
    other.write_bytes(b"")
    monkeypatch.setenv(oplib.LIBRARY_ENV, str(other))
    assert library_path() == other
    monkeypatch.setenv(oplib.LIBRARY_ENV, str(tmp_path / "missing.so"))
    with pytest.raises(OpLibraryError, match="OCTAVO_OP_LIBRARY"):
        library_path()
