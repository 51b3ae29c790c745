"""The checking HTTP front's default limits, importable without aiohttp (so `octavo triton --no-serve`, which only
writes a model repository, runs in a base install). `front` applies them; the command shows them as defaults."""
from __future__ import annotations

MAX_JSON_DEPTH = 64  # deepest JSON nesting passed on to tritonserver (it crashes on very deep bodies)
MAX_BODY_BYTES = 16 << 20  # largest request body passed on (413 above)
