"""The package as a user gets it (issue 19): an sdist and a wheel built from a clean copy of this tree (tracked
and new files only: no octavo/_lib, no third_party, no build/), the wheel installed into a fresh venv outside
the checkout, and octavo run from a folder that holds no checkout, with no PYTHONPATH. Then the sdist is
pip-installed too (its build compiles the op again, from the sdist's own sources).

One wheel build and one venv are shared by the module (the op compile and the dependency install dominate).
Generation is compared with transformers on the same tiny checkpoint.
"""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

import octavo
from octavo.runtime.backends.op_variants import X86_64_V3, X86_64_V4, cpu_flags, packaged_variants

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The quick brown fox"
MAX_TOKENS = 8
# the lab (issue 39): benchmark peers and the SLO search (benchmarks/), test doubles (tests/), experiments (scripts/)
LAB_NAMES = frozenset({"benchmarks", "peers", "slo", "roofline", "compare_peers", "slo_capacity", "tests", "faulty",
                       "faulty_backend", "scripts", "triton_cancel_race", "structured_lib_compare"})

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="the op library is built for Linux"),
    pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler"),
    pytest.mark.timeout(900),
]


@dataclass(slots=True)
class Install:
    venv: Path
    wheel: Path
    sdist: Path
    workdir: Path  # a folder with no checkout in or above it
    env: dict[str, str]

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def run(self, *args: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(a) for a in args], cwd=self.workdir, env=self.env, capture_output=True,
                              text=True, timeout=600)
        if check and proc.returncode != 0:
            raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc

    def octavo(self, *args: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run(self.venv / "bin" / "octavo", *args, check=check)


def clean_copy(dest: Path) -> Path:
    """The tree as a fresh clone would have it plus uncommitted new files: what `git ls-files` lists."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the work tree is skipped
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def user_env(include_dir: Path) -> dict[str, str]:
    """This environment minus what points into the checkout; the op build reuses the checkout's ORT headers."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "OCTAVO_OP_LIBRARY", "PYTHONHOME")}
    env["ORT_INCLUDE_DIR"] = str(include_dir)
    env["PIP_NO_INPUT"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> Install:
    from octavo.oplib_build import find_include_dir

    if not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the clean copy is what git tracks)")
    base = tmp_path_factory.mktemp("package")
    env = user_env(find_include_dir())  # fetched once into the checkout's third_party/ if needed
    source = clean_copy(base / "src")
    dist = base / "dist"
    dist.mkdir()
    workdir = base / "work"
    workdir.mkdir()
    # sdist: setuptools' PEP 517 hook (what `python -m build --sdist` calls)
    hook = f"from setuptools import build_meta; print(build_meta.build_sdist({str(dist)!r}))"
    done = subprocess.run([sys.executable, "-c", hook], cwd=source, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    sdist = dist / done.stdout.strip().splitlines()[-1]
    # wheel: pip in an isolated build environment, as `pip install .` does
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(source)],
                          cwd=workdir, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = dist.glob("*.whl")
    venv = base / "venv"
    base_python = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base_python, "-m", "venv", str(venv)], check=True, env=env)
    result = Install(venv, wheel, sdist, workdir, env)
    result.run(result.python, "-m", "pip", "install", "-q", wheel)
    return result


@pytest.fixture(scope="module")
def reference(hf_model_dir) -> tuple[list[int], list[int]]:  # noqa: ANN001
    """(prompt ids, transformers' greedy continuation) of the tiny llama checkpoint."""
    from models import hf_greedy, load_hf

    model, tokenizer = load_hf(hf_model_dir("llama"))
    ids = tokenizer(PROMPT)["input_ids"]
    return ids, hf_greedy(model, ids, MAX_TOKENS)


GENERATE = """
import json, sys
import octavo
from octavo.runtime.backends.oplib import library_path
llm = octavo.LLM(sys.argv[1])
params = octavo.SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3]), ignore_eos=True)
out = llm.generate([{"prompt_token_ids": json.loads(sys.argv[2])}], params, use_tqdm=False)
llm.close()
print(json.dumps({"octavo": octavo.__file__, "library": str(library_path()),
                  "tokens": list(out[0].outputs[0].token_ids)}))
"""


