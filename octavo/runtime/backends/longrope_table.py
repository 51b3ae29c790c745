"""LongRoPE's factor set chosen by the engine's context, as vLLM and llama.cpp choose it.

transformers picks a Phi model's long or short rope factors per forward call by the sequence length; a paged
KV cache keeps keys rotated once, so servers fix the set per engine: vLLM uses the long factors when
`max_model_len` > `original_max_position_embeddings`, llama.cpp when its context does. The export picks by
the model's full context (octavo.export.rope.complete_longrope, recorded in the manifest's rope_scaling as
`factors`); an engine started with a `max_model_len` on the other side of the original context swaps the
graph's `rope.inv_freq` table in memory before the session is created (the export on disk is unchanged).
The attention factor is the same for both sets, so nothing else changes.
"""
from __future__ import annotations

import logging
from typing import Any

import onnx
from onnx import numpy_helper

from octavo.export.rope import inv_freq

log = logging.getLogger(__name__)

TABLE = "rope.inv_freq"


def wanted_factors(rope_scaling: dict[str, Any] | None, max_model_len: int) -> str | None:
    """"long" or "short" for a longrope model served with MAX_MODEL_LEN tokens; None for any other rope."""
    if not rope_scaling or rope_scaling.get("rope_type") != "longrope":
        return None
    return "long" if max_model_len > int(rope_scaling["original_max_position_embeddings"]) else "short"


def select_longrope_factors(model: onnx.ModelProto, rope_scaling: dict[str, Any] | None, rope_theta: float,
                            max_model_len: int) -> bool:
    """Rewrite MODEL's rope.inv_freq with the factor set MAX_MODEL_LEN calls for, when the export chose the
    other one; True when it did. The rotary dimension is the factor lists' length times 2."""
    want = wanted_factors(rope_scaling, max_model_len)
    if want is None or rope_scaling is None or rope_scaling.get("factors") == want:
        return False
    scaling = {**rope_scaling, "factors": want}
    table = inv_freq(rope_theta, 2 * len(scaling["short_factor"]), scaling)
    for index, tensor in enumerate(model.graph.initializer):
        if tensor.name == TABLE:
            if tuple(tensor.dims) != table.shape:
                return False  # not a table this rope wrote; leave the graph as exported
            model.graph.initializer[index].CopyFrom(numpy_helper.from_array(table, TABLE))
            log.info("longrope: using the %s factors (max_model_len %d, original context %d)", want, max_model_len,
                     rope_scaling["original_max_position_embeddings"])
            return True
    return False
