"""Tokenized batches with character offsets, so heads can answer in input coordinates."""
from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

CASING_CLASSES = 5  # none/special/padding, lower, Capitalized, UPPER, other (digits, punctuation, mixed)


@dataclass
class EncodedInput:
    """One tokenized input (text or text pair), before padding into a batch."""

    text: str
    text_pair: str | None
    ids: list[int]
    type_ids: list[int]
    offsets: list[tuple[int, int]]
    sequence_ids: list[int | None]
    word_ids: list[int | None]
    truncated: bool

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) long, 1 = real token
    token_type_ids: torch.Tensor | None  # (B, T) long, or None where the model has none
    offsets: list[list[tuple[int, int]]]  # per row, per token: (start, end) chars in its own text
    sequence_ids: list[list[int | None]]  # per row, per token: 0 = text, 1 = text_pair, None = special/pad
    word_ids: list[list[int | None]]  # per row, per token: index of the pre-tokenized word
    texts: list[str]
    text_pairs: list[str] | None
    truncated: list[bool]
    # rows added at the end to fill a bucket shape (server/runner.py); each attends to its first
    # token only, so no attention row is fully masked; their outputs are dropped (`real`)
    filler_rows: int = 0
    # per-token classes some heads read (TOKEN_CLASSES: casing, segment), (B, T) each, made once
    # on the host (at collate time or on first use, `token_classes`)
    classes: dict[str, torch.Tensor] = field(default_factory=dict)
    arrays: TokenArrays | None = None  # the per-token lists as arrays, made once on first use (`token_arrays`)

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
        return self.arrays

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

    def pin_memory(self) -> "TokenBatch":
        """Page-locked host copies of the tensors, so copies to a GPU can run asynchronously."""
        self.input_ids = self.input_ids.pin_memory()
        self.attention_mask = self.attention_mask.pin_memory()
        if self.token_type_ids is not None:
            self.token_type_ids = self.token_type_ids.pin_memory()
        self.classes = {name: t.pin_memory() for name, t in self.classes.items()}
        return self


@dataclass
class TokenArrays:
    """A batch's per-token lists as (rows, T) int64 arrays, one row per real input; -1 where the
    list holds None (special tokens, padding)."""

    segment: np.ndarray  # sequence_ids: 0 = text, 1 = text_pair
    word: np.ndarray  # word_ids
    start: np.ndarray  # offsets: first character
    end: np.ndarray  # offsets: one past the last character

    @classmethod
    def of(cls, batch: TokenBatch) -> "TokenArrays":
        rows, width = len(batch.offsets), batch.seq_len

        def ids(lists) -> np.ndarray:
            flat = (-1 if i is None else i for i in itertools.chain.from_iterable(lists))
            return np.fromiter(flat, dtype=np.int64, count=rows * width).reshape(rows, width)

        pairs = itertools.chain.from_iterable(itertools.chain.from_iterable(batch.offsets))
        offsets = np.fromiter(pairs, dtype=np.int64, count=rows * width * 2).reshape(rows, width, 2)
        return cls(ids(batch.sequence_ids), ids(batch.word_ids), offsets[..., 0], offsets[..., 1])


def casing_classes(batch: TokenBatch) -> torch.Tensor:
    """(B, T) host tensor: the casing class of each token (CASING_CLASSES), 0 for special tokens,
    padding and filler rows. Lowercasing tokenizers lose the case cue NER leans on; this gives it back."""
    height, width = batch.input_ids.shape
    rows = []
    for r in range(batch.real_rows):
        ids = []
        for (start, end), seq in zip(batch.offsets[r], batch.sequence_ids[r]):
            if seq is None or end <= start:
                ids.append(0)
                continue
            piece = (batch.texts[r] if seq == 0 else batch.text_pairs[r])[start:end]
            if piece.islower():
                ids.append(1)
            elif piece[0].isupper() and (len(piece) == 1 or piece[1:].islower()):
                ids.append(2)
            elif piece.isupper():
                ids.append(3)
            else:
                ids.append(4)
        rows.append(ids + [0] * (width - len(ids)))
    rows += [[0] * width] * (height - len(rows))
    return torch.tensor(rows, dtype=torch.long)


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
    """Token spans without surrounding whitespace. Byte-level BPE tokenizers (SmolLM2, GPT-2
    style) count a word's leading space into its token ("Paris" in "to Paris" is (2, 8)); every
    consumer of offsets (entity spans, word tags, casing, token pairing) wants the word itself."""
    out = []
    for (start, end), seq in zip(offsets, sequence_ids):
        source = text if seq == 0 else pair if seq == 1 else None
        if source is not None:
            while start < end and source[start].isspace():
                start += 1
            while end > start and source[end - 1].isspace():
                end -= 1
        out.append((start, end))
    return out


class InputTooLong(ValueError):
    def __init__(self, rows: list[int], lengths: list[int], limit: int):
        self.rows, self.lengths, self.limit = rows, lengths, limit
        detail = ", ".join(f"input {r} has {n} tokens" for r, n in zip(rows, lengths))
        super().__init__(f"{detail}; the limit is {limit} (ask for truncation to cut them)")


