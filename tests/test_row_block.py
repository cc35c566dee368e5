"""A worker's rows as the engine holds them (`RowBlock`: one token array and one string per frame, no
object per row) collate to the same batch as the same rows as EncodedInputs, whichever requests,
frames and order a batch takes them in."""
from __future__ import annotations

import random

import numpy as np
import torch
from transformers import AutoTokenizer

from server.workers import frames
from server.backbone.sources import default_backbone_path
from server.backbone.tokens import (CASING, END, IDS, SEGMENT, START, TYPES, WORD, BlockRows, RowBlock, TextEncoder,
                                   gather_rows)

TEXTS = ["Merkel met Macron in Paris.", "", "  leading and trailing  ", "🙂 Zürich naïve café", "A",
         "The Quick brown FOX jumps over the lazy DOG in NEW York. " * 3, "東京は日本の首都です。"]
PAIRS = [("A man is playing a guitar.", "Someone plays music."), ("Short.", ""), ("ÉA é", "ẞ and ß")]


def encoder() -> TextEncoder:
    return TextEncoder(AutoTokenizer.from_pretrained(default_backbone_path(), local_files_only=True), 512, True)


def frame_of(requests: list[list]) -> frames.RequestFrame:
    """Requests' rows through a request frame and back, as the engine reads them."""
    parts = frames.request_frame([(i, rows, "ner", 10.0) for i, rows in enumerate(requests)], [])
    return frames.RequestFrame.read(b"".join(parts))


