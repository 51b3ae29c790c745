"""Malformed and hostile export folders: every one is refused with an octavo.errors class whose message
names the problem, through `LLM(...)` and through `octavo serve` (exit status 1 and the message).
Nothing outside the folder is ever read: file names in octavo.json, symlinks and the ONNX file's
external-data location that point out of the folder are refused (UnsafePathError)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
from engine_helpers import exported

from octavo import LLM
from octavo.errors import ModelFormatError, UnsafePathError


@pytest.fixture(scope="module")
def good(hf_model_dir) -> Path:  # noqa: ANN001
    return exported(hf_model_dir("llama"))


def _manifest(folder: Path, **changes: object) -> None:
    path = folder / "octavo.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _truncate(name: str, keep: float) -> Callable[[Path], None]:
    def f(folder: Path) -> None:
        p = folder / name
        p.write_bytes(p.read_bytes()[: int(p.stat().st_size * keep)])
    return f


def _outside(folder: Path) -> Path:
    """A file outside the folder that a careless loader would happily read."""
    secret = folder.parent / f"{folder.name}-outside"
    secret.mkdir(exist_ok=True)
    return secret


def _symlink_out(name: str) -> Callable[[Path], None]:
    def f(folder: Path) -> None:
        target = _outside(folder) / name
        shutil.copy(folder / name, target)
        (folder / name).unlink()
        (folder / name).symlink_to(target)
    return f


def _manifest_file_out(field: str, name: str) -> Callable[[Path], None]:
    def f(folder: Path) -> None:
        shutil.copy(folder / name, _outside(folder) / name)
        _manifest(folder, **{field: f"../{folder.name}-outside/{name}"})
    return f


def _external_data_out(folder: Path) -> None:
    """model.onnx names its weights file by a path that leaves the folder."""
    shutil.move(folder / "model.onnx.data", _outside(folder) / "model.onnx.data")
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = f"../{folder.name}-outside/model.onnx.data"
    onnx.save(model, folder / "model.onnx")


def _absolute_external_data(folder: Path) -> None:
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = str((folder / "model.onnx.data").resolve())
    onnx.save(model, folder / "model.onnx")


# (id, how to break the folder, expected error class, words the message must contain)
CASES: list[tuple[str, Callable[[Path], None], type[Exception], str]] = [
    ("no-manifest", lambda f: (f / "octavo.json").unlink(), ModelFormatError, "not"),
    ("manifest-not-json", lambda f: (f / "octavo.json").write_text("{nope"), ModelFormatError, "JSON"),
    ("manifest-binary", lambda f: (f / "octavo.json").write_bytes(b"\xff\xfe\x00\x01"), ModelFormatError, "octavo.json"),
    ("manifest-list", lambda f: (f / "octavo.json").write_text("[1, 2]"), ModelFormatError, "manifest"),
    ("manifest-newer", lambda f: _manifest(f, format_version=99), ModelFormatError, "Upgrade"),
    ("manifest-older", lambda f: _manifest(f, format_version=0), ModelFormatError, "Re-export"),
    ("manifest-version-string", lambda f: _manifest(f, format_version="1"), ModelFormatError, "version"),
    ("manifest-unknown-field", lambda f: _manifest(f, evil=True), ModelFormatError, "unknown"),
    ("manifest-missing-field", lambda f: (f / "octavo.json").write_text(json.dumps(
        {k: v for k, v in json.loads((f / "octavo.json").read_text()).items() if k != "num_layers"})),
     ModelFormatError, "num_layers"),
    ("onnx-missing", lambda f: (f / "model.onnx").unlink(), ModelFormatError, "model.onnx"),
    ("onnx-truncated", _truncate("model.onnx", 0.5), ModelFormatError, "model.onnx"),
    ("onnx-garbage", lambda f: (f / "model.onnx").write_bytes(os.urandom(4096)), ModelFormatError, "model.onnx"),
    ("weights-truncated", _truncate("model.onnx.data", 0.5), ModelFormatError, "model.onnx"),
    ("weights-missing", lambda f: (f / "model.onnx.data").unlink(), ModelFormatError, "model.onnx"),
    ("kv-heads-mismatch", lambda f: _manifest(f, num_kv_heads=1), ModelFormatError, "shape"),
    ("head-dim-mismatch", lambda f: _manifest(f, head_dim=8), ModelFormatError, "shape"),
    ("layers-mismatch", lambda f: _manifest(f, num_layers=3), ModelFormatError, "layers"),
    ("vocab-mismatch", lambda f: _manifest(f, vocab_size=500), ModelFormatError, "logits"),
    ("tokenizer-missing", lambda f: (f / "tokenizer.json").unlink(), ModelFormatError, "tokenizer"),
    ("tokenizer-garbage", lambda f: (f / "tokenizer.json").write_text('{"model": 7}'), ModelFormatError, "tokenizer"),
    ("tokenizer-truncated", _truncate("tokenizer.json", 0.5), ModelFormatError, "tokenizer"),
    ("manifest-onnx-escapes", _manifest_file_out("onnx_file", "model.onnx"), UnsafePathError, "onnx_file"),
    ("manifest-onnx-absolute", lambda f: _manifest(f, onnx_file=str((f / "model.onnx").resolve())), UnsafePathError,
     "onnx_file"),
    ("manifest-tokenizer-escapes", _manifest_file_out("tokenizer_file", "tokenizer.json"), UnsafePathError,
     "tokenizer_file"),
    ("manifest-template-escapes", _manifest_file_out("chat_template_file", "chat_template.jinja"), UnsafePathError,
     "chat_template_file"),
    ("manifest-weights-escapes", lambda f: _manifest(f, weights_file="../../etc/passwd"), UnsafePathError,
     "weights_file"),
    ("symlink-onnx-out", _symlink_out("model.onnx"), UnsafePathError, "model.onnx"),
    ("symlink-weights-out", _symlink_out("model.onnx.data"), UnsafePathError, "model.onnx.data"),
    ("symlink-tokenizer-out", _symlink_out("tokenizer.json"), UnsafePathError, "tokenizer.json"),
    ("symlink-template-out", _symlink_out("chat_template.jinja"), UnsafePathError, "chat_template.jinja"),
    ("external-data-escapes", _external_data_out, ModelFormatError, "model.onnx"),
    ("external-data-absolute", _absolute_external_data, ModelFormatError, "model.onnx"),
]


def broken_copy(good: Path, tmp_path: Path, breaker: Callable[[Path], None]) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(good, folder)
    breaker(folder)
    return folder


@pytest.mark.parametrize("case, breaker, exc, words", CASES, ids=[c[0] for c in CASES])
def test_llm_refuses_with_a_clear_error(good: Path, tmp_path: Path, case: str, breaker, exc, words: str) -> None:  # noqa: ANN001
    folder = broken_copy(good, tmp_path, breaker)
    with pytest.raises(exc) as info:
        LLM(str(folder), num_blocks=8, num_threads=1)
    msg = str(info.value)
    assert words.lower() in msg.lower(), msg
    assert "Traceback" not in msg and len(msg) < 2000


def test_symlink_inside_the_folder_is_fine(good: Path, tmp_path: Path) -> None:
    folder = broken_copy(good, tmp_path, lambda f: None)
    (folder / "tok-real.json").write_bytes((folder / "tokenizer.json").read_bytes())
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to("tok-real.json")
    llm = LLM(str(folder), num_blocks=8, num_threads=1)
    assert llm.get_tokenizer().encode("Hello")
    llm.close()


def test_folder_given_through_a_symlink_is_fine(good: Path, tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(good)
    llm = LLM(str(tmp_path / "link"), num_blocks=8, num_threads=1)
    llm.close()


@pytest.mark.parametrize("case", ["onnx-truncated", "manifest-onnx-escapes"])
def test_serve_exits_nonzero_with_the_message(good: Path, tmp_path: Path, case: str) -> None:
    _, breaker, exc, words = next(c for c in CASES if c[0] == case)
    folder = broken_copy(good, tmp_path, breaker)
    proc = subprocess.run([sys.executable, "-m", "octavo", "serve", str(folder), "--port", "0", "--num-blocks", "8",
                           "--num-threads", "1"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("octavo serve: error:")), "")
    assert re.search(exc.__name__, line) and words.lower() in line.lower(), (proc.stdout[-2000:], proc.stderr[-1000:])


def _stays_inside(folder: Path, rel: str) -> bool:
    """Independent reference for octavo.export.paths.inside: os.path.realpath + commonpath."""
    if os.path.isabs(rel):
        return False
    real, root = os.path.realpath(folder / rel), os.path.realpath(folder)
    return ".." not in Path(rel).parts and os.path.commonpath([real, root]) == root


@pytest.mark.parametrize("rel", ["model.onnx", "sub/model.onnx", "missing.bin", "link-in", "link-out",
                                 "dir-out/model.onnx", "dir-out/not-there", "dir-in/x", "../model/model.onnx",
                                 "sub/../model.onnx", "/etc/passwd", "./model.onnx"])
def test_inside_agrees_with_realpath(tmp_path: Path, rel: str) -> None:
    """The one path check (octavo.export.paths.inside, used by the manifest and the HF reader) against
    os.path.realpath: symlinked files and parent folders pointing out, '..' even when it lands back
    inside, absolute names, files that do not exist yet."""
    from octavo.export.paths import inside

    folder, outside = tmp_path / "model", tmp_path / "outside"
    (folder / "sub").mkdir(parents=True)
    outside.mkdir()
    for base in (folder, folder / "sub", outside):
        (base / "model.onnx").write_bytes(b"x")
    (folder / "link-in").symlink_to("sub/model.onnx")
    (folder / "link-out").symlink_to(outside / "model.onnx")
    (folder / "dir-out").symlink_to(outside, target_is_directory=True)
    (folder / "dir-in").symlink_to("sub", target_is_directory=True)
    if _stays_inside(folder, rel):
        assert inside(folder, rel) == folder / rel
    else:
        with pytest.raises(UnsafePathError, match="outside the model folder"):
            inside(folder, rel, subject="onnx_file")


def test_inside_refuses_a_symlink_loop_and_allows_the_hub_blobs(tmp_path: Path) -> None:
    from octavo.export.hf_reader import safe_path
    from octavo.export.paths import inside

    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(UnsafePathError):
        inside(tmp_path, "a")
    with pytest.raises(UnsafePathError, match="must be a file name"):
        inside(tmp_path, "")
    # HF hub cache: snapshots/<rev>/* link into the repository's blobs/, and only there
    repo = tmp_path / "models--org--name"
    snapshot, blobs = repo / "snapshots" / "abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    (blobs / "1234").write_text("{}")
    (snapshot / "config.json").symlink_to(blobs / "1234")
    (tmp_path / "secret").write_text("{}")
    (snapshot / "tokenizer.json").symlink_to(tmp_path / "secret")
    assert safe_path(snapshot, "config.json") == snapshot / "config.json"
    with pytest.raises(UnsafePathError, match="symlink pointing out"):
        safe_path(snapshot, "tokenizer.json")
    with pytest.raises(UnsafePathError, match="symlink pointing out"):
        inside(snapshot, "config.json")  # without also_allowed the blobs are outside
