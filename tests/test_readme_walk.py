"""The README's "Use it" block, walked as a new user would: scripts/readme_walk.sh runs every command in order
(on a tiny random model here; on the embedded SmolLM2 when run by hand), and the script follows the README:
a command added to, removed from or reordered in "Use it" fails here until the walk does the same."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from octavo.triton_server.launcher import pytriton_installed

ROOT = Path(__file__).resolve().parent.parent
WALK = ROOT / "scripts" / "readme_walk.sh"


def readme_commands() -> list[str]:
    """The `octavo` subcommand of each line of the README's "Use it" bash block, in order."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Use it", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [" ".join(line.split()[1:3]) if line.split()[1] == "bench" else line.split()[1]
            for line in block.strip().splitlines() if line.startswith(".venv/bin/octavo ")]


def walk_commands() -> list[str]:
    """The subcommands the walk announces with `step ...`, in order."""
    steps = re.findall(r"^step (\S+)( \S+)?", WALK.read_text(), re.M)
    return [f"{a}{b}" if a == "bench" else a for a, b in steps]


def test_the_walk_runs_the_readme_commands_in_order() -> None:
    commands = readme_commands()
    assert len(commands) >= 10 and commands[0] == "export", commands
    assert walk_commands() == commands


@pytest.mark.skipif(not pytriton_installed(), reason="the walk's triton step needs tritonserver")
@pytest.mark.timeout(1200)
def test_readme_walk_on_a_tiny_model(tmp_path: Path) -> None:
    from models import make_random_model

    src = make_random_model(tmp_path / "hf", "llama", max_position_embeddings=2048)  # the seed10 prompts fit
    env = {**os.environ, "OCTAVO": f"{sys.executable} -m octavo", "PYTHON": sys.executable,
           "OCTAVO_CACHE": str(tmp_path / "cache"), "PYTHONPATH": os.pathsep.join(
               [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), "WALK_TIMEOUT": "300"}
    proc = subprocess.run(["bash", str(WALK), str(src), str(tmp_path / "walk")], capture_output=True, text=True,
                          env=env, timeout=1200, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert 'README walk: every "Use it" command ran' in out
    ran = re.findall(r"^\$ octavo (\S+)( \S+)?", proc.stdout, re.M)
    assert [f"{a}{b}" if a == "bench" else a for a, b in ran] == readme_commands()
    assert "Failed requests:                         0" in out or "Failed requests: 0" in " ".join(out.split())
    assert "triton:" in out and "completion:" in out
