"""Build the ONNX Runtime custom-op library (`make op` / `python -m octavo.runtime.backends.build_op`).

Compiles plugins/onnxruntime/*.cc with g++ into octavo/_lib/liboctavo_ort.so. ONNX Runtime's C API
headers are not in the onnxruntime wheel; they are taken, in this order, from:
  1. $ORT_INCLUDE_DIR (a folder holding onnxruntime_c_api.h),
  2. a system install (/usr/include/onnxruntime, /usr/local/include/onnxruntime, ...),
  3. third_party/ort/ (already fetched), or else
  4. Debian trixie's `libonnxruntime-dev`, fetched with apt-get under a private configuration in
     third_party/apt/ (the machine's own apt sources and state are not read or changed).
The library links nothing from ONNX Runtime: it uses the C API handed to RegisterCustomOps.
Rebuilds only when the sources, flags, headers or compiler change (a hash kept beside the library).
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
from dataclasses import dataclass
from pathlib import Path

from octavo.errors import OpLibraryError
from octavo.runtime.backends.oplib import LIBRARY_NAME, library_dir

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[3]
SOURCE_DIR = REPO_ROOT / "plugins" / "onnxruntime"
THIRD_PARTY = REPO_ROOT / "third_party"
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
BASE_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp-simd", "-fvisibility=hidden", "-Wall", "-Wextra")
HOW_TO_FIX_HEADERS = (
    "install ONNX Runtime's C/C++ headers (Debian/Ubuntu: `apt-get install libonnxruntime-dev`, from trixie or "
    "newer) or set ORT_INCLUDE_DIR to a folder containing onnxruntime_c_api.h (e.g. from an onnxruntime release "
    "tarball's include/ folder)"
)


@dataclass(slots=True)
class BuildPlan:
    compiler: str
    include_dir: Path
    sources: list[Path]
    flags: list[str]
    output: Path

    def command(self, target: Path) -> list[str]:
        return [self.compiler, *self.flags, f"-I{self.include_dir}", f"-I{SOURCE_DIR}",
                *map(str, self.sources), "-o", str(target)]

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        for part in self.command(self.output):
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
    return THIRD_PARTY / "ort" / "usr" / "include" / "onnxruntime"


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
    with _exclusive(THIRD_PARTY / ".fetch.lock"):
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
    apt = THIRD_PARTY / "apt"
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
    logger.warning("fetching %s from Debian trixie into %s", DEBIAN_PACKAGE, THIRD_PARTY)
    _run(["apt-get", *options, "update"])
    debs = apt / "debs"
    for old in debs.glob("*.deb"):
        old.unlink()
    _run(["apt-get", *options, "download", DEBIAN_PACKAGE], cwd=debs)
    packages = sorted(debs.glob(f"{DEBIAN_PACKAGE}_*.deb"))
    if not packages:
        raise OpLibraryError(f"apt-get download {DEBIAN_PACKAGE} produced no .deb in {debs}: {HOW_TO_FIX_HEADERS}")
    target = THIRD_PARTY / "ort"
    staging = Path(tempfile.mkdtemp(prefix="ort-", dir=THIRD_PARTY))
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


def plan_build(*, native: bool | None = None, fetch: bool = True, extra_flags: tuple[str, ...] = (),
               output: Path | None = None) -> BuildPlan:
    if native is None:
        native = os.environ.get("OCTAVO_OP_NATIVE", "1") != "0"
    flags = list(BASE_FLAGS)
    if native:
        flags.append("-march=native")
    flags += os.environ.get("OCTAVO_OP_CXXFLAGS", "").split()
    flags += extra_flags
    sources = sorted(SOURCE_DIR.glob("*.cc"))
    if not sources:
        raise OpLibraryError(f"no C++ sources in {SOURCE_DIR}; is this a complete octavo checkout?")
    return BuildPlan(find_compiler(), find_include_dir(fetch=fetch), sources, flags,
                     output or library_dir() / LIBRARY_NAME)


def build_library(*, force: bool = False, native: bool | None = None, extra_flags: tuple[str, ...] = (),
                  output: Path | None = None) -> Path:
    """Build (or reuse) the custom-op library and return its path (default: octavo/_lib/liboctavo_ort.so)."""
    plan = plan_build(native=native, extra_flags=extra_flags, output=output)
    with _exclusive(plan.output.parent / ".build.lock"):
        return _build(plan, force=force)


def _build(plan: BuildPlan, *, force: bool) -> Path:
    stamp = plan.output.with_name(plan.output.name + ".sha256")
    fingerprint = plan.fingerprint()
    if not force and plan.output.is_file() and stamp.is_file() and stamp.read_text().strip() == fingerprint:
        logger.info("%s is up to date", plan.output)
        return plan.output
    plan.output.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes that loaded the old library keep their copy.
    fd, tmp_name = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=plan.output.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        command = plan.command(tmp)
        logger.info("compiling: %s", " ".join(command))
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            tail = "\n".join(result.stderr.strip().splitlines()[-30:])
            raise OpLibraryError(f"compiling the custom-op library failed:\n{tail}")
        tmp.chmod(0o755)
        tmp.replace(plan.output)
        stamp.write_text(fingerprint + "\n")
    finally:
        tmp.unlink(missing_ok=True)
    return plan.output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m octavo.runtime.backends.build_op", description=__doc__.split("\n")[0])
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    parser.add_argument("--portable", action="store_true", help="build without -march=native")
    parser.add_argument("--print-include-dir", action="store_true", help="print the ORT header folder and exit")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.print_include_dir:
            print(find_include_dir())
            return 0
        path = build_library(force=args.force, native=False if args.portable else None)
    except OpLibraryError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
