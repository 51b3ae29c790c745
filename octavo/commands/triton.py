"""`octavo triton MODEL --repo-out DIR`: write a ready Triton model repository for MODEL and serve it with a real
tritonserver (the one bundled by nvidia-pytriton, or $TRITONSERVER_DIR). `--no-serve` only writes the repository,
which then also works with the tritonserver of NVIDIA's container."""
from __future__ import annotations

import argparse
import re
import shutil
import signal
import tempfile
from pathlib import Path

from octavo.errors import InvalidRequestError, ModelFormatError
from octavo.serving.engine_params import engine_args_from_strings, engine_parameter_names

HELP = "serve a model behind NVIDIA Triton Inference Server (writes a model repository, starts tritonserver)"

MODEL_NAME = "octavo"
# config.pbtxt parameters: model_path and every EngineArgs field (model.py converts them by the field's type)
PARAMETER_KEYS = ("model_path", *engine_parameter_names())
_PARAM_RE = re.compile(r'parameters\s*\{\s*key:\s*"(?P<key>[^"]+)"\s*value:\s*\{\s*string_value:\s*"(?P<value>[^"]*)"\s*\}\s*\}')
_INSTANCE_RE = re.compile(r"instance_group\s*\[\s*\{\s*count:\s*\d+")


def template_dir() -> Path:
    """model_repo/octavo of this checkout (the template the generator copies)."""
    import octavo

    path = Path(octavo.__file__).resolve().parent.parent / "model_repo" / MODEL_NAME
    if not (path / "config.pbtxt").is_file():
        raise ModelFormatError(f"the Triton model template is not at {path}; pass --template model_repo/octavo "
                               "from an octavo checkout")
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
    parser.add_argument("model", help="octavo export folder, HF checkpoint folder or .gguf file")
    parser.add_argument("--repo-out", default=None,
                        help="folder to write the model repository into (default: a temporary folder)")
    parser.add_argument("--template", default=None, help="model template folder (default: model_repo/octavo)")
    parser.add_argument("--no-serve", action="store_true", help="only write the repository, do not start tritonserver")
    parser.add_argument("--instances", type=int, default=None, help="instance_group count (engines in this server)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="folder for the stub environment and backend links")
    parser.add_argument("--install-numpy", action="store_true",
                        help="pip-install numpy<2 for the python-backend stub if it is missing (see docs/triton.md)")
    for key in PARAMETER_KEYS[1:]:  # every EngineArgs field, as text (model.py converts it by the field's type)
        parser.add_argument(f"--{key.replace('_', '-')}", dest=key, default=None, metavar="VALUE",
                            help=f"engine argument {key} (a config.pbtxt parameter; default: the engine's)")


def run(args: argparse.Namespace) -> int:
    from octavo.runtime.engine import resolve_model_dir
    from octavo.serving.triton_launcher import TritonServer

    params = {k: getattr(args, k) for k in PARAMETER_KEYS[1:] if getattr(args, k) is not None}
    engine_args = engine_args_from_strings(args.model, params, where="engine parameter")  # refuse bad values now
    # export once now (in the format asked for: --weights int8 exports the int8 variant), not in every instance
    model = resolve_model_dir(engine_args.model, engine_args.weights, engine_args.quant_block_size,
                              engine_args.quantize_lm_head)
    repo = Path(args.repo_out) if args.repo_out else Path(tempfile.mkdtemp(prefix="octavo-triton-repo-"))
    write_model_repository(repo, model, parameters=params, instance_count=args.instances, template=args.template)
    print(f"model repository: {repo} (model {model})", flush=True)
    if args.no_serve:
        return 0
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="octavo-triton-run-"))
    server = TritonServer(repo, workdir, http_port=args.http_port, grpc_port=args.grpc_port,
                          metrics_port=args.metrics_port, log_verbose=args.log_verbose,
                          auto_install_numpy=args.install_numpy)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM = Ctrl-C: stop the server, also while it starts
    try:
        server.start(stdout_to_log=False)
        print(f"tritonserver ready: HTTP {server.http_url}  gRPC {server.grpc_url}  "
              f"metrics 127.0.0.1:{args.metrics_port}  (Ctrl-C stops it)", flush=True)
        code = server.wait()
    except KeyboardInterrupt:
        code = 0
    finally:
        server.stop()
    return 0 if code in (0, -signal.SIGTERM) else int(code)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
