"""octavo.tensorrt.ptx_abi: the PTX handed to TensorRT declares exactly the 15 parameters its AOT launch passes
(9 input pointers, 3 int32 extras, 3 output pointers). The compiled kernel's PTX is checked in
tests/test_triton_kernel.py (and assembled by ptxas); here the text rules, on PTX written like Triton's."""
from __future__ import annotations

import pytest

from octavo.tensorrt.ptx_abi import PLUGIN_PARAM_TYPES, PtxAbiError, entry_parameters, plugin_ptx

NAME = "_paged_attention_kernel"


def _ptx(types: list[str], body: str = "\tret;\n") -> str:
    lines = []
    for i, t in enumerate(types):
        pointer = " .ptr .global .align 1" if t == "u64" else ""
        lines.append(f"\t.param .{t}{pointer} {NAME}_param_{i}")
    params = ",\n".join(lines)
    return (f".version 8.7\n.target sm_90a\n.address_size 64\n\n.visible .entry {NAME}(\n{params}\n)\n"
            f".reqntid 128\n{{\n\tld.param.u64 %rd1, [{NAME}_param_0];\n{body}}}\n")


TRITON_TYPES = list(PLUGIN_PARAM_TYPES) + ["u64", "u64"]  # + global and profile scratch


def test_trailing_scratch_parameters_are_removed_and_the_rest_kept() -> None:
    ptx = _ptx(TRITON_TYPES)
    out = plugin_ptx(ptx, NAME)
    params = entry_parameters(out, NAME)
    assert [p.type for p in params] == list(PLUGIN_PARAM_TYPES)
    assert [p.name for p in params] == [f"{NAME}_param_{i}" for i in range(15)]
    assert f"{NAME}_param_14\n)" in out  # no dangling comma before the closing parenthesis
    assert out[out.index(".reqntid"):] == ptx[ptx.index(".reqntid"):]  # the body is untouched


def test_a_kernel_that_reads_a_scratch_parameter_is_refused() -> None:
    ptx = _ptx(TRITON_TYPES, body=f"\tld.param.u64 %rd2, [{NAME}_param_15];\n\tret;\n")
    with pytest.raises(PtxAbiError, match="reads its parameter _paged_attention_kernel_param_15"):
        plugin_ptx(ptx, NAME)


def test_a_changed_signature_is_refused() -> None:
    types = list(PLUGIN_PARAM_TYPES)
    types[10] = "u64"  # an extra that became a pointer
    with pytest.raises(PtxAbiError, match="declares parameters"):
        plugin_ptx(_ptx(types), NAME)
    with pytest.raises(PtxAbiError, match="declares parameters"):
        plugin_ptx(_ptx(list(PLUGIN_PARAM_TYPES[:14])), NAME)  # one too few


def test_ptx_of_an_older_triton_without_scratch_is_unchanged() -> None:
    ptx = _ptx(list(PLUGIN_PARAM_TYPES))
    assert plugin_ptx(ptx, NAME) == ptx


def test_unknown_entry_is_an_error() -> None:
    with pytest.raises(PtxAbiError, match="not an .entry"):
        plugin_ptx(_ptx(TRITON_TYPES), "other_kernel")
