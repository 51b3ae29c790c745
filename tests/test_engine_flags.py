"""One set of engine flags, generated from EngineArgs, on every command (generate, chat, serve, bench throughput,
demo, triton) and the same words as Triton's config.pbtxt parameters: a field added to EngineArgs gets its flag
on every command at once, a flag sets exactly its field, and --help shows every default."""
from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from octavo.cli import build_parser
from octavo.commands.engine_flags import add_engine_arguments, engine_args, flag_of
from octavo.runtime.engine_args import EngineArgs
from octavo.serving.engine_params import engine_args_from_strings, value_text

# one non-default value per field type; a field of a new type fails here until it has one
SAMPLE = {int: "32", bool: None, str: None, float: "0.5"}
STRINGS = {"backend": "tensorrt", "weights": "int4", "kv_cache_dtype": "float16", "trace_path": "t.jsonl",
           "prompt_activations": "int8", "decode_activations": "int8",
           "quant_kernel": "matmulnbits", "ort_spinning": "0", "reasoning_parser": "deepseek_r1",
           "kv_events_config": "{\"topic\": \"kv\"}",
           "lora_modules": "a=/adapters/a",
           "speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}'}
NEEDS = {"quant_block_size": ["--weights", "int8"], "quantize_lm_head": ["--weights", "int8"]}
FIELDS = [f for f in dataclasses.fields(EngineArgs) if f.name != "model"]
ENGINE_COMMANDS = [["generate", "m", "p"], ["chat", "m"], ["serve", "m"], ["bench", "throughput", "m"],
                   ["demo"], ["triton", "m"]]


def _plain(annotation: object) -> type:
    options = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return options[0]


def _non_default(field: dataclasses.Field) -> list[str]:
    kind = _plain(typing.get_type_hints(EngineArgs)[field.name])
    if kind is bool:
        return [("--no-" if field.default else "--") + flag_of(field.name)[2:], *NEEDS.get(field.name, [])]
    value = STRINGS.get(field.name) or SAMPLE[kind]
    if field.name == "quant_block_size":
        value = "64"
    return [flag_of(field.name), value, *NEEDS.get(field.name, [])]


def _parse(argv: list[str]) -> EngineArgs:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    add_engine_arguments(p)
    return engine_args(p.parse_args(["m", *argv]))


def test_defaults_are_engine_args_defaults() -> None:
    assert _parse([]) == EngineArgs(model="m")


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_every_field_has_a_flag_that_sets_it_and_the_triton_parameter_agrees(field) -> None:  # noqa: ANN001
    argv = _non_default(field)
    got = _parse(argv)
    assert getattr(got, field.name) != field.default, argv
    others = {f.name: getattr(got, f.name) for f in FIELDS if f.name != field.name and f.name not in ("weights",)}
    assert others == {f.name: f.default for f in FIELDS if f.name != field.name and f.name != "weights"}
    # the Triton parameter of the same name, from the text `octavo triton` writes, gives the same EngineArgs
    params = {f.name: value_text(getattr(got, f.name)) for f in FIELDS if getattr(got, f.name) != f.default}
    assert engine_args_from_strings("m", params) == got


@pytest.mark.parametrize("command", ENGINE_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_every_command_takes_the_same_engine_flags(command: list[str]) -> None:
    parser = build_parser()
    argv = ["--block-size", "32", "--no-enable-prefix-caching", "--seed", "7", "--trace-path", "t.jsonl",
            "--kv-cache-memory", "512M"]
    args = parser.parse_args([*command, *argv])
    for name, value in {"block_size": 32, "enable_prefix_caching": False, "seed": 7, "trace_path": "t.jsonl",
                        "kv_cache_memory": 512 << 20}.items():
        assert getattr(args, name) == value, (command, name)


def test_earlier_spellings_still_work() -> None:
    got = _parse(["--no-prefix-caching", "--engine-seed", "3", "--trace", "x.jsonl", "--threads", "1"])
    assert (got.enable_prefix_caching, got.seed, got.trace_path, got.num_threads) == (False, 3, "x.jsonl", 1)


def test_a_bad_value_names_the_flag(capsys) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit):
        _parse(["--kv-cache-memory", "lots"])
    assert "--kv-cache-memory must be a byte size" in capsys.readouterr().err


def _actions(parser: argparse.ArgumentParser, path: str = "octavo"):  # noqa: ANN202
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _actions(sub, f"{path} {name}")
        elif (action.option_strings and not isinstance(action, (argparse._HelpAction, argparse._VersionAction))
              and action.help != argparse.SUPPRESS):
            yield path, parser, action


def test_help_shows_every_default() -> None:
    missing = []
    for path, parser, action in _actions(build_parser()):
        text = parser._get_formatter()._expand_help(action) if action.help else ""
        if "default" not in parser.formatter_class(path)._get_help_string(action).lower() or "None" in text:
            missing.append(f"{path} {action.option_strings[0]}: {text!r}")
    assert not missing, "\n".join(missing)


def test_generate_help_shows_max_tokens_and_serve_help_the_port(capsys) -> None:  # noqa: ANN001
    for argv, needle in ((["generate", "--help"], "(default: 64)"), (["serve", "--help"], "(default: 8000")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        assert needle in " ".join(capsys.readouterr().out.split()), argv
