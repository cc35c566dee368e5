"""Tokenized batches with character offsets, so heads can answer in input coordinates.

Per token everything is an integer in one (tokens, FIELDS) int32 array, made by `TextEncoder.encode`
for a whole request at once (the `tokenizers` library's encodings: ids, type ids, segment, word,
trimmed offsets and the casing class; a request of few tokens row by row in Python, a longer one
column by column with numpy, whose per-call cost only pays off past ~200 tokens): a row is a view of
it, a request crosses processes as that array (`server/workers/frames.py`), and `collate` only
concatenates rows into a padded batch. The engine process keeps a frame's rows as it read them
(`RowBlock`: the frame's token array and text, each row's first token and length), so sorting a
batch, cutting it into passes and collate are numpy calls per batch, with no object per row. Collate
pads only what the pass reads (ids, type ids); a batch's other per-token planes (`TokenArraysLater`)
and the per-token lists (`EncodedInput.offsets`, `TokenBatch.sequence_ids`, ...) are made from the
arrays only when someone reads them (token classes, decoding, training, tests, bridges).
"""
from __future__ import annotations

import copy
import itertools
import threading
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

CASING_CLASSES = 5  # none/special/padding, lower, Capitalized, UPPER, other (digits, punctuation, mixed)

# columns of a token array: -1 in SEGMENT / WORD where the tokenizer says None (special tokens)
IDS, TYPES, SEGMENT, WORD, START, END, CASING = range(7)
FIELDS = 7


@dataclass
class EncodedInput:
    """One tokenized input (text or text pair), before padding into a batch."""

    text: str
    text_pair: str | None
    tokens: np.ndarray  # (tokens, FIELDS) int32, columns IDS..CASING
    truncated: bool = False
    # the request's answer controls (server.heads.decode.AnswerOptions; None: default answers),
    # carried with the row through batching to wherever it is decoded
    answer: Any = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def ids(self) -> list[int]:
        return self.tokens[:, IDS].tolist()

    @property
    def type_ids(self) -> list[int]:
        return self.tokens[:, TYPES].tolist()

    @property
    def offsets(self) -> list[tuple[int, int]]:
        return list(zip(self.tokens[:, START].tolist(), self.tokens[:, END].tolist()))

    @property
    def sequence_ids(self) -> list[int | None]:
        return _nones(self.tokens[:, SEGMENT])

    @property
    def word_ids(self) -> list[int | None]:
        return _nones(self.tokens[:, WORD])


@dataclass
class WindowRow(EncodedInput):
    """A row that is one window of a longer text (server/windows.py cuts them): answered with its
    logits, merged per text. A row type: it lives here, below the runner and the workers that ask
    which rows are windows."""

    part: int = 0  # which window of its text


def window_rows(rows: list[EncodedInput]) -> list[int]:
    """Indices of the rows that are windows of a longer text (they keep their logits: server/answers.py)."""
    if type(rows) is RowBlock:  # a worker's rows: windows there are plain rows here
        return []
    return [r for r, row in enumerate(rows) if isinstance(row, WindowRow)]


def plain_rows(rows: list[EncodedInput]) -> list[int]:
    """Indices of the rows that are not windows (answered decoded, as always)."""
    return [r for r, row in enumerate(rows) if not isinstance(row, WindowRow)]


TRUNCATED, PAIR = 1, 2  # a RowBlock row's flags (as a worker's request frame carries them)


class RowBlock(Sequence):
    """Many rows as arrays, with no object per row: one (tokens, FIELDS) int32 block holding their
    tokens, each row's first token and token count, and one string holding every row's text and text
    pair (a worker's request frame as it crossed the socket, server/workers/frames.py). Sorting a batch,
    cutting it into passes and collate take rows by index (`take`, slices: a few numpy calls whatever
    the rows); a row read one at a time is made an EncodedInput then (rare paths: a bridged task's
    decode, tests)."""

    def __init__(self, tokens: np.ndarray, first: np.ndarray | None, lengths: np.ndarray, text: str,
                 bounds: np.ndarray | None, flags: np.ndarray, ends: np.ndarray | None = None):
        self.tokens = tokens  # (tokens, FIELDS) int32
        self._first = first  # (rows,) int64: each row's first token in `tokens`
        self.lengths = lengths  # (rows,) int64: each row's token count
        self.text = text
        self._bounds = bounds  # (rows, 3) int64 in `text`: text start, text end = pair start, pair end
        self.flags = flags  # (rows,) uint8: TRUNCATED, PAIR
        # rows laid one after the other (a frame's, or frames' joined): each row's text end and pair end,
        # from which `first` and `bounds` are made when first read (once per batch, not per frame)
        self._ends = ends

    @classmethod
    def of_frame(cls, tokens: np.ndarray, lengths: np.ndarray, text: str, ends: np.ndarray, flags: np.ndarray
                 ) -> "RowBlock":
        """Rows laid one after the other: `lengths` tokens each in `tokens`, and in `text` each
        row's text then its pair, `ends` (rows, 2) where each of the two ends."""
        return cls(tokens, None, lengths.astype(np.int64), text, None, flags, ends)

    @property
    def first(self) -> np.ndarray:
        if self._first is None:
            first = np.zeros(len(self.lengths), dtype=np.int64)
            np.cumsum(self.lengths[:-1], out=first[1:])
            self._first = first
        return self._first

    @property
    def bounds(self) -> np.ndarray:
        if self._bounds is None:
            ends = self._ends
            bounds = np.zeros((len(ends), 3), dtype=np.int64)
            bounds[:, 1:] = ends
            bounds[1:, 0] = ends[:-1, 1]
            self._bounds = bounds
        return self._bounds

    @classmethod
    def join(cls, blocks: list["RowBlock"]) -> "RowBlock":
        """Several frames' blocks (rows laid one after the other, `of_frame`), in order, as one such block
        (one copy of their tokens and texts): numpy calls per join, not per block (a batch of one-request
        frames joins one block per request)."""
        if len(blocks) == 1:
            return blocks[0]
        text_base = np.repeat(np.cumsum([0] + [len(b.text) for b in blocks[:-1]]), [len(b) for b in blocks])
        ends = np.concatenate([b._ends for b in blocks]).astype(np.int64)
        ends += text_base[:, None]
        return cls(np.concatenate([b.tokens for b in blocks]), None, np.concatenate([b.lengths for b in blocks]),
                   "".join([b.text for b in blocks]), None, np.concatenate([b.flags for b in blocks]), ends)

    def take(self, index) -> "RowBlock":
        """Rows `index` (an index array or a slice), in that order; tokens and text shared, not copied."""
        return RowBlock(self.tokens, self.first[index], self.lengths[index], self.text, self.bounds[index],
                        self.flags[index])

    def __len__(self) -> int:
        return self.lengths.shape[0]

    def __getitem__(self, row):
        if isinstance(row, slice):
            return self.take(row)
        a, b, c = self.bounds[row].tolist()
        flag = int(self.flags[row])
        first = int(self.first[row])
        return EncodedInput(self.text[a:b], self.text[b:c] if flag & PAIR else None,
                            self.tokens[first:first + int(self.lengths[row])], bool(flag & TRUNCATED))

    def texts(self) -> "TextSpans":
        return TextSpans(self.text, self.bounds[:, 0], self.bounds[:, 1])

    def text_pairs(self) -> "TextSpans | None":
        """Each row's pair (None for a row without one), or None if no row has one."""
        pairs = (self.flags & PAIR) != 0
        return TextSpans(self.text, self.bounds[:, 1], self.bounds[:, 2], pairs) if pairs.any() else None


def ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """starts[0] .. starts[0] + counts[0] - 1, then the same for starts[1], ...: one index array, with
    no step per range (a batch's rows' tokens in a block, or their places in a padded one). `starts`
    of shape (k, ranges): k such arrays over the same counts, made together."""
    before = np.cumsum(counts) - counts  # each range's first place in the result
    out = np.repeat(starts - before, counts, axis=-1)
    out += np.arange(out.shape[-1])
    return out


class BlockRows(Sequence):
    """Rows start..stop of a RowBlock: one request's rows as its batcher entry holds them (one small
    object per request, none per row)."""

    __slots__ = ("block", "start", "stop", "pairs")

    def __init__(self, block: RowBlock, start: int, stop: int, pairs: bool):
        self.block, self.start, self.stop = block, start, stop
        self.pairs = pairs  # text pairs (every row of a request is of one kind)

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, row):
        if isinstance(row, slice):
            return [self.block[r] for r in range(self.start, self.stop)[row]]
        return self.block[range(self.start, self.stop)[row]]


def are_pairs(rows) -> bool:
    """Whether a request's rows (a list of EncodedInputs, or BlockRows) are text pairs."""
    return rows.pairs if type(rows) is BlockRows else rows[0].text_pair is not None


def gather_rows(parts: list[BlockRows]) -> tuple[RowBlock, np.ndarray]:
    """Several requests' rows -> a block holding them all (theirs if they share one: the requests of
    one frame) and, request after request, the index of each of their rows in it: numpy calls per
    batch, a step per request."""
    block = parts[0].block
    if all(part.block is block for part in parts):
        starts = np.array([part.start for part in parts], dtype=np.int64)
    else:  # several frames: their blocks joined, each one's rows after the blocks before it
        blocks, offsets, at = [], {}, 0
        for part in parts:
            if id(part.block) not in offsets:
                offsets[id(part.block)] = at
                at += part.block.lengths.shape[0]
                blocks.append(part.block)
        block = RowBlock.join(blocks)
        starts = np.array([offsets[id(part.block)] + part.start for part in parts], dtype=np.int64)
    counts = np.array([part.stop - part.start for part in parts], dtype=np.int64)
    if int(counts.sum()) == len(parts):  # one row per request
        return block, starts
    return block, ranges(starts, counts)


class TextSpans(Sequence):
    """Texts as spans of one string, each sliced when read (None where `present` says none)."""

    def __init__(self, text: str, start: np.ndarray, end: np.ndarray, present: np.ndarray | None = None):
        self.text, self.start, self.end, self.present = text, start, end, present

    def __len__(self) -> int:
        return self.start.shape[0]

    def __getitem__(self, row):
        if isinstance(row, slice):
            return [self[r] for r in range(*row.indices(len(self)))]
        if self.present is not None and not self.present[row]:
            return None
        return self.text[int(self.start[row]):int(self.end[row])]

    def __add__(self, other) -> list:
        return list(self) + list(other)

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None


def _nones(values: np.ndarray) -> list[int | None]:
    return [None if v < 0 else v for v in values.tolist()]


