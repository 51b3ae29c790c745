"""octavo.PagedAttention custom op (C++, ONNX Runtime CPU EP) against the numpy reference."""
from __future__ import annotations

import math

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from op_cases import Step, paged_attention_model, random_case, random_step

from octavo.reference import paged_attention_ref
from octavo import oplib_build as build_op
from octavo.runtime.backends.op_variants import cpu_flags
from octavo.runtime.backends import oplib
from octavo.runtime.backends.ort_kv_pools import set_cache_dtype


@pytest.fixture(scope="module")
def library() -> str:
    """Builds the library if the sources changed (no-op otherwise), so the tests see the current code."""
    build_op.build_library()
    return str(oplib.library_path())


def make_session(library: str, kv_dtype: str = "float32", **attrs: object) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    options.intra_op_num_threads = 2
    model = paged_attention_model(**attrs)  # type: ignore[arg-type]
    set_cache_dtype(model, kv_dtype)  # the pools (inputs and aliased outputs) as the backend declares them
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def half_pools(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The feeds with float16 pools (their existing contents rounded once, as a float16 engine holds them)."""
    for name in ("key_cache", "value_cache"):
        feeds[name] = feeds[name].astype(np.float16)
    return feeds


CASES = {
    # name: (seqs as (past, new), num_heads, kv_num_heads, head_dim, block_size, sliding_window, softcap)
    "prefill_packed_gqa4": ([(0, 37), (0, 5), (0, 64)], 8, 2, 64, 16, 0, 0.0),
    "chunked_and_decode_block1_mha_hd40": ([(13, 9), (0, 0), (40, 1), (7, 30)], 4, 4, 40, 1, 0, 0.0),
    "block256_gqa2": ([(300, 20), (0, 3), (255, 1)], 4, 2, 64, 256, 0, 0.0),
    "decode_batch_gqa4": ([(past, 1) for past in (0, 1, 15, 16, 17, 31, 100, 200, 63)], 8, 2, 64, 16, 0, 0.0),
    "sliding_window": ([(50, 20), (0, 33), (10, 1), (3, 4)], 4, 2, 64, 16, 7, 0.0),
    "softcap_gqa2": ([(20, 12), (0, 17), (33, 1)], 4, 2, 64, 16, 0, 5.0),
    "window_softcap_hd40_block1": ([(30, 6), (0, 9), (5, 1)], 8, 4, 40, 1, 5, 3.0),
    "long_chunk_tiles": ([(70, 130)], 2, 1, 64, 16, 0, 0.0),
    # Few work items + long contexts: key ranges split into parts, combined afterwards.
    "split_long_decode": ([(1000, 1), (700, 1)], 4, 1, 64, 16, 0, 0.0),
    "split_window": ([(600, 40)], 2, 2, 64, 16, 500, 0.0),
    "split_chunked_softcap_hd40": ([(600, 5), (0, 3)], 4, 2, 40, 32, 0, 3.0),
    # Many sequences: several kv heads per work item (one pass over each slot row serves them all).
    "decode_many_seqs_heads_per_item": ([(past, 1) for past in range(3, 400, 10)], 8, 4, 64, 16, 0, 0.0),
    "decode_many_seqs_heads_per_item_hd40": ([(past, 1) for past in range(0, 330, 9)], 8, 4, 40, 3, 0, 0.0),
    # Odd GQA groups: a triple of rows shares each key load (then pairs); 40 = 32 vector dims + a scalar tail.
    "decode_gqa3_hd40": ([(past, 1) for past in (0, 4, 5, 63, 64, 65, 130)], 9, 3, 40, 16, 0, 0.0),
    "decode_gqa5_window_softcap": ([(past, 1) for past in (1, 70, 200)], 10, 2, 64, 16, 50, 4.0),
    # Wide GQA groups (>= 7 query heads a kv head): on 8-lane builds every item takes the GEMM path, decode too.
    "decode_gqa8": ([(past, 1) for past in (0, 1, 63, 64, 65, 200)] + [(30, 4)], 32, 4, 64, 16, 0, 0.0),
    "decode_gqa7_hd40_window": ([(past, 1) for past in (3, 64, 150)] + [(0, 12)], 14, 2, 40, 16, 70, 0.0),
    "split_long_decode_gqa8": ([(1500, 1)], 16, 2, 64, 16, 0, 0.0),
}


def case_step(name: str) -> tuple[Step, dict[str, object]]:
    """CASES[NAME]: its random step (seeded by the name) and the op's attributes."""
    seqs, heads, kv_heads, head_dim, block_size, window, cap = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    step = random_step(rng, seqs, num_heads=heads, kv_num_heads=kv_heads, head_dim=head_dim, block_size=block_size)
    attrs = dict(num_heads=heads, kv_num_heads=kv_heads, scale=1 / math.sqrt(head_dim), sliding_window=window,
                 softcap=cap)
    return step, attrs


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_matches_reference(library: str, name: str) -> None:
    step, attrs = case_step(name)
    ref_inputs = step.feeds()
    expected = paged_attention_ref(*ref_inputs.values(), **attrs)  # updates ref_inputs' pools in place

    session = make_session(library, **attrs)
    feeds = step.feeds()
    output, key_cache_out, value_cache_out = session.run(None, feeds)
    np.testing.assert_allclose(output, expected, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(key_cache_out, ref_inputs["key_cache"])
    np.testing.assert_array_equal(value_cache_out, ref_inputs["value_cache"])
    # The pool was also written in place, in the buffer the op was given.
    np.testing.assert_array_equal(feeds["key_cache"], ref_inputs["key_cache"])
    np.testing.assert_array_equal(feeds["value_cache"], ref_inputs["value_cache"])


@pytest.mark.parametrize("seed", range(16))
def test_op_matches_reference_on_random_shapes(library: str, seed: int) -> None:
    """Random configurations reach the kernel's other paths: tile tails, head_dim 8..128 (vector
    tails), odd block sizes, windows longer than the context, several kv heads per work item."""
    seqs, attrs, head_dim, block_size, step = random_case(
        np.random.default_rng(1000 + seed), head_dims=[8, 16, 24, 40, 64, 80, 96, 128], block_sizes=[1, 3, 16, 32],
        max_past=90)
    ref_inputs = step.feeds()
    expected = paged_attention_ref(*ref_inputs.values(), **attrs)
    output, key_cache_out, value_cache_out = make_session(library, **attrs).run(None, step.feeds())
    np.testing.assert_allclose(output, expected, atol=1e-5, rtol=0, err_msg=str((seqs, attrs, head_dim, block_size)))
    np.testing.assert_array_equal(key_cache_out, ref_inputs["key_cache"])
    np.testing.assert_array_equal(value_cache_out, ref_inputs["value_cache"])


# float16 pools. The oracle writes the new K/V rounded to fp16 (numpy's round-to-nearest-even cast)
# and attends over the stored values widened, i.e. over exactly the numbers the op reads; what is left
# is float32 (op) vs float64 (oracle) arithmetic, so the float32-pool tolerance (1e-5 absolute on
# outputs of magnitude ~1) applies unchanged, and the pools must match bit for bit.
@pytest.mark.parametrize("name", sorted(CASES))
def test_op_matches_reference_float16_pools(library: str, name: str) -> None:
    step, attrs = case_step(name)
    ref_inputs = half_pools(step.feeds())
    expected = paged_attention_ref(*ref_inputs.values(), **attrs)
    feeds = half_pools(step.feeds())
    output, key_cache_out, value_cache_out = make_session(library, "float16", **attrs).run(None, feeds)
    assert key_cache_out.dtype == np.float16 and output.dtype == np.float32
    np.testing.assert_allclose(output, expected, atol=1e-5, rtol=0)
    for got in (key_cache_out, feeds["key_cache"]):  # the graph output and the caller's buffer (in place)
        np.testing.assert_array_equal(got.view(np.uint16), ref_inputs["key_cache"].view(np.uint16))
    for got in (value_cache_out, feeds["value_cache"]):
        np.testing.assert_array_equal(got.view(np.uint16), ref_inputs["value_cache"].view(np.uint16))
    # Against float32 pools holding the same numbers unrounded, fp16 storage moves the outputs only a
    # little: K/V ~ N(0, 1) lose at most 2^-11 relative each; measured max |diff| ~1e-3 on these cases.
    exact = paged_attention_ref(*step.feeds().values(), **attrs)
    np.testing.assert_allclose(output, exact, atol=5e-3, rtol=0)


@pytest.mark.parametrize("seed", range(8))
def test_op_matches_reference_float16_pools_random_shapes(library: str, seed: int) -> None:
    seqs, attrs, head_dim, block_size, step = random_case(
        np.random.default_rng(2000 + seed), head_dims=[4, 8, 20, 40, 64, 72, 128], block_sizes=[1, 3, 16, 256],
        max_past=300)
    ref_inputs = half_pools(step.feeds())
    expected = paged_attention_ref(*ref_inputs.values(), **attrs)
    output, key_cache_out, value_cache_out = make_session(library, "float16", **attrs).run(None, half_pools(step.feeds()))
    np.testing.assert_allclose(output, expected, atol=1e-5, rtol=0, err_msg=str((seqs, attrs, head_dim, block_size)))
    np.testing.assert_array_equal(key_cache_out.view(np.uint16), ref_inputs["key_cache"].view(np.uint16))
    np.testing.assert_array_equal(value_cache_out.view(np.uint16), ref_inputs["value_cache"].view(np.uint16))


def float16_edge_values() -> np.ndarray:
    """float32 values that exercise every branch of the fp16 rounding: every finite half (exact), the
    midpoints between neighbouring halves (ties: round to even) and one float32 ulp either side of
    them, the overflow boundary (65504 .. 65520 .. inf), subnormal halves and their midpoints, signed
    zeros and infinities, and random floats over 2^-30 .. 2^17."""
    halves = np.arange(0, 0x7c00, dtype=np.uint16).view(np.float16)  # +0 .. 65504: every finite positive half
    h = halves.astype(np.float32)
    mid = ((h[:-1].astype(np.float64) + h[1:].astype(np.float64)) / 2).astype(np.float32)  # exact in float32
    above = np.nextafter(mid, np.float32(np.inf))
    below = np.nextafter(mid, np.float32(0))
    special = np.array([65504, 65505, 65519, 65519.996, 65520, 65521, 1e6, np.inf, 0.0, 2.0 ** -25, 2.0 ** -25 * 1.5,
                        2.0 ** -26, 2.0 ** -24 * 0.5, 2.0 ** -24 * 1.5, 2.0 ** -24 * 2.5, 2.0 ** -14 * (1 - 2.0 ** -12)],
                       dtype=np.float32)
    rng = np.random.default_rng(0)
    random = (rng.uniform(1, 2, 20000) * 2.0 ** rng.integers(-30, 17, 20000)).astype(np.float32)
    positive = np.concatenate([h, mid, above, below, special, random])
    return np.concatenate([positive, -positive])


@pytest.mark.parametrize("head_dim", [4, 16, 28])  # all scalar; all vector (F16C); vector + scalar tails
def test_float16_pool_round_trip_is_numpys_rounding(library: str, head_dim: int) -> None:
    """Each one-token sequence attends only to itself, so its output IS its value row as stored in and
    read back from the float16 pool: fp16 round-to-nearest-even on write (numpy's cast), exact on read.
    The key pool holds the same values (checked as stored bits)."""
    values = float16_edge_values()
    values = np.concatenate([values, np.zeros(-len(values) % head_dim, np.float32)]).reshape(-1, head_dim)
    tokens = values.shape[0]
    feeds = {
        "query": np.zeros((tokens, head_dim), np.float32), "key": values, "value": values,
        "key_cache": np.zeros((tokens, 1, 1, head_dim), np.float16),
        "value_cache": np.zeros((tokens, 1, 1, head_dim), np.float16),
        "cumulative_sequence_length": np.arange(tokens + 1, dtype=np.int32),
        "past_seqlens": np.zeros(tokens, np.int32), "block_table": np.arange(tokens, dtype=np.int32).reshape(-1, 1),
        "slot_mapping": np.arange(tokens, dtype=np.int64),
    }
    session = make_session(library, "float16", num_heads=1, kv_num_heads=1, scale=1.0)
    output, key_cache_out, value_cache_out = session.run(None, feeds)
    with np.errstate(over="ignore"):  # values past 65520 become inf, as intended
        want = values.astype(np.float16)
    np.testing.assert_array_equal(key_cache_out.reshape(tokens, head_dim).view(np.uint16), want.view(np.uint16))
    np.testing.assert_array_equal(value_cache_out.reshape(tokens, head_dim).view(np.uint16), want.view(np.uint16))
    finite = np.isfinite(want).all(axis=1)  # an infinite value row makes p*V non-finite; compare the rest
    np.testing.assert_array_equal(output[finite], want[finite].astype(np.float32))


def test_pool_type_must_match_the_graph(library: str) -> None:
    """A float32 pool fed to a graph declaring float16 pools (or the reverse) is refused by ONNX Runtime's
    input type check before the op runs."""
    attrs = dict(num_heads=4, kv_num_heads=2, scale=0.125)
    step = random_step(np.random.default_rng(4), [(3, 2)], num_heads=4, kv_num_heads=2, head_dim=16, block_size=4)
    with pytest.raises(Exception, match=r"data type.*expected: \(tensor\(float16\)\)"):
        make_session(library, "float16", **attrs).run(None, step.feeds())
    with pytest.raises(Exception, match=r"data type.*expected: \(tensor\(float\)\)"):
        make_session(library, **attrs).run(None, half_pools(step.feeds()))


@pytest.mark.parametrize("batch_seqs", [
    [(1500, 1), (40, 30), (3, 1), (0, 70), (700, 2)],
    [(past, 1) for past in range(100, 1300, 100)],  # a decode batch: both kv heads in one item, alone one each
])
def test_sequence_result_is_bit_identical_alone_or_in_any_batch(library: str, batch_seqs: list) -> None:
    """How work is split (kv heads per item, key-range parts) may depend on the batch, but a
    sequence's numbers may not: the engine promises batch-invariant greedy output."""
    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    attrs = dict(num_heads=heads, kv_num_heads=kv_heads, scale=0.125)
    session = make_session(library, **attrs)
    rng = np.random.default_rng(11)
    batch = random_step(rng, batch_seqs, num_heads=heads, kv_num_heads=kv_heads, head_dim=head_dim,
                        block_size=block_size)
    (batch_out, *_) = session.run(None, batch.feeds())
    cu = batch.cumulative_sequence_length
    for b in range(len(batch_seqs)):
        rows = slice(cu[b], cu[b + 1])
        alone = batch.feeds()
        alone.update(query=batch.query[rows], key=batch.key[rows], value=batch.value[rows],
                     cumulative_sequence_length=np.array([0, cu[b + 1] - cu[b]], dtype=np.int32),
                     past_seqlens=batch.past_seqlens[b:b + 1], block_table=batch.block_table[b:b + 1],
                     slot_mapping=batch.slot_mapping[rows])
        (alone_out, *_) = session.run(None, alone)
        np.testing.assert_array_equal(alone_out, batch_out[rows], err_msg=f"sequence {b}")


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2), (16, 2), (14, 2)])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_token_rows_of_a_multi_token_step_equal_its_decode(library: str, heads: int, kv_heads: int,
                                                         kv_dtype: str) -> None:
    """Speculative verification scores 1 + k tokens of a sequence in one step; each token's output must be the
    bits a one-token decode step at its position gives (the engine promises that speculation changes no greedy
    token). Items of up to 8 tokens take the path their decode takes (dot products for narrow GQA groups, the
    GEMM for groups of >= 7 heads, also past 8 tokens), and long key ranges split at fixed offsets (512 keys), so
    the later tokens only add keys a row does not see. Contexts below, across and past the first split."""
    head_dim, block_size = 64, 16
    attrs = dict(num_heads=heads, kv_num_heads=kv_heads, scale=0.125)
    session = make_session(library, kv_dtype, **attrs)
    rng = np.random.default_rng(heads * 10 + kv_heads)
    wide = heads // kv_heads >= 7
    for past in (181, 250, 510, 1020):
        for new in (2, 5, 8, 12) if wide else (2, 5, 8):
            step = random_step(rng, [(past, new)], num_heads=heads, kv_num_heads=kv_heads, head_dim=head_dim,
                               block_size=block_size)
            feeds = step.feeds() if kv_dtype == "float32" else half_pools(step.feeds())
            multi, key_pool, value_pool = session.run(None, feeds)
            for i in range(new):
                one = dict(feeds, query=step.query[i:i + 1], key=step.key[i:i + 1], value=step.value[i:i + 1],
                           key_cache=key_pool.copy(), value_cache=value_pool.copy(),
                           cumulative_sequence_length=np.array([0, 1], np.int32),
                           past_seqlens=np.array([past + i], np.int32), slot_mapping=step.slot_mapping[i:i + 1])
                (alone, *_) = session.run(None, one)
                np.testing.assert_array_equal(alone[0], multi[i], err_msg=f"past {past}, {new} new, token {i}")


