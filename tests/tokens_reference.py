"""Tokenization with offsets as server/backbone/tokens.py did it before issue 37 (commit 31ec5ac),
frozen here purely as the oracle of tests/test_tokens.py: the transformers wrapper called per request,
a Python generator per token for the None -> -1 columns, and the first numpy version of the span
trimming and casing classes; plus one rule added since, `claim_marks`, a plain loop here. Not used by
the server."""
from __future__ import annotations

import copy
import itertools
import unicodedata

import numpy as np

FIELDS = 7
IDS, TYPES, SEGMENT, WORD, START, END, CASING = range(7)
_LOWER, _UPPER, _TITLE, _SPACE = 1, 2, 4, 8
_TABLE: np.ndarray | None = None


def _flags_of(char: str) -> int:
    upper = char.isupper()
    return (char.islower() * _LOWER) | (upper * _UPPER) | ((char.istitle() and not upper) * _TITLE) \
        | (char.isspace() * _SPACE)


def char_flags(text: str) -> np.ndarray:
    global _TABLE
    if _TABLE is None:
        _TABLE = np.fromiter((_flags_of(chr(c)) for c in range(0x10000)), dtype=np.uint8, count=0x10000)
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    flags = np.zeros(len(codes) + 1, dtype=np.uint8)
    flags[:-1] = _TABLE[np.minimum(codes, 0xFFFF)]
    for i in np.nonzero(codes > 0xFFFF)[0].tolist():
        flags[i] = _flags_of(text[i])
    return flags


def token_spans(texts, pairs, row, segment, start, end, trim=True):
    sources = texts + (pairs or [])
    bases = np.array([0, *itertools.accumulate(len(t) for t in sources)], dtype=np.int64)
    flags = char_flags("".join(sources))
    real = segment >= 0
    base = np.where(real, bases[np.where(segment == 1, row + len(texts), row)], 0)
    a, z = np.where(real, base + start, 0), np.where(real, base + end, 0)
    spans = real & (z > a)
    if trim and ((flags[a[spans]] | flags[z[spans] - 1]) & _SPACE).any():
        positions = np.arange(len(flags))
        text_char = (flags & _SPACE) == 0
        following = np.minimum.accumulate(np.where(text_char, positions, len(flags) - 1)[::-1])[::-1]
        preceding = np.maximum.accumulate(np.where(text_char, positions, -1))
        a = np.where(spans, np.minimum(following[a], z), a)
        z = np.where(spans & (z > a), np.maximum(preceding[np.maximum(z - 1, 0)] + 1, a), z)
        start, end = np.where(real, a - base, start), np.where(real, z - base, end)
    counts = np.zeros((len(flags) + 1, 3), dtype=np.int32)
    np.cumsum((flags[:, None] & np.array([_LOWER, _UPPER, _TITLE], dtype=np.uint8)) != 0, axis=0, out=counts[1:])
    lower, upper, title = (counts[z] - counts[a]).T
    rest = counts[z] - counts[np.minimum(a + 1, z)]
    casing = np.full(len(a), 4, dtype=np.int32)
    casing[(lower + title == 0) & (upper > 0)] = 3
    casing[((flags[a] & _UPPER) != 0) & ((z - a == 1) | ((rest[:, 1] + rest[:, 2] == 0) & (rest[:, 0] > 0)))] = 2
    casing[(upper + title == 0) & (lower > 0)] = 1
    casing[~real | (z <= a)] = 0
    return start, end, casing


