"""server/heads/decode.py as it was before issue 37 (commit 31ec5ac: softmax and sigmoid in torch,
numpy after), frozen here purely as the oracle of tests/test_decode_numpy.py, which holds the numpy
decoder to the same answers on random logits and on the shipped modules' real outputs; with one
change since, the BIOES / BILOU reading of tags (E- and S- close an entity). Not used by the server."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from modules_store import TaskType
from server.backbone.tokens import TokenBatch


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


def decode(task_type: TaskType, labels: list[str], logits: torch.Tensor, batch: TokenBatch,
           options: "AnswerOptions | list[AnswerOptions | None] | None" = None,
           decoding: dict | None = None) -> list[dict[str, Any]]:
    """Answers per row. `options`: answer controls for every row, or one per row (None: default);
    `decoding`: the manifest's answer defaults (multi-label thresholds, token aggregation)."""
    rows = len(batch.texts) if task_type == TaskType.token_classification else logits.shape[0]
    per_row = options if isinstance(options, list) else [options] * rows
    per_row = [o or DEFAULT_OPTIONS for o in per_row]
    decoding = decoding or {}
    if task_type == TaskType.sequence_classification:
        return _classifications(labels, logits, per_row, decoding.get("threshold"))
    if task_type == TaskType.multi_label_classification:
        return _multi_labels(labels, logits, per_row, decoding)
    if task_type == TaskType.regression:
        return [{"value": value} for value in logits.float().flatten(1)[:, 0].tolist()]
    if task_type == TaskType.token_classification:
        default = decoding.get("aggregation", "first")
        strategies = [o.aggregation or default for o in per_row]
        if len(set(strategies)) == 1:
            return _token_answers(labels, logits, batch, strategies[0])
        out: list = [None] * len(strategies)
        for strategy in sorted(set(strategies)):  # each strategy over the batch, kept for its own rows
            answers = _token_answers(labels, logits, batch, strategy)
            for r, s in enumerate(strategies):
                if s == strategy:
                    out[r] = answers[r]
        return out
    if task_type == TaskType.embedding:
        return embeddings(logits)
    raise ValueError(f"no decoder for task type {task_type}")


def decode_rows(task_type: TaskType, labels: list[str], packed: np.ndarray, batch: TokenBatch,
                options: "AnswerOptions | list[AnswerOptions | None] | None" = None,
                decoding: dict | None = None) -> list[dict[str, Any]]:
    """`decode` over one request's logits packed by an engine in another process (`server/workers/frames.py`,
    `pack_answers`): (rows, labels), or for token tasks every row's own tokens one after the other
    (tokens, labels); on `batch`, those rows collated."""
    if task_type != TaskType.token_classification:
        return decode(task_type, labels, torch.from_numpy(packed), batch, options, decoding)
    logits = np.zeros((batch.size, batch.seq_len, len(labels)), dtype=np.float32)
    logits[batch.attention_mask.numpy().astype(bool)] = packed  # padding positions are never read (no word there)
    return decode(task_type, labels, torch.from_numpy(logits), batch, options, decoding)


def ranked(labels: list[str], values: list[float], top_k: int | None) -> dict[str, float]:
    """label -> value, best first, the first `top_k` (all when None); equal values keep label order."""
    order = sorted(range(len(labels)), key=lambda i: -values[i])  # stable: ties stay in label order
    return {labels[i]: values[i] for i in order[:top_k]}


def _classifications(labels: list[str], logits: torch.Tensor, options: list[AnswerOptions],
                     shipped_threshold: float | None = None) -> list[dict[str, Any]]:
    """One label per row, the most probable; "none of these" (label None) where its probability is
    under the threshold (the request's, else the manifest's `decoding.threshold`, else none)."""
    probs = torch.softmax(logits.float(), dim=-1).cpu()
    best = probs.argmax(dim=-1).tolist()  # the first of equal maxima, as max() over the list would
    raw = logits.float().cpu().tolist() if any(o.raw_scores for o in options) else None
    out = []
    for r, (b, row) in enumerate(zip(best, probs.tolist())):
        o = options[r]
        values = raw[r] if o.raw_scores else row
        threshold = shipped_threshold if o.threshold is None else o.threshold
        label = None if threshold is not None and row[b] < threshold else labels[b]
        scores = dict(zip(labels, values)) if o.top_k is None else ranked(labels, values, o.top_k)
        out.append({"label": label, "score": values[b], "scores": scores})
    return out


def _multi_labels(labels: list[str], logits: torch.Tensor, options: list[AnswerOptions],
                  decoding: dict) -> list[dict[str, Any]]:
    """Independent labels (one sigmoid each): every label whose probability is at least its threshold
    (the manifest's per-label thresholds, 0.5 where it has none, or the request's one threshold)."""
    probs = torch.sigmoid(logits.float()).cpu().numpy()
    shipped = decoding.get("thresholds", {})
    default = np.array([shipped.get(label, 0.5) for label in labels], dtype=np.float32)
    raw = logits.float().cpu().tolist() if any(o.raw_scores for o in options) else None
    out = []
    for r, o in enumerate(options):
        thresholds = default if o.threshold is None else np.float32(o.threshold)
        values = raw[r] if o.raw_scores else probs[r].tolist()
        chosen = np.nonzero(probs[r] >= thresholds)[0]
        answer = {"labels": [labels[i] for i in chosen]}  # in label order
        answer["scores"] = ranked(labels, values, o.top_k) if o.top_k is not None else dict(zip(labels, values))
        out.append(answer)
    return out


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
    if len(tag) > 2 and tag[1] == "-" and tag[0] in "BIELSU":
        return {"L": "E", "U": "S"}.get(tag[0], tag[0]), tag[2:]
    return "I", tag


