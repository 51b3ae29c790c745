"""Crafted GGUF files: every count and length in the header is checked against the file's size before the
`gguf` reader loops over it, so a tiny file declaring huge arrays/strings/tables is refused with a clear
ModelFormatError at once, under a memory cap, instead of allocating without end.

Each case runs `read_gguf` in a child process with RLIMIT_AS capped: the old code looped over 2**62
elements (MemoryError or the subprocess timeout); the check must answer in under a second."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from octavo.export.gguf_writer import write_gguf

U8, U32, STRING, ARRAY, U64 = 0, 4, 8, 9, 10
HUGE = 1 << 62


def _s(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _header(kv: list[bytes], tensors: list[bytes] = (), *, tensor_count: int | None = None,
            kv_count: int | None = None) -> bytes:
    n_t = len(tensors) if tensor_count is None else tensor_count
    n_kv = len(kv) if kv_count is None else kv_count
    return b"GGUF" + struct.pack("<IQQ", 3, n_t, n_kv) + b"".join(kv) + b"".join(tensors)


def _arch() -> bytes:
    return _s(b"general.architecture") + struct.pack("<I", STRING) + _s(b"llama")


CRAFTED = {
    # the attack run's file: an array of 2**62 UINT8 in 110 bytes
    "array_of_2e62_uint8": _header([_arch(), _s(b"x.big") + struct.pack("<IIQ", ARRAY, U8, HUGE) + b"\0" * 16]),
    "array_of_2e62_strings": _header([_s(b"x.big") + struct.pack("<IIQ", ARRAY, STRING, HUGE) + _s(b"a")]),
    "array_of_2e62_arrays": _header([_s(b"x.big") + struct.pack("<IIQ", ARRAY, ARRAY, HUGE)
                                     + struct.pack("<IQ", U8, 0)]),
    "string_of_2e62_bytes": _header([_s(b"x.s") + struct.pack("<IQ", STRING, HUGE) + b"abc"]),
    "key_of_2e62_bytes": _header([struct.pack("<Q", HUGE) + b"k" * 20]),
    "2e62_metadata_entries": _header([_arch()], kv_count=HUGE),
    "2e62_tensors": _header([_arch()], tensor_count=HUGE),
    "tensor_with_2e31_dims": _header([_arch()], [_s(b"t") + struct.pack("<I", 1 << 31) + b"\0" * 32]),
    "arrays_nested_10000_deep": _header([_s(b"x.n") + struct.pack("<I", ARRAY)
                                         + struct.pack("<IQ", ARRAY, 1) * 10_000 + struct.pack("<IQ", U8, 0)]),
    "unknown_value_type": _header([_s(b"x.t") + struct.pack("<I", 77) + b"\0" * 8]),
    "truncated_in_the_counts": b"GGUF" + struct.pack("<IQ", 3, 0) + b"\0\0",
}

CHILD = r"""
import json, resource, sys, time
from octavo.export.gguf_reader import read_gguf
from octavo.errors import ModelFormatError
cap = 2 << 30
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
t0 = time.monotonic()
try:
    read_gguf(sys.argv[1])
    out = {"error": None}
except ModelFormatError as exc:
    out = {"error": "ModelFormatError", "message": str(exc)}
except BaseException as exc:
    out = {"error": type(exc).__name__, "message": str(exc)[:300]}
out["seconds"] = time.monotonic() - t0
print(json.dumps(out))
"""


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_gguf_is_refused_at_once_under_a_memory_cap(tmp_path: Path, case: str) -> None:
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(CRAFTED[case])
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}: reading a {path.stat().st_size}-byte GGUF ran for over 60 s")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["error"] == "ModelFormatError", out
    assert path.name in out["message"] and "GGUF" in out["message"], out
    assert out["seconds"] < 1.0, out


def test_valid_gguf_files_still_pass_the_header_check(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    """The check accepts what the project's writer (and llama.cpp's layout) produces: arrays of strings
    (the vocabulary), of ints (token types) and of floats (merges' scores), and every tensor."""
    from octavo.export.gguf_header import check_header
    from octavo.export.gguf_reader import read_gguf

    path = tmp_path / "tiny.gguf"
    write_gguf(hf_model_dir("llama"), path)
    check_header(path)
    ckpt = read_gguf(path)
    assert ckpt.config["num_hidden_layers"] >= 1