class TextEncoder:
    """A fast tokenizer with its model's limits: text -> EncodedInput (with character offsets) ->
    padded TokenBatch. The backbone has one; a bridge has one for its target backbone."""

    def __init__(self, tokenizer, max_tokens: int, uses_token_types: bool, device: torch.device | str = "cpu"):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("a fast tokenizer is required (character offsets come from it)")
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens  # the most tokens one input may have
        self.uses_token_types = uses_token_types
        self.device = torch.device(device)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (tokenizer.eos_token_id or 0)

    def tokenize(self, texts, text_pairs=None, truncate: bool = False, max_tokens: int | None = None) -> TokenBatch:
        """encode() then collate(): a padded batch in input order."""
        return self.collate(self.encode(texts, text_pairs, truncate, max_tokens))

    def encode(self, texts, text_pairs=None, truncate: bool = False, max_tokens: int | None = None,
               whole: bool = False) -> list[EncodedInput]:
        """Tokenize with offsets. Inputs over the token limit (the model's, or a lower
        `max_tokens`) raise InputTooLong unless `truncate`; `whole`: no limit (server/windows.py
        cuts such inputs into windows)."""
        texts = list(texts)
        pairs = list(text_pairs) if text_pairs is not None else None
        limit = min(max_tokens, self.max_tokens) if max_tokens else self.max_tokens
        enc = self.tokenizer(texts, pairs, add_special_tokens=True, truncation=False, verbose=False)
        lengths = [len(ids) for ids in enc["input_ids"]]
        too_long = [] if whole else [i for i, n in enumerate(lengths) if n > limit]
        if too_long and not truncate:
            raise InputTooLong(too_long, [lengths[i] for i in too_long], limit)
        if too_long:
            enc = self.tokenizer(texts, pairs, add_special_tokens=True, truncation=True, max_length=limit)
        cut = set(too_long)
        rows = []
        for r, encoding in enumerate(enc.encodings):
            pair = pairs[r] if pairs is not None else None
            rows.append(EncodedInput(
                text=texts[r], text_pair=pair, ids=list(encoding.ids), type_ids=list(encoding.type_ids),
                offsets=trimmed_offsets(encoding.offsets, encoding.sequence_ids, texts[r], pair),
                sequence_ids=list(encoding.sequence_ids), word_ids=list(encoding.word_ids), truncated=r in cut,
            ))
        return rows

    def collate(self, rows, shape: tuple[int, int] | None = None, device: torch.device | str | None = None,
                classes: Iterable[str] = ()) -> TokenBatch:
        """Pad encoded inputs (possibly from several requests) into one batch; padding goes on
        the right for every model (a causal decoder's real tokens never attend to it).

        `shape` (rows, tokens): pad to that bucket shape instead of the smallest one; rows past
        the real ones are filler rows (`TokenBatch.filler_rows`). `device`: where the tensors go
        (default this encoder's device; "cpu" keeps them on the host for the caller to pin and
        copy). `classes`: the per-token classes to make now (TOKEN_CLASSES that loaded heads read)."""
        lengths = [len(row.ids) for row in rows]
        width = max(lengths)
        height = len(rows)
        if shape is not None:
            if shape[0] < height or shape[1] < width:
                raise ValueError(f"bucket {shape} is smaller than the batch ({height} rows x {width} tokens)")
            height, width = shape
        # filled in numpy, a slice per row (a tensor per row cost more than the rest of collating)
        input_ids = np.full((height, width), self.pad_id, dtype=np.int64)
        attention = np.zeros((height, width), dtype=np.int64)
        attention[:len(rows)] = np.arange(width) < np.array(lengths)[:, None]
        attention[len(rows):, 0] = 1  # filler rows see one token: no attention row is all masked
        types = np.zeros((height, width), dtype=np.int64) if self.uses_token_types else None
        for r, row in enumerate(rows):
            input_ids[r, :lengths[r]] = row.ids
            if types is not None:
                types[r, :lengths[r]] = row.type_ids
        padding = [width - n for n in lengths]
        has_pairs = any(row.text_pair is not None for row in rows)
        batch = TokenBatch(
            input_ids=torch.from_numpy(input_ids), attention_mask=torch.from_numpy(attention),
            token_type_ids=None if types is None else torch.from_numpy(types),
            offsets=[row.offsets + [(0, 0)] * p for row, p in zip(rows, padding)],
            sequence_ids=[row.sequence_ids + [None] * p for row, p in zip(rows, padding)],
            word_ids=[row.word_ids + [None] * p for row, p in zip(rows, padding)],
            texts=[row.text for row in rows],
            text_pairs=[row.text_pair for row in rows] if has_pairs else None,
            truncated=[row.truncated for row in rows],
            filler_rows=height - len(rows),
        )
        for name in classes:
            batch.token_classes(name)
        return batch.to(self.device if device is None else device)