class TokenLists(Sequence):
    """Per row, per token: a list made from planes of a batch's `TokenArrays` when a row is read
    (None where the plane holds -1; with `end`, (start, end) pairs). The planes are looked up only
    then: a collated batch makes them on first read (`TokenArraysLater`)."""

    def __init__(self, arrays, name: str, end: str | None = None):
        self.arrays, self.name, self.end_name = arrays, name, end

    def __len__(self) -> int:
        return getattr(self.arrays, self.name).shape[0]

    def __getitem__(self, row):
        if isinstance(row, slice):
            return [self[r] for r in range(*row.indices(len(self)))]
        values = getattr(self.arrays, self.name)
        if self.end_name is not None:
            return list(zip(values[row].tolist(), getattr(self.arrays, self.end_name)[row].tolist()))
        return _nones(values[row])

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) long, 1 = real token
    token_type_ids: torch.Tensor | None  # (B, T) long, or None where the model has none
    # per real row, per token (lists, or `TokenLists` made from `arrays` when read):
    offsets: Sequence[list[tuple[int, int]]]  # (start, end) chars in its own text
    sequence_ids: Sequence[list[int | None]]  # 0 = text, 1 = text_pair, None = special/pad
    word_ids: Sequence[list[int | None]]  # index of the pre-tokenized word
    texts: Sequence[str]  # a list, or `TextSpans` of a RowBlock's string
    text_pairs: Sequence[str | None] | None
    truncated: list[bool]
    # rows added at the end to fill a bucket shape (server/runner/shapes.py); each attends to its first
    # token only, so no attention row is fully masked; their outputs are dropped (`real`)
    filler_rows: int = 0
    # per-token classes some heads read (TOKEN_CLASSES: casing, segment), (B, T) each, made once
    # on the host (at collate time or on first use, `token_classes`)
    classes: dict[str, torch.Tensor] = field(default_factory=dict)
    # the per-token lists as arrays (collate's, made on first read; else made on first use: `token_arrays`)
    arrays: TokenArrays | TokenArraysLater | None = None

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def real_rows(self) -> int:
        return self.size - self.filler_rows

    def real(self) -> "TokenBatch":
        """This batch without its filler rows (what answers are decoded on)."""
        if not self.filler_rows:
            return self
        n = self.real_rows
        return replace(self, input_ids=self.input_ids[:n], attention_mask=self.attention_mask[:n],
                       token_type_ids=None if self.token_type_ids is None else self.token_type_ids[:n],
                       filler_rows=0, classes={name: t[:n] for name, t in self.classes.items()})

    def token_classes(self, name: str) -> torch.Tensor:
        """(B, T) classes `name` of each token (TOKEN_CLASSES), on the batch's device. Made once per
        batch, on the host, and kept: a head that reads them then does no per-token Python inside
        the pass, and the model runner copies them into a captured graph's static inputs like the
        token ids."""
        if name not in self.classes:
            self.classes[name] = TOKEN_CLASSES[name](self).to(self.input_ids.device)
        return self.classes[name]

    def token_arrays(self) -> "TokenArrays":
        """`sequence_ids`, `word_ids` and `offsets` as numpy arrays (real rows), made once per batch
        and kept: decoders work on whole arrays instead of per token in Python."""
        if self.arrays is None:
            self.arrays = TokenArrays.of(self)
        arrays = self.arrays
        return arrays.made() if type(arrays) is TokenArraysLater else arrays

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def lengths(self) -> list[int]:
        return self.attention_mask.sum(dim=1).tolist()

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "TokenBatch":
        """Move the tensors (non_blocking: from pinned host memory, asynchronously)."""
        self.input_ids = self.input_ids.to(device, non_blocking=non_blocking)
        self.attention_mask = self.attention_mask.to(device, non_blocking=non_blocking)
        if self.token_type_ids is not None:
            self.token_type_ids = self.token_type_ids.to(device, non_blocking=non_blocking)
        self.classes = {name: t.to(device, non_blocking=non_blocking) for name, t in self.classes.items()}
        return self


@dataclass
class TokenArrays:
    """A batch's per-token lists as (rows, T) int64 arrays, one row per real input; -1 where the
    list holds None (special tokens, padding)."""

    segment: np.ndarray  # sequence_ids: 0 = text, 1 = text_pair
    word: np.ndarray  # word_ids
    start: np.ndarray  # offsets: first character
    end: np.ndarray  # offsets: one past the last character
    casing: np.ndarray | None = None  # casing classes (CASING_CLASSES), where collate made them

    @classmethod
    def of_tokens(cls, tokens: np.ndarray, places: np.ndarray, rows: int, width: int) -> "TokenArrays":
        """From a batch's real tokens (tokens, FIELDS) and each one's place in its (rows, width)
        padded grid (row-major); padding gets -1 in segment and word, 0 elsewhere."""
        planes = np.zeros((FIELDS - SEGMENT, rows * width), dtype=np.int64)  # segment, word, start, end, casing
        planes[:WORD - SEGMENT + 1] = -1
        planes[:, places] = tokens[:, SEGMENT:].T
        segment, word, start, end, casing = planes.reshape(FIELDS - SEGMENT, rows, width)
        return cls(segment=segment, word=word, start=start, end=end, casing=casing)

    @classmethod
    def of(cls, batch: TokenBatch) -> "TokenArrays":
        """From a batch built by hand from lists (collate makes the arrays itself)."""
        rows, width = len(batch.offsets), batch.seq_len

        def ids(lists) -> np.ndarray:
            flat = (-1 if i is None else i for i in itertools.chain.from_iterable(lists))
            return np.fromiter(flat, dtype=np.int64, count=rows * width).reshape(rows, width)

        pairs = itertools.chain.from_iterable(itertools.chain.from_iterable(batch.offsets))
        offsets = np.fromiter(pairs, dtype=np.int64, count=rows * width * 2).reshape(rows, width, 2)
        return cls(ids(batch.sequence_ids), ids(batch.word_ids), offsets[..., 0], offsets[..., 1])


