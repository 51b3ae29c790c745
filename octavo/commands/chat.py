"""`octavo chat MODEL`: an interactive chat in the terminal (the model's chat template, streaming)."""
from __future__ import annotations

import argparse
import sys

from octavo.commands.generate import add_sampling_arguments, sampling_params
from octavo.commands.engine_flags import add_engine_arguments, engine_args
from octavo.export.embedded import EMBEDDED_NAME

HELP = "chat with a model in the terminal (/reset clears the conversation, /exit or Ctrl-D quits)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="export folder, HF checkpoint folder or .gguf file "
                   f"(default: the embedded SmolLM2-135M-Instruct, {EMBEDDED_NAME!r})")
    p.add_argument("--system", default=None, help="system message (default: none)")
    add_sampling_arguments(p)
    add_engine_arguments(p)
    p.set_defaults(max_tokens=256, temperature=0.7, top_p=0.9)


COMMANDS = {"/reset": "clear the conversation (the system message stays)", "/help": "list these commands",
            "/exit": "quit (also /quit or Ctrl-D)"}


def banner(model: str) -> str:
    lines = [f"octavo chat: {model}. Type a message and press Enter. Commands:"]
    lines += [f"  {name:<7} {what}" for name, what in COMMANDS.items()]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from octavo.export.embedded import model_argument
    from octavo.errors import InvalidRequestError
    from octavo.runtime.llm import LLM

    model, name = model_argument(args.model)
    llm = LLM.from_engine_args(engine_args(args, model))
    tok = llm.get_tokenizer()
    params = sampling_params(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages: list[dict[str, str]] = list(system)
    interactive = sys.stdin.isatty()
    print(banner(name), flush=True)
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            break
        line = line.strip()
        if not line:
            continue
        if line.startswith("/") and not line.startswith("//"):  # a command, never a message to the model
            word = line.split()[0].lower()
            if word in ("/exit", "/quit"):
                break
            if word == "/reset":
                turns = sum(m["role"] == "user" for m in messages)
                messages = list(system)
                print(f"[conversation cleared: {turns} turn{'s' if turns != 1 else ''} forgotten"
                      + ("; the system message stays" if system else "") + "]", flush=True)
            elif word == "/help":
                print(banner(name), flush=True)
            else:
                print(f"[unknown command {word}; commands: {', '.join(COMMANDS)}, /quit. "
                      "To send a message that starts with '/', write '//' instead]", flush=True)
            continue
        if line.startswith("//"):
            line = line[1:]
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