@dataclass
class Words:
    """Per word (as the tokenizer pre-split it), all rows of a batch in row order, each row's words
    in the order of their first sub-token: flat arrays of one entry per word."""

    row: np.ndarray
    segment: np.ndarray  # 0 text, 1 text_pair
    start: np.ndarray  # the first sub-token's start
    end: np.ndarray  # the furthest end of its sub-tokens
    label: np.ndarray  # its tag (label index), from its probability vector by `aggregation` (`word_tags`)
    score: np.ndarray  # that tag's probability


def word_predictions(probs: np.ndarray, batch: TokenBatch, labels: list[str], aggregation: str = "first") -> Words:
    """A word's span runs from its first sub-token to the end of its last. Its probability vector, by
    `aggregation` (as Hugging Face's token-classification pipeline defines them): first, its first
    sub-token's (the one training labels); average, the mean of its sub-tokens'; max, that of the
    sub-token whose best probability is highest (the first of equal ones). `probs`: (rows, T, C)
    softmax probabilities. Its tag: by `word_tags` (under the BIO rules of `labels` where they have any);
    its score, that tag's probability."""
    tokens = batch.token_arrays()
    row, t = np.nonzero((tokens.segment >= 0) & (tokens.word >= 0))  # row-major: token order per row
    segment, word = tokens.segment[row, t], tokens.word[row, t]
    # one integer per (row, segment, word); its first token in the (row, token) order above
    key = (row * (int(segment.max(initial=0)) + 1) + segment) * (int(word.max(initial=0)) + 1) + word
    _, first, which = np.unique(key, return_index=True, return_inverse=True)
    which = which.reshape(-1)
    end = tokens.end[row, t]
    word_end = end[first]
    np.maximum.at(word_end, which, end)
    order = np.argsort(first)
    if aggregation == "average":
        pieces = probs[row, t]
        mean = np.zeros((len(first), pieces.shape[-1]), dtype=np.float64)
        np.add.at(mean, which, pieces)
        mean /= np.bincount(which, minlength=len(first))[:, None]
        vectors = mean[order]
    elif aggregation == "max":
        piece_scores = probs[row, t].max(-1)
        # per word, its pieces by score (highest first, then position): the first of each word wins
        by_score = np.lexsort((np.arange(len(which)), -piece_scores, which))
        group_start = np.flatnonzero(np.r_[True, which[by_score][1:] != which[by_score][:-1]])
        winner = by_score[group_start][order]  # one token per word, words in key order -> first-token order
        vectors = probs[row[winner], t[winner]]
    elif aggregation == "first":
        vectors = probs[row[first[order]], t[first[order]]]
    else:
        raise ValueError(f"unknown aggregation {aggregation!r}; one of {AGGREGATIONS[:3]}")
    first = first[order]
    word_row, word_segment = row[first], segment[first]
    # a sequence is a run of words of one row and segment: the words an entity may continue over
    starts = np.ones(len(word_row), dtype=bool)
    starts[1:] = (word_row[1:] != word_row[:-1]) | (word_segment[1:] != word_segment[:-1])
    label = word_tags(vectors, starts, labels)
    score = vectors[np.arange(len(label)), label].astype(np.float32)
    return Words(row=word_row, segment=word_segment, start=tokens.start[word_row, t[first]],
                 end=word_end[order], label=label, score=score)


def word_tags(probs: np.ndarray, starts: np.ndarray, labels: list[str]) -> np.ndarray:
    """Each word's tag index from its probability vector (`probs`, (words, C)), sequence by sequence
    (`starts`: True on each sequence's first word): under the BIO rules of `labels` where they have
    any (`constrained_labels`), else the best label. What tmod-serve answers and tmod-train scores."""
    allowed = bio_constraints(labels)
    if allowed is None:
        return probs.argmax(1)
    # log of 0 (a probability float32 rounds away) floored: every allowed path keeps a finite score
    return constrained_labels(np.log(np.maximum(probs, np.finfo(np.float64).tiny, dtype=np.float64)), starts, allowed)


def bio_constraints(labels: list[str]) -> np.ndarray | None:
    """Which tag may follow which, (C + 1, C) booleans: [i, j] may tag j follow tag i; the last row:
    may tag j open a sequence. An `I-X` (and an `E-X` / `L-X`) may only follow `B-X` or `I-X`, where the
    labels have a `B-X` (a label set without B- tags, or other prefixes, is not constrained). None:
    nothing is."""
    allowed = np.ones((len(labels) + 1, len(labels)), dtype=bool)
    for j, tag in enumerate(labels):
        if tag[:2] in ("I-", "E-", "L-") and "B-" + tag[2:] in labels:
            allowed[:, j] = [label in ("I-" + tag[2:], "B-" + tag[2:]) for label in labels] + [False]
    return None if allowed.all() else allowed


