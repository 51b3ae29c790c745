"""Cost of the server's JSON body check (octavo.serving.app.parse_json_body) against plain json.loads of the
same body, measured side by side in ONE run: the body is parsed on the event loop, so the strict-UTF-8 and
lone-surrogate checks must add little beyond the decode itself (re-serialising the body with json.dumps, as it
once did, cost 2.4-4x the decode on a 1.4 MB token list).

Bodies: a 300 000-id token list, a 1.6 MB text prompt, 30 000 chat turns each holding an escaped emoji pair
(the one case that needs a regex pass). The two parsers run interleaved, round after round; the report is the
median of the per-round ratios (a load spike hits both sides of a round alike) and best/best.

    .venv/bin/python -m benchmarks.bench_body_parse [--rounds 15] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from octavo.serving.app import parse_json_body

BODIES: dict[str, object] = {
    "token_ids": {"prompt": [5 + i % 300 for i in range(300_000)]},
    "text": {"prompt": "The quick brown fox jumps over the lazy dog. " * 35_000},
    "escaped_pairs": {"messages": [{"role": "user", "content": f"turn {i} \U0001F600"} for i in range(30_000)]},
}


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(raw: bytes, rounds: int) -> dict[str, float]:
    """Median json.loads time, median parse_json_body time, the median of their per-round ratio, and the ratio
    of the two best times (for a body parsed in ~2 ms, one scheduler time slice of a loaded machine is 10x that)."""
    json.loads(raw.decode("utf-8"))  # warm-up round, not counted (first-touch allocation)
    parse_json_body(raw)
    loads, checked, ratios = [], [], []
    for _ in range(rounds):
        a = _seconds(lambda: json.loads(raw.decode("utf-8")))
        b = _seconds(lambda: parse_json_body(raw))
        loads.append(a)
        checked.append(b)
        ratios.append(b / a)
    return {"mb": len(raw) / 1e6, "json_loads_ms": statistics.median(loads) * 1e3,
            "parse_json_body_ms": statistics.median(checked) * 1e3, "ratio": statistics.median(ratios),
            "best_ratio": min(checked) / min(loads)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    results = {}
    for kind, value in BODIES.items():
        raw = json.dumps(value).encode()
        assert parse_json_body(raw) == value
        results[kind] = r = measure(raw, args.rounds)
        print(f"{kind:14s} {r['mb']:.1f} MB  json.loads {r['json_loads_ms']:7.1f} ms  "
              f"parse_json_body {r['parse_json_body_ms']:7.1f} ms  ratio {r['ratio']:.2f} (best/best {r['best_ratio']:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
