"""A request of few tokens is made into its token array in Python (`few_token_rows`), a longer one by
numpy (`token_spans`); tests/test_tokens.py checks both against the frozen reference on real and
awkward texts. Here: the Python path's str methods class and trim every character as the reference's
per-character flags do, and both paths give one array for the same encodings."""
from __future__ import annotations

import unicodedata
from types import SimpleNamespace

import numpy as np
import pytest
from transformers import AutoTokenizer

from server.backbone import tokens
from server.backbone.sources import default_backbone_path
from server.backbone.tokens import CASING, END, START, WORD, TextEncoder, few_token_rows
from tests.tokens_reference import claim_marks as reference_claim_marks
from tests.tokens_reference import token_spans as reference_spans


class encoding(SimpleNamespace):
    """What the paths read of a `tokenizers` Encoding, with the offsets and segments given."""

    def __init__(self, offsets, segments):
        n = len(offsets)
        super().__init__(ids=list(range(n)), type_ids=[0] * n, sequence_ids=segments,
                         word_ids=[None if s is None else i for i, s in enumerate(segments)], offsets=offsets)

    def __len__(self):
        return len(self.offsets)


def test_every_cased_or_space_character_classed_and_trimmed_as_the_reference():
    """str.islower/isupper/strip read the same per-character properties as the reference's flags, but a
    one-character str.islower or str.isupper reads one property only: each character that any of them
    sees (the rest is uncased and no space for both), alone, doubled, after a capital and between
    spaces, in one request of spans."""
    seen = [chr(c) for c in range(0x110000) if chr(c).islower() or chr(c).isupper() or chr(c).istitle()
            or chr(c).isspace()]
    assert len(seen) > 3000
    pieces = [p for c in seen for p in (c, c + c, "A" + c, "a" + c, " " + c + "b" + c + "\u3000")] + ["", " ", "Ab"]
    ends = np.cumsum([len(p) for p in pieces])
    starts = ends - [len(p) for p in pieces]
    segments = [0] * len(pieces)
    segments[::7] = [None] * len(segments[::7])  # special tokens keep their offsets
    text = "".join(pieces)
    given = encoding(list(zip(starts.tolist(), ends.tolist())), segments)
    got = few_token_rows([given], [text], None)
    segment = np.array([-1 if s is None else s for s in segments], dtype=np.int64)
    want = np.zeros_like(got)
    want[:, START], want[:, END], want[:, CASING] = reference_spans(
        [text], None, np.zeros(len(pieces), dtype=np.int64), segment, starts, ends)
    reference_claim_marks(want, [given], [text], None)  # some cased characters are combining marks (U+0345)
    for column in (START, END, CASING):
        np.testing.assert_array_equal(got[:, column], want[:, column], err_msg=f"column {column}")
    assert set(got[:, CASING].tolist()) == {0, 1, 2, 3, 4}


def test_spans_take_the_combining_marks_after_them_as_the_reference():
    """Every combining mark (Unicode category M*, BMP and beyond) after a word, after a word a
    tokenizer cut in two, doubled, before a space, before the next token and at a text's end: both
    paths move a span's end past the marks no token holds, and only those, as the reference's loop."""
    marks = [chr(c) for c in range(0x110000) if unicodedata.category(chr(c))[0] == "M"]
    assert len(marks) > 2000 and any(ord(m) > 0xFFFF for m in marks)
    offsets, segments, text = [], [], ""
    for m in marks:
        piece = "ab" + m + " cd" + m + m + " ef" + m
        offsets += [(len(text), len(text) + 2), (len(text) + 4, len(text) + 5), (len(text) + 5, len(text) + 6),
                    (len(text) + 9, len(text) + 11), (len(text) + 11, len(text) + 12)]  # the last holds its mark
        segments += [0] * 5
        text += piece
    offsets.append((0, 0))
    segments.append(None)  # a closing special token: the last mark has no next token of its text
    given = encoding(offsets, segments)
    got = few_token_rows([given], [text], None)
    want = got.copy()
    want[:, START], want[:, END] = np.array(offsets).T
    reference_claim_marks(want, [given], [text], None)
    np.testing.assert_array_equal(got[:, END], want[:, END])
    spans = got[:-1].reshape(len(marks), 5, -1)
    assert (spans[:, 0, END] - spans[:, 0, START] == 3).all()  # "ab" + its mark
    assert (spans[:, 1, END] - spans[:, 1, START] == 1).all()  # "c": the next token starts at "d"
    assert (spans[:, 2, END] - spans[:, 2, START] == 3).all()  # "d" + both marks
    assert (spans[:, 3, END] - spans[:, 3, START] == 2).all()  # "ef": the next token holds the mark
    np.testing.assert_array_equal(got, TextEncoder.token_array([given], [text], None))  # numpy: the same
    big = TextEncoder.token_array([given] * 2, [text, "x" + text[1:]], None)  # two texts joined by numpy
    np.testing.assert_array_equal(big[len(offsets):, END], got[:, END])


@pytest.mark.parametrize("text, words", [
    ("Bogota\u0301 rocks", ["Bogota\u0301", "rocks"]),  # NFD, as macOS writes it
    ("e\u0301te\u0301 cafe\u0301", ["e\u0301te\u0301", "cafe\u0301"]),
    ("\u092e\u0947\u0902 \u0939\u0942\u0901", ["\u092e\u0947\u0902", "\u0939\u0942\u0901"]),  # Hindi, two words
])
def test_an_accent_stripping_tokenizer_keeps_a_word_whole(minilm, text, words):
    """MiniLM's uncased tokenizer drops decomposed accents from its tokens: the words' spans still
    cover them, on both paths."""
    rows = minilm.encode([text])
    assert [text[s:e] for s, e in word_spans(rows[0])] == words
    encodings = minilm.plain.encode_batch([text])
    np.testing.assert_array_equal(few_token_rows(encodings, [text], None),
                                  TextEncoder.token_array(encodings * 2, [text, text], None)[:len(encodings[0])])


def word_spans(row):
    spans: dict[int, list[int]] = {}
    for word, start, end in row.tokens[:, [WORD, START, END]].tolist():
        if word >= 0:
            spans.setdefault(word, [start, end])[1] = end
    return list(spans.values())


@pytest.fixture(scope="module")
def minilm():
    return TextEncoder(AutoTokenizer.from_pretrained(default_backbone_path(), local_files_only=True), 512, True)


@pytest.mark.parametrize("pairs", [False, True])
def test_both_paths_give_one_array(minilm, monkeypatch, pairs):
    texts = ["  Paris, FRANCE and ǅungla naïve 🙂 É", "The Quick brown FOX", "", "a  b\tC"]
    pair_texts = [t[::-1] for t in texts] if pairs else None
    encodings = minilm.plain.encode_batch(list(zip(texts, pair_texts)) if pairs else texts)
    assert sum(len(e) for e in encodings) <= tokens.FEW_TOKENS
    few = TextEncoder.token_array(encodings, texts, pair_texts)
    monkeypatch.setattr(tokens, "FEW_TOKENS", 0)
    many = TextEncoder.token_array(encodings, texts, pair_texts)
    assert few.dtype == many.dtype == np.int32 and few.shape == many.shape
    np.testing.assert_array_equal(few, many)
