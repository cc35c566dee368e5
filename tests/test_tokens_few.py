"""A request of few tokens is made into its token array in Python (`few_token_rows`), a longer one by
numpy (`token_spans`); tests/test_tokens.py checks both against the frozen reference on real and
awkward texts. Here: the Python path's str methods class and trim every character as the reference's
per-character flags do, and both paths give one array for the same encodings."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from transformers import AutoTokenizer

from server.backbone import tokens
from server.backbone.sources import default_backbone_path
from server.backbone.tokens import CASING, END, START, TextEncoder, few_token_rows
from tests.tokens_reference import token_spans as reference_spans


def encoding(offsets, segments):
    n = len(offsets)
    return SimpleNamespace(ids=list(range(n)), type_ids=[0] * n, sequence_ids=segments,
                           word_ids=[None if s is None else i for i, s in enumerate(segments)], offsets=offsets)


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
    got = few_token_rows([encoding(list(zip(starts.tolist(), ends.tolist())), segments)], [text], None)
    segment = np.array([-1 if s is None else s for s in segments], dtype=np.int64)
    want = reference_spans([text], None, np.zeros(len(pieces), dtype=np.int64), segment, starts, ends)
    for column, values in zip((START, END, CASING), want):
        np.testing.assert_array_equal(got[:, column], values, err_msg=f"column {column}")
    assert set(got[:, CASING].tolist()) == {0, 1, 2, 3, 4}


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
