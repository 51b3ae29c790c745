"""--quant-kernel block-bf16 (octavo/export/quant_options.py): the block export whose BlockMatMul and
PagedAttention nodes carry prompt_bf16 = 1, so that a prompt's steps compute in bfloat16 on CPUs with AMX-BF16.

The numerics of those nodes are tested in test_block_matmul.py and test_op.py against float64 references over
bfloat16-rounded operands. Here: the export (attributes, manifest, cache folder, mismatch errors) and the real
SmolLM2 Q4_1 file answering through it as through the block export.
"""
from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from octavo.errors import ExportMismatchError
from octavo.export.quantize import QuantConfig

from test_gguf import SMOL  # noqa: F401

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, tuple[Path, object]]:  # noqa: ANN001
    from octavo.export import export_model

    out = {}
    for kernel in ("block", "block-bf16"):
        folder = tmp_path_factory.mktemp(kernel) / "model"
        out[kernel] = folder, export_model(SMOL, folder, progress=False, quant_kernel=kernel)
    return out


def _nodes(folder: Path, op_type: str) -> list[onnx.NodeProto]:
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    return [n for n in model.graph.node if n.op_type == op_type]


def test_block_bf16_marks_every_block_matmul_and_attention_node(exports) -> None:  # noqa: ANN001
    for kernel, (folder, manifest) in exports.items():
        want = [onnx.helper.make_attribute("prompt_bf16", 1)] if kernel == "block-bf16" else []
        for op_type, count in (("BlockMatMul", 30 * 4), ("PagedAttention", 30)):
            nodes = _nodes(folder, op_type)
            assert len(nodes) >= count, (kernel, op_type, len(nodes))
            for node in nodes:
                assert [a for a in node.attribute if a.name == "prompt_bf16"] == want, (kernel, node.name)
        entry = manifest.quantization  # type: ignore[attr-defined]
        assert entry["method"] == "BlockMatMul"
        assert entry.get("prompt_arithmetic") == ("bfloat16" if kernel == "block-bf16" else None)


def test_block_bf16_has_its_own_cache_folder_and_is_refused_for_a_block_export(exports) -> None:  # noqa: ANN001
    assert QuantConfig("gguf", kernel="block-bf16").cache_tag() == "gguf-block-bf16"
    assert QuantConfig("gguf", kernel="block").cache_tag() == "gguf-block"
    assert QuantConfig("int4", kernel="block-bf16").cache_tag() == "int4-b32-block-bf16"
    from octavo.export.resolve import resolve_model

    block, _ = exports["block"]
    bf16, _ = exports["block-bf16"]
    with pytest.raises(ExportMismatchError, match="exported with quant_kernel block, not 'block-bf16'"):
        resolve_model(block, quant_kernel="block-bf16")
    with pytest.raises(ExportMismatchError, match="exported with quant_kernel block-bf16, not 'block'"):
        resolve_model(bf16, quant_kernel="block")
    assert Path(resolve_model(bf16, quant_kernel="block-bf16")) == bf16


def test_block_bf16_answers_as_block_does(exports) -> None:  # noqa: ANN001
    """The prompt (a chat template of ~30 tokens: > 8 rows, so a prompt step) runs in bfloat16 where AMX runs;
    the greedy answer of this well-separated question stays the block export's."""
    from octavo import LLM, SamplingParams

    answers = {}
    for kernel, (folder, _) in exports.items():
        llm = LLM(str(folder), num_blocks=16)
        try:
            answers[kernel] = llm.chat(QUESTION, SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0].text
        finally:
            llm.close()
    assert "Paris" in answers["block-bf16"], answers
    assert answers["block-bf16"] == answers["block"], answers