def installed_generate(install: Install, model: Path, ids: list[int]) -> dict:
    proc = install.run(install.python, "-c", GENERATE, model, json.dumps(ids), str(MAX_TOKENS))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def expected_variant() -> str:
    flags = cpu_flags()
    if platform.machine() != "x86_64":
        return packaged_variants()[0].name
    return X86_64_V4.name if flags is not None and not X86_64_V4.missing(flags) else X86_64_V3.name


def site_packages(install: Install) -> Path:
    return Path(install.run(install.python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))")
                .stdout.strip())


def test_wheel_carries_the_op_builds_and_the_data_files(install: Install) -> None:
    assert install.wheel.name == f"octavo-{octavo.__version__}-py3-none-linux_{platform.machine()}.whl"
    names = set(zipfile.ZipFile(install.wheel).namelist())
    for variant in packaged_variants():
        assert f"octavo/_lib/{variant.file_name}" in names
    assert "octavo/tensorrt/plugin.py" in names  # the TensorRT plugin is a module of the package
    for data in ("model_repo/octavo/config.pbtxt", "model_repo/octavo/1/model.py",
                 "plugins/onnxruntime/paged_attention_kernel.cc",
                 "plugins/onnxruntime/block_matmul_kernel.cc", "plugins/onnxruntime/op_glue.h"):
        assert f"octavo/_data/{data}" in names, data
    assert not [n for n in names if n.endswith((".sha256", ".lock", ".o", ".pyc"))]
    assert "octavo/_lib/liboctavo_ort.so" not in names  # no -march=native build in a portable wheel


def test_wheel_holds_the_product_not_the_lab(install: Install) -> None:
    """`unzip -l` of the wheel: octavo/ and its metadata only; no folder or module of the lab anywhere in it."""
    names = zipfile.ZipFile(install.wheel).namelist()
    dist_info = f"octavo-{octavo.__version__}.dist-info/"
    assert [n for n in names if not n.startswith(("octavo/", dist_info))] == []
    lab = [n for n in names
           if any(Path(part).stem in LAB_NAMES or part.startswith("bench_") for part in n.split("/"))]
    assert lab == []
    assert "octavo/bench/throughput.py" in names and "octavo/bench/serve_client.py" in names  # `octavo bench` stays
    with tarfile.open(install.sdist) as sdist:  # MANIFEST.in prunes the lab from the sdist too
        assert not [n for n in sdist.getnames() if n.split("/")[1:2] in (["benchmarks"], ["scripts"], ["tests"])]


def test_wheel_op_builds_are_portable(install: Install, tmp_path: Path) -> None:
    """The wheel's x86-64-v3 build uses no AVX-512 (the v4 one does), and a build for a wider CPU than this one
    refuses to register, with an ONNX Runtime error naming the missing feature, instead of dying of an illegal
    instruction (the check in RegisterCustomOps)."""
    if platform.machine() != "x86_64":
        pytest.skip("x86-64 variants only")
    with zipfile.ZipFile(install.wheel) as wheel:
        wheel.extractall(tmp_path, [f"octavo/_lib/{v.file_name}" for v in packaged_variants()])
    folder = tmp_path / "octavo" / "_lib"
    objdump = shutil.which("objdump")
    if objdump is not None:
        def uses_zmm(variant: str) -> bool:
            text = subprocess.run([objdump, "-d", str(folder / f"liboctavo_ort.{variant}.so")],
                                  capture_output=True, text=True, check=True).stdout
            return "%zmm" in text

        assert not uses_zmm(X86_64_V3.name)
        assert uses_zmm(X86_64_V4.name)
    import onnxruntime as ort

    flags = cpu_flags()
    for variant in packaged_variants():
        options = ort.SessionOptions()
        if flags is not None and variant.missing(flags):
            with pytest.raises(Exception, match=r"needs the CPU feature \w+, which this CPU lacks"):
                options.register_custom_ops_library(str(folder / variant.file_name))
        else:
            options.register_custom_ops_library(str(folder / variant.file_name))


def test_installed_wheel_generates_like_transformers(install: Install, hf_model_dir, reference) -> None:  # noqa: ANN001
    ids, expected = reference
    result = installed_generate(install, hf_model_dir("llama"), ids)
    packages = site_packages(install)
    assert Path(result["octavo"]).is_relative_to(packages), result  # not this checkout
    library = Path(result["library"])
    assert library.parent == packages / "octavo" / "_lib"
    assert library.name == f"liboctavo_ort.{expected_variant()}.so"
    assert result["tokens"] == expected


