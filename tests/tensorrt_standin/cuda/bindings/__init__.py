"""Stand-in for cuda-python's cuda.bindings (tests only)."""
