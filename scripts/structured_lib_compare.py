"""Compare llguidance and xgrammar on one tokenizer: tokenizer-bridge time, schema/regex/grammar compile time,
per-token mask time and resident memory (how the structured-output library was chosen; docs/structured_outputs.md).

    python scripts/structured_lib_compare.py EXPORT_DIR [--tokens 64] [--only llguidance|xgrammar]

Each library runs in its own subprocess (so memory figures are its own). Masks are timed along a fixed
valid output: at each step the mask is computed, then the next token of that output is consumed.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
VALID = json.dumps({"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "engines"],
                    "address": {"city": "London", "zip": "W1"}})
REGEX = r"\d{3}-\d{3}-\d{4}"
LARK = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: factor (("*" | "/") factor)*\nfactor: NUMBER | "(" expr ")"\nNUMBER: /[0-9]+/\n'
EBNF = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\nfactor ::= [0-9]+ | "(" expr ")"\n'


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_llguidance(tok_json: str, vocab: int, eos: int, ids: list[int]) -> dict:
    t0 = time.perf_counter()
    import llguidance as llg
    import llguidance.numpy as lln
    import numpy as np

    out: dict = {"version": version("llguidance"),
                 "import_rss_mb": rss_mb(), "import_s": time.perf_counter() - t0}
    base = rss_mb()
    t = time.perf_counter()
    tok = llg.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)
    out["tokenizer_s"] = time.perf_counter() - t
    out["tokenizer_rss_mb"] = rss_mb() - base

    t = time.perf_counter()
    grammar = llg.LLMatcher.grammar_from_json_schema(SCHEMA)
    m = llg.LLMatcher(tok, grammar)
    out["schema_compile_s"] = time.perf_counter() - t
    assert not m.is_error(), m.get_error()
    t = time.perf_counter()
    llg.LLMatcher(tok, llg.LLMatcher.grammar_from_regex(REGEX))
    out["regex_compile_s"] = time.perf_counter() - t
    t = time.perf_counter()
    llg.LLMatcher(tok, llg.LLMatcher.grammar_from_lark(LARK))
    out["grammar_compile_s"] = time.perf_counter() - t

    mask = lln.allocate_token_bitmask(1, vocab)
    times = []
    for tid in ids:
        t = time.perf_counter()
        lln.fill_next_token_bitmask(m, mask)
        times.append(time.perf_counter() - t)
        assert m.consume_token(tid), m.get_error()
    out["mask_ms_mean"] = 1000 * sum(times) / len(times)
    out["mask_ms_max"] = 1000 * max(times)
    out["mask_ms_first"] = 1000 * times[0]
    # a decode step of 64 constrained requests, each at a different point of the output
    ms = [llg.LLMatcher(tok, grammar) for _ in range(64)]
    for i, mm in enumerate(ms):
        mm.consume_tokens(ids[: i % (len(ids) - 1)])
    big = lln.allocate_token_bitmask(64, vocab)
    t = time.perf_counter()
    for i, mm in enumerate(ms):
        lln.fill_next_token_bitmask(mm, big, i)
    out["batch64_mask_ms"] = 1000 * (time.perf_counter() - t)
    out["rss_mb_total"] = rss_mb()
    del np
    return out


def run_xgrammar(tok_json: str, vocab: int, eos: int, ids: list[int]) -> dict:
    t0 = time.perf_counter()
    import torch
    import transformers
    import xgrammar as xgr
    from tokenizers import Tokenizer

    out: dict = {"version": version("xgrammar"),
                 "import_rss_mb": rss_mb(), "import_s": time.perf_counter() - t0}
    base = rss_mb()
    t = time.perf_counter()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok_json))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    out["tokenizer_s"] = time.perf_counter() - t
    out["tokenizer_rss_mb"] = rss_mb() - base

    t = time.perf_counter()
    cg = compiler.compile_json_schema(json.dumps(SCHEMA), strict_mode=True)
    m = xgr.GrammarMatcher(cg)
    out["schema_compile_s"] = time.perf_counter() - t
    t = time.perf_counter()
    compiler.compile_regex(REGEX)
    out["regex_compile_s"] = time.perf_counter() - t
    t = time.perf_counter()
    compiler.compile_grammar(EBNF)
    out["grammar_compile_s"] = time.perf_counter() - t

    mask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for tid in ids:
        t = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - t)
        assert m.accept_token(tid)
    out["mask_ms_mean"] = 1000 * sum(times) / len(times)
    out["mask_ms_max"] = 1000 * max(times)
    out["mask_ms_first"] = 1000 * times[0]
    ms = [xgr.GrammarMatcher(cg) for _ in range(64)]
    for i, mm in enumerate(ms):
        for tid in ids[: i % (len(ids) - 1)]:
            mm.accept_token(tid)
    big = xgr.allocate_token_bitmask(64, vocab)
    t = time.perf_counter()
    for i, mm in enumerate(ms):
        mm.fill_next_token_bitmask(big, i)
    out["batch64_mask_ms"] = 1000 * (time.perf_counter() - t)
    out["rss_mb_total"] = rss_mb()
    del torch
    return out


def child(lib: str, folder: Path) -> None:
    from tokenizers import Tokenizer

    tok_json = (folder / "tokenizer.json").read_text()
    hf = Tokenizer.from_str(tok_json)
    vocab = hf.get_vocab_size(with_added_tokens=True)
    manifest = json.loads((folder / "octavo.json").read_text())
    eos = manifest["eos_token_ids"][0]
    ids = hf.encode(VALID, add_special_tokens=False).ids + [eos]
    fn = run_llguidance if lib == "llguidance" else run_xgrammar
    res = fn(tok_json, vocab, eos, ids)
    res.update(lib=lib, vocab=vocab, tokens=len(ids))
    print(json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--only", choices=["llguidance", "xgrammar"])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.only, a.model)
        return
    for lib in ([a.only] if a.only else ["llguidance", "xgrammar"]):
        r = subprocess.run([sys.executable, __file__, str(a.model), "--only", lib, "--child"],
                           capture_output=True, text=True, check=False)
        line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else json.dumps({"lib": lib, "error": r.stderr[-2000:]})
        print(line, flush=True)


if __name__ == "__main__":
    main()
