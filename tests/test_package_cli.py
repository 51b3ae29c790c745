"""`octavo --version` and the one-line message for a missing optional extra (in a real fresh venv:
tests/test_package.py::test_missing_extra_names_the_pip_command_in_one_line)."""
from __future__ import annotations

import importlib

import pytest

import octavo
from octavo import cli


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"octavo {octavo.__version__}"


def test_command_whose_module_needs_a_missing_extra(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A command module that imports an extra's package at the top still lists and names the pip command."""
    real = cli._load

    def load(name: str):  # noqa: ANN202
        if name == "serve":
            raise ModuleNotFoundError("No module named 'aiohttp'", name="aiohttp")
        return real(name)

    monkeypatch.setattr(cli, "_load", load)
    assert "pip install 'octavo[serve]'" in cli.build_parser().format_help()
    assert cli.main(["serve", "model", "--port", "0"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "octavo serve: error: this needs the optional dependency 'aiohttp': pip install 'octavo[serve]'"]


def test_missing_module_of_no_extra_is_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    """A module no extra provides is a bug or a broken install: the real error, not a misleading pip hint."""
    generate = importlib.import_module("octavo.commands.generate")

    def broken(args):  # noqa: ANN001, ANN202
        raise ModuleNotFoundError("No module named 'numpy'", name="numpy")

    monkeypatch.setattr(generate, "run", broken)
    with pytest.raises(ModuleNotFoundError):
        cli.main(["generate", "model", "hi"])
