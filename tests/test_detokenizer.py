"""Incremental detokenizer on the test tokenizer (byte-level BPE, so multi-byte characters are split
across tokens): UTF-8 safety, exact stop-string cuts, and streams that never show text a stop removes."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from models import CORPUS, make_tokenizer

from octavo.runtime.detokenizer import IncrementalDetokenizer

TOK = make_tokenizer()
TEXT = "Héllo wörld, naïve café — ünïcödé 日本語 テスト 😀 emoji. The quick brown fox jumps over the lazy dog."


def ids(text: str) -> list[int]:
    return TOK.encode(text).ids


def stream(text: str, stop: list[str] | None = None, include: bool = False) -> tuple[IncrementalDetokenizer, list[str]]:
    prompt = ids("Hello")
    d = IncrementalDetokenizer(TOK, prompt, stop or [], include)
    shown = []
    for t in ids(text):
        hit = d.add(t)
        shown.append(d.visible_text(finished=False))
        if hit:
            break
    d.flush()
    return d, shown


def test_multibyte_characters_are_never_emitted_half_way() -> None:
    toks = ids(TEXT)
    pieces = [TOK.decode([t]) for t in toks]
    assert any("\ufffd" in p for p in pieces), "the test needs tokens that split a character"
    d, shown = stream(TEXT)
    assert all("\ufffd" not in s for s in shown)
    assert d.text == TEXT == TOK.decode(toks)
    assert all(shown[i].startswith(shown[i - 1]) for i in range(1, len(shown)))


def test_incomplete_character_at_the_end_is_flushed() -> None:
    toks = ids("日本")
    d = IncrementalDetokenizer(TOK, [], [])
    for t in toks[:-1]:
        d.add(t)
    d.flush()
    assert d.text == TOK.decode(toks[:-1])  # honest: the partial character shows as U+FFFD at the end


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cut_exactly(include: bool) -> None:
    d, shown = stream(TEXT, ["brown fox"], include)
    expect = TEXT[: TEXT.index("brown fox")] + ("brown fox" if include else "")
    assert d.stopped_by == "brown fox" and d.text == expect
    assert all(expect.startswith(s) for s in shown)


def test_stream_holds_back_a_possible_stop_prefix() -> None:
    d = IncrementalDetokenizer(TOK, [], ["fox!"])
    for t in ids("the fo"):
        d.add(t)
    assert d.visible_text(finished=False) == "the "
    assert d.visible_text(finished=True) == "the fo"
    for t in ids("x jumps"):
        assert d.add(t) is None
    assert d.visible_text(finished=False) == "the fox jumps"


def test_earliest_of_several_stops() -> None:
    d, _ = stream(TEXT, ["lazy", "café", "😀"])
    assert d.text == TEXT[: TEXT.index("café")]


@settings(max_examples=60, deadline=None)
@given(start=st.integers(0, len(CORPUS) - 200), length=st.integers(1, 120), s0=st.integers(0, 119),
       slen=st.integers(1, 8), include=st.booleans())
def test_property_stream_equals_cut_of_the_full_decode(start: int, length: int, s0: int, slen: int,
                                                        include: bool) -> None:
    text = CORPUS[start:start + length]
    full = TOK.decode(ids(text))
    stop = full[s0 % len(full):][:slen]
    d, shown = stream(text, [stop], include)
    i = full.find(stop)
    expect = full[: i + (len(stop) if include else 0)]
    assert d.text == expect
    assert all(expect.startswith(s) and "\ufffd" not in s for s in shown)


@settings(max_examples=80, deadline=None)
@given(pieces=st.lists(st.text(max_size=6), max_size=30),
       cuts=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 200)), max_size=10),
       truncate=st.integers(0, 200))
def test_text_pieces_slice_and_truncate_like_a_string(pieces: list[str], cuts: list, truncate: int) -> None:
    """The piece store behind `text` (no `str +=`): slices and cuts equal a plain string's."""
    d = IncrementalDetokenizer(TOK, [], [])
    for p in pieces:
        d._append(p)
    whole = "".join(pieces)
    assert d.length == len(whole)
    for a, b in cuts:
        assert d.slice(a, b) == whole[a:b]
    d._truncate(truncate)
    whole = whole[:truncate]
    assert d.length == len(whole)
    for a, b in cuts:
        assert d.slice(a, b) == whole[a:b]
    assert d.text == whole
    d._append("xyz")
    assert d.text == whole + "xyz" and d.slice(len(whole), len(whole) + 2) == "xy"


def test_a_long_stream_never_joins_the_whole_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a streamed request does per token (add, hold back a stop prefix, send the new slice) never touches
    the whole text, so the work per token does not grow with the output (the old `text +=` copied it all at
    every token: quadratic). 20,000 tokens with two stop strings that never match, then one that does."""
    toks = ids(CORPUS[:4000])
    n = 20_000
    stream_ids = (toks * (n // len(toks) + 1))[:n]
    expect = TOK.decode(stream_ids)
    d = IncrementalDetokenizer(TOK, ids("Hello"), ["never here", "nor this"])

    def joined(self: IncrementalDetokenizer) -> str:
        raise AssertionError("the whole text was joined while streaming")

    with monkeypatch.context() as m:
        m.setattr(IncrementalDetokenizer, "text", property(joined))
        sent, shown = 0, []
        for t in stream_ids:
            assert d.add(t) is None
            visible = d.visible_length(finished=False)
            shown.append(d.slice(sent, visible))
            sent = max(sent, visible)
        d.flush()
        shown.append(d.slice(sent, d.visible_length(finished=True)))
    assert "".join(shown) == d.text == expect
