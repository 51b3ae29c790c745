"""LoRA adapters as models of the server (vLLM's --lora-modules): a request whose `model` names an adapter runs with
it (SamplingParams.lora_name) and its response carries that name; /v1/models lists each adapter with its folder
(`root`) and the base model (`parent`). Any other name is the usual 404.
"""
from __future__ import annotations

from typing import Any

from octavo.runtime.async_engine import AsyncEngine
from octavo.runtime.sampling_params import SamplingParams
from octavo.serving.protocol import check_model
from octavo.serving.state import ServerState


def resolve_model(st: ServerState, engine: AsyncEngine, requested: str | None, params: SamplingParams) -> str:
    """The name the response carries: REQUESTED when it names an adapter (PARAMS then runs with it), else the
    served model's; a 404 for a name that is neither."""
    loras = engine.loras.slots
    if requested is not None and requested in loras:
        params.lora_name = requested
        return requested
    check_model(requested, (*st.config.served_model_names, *loras))
    return st.model_name


def adapter_models(st: ServerState, created: int) -> list[dict[str, Any]]:
    """/v1/models entries of the adapters (none while the model loads)."""
    if st.engine is None:
        return []
    registry = st.engine.loras
    return [{"id": name, "object": "model", "created": created, "owned_by": "octavo", "root": registry.adapters[name].path,
             "parent": st.model_name, "max_model_len": st.max_model_len} for name in registry.slots]


__all__ = ["adapter_models", "resolve_model"]
