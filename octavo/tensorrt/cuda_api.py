"""The few CUDA runtime calls octavo's TensorRT path makes, through cuda-python (import-guarded).

cuda-python is NVIDIA's official Python binding; since 12.6 its modules live in `cuda.bindings`, before
that in `cuda`. Every call returns (error, value...); `check` turns a non-success error into an exception.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

from octavo.errors import BackendUnavailableError


def import_cudart() -> ModuleType:
    """cuda-python's runtime module, or BackendUnavailableError saying how to get it."""
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart  # type: ignore[no-redef]  # older cuda-python
        except ImportError as exc:
            raise BackendUnavailableError(
                "cuda-python is not installed (pip install cuda-python on a machine with an NVIDIA GPU); "
                f"the TensorRT backend uses it for device memory and streams ({exc})"
            ) from exc
    return cudart


def check(result: Any, what: str) -> Any:  # noqa: ANN401
    """Unpack a cuda-python result tuple; raise on error. Returns the value (or tuple of values)."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA error {int(err)} ({getattr(err, 'name', err)}) in {what}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def compute_capability(cudart: ModuleType, device: int = 0) -> int:
    """e.g. 90 for H100/H200, 80 for A100, 89 for L4."""
    props = check(cudart.cudaGetDeviceProperties(device), "cudaGetDeviceProperties")
    return int(props.major) * 10 + int(props.minor)


def driver_cuda_version(cudart: ModuleType) -> str:
    """The CUDA version the installed driver supports, as "12.4"."""
    raw = int(check(cudart.cudaDriverGetVersion(), "cudaDriverGetVersion"))
    return f"{raw // 1000}.{(raw % 1000) // 10}"


def ptx_version_cap(driver_version: str) -> int | None:
    """PTX ISA cap for Triton so the driver can JIT the PTX TensorRT embeds; None = Triton's default is fine.

    Triton picks its PTX ISA from its bundled ptxas (CUDA 12.8 -> ISA 8.7 for triton 3.7.1); a driver
    older than that ptxas rejects the PTX at engine load, so the ISA is lowered to the driver's.
    """
    from triton.backends.nvidia.compiler import get_ptxas, ptx_get_version

    driver_isa = ptx_get_version(driver_version)
    default_isa = ptx_get_version(get_ptxas(90).version)
    return driver_isa if driver_isa < default_isa else None
