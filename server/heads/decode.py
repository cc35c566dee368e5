"""Logits -> response objects, by task type (shared by every head kind).

Decoding works on a whole batch at once: softmax and argmax run once, where the logits are (on
the device in an eager pass), one copy brings the results to the host, and token classification
then reads the batch's token arrays (`TokenBatch.token_arrays`) with numpy. Python runs per answer
and per entity, never per token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from modules_store import TaskType
from server.backbone.tokens import TokenBatch


def decode(task_type: TaskType, labels: list[str], logits: torch.Tensor, batch: TokenBatch) -> list[dict[str, Any]]:
    if task_type == TaskType.sequence_classification:
        return _classifications(labels, logits)
    if task_type == TaskType.regression:
        return [{"value": value} for value in logits.float().flatten(1)[:, 0].tolist()]
    if task_type == TaskType.token_classification:
        return _entities(labels, logits, batch)
    if task_type == TaskType.embedding:
        return embeddings(logits)
    raise ValueError(f"no decoder for task type {task_type}")


def decode_rows(task_type: TaskType, labels: list[str], packed: np.ndarray, batch: TokenBatch
                ) -> list[dict[str, Any]]:
    """`decode` over one request's logits packed by an engine in another process (`server/workers.py`,
    `pack_answers`): (rows, labels), or for token tasks every row's own tokens one after the other
    (tokens, labels); on `batch`, those rows collated."""
    if task_type != TaskType.token_classification:
        return decode(task_type, labels, torch.from_numpy(packed), batch)
    logits = np.zeros((batch.size, batch.seq_len, len(labels)), dtype=np.float32)
    logits[batch.attention_mask.numpy().astype(bool)] = packed  # padding positions are never read (no word there)
    return decode(task_type, labels, torch.from_numpy(logits), batch)


def _classifications(labels: list[str], logits: torch.Tensor) -> list[dict[str, Any]]:
    probs = torch.softmax(logits.float(), dim=-1).cpu()
    best = probs.argmax(dim=-1).tolist()  # the first of equal maxima, as max() over the list would
    return [{"label": labels[b], "score": row[b], "scores": dict(zip(labels, row))}
            for b, row in zip(best, probs.tolist())]


def embeddings(logits: torch.Tensor) -> list[dict[str, Any]]:
    """An embedding head's (B, D + 1) output: each row's vector and the norm it had before
    normalisation (server/heads/embedding/layer.py, `with_norm`)."""
    rows = logits.float().cpu().tolist()
    return [{"embedding": row[:-1], "norm": row[-1]} for row in rows]


def best_labels(logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per position: the softmax probability of the best label and its index, as host arrays of
    the logits' leading shape (softmax and argmax where the logits are, one copy to the host)."""
    scores, best = torch.softmax(logits.float(), dim=-1).max(dim=-1)
    both = torch.stack((scores, best.float())).cpu().numpy()  # label indices are exact in float32
    return both[0], both[1].astype(np.int64)


# ---- token classification ---------------------------------------------------------------------------
def split_tag(tag: str) -> tuple[str, str]:
    """BIO tag -> (prefix, type): 'B-PER' -> ('B', 'PER'), 'O' -> ('O', ''), 'PER' -> ('I', 'PER').
    The one reading of a tag: the served entities and the entity F1 that tmod-train reports for them
    (training/metrics.py) both use it."""
    if tag == "O":
        return "O", ""
    if len(tag) > 2 and tag[1] == "-" and tag[0] in "BIE":
        return tag[0], tag[2:]
    return "I", tag


@dataclass
class Words:
    """Per word (as the tokenizer pre-split it), all rows of a batch in row order, each row's words
    in the order of their first sub-token: flat arrays of one entry per word."""

    row: np.ndarray
    segment: np.ndarray  # 0 text, 1 text_pair
    start: np.ndarray  # the first sub-token's start
    end: np.ndarray  # the furthest end of its sub-tokens
    label: np.ndarray  # label index predicted on the first sub-token
    score: np.ndarray  # that prediction's probability


def word_predictions(scores: np.ndarray, best: np.ndarray, batch: TokenBatch) -> Words:
    """A word's tag is the prediction on its first sub-token (the one training labels); its span
    runs to the end of its last sub-token. `scores`, `best`: (rows, T) from `best_labels`."""
    tokens = batch.token_arrays()
    row, t = np.nonzero((tokens.segment >= 0) & (tokens.word >= 0))  # row-major: token order per row
    segment, word = tokens.segment[row, t], tokens.word[row, t]
    # one integer per (row, segment, word); its first token in the (row, token) order above
    key = (row * (int(segment.max(initial=0)) + 1) + segment) * (int(word.max(initial=0)) + 1) + word
    _, first, which = np.unique(key, return_index=True, return_inverse=True)
    end = tokens.end[row, t]
    word_end = end[first]
    np.maximum.at(word_end, which.reshape(-1), end)
    order = np.argsort(first)
    first = first[order]
    return Words(row=row[first], segment=segment[first], start=tokens.start[row[first], t[first]],
                 end=word_end[order], label=best[row[first], t[first]], score=scores[row[first], t[first]])


OUTSIDE, INSIDE = 0, 1  # tag prefix codes (B and E are 2 and 3: they only ever start an entity)


def _entities(labels: list[str], logits: torch.Tensor, batch: TokenBatch) -> list[dict[str, Any]]:
    rows = len(batch.texts)
    scores, best = best_labels(logits[:rows])
    words = word_predictions(scores, best, batch)
    tags = [split_tag(tag) for tag in labels]
    kinds = sorted({kind for _, kind in tags})
    prefix = np.array(["OIBE".index(p) for p, _ in tags])[words.label]
    kind = np.array([kinds.index(k) for _, k in tags])[words.label]

    # A word continues the open entity when it is an I- of the same type in the same row and segment
    # and the word before it was in an entity (any word but an O- leaves one open).
    after = np.zeros(len(words.row), dtype=bool)
    after[1:] = ((words.row[1:] == words.row[:-1]) & (prefix[:-1] != OUTSIDE) & (kind[1:] == kind[:-1])
                 & (words.segment[1:] == words.segment[:-1]))
    continues = after & (prefix == INSIDE)
    starts = (prefix != OUTSIDE) & ~continues
    ends_here = (starts | continues) & ~np.append(continues[1:], False)
    firsts, lasts = np.nonzero(starts)[0].tolist(), np.nonzero(ends_here)[0].tolist()

    word_scores = words.score.tolist()
    row_of, segment_of = words.row.tolist(), words.segment.tolist()
    start_of, end_of, label_of = words.start.tolist(), words.end.tolist(), words.label.tolist()
    # offsets index the text they came from; pairs say which one ("segment": 0 text, 1 text_pair)
    pairs = batch.text_pairs
    out: list[dict[str, Any]] = [{"entities": []} for _ in range(rows)]
    for first, last in zip(firsts, lasts):
        row, segment, start, end = row_of[first], segment_of[first], start_of[first], end_of[last]
        source = batch.texts[row] if segment == 0 else pairs[row]
        entity = {"text": source[start:end], "label": tags[label_of[first]][1], "start": start, "end": end,
                  "score": sum(word_scores[first:last + 1]) / (last + 1 - first)}
        if pairs is not None:
            entity["segment"] = segment
        out[row]["entities"].append(entity)
    return out