def real_column(source: np.ndarray, taken: np.ndarray | None, column: int) -> np.ndarray:
    """One field of a batch's real tokens: `source`'s rows `taken` (None: all of them, in order), a
    column's gather (cheaper than gathering whole rows for one field)."""
    return source[:, column] if taken is None else source[:, column][taken]


class TokenArraysLater:
    """A collated batch's `TokenArrays`, made on first read of any plane. The pass itself reads only
    ids and type ids (and, where a head reads casing, the casing column: `casing_plane`); the planes
    are read where a task is decoded in this process (never in a worker server's engine process for
    layer-mix tasks), and making them was ~40% of collating a batch (issue 37)."""

    __slots__ = ("_source", "_made")

    def __init__(self, source: np.ndarray, taken: np.ndarray | None, places: np.ndarray, rows: int, width: int):
        """`source` (tokens, FIELDS): the batch's real tokens are its rows `taken` (None: all of them, in
        order); `places`: each one's place in the (rows, width) grid, row-major."""
        self._source, self._made = (source, taken, places, rows, width), None

    def made(self) -> TokenArrays:
        if self._made is None:
            source, taken, places, rows, width = self._source
            tokens = source if taken is None else np.take(source, taken, axis=0)
            self._made, self._source = TokenArrays.of_tokens(tokens, places, rows, width), None
        return self._made

    def casing_plane(self) -> np.ndarray:
        """The casing plane (rows, width) alone, the others left unmade: what a casing-reading head
        (the shipped ner) needs at collate time, a column's gather and scatter instead of five planes
        (a 192-row batch's collate into a 256 x 64 bucket 146 -> 98 µs warm, issue 37)."""
        if self._made is not None:
            return self._made.casing
        source, taken, places, rows, width = self._source
        plane = np.zeros(rows * width, dtype=np.int64)
        plane[places] = real_column(source, taken, CASING)
        return plane.reshape(rows, width)

    segment = property(lambda self: self.made().segment)
    word = property(lambda self: self.made().word)
    start = property(lambda self: self.made().start)
    end = property(lambda self: self.made().end)
    casing = property(lambda self: self.made().casing)


# per character: what str.islower / isupper / istitle / isspace see (CPython's per-character
# properties), and whether it is a combining mark (Unicode category M*), looked up in a table so that
# a whole text is classified by numpy
_LOWER, _UPPER, _TITLE, _SPACE, _MARK = 1, 2, 4, 8, 16
_TABLE: np.ndarray | None = None  # flags of the Basic Multilingual Plane, made on first use (~30 ms)
# a character's lower, upper and title-case counts packed in one int64 (21 bits each), by its flags:
# one cumulative sum counts all three, and a span's counts are one difference (no field of a span's
# difference borrows from another while the span is under 2**21 characters: `_PACKED_LIMIT`)
_BITS = 21
_FIELD = (1 << _BITS) - 1
_NOT_UPPER = ~np.int64(_FIELD << _BITS)  # the lower and title fields
_PACKED = np.array([((f & _LOWER) != 0) | (((f & _UPPER) != 0) << _BITS) | (((f & _TITLE) != 0) << 2 * _BITS)
                    for f in range(32)], dtype=np.int64)
_PACKED_LIMIT = 1 << _BITS


def _flags_of(char: str) -> int:
    upper = char.isupper()
    return (char.islower() * _LOWER) | (upper * _UPPER) | ((char.istitle() and not upper) * _TITLE) \
        | (char.isspace() * _SPACE) | (is_mark(char) * _MARK)


def is_mark(char: str) -> bool:
    return unicodedata.category(char)[0] == "M"


def char_flags(text: str) -> np.ndarray:
    """(len(text) + 1,) uint8: each character's flags, and a 0 after the last one."""
    global _TABLE
    if _TABLE is None:
        _TABLE = np.fromiter((_flags_of(chr(c)) for c in range(0x10000)), dtype=np.uint8, count=0x10000)
    if text.isascii():  # one byte a character: no UTF-32 copy, no code past the table
        flags = np.zeros(len(text) + 1, dtype=np.uint8)
        flags[:-1] = _TABLE[np.frombuffer(text.encode("ascii"), dtype=np.uint8)]
        return flags
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    flags = np.zeros(len(codes) + 1, dtype=np.uint8)
    flags[:-1] = _TABLE[np.minimum(codes, 0xFFFF)]
    for i in np.nonzero(codes > 0xFFFF)[0].tolist():  # outside the table (emoji, rare scripts): one by one
        flags[i] = _flags_of(text[i])
    return flags


