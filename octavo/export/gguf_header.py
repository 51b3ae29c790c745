"""Check a GGUF file's header against the file's size before any reader trusts it.

The `gguf` package's GGUFReader loops over every count the header declares (metadata entries, array
elements, tensors, dimensions) and slices its memory map with every declared length; slices past the end
are silently empty, so a 110-byte file declaring an array of 2**62 UINT8 makes it loop (and allocate)
without end. This walk reads the same layout with `struct` and refuses, in time proportional to the file's
real size, any count or length that cannot fit in the bytes that are left:

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count  x  (key: string, value_type u32, value)
    tensor_count x (name: string, n_dims u32, dims u64 x n_dims, ggml_type u32, offset u64)
    string = length u64 + bytes; array = element_type u32 + count u64 + elements

Only the shape of the header is checked here; GGUFReader still decodes it (and read_gguf checks the tensors'
data against the file's size afterwards).
"""
from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

from octavo.errors import ModelFormatError

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses more
MAX_ARRAY_DEPTH = 8  # arrays of arrays: GGUFReader recurses once per level
# GGUFValueType -> size in bytes of one value of a fixed-size type
FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
MIN_KV_BYTES = 8 + 4 + 1  # empty key, the type, the smallest value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # empty name, n_dims 0, type, offset


class _Walk:
    """A cursor over the header bytes that refuses to move past the end of the file."""

    __slots__ = ("buf", "pos", "end", "order", "name")

    def __init__(self, buf: bytes | mmap.mmap, order: str, name: str) -> None:
        self.buf, self.pos, self.end, self.order, self.name = buf, 0, len(buf), order, name

    def fail(self, what: str) -> ModelFormatError:
        return ModelFormatError(
            f"{self.name} is not a valid GGUF file: {what} (at byte {self.pos} of {self.end}); it is corrupt or "
            "was crafted: download or convert it again"
        )

    def left(self) -> int:
        return self.end - self.pos

    def skip(self, n: int, what: str) -> None:
        if n > self.left():
            raise self.fail(f"{what} declares {n} bytes but only {self.left()} are left in the file")
        self.pos += n

    def u32(self, what: str) -> int:
        return self._unpack("I", 4, what)

    def u64(self, what: str) -> int:
        return self._unpack("Q", 8, what)

    def _unpack(self, code: str, size: int, what: str) -> int:
        if size > self.left():
            raise self.fail(f"the file ends inside {what}")
        (value,) = struct.unpack_from(self.order + code, self.buf, self.pos)
        self.pos += size
        return int(value)

    def count(self, what: str, min_item_bytes: int) -> int:
        """A u64 count of items that each take at least MIN_ITEM_BYTES: refused when they cannot all fit."""
        n = self.u64(what)
        if n * min_item_bytes > self.left():
            raise self.fail(f"{what} is {n}, but {n} items of at least {min_item_bytes} bytes cannot fit in the "
                            f"{self.left()} bytes left")
        return n

    def string(self, what: str) -> None:
        self.skip(self.u64(f"the length of {what}"), what)

    def value(self, vtype: int, what: str, depth: int = 0) -> None:
        if vtype in FIXED_SIZES:
            self.skip(FIXED_SIZES[vtype], what)
        elif vtype == STRING:
            self.string(what)
        elif vtype == ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise self.fail(f"{what} nests arrays more than {MAX_ARRAY_DEPTH} deep")
            etype = self.u32(f"the element type of {what}")
            if etype in FIXED_SIZES:  # one bounds check for the whole array
                n = self.count(f"the element count of {what}", FIXED_SIZES[etype])
                self.skip(n * FIXED_SIZES[etype], what)
            elif etype == STRING:
                for _ in range(self.count(f"the element count of {what}", 8)):
                    self.string(f"a string in {what}")
            elif etype == ARRAY:
                for _ in range(self.count(f"the element count of {what}", 12)):
                    self.value(ARRAY, f"an array in {what}", depth + 1)
            else:
                raise self.fail(f"{what} has the unknown element type {etype}")
        else:
            raise self.fail(f"{what} has the unknown value type {vtype}")


def check_header(path: Path) -> list[tuple[str, int, int]]:
    """Raise ModelFormatError unless every count and length in PATH's GGUF header fits in the file; returns
    each tensor's (name, number of dimensions, GGML type id), read without decoding the metadata."""
    with path.open("rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size < 24:
            raise ModelFormatError(f"{path.name} is not a GGUF file: it is only {size} bytes")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:  # pages in only the header
            return check_header_bytes(buf, path.name)


def check_header_bytes(buf: bytes | mmap.mmap, name: str) -> list[tuple[str, int, int]]:
    """check_header over the file's bytes (a bytes object or a memory map)."""
    if len(buf) < 24 or buf[:4] != b"GGUF":
        raise ModelFormatError(f"{name} is not a GGUF file: it is {len(buf)} bytes and does not start with a "
                               "GGUF header")
    version = struct.unpack_from("<I", buf, 4)[0]
    order = "<"
    if version & 0xFFFF == 0:  # written for the other byte order (as GGUFReader detects it)
        order, version = ">", struct.unpack_from(">I", buf, 4)[0]
    if version not in SUPPORTED_VERSIONS:
        raise ModelFormatError(f"{name}: GGUF version {version} is not supported (versions "
                               f"{', '.join(map(str, SUPPORTED_VERSIONS))} are)")
    w = _Walk(buf, order, name)
    w.pos = 8
    tensor_count = w.u64("the tensor count")
    kv_count = w.count("the metadata entry count", MIN_KV_BYTES)
    if tensor_count * MIN_TENSOR_INFO_BYTES > w.left():
        raise w.fail(f"the tensor count is {tensor_count}, more than the file can describe")
    for i in range(kv_count):
        w.string(f"the key of metadata entry {i}")
        w.value(w.u32(f"the type of metadata entry {i}"), f"metadata entry {i}")
    if tensor_count * MIN_TENSOR_INFO_BYTES > w.left():  # again: the metadata used up bytes
        raise w.fail(f"the tensor count is {tensor_count}, more than the bytes left can describe")
    tensors: list[tuple[str, int, int]] = []
    for i in range(tensor_count):
        start = w.pos + 8
        w.string(f"the name of tensor {i}")
        tensor_name = bytes(buf[start:w.pos]).decode("utf-8", "replace")
        n_dims = w.u32(f"the dimension count of tensor {i}")
        if n_dims > MAX_DIMS:
            raise w.fail(f"tensor {i} declares {n_dims} dimensions (at most {MAX_DIMS})")
        w.skip(8 * n_dims, f"the shape of tensor {i}")
        tensors.append((tensor_name, n_dims, w.u32(f"the type of tensor {i}")))
        w.skip(8, f"the offset of tensor {i}")
    return tensors