@pytest.mark.parametrize("seqs", [[(300, 1)], [(1000, 1)], [(260, 40)], [(0, 9), (300, 1)]],
                         ids=["decode", "decode_split_keys", "prefill", "batch"])
def test_nan_query_reaches_the_output_and_only_its_head(library: str, seqs: list) -> None:
    """A NaN in one query head (a broken model or weights) gives NaN in that head's output rows and nothing else:
    the sampler then fails the step (sampler.py) rather than sampling from a finite average of the values, which is
    what the decode softmax gave before (simd::exp clamped NaN to exp(-87.3))."""
    heads, kv_heads, head_dim = 9, 3, 64
    session = make_session(library, num_heads=heads, kv_num_heads=kv_heads, scale=head_dim ** -0.5)
    step = random_step(np.random.default_rng(5), seqs, num_heads=heads, kv_num_heads=kv_heads, head_dim=head_dim,
                       block_size=16)
    feeds = step.feeds()
    query = feeds["query"].copy()
    token = step.cumulative_sequence_length[-1] - 1  # the last sequence's last token
    query[token, 4 * head_dim:5 * head_dim] = np.nan  # query head 4 (kv head 1)
    feeds["query"] = query
    (out, *_) = session.run(None, feeds)
    nan = np.isnan(out)
    assert nan[token, 4 * head_dim:5 * head_dim].all()
    nan[token, 4 * head_dim:5 * head_dim] = False
    assert not nan.any(), "NaN leaked into other heads or tokens"


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_iobinding_writes_callers_pool_zero_copy(library: str, kv_dtype: str) -> None:
    """As the runtime uses it: pools bound once as OrtValues over numpy, cache outputs dangling. Two steps
    (prefill, then decode) must leave the new K/V in the caller's own arrays (bit for bit the oracle's,
    float16 ones rounded as numpy rounds) and read them back."""
    heads, kv_heads, head_dim, block_size = 4, 2, 64, 16
    attrs = dict(num_heads=heads, kv_num_heads=kv_heads, scale=0.125)
    session = make_session(library, kv_dtype, cache_outputs=False, **attrs)
    rng = np.random.default_rng(7)
    prefill = random_step(rng, [(0, 20), (0, 3)], num_heads=heads, kv_num_heads=kv_heads, head_dim=head_dim,
                          block_size=block_size)
    key_pool, value_pool = prefill.key_cache.astype(kv_dtype), prefill.value_cache.astype(kv_dtype)
    ref_key, ref_value = key_pool.copy(), value_pool.copy()
    binding = session.io_binding()
    key_value = ort.OrtValue.ortvalue_from_numpy(key_pool)
    value_value = ort.OrtValue.ortvalue_from_numpy(value_pool)
    assert key_value.data_ptr() == key_pool.ctypes.data
    binding.bind_ortvalue_input("key_cache", key_value)
    binding.bind_ortvalue_input("value_cache", value_value)

    decode = random_step(rng, [(20, 1), (3, 1)], num_heads=heads, kv_num_heads=kv_heads, head_dim=head_dim,
                         block_size=block_size)
    decode.block_table = prefill.block_table  # same sequences, same blocks: next position of each
    decode.slot_mapping = np.array([prefill.block_table[b, pos // block_size] * block_size + pos % block_size
                                    for b, pos in enumerate((20, 3))], dtype=np.int64)
    for step in (prefill, decode):
        feeds = step.feeds()
        expected = paged_attention_ref(
            feeds["query"], feeds["key"], feeds["value"], ref_key, ref_value, feeds["cumulative_sequence_length"],
            feeds["past_seqlens"], feeds["block_table"], feeds["slot_mapping"], **attrs)
        for name in ("query", "key", "value", "cumulative_sequence_length", "past_seqlens", "block_table",
                     "slot_mapping"):
            binding.bind_cpu_input(name, feeds[name])
        binding.bind_output("output")
        session.run_with_iobinding(binding)
        np.testing.assert_allclose(binding.get_outputs()[0].numpy(), expected, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(key_pool.view(np.uint16), ref_key.view(np.uint16))  # bits, either dtype
        np.testing.assert_array_equal(value_pool.view(np.uint16), ref_value.view(np.uint16))


def run_with_pools_bound(session: ort.InferenceSession, feeds: dict[str, np.ndarray],
                         aliases: dict[str, str]) -> list[ort.OrtValue]:
    """Run with the KV pools bound as OrtValues over the caller's arrays, each cache output of ALIASES
    (output -> pool input) bound to its pool's OrtValue, as the backend does; the outputs, "output" first."""
    binding = session.io_binding()
    pools = {name: ort.OrtValue.ortvalue_from_numpy(feeds[name]) for name in ("key_cache", "value_cache")}
    for name, array in feeds.items():
        if name in pools:
            binding.bind_ortvalue_input(name, pools[name])
        else:
            binding.bind_cpu_input(name, array)
    binding.bind_output("output")
    for out, pool in aliases.items():
        binding.bind_ortvalue_output(out, pools[pool])
    session.run_with_iobinding(binding)
    return binding.get_outputs()


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_cache_outputs_bound_to_the_pool_share_its_buffer(library: str, kv_dtype: str) -> None:
    """With the cache outputs as graph outputs bound to the pool's own OrtValue, ORT hands the op that
    same buffer: the output OrtValue points at the caller's array."""
    heads, kv_heads, head_dim = 2, 1, 64
    attrs = dict(num_heads=heads, kv_num_heads=kv_heads, scale=0.125)
    session = make_session(library, kv_dtype, **attrs)
    step = random_step(np.random.default_rng(3), [(5, 4)], num_heads=heads, kv_num_heads=kv_heads,
                       head_dim=head_dim, block_size=4)
    feeds = step.feeds()
    if kv_dtype == "float16":
        half_pools(feeds)
    ref_key, ref_value = feeds["key_cache"].copy(), feeds["value_cache"].copy()
    expected = paged_attention_ref(feeds["query"], feeds["key"], feeds["value"], ref_key, ref_value,
                                   *[feeds[n] for n in ("cumulative_sequence_length", "past_seqlens", "block_table",
                                                        "slot_mapping")], **attrs)
    outputs = run_with_pools_bound(session, feeds, {"key_cache_out": "key_cache", "value_cache_out": "value_cache"})
    np.testing.assert_allclose(outputs[0].numpy(), expected, atol=1e-5, rtol=0)
    assert outputs[1].data_ptr() == feeds["key_cache"].ctypes.data
    assert outputs[2].data_ptr() == feeds["value_cache"].ctypes.data
    np.testing.assert_array_equal(feeds["key_cache"], ref_key)
    np.testing.assert_array_equal(feeds["value_cache"], ref_value)


def test_float16_pools_inside_a_graph_are_written_in_place(library: str) -> None:
    """As in an exported model the op's query comes from another node and its output feeds another
    node. Switched to float16 the way the backend does it (set_cache_dtype + expose_pool_outputs, pool
    outputs bound to the pools), ONNX Runtime must run the float16 kernel on the caller's buffers: no
    inserted Cast, pools written in place, output as the oracle's."""
    from onnx import TensorProto, helper

    from octavo.runtime.backends.ort_kv_pools import expose_pool_outputs

    heads, kv_heads, head_dim = 4, 2, 16
    attrs = dict(num_heads=heads, kv_num_heads=kv_heads, scale=0.25)
    model = paged_attention_model(cache_outputs=False, **attrs)
    graph = model.graph
    graph.node[0].input[0] = "query_relu"
    graph.node[0].output[0] = "attention"
    graph.node.insert(0, helper.make_node("Relu", ["query"], ["query_relu"]))
    graph.node.append(helper.make_node("Neg", ["attention"], ["output"]))
    set_cache_dtype(model, "float16")
    aliases = expose_pool_outputs(model)
    assert aliases == {"key_cache_out": "key_cache", "value_cache_out": "value_cache"}
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    step = random_step(np.random.default_rng(12), [(6, 3), (0, 4)], num_heads=heads, kv_num_heads=kv_heads,
                       head_dim=head_dim, block_size=4)
    feeds = half_pools(step.feeds())
    ref = half_pools(step.feeds())
    ref["query"] = np.maximum(ref["query"], 0)
    expected = -paged_attention_ref(*ref.values(), **attrs)
    outputs = run_with_pools_bound(session, feeds, aliases)
    np.testing.assert_allclose(outputs[0].numpy(), expected, atol=1e-5, rtol=0)
    assert outputs[1].data_ptr() == feeds["key_cache"].ctypes.data
    np.testing.assert_array_equal(feeds["key_cache"].view(np.uint16), ref["key_cache"].view(np.uint16))
    np.testing.assert_array_equal(feeds["value_cache"].view(np.uint16), ref["value_cache"].view(np.uint16))


BAD_INPUTS = {
    "query width": (lambda f: f.update(query=f["query"][:, :-1].copy()), "query has shape"),
    "key rows": (lambda f: f.update(key=f["key"][:-1].copy()), "key has shape"),
    "pool mismatch": (lambda f: f.update(value_cache=f["value_cache"][:-1].copy()), "differs from key_cache"),
    "block out of pool": (lambda f: f["block_table"].__setitem__((0, 0), 10_000), "outside the pool"),
    "cu total": (lambda f: f["cumulative_sequence_length"].__setitem__(-1, 5), "must equal the number"),
    "slot out of pool": (lambda f: f["slot_mapping"].__setitem__(0, 10**9), r"slot_mapping\[0\]=1000000000 is outside"),
    "past too long": (lambda f: f["past_seqlens"].__setitem__(0, 10_000), "columns"),
    "negative past": (lambda f: f["past_seqlens"].__setitem__(0, -2), "negative"),
    "pool rank": (lambda f: f.update(key_cache=f["key_cache"][0].copy(), value_cache=f["value_cache"][0].copy()),
                  "rank 4"),
}


def test_bad_inputs_give_clear_errors_and_session_survives(library: str) -> None:
    attrs = dict(num_heads=4, kv_num_heads=2, scale=0.125)
    session = make_session(library, **attrs)
    step = random_step(np.random.default_rng(1), [(3, 4), (0, 2)], num_heads=4, kv_num_heads=2, head_dim=16,
                       block_size=4)
    for name, (corrupt, message) in BAD_INPUTS.items():
        feeds = step.feeds()
        corrupt(feeds)
        with pytest.raises(Exception, match=message) as info:
            session.run(None, feeds)
        assert "octavo.PagedAttention" in str(info.value), name
    session.run(None, step.feeds())  # still usable


def test_bad_attributes_fail_at_session_creation(library: str) -> None:
    with pytest.raises(Exception, match="multiple of kv_num_heads"):
        make_session(library, num_heads=6, kv_num_heads=4, scale=0.1)


def test_missing_headers_name_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    from octavo.errors import OpLibraryError

    monkeypatch.setenv("ORT_INCLUDE_DIR", str(tmp_path))
    with pytest.raises(OpLibraryError, match="ORT_INCLUDE_DIR"):
        build_op.find_include_dir()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["x86-64", "haswell", "x86-64-v3", "x86-64-v4"])
def test_portable_builds_match_reference(arch: str, tmp_path) -> None:  # noqa: ANN001
    """The SIMD code at 4, 8 and 16 lanes (the default build uses the host's widest vectors); x86-64-v3/v4 are
    the wheel's builds (docs/install.md)."""
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("x86-64 -march variants only")
    flags = oplib.cpu_flags()
    if arch == "x86-64-v4" and (flags is None or oplib.X86_64_V4.missing(flags)):
        pytest.skip("this CPU has no AVX-512")
    library = str(build_op.build_library(native=False, extra_flags=(f"-march={arch}",),
                                         output=tmp_path / "liboctavo_ort.so"))
    for name in sorted(CASES):
        test_op_matches_reference(library, name)
    for seed in range(16):
        test_op_matches_reference_on_random_shapes(library, seed)
    for name in sorted(CASES):  # float16 pools: F16C (haswell) and the scalar conversions (x86-64)
        test_op_matches_reference_float16_pools(library, name)
    for seed in range(8):
        test_op_matches_reference_float16_pools_random_shapes(library, seed)
    for head_dim in (4, 16, 28):
        test_float16_pool_round_trip_is_numpys_rounding(library, head_dim)
    from test_kv_int8 import CASES as INT8_CASES
    from test_kv_int8 import test_op_matches_reference as int8_case
    from test_kv_int8 import test_op_matches_reference_on_random_shapes as int8_random_case

    for name in sorted(INT8_CASES):  # int8 pools: the row quantizer and dequantizer at each width
        int8_case(library, name)
    for seed in range(8):
        int8_random_case(library, seed)
    if arch == "x86-64-v4":  # the bfloat16 paths are built into the AVX-512 builds only (amx.h)
        for name in sorted(CASES):
            for kv_dtype in ("float32", "float16"):
                test_prompt_bf16_attention(library, name, kv_dtype)


def test_library_path_names_the_fix_when_missing(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    from octavo.errors import OpLibraryError

    monkeypatch.setattr(oplib, "library_dir", lambda: tmp_path)
    with pytest.raises(OpLibraryError, match="make op"):
        oplib.library_path()


def test_step_without_tokens_is_a_no_op(library: str) -> None:
    attrs = dict(num_heads=4, kv_num_heads=2, scale=0.125)
    session = make_session(library, **attrs)
    step = random_step(np.random.default_rng(2), [(5, 0), (0, 0)], num_heads=4, kv_num_heads=2, head_dim=16,
                       block_size=4)
    feeds = step.feeds()
    output, key_cache_out, _ = session.run(None, feeds)
    assert output.shape == (0, 64)
    np.testing.assert_array_equal(key_cache_out, step.key_cache)


# prompt_bf16 = 1 (block-bf16 exports): on a CPU with AVX512-BF16 (AMX tiles where AMX-BF16 runs, VDPBF16PS
# vectors elsewhere; AVX-512 builds) the prompt items (>= 16 rows, head_dim a multiple
# of 32) round the scaled queries, the keys and values they read and the probabilities to bfloat16 and sum
# products in float32. Reference: the float64 oracle over bf16-rounded queries (scale 1/8 for head_dim 64, a
# power of two: rounding q * scale is rounding q), keys and values; what is left is the probabilities' rounding,
# |out error| <= 2^-8 * sum_j p_j |v_j| <= 2^-8 max |v|, plus float32 arithmetic. Every other item, and every
# item on a CPU without AVX512-BF16, is the float32 op bit for bit; the pools are written the same.
BF16 = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= (cpu_flags() or frozenset())


def _bf16(a: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32).view(np.float32).reshape(a.shape)


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_prompt_bf16_attention(library: str, name: str, kv_dtype: str) -> None:
    step, attrs = case_step(name)
    pools = half_pools if kv_dtype == "float16" else (lambda feeds: feeds)
    plain = make_session(library, kv_dtype, **attrs).run(None, pools(step.feeds()))
    got = make_session(library, kv_dtype, prompt_bf16=1, **attrs).run(None, pools(step.feeds()))
    for a, b in zip(got[1:], plain[1:]):  # the pools
        np.testing.assert_array_equal(a, b)
    head_dim = step.query.shape[1] // int(attrs["num_heads"])
    if not BF16 or head_dim % 32 or np.array_equal(got[0], plain[0]):  # float32 items only (decode-only steps)
        np.testing.assert_array_equal(got[0], plain[0])
        assert not (BF16 and head_dim % 32 == 0 and name.startswith(("prefill", "long")))  # those have prompt items
        return
    assert attrs["scale"] == 0.125
    feeds = pools(step.feeds())
    if kv_dtype == "float16":  # the new rows as the op reads them back: float16, then bfloat16
        feeds["key"], feeds["value"] = (feeds[n].astype(np.float16).astype(np.float32) for n in ("key", "value"))
    feeds = {n: (_bf16(v.astype(np.float32)) if v.dtype.kind == "f" else v) for n, v in feeds.items()}
    expected = paged_attention_ref(*feeds.values(), **attrs)
    bound = 2.0 ** -8 * max(np.abs(feeds["value"]).max(), np.abs(feeds["value_cache"]).max()) + 1e-5
    np.testing.assert_allclose(got[0], expected, atol=bound, rtol=0)
    exact = paged_attention_ref(*pools(step.feeds()).values(), **attrs)
    assert np.abs(got[0] - exact).max() > 10 * np.abs(plain[0] - exact).max()  # it did run in bfloat16


# Optional inputs 9-11 (position_ids, cos_cache, sin_cache: the ONNX Runtime backend moves each layer's rotary
# embedding into its attention node, ort_fusions.fuse_rotary_into_attention): the op rotates query and key in
# rotate-half form before anything reads them. Reference: numpy's float32 rotation of q and k (two products and a
# sum, as the exported graph computes it) fed to the op without those inputs -- the same bits in every output.
ROTARY_INPUTS = (("position_ids", TensorProto.INT64), ("cos_cache", TensorProto.FLOAT), ("sin_cache", TensorProto.FLOAT))


def _rotary_session(library: str, kv_dtype: str = "float32", **attrs: object) -> ort.InferenceSession:
    model = paged_attention_model(**attrs)  # type: ignore[arg-type]
    model.graph.node[0].input.extend(name for name, _ in ROTARY_INPUTS)
    model.graph.input.extend(helper.make_tensor_value_info(name, dtype, None) for name, dtype in ROTARY_INPUTS)
    set_cache_dtype(model, kv_dtype)
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _tables(head_dim: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)
    angles = np.arange(positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _rotate(x: np.ndarray, heads: int, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    t = x.reshape(len(x), heads, -1)
    half = t.shape[-1] // 2
    lo, hi = t[..., :half], t[..., half:]
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    return np.concatenate([lo * c + -hi * s, hi * c + lo * s], axis=-1).astype(np.float32).reshape(x.shape)


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", ["prefill_packed_gqa4", "chunked_and_decode_block1_mha_hd40", "decode_batch_gqa4",
                                  "sliding_window", "long_chunk_tiles", "split_long_decode"])
def test_rotary_inputs_rotate_query_and_key_first(library: str, name: str, kv_dtype: str) -> None:
    step, attrs = case_step(name)
    pools = half_pools if kv_dtype == "float16" else (lambda feeds: feeds)
    heads, kv_heads = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
    head_dim = step.query.shape[1] // heads
    rng = np.random.default_rng(7)
    cos, sin = _tables(head_dim, 1200)
    positions = rng.integers(0, 1200, len(step.query)).astype(np.int64)  # any row of the tables, not only past + i
    feeds = pools(step.feeds())
    want = make_session(library, kv_dtype, **attrs).run(None, {
        **feeds, "query": _rotate(step.query, heads, positions, cos, sin),
        "key": _rotate(step.key, kv_heads, positions, cos, sin)})
    got = _rotary_session(library, kv_dtype, **attrs).run(None, {
        **pools(step.feeds()), "position_ids": positions, "cos_cache": cos, "sin_cache": sin})
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_rotary_inputs_are_checked(library: str) -> None:
    step, attrs = case_step("decode_batch_gqa4")
    head_dim = step.query.shape[1] // int(attrs["num_heads"])
    cos, sin = _tables(head_dim, 64)
    session = _rotary_session(library, **attrs)
    positions = np.zeros(len(step.query), np.int64)
    positions[3] = 64
    with pytest.raises(Exception, match=r"position_ids\[3\] = 64 is outside the rotary tables' 64 positions"):
        session.run(None, {**step.feeds(), "position_ids": positions, "cos_cache": cos, "sin_cache": sin})
    with pytest.raises(Exception, match=r"sin_cache shape \[64, 16\] differs from cos_cache shape \[64, 32\]"):
        session.run(None, {**step.feeds(), "position_ids": positions * 0, "cos_cache": cos, "sin_cache": sin[:, :16]})
    with pytest.raises(Exception, match=r"cos_cache has shape \[64, 31\] but dimension 1 must be 32"):
        session.run(None, {**step.feeds(), "position_ids": positions * 0, "cos_cache": cos[:, :31],
                           "sin_cache": sin[:, :31]})