def token_spans(texts: list[str], pairs: list[str] | None, row: np.ndarray, segment: np.ndarray,
                start: np.ndarray, end: np.ndarray, trim: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat per-token arrays (row, segment (-1 special), start, end in its own text) ->
    (start, end, casing class): spans without surrounding whitespace (`trim`: byte-level BPE
    tokenizers count a word's leading space into its token, "Paris" in "to Paris" is (2, 8); every
    consumer of offsets wants the word itself), and the casing class of each span
    (CASING_CLASSES; 0 for special tokens and empty spans). Lowercasing tokenizers lose the case cue
    NER leans on; this gives it back. All texts of the batch are classified at once, with a few
    numpy calls whatever the number of tokens (a one-text request is dominated by their count)."""
    sources = texts + (pairs or [])
    joined = sources[0] if len(sources) == 1 else "".join(sources)
    flags = char_flags(joined)
    real = segment >= 0
    if len(sources) == 1:
        a, z = np.where(real, start, 0), np.where(real, end, 0)
        base = 0
    else:
        bases = np.array([0, *itertools.accumulate(len(t) for t in sources)], dtype=np.int64)
        source = np.where(segment == 1, row + len(texts), row)
        base = np.where(real, bases[source], 0)
        a, z = base + np.where(real, start, 0), base + np.where(real, end, 0)
    given_start = a  # where the tokenizer said each span starts, before trimming
    empty = z <= a
    first = flags[a]
    # flags[-1] is the 0 after the text: an empty span at 0 reads it (a false alarm only costs time)
    if trim and ((first | flags[z - 1]) & _SPACE).any():  # some span may start or end on a space
        spans = ~empty
        positions = np.arange(len(flags))
        text_char = (flags & _SPACE) == 0
        following = np.minimum.accumulate(np.where(text_char, positions, len(flags) - 1)[::-1])[::-1]
        preceding = np.maximum.accumulate(np.where(text_char, positions, -1))
        a = np.where(spans, np.minimum(following[a], z), a)
        z = np.where(spans & (z > a), np.maximum(preceding[np.maximum(z - 1, 0)] + 1, a), z)
        start, end = np.where(real, a - base, start), np.where(real, z - base, end)
        empty, first = z <= a, flags[a]
    if len(flags) < _PACKED_LIMIT:
        counts = np.zeros(len(flags) + 1, dtype=np.int64)
        np.cumsum(_PACKED[flags], out=counts[1:])
        until = counts[z]
        span = until - counts[a]  # lower + upper << 21 + title << 42 in [a, z)
        rest = until - counts[np.minimum(a + 1, z)]  # the same without the span's first character
        lower_only = (span - 1).view(np.uint64) < _FIELD  # 0 < span < 2**21: lower-case letters, nothing else cased
        upper_only = ((span & _NOT_UPPER) == 0) & (span != 0)
        capital = ((first & _UPPER) != 0) & (rest <= _FIELD) & ((rest != 0) | (z - a == 1))
    else:  # a text of 2**21 characters or more: a span may be that long too, so three plain counts
        counts = np.zeros((len(flags) + 1, 3), dtype=np.int64)
        np.cumsum((flags[:, None] & np.array([_LOWER, _UPPER, _TITLE], dtype=np.uint8)) != 0, axis=0, out=counts[1:])
        lower, upper, title = (counts[z] - counts[a]).T
        rest = counts[z] - counts[np.minimum(a + 1, z)]
        upper_only = (lower + title == 0) & (upper > 0)
        lower_only = (upper + title == 0) & (lower > 0)
        capital = ((first & _UPPER) != 0) & ((z - a == 1) | ((rest[:, 1] + rest[:, 2] == 0) & (rest[:, 0] > 0)))
    # other (4), then in increasing priority UPPER (3), Capitalized (2), lower (1); 0: special or empty
    casing = np.full(len(a), 4, dtype=np.int32)
    casing[upper_only] = 3
    casing[capital] = 2
    casing[lower_only] = 1
    casing[empty | ~real] = 0
    if trim and not joined.isascii():  # (str.isascii reads a flag: no pass over the text)
        ends_before_mark = ~empty & real & ((flags[z] & _MARK) != 0)
        if ends_before_mark.any():  # (each span's text ends at the next text's base: made here, where it is read)
            source_end = len(joined) if len(sources) == 1 else np.where(real, bases[source + 1], 0)
            end = np.where(ends_before_mark, claim_marks(flags, z, given_start, row, segment, real, source_end) - base,
                           end)
    return start, end, casing


def claim_marks(flags: np.ndarray, z: np.ndarray, given_start: np.ndarray, row, segment: np.ndarray,
                real: np.ndarray, source_end) -> np.ndarray:
    """Span ends moved past the combining marks that follow them and that no token holds: an
    accent-stripping tokenizer (BERT's uncased ones) drops a decomposed accent from every token, so
    "Bogota\u0301" (NFD, as macOS and some PDFs write it) would end an entity at "Bogota", and Hindi's
    "में" at "म". A mark stays outside where the next token of the same text starts, or the text ends."""
    positions = np.arange(len(flags))
    next_unmarked = np.minimum.accumulate(np.where((flags & _MARK) == 0, positions, len(flags) - 1)[::-1])[::-1]
    limit = np.broadcast_to(source_end, z.shape).copy()
    row = np.broadcast_to(row, z.shape)  # 0: one text
    same_text = real[1:] & (row[1:] == row[:-1]) & (segment[1:] == segment[:-1])
    limit[:-1] = np.where(same_text, np.minimum(limit[:-1], given_start[1:]), limit[:-1])
    return np.maximum(z, np.minimum(next_unmarked[z], limit))


# A request of at most this many tokens is made into its array in Python (`few_token_rows`): the
# numpy path costs ~45 calls whatever the length (~38 µs plus ~0.4 µs a token on a 2-core EPYC),
# Python ~0.6 µs a token; they cost the same near 200 tokens (docs/host-path-log.md, issue 37).
FEW_TOKENS = 128


def few_token_rows(encodings, texts: list[str], pairs: list[str] | None) -> np.ndarray:
    """What `TextEncoder.token_array` makes with numpy, made token by token in Python: the same
    (tokens, FIELDS) int32 array, for requests with few tokens. A span is trimmed with str.strip,
    which strips what str.isspace sees (the `_SPACE` flag), and classed with str.islower and
    str.isupper, which read the `_LOWER`, `_UPPER` and `_TITLE` flags of its characters the way
    `token_spans` counts them (tests/test_tokens_few.py checks every character against it)."""
    values = []  # the rows' fields one after the other (numpy reads a flat list faster than a list of rows)
    for r, encoding in enumerate(encodings):
        text, pair = texts[r], pairs[r] if pairs is not None else None
        first = len(values)
        for token, kind, segment, word, (start, end) in zip(encoding.ids, encoding.type_ids, encoding.sequence_ids,
                                                            encoding.word_ids, encoding.offsets):
            if word is None:
                word = -1
            if segment is None:  # a special token: its offsets as given, casing 0
                values += (token, kind, -1, word, start, end, 0)
                continue
            span = (pair if segment == 1 else text)[start:end]
            if span and (span[0].isspace() or span[-1].isspace()):
                span = span.lstrip()
                start = end - len(span)
                span = span.rstrip()
                end = start + len(span)
            values += (token, kind, segment, word, start, end, span_casing(span))
        if not (text.isascii() and (pair is None or pair.isascii())):
            claim_marks_of_row(values, first, encoding, text, pair)
    return np.array(values, dtype=np.int32).reshape(-1, FIELDS)


def claim_marks_of_row(values: list, first: int, encoding, text: str, pair: str | None) -> None:
    """`claim_marks` for one row of `few_token_rows`' flat list (its fields from `values[first]` on)."""
    segments, offsets = encoding.sequence_ids, encoding.offsets
    for i, segment in enumerate(segments):
        at = first + i * FIELDS
        start, end = values[at + START], values[at + END]
        source = pair if segment == 1 else text
        if segment is None or end <= start or end >= len(source) or not is_mark(source[end]):
            continue
        limit = offsets[i + 1][0] if i + 1 < len(segments) and segments[i + 1] == segment else len(source)
        while end < limit and is_mark(source[end]):
            end += 1
        values[at + END] = end


def span_casing(span: str) -> int:
    """The casing class of one span (CASING_CLASSES), as `token_spans` classes it: 0 empty, 1 lower
    (no upper- or title-case character, some lower-case one: str.islower), 2 Capitalized (an
    upper-case first character, alone or followed by lower-case ones), 3 UPPER (no lower- or
    title-case character, some upper-case one: str.isupper), 4 anything else."""
    if not span:
        return 0
    if span.islower():
        return 1
    if span[0].isupper() and (len(span) == 1 or span[1:].islower()):
        return 2
    return 3 if span.isupper() else 4


def casing_classes(batch: TokenBatch) -> torch.Tensor:
    """(B, T) host tensor: the casing class of each token (CASING_CLASSES), 0 for special tokens,
    padding and filler rows."""
    casing = np.zeros(tuple(batch.input_ids.shape), dtype=np.int64)
    if type(batch.arrays) is TokenArraysLater:  # collated: the casing column alone
        plane = batch.arrays.casing_plane()
        casing[:plane.shape[0]] = plane
        return torch.from_numpy(casing)
    arrays = batch.token_arrays()
    if arrays.casing is not None:
        casing[:arrays.casing.shape[0]] = arrays.casing
    else:
        rows, width = arrays.segment.shape
        row = np.repeat(np.arange(rows), width)
        _, _, flat = token_spans(batch.texts, batch.text_pairs, row, arrays.segment.reshape(-1),
                                 arrays.start.reshape(-1), arrays.end.reshape(-1), trim=False)
        casing[:rows] = flat.reshape(rows, width)
    return torch.from_numpy(casing)


def segment_classes(batch: TokenBatch) -> torch.Tensor:
    """(B, T) host tensor: which text each token belongs to, from the tokenizer's sequence ids: 0 =
    the text, 1 = the text pair, 2 = a special token, padding or a filler row. Pair heads pool the
    text and the pair separately with it."""
    segments = np.full(tuple(batch.input_ids.shape), 2, dtype=np.int64)
    arrays = batch.token_arrays().segment  # real rows; -1 = special or padding
    segments[:arrays.shape[0]] = np.where(arrays < 0, 2, arrays)
    return torch.from_numpy(segments)


# Per-token classes a head may read (`Head.token_classes_read`), by name: made on the host from the
# raw inputs, never inside the pass.
TOKEN_CLASSES = {"casing": casing_classes, "segment": segment_classes}


def trimmed_offsets(offsets, sequence_ids, text: str, pair: str | None) -> list[tuple[int, int]]:
    """One input's token spans without surrounding whitespace (`token_spans`)."""
    segment = np.array([-1 if s is None else s for s in sequence_ids], dtype=np.int64)
    bounds = np.array(offsets, dtype=np.int64).reshape(-1, 2)
    start, end, _ = token_spans([text], None if pair is None else [pair], np.zeros(len(segment), dtype=np.int64),
                                segment, bounds[:, 0], bounds[:, 1])
    return list(zip(start.tolist(), end.tolist()))


class InputTooLong(ValueError):
    def __init__(self, rows: list[int], lengths: list[int], limit: int):
        self.rows, self.lengths, self.limit = rows, lengths, limit
        detail = ", ".join(f"input {r} has {n} tokens" for r, n in zip(rows, lengths))
        super().__init__(f"{detail}; the limit is {limit} (ask for truncation to cut them)")


def keep_last_tokens(row: EncodedInput, limit: int) -> EncodedInput:
    """A single text cut from the left to `limit` tokens: its leading and trailing special tokens
    and the last text tokens that fit (what a tokenizer truncating on the left gives)."""
    text = np.flatnonzero(row.tokens[:, SEGMENT] >= 0)
    specials = len(row) - len(text)
    keep = np.r_[0:text[0], text[len(text) - (limit - specials):], text[-1] + 1:len(row)]
    return replace(row, tokens=row.tokens[keep], truncated=True)


class TextEncoder:
    """A fast tokenizer with its model's limits: text -> EncodedInput (with character offsets) ->
    padded TokenBatch. The backbone has one; a bridge has one for its target backbone.

    Requests are tokenized by the `tokenizers` library directly (`plain`, a copy of the wrapper's
    backend that never truncates or pads), not through the transformers wrapper, whose per-call
    argument handling and per-token conversions cost several times the tokenization itself (issue
    37, docs/host-path-log.md#the-host-path-per-request-issue-37). `tokenizer`, the wrapper, stays for
    what is not per request (token names, saving, the vocabulary hash)."""

    def __init__(self, tokenizer, max_tokens: int, uses_token_types: bool, device: torch.device | str = "cpu"):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("a fast tokenizer is required (character offsets come from it)")
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens  # the most tokens one input may have
        self.uses_token_types = uses_token_types
        self.device = torch.device(device)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (tokenizer.eos_token_id or 0)
        self._cutter = None  # the truncating copy of the backend (`_cut`), made on first use
        self._cut_lock = threading.Lock()
        self.plain = self._backend()

    def _backend(self):
        """A copy of the wrapper's backend tokenizer set as the wrapper sets it for a call without
        truncation or padding (a tokenizer.json may carry either); nothing sets it again, so threads
        share it safely."""
        backend = copy.deepcopy(self.tokenizer.backend_tokenizer)
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = bool(getattr(self.tokenizer, "split_special_tokens", False))
        return backend

    def __getstate__(self):  # sent to worker processes: the lock and the copies are made anew there
        return {k: v for k, v in self.__dict__.items() if k not in ("_cutter", "_cut_lock", "plain")}

    def __setstate__(self, state):
        self.__dict__.update(state, _cutter=None, _cut_lock=threading.Lock())
        self.plain = self._backend()

    def tokenize(self, texts, text_pairs=None, truncate: bool = False, max_tokens: int | None = None) -> TokenBatch:
        """encode() then collate(): a padded batch in input order."""
        return self.collate(self.encode(texts, text_pairs, truncate, max_tokens))

    def row_limit(self, max_tokens: int | None = None) -> int:
        """The most word pieces one row may hold: the model's limit, or a lower `max_tokens`."""
        return min(max_tokens, self.max_tokens) if max_tokens else self.max_tokens

    def encode(self, texts, text_pairs=None, truncate: bool | str = False, max_tokens: int | None = None,
               whole: bool = False) -> list[EncodedInput]:
        """Tokenize with offsets. Inputs over the token limit (the model's, or a lower
        `max_tokens`) raise InputTooLong unless `truncate`: True or "right" cuts their end, "left"
        their start (single texts only; the special tokens stay); `whole`: no limit
        (server/windows.py cuts such inputs into windows)."""
        texts = list(texts)
        pairs = list(text_pairs) if text_pairs is not None else None
        limit = self.row_limit(max_tokens)
        inputs = texts if pairs is None else list(zip(texts, pairs))
        if len(texts) == 1:  # one input: no batch (the library's thread pool is not worth it)
            encodings = [self.plain.encode(texts[0], None if pairs is None else pairs[0])]
        else:
            encodings = self.plain.encode_batch(inputs)
        lengths = [len(e) for e in encodings]
        too_long = [] if whole else [i for i, n in enumerate(lengths) if n > limit]
        if too_long and not truncate:
            raise InputTooLong(too_long, [lengths[i] for i in too_long], limit)
        if truncate == "left" and pairs is not None:
            raise ValueError("truncation from the left is for single texts")
        if too_long and truncate != "left":
            encodings = self._cut(inputs, limit)
            lengths = [len(e) for e in encodings]
        tokens = self.token_array(encodings, texts, pairs)
        if len(texts) == 1:
            rows = [EncodedInput(texts[0], pairs[0] if pairs is not None else None, tokens, bool(too_long))]
        else:
            bounds = [0, *itertools.accumulate(lengths)]
            cut = set(too_long)
            rows = [EncodedInput(texts[r], pairs[r] if pairs is not None else None, tokens[bounds[r]:bounds[r + 1]],
                                 r in cut) for r in range(len(texts))]
        if truncate == "left" and too_long:
            rows = [keep_last_tokens(rows[r], limit) if r in too_long else rows[r] for r in range(len(rows))]
        return rows

    def _cut(self, inputs: list, limit: int) -> list:
        """Encodings truncated to `limit` (as the wrapper truncates: longest first, on its side). A
        tokenizer keeps its truncation setting as state, set just before it encodes, so a truncating
        call on the shared one would race other threads' plain calls (some long texts came back
        silently cut, some cut ones whole): truncating calls go to a copy of their own, one at a time;
        the shared one is never set to truncate."""
        with self._cut_lock:
            if self._cutter is None:
                self._cutter = self._backend()
            self._cutter.enable_truncation(limit, stride=0, strategy="longest_first",
                                           direction=getattr(self.tokenizer, "truncation_side", "right"))
            return self._cutter.encode_batch(inputs)

    @staticmethod
    def token_array(encodings, texts: list[str], pairs: list[str] | None) -> np.ndarray:
        """The tokenizer's encodings of a request -> one (tokens, FIELDS) int32 array (rows one
        after the other). Up to `FEW_TOKENS` tokens, each token's row is made in Python
        (`few_token_rows`); past it each column is converted from the encodings' lists by numpy in
        one call (None, for special tokens, arrives as NaN in a float array and leaves as -1) and
        spans and casing classes come from `token_spans`. Both give the same array."""
        if sum(len(e) for e in encodings) <= FEW_TOKENS:
            return few_token_rows(encodings, texts, pairs)
        if len(encodings) == 1:
            e = encodings[0]
            ids, types, segments, words, offsets = e.ids, e.type_ids, e.sequence_ids, e.word_ids, e.offsets
        else:
            chain = itertools.chain.from_iterable
            ids, types = list(chain(e.ids for e in encodings)), list(chain(e.type_ids for e in encodings))
            segments, words = list(chain(e.sequence_ids for e in encodings)), list(chain(e.word_ids for e in encodings))
            offsets = list(chain(e.offsets for e in encodings))
        n = len(ids)
        out = np.empty((n, FIELDS), dtype=np.int32)
        out[:, IDS] = ids
        out[:, TYPES] = types
        nullable = np.array((segments, words), dtype=np.float64).reshape(2, n)
        nullable[np.isnan(nullable)] = -1  # (np.nan_to_num costs more than the whole column)
        out[:, SEGMENT:WORD + 1] = nullable.T
        bounds = np.array(offsets, dtype=np.int64).reshape(n, 2)
        row = 0 if len(encodings) == 1 else np.repeat(np.arange(len(encodings)), [len(e) for e in encodings])
        out[:, START], out[:, END], out[:, CASING] = token_spans(texts, pairs, row, out[:, SEGMENT], bounds[:, 0],
                                                                 bounds[:, 1])
        return out

    def collate(self, rows, shape: tuple[int, int] | None = None, device: torch.device | str | None = None,
                classes: Iterable[str] = (), lengths: Sequence[int] | None = None) -> TokenBatch:
        """Pad encoded inputs (a list of EncodedInputs, or a RowBlock: possibly from several
        requests) into one batch; padding goes on the right for every model (a causal decoder's real
        tokens never attend to it).

        `shape` (rows, tokens): pad to that bucket shape instead of the smallest one; rows past
        the real ones are filler rows (`TokenBatch.filler_rows`). `device`: where the tensors go
        (default this encoder's device; "cpu" keeps them on the host for the caller to pin and
        copy). `classes`: the per-token classes to make now (TOKEN_CLASSES that loaded heads read).
        `lengths`: the rows' token counts where the caller has them (else each row is asked; a
        RowBlock has them)."""
        block = type(rows) is RowBlock
        if block:
            lengths = rows.lengths
        else:
            lengths = np.array([len(row) for row in rows] if lengths is None else lengths, dtype=np.int64)
        width = int(lengths.max())
        height = n = len(rows)
        if shape is not None:
            if shape[0] < height or shape[1] < width:
                raise ValueError(f"bucket {shape} is smaller than the batch ({height} rows x {width} tokens)")
            height, width = shape
        # each real token's row in `source` (tokens, FIELDS) and its place in the (n, width) grid of real
        # rows (row-major, so also in the padded one): no Python per row or token
        real = np.arange(width) < lengths[:, None]
        if block:  # the block's token array, and which of its rows: two index arrays
            places, taken = ranges(np.stack((np.arange(0, n * width, width, dtype=np.int64), rows.first)), lengths)
            source = rows.tokens
        else:  # the rows' tokens one after the other, all of them
            source, taken = np.concatenate([row.tokens for row in rows]) if n > 1 else rows[0].tokens, None
            places = np.flatnonzero(real)
        # what the pass reads, ids (and type ids), padded to the whole (height, width) block now, one
        # column at a time (a column's gather and scatter cost less than a row's); the other per-token
        # planes when someone reads them (`TokenArraysLater`)
        columns = (IDS, TYPES) if self.uses_token_types else (IDS,)
        inputs = np.empty((len(columns), height * width), dtype=np.int64)
        for plane, column in enumerate(columns):
            inputs[plane].fill(self.pad_id if column == IDS else 0)
            inputs[plane, places] = real_column(source, taken, column)
        inputs = inputs.reshape(len(columns), height, width)
        attention = np.zeros((height, width), dtype=np.int64)
        attention[:n] = real
        attention[n:, 0] = 1  # filler rows see one token: no attention row is all masked
        arrays = TokenArraysLater(source, taken, places, n, width)
        if block:  # texts sliced out of the block's string only when read
            texts, pairs, truncated = rows.texts(), rows.text_pairs(), ((rows.flags & TRUNCATED) != 0).tolist()
        else:
            texts, pairs, truncated = [row.text for row in rows], [row.text_pair for row in rows], \
                [row.truncated for row in rows]
            if pairs.count(None) == n:
                pairs = None
        batch = TokenBatch(
            input_ids=torch.from_numpy(inputs[0]), attention_mask=torch.from_numpy(attention),
            token_type_ids=torch.from_numpy(inputs[1]) if self.uses_token_types else None,
            offsets=TokenLists(arrays, "start", "end"), sequence_ids=TokenLists(arrays, "segment"),
            word_ids=TokenLists(arrays, "word"), texts=texts, text_pairs=pairs, truncated=truncated,
            filler_rows=height - n, arrays=arrays,
        )
        for name in classes:
            batch.token_classes(name)
        device = self.device if device is None else device
        # from_numpy: on the host already
        return batch if device == "cpu" or torch.device(device).type == "cpu" else batch.to(device)
