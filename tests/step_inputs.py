"""StepInputs for one sequence (backend tests that bypass the engine's ModelRunner): the library helper."""
from __future__ import annotations

from octavo.runtime.step_inputs import one_sequence, prefill

__all__ = ["one_sequence", "prefill"]
