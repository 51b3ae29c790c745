"""Stand-in for `cuda.bindings.runtime`: "device" memory is host memory (ctypes buffers), 256-byte
aligned like cudaMalloc; every call returns (error, value...) like cuda-python."""
from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass

ALIGNMENT = 256
TOTAL_BYTES = 1 << 30


class cudaError_t(enum.IntEnum):  # noqa: N801 - cuda-python's name
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2
    cudaErrorInvalidDevicePointer = 17


class cudaMemcpyKind(enum.IntEnum):  # noqa: N801
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3


@dataclass
class cudaDeviceProp:  # noqa: N801
    major: int = 9
    minor: int = 0
    name: bytes = b"stand-in sm_90"


_allocations: dict[int, ctypes.Array] = {}  # aligned address -> owning buffer (kept alive)
_sizes: dict[int, int] = {}


def _owns(ptr: int, nbytes: int) -> bool:
    return any(base <= ptr and ptr + nbytes <= base + size for base, size in _sizes.items())


def cudaSetDevice(device: int):  # noqa: N802, ANN201
    return (cudaError_t.cudaSuccess,) if device == 0 else (cudaError_t.cudaErrorInvalidValue,)


def cudaGetDeviceProperties(device: int):  # noqa: N802, ANN201
    return cudaError_t.cudaSuccess, cudaDeviceProp()


def cudaDriverGetVersion():  # noqa: N802, ANN201
    return cudaError_t.cudaSuccess, 12080


def cudaMemGetInfo():  # noqa: N802, ANN201
    used = sum(_sizes.values())
    return cudaError_t.cudaSuccess, TOTAL_BYTES - used, TOTAL_BYTES


def cudaMalloc(nbytes: int):  # noqa: N802, ANN201
    if nbytes > TOTAL_BYTES - sum(_sizes.values()):
        return cudaError_t.cudaErrorMemoryAllocation, 0
    buffer = (ctypes.c_char * (nbytes + ALIGNMENT))()
    ptr = -(-ctypes.addressof(buffer) // ALIGNMENT) * ALIGNMENT
    _allocations[ptr], _sizes[ptr] = buffer, nbytes
    return cudaError_t.cudaSuccess, ptr


def cudaFree(ptr: int):  # noqa: N802, ANN201
    if ptr not in _allocations:
        return (cudaError_t.cudaErrorInvalidDevicePointer,)
    del _allocations[ptr], _sizes[ptr]
    return (cudaError_t.cudaSuccess,)


def cudaMemset(ptr: int, value: int, nbytes: int):  # noqa: N802, ANN201
    if not _owns(ptr, nbytes):
        return (cudaError_t.cudaErrorInvalidDevicePointer,)
    ctypes.memset(ptr, value, nbytes)
    return (cudaError_t.cudaSuccess,)


def cudaMemcpy(dst: int, src: int, nbytes: int, kind: cudaMemcpyKind):  # noqa: N802, ANN201
    device_side = {cudaMemcpyKind.cudaMemcpyHostToDevice: (dst,), cudaMemcpyKind.cudaMemcpyDeviceToHost: (src,),
                   cudaMemcpyKind.cudaMemcpyDeviceToDevice: (dst, src)}[kind]
    if not all(_owns(p, nbytes) for p in device_side):
        return (cudaError_t.cudaErrorInvalidValue,)
    ctypes.memmove(dst, src, nbytes)
    return (cudaError_t.cudaSuccess,)


def cudaMemcpyAsync(dst: int, src: int, nbytes: int, kind: cudaMemcpyKind, stream: int):  # noqa: N802, ANN201
    return cudaMemcpy(dst, src, nbytes, kind)


def cudaStreamCreate():  # noqa: N802, ANN201
    return cudaError_t.cudaSuccess, 1


def cudaStreamSynchronize(stream: int):  # noqa: N802, ANN201
    return (cudaError_t.cudaSuccess,)


def cudaStreamDestroy(stream: int):  # noqa: N802, ANN201
    return (cudaError_t.cudaSuccess,)
