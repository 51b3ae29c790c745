"""`octavo chat MODEL`: an interactive chat in the terminal (the model's chat template, streaming)."""
from __future__ import annotations

import argparse
import sys

from octavo.commands.generate import add_sampling_arguments, sampling_params
from octavo.commands.serve import add_engine_arguments, engine_args

HELP = "chat with a model in the terminal (/reset clears the conversation, /exit or Ctrl-D quits)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="export folder, HF checkpoint folder or .gguf file")
    p.add_argument("--system", default=None, help="system message")
    add_sampling_arguments(p)
    add_engine_arguments(p)
    p.set_defaults(max_tokens=256, temperature=0.7, top_p=0.9)


def run(args: argparse.Namespace) -> int:
    from octavo.errors import InvalidRequestError
    from octavo.runtime.llm import LLM

    ea = engine_args(args)
    llm = LLM.from_engine_args(ea)
    tok = llm.get_tokenizer()
    params = sampling_params(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages: list[dict[str, str]] = list(system)
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            messages = list(system)
            continue
        messages.append({"role": "user", "content": line})
        try:
            ids = tok.encode_chat(messages)
            sys.stdout.write("assistant> ")
            shown, text, reason = 0, "", None
            for out in llm.stream({"prompt_token_ids": ids}, params):
                text, reason = out.outputs[0].text, out.outputs[0].finish_reason
                sys.stdout.write(text[shown:])
                sys.stdout.flush()
                shown = len(text)
            sys.stdout.write("\n" if reason != "length" else " [max tokens reached]\n")
        except InvalidRequestError as exc:  # e.g. the conversation outgrew the context: say so, keep going
            print(f"\n[error: {exc}; /reset starts over]")
            messages.pop()
            continue
        except KeyboardInterrupt:
            print(" [interrupted]")
        messages.append({"role": "assistant", "content": text})
    llm.close()
    return 0
