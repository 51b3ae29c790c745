"""Peers for `benchmarks/compare_peers.py`: the same model and the same token-id workloads run through
octavo and through other engines (HF transformers, onnxruntime-genai, llama.cpp's llama-server), each in
its own process, so that every number in the comparison comes from one run on one machine.

    model.py      the random-weight perf model (HF folder) and its conversions (octavo, genai, GGUF)
    requests.py   token-id workloads (the seed's mix, 64 random, shared prefix) every peer can take
    result.py     what a peer returns for one workload, and the comparison table
    hf.py         transformers: one request at a time, and padded static batches
    ortgenai.py   onnxruntime-genai's batched Generator (CPU)
    llamacpp.py   llama.cpp's llama-server (continuous batching over -np slots), when a binary is given
    octavo_peer.py octavo offline (octavo.LLM) and online (`octavo serve`)
    worker.py     runs one peer over all workloads in a subprocess, JSON in and out
    memory.py     each peer's own peak RSS (VmHWM from /proc, not the inherited ru_maxrss)
"""
