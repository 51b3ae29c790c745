"""Find, prepare and run a real NVIDIA Triton Inference Server for octavo's model repository.

Three installations are recognised, in this order:
1. an explicit one: `$TRITONSERVER_DIR` (a folder holding bin/tritonserver and backends/, e.g. /opt/tritonserver
   in NVIDIA's container);
2. the tritonserver bundled by the `nvidia-pytriton` wheel (`pip install --no-deps nvidia-pytriton==0.7.0`, or
   `make setup`'s `--target <env>/pytriton`, see pytriton_target_dir),
   which ships tritonserver 2.51 with only the python backend, one python-backend stub per Python version,
   and its shared libraries in site-packages/nvidia_pytriton.libs;
3. a `tritonserver` on PATH (its backends in ../backends).

For the wheel, the python backend's stub must sit in `<backend-directory>/python/`, so a small backend folder
of symlinks is made per run (the wheel itself is never modified). The stub is linked against `libpython3.X.so`;
LD_LIBRARY_PATH starts with this interpreter's LIBDIR so it loads OUR libpython (otherwise Debian's
/lib/x86_64-linux-gnu copy is picked up and fails with "'_thread.RLock' object has no attribute
'_recursion_count'"). The embedded interpreter finds its prefix by looking up `python3` on PATH, so this
interpreter's bin/ goes first on PATH; the stub then runs inside that environment, in isolated mode (it ignores
PYTHONPATH).

The wheel's stubs are built against numpy 1.x with an old pybind11: under numpy 2 every tensor the stub copies
comes out with a wrong stride (a BYTES input "hello" arrives as five copies of its first byte and the stub dies
in deserialize_bytes_tensor). So when this environment has numpy >= 2, the stub runs in a small per-run
environment (`stub_env/`: a venv without pip) whose site-packages lists, in order, a numpy<2 overlay folder and
then this environment's site-packages (`site.addsitedir`, so editable installs such as octavo keep working).
The overlay is made once with `pip install --no-deps --target <overlay> numpy==1.26.4` (install_numpy_overlay).
NVIDIA's container (numpy 1.x, stub built with it) needs none of this.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from octavo.errors import BackendUnavailableError

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "install the tritonserver bundled by NVIDIA's PyTriton wheel into this environment with "
    "`pip install --no-deps nvidia-pytriton==0.7.0` (and `pip install 'tritonclient[grpc,http]'` for clients), "
    "or point $TRITONSERVER_DIR at a Triton installation such as /opt/tritonserver in NVIDIA's container"
)


@dataclass(slots=True)
class TritonInstall:
    """Where a tritonserver installation keeps its parts."""

    binary: Path  # bin/tritonserver
    backends: Path  # folder holding python/ (libtriton_python.so, triton_python_backend_utils.py)
    stub: Path | None  # python-backend stub for this Python, when it is not already in backends/python/
    lib_dirs: list[Path] = field(default_factory=list)  # shared libraries the binary needs
    origin: str = ""  # "TRITONSERVER_DIR" | "nvidia-pytriton" | "PATH"


def find_tritonserver() -> TritonInstall:
    """Locate a usable tritonserver; raises BackendUnavailableError (with the install command) if none."""
    explicit = os.environ.get("TRITONSERVER_DIR")
    if explicit:
        root = Path(explicit)
        binary = root / "bin" / "tritonserver"
        if not binary.is_file():
            raise BackendUnavailableError(f"$TRITONSERVER_DIR={explicit} has no bin/tritonserver")
        return TritonInstall(binary, root / "backends", None, [root / "lib"], "TRITONSERVER_DIR")
    wheel = _find_pytriton()
    if wheel is not None:
        return wheel
    on_path = shutil.which("tritonserver")
    if on_path:
        root = Path(on_path).resolve().parent.parent
        return TritonInstall(Path(on_path), root / "backends", None, [root / "lib"], "PATH")
    raise BackendUnavailableError(f"no tritonserver found: {INSTALL_HINT}")


def pytriton_target_dir() -> Path:
    """Where `make setup` installs nvidia-pytriton (`pip install --no-deps --target`, outside site-packages, so that
    pip never checks its numpy<2 pin against this environment): $OCTAVO_PYTRITON_DIR or <this environment>/pytriton."""
    return Path(os.environ.get("OCTAVO_PYTRITON_DIR") or Path(sys.prefix) / "pytriton")


def _pytriton_package() -> Path | None:
    """nvidia-pytriton's `pytriton` folder: importable here, or in pytriton_target_dir(); None if neither."""
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    target = pytriton_target_dir() / "pytriton"
    return target if (target / "tritonserver").is_dir() else None