def token_array(encodings, texts, pairs) -> np.ndarray:
    chain = itertools.chain.from_iterable
    n = sum(len(e) for e in encodings)
    out = np.empty((n, FIELDS), dtype=np.int32)
    out[:, IDS] = np.fromiter(chain(e.ids for e in encodings), dtype=np.int32, count=n)
    out[:, TYPES] = np.fromiter(chain(e.type_ids for e in encodings), dtype=np.int32, count=n)
    for column, name in ((SEGMENT, "sequence_ids"), (WORD, "word_ids")):
        values = chain(getattr(e, name) for e in encodings)
        out[:, column] = np.fromiter((-1 if v is None else v for v in values), dtype=np.int32, count=n)
    offsets = np.fromiter(chain(chain(e.offsets for e in encodings)), dtype=np.int64, count=2 * n).reshape(n, 2)
    row = np.repeat(np.arange(len(encodings)), [len(e) for e in encodings])
    out[:, START], out[:, END], out[:, CASING] = token_spans(texts, pairs, row, out[:, SEGMENT].astype(np.int64),
                                                             offsets[:, 0], offsets[:, 1])
    claim_marks(out, encodings, texts, pairs)
    return out


def claim_marks(out: np.ndarray, encodings, texts, pairs) -> None:
    """A non-empty span's end moves past the combining marks (Unicode category M*) after it, up to
    where the next token of its text starts or the text ends."""
    at = 0
    for r, encoding in enumerate(encodings):
        # read once: each read of an Encoding's property builds the whole list anew (a 20,000-character
        # text's tokens read it per token: ~100 s of the byte-level tokenizer's test)
        segments, offsets = encoding.sequence_ids, encoding.offsets
        for i, segment in enumerate(segments):
            start, end = int(out[at + i, START]), int(out[at + i, END])
            if segment is None or end <= start:
                continue
            source = pairs[r] if segment == 1 else texts[r]
            limit = offsets[i + 1][0] if i + 1 < len(segments) and segments[i + 1] == segment else len(source)
            while end < limit and unicodedata.category(source[end]).startswith("M"):
                end += 1
            out[at + i, END] = end
        at += len(segments)


def keep_last_tokens(tokens: np.ndarray, limit: int) -> np.ndarray:
    text = np.flatnonzero(tokens[:, SEGMENT] >= 0)
    specials = len(tokens) - len(text)
    keep = np.r_[0:text[0], text[len(text) - (limit - specials):], text[-1] + 1:len(tokens)]
    return tokens[keep]


_CUTTERS: dict = {}


def reference_encode(tokenizer, max_tokens: int, texts, text_pairs=None, truncate=False, max_tokens_asked=None,
                     whole=False) -> list[tuple[np.ndarray, bool]] | tuple[list[int], list[int], int]:
    """Per input, (its (tokens, FIELDS) int32 array, truncated); or, where an input is over the
    limit and not truncated, (rows, lengths, limit) as InputTooLong carried them."""
    texts = list(texts)
    pairs = list(text_pairs) if text_pairs is not None else None
    limit = min(max_tokens_asked, max_tokens) if max_tokens_asked else max_tokens
    enc = tokenizer(texts, pairs, add_special_tokens=True, truncation=False, verbose=False)
    lengths = [len(ids) for ids in enc["input_ids"]]
    too_long = [] if whole else [i for i, n in enumerate(lengths) if n > limit]
    if too_long and not truncate:
        return too_long, [lengths[i] for i in too_long], limit
    if too_long and truncate != "left":
        if id(tokenizer) not in _CUTTERS:  # the copy the encoder truncated with (one per tokenizer)
            _CUTTERS[id(tokenizer)] = (tokenizer, copy.deepcopy(tokenizer))
        enc = _CUTTERS[id(tokenizer)][1](texts, pairs, add_special_tokens=True, truncation=True, max_length=limit)
    tokens = token_array(enc.encodings, texts, pairs)
    bounds = np.concatenate(([0], np.cumsum([len(e) for e in enc.encodings]))).tolist()
    rows = [(tokens[bounds[r]:bounds[r + 1]], r in too_long) for r in range(len(texts))]
    if truncate == "left":
        rows = [(keep_last_tokens(t, limit), cut) if cut else (t, cut) for t, cut in rows]
    return rows
