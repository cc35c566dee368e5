"""A pass's host logits -> what leaves the model runner: the one place where logits become answers.

With one process (`--workers 1`) every task is decoded here (`decode_all`). With HTTP worker
processes the workers decode: native tasks leave as each row's logits (`row_logits`; the worker's
`decode_rows` turns them into the same answers), while a foreign task's logits lie on its bridge's
tokenization, which only the engine process has, so it is decoded here.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from server.backbone import TokenBatch
from server.backbone.tokens import ranges
from server.heads.decode import decode
from server.modules import LoadedModule


def decode_all(modules: dict[str, LoadedModule], logits: dict[str, torch.Tensor],
               batches: dict[str, TokenBatch], rows: list | None = None) -> dict[str, list[dict]]:
    """Decoded answers per task from a pass's logits, each on the batch its logits are laid out on;
    with `rows` (the pass's EncodedInputs), each row's answer controls (`EncodedInput.answer`) apply
    to its answers, and each module's manifest `decoding` gives the defaults (multi-label thresholds)."""
    options = [row.answer for row in rows] if rows is not None else None
    return {
        task: decode(modules[task].head.task_type, modules[task].head.labels, logits[task], batches[task], options,
                     modules[task].manifest.decoding if modules[task].manifest is not None else None)
        for task in modules
    }


class RowLogits(Sequence):
    """One native task's host logits of a pass, as each row's logits: `rows[r]` is row r's array
    ((labels,), or (tokens, labels) over its own tokens for a token task: `lengths` given), a view made
    only when asked. `take` gathers many rows at once, so that packing a batch's answers costs numpy
    calls per task, not a Python step per row (the answer frame, server/workers/frames.py)."""

    def __init__(self, array: np.ndarray, lengths: np.ndarray | None = None):
        self.array, self.lengths = array, lengths

    def __len__(self) -> int:
        return self.array.shape[0]

    def __getitem__(self, r):
        if isinstance(r, slice):
            return [self[i] for i in range(*r.indices(len(self)))]
        return self.array[r] if self.lengths is None else self.array[r, :self.lengths[r]]

    @classmethod
    def joined(cls, parts: list["RowLogits"]) -> "RowLogits":
        """Several passes' RowLogits of one task, their rows one after the other, as one (a batch cut
        into passes answers as one array, so its answer frame gathers rows with numpy, not a view per
        row). A token task's passes differ in width: each is copied into the widest, whose padding is
        never read (rows are read over their own lengths)."""
        if len(parts) == 1:
            return parts[0]
        if parts[0].lengths is None:
            return cls(np.concatenate([part.array for part in parts]))
        width = max(part.array.shape[1] for part in parts)
        array = np.zeros((sum(len(part) for part in parts), width, parts[0].array.shape[2]), dtype=parts[0].array.dtype)
        at = 0
        for part in parts:
            array[at:at + len(part), :part.array.shape[1]] = part.array
            at += len(part)
        return cls(array, np.concatenate([part.lengths for part in parts]))

    def take(self, places: np.ndarray) -> np.ndarray:
        """Rows `places`, in that order, as one array: (rows, labels), or a token task's rows' own
        tokens one after the other (tokens, labels) (what `np.concatenate` of their views gives)."""
        if self.lengths is None:
            return np.take(self.array, places, axis=0)
        # a token task: the rows' own tokens gathered by their flat index, nothing of their padding
        # copied (a padded gather then a mask wrote the padded rows first: 30 -> 19 µs for 160 rows,
        # 82 -> 50 for 480, warm; np.take, not fancy indexing, which took 49 for 160)
        array = np.ascontiguousarray(self.array)
        _, width, labels = array.shape
        return np.take(array.reshape(-1, labels), ranges(places * width, self.lengths[places]), axis=0)


def row_logits(modules: dict[str, LoadedModule], logits: dict[str, torch.Tensor], batches: dict[str, TokenBatch],
               lengths: list[int], rows: list | None = None) -> dict[str, Sequence]:
    """Per task, each row's host logits (`RowLogits`: (tokens, labels) over its own tokens for token
    tasks, (labels,) otherwise), for a frontend process to decode (`decode_rows`). A task whose bridge
    re-tokenizes has its logits on the bridge's tokenization, which only this process has: decoded here."""
    out = {}
    token_lengths = None
    for task, module in modules.items():
        if module.retokenized:
            out[task] = decode_all({task: module}, logits, batches, rows)[task]
        elif logits[task].dim() == 3:
            if token_lengths is None:
                token_lengths = np.asarray(lengths)
            out[task] = RowLogits(logits[task].numpy(), token_lengths)
        else:
            out[task] = RowLogits(logits[task].numpy())
    return out


def joined_answers(parts: list[dict[str, Sequence]]) -> dict[str, Sequence]:
    """Several passes' answers (each `answers`' result, for the same tasks), their rows one after
    the other: a task answered as RowLogits in every pass stays one RowLogits (`RowLogits.joined`);
    any other (decoded answers, refusals) becomes one list."""
    if len(parts) == 1:
        return parts[0]
    out = {}
    for task in parts[0]:
        values = [part[task] for part in parts]
        if all(type(v) is RowLogits for v in values):
            out[task] = RowLogits.joined(values)
        else:
            out[task] = [answer for v in values for answer in v]
    return out


def answers(modules: dict[str, LoadedModule], logits: dict[str, torch.Tensor], batches: dict[str, TokenBatch],
            lengths: list[int], decode_here: bool, raw_rows: list[int] = (), rows: list | None = None
            ) -> dict[str, list]:
    """Per task, each row's answer: decoded (`decode_here`), or its logits for a worker to decode.
    `raw_rows` keep their logits either way: windows of a longer text, which the request combines
    per text and decodes whole (server/windows.py). `rows`: the pass's EncodedInputs, whose answer
    controls apply where decoding happens here."""
    if not decode_here or len(raw_rows) == len(lengths):
        return row_logits(modules, logits, batches, lengths, rows)
    decoded = decode_all(modules, logits, batches, rows)
    if raw_rows:
        raw = row_logits(modules, logits, batches, lengths, rows)
        for task in decoded:
            for r in raw_rows:
                decoded[task][r] = raw[task][r]
    return decoded