def pytriton_installed() -> bool:
    """Whether nvidia-pytriton's tritonserver is installed (either way `make setup` or pip may have put it)."""
    return _pytriton_package() is not None


def _find_pytriton() -> TritonInstall | None:
    pkg = _pytriton_package()
    if pkg is None:
        return None
    dist = pkg / "tritonserver"
    binary = dist / "bin" / "tritonserver"
    if not binary.is_file():
        return None
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise BackendUnavailableError(
            f"nvidia-pytriton at {pkg} has no python-backend stub for Python {version}; "
            f"stubs exist for {sorted(p.name for p in (dist / 'python_backend_stubs').iterdir())}"
        )
    libs = [d for d in (pkg.parent / "nvidia_pytriton.libs", dist / "external_libs") if d.is_dir()]
    return TritonInstall(binary, dist / "backends", stub, libs, "nvidia-pytriton")


def prepare_backend_dir(install: TritonInstall, workdir: Path) -> Path:
    """A backend directory whose python/ holds the stub for this Python (symlinks; the install is untouched)."""
    if install.stub is None:
        return install.backends
    out = Path(workdir) / "backends"
    if out.exists():
        shutil.rmtree(out)
    for src_dir in install.backends.iterdir():
        if not src_dir.is_dir():
            continue
        dst_dir = out / src_dir.name
        dst_dir.mkdir(parents=True)
        for item in src_dir.iterdir():
            if item.name != "__pycache__":
                (dst_dir / item.name).symlink_to(item.resolve())
    stub_dst = out / "python" / "triton_python_backend_stub"
    if stub_dst.exists() or stub_dst.is_symlink():
        stub_dst.unlink()
    stub_dst.symlink_to(install.stub.resolve())
    return out


NUMPY_FOR_STUB = "numpy==1.26.4"


def numpy_overlay_dir() -> Path:
    """Folder holding numpy<2 for the wheel's stub: $OCTAVO_TRITON_NUMPY or <this environment>/triton-numpy."""
    return Path(os.environ.get("OCTAVO_TRITON_NUMPY") or Path(sys.prefix) / "triton-numpy")


def stub_needs_numpy_overlay(install: TritonInstall) -> bool:
    """True for the wheel's stubs (built for numpy 1.x) when this environment has numpy >= 2."""
    import numpy

    return install.origin == "nvidia-pytriton" and int(numpy.__version__.split(".")[0]) >= 2


def install_numpy_overlay(target: Path | None = None) -> Path:
    """`pip install --no-deps --target TARGET numpy==1.26.4` (only numpy; nothing else is touched)."""
    target = Path(target or numpy_overlay_dir())
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), NUMPY_FOR_STUB]
    log.warning("installing numpy<2 for the Triton python-backend stub: %s", " ".join(cmd))
    subprocess.run(cmd, check=True)
    return target


def prepare_stub_env(install: TritonInstall, workdir: Path, auto_install: bool = False) -> Path:
    """The bin/ folder to put first on PATH so the stub's embedded interpreter runs where `import octavo` works."""
    if not stub_needs_numpy_overlay(install):
        return Path(sys.executable).parent
    overlay = numpy_overlay_dir()
    if not (overlay / "numpy" / "__init__.py").is_file():
        if not auto_install:
            raise BackendUnavailableError(
                f"the python-backend stub of nvidia-pytriton needs numpy<2 but this environment has numpy>=2 and "
                f"{overlay} holds no numpy; run `{sys.executable} -m pip install --no-deps --target {overlay} "
                f"{NUMPY_FOR_STUB}` (only the stub sees it)"
            )
        install_numpy_overlay(overlay)
    env_dir = Path(workdir) / "stub_env"
    if env_dir.exists():
        shutil.rmtree(env_dir)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    purelib = sysconfig.get_path("purelib")  # this environment's site-packages
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site_dir = env_dir / "lib" / ver / "site-packages"
    site_dir.mkdir(parents=True, exist_ok=True)
    (site_dir / "octavo_triton_stub.pth").write_text(
        f"{overlay.resolve()}\nimport site; site.addsitedir({purelib!r})\n"
    )
    return env_dir / "bin"


