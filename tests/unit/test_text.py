"""Incremental detokenization and stop strings (the postfilter's state machines)."""

from __future__ import annotations

import random

import pytest

from services.postfilter.text import Detokenizer, StopMatcher

TEXTS = [
    "café naïve résumé — “quotes”",
    "日本語のテキスト。中文文本。한국어",
    "emoji 😀🎉🚀 mixed with ascii and ∑ ∞ ≠",
    "plain ascii text with spaces  and\nnewlines",
]


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_never_emits_half_characters(tiny_model, text):
    _, _, tok = tiny_model
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # multi-byte characters really are split across tokens
    detok = Detokenizer(tok.backend_tokenizer)
    pieces = [detok.step(t) for t in ids]
    pieces.append(detok.finish())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_detokenizer_skips_special_tokens(tiny_model):
    _, _, tok = tiny_model
    ids = tok.encode("hi<|im_end|>there", add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids
    detok = Detokenizer(tok.backend_tokenizer, skip_special_tokens=True)
    out = "".join(detok.step(t) for t in ids) + detok.finish()
    assert out == tok.decode(ids, skip_special_tokens=True)
    assert "<|im_end|>" not in out


def test_detokenizer_finish_matches_one_shot_decode_on_incomplete_bytes(tiny_model):
    _, _, tok = tiny_model
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 1
    partial = ids[:-1]
    detok = Detokenizer(tok.backend_tokenizer)
    out = "".join(detok.step(t) for t in partial)
    assert out == ""  # never half a character while streaming
    assert out + detok.finish() == tok.decode(partial)


def feed_all(matcher: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = []
    for p in pieces:
        text, stopped = matcher.feed(p)
        out.append(text)
        if stopped:
            return "".join(out), True
    out.append(matcher.flush())
    return "".join(out), False


def test_stop_string_across_pieces_never_leaks():
    m = StopMatcher(["STOP"])
    emitted = []
    for piece in ["Hello S", "T", "O", "P and more"]:
        text, stopped = m.feed(piece)
        emitted.append(text)
        assert "S" not in "".join(emitted).replace("Hello ", "")  # no part of STOP ever shown
        if stopped:
            break
    assert "".join(emitted) == "Hello " and stopped


def test_held_text_is_released_when_it_turns_out_not_to_be_a_stop():
    m = StopMatcher(["STOP"])
    assert m.feed("a ST") == ("a ", False)
    assert m.feed("ORM") == ("STORM", False)
    assert m.flush() == ""


def test_include_stop_and_several_stops():
    assert feed_all(StopMatcher(["end", "x"], include_stop=True), ["abc e", "nd z"]) == ("abc end", True)
    assert feed_all(StopMatcher(["zz", "b"]), ["ab", "zz"]) == ("a", True)
    # "b" completes before "abc" does, even when both arrive in one piece
    assert feed_all(StopMatcher(["abc", "b"]), ["abc"]) == ("a", True)


def test_stop_matcher_equals_simple_reference_on_random_splits():
    rng = random.Random(0)
    alphabet = "ab c"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(0, 6))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        got, stopped = feed_all(StopMatcher(stops), pieces)
        # reference: the text up to the earliest completed stop string, checked prefix by prefix
        expected, expect_stop = text, False
        for end in range(len(text) + 1):
            hits = [text[:end].find(s) for s in stops if s in text[:end]]
            if hits:
                expected, expect_stop = text[: min(hits)], True
                break
        assert (got, stopped) == (expected, expect_stop), (text, stops, pieces)
