"""Logits -> response objects, by task type (shared by every head kind).

Decoding is numpy on the host, no torch: a worker decodes every request of an engine answer frame
together (`decode_rows` over their rows, no padded batch needed), the one process a whole batch
(`decode`), with the same code; each row is answered as on its own. Token tasks work on flat
per-token arrays (`Tokens`: row, segment, word, offsets) and take a softmax only where it is read
(each word's first piece for the default aggregation); Python
runs per answer and per entity, never per token. Token tags are decoded under the BIO rules
(`constrained_labels`, the rules of a label set made once and kept): an answer never holds an `I-X`
(or a BIOES `E-X`) that does not follow `B-X` or `I-X`.

Probabilities are float32 as torch computed them before (issue 37), to within a few units in the
last place (a vectorised exp differs between libraries and between AVX2 and AVX-512):
tests/test_decode_numpy.py holds labels, texts and offsets equal to the torch decoder's and scores
within the tolerance it states.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from modules_store import TaskType
from server.backbone.tokens import END, SEGMENT, EncodedInput, TokenBatch


AGGREGATIONS = ("first", "average", "max", "none")
TRUNCATION_DIRECTIONS = ("right", "left")


@dataclass(frozen=True)
class AnswerOptions:
    """Per-request answer controls (docs/answer-controls.md); None / False leave the default answer.
    Each applies to the task types it concerns and is ignored by the others."""

    top_k: int | None = None  # sequence and multi-label tasks: the k best labels, best first (default: all)
    raw_scores: bool = False  # sequence and multi-label tasks: the head's logits instead of probabilities
    threshold: float | None = None  # multi-label: this probability for every label; single-label: no label under it
    # (default: the manifest's decoding thresholds / threshold)
    aggregation: str | None = None  # token tasks: first, average, max, none (default: the manifest's, else first)

    def is_default(self) -> bool:
        return self == DEFAULT_OPTIONS


DEFAULT_OPTIONS = AnswerOptions()


def decode(task_type: TaskType, labels: list[str], logits, batch: TokenBatch | None,
           options: "AnswerOptions | list[AnswerOptions | None] | None" = None,
           decoding: dict | None = None) -> list[dict[str, Any]]:
    """Answers per row from a batch's logits (a torch tensor on any device, or an ndarray):
    (rows, labels), or for token tasks (rows, tokens, labels) laid out on `batch` (its filler rows'
    dropped). `options`: answer controls for every row, or one per row (None: default); `decoding`:
    the manifest's answer defaults (multi-label thresholds, token aggregation)."""
    values = host(logits)
    if task_type == TaskType.token_classification:
        rows = len(batch.texts)
        return _decode(task_type, labels, values[:rows].reshape(-1, values.shape[-1]), Tokens.of_batch(batch),
                       rows, options, decoding)
    return _decode(task_type, labels, values, None, values.shape[0], options, decoding)


def decode_rows(task_type: TaskType, labels: list[str], packed, rows: "TokenBatch | Sequence[EncodedInput]",
                options: "AnswerOptions | list[AnswerOptions | None] | None" = None,
                decoding: dict | None = None) -> list[dict[str, Any]]:
    """`decode` over one request's logits packed by an engine in another process (`server/workers/frames.py`'s
    answer frames): (rows, labels), or for token tasks every row's own tokens one after the other
    (tokens, labels). `rows`: the request's EncodedInputs (cheapest: their token arrays are read as
    they are), or those rows collated into a TokenBatch. Several requests (an engine frame's) decode
    in one call the same way, their rows and packed logits one after the other, each row answered as
    on its own."""
    values = host(packed)
    if task_type != TaskType.token_classification:
        return _decode(task_type, labels, values, None, values.shape[0], options, decoding)
    if isinstance(rows, TokenBatch):
        return _decode(task_type, labels, values, Tokens.of_collated(rows), len(rows.texts), options, decoding)
    return _decode(task_type, labels, values, Tokens.of_rows(rows), len(rows), options, decoding)


