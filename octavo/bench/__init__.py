"""Benchmarks: workloads, offline throughput (octavo.LLM) and online serving (HTTP client) with vLLM's report."""
