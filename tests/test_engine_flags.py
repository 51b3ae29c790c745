"""The engine flags shared by serve / generate / chat / bench reach every EngineArgs field: a field added
to EngineArgs without a flag (or a flag that sets the wrong field) fails here."""
from __future__ import annotations

import argparse
import dataclasses

from octavo.commands.serve import add_engine_arguments, engine_args
from octavo.runtime.engine_args import EngineArgs

# one non-default command line per field (model is the positional argument)
NON_DEFAULT = {
    "block_size": ["--block-size", "32"], "num_blocks": ["--num-blocks", "100"],
    "kv_cache_memory": ["--kv-cache-memory", "1G"], "max_num_seqs": ["--max-num-seqs", "8"],
    "max_num_batched_tokens": ["--max-num-batched-tokens", "512"], "max_model_len": ["--max-model-len", "256"],
    "enable_prefix_caching": ["--no-prefix-caching"], "num_threads": ["--num-threads", "1"],
    "backend": ["--backend", "tensorrt"], "trace_path": ["--trace", "t.jsonl"],
    "weights": ["--weights", "int4"], "kv_cache_dtype": ["--kv-cache-dtype", "float16"],
    "quant_block_size": ["--quant-block-size", "64"], "quantize_lm_head": ["--quantize-lm-head"],
    "seed": ["--engine-seed", "7"],
}


def _parse(argv: list[str]) -> EngineArgs:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    add_engine_arguments(p)
    return engine_args(p.parse_args(["m", *argv]))


def test_defaults_are_engine_args_defaults() -> None:
    assert _parse([]) == EngineArgs(model="m")


def test_every_field_has_a_flag_that_sets_it() -> None:
    fields = {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}
    assert fields <= set(NON_DEFAULT), f"EngineArgs fields without a CLI flag: {sorted(fields - set(NON_DEFAULT))}"
    default = EngineArgs(model="m")
    for name, argv in NON_DEFAULT.items():
        if name == "backend":  # tensorrt with int weights is refused; alone it parses
            got = _parse(argv)
        elif name in ("quant_block_size", "quantize_lm_head"):  # only meaningful with int8/int4 weights
            got = _parse([*argv, "--weights", "int8"])
        else:
            got = _parse(argv)
        assert getattr(got, name) != getattr(default, name), name