def server_env(install: TritonInstall, stub_bin: Path | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver and its python-backend stub (see the module docstring for why)."""
    env = dict(os.environ if base is None else base)
    libdir = sysconfig.get_config_var("LIBDIR")
    lib_path = [p for p in [libdir, *map(str, install.lib_dirs)] if p]
    if env.get("LD_LIBRARY_PATH"):
        lib_path.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(lib_path)
    bin_dir = str(stub_bin or Path(sys.executable).parent)  # the stub's interpreter finds pyvenv.cfg there
    env["PATH"] = bin_dir + (":" + env["PATH"] if env.get("PATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def shm_prefix() -> str:
    """A /dev/shm name prefix unique to one server run."""
    return f"octavo_triton_{os.getpid()}_{os.urandom(4).hex()}_"


# "E1201 12:00:00.000 123 file.cc:45] "message"" and the fatal "error: creating server: ..." lines
_ERROR_LINE = re.compile(r"^(?:E\d{4} [\d:.]+\s+\d+ \S+\] |(?=error: ))(.*)$", re.MULTILINE)
_LIVE_MODELS = re.compile(r"Timeout \d+: Found (\d+) live models")  # printed once a second while it waits
_HARMLESS = ("CudaDriverHelper has not been initialized",)  # on every machine without a GPU


def check_ports_free(ports: list[tuple[str, str, int]]) -> None:
    """BackendUnavailableError naming every (what, host, port) that cannot be bound now (port 0 is skipped)."""
    taken = []
    for what, host, port in ports:
        if port == 0:
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is not "taken"
            try:
                s.bind((host, port))
            except OSError as exc:
                taken.append(f"{what} {host}:{port} ({exc.strerror or exc})")
    if taken:
        raise BackendUnavailableError(
            f"cannot start tritonserver: {'; '.join(taken)}; stop what uses "
            f"{'it' if len(taken) == 1 else 'them'} or pick other ports (--http-port, --grpc-port, --metrics-port)")


def _connect_host(host: str) -> str:
    """Where a local client reaches a server bound to HOST (the wildcard addresses: loopback)."""
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(host, f"[{host}]" if ":" in host else host)


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to 0 and let the OS choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class TritonServer:
    """One tritonserver process serving a model repository; `start()` waits until it is ready."""

    model_repository: Path
    workdir: Path  # backend symlinks and the server log go here
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    # tritonserver's own default is 0.0.0.0 (every interface); octavo binds loopback unless told otherwise
    http_host: str = "127.0.0.1"
    grpc_host: str = "127.0.0.1"
    metrics_host: str = "127.0.0.1"
    log_verbose: int = 0
    # how long tritonserver waits on SIGTERM for in-flight requests and model unloads before it exits 1 anyway
    exit_timeout_s: int = 10
    extra_args: list[str] = field(default_factory=list)
    auto_install_numpy: bool = False  # run pip for the numpy<2 overlay when it is missing
    install: TritonInstall | None = None
    stub_bin: Path | None = None
    shm_prefix: str = ""
    process: subprocess.Popen | None = None
    log_path: Path | None = None

    def command(self) -> list[str]:
        self.shm_prefix = self.shm_prefix or shm_prefix()
        install = self.install or find_tritonserver()
        self.install = install
        backends = prepare_backend_dir(install, self.workdir)
        self.stub_bin = prepare_stub_env(install, self.workdir, self.auto_install_numpy)
        return [
            str(install.binary),
            f"--model-repository={Path(self.model_repository).resolve()}",
            f"--backend-directory={backends}",
            f"--http-address={self.http_host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.grpc_host}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.metrics_host}",
            f"--metrics-port={self.metrics_port}",
            "--disable-auto-complete-config",
            "--strict-readiness=true",
            "--exit-on-error=true",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--log-verbose={self.log_verbose}",
            # the python backend names its /dev/shm regions from this prefix; our own prefix lets stop() remove
            # the regions a killed server leaves behind (1 MiB and up each)
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            *self.extra_args,
        ]

    def ports(self) -> list[tuple[str, str, int]]:
        return [("HTTP", self.http_host, self.http_port), ("gRPC", self.grpc_host, self.grpc_port),
                ("metrics", self.metrics_host, self.metrics_port)]

    def start(self, timeout_s: float = 120.0, stdout_to_log: bool = True) -> None:
        """Check the ports, start the server and wait until /v2/health/ready answers 200 (raises if a port is
        taken, or the server exits or times out)."""
        check_ports_free(self.ports())
        self.workdir = Path(self.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        assert self.install is not None
        log.info("starting %s", " ".join(cmd))
        self.log_path = self.workdir / "tritonserver.log"
        out = open(self.log_path, "wb") if stdout_to_log else None  # noqa: SIM115 (closed with the process)
        try:
            self.process = subprocess.Popen(
                cmd, env=server_env(self.install, self.stub_bin), stdout=out, stderr=subprocess.STDOUT if out else None,
                start_new_session=True,
            )
        finally:
            if out is not None:
                out.close()
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()  # also sweeps stubs a half-started server leaves behind
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                failures = "".join(f"\n  {line}" for line in self.load_failures())
                errors = "".join(f"\n  {line}" for line in self.error_lines())
                raise BackendUnavailableError(
                    f"tritonserver exited with code {self.process.returncode} before it was ready"
                    + (f"; models that failed to load:{failures}" if failures else "")
                    + (f"; its errors:{errors}" if errors else "")
                    + (f"\nthe end of its log ({self.log_path}):\n{self.log_tail(2000)}" if self.log_path else
                       " (its output went to this terminal, above)")
                )
            if self.ready():
                return
            time.sleep(0.2)
        raise BackendUnavailableError(f"tritonserver was not ready within {timeout_s:.0f} s; its log:\n{self.log_tail()}")

    @property
    def http_url(self) -> str:
        return f"{_connect_host(self.http_host)}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{_connect_host(self.grpc_host)}:{self.grpc_port}"

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=1) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def error_lines(self, limit: int = 10) -> list[str]:
        """The log's error lines ("E1201 12:00:00.000 123 file.cc:45] message" -> the message), first LIMIT."""
        if self.log_path is None or not self.log_path.exists():
            return []
        found = [m.group(1).strip().strip('"')[:1000] for m in _ERROR_LINE.finditer(self.log_path.read_text(errors="replace"))]
        return [line for line in found if not any(h in line for h in _HARMLESS)][:limit]

    def log_tail(self, chars: int = 6000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log file: its output went to this terminal)"
        return self.log_path.read_text(errors="replace")[-chars:]

    def load_failures(self) -> list[str]:
        """The log's "failed to load 'MODEL' ..." lines (the reason a model is unavailable), first 1000 chars each."""
        if self.log_path is None or not self.log_path.exists():
            return []
        return [line.split("] ", 1)[-1][:1000] for line in self.log_path.read_text(errors="replace").splitlines()
                if "failed to load '" in line]

    def wait(self) -> int:
        assert self.process is not None
        return self.process.wait()

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM, wait, then SIGKILL the server; finally sweep its process group (python-backend stubs orphaned
        by a server that exited on its exit timeout keep running otherwise) and its /dev/shm regions."""
        proc, self.process = self.process, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("tritonserver did not stop within %.0f s; killing it", timeout_s)
                proc.kill()
                proc.wait(timeout=10)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group is the server's own (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass
        for region in Path("/dev/shm").glob(f"{self.shm_prefix}*") if self.shm_prefix else []:
            region.unlink(missing_ok=True)
        stuck = self.models_left_loaded() if proc.returncode not in (0, -signal.SIGTERM) else 0
        if stuck:
            log.warning(
                "tritonserver exited %s after --exit-timeout-secs=%d with %d model(s) still loaded, so finalize() "
                "did not run. With octavo's model this is tritonserver 2.51's frontends (gRPC streams, HTTP "
                "generate_stream) keeping a request of a cancelled stream for ever (docs/triton.md, 'Shutdown after "
                "cancelled streams'); octavo had answered every request and flushes its trace per step. The stubs "
                "were killed and their shared memory removed: the next start is clean. Its log: %s",
                proc.returncode, self.exit_timeout_s, stuck, self.log_path)
        return proc.returncode

    def models_left_loaded(self) -> int:
        """How many models tritonserver still held when its exit timeout ran out (its last "Timeout N: Found M
        live models" line; 0 if it never said so, i.e. every model unloaded)."""
        if self.log_path is None or not self.log_path.exists():
            return 0
        found = _LIVE_MODELS.findall(self.log_path.read_text(errors="replace"))
        return int(found[-1]) if found and found[-1] != "0" else 0
