"""The kernel parameter list TensorRT's AOT plugin launch passes, and the PTX that declares exactly that list.

TensorRT launches an AOT plugin's kernel with one `kernelParams` entry per plugin input, per `SymInt32` extra and
per output, in that order: for `octavo::PagedAttention` 9 input pointers, 3 int32 extras, 3 output pointers = 15.
Triton >= 3.3 appends two pointers of its own to every kernel (global and profile scratch), so its PTX declares
17. If the launcher builds a 15-entry array for a 17-parameter entry, the driver reads two pointers past the
array's end. `plugin_ptx` removes those trailing declarations, only after checking the kernel body never names
them (it does not when the kernel needs no scratch memory, which `gpu_kernel.check_aot_launchable` also
asserts), so the PTX handed to TensorRT declares exactly the 15 parameters TensorRT passes.

Text only: no triton import (tests and `scripts/gpu_check.py` check compiled PTX with it).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from octavo.errors import OctavoError

# (PTX type of each parameter TensorRT passes) = 9 input pointers, 3 int32 extras, 3 output pointers
PLUGIN_PARAM_TYPES: tuple[str, ...] = ("u64",) * 9 + ("u32",) * 3 + ("u64",) * 3


class PtxAbiError(OctavoError):
    """The PTX's entry parameters cannot be made to match TensorRT's AOT launch (a kernel that uses Triton's
    scratch memory, a changed kernel signature)."""


@dataclass(slots=True, frozen=True)
class PtxParam:
    type: str  # "u64", "u32", ...
    name: str
    line: str  # the declaration line, as written


def _entry_span(ptx: str, kernel_name: str) -> tuple[int, int]:
    """(start, end) of the text between `.entry NAME(` and its closing parenthesis."""
    match = re.search(r"\.entry\s+" + re.escape(kernel_name) + r"\s*\(", ptx)
    if match is None:
        raise PtxAbiError(f"kernel {kernel_name!r} is not an .entry of this PTX")
    end = ptx.find(")", match.end())
    if end < 0:
        raise PtxAbiError(f"unterminated parameter list of .entry {kernel_name}")
    return match.end(), end


def entry_parameters(ptx: str, kernel_name: str) -> list[PtxParam]:
    """The `.param` declarations of KERNEL_NAME's entry, in order."""
    start, end = _entry_span(ptx, kernel_name)
    params = []
    for line in ptx[start:end].splitlines():
        words = line.strip().rstrip(",").split()
        if words and words[0] == ".param":
            params.append(PtxParam(type=words[1].lstrip("."), name=words[-1], line=line))
    return params


def strip_unused_trailing_parameters(ptx: str, kernel_name: str, keep: int) -> str:
    """PTX whose entry declares only its first KEEP parameters; the dropped ones must be unreferenced."""
    params = entry_parameters(ptx, kernel_name)
    if len(params) <= keep:
        return ptx
    start, end = _entry_span(ptx, kernel_name)
    body = ptx[end:]
    for param in params[keep:]:
        if re.search(r"\b" + re.escape(param.name) + r"\b", body):
            raise PtxAbiError(f"{kernel_name} reads its parameter {param.name} (Triton scratch memory?); TensorRT's "
                              f"AOT launch passes only {keep} parameters, so this kernel cannot be its plugin")
    kept = [p.line.rstrip().rstrip(",") for p in params[:keep]]
    declaration = "\n" + ",\n".join(kept) + "\n"
    return ptx[:start] + declaration + ptx[end:]


def plugin_ptx(ptx: str, kernel_name: str) -> str:
    """The PTX to hand TensorRT: exactly PLUGIN_PARAM_TYPES as the entry's parameters, or PtxAbiError."""
    stripped = strip_unused_trailing_parameters(ptx, kernel_name, keep=len(PLUGIN_PARAM_TYPES))
    types = tuple(p.type for p in entry_parameters(stripped, kernel_name))
    if types != PLUGIN_PARAM_TYPES:
        raise PtxAbiError(f"{kernel_name} declares parameters {list(types)}; TensorRT's AOT launch of "
                          f"octavo::PagedAttention passes {list(PLUGIN_PARAM_TYPES)} (inputs, int32 extras, outputs)")
    return stripped