def assert_same_batch(got, want) -> None:
    for name in ("input_ids", "attention_mask", "token_type_ids"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for name in ("segment", "word", "start", "end", "casing"):
        np.testing.assert_array_equal(getattr(got.arrays, name), getattr(want.arrays, name), err_msg=name)
    for name in ("casing", "segment"):
        assert torch.equal(got.token_classes(name), want.token_classes(name)), name
    assert list(got.texts) == list(want.texts)
    assert (None if got.text_pairs is None else list(got.text_pairs)) == want.text_pairs
    assert got.truncated == want.truncated and got.filler_rows == want.filler_rows
    assert list(got.offsets) == list(want.offsets) and list(got.word_ids) == list(want.word_ids)


def test_rows_read_back_from_a_frame_are_the_rows_sent():
    text = encoder()
    requests = [text.encode(TEXTS[:3]), text.encode(TEXTS[3:4]), text.encode(TEXTS[4:], truncate=True, max_tokens=8),
                text.encode(*zip(*PAIRS))]
    frame = frame_of(requests)
    assert all(type(rows) is BlockRows for rows in frame.rows)
    assert [rows.pairs for rows in frame.rows] == [False, False, False, True]
    for sent, read in zip(requests, frame.rows):
        assert len(read) == len(sent)
        for a, b in zip(sent, read):
            assert (b.text, b.text_pair, b.truncated) == (a.text, a.text_pair, a.truncated)
            np.testing.assert_array_equal(b.tokens, a.tokens)
    assert any(row.truncated for row in frame.rows[2])


def test_a_batch_of_rows_from_several_frames_collates_as_their_encoded_inputs():
    """Requests of two frames (two blocks joined), in a shuffled order, taken as the batcher takes
    them; then cut as the runner cuts passes (a slice) and padded to a bucket shape."""
    text = encoder()
    first = [text.encode(TEXTS[:2]), text.encode(TEXTS[2:5])]
    second = [text.encode(TEXTS[5:6]), text.encode(TEXTS[6:]), text.encode(TEXTS[1:4])]
    parts = frame_of(first).rows + frame_of(second).rows
    sent = first + second
    order = list(range(len(parts)))
    random.Random(0).shuffle(order)
    block, index = gather_rows([parts[i] for i in order])
    rows = block.take(index)
    want = [row for i in order for row in sent[i]]
    assert type(rows) is RowBlock and len(rows) == len(want)
    classes = ("casing", "segment")
    assert_same_batch(text.collate(rows, classes=classes), text.collate(want, classes=classes))
    assert_same_batch(text.collate(rows[2:5], classes=classes), text.collate(want[2:5], classes=classes))
    width = max(len(row) for row in want) + 3
    assert_same_batch(text.collate(rows, shape=(len(want) + 2, width)), text.collate(want, shape=(len(want) + 2, width)))
    # one frame's requests, one row each: the index is their rows' places in the frame
    singles = frame_of([text.encode([t]) for t in TEXTS]).rows
    block, index = gather_rows(singles[::-1])
    assert index.tolist() == list(range(len(TEXTS)))[::-1]
    assert_same_batch(text.collate(block.take(index)), text.collate([text.encode([t])[0] for t in TEXTS[::-1]]))


def test_pairs_collate_as_their_encoded_inputs():
    text = encoder()
    sent = [text.encode(*zip(*PAIRS)), text.encode([PAIRS[0][0]], [PAIRS[0][1]])]
    block, index = gather_rows(frame_of(sent).rows)
    assert_same_batch(text.collate(block.take(index)), text.collate([row for rows in sent for row in rows]))


def test_a_batch_makes_its_token_planes_only_when_read_and_they_hold_each_rows_tokens():
    """collate pads ids and type ids at once; segment, word, offsets and casing are made on first
    read (a worker server's engine process reads none of them for layer-mix tasks) and then hold, per
    row, that row's own token columns and padding (-1 segment and word, 0 elsewhere), row by row as
    plain Python would place them."""
    text = encoder()
    requests = [text.encode(TEXTS[:4]), text.encode(*zip(*PAIRS))]
    sent = [row for rows in requests for row in rows]
    block, index = gather_rows(frame_of(requests).rows)
    for rows in (block.take(index), sent):
        batch = text.collate(rows, shape=(len(sent) + 3, max(len(row) for row in sent) + 5))
        assert batch.arrays._made is None  # nothing but the pass's inputs made yet
        width = batch.seq_len
        for r, row in enumerate(sent):
            tokens = np.asarray(row.tokens, dtype=np.int64)
            padding = width - len(row)
            for plane, column, pad in (("segment", SEGMENT, -1), ("word", WORD, -1), ("start", START, 0), ("end", END, 0),
                                       ("casing", CASING, 0)):
                want = tokens[:, column].tolist() + [pad] * padding
                assert getattr(batch.arrays, plane)[r].tolist() == want, (r, plane)
            assert batch.input_ids[r].tolist() == tokens[:, IDS].tolist() + [text.pad_id] * padding
            assert batch.token_type_ids[r].tolist() == tokens[:, TYPES].tolist() + [0] * padding
        assert batch.arrays.segment.shape == (len(sent), width)  # real rows only
        assert batch.input_ids[len(sent):].eq(text.pad_id).all() and batch.attention_mask[len(sent):, 1:].eq(0).all()


def test_a_casing_reading_head_gets_the_casing_plane_without_the_other_planes():
    """A head that reads casing (the shipped ner) has its classes made at collate time from the casing
    column alone; they equal the casing plane of the whole token arrays, filler rows 0."""
    text = encoder()
    requests = [text.encode(TEXTS), text.encode(*zip(*PAIRS))]
    sent = [row for rows in requests for row in rows]
    block, index = gather_rows(frame_of(requests).rows)
    for rows in (block.take(index), sent):
        batch = text.collate(rows, shape=(len(sent) + 2, max(len(row) for row in sent) + 3), classes={"casing"})
        assert batch.arrays._made is None  # casing made, the other planes not
        casing = batch.classes["casing"]
        want = torch.zeros_like(casing)
        want[:len(sent)] = torch.from_numpy(batch.arrays.made().casing)
        assert torch.equal(casing, want) and casing[len(sent):].eq(0).all()
        assert casing.abs().sum() > 0  # the texts hold cased words
        assert np.array_equal(batch.arrays.casing_plane(), batch.arrays.made().casing)  # once made, the made one
