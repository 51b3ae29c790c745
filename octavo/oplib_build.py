"""Build the ONNX Runtime custom-op library (`make op` / `python -m octavo.oplib_build`).

Compiles plugins/onnxruntime/*.cc with g++ into octavo/_lib/: `liboctavo_ort.so` for this machine
(-march=native, what `make op` and an editable install build), or with `--packaged` the portable builds a wheel
ships (`liboctavo_ort.<variant>.so`, octavo.runtime.backends.oplib chooses one at load time). Sources compile in
parallel (one compiler process per core). ONNX Runtime's C API headers are not in the onnxruntime wheel; they
are taken, in this order, from:
  1. $ORT_INCLUDE_DIR (a folder holding onnxruntime_c_api.h),
  2. a system install (/usr/include/onnxruntime, /usr/local/include/onnxruntime, ...),
  3. third_party/ort/ (already fetched), or else
  4. Debian trixie's `libonnxruntime-dev`, fetched with apt-get under a private configuration in
     third_party/apt/ (the machine's own apt sources and state are not read or changed).
third_party/ is the checkout's (git-ignored); an installed octavo uses ~/.cache/octavo/third_party.
The library links nothing from ONNX Runtime: it uses the C API handed to RegisterCustomOps.
Rebuilds only when the sources, flags, headers or compiler change (a hash kept beside the library).

Build-time tooling: setup.py's build_ext runs it at pip install, `make op` from a checkout, and a user on a CPU
no packaged build fits. Nothing at run time imports it; the variant table it compiles
(octavo.runtime.backends.op_variants) belongs to the loader. This module imports nothing outside the standard
library and octavo.errors / resources / runtime.backends.op_variants: setup.py runs it inside pip's isolated build
environment.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from octavo.errors import OpLibraryError
from octavo.resources import checkout_root, data_path, in_checkout
from octavo.runtime.backends.op_variants import LIBRARY_NAME, Variant, library_dir, packaged_variants

logger = logging.getLogger(__name__)

SOURCE_DIR = data_path("plugins/onnxruntime")
HEADER = "onnxruntime_c_api.h"
SYSTEM_INCLUDE_DIRS = (
    Path("/usr/include/onnxruntime"),
    Path("/usr/local/include/onnxruntime"),
    Path("/usr/include/onnxruntime/core/session"),
    Path("/usr/local/include/onnxruntime/core/session"),
    Path("/usr/include"),
    Path("/usr/local/include"),
)
DEBIAN_PACKAGE = "libonnxruntime-dev"
DEBIAN_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
DEBIAN_SOURCE = f"""Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: {DEBIAN_KEYRING}
"""
COMPILE_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-fopenmp-simd", "-fvisibility=hidden", "-Wall", "-Wextra")
LINK_FLAGS = ("-shared",)
NATIVE_FLAGS = ("-march=native",)
HOW_TO_FIX_HEADERS = (
    "install ONNX Runtime's C/C++ headers (Debian/Ubuntu: `apt-get install libonnxruntime-dev`, from trixie or "
    "newer) or set ORT_INCLUDE_DIR to a folder containing onnxruntime_c_api.h (e.g. from an onnxruntime release "
    "tarball's include/ folder)"
)


def third_party_dir() -> Path:
    """Where fetched headers go: the checkout's third_party/, or a per-user cache for an installed octavo."""
    if in_checkout():
        return checkout_root() / "third_party"
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "octavo" / "third_party"


@dataclass(slots=True)
class BuildPlan:
    compiler: str
    include_dir: Path
    sources: list[Path]
    flags: list[str]
    output: Path

    def compile_command(self, source: Path, obj: Path) -> list[str]:
        return [self.compiler, *self.flags, f"-I{self.include_dir}", f"-I{SOURCE_DIR}", "-c", str(source),
                "-o", str(obj)]

    def link_command(self, objects: list[Path], target: Path) -> list[str]:
        return [self.compiler, *self.flags, *LINK_FLAGS, *map(str, objects), "-o", str(target)]

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        for part in [*self.flags, *LINK_FLAGS, str(self.include_dir), *map(str, self.sources)]:
            digest.update(part.encode() + b"\0")
        for path in sorted(SOURCE_DIR.glob("*.[ch]*")) + [self.include_dir / HEADER]:
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
        digest.update(_compiler_version(self.compiler).encode())
        return digest.hexdigest()


