"""Server-sent events as OpenAI streams them: one `data: <json>\\n\\n` per chunk, then `data: [DONE]\\n\\n`."""
from __future__ import annotations

import json
from typing import Any

from aiohttp import web

DONE = b"data: [DONE]\n\n"
HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


async def open_stream(request: web.Request) -> web.StreamResponse:
    """Send the 200 headers of an event stream; the caller then writes events and DONE."""
    resp = web.StreamResponse(status=200, headers=HEADERS)
    await resp.prepare(request)
    return resp