def _decode(task_type: TaskType, labels: list[str], values: np.ndarray, tokens: "Tokens | None", rows: int,
            options, decoding: dict | None) -> list[dict[str, Any]]:
    per_row = options if isinstance(options, list) else [options] * rows
    per_row = [o or DEFAULT_OPTIONS for o in per_row]
    decoding = decoding or {}
    if task_type == TaskType.sequence_classification:
        return _classifications(labels, values, per_row, decoding.get("threshold"))
    if task_type == TaskType.multi_label_classification:
        return _multi_labels(labels, values, per_row, decoding)
    if task_type == TaskType.regression:
        return [{"value": value} for value in values.reshape(values.shape[0], -1 if values.size else 1)[:, 0].tolist()]
    if task_type == TaskType.token_classification:
        default = decoding.get("aggregation", "first")
        strategies = [o.aggregation or default for o in per_row]
        if len(set(strategies)) == 1:
            return _token_answers(labels, values, tokens, rows, strategies[0])
        out: list = [None] * len(strategies)
        for strategy in sorted(set(strategies)):  # each strategy over the batch, kept for its own rows
            answers = _token_answers(labels, values, tokens, rows, strategy)
            for r, s in enumerate(strategies):
                if s == strategy:
                    out[r] = answers[r]
        return out
    if task_type == TaskType.embedding:
        return embeddings(values)
    raise ValueError(f"no decoder for task type {task_type}")


def host(logits) -> np.ndarray:
    """Logits as a float32 host array: an ndarray as it is (cast if another float type), a torch
    tensor (any device, any float type) copied to the host once. Never written to."""
    if isinstance(logits, np.ndarray):
        return logits if logits.dtype == np.float32 else logits.astype(np.float32)
    return logits.detach().float().cpu().numpy()  # a tensor (the one-process path): one copy, no torch math


def softmax(values: np.ndarray) -> np.ndarray:
    """Softmax over the last axis in float32, as torch's CPU kernel computes it (max, exp of the
    differences, times the reciprocal of their sum)."""
    shifted = np.exp(values - values.max(-1, keepdims=True))
    shifted *= np.float32(1) / shifted.sum(-1, keepdims=True)
    return shifted


def sigmoid(values: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) of a very negative x is inf: the probability is 0
        return np.float32(1) / (np.float32(1) + np.exp(-values))


def ranked(labels: list[str], values: list[float], top_k: int | None) -> dict[str, float]:
    """label -> value, best first, the first `top_k` (all when None); equal values keep label order."""
    order = sorted(range(len(labels)), key=lambda i: -values[i])  # stable: ties stay in label order
    return {labels[i]: values[i] for i in order[:top_k]}


def _classifications(labels: list[str], logits: np.ndarray, options: list[AnswerOptions],
                     shipped_threshold: float | None = None) -> list[dict[str, Any]]:
    """One label per row, the most probable; "none of these" (label None) where its probability is
    under the threshold (the request's, else the manifest's `decoding.threshold`, else none)."""
    probs = softmax(logits)
    best = probs.argmax(-1).tolist()  # the first of equal maxima, as max() over the list would
    raw = logits.tolist() if any(o.raw_scores for o in options) else None
    out = []
    for r, (b, row) in enumerate(zip(best, probs.tolist())):
        o = options[r]
        values = raw[r] if o.raw_scores else row
        threshold = shipped_threshold if o.threshold is None else o.threshold
        label = None if threshold is not None and row[b] < threshold else labels[b]
        scores = dict(zip(labels, values)) if o.top_k is None else ranked(labels, values, o.top_k)
        out.append({"label": label, "score": values[b], "scores": scores})
    return out


def _multi_labels(labels: list[str], logits: np.ndarray, options: list[AnswerOptions],
                  decoding: dict) -> list[dict[str, Any]]:
    """Independent labels (one sigmoid each): every label whose probability is at least its threshold
    (the manifest's per-label thresholds, 0.5 where it has none, or the request's one threshold)."""
    probs = sigmoid(logits)
    shipped = decoding.get("thresholds", {})
    default = np.array([shipped.get(label, 0.5) for label in labels], dtype=np.float32)
    raw = logits.tolist() if any(o.raw_scores for o in options) else None
    out = []
    for r, o in enumerate(options):
        thresholds = default if o.threshold is None else np.float32(o.threshold)
        values = raw[r] if o.raw_scores else probs[r].tolist()
        chosen = np.nonzero(probs[r] >= thresholds)[0]
        answer = {"labels": [labels[i] for i in chosen]}  # in label order
        answer["scores"] = ranked(labels, values, o.top_k) if o.top_k is not None else dict(zip(labels, values))
        out.append(answer)
    return out


