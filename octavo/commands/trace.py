"""`octavo trace FILE`: draw a trace file again (terminal timeline + summary, optional PNG and HTML)."""
from __future__ import annotations

import argparse

HELP = "render a trace file (written with --trace): timeline, per-step log, memory report, PNG, HTML"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="trace file: one JSON row per engine step (from --trace FILE)")
    parser.add_argument("--png", metavar="OUT.png", help="also draw the timeline, batch size, blocks and tokens as a PNG (default: none)")
    parser.add_argument("--html", metavar="OUT.html", help="also write a self-contained HTML report (default: none)")
    parser.add_argument("--x-axis", choices=("step", "time"), default="step",
                        help="the picture's x-axis: engine steps, or wall time (a server's trace: idle time between "
                             "requests shows; default: %(default)s)")
    parser.add_argument("--no-log", action="store_true", help="leave out the per-step log")
    parser.add_argument("--max-num-seqs", type=int, help="for the memory report's static comparison (default: none)")
    parser.add_argument("--max-model-len", type=int, help="for the memory report's static comparison (default: none)")


def run(args: argparse.Namespace) -> int:
    from octavo.tracing.reader import read_trace
    from octavo.tracing.report import build_report, format_terminal
    from octavo.tracing.files import write_outputs

    rows = read_trace(args.file)
    report = build_report(rows, title=f"trace {args.file}", max_num_seqs=args.max_num_seqs,
                          max_model_len=args.max_model_len)
    print(format_terminal(report, step_log=not args.no_log))
    for path in write_outputs(report, png=args.png, html=args.html, x_axis=args.x_axis):
        print(f"wrote {path}")
    return 0
