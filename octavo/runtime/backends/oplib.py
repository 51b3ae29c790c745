"""Where the ONNX Runtime custom-op library (octavo.PagedAttention) lives once built, and which build this CPU runs.

Two kinds of build sit in octavo/_lib/:
- `liboctavo_ort.so`: built on this machine for this CPU (`make op`, `python -m octavo.oplib_build`, an editable
  install). When present it is used.
- `liboctavo_ort.<variant>.so`: the portable builds a wheel ships (octavo.oplib_build.build_packaged): on x86-64 one
  for AVX2 + FMA + F16C (x86-64-v3) and one for AVX-512 (x86-64-v4); elsewhere one with the compiler's defaults.
  The widest one this CPU runs is chosen at load time from the CPU's feature flags.
`$OCTAVO_OP_LIBRARY` names a library to use instead of either (benchmarks, a build kept elsewhere).

The library's one process-wide switch, its AMX paths on or off (amx.h's octavo_set_amx), is set through set_amx.
"""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

from octavo.errors import OpLibraryError
from octavo.runtime.backends.op_variants import (  # noqa: F401 - re-exported: this module is where callers look
    GENERIC,
    LIBRARY_NAME,
    X86_64_V3,
    X86_64_V4,
    Variant,
    cpu_flags,
    library_dir,
    packaged_variants,
)

LIBRARY_ENV = "OCTAVO_OP_LIBRARY"


def select_variant(folder: Path, flags: frozenset[str] | None) -> Path | None:
    """The widest packaged build in FOLDER this CPU runs; None when FOLDER holds none.

    Unknown flags (no /proc/cpuinfo) pick the narrowest build; the library itself refuses to register on a CPU
    that lacks what it was compiled for, with a clear error instead of an illegal instruction."""
    shipped = [v for v in packaged_variants() if (folder / v.file_name).is_file()]
    if not shipped:
        return None
    if flags is None:
        return folder / shipped[-1].file_name
    for variant in shipped:
        if not variant.missing(flags):
            return folder / variant.file_name
    narrowest = shipped[-1]
    raise OpLibraryError(
        f"this CPU lacks {', '.join(narrowest.missing(flags))}, which the packaged custom-op builds need "
        f"(the narrowest, {narrowest.name}, needs AVX2/FMA/F16C): build one for this CPU with "
        "`python -m octavo.oplib_build` (needs g++ and ONNX Runtime's headers, docs/install.md)"
    )


def library_path() -> Path:
    """Path of the custom-op library to load (register it with SessionOptions.register_custom_ops_library)."""
    override = os.environ.get(LIBRARY_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise OpLibraryError(f"${LIBRARY_ENV}={override} is not a file; unset it or point it at a built "
                                 f"{LIBRARY_NAME}")
        return path
    folder = library_dir()
    native = folder / LIBRARY_NAME
    if native.is_file():
        return native
    packaged = select_variant(folder, cpu_flags())
    if packaged is not None:
        return packaged
    raise OpLibraryError(
        f"the ONNX Runtime custom-op library {native} is not built: run `make op` "
        "(or `python -m octavo.oplib_build`)"
    )


AMX_SWITCH = "octavo_set_amx"  # the library's exported switch (plugins/onnxruntime/amx.h)


def set_amx(enabled: bool, path: Path | None = None) -> bool:
    """Switch the AMX paths of the library at PATH (default: library_path()) on or off for this process; returns
    the switch's previous state. Off, every node computes what it computes on a CPU without AMX
    (docs/quantization.md); on, AMX runs where the CPU has it (the library's default). The library is loaded into
    the process if ONNX Runtime has not loaded it yet: the same copy its sessions run, so the switch holds for
    every session of the process."""
    path = path or library_path()
    switch = _amx_switch(str(path))
    if switch is None:  # a library from before the switch: AMX on is all it does
        if not enabled:
            raise OpLibraryError(f"the custom-op library {path} has no AMX switch ({AMX_SWITCH}): it was built "
                                 "from older sources. Rebuild it with `make op` (or `python -m octavo.oplib_build`), or "
                                 "reinstall octavo")
        return True
    return bool(switch(1 if enabled else 0))


@functools.cache
def _amx_switch(path: str) -> ctypes._CFuncPtr | None:
    try:
        switch = getattr(ctypes.CDLL(path), AMX_SWITCH)
    except AttributeError:
        return None
    switch.argtypes = [ctypes.c_int]
    switch.restype = ctypes.c_int
    return switch