def embeddings(logits: np.ndarray) -> list[dict[str, Any]]:
    """An embedding head's (B, D + 1) output: each row's vector and the norm it had before
    normalisation (server/heads/embedding/layer.py, `with_norm`)."""
    return [{"embedding": row[:-1], "norm": row[-1]} for row in host(logits).tolist()]


# ---- token classification ---------------------------------------------------------------------------
# tag prefixes of the schemes read: BIO (IOB2, and IOB1, whose I- may open an entity), BIOES / IOBES
# and BILOU (L- ends an entity as E- does, U- is a one-word entity as S- is)
PREFIXES = {"B": "B", "I": "I", "E": "E", "L": "E", "S": "S", "U": "S"}


def split_tag(tag: str) -> tuple[str, str]:
    """Tag -> (prefix, type): 'B-PER' -> ('B', 'PER'), 'E-PER' and 'L-PER' -> ('E', 'PER'), 'S-PER'
    and 'U-PER' -> ('S', 'PER'), 'O' -> ('O', ''), 'PER' -> ('I', 'PER'). The one reading of a tag:
    the served entities and the entity F1 that tmod-train reports for them (training/metrics.py) both
    use it. An entity goes on through I- and E- tags of its type after a B- or I-; E- and S- close it."""
    if tag == "O":
        return "O", ""
    if len(tag) > 2 and tag[1] == "-" and tag[0] in PREFIXES:
        return PREFIXES[tag[0]], tag[2:]
    return "I", tag


@dataclass
class Tokens:
    """The tokens whose logits are decoded, one after the other (each row's in order, rows in order),
    as flat int64 arrays; -1 in segment and word where the tokenizer says None (special tokens,
    padding). Made from a request's rows (their token arrays as they are), a collated batch's real
    tokens (the packed layout of `decode_rows`) or every position of a padded batch (`decode`)."""

    texts: list[str]
    pairs: list[str] | None
    row: np.ndarray
    segment: np.ndarray
    word: np.ndarray
    start: np.ndarray
    end: np.ndarray

    @classmethod
    def of_rows(cls, rows: Sequence[EncodedInput]) -> "Tokens":
        tokens = rows[0].tokens if len(rows) == 1 else np.concatenate([row.tokens for row in rows])
        row = np.repeat(np.arange(len(rows)), [len(r) for r in rows]) if len(rows) > 1 else np.zeros(len(tokens), np.int64)
        columns = tokens[:, SEGMENT:END + 1].T.astype(np.int64)  # SEGMENT, WORD, START, END in that order
        pairs = [r.text_pair for r in rows] if any(r.text_pair is not None for r in rows) else None
        return cls([r.text for r in rows], pairs, row, *columns)

    @classmethod
    def of_collated(cls, batch: TokenBatch) -> "Tokens":
        arrays = batch.token_arrays()
        real = batch.attention_mask[:arrays.segment.shape[0]].numpy().astype(bool)
        row = np.nonzero(real)[0]
        return cls(batch.texts, batch.text_pairs, row, arrays.segment[real], arrays.word[real], arrays.start[real],
                   arrays.end[real])

    @classmethod
    def of_batch(cls, batch: TokenBatch) -> "Tokens":
        arrays = batch.token_arrays()
        rows, width = arrays.segment.shape
        return cls(batch.texts, batch.text_pairs, np.repeat(np.arange(rows), width), arrays.segment.reshape(-1),
                   arrays.word.reshape(-1), arrays.start.reshape(-1), arrays.end.reshape(-1))


@dataclass
class Words:
    """Per word (as the tokenizer pre-split it), all rows in row order, each row's words in the order
    of their first sub-token: flat arrays of one entry per word."""

    row: np.ndarray
    segment: np.ndarray  # 0 text, 1 text_pair
    start: np.ndarray  # the first sub-token's start
    end: np.ndarray  # the furthest end of its sub-tokens
    label: np.ndarray  # its tag (label index), from its probability vector by `aggregation` (`word_tags`)
    score: np.ndarray  # that tag's probability
    opens: np.ndarray  # True where a sequence (a run of one row and segment) begins