@contextlib.contextmanager
def _exclusive(lock_file: Path) -> Iterator[None]:
    """Serialises fetches/builds between processes (e.g. `make op` beside a test run)."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _compiler_version(compiler: str) -> str:
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False)
    return result.stdout.splitlines()[0] if result.stdout else compiler


def find_compiler() -> str:
    for candidate in (os.environ.get("CXX"), "g++", "c++"):
        if candidate and shutil.which(candidate):
            return candidate
    raise OpLibraryError(
        "no C++17 compiler found (looked for $CXX, g++, c++): install one "
        "(Debian/Ubuntu: `apt-get install g++`) or set CXX, then run `make op`"
    )


def _holds_header(folder: Path) -> bool:
    return (folder / HEADER).is_file()


def fetched_include_dir() -> Path:
    return third_party_dir() / "ort" / "usr" / "include" / "onnxruntime"


def find_include_dir(*, fetch: bool = True) -> Path:
    """The folder holding onnxruntime_c_api.h, fetching Debian's headers when nothing else has them."""
    env = os.environ.get("ORT_INCLUDE_DIR")
    if env:
        folder = Path(env)
        for candidate in (folder, folder / "onnxruntime", folder / "onnxruntime" / "core" / "session"):
            if _holds_header(candidate):
                return candidate
        raise OpLibraryError(f"ORT_INCLUDE_DIR={env} does not contain {HEADER}; point it at the folder that does")
    for folder in (*SYSTEM_INCLUDE_DIRS, fetched_include_dir()):
        if _holds_header(folder):
            return folder
    if not fetch:
        raise OpLibraryError(f"ONNX Runtime headers not found: {HOW_TO_FIX_HEADERS}")
    with _exclusive(third_party_dir() / ".fetch.lock"):
        if not _holds_header(fetched_include_dir()):  # another process may have fetched meanwhile
            fetch_debian_headers()
    return fetched_include_dir()


def _run(command: list[str], *, cwd: Path | None = None) -> None:
    logger.info("running %s", " ".join(command))
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise OpLibraryError(f"`{' '.join(command[:2])} ...` failed (exit {result.returncode}):\n{tail}\n"
                             f"Cannot fetch {DEBIAN_PACKAGE}: {HOW_TO_FIX_HEADERS}")


def fetch_debian_headers() -> None:
    """Download and unpack Debian trixie's libonnxruntime-dev into third_party/ort (private apt config)."""
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise OpLibraryError(f"ONNX Runtime headers not found and `{tool}` is unavailable to fetch them: "
                                 f"{HOW_TO_FIX_HEADERS}")
    if not DEBIAN_KEYRING.is_file():
        raise OpLibraryError(f"ONNX Runtime headers not found and {DEBIAN_KEYRING} (package debian-archive-keyring) "
                             f"is missing, so Debian's {DEBIAN_PACKAGE} cannot be verified: {HOW_TO_FIX_HEADERS}")
    third_party = third_party_dir()
    apt = third_party / "apt"
    parts = apt / "sources.list.d"
    for folder in (parts, apt / "lists" / "partial", apt / "cache" / "archives" / "partial", apt / "debs"):
        folder.mkdir(parents=True, exist_ok=True)
    (apt / "sources.list").write_text("")  # empty: the machine's own sources are not used
    (parts / "debian-trixie.sources").write_text(DEBIAN_SOURCE)
    (apt / "preferences.d").mkdir(exist_ok=True)
    options = [
        f"-oDir::Etc::SourceList={apt / 'sources.list'}",
        f"-oDir::Etc::SourceParts={parts}",
        f"-oDir::Etc::Preferences={apt / 'preferences'}",
        f"-oDir::Etc::PreferencesParts={apt / 'preferences.d'}",
        f"-oDir::State::Lists={apt / 'lists'}",
        f"-oDir::Cache={apt / 'cache'}",
        "-oAPT::Sandbox::User=root" if os.geteuid() == 0 else "-oAPT::Sandbox::User=" + _user_name(),
        "-oAcquire::Languages=none",
        "-oDebug::NoLocking=true",
        "-qq",
    ]
    logger.warning("fetching %s from Debian trixie into %s", DEBIAN_PACKAGE, third_party)
    _run(["apt-get", *options, "update"])
    debs = apt / "debs"
    for old in debs.glob("*.deb"):
        old.unlink()
    _run(["apt-get", *options, "download", DEBIAN_PACKAGE], cwd=debs)
    packages = sorted(debs.glob(f"{DEBIAN_PACKAGE}_*.deb"))
    if not packages:
        raise OpLibraryError(f"apt-get download {DEBIAN_PACKAGE} produced no .deb in {debs}: {HOW_TO_FIX_HEADERS}")
    target = third_party / "ort"
    staging = Path(tempfile.mkdtemp(prefix="ort-", dir=third_party))
    try:
        _run(["dpkg-deb", "-x", str(packages[-1]), str(staging)])
        if not _holds_header(staging / "usr" / "include" / "onnxruntime"):
            raise OpLibraryError(f"{packages[-1].name} does not contain {HEADER}: {HOW_TO_FIX_HEADERS}")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _user_name() -> str:
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name


def _sources() -> list[Path]:
    sources = sorted(SOURCE_DIR.glob("*.cc"))
    if not sources:
        raise OpLibraryError(f"no C++ sources in {SOURCE_DIR}; is this a complete octavo checkout or package?")
    return sources


