"""What an embedding request asks and holds (runtime/pooling.py runs it): PoolingParams (vLLM's: the pooling type,
normalize, dimensions), EmbeddingModel (what the loaded model offers), PoolState (one request's pooling so far), and
`pool_state`, the check that turns the first two into the third.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from octavo.errors import InvalidRequestError
from octavo.export.pooling_config import POOLING_TYPES, PoolingConfig


@dataclass(slots=True)
class PoolingParams:
    """What an embedding request asks (vLLM's PoolingParams): None fields take the model's pooling config."""

    pooling_type: str | None = None  # "last" | "mean" | "cls"
    normalize: bool | None = None  # L2-normalize the vector
    dimensions: int | None = None  # keep the first DIMENSIONS values (Matryoshka), before normalizing

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"normalize must be a boolean, got {self.normalize!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise InvalidRequestError(f"dimensions must be a positive integer, got {self.dimensions!r}")


@dataclass(slots=True)
class EmbeddingModel:
    """What the engine's model offers embedding requests: its pooling config (None: a generative export, which
    has no hidden states) and its hidden size."""

    config: PoolingConfig | None
    hidden_size: int
    backend_can_pool: bool = True


@dataclass(slots=True)
class PoolState:
    """One embedding request's pooling: what it asked, resolved, and what it has pooled so far."""

    type: str
    normalize: bool
    dimensions: int | None
    next: int = 0  # first prompt position not pooled yet
    total: np.ndarray | None = None  # "mean": the sum of the pooled rows (float64); "last"/"cls": the row

    def rows(self, start: int, n: int, prompt_len: int) -> tuple[int, int] | None:
        """(first position, count) of the rows a chunk [START, START + N) must return, or None."""
        end = min(start + n, prompt_len)
        if self.type == "last":
            return (prompt_len - 1, 1) if end == prompt_len and self.next < prompt_len else None
        if self.type == "cls":
            return (0, 1) if start == 0 and self.next == 0 else None
        first = max(start, self.next)
        return (first, end - first) if end > first else None


def pool_state(model: EmbeddingModel, params: PoolingParams, max_tokens: int | None, n: int) -> PoolState:
    """The PoolState of a request asking PARAMS on MODEL, or InvalidRequestError saying why it cannot embed."""
    if model.config is None:
        raise InvalidRequestError("this model was exported without hidden states, so it cannot make embeddings: "
                                  "export it with `octavo export --pooling last` (or mean, cls), or export a "
                                  "sentence-transformers folder")
    if not model.backend_can_pool:
        raise InvalidRequestError("this backend does not return hidden states (embeddings run on onnxruntime)")
    if n != 1:
        raise InvalidRequestError(f"an embedding request makes one vector: n must be 1, got {n}")
    if params.dimensions is not None and params.dimensions > model.hidden_size:
        exc = InvalidRequestError(f"dimensions ({params.dimensions}) must be at most the model's hidden size "
                                  f"({model.hidden_size})")
        exc.param = "dimensions"  # type: ignore[attr-defined] - the server's error body names the field
        raise exc
    return PoolState(params.pooling_type or model.config.type,
                     model.config.normalize if params.normalize is None else params.normalize, params.dimensions)


__all__ = ["EmbeddingModel", "PoolState", "PoolingParams", "pool_state"]