def word_predictions(logits: np.ndarray, tokens: Tokens, labels: list[str], aggregation: str = "first") -> Words:
    """A word's span runs from its first sub-token to the end of its last. Its probability vector, by
    `aggregation` (as Hugging Face's token-classification pipeline defines them): first, its first
    sub-token's (the one training labels); average, the mean of its sub-tokens'; max, that of the
    sub-token whose best probability is highest (the first of equal ones). `logits`: (tokens, C),
    one per entry of `tokens`. Its tag: by `word_tags` (under the BIO rules of `labels` where they
    have any); its score, that tag's probability."""
    if aggregation not in AGGREGATIONS[:3]:
        raise ValueError(f"unknown aggregation {aggregation!r}; one of {AGGREGATIONS[:3]}")
    pieces = np.flatnonzero((tokens.segment >= 0) & (tokens.word >= 0))  # token order per row
    row, segment, word = tokens.row[pieces], tokens.segment[pieces], tokens.word[pieces]
    end = tokens.end[pieces]
    # one integer per (row, segment, word); a tokenizer gives each word's pieces together, in order
    # one integer per (row, segment, word), in that order (word ids under 2**32, segments 0 and 1)
    key = (row << 34) | (segment << 32) | word
    new_word = np.empty(len(key), dtype=bool)  # (np.r_, np.diff and np.ones cost more than the rest on a short text)
    new_word[:1] = True
    np.not_equal(key[1:], key[:-1], out=new_word[1:])
    if (key[1:] >= key[:-1]).all():  # words one after another: each starts where the key changes
        first = np.flatnonzero(new_word)
        which = np.cumsum(new_word) - 1 if aggregation != "first" else None
        word_end = np.maximum.reduceat(end, first) if len(key) else end
    else:  # pieces of a word apart (token lists built by hand): words by key, in first-piece order
        _, first, which = np.unique(key, return_index=True, return_inverse=True)
        order = np.argsort(first)
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        first, which = first[order], rank[which.reshape(-1)]
        word_end = end[first]
        np.maximum.at(word_end, which, end)
    first_piece = pieces[first]
    if aggregation == "first":
        vectors = softmax(logits[first_piece])
    else:
        probs = softmax(logits[pieces])
        if aggregation == "average":
            mean = np.zeros((len(first), probs.shape[-1]), dtype=np.float64)
            np.add.at(mean, which, probs)
            mean /= np.bincount(which, minlength=len(first))[:, None]
            vectors = mean
        else:  # max: per word, its pieces by score (highest first, then position): the first of each word wins
            piece_scores = probs.max(-1)
            by_score = np.lexsort((np.arange(len(which)), -piece_scores, which))
            grouped = which[by_score]
            group_start = np.flatnonzero(np.concatenate(([True], grouped[1:] != grouped[:-1])))[:len(first)]
            vectors = probs[by_score[group_start]]  # (no words: none; the torch decoder raised IndexError)
    word_row, word_segment = row[first], segment[first]
    # a sequence is a run of words of one row and segment: the words an entity may continue over
    starts = np.empty(len(word_row), dtype=bool)
    starts[:1] = True
    starts[1:] = (word_row[1:] != word_row[:-1]) | (word_segment[1:] != word_segment[:-1])
    label = word_tags(vectors, starts, labels)
    score = vectors[np.arange(len(label)), label].astype(np.float32)
    return Words(row=word_row, segment=word_segment, start=tokens.start[first_piece], end=word_end, label=label,
                 score=score, opens=starts)


def word_tags(probs: np.ndarray, starts: np.ndarray, labels: list[str]) -> np.ndarray:
    """Each word's tag index from its probability vector (`probs`, (words, C)), sequence by sequence
    (`starts`: True on each sequence's first word): under the BIO rules of `labels` where they have
    any (`constrained_labels`), else the best label. What tmod-serve answers and tmod-train scores."""
    allowed = bio_constraints(labels)
    best = probs.argmax(1)  # the argmax of the logs below: a probability's log keeps its order
    if allowed is None or not _breaks_rules(best, starts, allowed).any():
        return best
    # log of 0 (a probability float32 rounds away) floored: every allowed path keeps a finite score
    return constrained_labels(np.log(np.maximum(probs, np.finfo(np.float64).tiny, dtype=np.float64)), starts, allowed)


