"""`octavo generate MODEL "prompt" ...`: generate text offline (one prompt streams; several run batched)."""
from __future__ import annotations

import argparse
import sys
import time

from octavo.export.embedded import EMBEDDED_NAME
from octavo.commands.engine_flags import add_engine_arguments, engine_args

HELP = "generate text for one or more prompts (streams a single prompt)"


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (the engine's --seed seeds sampled requests)")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate per completion")
    g.add_argument("--min-tokens", type=int, default=0, help="generate at least this many before EOS/stop counts")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability (0 = off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="0 = off")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="0 = off")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def sampling_params(args: argparse.Namespace, n: int = 1):  # noqa: ANN201
    from octavo.runtime.sampling_params import SamplingParams

    return SamplingParams(
        n=n, max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        stop=args.stop, ignore_eos=args.ignore_eos)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help=f"export folder, HF checkpoint folder, .gguf file or {EMBEDDED_NAME!r} (the "
                                 "embedded SmolLM2-135M-Instruct)")
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text (several: run as one batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("-n", type=int, default=1, help="completions per prompt (default: 1)")
    add_sampling_arguments(p)
    add_engine_arguments(p)


def run(args: argparse.Namespace) -> int:
    from octavo.runtime.llm import LLM

    from octavo.export.embedded import model_argument

    ea = engine_args(args, model_argument(args.model)[0])
    llm = LLM.from_engine_args(ea)
    tok = llm.get_tokenizer()
    params = sampling_params(args, args.n)
    prompts = [
        {"prompt_token_ids": tok.encode_chat([{"role": "user", "content": p}])}
        if args.chat else p for p in args.prompts]
    t0 = time.perf_counter()
    if len(prompts) == 1 and args.n == 1:
        shown = 0
        out = None
        for out in llm.stream(prompts[0], params):
            text = out.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
        sys.stdout.write("\n")
        outs = [out] if out is not None else []
    else:
        outs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty())
        for i, out in enumerate(outs):
            for c in out.outputs:
                label = f"[{i}]" if args.n == 1 else f"[{i}.{c.index}]"
                print(f"{label} {args.prompts[i]!r} -> {c.text!r} ({c.finish_reason})")
    dt = time.perf_counter() - t0
    st = llm.engine.stats()
    print(f"{st.generation_tokens_total} tokens in {dt:.2f} s ({st.generation_tokens_total / max(dt, 1e-9):.1f} tok/s), "
          f"{st.step_count} steps, prefix-cache hits {st.prefix_cache_hits} tokens, preemptions {st.num_preemptions}",
          file=sys.stderr)
    errors = [c.error for o in outs for c in o.outputs if c.finish_reason == "error"]
    for e in errors:
        print(f"octavo generate: error: {e}", file=sys.stderr)
    llm.close()
    return 1 if errors else 0
