"""A Triton model repository for an octavo model: the template (model_repo/octavo: config.pbtxt and the
python-backend model 1/model.py) copied with its config.pbtxt parameters filled in (model_path and every EngineArgs
field that differs from its default). `octavo triton --no-serve` writes only this; it also works with the
tritonserver of NVIDIA's container."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

from octavo.errors import InvalidRequestError, ModelFormatError
from octavo.serving.engine_params import engine_parameter_names

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
