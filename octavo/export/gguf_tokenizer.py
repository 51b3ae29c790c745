"""Rebuild a HF `tokenizers` tokenizer.json from a GGUF file's tokenizer metadata.

GGUF facts (llama.cpp's keys): tokenizer.ggml.model ("gpt2" = byte-level BPE, "llama" = SentencePiece
BPE), .tokens (id order), .merges ("a b" strings; SentencePiece files often have none), .scores
(SentencePiece piece scores), .token_type (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
6 byte), .pre (which pre-tokenizer split regex the vocabulary was trained with), .bos/.eos/.unknown/
.padding_token_id, .add_bos_token, .add_eos_token, .add_space_prefix.
"""
from __future__ import annotations

import logging
from typing import Any

from octavo.errors import ModelFormatError

log = logging.getLogger(__name__)

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
METASPACE = "\u2581"

# Pre-tokenizer split regexes, by tokenizer.ggml.pre (these are the published regexes of those models).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {"llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT,
                 "smaug-bpe": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT}
# Byte-level vocabularies that split every digit before the GPT-2 regex (SmolLM, StarCoder family).
_DIGIT_PRES = {"smollm", "starcoder", "refact"}
_GPT2_PRES = {None, "default", "gpt2", "gpt-2"}


def build_tokenizer_json(meta: dict[str, Any], name: str) -> str:
    """tokenizer.json text for the tokenizer the metadata describes; ModelFormatError if it cannot."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelFormatError(f"{name}: the GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ModelFormatError(f"{name}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    if kind == "gpt2":
        tok = _byte_level(meta, tokens, types, name)
    elif kind == "llama":
        tok = _sentencepiece(meta, tokens, types, name)
    else:
        raise ModelFormatError(
            f"{name}: tokenizer type {kind!r} is not supported (supported: 'gpt2' byte-level BPE, "
            "'llama' SentencePiece BPE)"
        )
    _add_special_tokens(tok, tokens, types)
    _set_post_processor(tok, meta, tokens, byte_level=kind == "gpt2")
    return tok.to_str()


def _vocab(tokens: list[str], name: str) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if token in vocab:
            log.warning("%s: token %r appears twice (ids %d and %d); keeping the first", name, token,
                        vocab[token], index)
            continue
        vocab[token] = index
    return vocab


def _merges(meta: dict[str, Any]) -> list[tuple[str, str]] | None:
    raw = meta.get("tokenizer.ggml.merges")
    if not raw:
        return None
    pairs = []
    for merge in raw:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ModelFormatError(f"tokenizer.ggml.merges entry {merge!r} is not 'left right'")
        pairs.append((left, right))
    return pairs


def _byte_level(meta: dict[str, Any], tokens: list[str], types: list[int], name: str) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = _merges(meta)
    if merges is None:
        raise ModelFormatError(f"{name}: a byte-level (gpt2) GGUF tokenizer needs tokenizer.ggml.merges")
    tok = Tokenizer(models.BPE(_vocab(tokens, name), merges, fuse_unk=False, byte_fallback=False))
    pre = meta.get("tokenizer.ggml.pre")
    if pre in _SPLIT_BY_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre in _DIGIT_PRES:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        if pre not in _GPT2_PRES:
            log.warning("%s: unknown tokenizer.ggml.pre %r; splitting text with the GPT-2 regex", name, pre)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("qwen2", "deepseek-r1-qwen"):
        from tokenizers import normalizers

        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(meta: dict[str, Any], tokens: list[str], types: list[int], name: str) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = _vocab(tokens, name)
    merges = _merges(meta)
    if merges is None:
        scores = meta.get("tokenizer.ggml.scores")
        if not scores or len(scores) != len(tokens):
            raise ModelFormatError(f"{name}: a SentencePiece GGUF tokenizer needs tokenizer.ggml.scores or .merges")
        merges = merges_from_scores(tokens, [float(s) for s in scores], types)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else ("<unk>" if "<unk>" in vocab else None)
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=METASPACE, prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace(METASPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges implied by a vocabulary: every split of a normal piece into two normal
    pieces, best (highest-scoring) merged piece first; ties by longer left part, then by piece ids."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED)}
    found: list[tuple[float, int, int, int, int, int, str, str]] = []
    for token, index in ids.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                found.append((-scores[index], -len(left), -len(right), index, ids[left], ids[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _add_special_tokens(tok: Any, tokens: list[str], types: list[int]) -> None:
    """Control and unknown tokens become special added tokens (never split, skipped on decode if asked);
    user-defined ones become plain added tokens (matched whole in the text)."""
    from tokenizers import AddedToken

    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)


def _set_post_processor(tok: Any, meta: dict[str, Any], tokens: list[str], *, byte_level: bool) -> None:
    """BOS/EOS insertion as tokenizer.ggml.add_bos_token / add_eos_token say (SentencePiece default: BOS)."""
    from tokenizers import processors

    default_bos = not byte_level
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    steps: list[Any] = [processors.ByteLevel(trim_offsets=False)] if byte_level else []
    bos_id, eos_id = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    add_bos = add_bos and bos_id is not None
    add_eos = add_eos and eos_id is not None
    if add_bos or add_eos:
        bos = tokens[int(bos_id)] if add_bos else None
        eos = tokens[int(eos_id)] if add_eos else None
        single = " ".join(x for x in (bos and f"{bos}:0", "$A:0", eos and f"{eos}:0") if x)
        pair = " ".join(x for x in (single, bos and f"{bos}:1", "$B:1", eos and f"{eos}:1") if x)
        special = [(t, int(i)) for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None]
        steps.append(processors.TemplateProcessing(single=single, pair=pair, special_tokens=special))
    if len(steps) == 1:
        tok.post_processor = steps[0]
    elif steps:
        tok.post_processor = processors.Sequence(steps)