def test_installed_cli_generate_export_version(install: Install, hf_model_dir, reference) -> None:  # noqa: ANN001
    model = hf_model_dir("llama")
    assert install.octavo("--version").stdout.strip() == f"octavo {octavo.__version__}"
    gen = install.octavo("generate", model, PROMPT, "--max-tokens", str(MAX_TOKENS), "--ignore-eos")
    assert gen.stdout.strip(), gen.stderr

    out = install.workdir / "exported"
    install.octavo("export", model, out, "--no-progress", "--force")
    assert (out / "octavo.json").is_file() and (out / "model.onnx").is_file()
    ids, expected = reference
    assert installed_generate(install, out, ids)["tokens"] == expected  # the export runs, and runs right

    plugin = install.run(install.python, "-c", "from pathlib import Path; import octavo.tensorrt.plugin as m; "
                                               "p = Path(m.__file__); print(p, p.is_file())").stdout.split()
    assert plugin[1] == "True" and Path(plugin[0]).is_relative_to(site_packages(install))


def test_missing_extra_names_the_pip_command_in_one_line(install: Install, hf_model_dir) -> None:  # noqa: ANN001
    """Runs before test_triton_from_the_installed_package installs the serve extra (file order)."""
    for command in ("serve", "triton"):  # the Triton front is an aiohttp server too
        # (`octavo triton --no-serve` only writes a repository and needs no extra: test_triton_repository_base_install)
        proc = install.octavo(command, hf_model_dir("llama"), "--http-port=0" if command == "triton" else "--port=0",
                              check=False)
        assert proc.returncode == 2
        assert proc.stderr.strip().splitlines() == [
            f"octavo {command}: error: this needs the optional dependency 'aiohttp': pip install 'octavo[serve]'"]
    listing = install.octavo("--help").stdout  # every command is listed; the others still run
    assert "serve" in listing and "triton" in listing


def test_triton_from_the_installed_package(install: Install, hf_model_dir) -> None:  # noqa: ANN001
    """With the serve extra (pip install 'octavo[serve]' from the same wheel), `octavo triton --no-serve` writes
    the repository from the template inside the package."""
    install.run(install.python, "-m", "pip", "install", "-q", f"{install.wheel}[serve]")
    model = hf_model_dir("llama")
    repo = install.workdir / "triton_repo"
    install.octavo("triton", model, "--repo-out", repo, "--no-serve")
    assert (repo / "octavo" / "1" / "model.py").read_bytes() == (ROOT / "model_repo/octavo/1/model.py").read_bytes()
    config = (repo / "octavo" / "config.pbtxt").read_text()
    found = re.search(r'key: "model_path" value: \{ string_value: "([^"]+)" \}', config)
    assert found and (Path(found.group(1)) / "octavo.json").is_file(), config  # an export the server can load


def test_sdist_is_complete_and_pip_installs(install: Install, hf_model_dir, reference) -> None:  # noqa: ANN001
    with tarfile.open(install.sdist) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    for needed in ("setup.py", "pyproject.toml", "README.md", "plugins/onnxruntime/paged_attention_op.cc",
                   "plugins/onnxruntime/simd.h", "plugins/onnxruntime/block_matmul_op.cc",
                   "plugins/onnxruntime/block_matmul_kernel.h", "octavo/tensorrt/plugin.py",
                   "model_repo/octavo/config.pbtxt", "octavo/oplib_build.py"):
        assert needed in names, needed
    assert not [n for n in names if n.endswith(".so") or n.startswith(("third_party", "octavo/_lib", "build/"))]
    # into a folder of its own, first on the venv's path: the venv (and the wheel in it) stay as they are
    target = install.workdir.parent / "from_sdist"
    install.run(install.python, "-m", "pip", "install", "-q", "--no-deps", "--target", target, install.sdist)
    ids, expected = reference
    proc = install.run(install.python, "-c", f"import sys; sys.path.insert(0, {str(target)!r}); exec({GENERATE!r})",
                       hf_model_dir("llama"), json.dumps(ids), str(MAX_TOKENS))
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(result["octavo"]).is_relative_to(target)
    assert Path(result["library"]) == target / "octavo" / "_lib" / f"liboctavo_ort.{expected_variant()}.so"
    assert result["tokens"] == expected
