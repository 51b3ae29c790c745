"""SLO capacity (benchmarks/slo_capacity.py): the largest Poisson arrival rate at which an engine meets a latency
SLO, for octavo and its peers, against naive serving.

    target.py      the SLO and one point's verdict (percentiles over its N requests, the early-stop rule)
    workload.py    chat-sized token-id requests: the same lengths at every point, fresh ids per point
    point.py       measure one rate against a running server (Poisson arrivals, streamed, client-side)
    search.py      geometric steps then bisection over the rate
    fifo_replay.py one-at-a-time serving below its measurable range, from its measured service times
    engines.py     the engines' server commands (octavo, llama-server, vLLM, HF naive)
    run.py         one engine: start, calibrate, search, stop
    table.py       the table and the ratios to HF naive
"""
