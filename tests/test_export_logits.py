"""Exported graph + OnnxRuntimeBackend vs HF transformers' logits (fp32, atol 1e-4).

Every step is built by hand: shuffled, non-contiguous block tables, slot mappings computed here, and
the pools pre-filled with noise so a read of a wrong slot shows up. The reference is HF's forward over
each full sequence, compared at the same positions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from octavo.runtime.backends.base import StepInputs

ARCHS = ["llama", "llama3rope", "qwen2", "mistral", "tied", "qwen3window", "phi3", "gemma3", "gemma2"]
ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 96


@dataclass
class Pager:
    """A tiny block allocator handing out blocks in a shuffled order (tables are never contiguous)."""

    rng: np.random.Generator
    free: list[int] = field(default_factory=list)
    tables: dict[str, list[int]] = field(default_factory=dict)
    lengths: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.free = self.rng.permutation(NUM_BLOCKS).tolist()

    def step(self, chunks: list[tuple[str, list[int]]], logits_rows: str = "all") -> tuple[StepInputs, list[tuple[str, int]]]:
        """StepInputs for CHUNKS [(seq, new token ids)]; returns also (seq, position) of every logits row."""
        ids, pos, slots, cu, past, rows, where = [], [], [], [0], [], [], []
        for seq, tokens in chunks:
            start = self.lengths.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            for p in range(start, start + len(tokens)):
                if p // BLOCK_SIZE >= len(table):
                    table.append(self.free.pop())
                ids.append(tokens[p - start])
                pos.append(p)
                slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            wanted = range(len(tokens)) if logits_rows == "all" else [len(tokens) - 1]
            rows += [cu[-1] + i for i in wanted]
            where += [(seq, start + i) for i in wanted]
            past.append(start)
            cu.append(cu[-1] + len(tokens))
            self.lengths[seq] = start + len(tokens)
        width = max(len(self.tables[s]) for s, _ in chunks)
        table = np.full((len(chunks), width), -1, np.int32)  # unused entries: invalid ids, must not be read
        for b, (seq, _) in enumerate(chunks):
            table[b, : len(self.tables[seq])] = self.tables[seq]
        return StepInputs(
            input_ids=np.array(ids, np.int64), position_ids=np.array(pos, np.int64),
            cumulative_sequence_length=np.array(cu, np.int32), past_seqlens=np.array(past, np.int32),
            block_table=table, slot_mapping=np.array(slots, np.int64), logits_indices=np.array(rows, np.int64),
        ), where


@pytest.fixture(scope="session")
def exported(hf_model_dir, tmp_path_factory):  # noqa: ANN001, ANN201
    """Factory: arch -> (export folder, manifest, HF model); each exported and loaded once."""
    from models import load_hf

    from octavo.export import export_model

    made: dict = {}

    def get(arch: str):  # noqa: ANN202
        if arch not in made:
            src = hf_model_dir(arch)
            out = tmp_path_factory.mktemp(f"export_{arch}") / "model"
            manifest = export_model(src, out, progress=False)
            made[arch] = (out, manifest, load_hf(src)[0])
        return made[arch]

    return get


def hf_logits(model, ids: list[int]) -> np.ndarray:  # noqa: ANN001
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def noisy_backend(exported, arch: str):  # noqa: ANN001, ANN201
    from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend

    folder, manifest, _ = exported(arch)
    backend = OnnxRuntimeBackend(folder, manifest, NUM_BLOCKS, BLOCK_SIZE, num_threads=1)
    rng = np.random.default_rng(7)
    for pool in backend.key_caches + backend.value_caches:
        pool[...] = rng.normal(0, 30, pool.shape)  # garbage: reading a slot not written this run is visible
    return backend


def check(logits: np.ndarray, where: list[tuple[str, int]], reference: dict[str, np.ndarray]) -> None:
    expected = np.stack([reference[seq][p] for seq, p in where])
    assert logits.shape == expected.shape and logits.dtype == np.float32
    np.testing.assert_allclose(logits, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_prefill_then_batched_decode(exported, arch: str) -> None:
    """Three prompts of different lengths prefilled in ONE step, then four batched decode steps."""
    _, manifest, model = exported(arch)
    rng = np.random.default_rng(1)
    lengths = {"a": 29, "b": 6, "c": 13}  # "a" > mistral's window of 24
    decode_steps = 4
    full = {s: rng.integers(0, manifest.vocab_size, n + decode_steps).tolist() for s, n in lengths.items()}
    reference = {s: hf_logits(model, ids) for s, ids in full.items()}
    backend = noisy_backend(exported, arch)
    pager = Pager(np.random.default_rng(2))

    inputs, where = pager.step([(s, full[s][:n]) for s, n in lengths.items()])
    check(backend.run(inputs), where, reference)
    for i in range(decode_steps):
        order = ["c", "a", "b"] if i % 2 else ["b", "c", "a"]  # batch order changes between steps
        inputs, where = pager.step([(s, [full[s][lengths[s] + i]]) for s in order])
        check(backend.run(inputs), where, reference)
    backend.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_beside_decodes(exported, arch: str) -> None:
    """A 41-token prompt prefilled in 3 chunks, each packed with a decode of another sequence."""
    _, manifest, model = exported(arch)
    rng = np.random.default_rng(3)
    long = rng.integers(0, manifest.vocab_size, 41).tolist()
    other = rng.integers(0, manifest.vocab_size, 12).tolist()
    reference = {"long": hf_logits(model, long), "other": hf_logits(model, other)}
    backend = noisy_backend(exported, arch)
    pager = Pager(np.random.default_rng(4))

    inputs, where = pager.step([("other", other[:9])], logits_rows="last")
    check(backend.run(inputs), where, reference)
    bounds = [0, 14, 31, 41]
    for i in range(3):
        chunk = long[bounds[i] : bounds[i + 1]]
        inputs, where = pager.step([("other", [other[9 + i]]), ("long", chunk)], logits_rows="all" if i == 2 else "last")
        check(backend.run(inputs), where, reference)
    backend.close()


def test_pools_written_in_place(exported) -> None:
    """The numpy pools the backend exposes are the ones the op writes (zero copy), and only at slot_mapping."""
    backend = noisy_backend(exported, "llama")
    before = [p.copy() for p in backend.key_caches + backend.value_caches]
    pager = Pager(np.random.default_rng(5))
    inputs, _ = pager.step([("s", list(range(10, 17)))])
    backend.run(inputs)
    slots = inputs.slot_mapping
    for old, pool in zip(before, backend.key_caches + backend.value_caches):
        flat_old = old.reshape(NUM_BLOCKS * BLOCK_SIZE, -1)
        flat_new = pool.reshape(NUM_BLOCKS * BLOCK_SIZE, -1)
        untouched = np.setdiff1d(np.arange(NUM_BLOCKS * BLOCK_SIZE), slots)
        assert np.array_equal(flat_old[untouched], flat_new[untouched])
        assert not np.isclose(flat_old[slots], flat_new[slots]).any()
    backend.close()


def test_batch_invariance(exported) -> None:
    """A sequence's logits do not depend on what else is packed into the step (prefill and decode)."""
    _, manifest, _ = exported("qwen2")
    rng = np.random.default_rng(6)
    mine = rng.integers(0, manifest.vocab_size, 19).tolist()
    others = {f"o{i}": rng.integers(0, manifest.vocab_size, n).tolist() for i, n in enumerate((5, 26, 11))}
    results = []
    for company in ({}, others):
        backend = noisy_backend(exported, "qwen2")
        pager = Pager(np.random.default_rng(8))
        inputs, where = pager.step([("me", mine[:18])] + [(s, ids[:-1]) for s, ids in company.items()])
        prefill = backend.run(inputs)[: 18]
        inputs, _ = pager.step([(s, ids[-1:]) for s, ids in company.items()] + [("me", mine[18:])])
        decode = backend.run(inputs)[-1]
        results.append((prefill, decode))
        backend.close()
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=0, atol=1e-5)
    assert (results[0][0].argmax(-1) == results[1][0].argmax(-1)).all()