def _breaks_rules(best: np.ndarray, starts: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Per word: True where `allowed` forbids its label after the one before it (or opening its sequence)."""
    before = np.empty_like(best)
    before[:1] = 0
    before[1:] = best[:-1]
    before[starts] = len(allowed) - 1
    return ~allowed[before, best]


def bio_constraints(labels: Sequence[str]) -> np.ndarray | None:
    """Which tag may follow which, (C + 1, C) booleans: [i, j] may tag j follow tag i; the last row:
    may tag j open a sequence. An `I-X`, and an `E-X` (`L-X`) that ends an entity, may only follow
    `B-X` or `I-X`, where the labels have a `B-X` (a label set without B- tags, or other prefixes, is
    not constrained). None: nothing is. Made once per label set and kept (read-only)."""
    return _constraints(tuple(labels))


@lru_cache(maxsize=256)
def _constraints(labels: tuple[str, ...]) -> np.ndarray | None:
    allowed = np.ones((len(labels) + 1, len(labels)), dtype=bool)
    for j, tag in enumerate(labels):
        if tag[:2] in ("I-", "E-", "L-") and "B-" + tag[2:] in labels:
            allowed[:, j] = [label in ("B-" + tag[2:], "I-" + tag[2:]) for label in labels] + [False]
    if allowed.all():
        return None
    allowed.flags.writeable = False
    return allowed


def constrained_labels(log_probs: np.ndarray, starts: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Per word, its label in the most probable label sequence that `allowed` (`bio_constraints`)
    permits, sequence by sequence (`starts`: True on each sequence's first word). A sequence whose
    best labels already follow the rules keeps them; the others are searched (`viterbi`)."""
    best = log_probs.argmax(1)
    if len(best) == 0:
        return best
    broken = _breaks_rules(best, starts, allowed)
    if not broken.any():
        return best
    begin = np.flatnonzero(starts)
    length = np.diff(np.concatenate((begin, [len(best)])))
    redo = np.unique(np.cumsum(starts)[broken] - 1)  # sequences with a forbidden step
    steps = np.arange(length[redo].max())
    inside = steps[None] < length[redo][:, None]
    index = np.where(inside, begin[redo][:, None] + steps[None], begin[redo][:, None])
    best[index[inside]] = viterbi(log_probs[index], length[redo], allowed)[inside]
    return best


def viterbi(log_probs: np.ndarray, lengths: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """The most probable allowed label path of each sequence: `log_probs` (S, L, C), sequence s
    holding its first `lengths[s]` steps; `allowed` as `bio_constraints`. Equal scores: the lower
    label index. Returns (S, L) label indices (0 past a sequence's end).
    The sequences are taken longest first, so those still running at a step are the first ones: each
    step works on a slice of them, with no mask for the ones that ended. What this costs on the short
    sentences of one engine frame is numpy calls per step, not arithmetic: the arrays are laid out
    step-major (each step's slice contiguous) and every step writes into them in place (`out=`), four
    calls a step forward and one back (12 sentences of random logits, 39 steps: 424 -> 322 us on a
    2-core AMD EPYC with AVX-512, issue 37)."""
    sequences, steps, labels = log_probs.shape
    penalty = np.where(allowed, 0.0, -np.inf)
    follow = penalty[None, :-1]  # (1, from, to)
    order = np.argsort(-np.asarray(lengths), kind="stable")
    by_step = np.ascontiguousarray(log_probs[order].transpose(1, 0, 2))  # (L, S, C)
    lengths = np.asarray(lengths)[order]
    running = (lengths[None, :] > np.arange(steps + 1)[:, None]).sum(1).tolist()  # per step: sequences still in it
    score = penalty[-1] + by_step[0]
    back = np.zeros((steps, sequences, labels), dtype=np.int64)  # (L, S, C): the best label before, per label
    candidates = np.empty((sequences, labels, labels))  # (S, from, to)
    for t in range(1, steps):
        n = running[t]
        here, now = candidates[:n], score[:n]
        np.add(now[:, :, None], follow, out=here)
        here.argmax(1, out=back[t, :n])
        np.maximum.reduce(here, axis=1, out=now)  # (ndarray.max: the same through a Python wrapper)
        now += by_step[t, :n]
    last = score.argmax(1)
    path = np.zeros((steps, sequences), dtype=np.int64)
    flat = back.reshape(steps, sequences * labels)
    base = np.arange(sequences) * labels  # each sequence's first label in a step's flat row
    for t in range(steps - 1, -1, -1):
        going_on, in_step = running[t + 1], running[t]  # [:going_on] follow their next step, [going_on:in_step] end at t
        if going_on:
            flat[t + 1].take(base[:going_on] + path[t + 1, :going_on], out=path[t, :going_on])
        if in_step > going_on:
            path[t, going_on:in_step] = last[going_on:in_step]
    out = np.empty((sequences, steps), dtype=np.int64)
    out[order] = path.T
    return out


OUTSIDE, INSIDE, BEGIN, LAST = range(4)  # tag prefix codes: O, I, B, E (L); S (U) is 4 (`split_tag`)


@lru_cache(maxsize=256)
def _tag_codes(labels: tuple[str, ...]) -> tuple[list[tuple[str, str]], np.ndarray, np.ndarray]:
    """Per label: its (prefix, type), its prefix code (OIBES) and its type's index (read-only)."""
    tags = [split_tag(tag) for tag in labels]
    kinds = sorted({kind for _, kind in tags})
    prefix = np.array(["OIBES".index(p) for p, _ in tags])
    kind = np.array([kinds.index(k) for _, k in tags])
    prefix.flags.writeable = kind.flags.writeable = False
    return tags, prefix, kind


def _token_answers(labels: list[str], logits: np.ndarray, tokens: Tokens, rows: int, aggregation: str
                   ) -> list[dict[str, Any]]:
    if aggregation == "none":
        return _pieces(labels, logits, tokens, rows)
    return _entities(labels, logits, tokens, rows, aggregation)


def _pieces(labels: list[str], logits: np.ndarray, tokens: Tokens, rows: int) -> list[dict[str, Any]]:
    """Aggregation "none": every word piece of the text (special tokens left out) with its own best
    label (the full tag), that label's probability and its character offsets."""
    pieces = np.flatnonzero(tokens.segment >= 0)
    probs = softmax(logits[pieces])
    best = probs.argmax(-1)
    scores = probs[np.arange(len(best)), best].tolist()
    texts, pairs = tokens.texts, tokens.pairs
    out: list[dict[str, Any]] = [{"tokens": []} for _ in range(rows)]
    for r, segment, start, end, label, score in zip(tokens.row[pieces].tolist(), tokens.segment[pieces].tolist(),
                                                    tokens.start[pieces].tolist(), tokens.end[pieces].tolist(),
                                                    best.tolist(), scores):
        source = texts[r] if segment == 0 else pairs[r]
        piece = {"text": source[start:end], "label": labels[label], "score": score, "start": start, "end": end}
        if pairs is not None:
            piece["segment"] = segment
        out[r]["tokens"].append(piece)
    return out


def _entities(labels: list[str], logits: np.ndarray, tokens: Tokens, rows: int, aggregation: str = "first"
              ) -> list[dict[str, Any]]:
    words = word_predictions(logits, tokens, labels, aggregation)
    tags, prefix_of, kind_of = _tag_codes(tuple(labels))
    prefix = prefix_of[words.label]
    out: list[dict[str, Any]] = [{"entities": []} for _ in range(rows)]
    inside = prefix != OUTSIDE
    if not inside.any():  # no entity (most texts): nothing more to find
        return out
    kind = kind_of[words.label]

    # A word continues the open entity when it is an I- or E- of the same type in the same row and
    # segment and the word before it left one open (a B- or an I-; E- and S- close theirs).
    continues = (prefix == INSIDE) | (prefix == LAST)
    continues[:1] = False
    left_open = (prefix == INSIDE) | (prefix == BEGIN)
    continues[1:] &= ~words.opens[1:] & left_open[:-1] & (kind[1:] == kind[:-1])
    starts = inside & ~continues
    closes = np.empty(len(continues), dtype=bool)  # the next word does not continue this one
    closes[-1:] = True
    np.logical_not(continues[1:], out=closes[:-1])
    ends_here = (starts | continues) & closes
    firsts, lasts = np.nonzero(starts)[0].tolist(), np.nonzero(ends_here)[0].tolist()
    word_scores = words.score.tolist()
    row_of, segment_of = words.row.tolist(), words.segment.tolist()
    start_of, end_of, label_of = words.start.tolist(), words.end.tolist(), words.label.tolist()
    # offsets index the text they came from; pairs say which one ("segment": 0 text, 1 text_pair)
    texts, pairs = tokens.texts, tokens.pairs
    for first, last in zip(firsts, lasts):
        row, segment, start, end = row_of[first], segment_of[first], start_of[first], end_of[last]
        source = texts[row] if segment == 0 else pairs[row]
        entity = {"text": source[start:end], "label": tags[label_of[first]][1], "start": start, "end": end,
                  "score": sum(word_scores[first:last + 1]) / (last + 1 - first)}
        if pairs is not None:
            entity["segment"] = segment
        out[row]["entities"].append(entity)
    return out
