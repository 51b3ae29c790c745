"""EngineArgs from text parameters (Triton's config.pbtxt, `octavo triton` flags): every EngineArgs field is one,
converted by its annotation. The reference is the EngineArgs dataclass itself (its fields and defaults)."""
from __future__ import annotations

import dataclasses

import pytest

from octavo.errors import InvalidRequestError
from octavo.runtime.engine_args import EngineArgs
from octavo.serving.engine_params import engine_args_from_strings, engine_parameter_names

FIELDS = [f for f in dataclasses.fields(EngineArgs) if f.name != "model"]


def test_every_engine_field_is_a_parameter_and_its_default_round_trips() -> None:
    assert engine_parameter_names() == tuple(f.name for f in FIELDS)
    assert {"weights", "kv_cache_dtype", "enable_prefix_caching", "trace_path"} <= set(engine_parameter_names())
    default = EngineArgs(model="m")
    for f in FIELDS:  # the default, written as text, reads back as the default (typed: 16 is an int, not "16")
        value = getattr(default, f.name)
        if value is None:
            continue
        args = engine_args_from_strings("m", {f.name: str(value).lower() if isinstance(value, bool) else str(value)})
        assert args == default and type(getattr(args, f.name)) is type(value), f.name
    assert engine_args_from_strings("m", {f.name: "" for f in FIELDS}) == default  # empty = the default


def test_typed_conversion_of_each_kind() -> None:
    args = engine_args_from_strings("m", {"block_size": "32", "num_blocks": " 7 ", "enable_prefix_caching": "off",
                                          "weights": "int8", "quant_block_size": "none", "kv_cache_dtype": "float16",
                                          "trace_path": "/tmp/t_{instance}.jsonl", "seed": "-3"})
    assert (args.block_size, args.num_blocks, args.enable_prefix_caching, args.weights) == (32, 7, False, "int8")
    assert args.quant_block_size is None and args.kv_cache_dtype == "float16" and args.seed == -3
    assert args.trace_path == "/tmp/t_{instance}.jsonl"


@pytest.mark.parametrize(("values", "named"), [
    ({"no_such_knob": "1"}, "no_such_knob"),
    ({"model": "/elsewhere"}, "'model'"),  # model comes from model_path, not a parameter
    ({"block_size": "sixteen"}, "block_size"),
    ({"enable_prefix_caching": "maybe"}, "enable_prefix_caching"),
    ({"num_blocks": "1.5"}, "num_blocks"),
    ({"weights": "int3"}, "weights"),  # EngineArgs.validate
])
def test_bad_parameters_are_refused_by_name(values: dict[str, str], named: str) -> None:
    with pytest.raises(InvalidRequestError, match=named):
        engine_args_from_strings("m", values, where="config.pbtxt parameter")


def test_triton_generator_knows_every_engine_field() -> None:
    from octavo.triton_server.model_repository import PARAMETER_KEYS, render_config, template_dir

    assert set(PARAMETER_KEYS) == {"model_path"} | {f.name for f in FIELDS}
    template = (template_dir() / "config.pbtxt").read_text()
    params = {"max_num_seqs": "8", "weights": "int8", "kv_cache_dtype": "float16"}
    text = render_config(template, params)
    for key, value in params.items():  # filled in once, whether the template lists the key or not
        assert text.count(f'key: "{key}" value: {{ string_value: "{value}" }}') == 1, key
        assert text.count(f'key: "{key}"') == 1, key
    cut = template.replace('parameters { key: "kv_cache_dtype" value: { string_value: "" } }', "")
    assert 'key: "kv_cache_dtype" value: { string_value: "float16" }' in render_config(cut, params)
