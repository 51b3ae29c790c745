"""vLLM's runtime LoRA routes, served only with `octavo serve --allow-runtime-lora-updating` (vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING): the client names a folder on the server, so keep them behind --api-key.

    POST /v1/load_lora_adapter    {"lora_name", "lora_path"}  -> "Success: LoRA adapter 'NAME' added successfully."
    POST /v1/unload_lora_adapter  {"lora_name"}               -> "Success: LoRA adapter 'NAME' removed successfully."

The PEFT folder is read off the event loop; the slot is filled between two engine steps (AsyncEngine.between_steps),
so no step ever sees half an adapter. A name in use, a full set of slots (max_loras), a rank above max_lora_rank or
a folder that is not a LoRA adapter is a 400; unloading an unknown name a 404, one that requests still use a 400.
"""
from __future__ import annotations

import asyncio

from aiohttp import web

from octavo.errors import InvalidRequestError, ModelFormatError
from octavo.runtime.lora import read_peft_adapter
from octavo.serving.api_error import ApiError, bad_request
from octavo.serving.body import Body
from octavo.serving.routes import read_json
from octavo.serving.state import STATE


async def load_lora_adapter(request: web.Request) -> web.Response:
    st = request.app[STATE]
    engine = st.ready_engine()
    b = Body(await read_json(request))
    name, path = b.string("lora_name", None), b.string("lora_path", None)
    if not name or not path:
        raise bad_request("'lora_name' and 'lora_path' are required", "lora_name" if not name else "lora_path")
    if name in st.config.served_model_names:
        raise bad_request(f"{name!r} is the served model's name", "lora_name")
    try:
        adapter = await asyncio.to_thread(read_peft_adapter, name, path, engine.loras.max_rank)
        await engine.between_steps(lambda e: e.add_lora(adapter))
    except (InvalidRequestError, ModelFormatError, OSError) as exc:
        raise bad_request(f"cannot load the LoRA adapter {name!r}: {exc}", "lora_path") from None
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    st = request.app[STATE]
    engine = st.ready_engine()
    b = Body(await read_json(request))
    name = b.string("lora_name", None)
    if not name:
        raise bad_request("'lora_name' is required", "lora_name")
    if name not in engine.loras.slots:
        raise ApiError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="not_found")
    try:
        await engine.between_steps(lambda e: e.remove_lora(name))
    except InvalidRequestError as exc:
        raise bad_request(str(exc), "lora_name") from None
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def add_lora_routes(app: web.Application) -> None:
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)


__all__ = ["add_lora_routes"]
