"""The export folder's shape: the graph contract, the manifest, tokenizer files, weights storage, the
safetensors dtypes, resolve_model's cache, and the SmolLM2 GGUF end to end."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from octavo.export import export_model
from octavo.export.graph import STEP_INPUTS, cache_input_names
from octavo.export.manifest import Manifest
from octavo.export.resolve import resolve_model

@pytest.fixture(scope="module")
def mistral_export(hf_model_dir, tmp_path_factory) -> tuple[Path, Manifest]:  # noqa: ANN001
    out = tmp_path_factory.mktemp("mistral") / "model"
    return out, export_model(hf_model_dir("mistral"), out, progress=False)


def test_graph_follows_the_contract(mistral_export: tuple[Path, Manifest]) -> None:
    out, manifest = mistral_export
    model = onnx.load(out / "model.onnx", load_external_data=False)
    graph = model.graph
    assert [i.name for i in graph.input] == [n for n, _, _ in STEP_INPUTS] + cache_input_names(manifest.num_layers)
    assert [o.name for o in graph.output] == ["logits"]
    attention = [n for n in graph.node if (n.domain, n.op_type) == ("octavo", "PagedAttention")]
    assert len(attention) == manifest.num_layers == 2
    for layer, node in enumerate(attention):
        assert list(node.input[3:]) == [
            f"key_cache.{layer}", f"value_cache.{layer}", "cumulative_sequence_length", "past_seqlens",
            "block_table", "slot_mapping",
        ]
        assert len(node.output) == 3
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["num_heads"] == 4 and attrs["kv_num_heads"] == 1 and attrs["sliding_window"] == 24
        assert attrs["scale"] == pytest.approx(16 ** -0.5)
    # logits only for the gathered rows: the last Gather (over logits_indices) comes before the lm_head
    gathers = [n for n in graph.node if n.op_type == "Gather" and "logits_indices" in n.input]
    assert len(gathers) == 1
    # all weights in ONE external file; no tracing leftovers
    locations = {
        e.value for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
        for e in t.external_data if e.key == "location"
    }
    assert locations == {"model.onnx.data"}
    assert (out / "model.onnx").stat().st_size < 64 * 1024


def test_manifest_and_tokenizer_files(mistral_export: tuple[Path, Manifest], hf_model_dir) -> None:  # noqa: ANN001
    from tokenizers import Tokenizer

    out, manifest = mistral_export
    assert Manifest.load(out) == manifest
    assert (manifest.architecture, manifest.sliding_window, manifest.num_kv_heads, manifest.head_dim) == ("mistral", 24, 1, 16)
    assert manifest.eos_token_ids == [2] and manifest.bos_token_id == 1
    source = hf_model_dir("mistral")
    text = "Héllo wörld, the quick brown fox"
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode(text).ids == \
        Tokenizer.from_file(str(source / "tokenizer.json")).encode(text).ids
    template = json.loads((source / "tokenizer_config.json").read_text())["chat_template"]
    assert (out / "chat_template.jinja").read_text() == template


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_safetensors_are_widened(tmp_path: Path, dtype: str) -> None:
    import torch
    from safetensors.torch import save_file

    from octavo.export.safetensors_file import SafetensorsFile

    tensor = torch.randn(3, 5).to(getattr(torch, dtype))
    save_file({"w": tensor}, tmp_path / "x.safetensors")
    got = SafetensorsFile(tmp_path / "x.safetensors").get("w")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, tensor.float().numpy())


def test_llama3_and_linear_inv_freq_match_transformers() -> None:
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from octavo.export.rope import inv_freq

    for scaling in (
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192},
        {"rope_type": "linear", "factor": 4.0},
    ):
        config = LlamaConfig(hidden_size=512, num_attention_heads=4, rope_parameters={"rope_theta": 500000.0, **scaling})
        expected, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, torch.device("cpu"))
        np.testing.assert_allclose(inv_freq(500000.0, 128, scaling), expected.numpy(), rtol=2e-6)


def test_resolve_model_exports_once_into_the_cache(hf_model_dir, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("OCTAVO_CACHE", str(tmp_path / "cache"))
    source = hf_model_dir("tied")
    first = resolve_model(source, progress=False)
    assert first.parent == tmp_path / "cache" and first.name.startswith(source.name)
    stamp = (first / "model.onnx").stat().st_mtime_ns
    assert resolve_model(source, progress=False) == first
    assert (first / "model.onnx").stat().st_mtime_ns == stamp, "exported twice"
    assert resolve_model(first) == first  # an export folder is returned as is


@pytest.mark.slow  # ~7 s export + reads a 100 MB GGUF; slower on a busy machine
def test_smollm2_gguf_exports_and_answers(tmp_path: Path) -> None:
    """The real pretrained demo model: GGUF -> export -> greedy answer through the backend."""
    pytest.importorskip("octavo.export.gguf_reader")
    from octavo.export.embedded import default_model_path
    from octavo.errors import ModelFormatError

    try:
        gguf = default_model_path()
    except ModelFormatError as exc:
        pytest.skip(str(exc))
    import jinja2
    from step_inputs import one_sequence
    from tokenizers import Tokenizer

    from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend

    manifest = export_model(gguf, tmp_path / "smol", progress=False)  # its time is a benchmark's, not a test's
    assert (manifest.num_layers, manifest.tie_word_embeddings) == (30, True)

    folder = tmp_path / "smol"
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    prompt = jinja2.Template((folder / "chat_template.jinja").read_text()).render(
        messages=[{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    backend = OnnxRuntimeBackend(folder, manifest, num_blocks=8, block_size=16, num_threads=2)
    table = np.random.default_rng(0).permutation(8).astype(np.int32)[None]
    past, new, answer = 0, ids, []
    for _ in range(8):
        logits = backend.run(one_sequence(new, past, table, 16))
        past += len(new)
        new = [int(logits[0].argmax())]
        answer += new
    backend.close()
    assert "Paris" in tokenizer.decode(answer)


def test_sharded_checkpoint_exports_the_same_weights(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    """A checkpoint saved in shards (model.safetensors.index.json) gives byte-identical weights."""
    from models import load_hf

    source = hf_model_dir("qwen2")
    model, tokenizer = load_hf(source)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    tokenizer.save_pretrained(sharded)
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 1
    export_model(source, tmp_path / "a", progress=False)
    export_model(sharded, tmp_path / "b", progress=False)
    assert (tmp_path / "a" / "model.onnx.data").read_bytes() == (tmp_path / "b" / "model.onnx.data").read_bytes()


def test_hf_hub_cache_layout_with_blob_symlinks(hf_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    """models--X/snapshots/<rev>/* link into models--X/blobs/: allowed, unlike other links out."""
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, path in enumerate(sorted(hf_model_dir("llama").iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        blob.write_bytes(path.read_bytes())
        (snapshot / path.name).symlink_to(Path("../../blobs") / blob.name)
    assert export_model(snapshot, tmp_path / "out", progress=False).architecture == "llama"
