"""The external-data file (model.onnx.data): raw little-endian bytes appended tensor after tensor.

Each tensor starts at a page-aligned offset (ONNX Runtime can then map it instead of copying), and its
TensorProto only records (location, offset, length). Several arrays can be written back to back as one
tensor, which is how q/k/v and gate/up are fused without concatenating them in memory.
"""
from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import numpy as np
from onnx import TensorProto, helper

ALIGNMENT = 4096


class WeightsFile:
    """Append-only writer; use as a context manager."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: BinaryIO = path.open("wb")
        self._offset = 0
        self.bytes_written = 0

    def __enter__(self) -> "WeightsFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def add(self, name: str, parts: list[np.ndarray], dtype: str = "<f4") -> TensorProto:
        """Write PARTS (cast to DTYPE, float32 by default; same trailing shape) as one tensor along axis 0."""
        parts = [np.ascontiguousarray(p, dtype=dtype) for p in parts]
        trailing = parts[0].shape[1:]
        if any(p.shape[1:] != trailing for p in parts):
            raise ValueError(f"{name}: parts have different trailing shapes {[p.shape for p in parts]}")
        dims = [sum(p.shape[0] for p in parts), *trailing] if parts[0].ndim else []
        pad = -self._offset % ALIGNMENT
        if pad:
            self._file.write(b"\0" * pad)
            self._offset += pad
        start = self._offset
        for part in parts:
            if part.size:
                self._file.write(memoryview(part.reshape(-1)).cast("B"))
            self._offset += part.nbytes
        self.bytes_written = self._offset

        tensor = TensorProto()
        tensor.name = name
        tensor.data_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        tensor.dims.extend(int(d) for d in dims)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.path.name), ("offset", str(start)), ("length", str(self._offset - start))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        return tensor
