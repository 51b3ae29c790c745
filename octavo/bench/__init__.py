"""`octavo bench`: workloads, offline throughput (octavo.LLM), online serving (HTTP client) with vLLM's report, and
the engine step profiler. octavo measured beside other engines is the checkout's benchmarks/, not this package."""
