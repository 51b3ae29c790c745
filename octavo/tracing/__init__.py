"""Engine traces (one row per step) read back and drawn: ASCII timeline, step log, memory report, PNG, HTML."""
