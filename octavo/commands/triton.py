"""`octavo triton MODEL --repo-out DIR`: write a ready Triton model repository for MODEL and serve it with a real
tritonserver (the one bundled by nvidia-pytriton, or $TRITONSERVER_DIR). `--no-serve` only writes the repository,
which then also works with the tritonserver of NVIDIA's container."""
from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import signal
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from octavo.errors import BackendUnavailableError, InvalidRequestError, ModelFormatError
from octavo.serving.engine_params import engine_parameter_names
from octavo.serving.triton_front import MAX_BODY_BYTES, MAX_JSON_DEPTH

if TYPE_CHECKING:
    from octavo.serving.triton_launcher import TritonServer

HELP = "serve a model behind NVIDIA Triton Inference Server (writes a model repository, starts tritonserver)"

MODEL_NAME = "octavo"
# config.pbtxt parameters: model_path and every EngineArgs field (model.py converts them by the field's type)
PARAMETER_KEYS = ("model_path", *engine_parameter_names())
_PARAM_RE = re.compile(r'parameters\s*\{\s*key:\s*"(?P<key>[^"]+)"\s*value:\s*\{\s*string_value:\s*"(?P<value>[^"]*)"\s*\}\s*\}')
_INSTANCE_RE = re.compile(r"instance_group\s*\[\s*\{\s*count:\s*\d+")


def template_dir() -> Path:
    """model_repo/octavo (the template the generator copies): the installed package's copy or the checkout's."""
    from octavo.resources import data_path

    path = data_path(f"model_repo/{MODEL_NAME}")
    if not (path / "config.pbtxt").is_file():
        raise ModelFormatError(f"the Triton model template is not at {path} (an incomplete install?); reinstall "
                               "octavo or pass --template model_repo/octavo from an octavo checkout")
    return path


def _pbtxt_string(value: str) -> str:
    if '"' in value or "\\" in value or "\n" in value:
        raise InvalidRequestError(f"parameter value {value!r} must not contain quotes, backslashes or newlines")
    return value


def _parameter_entry(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value: {{ string_value: "{_pbtxt_string(str(value))}" }} }}'


def render_config(template: str, parameters: dict[str, str], instance_count: int | None = None) -> str:
    """The template's config.pbtxt with the given parameters' values filled in: entries the template has are
    replaced, the others appended (unknown keys are refused)."""
    unknown = set(parameters) - set(PARAMETER_KEYS)
    if unknown:
        raise InvalidRequestError(f"unknown Triton model parameters {sorted(unknown)}; known: {list(PARAMETER_KEYS)}")
    present = {m.group("key") for m in _PARAM_RE.finditer(template)}

    def fill(match: re.Match[str]) -> str:
        key = match.group("key")
        return _parameter_entry(key, parameters[key]) if key in parameters else match.group(0)

    text = _PARAM_RE.sub(fill, template)
    extra = [_parameter_entry(k, v) for k, v in parameters.items() if k not in present]
    if extra:
        text = text.rstrip("\n") + "\n" + "\n".join(extra) + "\n"
    if instance_count is not None:
        if instance_count < 1:
            raise InvalidRequestError(f"instance count must be >= 1, got {instance_count}")
        text, n = _INSTANCE_RE.subn(f"instance_group [ {{ count: {instance_count}", text)
        if n != 1:
            raise ModelFormatError("the template config.pbtxt has no `instance_group [ { count: N` entry")
    return text