def constrained_labels(log_probs: np.ndarray, starts: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Per word, its label in the most probable label sequence that `allowed` (`bio_constraints`)
    permits, sequence by sequence (`starts`: True on each sequence's first word). A sequence whose
    best labels already follow the rules keeps them; the others are searched (`viterbi`)."""
    best = log_probs.argmax(1)
    if len(best) == 0:
        return best
    before = np.where(starts, len(allowed) - 1, np.r_[0, best[:-1]])
    broken = ~allowed[before, best]
    if not broken.any():
        return best
    begin = np.flatnonzero(starts)
    length = np.diff(np.r_[begin, len(best)])
    redo = np.unique(np.cumsum(starts)[broken] - 1)  # sequences with a forbidden step
    steps = np.arange(length[redo].max())
    inside = steps[None] < length[redo][:, None]
    index = np.where(inside, begin[redo][:, None] + steps[None], begin[redo][:, None])
    best[index[inside]] = viterbi(log_probs[index], length[redo], allowed)[inside]
    return best


def viterbi(log_probs: np.ndarray, lengths: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """The most probable allowed label path of each sequence: `log_probs` (S, L, C), sequence s
    holding its first `lengths[s]` steps; `allowed` as `bio_constraints`. Equal scores: the lower
    label index. Returns (S, L) label indices (0 past a sequence's end)."""
    sequences, steps, _ = log_probs.shape
    penalty = np.where(allowed, 0.0, -np.inf)
    score = penalty[-1] + log_probs[:, 0]
    back = np.zeros((sequences, steps, allowed.shape[1]), dtype=np.int64)
    for t in range(1, steps):
        candidates = score[:, :, None] + penalty[None, :-1]  # (S, from, to)
        back[:, t] = candidates.argmax(1)
        score = np.where((t < lengths)[:, None], candidates.max(1) + log_probs[:, t], score)
    path = np.zeros((sequences, steps), dtype=np.int64)
    last = score.argmax(1)
    every = np.arange(sequences)
    for t in range(steps - 1, -1, -1):
        following = back[every, min(t + 1, steps - 1), path[:, min(t + 1, steps - 1)]]
        path[:, t] = np.where(t == lengths - 1, last, np.where(t < lengths - 1, following, 0))
    return path


OUTSIDE, INSIDE, BEGIN, LAST = 0, 1, 2, 3  # tag prefix codes (S is 4)


def _token_answers(labels: list[str], logits: torch.Tensor, batch: TokenBatch, aggregation: str
                   ) -> list[dict[str, Any]]:
    if aggregation == "none":
        return _pieces(labels, logits, batch)
    return _entities(labels, logits, batch, aggregation)


def _pieces(labels: list[str], logits: torch.Tensor, batch: TokenBatch) -> list[dict[str, Any]]:
    """Aggregation "none": every word piece of the text (special tokens left out) with its own best
    label (the full tag), that label's probability and its character offsets."""
    rows = len(batch.texts)
    scores, best = best_labels(logits[:rows])
    tokens = batch.token_arrays()
    pairs = batch.text_pairs
    out: list[dict[str, Any]] = []
    for r in range(rows):
        pieces = []
        for t in np.nonzero(tokens.segment[r] >= 0)[0].tolist():
            segment, start, end = int(tokens.segment[r, t]), int(tokens.start[r, t]), int(tokens.end[r, t])
            source = batch.texts[r] if segment == 0 else pairs[r]
            piece = {"text": source[start:end], "label": labels[best[r, t]], "score": float(scores[r, t]),
                     "start": start, "end": end}
            if pairs is not None:
                piece["segment"] = segment
            pieces.append(piece)
        out.append({"tokens": pieces})
    return out


def _entities(labels: list[str], logits: torch.Tensor, batch: TokenBatch, aggregation: str = "first"
              ) -> list[dict[str, Any]]:
    rows = len(batch.texts)
    probs = torch.softmax(logits[:rows].float(), dim=-1).cpu().numpy()
    words = word_predictions(probs, batch, labels, aggregation)
    tags = [split_tag(tag) for tag in labels]
    kinds = sorted({kind for _, kind in tags})
    prefix = np.array(["OIBES".index(p) for p, _ in tags])[words.label]
    kind = np.array([kinds.index(k) for _, k in tags])[words.label]

    # A word continues the open entity when it is an I- or E- of the same type in the same row and
    # segment and the word before it left one open (a B- or an I-).
    after = np.zeros(len(words.row), dtype=bool)
    after[1:] = ((words.row[1:] == words.row[:-1]) & np.isin(prefix[:-1], (INSIDE, BEGIN)) & (kind[1:] == kind[:-1])
                 & (words.segment[1:] == words.segment[:-1]))
    continues = after & np.isin(prefix, (INSIDE, LAST))
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