def plan_build(*, native: bool | None = None, fetch: bool = True, extra_flags: tuple[str, ...] = (),
               output: Path | None = None) -> BuildPlan:
    """The build for this machine (-march=native unless native=False or $OCTAVO_OP_NATIVE=0)."""
    if native is None:
        native = os.environ.get("OCTAVO_OP_NATIVE", "1") != "0"
    flags = list(COMPILE_FLAGS)
    if native:
        flags += NATIVE_FLAGS
    flags += os.environ.get("OCTAVO_OP_CXXFLAGS", "").split()
    flags += extra_flags
    return BuildPlan(find_compiler(), find_include_dir(fetch=fetch), _sources(), flags,
                     output or library_dir() / LIBRARY_NAME)


def plan_variant(variant: Variant, folder: Path, *, fetch: bool = True) -> BuildPlan:
    """The portable build VARIANT (no -march=native), written to FOLDER/liboctavo_ort.<variant>.so."""
    flags = [*COMPILE_FLAGS, *variant.compile_flags, *os.environ.get("OCTAVO_OP_CXXFLAGS", "").split()]
    return BuildPlan(find_compiler(), find_include_dir(fetch=fetch), _sources(), flags, folder / variant.file_name)


def build_library(*, force: bool = False, native: bool | None = None, extra_flags: tuple[str, ...] = (),
                  output: Path | None = None) -> Path:
    """Build (or reuse) the custom-op library and return its path (default: octavo/_lib/liboctavo_ort.so)."""
    return build_plans([plan_build(native=native, extra_flags=extra_flags, output=output)], force=force)[0]


def build_packaged(folder: Path | None = None, *, force: bool = False) -> list[Path]:
    """Build (or reuse) every portable variant a wheel for this platform ships, in parallel; their paths."""
    folder = folder or library_dir()
    return build_plans([plan_variant(v, folder) for v in packaged_variants()], force=force)


def build_plans(plans: list[BuildPlan], *, force: bool = False, jobs: int | None = None) -> list[Path]:
    """Runs PLANS, every source of every plan compiled in parallel (JOBS processes, default one per core)."""
    folders = sorted({plan.output.parent for plan in plans})
    with contextlib.ExitStack() as stack:
        for folder in folders:
            stack.enter_context(_exclusive(folder / ".build.lock"))
        stale = [plan for plan in plans if force or not _up_to_date(plan)]
        if stale:
            _compile_and_link(stale, jobs or os.cpu_count() or 1)
    return [plan.output for plan in plans]


def _stamp(plan: BuildPlan) -> Path:
    return plan.output.with_name(plan.output.name + ".sha256")


def _up_to_date(plan: BuildPlan) -> bool:
    stamp = _stamp(plan)
    if plan.output.is_file() and stamp.is_file() and stamp.read_text().strip() == plan.fingerprint():
        logger.info("%s is up to date", plan.output)
        return True
    return False


def _check(command: list[str], what: str) -> None:
    logger.info("%s", " ".join(command))
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-30:])
        raise OpLibraryError(f"{what} failed:\n{tail}")


def _compile_and_link(plans: list[BuildPlan], jobs: int) -> None:
    with tempfile.TemporaryDirectory(prefix="octavo-op-") as scratch:
        objects = {id(plan): [Path(scratch) / f"{index}-{source.stem}.o" for source in plan.sources]
                   for index, plan in enumerate(plans)}
        compiles = [(plan.compile_command(source, obj), f"compiling {source.name} for {plan.output.name}")
                    for plan in plans for source, obj in zip(plan.sources, objects[id(plan)])]
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            for future in [pool.submit(_check, *job) for job in compiles]:
                future.result()
        for plan in plans:
            _link(plan, objects[id(plan)])


def _link(plan: BuildPlan, objects: list[Path]) -> None:
    plan.output.parent.mkdir(parents=True, exist_ok=True)
    fingerprint = plan.fingerprint()
    # Link beside the target and rename: processes that loaded the old library keep their copy.
    fd, tmp_name = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=plan.output.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        _check(plan.link_command(objects, tmp), f"linking {plan.output.name}")
        tmp.chmod(0o755)
        tmp.replace(plan.output)
        _stamp(plan).write_text(fingerprint + "\n")
    finally:
        tmp.unlink(missing_ok=True)


def main(argv: list[str] | None = None, prog: str = "python -m octavo.oplib_build") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    parser.add_argument("--portable", action="store_true", help="build liboctavo_ort.so without -march=native")
    parser.add_argument("--packaged", action="store_true",
                        help="build the portable variants a wheel ships (liboctavo_ort.<variant>.so) instead")
    parser.add_argument("--out", type=Path, default=None, help="folder for --packaged (default: octavo/_lib)")
    parser.add_argument("--print-include-dir", action="store_true", help="print the ORT header folder and exit")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.print_include_dir:
            print(find_include_dir())
            return 0
        if args.packaged:
            paths = build_packaged(args.out, force=args.force)
        else:
            paths = [build_library(force=args.force, native=False if args.portable else None)]
    except OpLibraryError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print("\n".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
