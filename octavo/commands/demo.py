"""`octavo demo`: the seed's ten requests on a real model, and the seed's picture drawn from the trace."""
from __future__ import annotations

import argparse
import sys

HELP = "run the seed's ten requests (SmolLM2-135M-Instruct by default) and show continuous batching step by step"


DEMO_FIELDS = ("block_size", "num_blocks", "max_num_batched_tokens", "max_num_seqs", "num_threads", "trace_path",
               "enable_prefix_caching", "weights", "kv_cache_dtype")  # DemoConfig's own engine fields


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from octavo.commands.engine_flags import add_engine_arguments
    from octavo.export.embedded import EMBEDDED_NAME

    parser.add_argument("--model", help="octavo export folder, HF folder or .gguf (default: the embedded "
                                        f"SmolLM2-135M-Instruct, {EMBEDDED_NAME!r}, exported once into the cache)")
    parser.add_argument("--arrivals", choices=["together", "staggered"], default="together",
                        help="together: all ten before step 1 (the seed); staggered: one joins every "
                             "--stagger-every steps, mid-stream (default: %(default)s)")
    parser.add_argument("--stagger-every", type=int, default=4, help="steps between staggered arrivals")
    parser.add_argument("--png", metavar="FILE", help="draw timeline, batch size, KV blocks and tokens per step "
                                                      "(default: none)")
    parser.add_argument("--html", metavar="FILE", help="write a self-contained HTML report (default: none)")
    parser.add_argument("--no-chat-template", action="store_true",
                        help="send the prompts as plain text (closer to the seed's short prompts; worse answers)")
    parser.add_argument("--no-log", action="store_true", help="leave out the per-step log")
    add_engine_arguments(parser, help_overrides={
        "num_blocks": "KV pool size in blocks (default: every request at full length + 25%%; fewer forces preemption)",
        "block_size": "tokens per KV block (default: 16; the seed used 256)",
    })


def run(args: argparse.Namespace) -> int:
    from octavo.commands.engine_flags import ENGINE_FIELDS, engine_args
    from octavo.export.embedded import model_argument
    from octavo.demo.run import DemoConfig, run_demo
    from octavo.tracing.files import write_outputs
    from octavo.tracing.report import format_terminal
    from octavo.tracing.story import describe_run

    model, name = model_argument(args.model)
    shown = model if name == model else f"{name} ({model})"
    ea = engine_args(args, model)
    config = DemoConfig(
        model=model, arrivals=args.arrivals, stagger_every=args.stagger_every,
        use_chat_template=not args.no_chat_template, **{k: getattr(ea, k) for k in DEMO_FIELDS},
        engine_extra={k: getattr(ea, k) for k in ENGINE_FIELDS if k not in DEMO_FIELDS},
    )
    print(f"octavo demo: model {shown}", file=sys.stderr)
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
    report.notes[:0] = [
        f"model {shown}; block_size {config.block_size}, {result.num_blocks} KV blocks, "
        f"max_num_batched_tokens {config.max_num_batched_tokens}, max_num_seqs {config.max_num_seqs}, "
        f"arrivals {config.arrivals}" + (f" (one every {config.stagger_every} steps)" if config.arrivals == "staggered" else ""),
        "Greedy, ignore_eos=True and max_tokens = each profile's generation length: every length is exact, "
        "so the finishing steps are predictable. What this run did, read from its trace:",
        *describe_run(report.rows, report.spans, config.max_num_batched_tokens, _chunk_cap(config)),
    ]
    print(format_terminal(report, step_log=not args.no_log))
    for path in write_outputs(report, png=args.png, html=args.html):
        print(f"wrote {path}")
    if args.trace_path:
        print(f"wrote {args.trace_path} (draw it again: octavo trace {args.trace_path} --png OUT.png --html OUT.html)")
    return 0


def _chunk_cap(config) -> int:  # noqa: ANN001 - a DemoConfig
    """The long-prefill cap the demo's engine ran with (a --long-prefill-token-threshold flag, else the default)."""
    from octavo.runtime.engine_args import EngineArgs

    return config.engine_extra.get("long_prefill_token_threshold", EngineArgs.long_prefill_token_threshold)
