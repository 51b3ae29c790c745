"""`octavo triton MODEL --repo-out DIR`: write a ready Triton model repository for MODEL and serve it with a real
tritonserver (the one bundled by nvidia-pytriton, or $TRITONSERVER_DIR). `--no-serve` only writes the repository,
which then also works with the tritonserver of NVIDIA's container."""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from octavo.errors import InvalidRequestError
from octavo.triton_server.front_limits import MAX_BODY_BYTES, MAX_JSON_DEPTH  # no aiohttp: --no-serve needs none
from octavo.triton_server.model_repository import write_model_repository

HELP = "serve a model behind NVIDIA Triton Inference Server (writes a model repository, starts tritonserver)"


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
    from octavo.triton_server.launcher import check_ports_free

    ea = engine_args(args, model_argument(args.model)[0])  # refuse bad values now, before any work
    if not args.no_serve:  # a missing serve extra and a taken port are named now, not after an export
        import aiohttp  # noqa: F401 - the front needs it (serve extra); --no-serve only writes the repository
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
    from octavo.triton_server.serve import ServeOptions, serve_repository  # the front needs aiohttp (serve extra)

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="octavo-triton-run-"))
    options = ServeOptions(host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                           metrics_port=args.metrics_port, max_body_bytes=args.max_body_bytes,
                           max_json_depth=args.max_json_depth, log_verbose=args.log_verbose,
                           install_numpy=args.install_numpy)
    return serve_repository(repo, workdir, options)
