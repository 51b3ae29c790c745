"""Stand-in for cuda-python (tests only; see ../README.md)."""
