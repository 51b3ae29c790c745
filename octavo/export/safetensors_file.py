"""One .safetensors file, read lazily through a memory map, with its header checked against its size.

Format: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}},
then the data. A file cut short (interrupted download) is caught here with a message naming it,
instead of a crash or garbage weights later.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from octavo.errors import ModelFormatError

_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # converted by shifting into the high half of a float32
    "F64": np.dtype("<f8"),
}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(slots=True, frozen=True)
class _Entry:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsFile:
    """Header parsed and validated at open; tensors are memory-mapped on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries = self._read_header(path)
        self._map: np.memmap | None = None

    def _read_header(self, path: Path) -> dict[str, _Entry]:
        size = path.stat().st_size
        hint = "the file is truncated or corrupt; download it again"
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ModelFormatError(f"{path}: only {size} bytes, too short for a safetensors header; {hint}")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(_MAX_HEADER, size - 8):
                raise ModelFormatError(
                    f"{path}: header claims {header_len} bytes but the file has {size}; {hint}"
                )
            try:
                header = json.loads(f.read(header_len))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ModelFormatError(f"{path}: safetensors header is not valid JSON ({exc}); {hint}") from exc
        if not isinstance(header, dict):
            raise ModelFormatError(f"{path}: safetensors header is not a JSON object; {hint}")
        self._header_len = header_len
        data_size = size - 8 - header_len
        entries: dict[str, _Entry] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape, (begin, end) = str(info["dtype"]), tuple(int(d) for d in info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError) as exc:
                raise ModelFormatError(f"{path}: malformed header entry for {name!r}; {hint}") from exc
            if dtype not in _DTYPES:
                raise ModelFormatError(
                    f"{path}: tensor {name!r} has dtype {dtype}; octavo reads F32, F16, BF16 and F64 "
                    f"safetensors (quantized safetensors are not supported; GGUF files are)"
                )
            expected = int(np.prod(shape, dtype=np.int64)) * _DTYPES[dtype].itemsize
            if not (0 <= begin <= end) or end - begin != expected:
                raise ModelFormatError(f"{path}: tensor {name!r} has inconsistent offsets; {hint}")
            if end > data_size:
                raise ModelFormatError(
                    f"{path}: tensor {name!r} ends at byte {8 + header_len + end} but the file has only "
                    f"{size} bytes; {hint}"
                )
            entries[name] = _Entry(dtype, shape, int(begin), int(end))
        return entries

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def get(self, name: str) -> np.ndarray:
        """The tensor as float32 (a zero-copy view of the mapped file when it is stored as F32)."""
        entry = self._entries[name]
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        start = 8 + self._header_len
        raw = self._map[start + entry.begin : start + entry.end]
        array = raw.view(_DTYPES[entry.dtype]).reshape(entry.shape)
        if entry.dtype == "F32":
            return array
        if entry.dtype == "BF16":
            return (array.astype(np.uint32) << 16).view(np.float32)
        return array.astype(np.float32)