def write_model_repository(out: str | Path, model_path: str | Path, *, parameters: dict[str, str] | None = None,
                           instance_count: int | None = None, template: str | Path | None = None) -> Path:
    """Write OUT/octavo/{config.pbtxt, 1/model.py} from the template with model_path (absolute) and PARAMETERS
    filled in; returns OUT (the folder to pass as --model-repository). OUT/octavo is replaced if it exists."""
    src = Path(template) if template else template_dir()
    out = Path(out)
    model_dir = out / MODEL_NAME
    if model_dir.exists():
        shutil.rmtree(model_dir)
    shutil.copytree(src, model_dir, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    params = {k: str(v) for k, v in (parameters or {}).items() if v is not None}
    params["model_path"] = str(Path(model_path).resolve())
    config = render_config((src / "config.pbtxt").read_text(), params, instance_count)
    (model_dir / "config.pbtxt").write_text(config)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from octavo.commands.engine_flags import add_engine_arguments
    from octavo.export.embedded import EMBEDDED_NAME

    parser.add_argument("model", nargs="?", default=None, help="octavo export folder, HF checkpoint folder or .gguf "
                        f"file (default: the embedded SmolLM2-135M-Instruct, {EMBEDDED_NAME!r})")
    parser.add_argument("--repo-out", default=None,
                        help="folder to write the model repository into (default: a temporary folder)")
    parser.add_argument("--template", default=None, help="model template folder (default: model_repo/octavo)")
    parser.add_argument("--no-serve", action="store_true", help="only write the repository, do not start tritonserver")
    parser.add_argument("--instances", type=int, default=None,
                        help="instance_group count: engines in this server (default: the template's, 1)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address the HTTP front, gRPC and metrics bind (default: %(default)s, loopback; 0.0.0.0 "
                             "exposes them)")
    parser.add_argument("--http-port", type=int, default=8000, help="HTTP port (octavo's checking front)")
    parser.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (tritonserver)")
    parser.add_argument("--metrics-port", type=int, default=8002, help="Prometheus metrics port (tritonserver)")
    parser.add_argument("--max-body-bytes", type=_bytes, default=MAX_BODY_BYTES,
                        help="largest HTTP request body the front passes on (413 above; default: 16M)")
    parser.add_argument("--max-json-depth", type=int, default=MAX_JSON_DEPTH,
                        help="deepest JSON nesting the front passes on (400 above; tritonserver crashes on very deep "
                             "bodies, docs/triton.md)")
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver's --log-verbose level")
    parser.add_argument("--workdir", default=None,
                        help="folder for the stub environment, backend links and tritonserver.log (default: a "
                             "temporary folder)")
    parser.add_argument("--install-numpy", action="store_true",
                        help="pip-install numpy<2 for the python-backend stub if it is missing (see docs/triton.md)")
    add_engine_arguments(parser)  # the same flags as serve/generate; written as config.pbtxt parameters


def _bytes(text: str) -> int:
    from octavo.serving.engine_params import parse_bytes

    try:
        return parse_bytes(text)
    except InvalidRequestError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from octavo.commands.engine_flags import changed_fields, engine_args
    from octavo.export.embedded import model_argument
    from octavo.runtime.model_setup import resolve_model_dir
    from octavo.serving.engine_params import value_text
    from octavo.serving.triton_launcher import TritonServer, check_ports_free, free_port

    ea = engine_args(args, model_argument(args.model)[0])  # refuse bad values now, before any work
    if not args.no_serve:  # a taken port is named now, not after an export and a tritonserver start
        check_ports_free([("HTTP", args.host, args.http_port), ("gRPC", args.host, args.grpc_port),
                          ("metrics", args.host, args.metrics_port)])
    if ea.trace_path:  # the python-backend stub runs in another folder
        ea.trace_path = str(Path(ea.trace_path).resolve())
    params = {k: value_text(v) for k, v in changed_fields(ea).items()}
    # export once now (in the format asked for: --weights int8 exports the int8 variant), not in every instance
    model = resolve_model_dir(ea.model, ea.weights, ea.quant_block_size, ea.quantize_lm_head, ea.quant_kernel)
    repo = Path(args.repo_out) if args.repo_out else Path(tempfile.mkdtemp(prefix="octavo-triton-repo-"))
    write_model_repository(repo, model, parameters=params, instance_count=args.instances, template=args.template)
    print(f"model repository: {repo} (model {model})", flush=True)
    if args.no_serve:
        return 0
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="octavo-triton-run-"))
    # tritonserver's HTTP listens on a private loopback port; the public one is octavo's checking front
    server = TritonServer(repo, workdir, http_port=free_port(), grpc_port=args.grpc_port,
                          metrics_port=args.metrics_port, http_host="127.0.0.1", grpc_host=args.host,
                          metrics_host=args.host, log_verbose=args.log_verbose,
                          auto_install_numpy=args.install_numpy)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM = Ctrl-C: stop the server, also while it starts
    try:
        print(f"starting tritonserver (its log: {workdir / 'tritonserver.log'})", flush=True)
        server.start()
        return asyncio.run(_serve_front(server, args))
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


async def _serve_front(server: TritonServer, args: argparse.Namespace) -> int:
    from octavo.serving.triton_front import FrontConfig, start_front

    config = FrontConfig(upstream=f"http://{server.http_url}", max_body_bytes=args.max_body_bytes,
                         max_json_depth=args.max_json_depth)
    try:
        runner = await start_front(config, args.host, args.http_port)
    except OSError as exc:  # taken since the check
        raise BackendUnavailableError(f"cannot serve HTTP on {args.host}:{args.http_port}: {exc.strerror or exc}; "
                                      "pick another --http-port") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # Ctrl-C / SIGTERM: leave the loop, then stop tritonserver
        loop.add_signal_handler(sig, stop.set)
    print(f"tritonserver ready: HTTP {args.host}:{args.http_port}  gRPC {args.host}:{args.grpc_port}  "
          f"metrics {args.host}:{args.metrics_port}  (Ctrl-C stops it)", flush=True)
    try:
        while not stop.is_set() and server.process is not None and server.process.poll() is None:
            try:  # the process has no awaitable exit here; look again twice a second
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
        if stop.is_set() or server.process is None:
            return 0
        code = server.process.returncode
        print(f"tritonserver exited with code {code}; its log: {server.log_path}", flush=True)
        return 0 if code in (0, -signal.SIGTERM) else 1
    finally:
        await runner.cleanup()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
