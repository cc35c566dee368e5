"""Validation metrics: classification scores and CoNLL entity-level scores.

Entity extraction follows conlleval (and seqeval's default mode): an entity starts at a B- tag,
or at an I- tag whose type differs from the entity before it (IOB1 and ill-formed BIO); it ends
at O, at a B- tag, or where the type changes; BIOES / BILOU tags are read too (an E- / L- tag ends
the entity, an S- / U- tag is one of its own). Scores count exact (type, start, end) matches. Tags
are read as tmod-serve reads them (`split_tag`), so the score describes the spans that are served.
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np
from scipy import sparse

from modules_store import TaskType
from server.heads.decode import split_tag


# ---- classification ---------------------------------------------------------------------------
def accuracy(gold: Sequence, pred: Sequence) -> float:
    _same_length(gold, pred)
    return sum(g == p for g, p in zip(gold, pred)) / len(gold) if gold else 0.0


def _prf(tp, fp, fn) -> tuple:
    """Precision, recall and F1 of counts, 0 where undefined (sklearn's zero_division=0): of numbers, or
    element by element of numpy arrays of counts (`margin_interval`'s rounds)."""
    tp, fp, fn = (np.asarray(v, dtype=np.float64) for v in (tp, fp, fn))
    with np.errstate(divide="ignore", invalid="ignore"):
        precision = np.where(tp + fp > 0, tp / (tp + fp), 0.0)
        recall = np.where(tp + fn > 0, tp / (tp + fn), 0.0)
        f1 = np.where(precision + recall > 0, 2 * precision * recall / (precision + recall), 0.0)
    if precision.ndim == 0:
        return float(precision), float(recall), float(f1)
    return precision, recall, f1


def f1_binary(gold: Sequence, pred: Sequence, positive) -> float:
    _same_length(gold, pred)
    tp = sum(g == positive and p == positive for g, p in zip(gold, pred))
    fp = sum(g != positive and p == positive for g, p in zip(gold, pred))
    fn = sum(g == positive and p != positive for g, p in zip(gold, pred))
    return _prf(tp, fp, fn)[2]


def f1_macro(gold: Sequence, pred: Sequence, labels: Sequence | None = None) -> float:
    """Unweighted mean of per-class F1 over `labels` (default: every class in gold or pred)."""
    labels = list(labels) if labels is not None else sorted(set(gold) | set(pred), key=str)
    return sum(f1_binary(gold, pred, label) for label in labels) / len(labels) if labels else 0.0


def matthews(gold: Sequence, pred: Sequence) -> float:
    """Matthews correlation coefficient (multi-class form; the usual one for two classes)."""
    _same_length(gold, pred)
    n = len(gold)
    if n == 0:
        return 0.0
    gold_counts, pred_counts = Counter(gold), Counter(pred)
    classes = list(set(gold_counts) | set(pred_counts))
    return _mcc(sum(g == p for g, p in zip(gold, pred)), n, [gold_counts[c] for c in classes],
                [pred_counts[c] for c in classes])


def _mcc(correct, n, gold_counts, pred_counts):
    """MCC of counts: rows answered right, rows, and each class's gold and predicted rows (last axis);
    numbers, or numpy arrays of them (`margin_interval`'s rounds)."""
    correct, n, gold_counts, pred_counts = (np.asarray(v, dtype=np.float64)
                                            for v in (correct, n, gold_counts, pred_counts))
    cov_gp = correct * n - (gold_counts * pred_counts).sum(-1)
    cov_gg = n * n - (gold_counts * gold_counts).sum(-1)
    cov_pp = n * n - (pred_counts * pred_counts).sum(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        # one side constant: no correlation (sklearn's convention too)
        mcc = np.where((cov_gg == 0) | (cov_pp == 0), 0.0, cov_gp / np.sqrt(cov_gg * cov_pp))
    return float(mcc) if mcc.ndim == 0 else mcc


def classification_scores(gold: Sequence[str], pred: Sequence[str], labels: Sequence[str]) -> dict:
    """Everything reported for a sequence task. Binary F1 takes labels[1] as the positive class."""
    scores = {
        "accuracy": accuracy(gold, pred),
        "f1_macro": f1_macro(gold, pred, labels),
        "mcc": matthews(gold, pred),
        "examples": len(gold),
    }
    if len(labels) == 2:
        scores["f1"] = f1_binary(gold, pred, labels[1])
        scores["f1_positive_label"] = labels[1]
    return scores


def per_class_scores(gold: Sequence[str], pred: Sequence[str], labels: Sequence[str]) -> dict:
    """Each label's precision, recall, F1, support (gold count) and predicted count."""
    _same_length(gold, pred)
    out = {}
    for label in labels:
        tp = sum(g == label and p == label for g, p in zip(gold, pred))
        n_pred, n_gold = sum(p == label for p in pred), sum(g == label for g in gold)
        precision, recall, f1 = _prf(tp, n_pred - tp, n_gold - tp)
        out[label] = {"precision": precision, "recall": recall, "f1": f1, "support": n_gold, "predicted": n_pred}
    return out


def confusion_matrix(gold: Sequence[str], pred: Sequence[str], labels: Sequence[str]) -> list[list[int]]:
    """counts[i][j]: examples of gold label i predicted as label j."""
    index = {label: i for i, label in enumerate(labels)}
    counts = [[0] * len(labels) for _ in labels]
    for g, p in zip(gold, pred):
        counts[index[g]][index[p]] += 1
    return counts


# ---- multi-label ------------------------------------------------------------------------------
def multi_hot(rows: Sequence[Sequence[str]], labels: Sequence[str]) -> np.ndarray:
    """(N, C) booleans of label collections, one column per label of `labels`."""
    index = {label: i for i, label in enumerate(labels)}
    out = np.zeros((len(rows), len(labels)), dtype=bool)
    for r, row in enumerate(rows):
        out[r, [index[y] for y in row]] = True
    return out


THRESHOLD_GRID = tuple(round(0.02 * i, 2) for i in range(1, 50))  # 0.02 .. 0.98


def multilabel_scores(gold: np.ndarray, pred: np.ndarray, labels: Sequence[str]) -> dict:
    """Macro and micro F1 (and per label) of (N, C) boolean gold and predicted label sets. A label
    with no gold and no predicted row scores F1 0 (sklearn's zero_division=0)."""
    gold, pred = np.asarray(gold, dtype=bool), np.asarray(pred, dtype=bool)
    if gold.shape != pred.shape:
        raise ValueError(f"gold {gold.shape} vs predicted {pred.shape}")
    tp, fp, fn = (gold & pred).sum(0), (~gold & pred).sum(0), (gold & ~pred).sum(0)
    per_label = {}
    for c, label in enumerate(labels):
        p, r, f = _prf(int(tp[c]), int(fp[c]), int(fn[c]))
        per_label[label] = {"precision": p, "recall": r, "f1": f, "support": int(gold[:, c].sum()),
                            "predicted": int(pred[:, c].sum())}
    p, r, f = _prf(int(tp.sum()), int(fp.sum()), int(fn.sum()))
    return {"f1_macro": sum(v["f1"] for v in per_label.values()) / len(labels) if len(labels) else 0.0,
            "f1_micro": f, "precision_micro": p, "recall_micro": r,
            "exact_match": float((gold == pred).all(1).mean()) if len(gold) else 0.0,
            "examples": int(len(gold)), "per_label": per_label}


def label_f1_by_threshold(gold: np.ndarray, probs: np.ndarray, grid: Sequence[float] = THRESHOLD_GRID) -> np.ndarray:
    """(len(grid), C): each label's F1 when predicted at probability >= each threshold."""
    gold = np.asarray(gold, dtype=bool)
    out = np.zeros((len(grid), gold.shape[1]))
    for i, t in enumerate(grid):
        pred = probs >= t
        tp, fp, fn = (gold & pred).sum(0), (~gold & pred).sum(0), (gold & ~pred).sum(0)
        out[i] = np.where(tp > 0, 2 * tp / np.maximum(2 * tp + fp + fn, 1), 0.0)
    return out


def choose_thresholds(gold: np.ndarray, probs: np.ndarray, labels: Sequence[str],
                      grid: Sequence[float] = THRESHOLD_GRID) -> dict:
    """Decision thresholds for a multi-label head, chosen on (validation) data: one global threshold
    (the grid value with the best macro F1) or one per label (each label's best F1 on the grid; macro F1
    is a mean over labels, so this maximises it too), whichever gives the better macro F1 (ties: global,
    the simpler rule). A label the split gives no evidence on (F1 0 at every threshold: no positive row,
    or none found) takes the global threshold, not the grid's lowest, which would answer it on nearly every
    text. Returns the manifest's `decoding` entries and what each rule scored."""
    table = label_f1_by_threshold(gold, probs, grid)
    macro = table.mean(1)
    best_global = int(np.argmax(macro))  # first of equal maxima: the lowest threshold
    no_evidence = table.max(0) == 0
    per_label = np.where(no_evidence, best_global, table.argmax(0))
    per_label_macro = float(table[per_label, np.arange(len(labels))].mean())
    global_macro = float(macro[best_global])
    if per_label_macro > global_macro:
        rule = "per_label"
        thresholds = {label: float(grid[i]) for label, i in zip(labels, per_label)}
    else:
        rule = "global"
        thresholds = {label: float(grid[best_global]) for label in labels}
    unfitted = [label for label, none in zip(labels, no_evidence) if none]
    unfitted_note = (f"; {len(unfitted)} label(s) with F1 0 at every threshold there (no positive row, or none "
                     f"found) take the global one: {', '.join(unfitted)}" if unfitted and rule == "per_label" else "")
    return {
        "thresholds": thresholds,
        "threshold_rule": f"{rule}: of one global threshold (macro F1 {global_macro:.4f} at {grid[best_global]}) and "
                          f"one per label (macro F1 {per_label_macro:.4f}), the better on the validation split; "
                          f"grid {grid[0]}..{grid[-1]} step {round(grid[1] - grid[0], 4)}, predicted at p >= threshold"
                          f"{unfitted_note}",
        "rule": rule, "global_threshold": float(grid[best_global]),
        "global_f1_macro": global_macro, "per_label_f1_macro": per_label_macro,
    }


# ---- "none of these" (single-label) ----------------------------------------------------------
def answered_scores(gold: Sequence[str], probs: np.ndarray, labels: Sequence[str], threshold: float) -> dict:
    """With no label answered where the best probability is under `threshold`: the share of rows
    answered (coverage) and the accuracy over those."""
    probs = np.asarray(probs)
    answered = probs.max(1) >= threshold
    correct = np.array([labels[i] == g for i, g in zip(probs.argmax(1), gold)])
    n = int(answered.sum())
    return {"threshold": float(threshold), "coverage": n / len(gold) if len(gold) else 0.0,
            "accuracy_answered": float(correct[answered].mean()) if n else 0.0, "answered": n}


def choose_none_threshold(gold: Sequence[str], probs: np.ndarray, labels: Sequence[str],
                          grid: Sequence[float] = THRESHOLD_GRID) -> dict:
    """The "none of these" threshold of a single-label head, chosen on (validation) data: the grid
    value where answering gains most, counting +1 per right answer and -1 per wrong one (so a row is
    left unanswered where, at its confidence, the head is wrong more often than right); ties: the
    lowest threshold (answer more)."""
    probs = np.asarray(probs)
    confidence = probs.max(1)
    correct = np.array([labels[i] == g for i, g in zip(probs.argmax(1), gold)])
    gains = [int(np.where(correct, 1, -1)[confidence >= t].sum()) for t in grid]
    best = grid[int(np.argmax(gains))]
    return {**answered_scores(gold, probs, labels, best),
            "threshold_rule": f"none of these under p {best}: of the grid {grid[0]}..{grid[-1]}, the threshold with the "
                              f"most right minus wrong answers on the validation split"}


# ---- what validation chose -------------------------------------------------------------------
NOTHING_CHOSEN = "chose nothing (the run kept its last epoch)"


def validation_role(epoch: bool, decision_thresholds: bool, none_threshold: bool) -> str:
    """What a run's validation split chose, said once (the manifest's `metrics.role`) and read wherever a
    validation number is shown (report.md, the verdict, `eval` on that file): a number on rows that chose
    something is optimistic. A --none-below P the user set was not chosen, nor the epoch of a one-epoch run
    or of --select last."""
    chose = [what for what, did in (("the epoch", epoch), ("the decision thresholds", decision_thresholds),
                                    ("the none-of-these threshold", none_threshold)) if did]
    return "chose " + " and ".join(chose) if chose else NOTHING_CHOSEN


def optimistic(role: str) -> str:
    """The clause after a validation number: optimistic where its rows chose something (`validation_role`)."""
    return "" if role == NOTHING_CHOSEN else ", so this number is optimistic"


def rows_seen(data: dict, split: str, validation_role: str = NOTHING_CHOSEN) -> str:
    """Why a run's validation or test number (or eval's on a `file` of no part of the run) is not wholly
    unseen: its rows whose text the training rows hold too, and for test (or such a file) those the
    validation rows hold where validation chose something (the counts of `training.splits.shared_rows`,
    in the manifest's `training.data`); "" where it is unseen."""
    rows, seen = data.get(f"{split}_examples"), []

    def holding(shared: int, other: str) -> str:
        return f"{shared} of its {rows} rows {'holds' if shared == 1 else 'hold'} a text the {other} rows hold too"

    if shared := data.get(f"{split}_rows_also_in_training"):
        seen.append(holding(shared, "training") + ", which flatters the head")
    if split in ("test", "file") and (shared := data.get(f"{split}_rows_also_in_validation")) \
            and optimistic(validation_role):
        seen.append(holding(shared, "validation") + f", and validation {validation_role} on them, so this number is "
                    "optimistic")
    return "; ".join(seen)


# ---- entities ---------------------------------------------------------------------------------
def entities(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """(type, first, last) word indices of each entity in one sentence's tags (last inclusive): the
    spans tmod-serve answers for those tags (server/heads/decode.py). A word continues the open
    entity only as an I- or E- of its type after a B- or I- (E- and S- close an entity); any other
    tag but O starts one."""
    found = []
    current = None  # [type, first]
    left_open = False
    for i, tag in enumerate(tags):
        prefix, kind = split_tag(tag)
        if current is not None and not (left_open and prefix in ("I", "E") and kind == current[0]):
            found.append((current[0], current[1], i - 1))
            current = None
        if prefix != "O" and current is None:
            current = [kind, i]
        left_open = prefix in ("B", "I")
    if current is not None:
        found.append((current[0], current[1], len(tags) - 1))
    return found


def entity_scores(gold: Sequence[Sequence[str]], pred: Sequence[Sequence[str]]) -> dict:
    """Micro precision/recall/F1 over exact entity matches, plus the same per type."""
    if len(gold) != len(pred):
        raise ValueError(f"{len(gold)} gold sentences vs {len(pred)} predicted")
    tp, n_gold, n_pred = Counter(), Counter(), Counter()
    for s, (gold_tags, pred_tags) in enumerate(zip(gold, pred)):
        _same_length(gold_tags, pred_tags, f"sentence {s}: ")
        gold_set, pred_set = set(entities(gold_tags)), set(entities(pred_tags))
        n_gold.update(e[0] for e in gold_set)
        n_pred.update(e[0] for e in pred_set)
        tp.update(e[0] for e in gold_set & pred_set)
    per_type = {}
    for kind in sorted(set(n_gold) | set(n_pred)):
        p, r, f = _prf(tp[kind], n_pred[kind] - tp[kind], n_gold[kind] - tp[kind])
        per_type[kind] = {"precision": p, "recall": r, "f1": f, "support": n_gold[kind]}
    total_tp, total_gold, total_pred = sum(tp.values()), sum(n_gold.values()), sum(n_pred.values())
    p, r, f = _prf(total_tp, total_pred - total_tp, total_gold - total_tp)
    words = sum(len(t) for t in gold)
    word_acc = sum(g == q for gt, pt in zip(gold, pred) for g, q in zip(gt, pt)) / words if words else 0.0
    return {"precision": p, "recall": r, "f1": f, "per_type": per_type, "entities": total_gold,
            "sentences": len(gold), "word_accuracy": word_acc}


def _same_length(a: Sequence, b: Sequence, where: str = "") -> None:
    if len(a) != len(b):
        raise ValueError(f"{where}{len(a)} gold vs {len(b)} predicted")


# ---- the noise in a margin --------------------------------------------------------------------
# bootstrap rounds: between seeds an accuracy margin's interval ends moved by a standard deviation of 0.004 on
# 249 rows, 0.0016 on 872 (20 seeds each); a margin that close to 0 is called within the noise or not by its seed
ROUNDS = 1000
LEVEL = 0.95


def interval_text(interval: Sequence[float]) -> str:
    """A margin's interval as every report writes it: '-0.0092 to +0.0241'."""
    return f"{interval[0]:+.4f} to {interval[1]:+.4f}"


def within_noise(interval: Sequence[float] | None) -> bool:
    """Whether a margin's interval holds 0: its rows cannot tell the head from that baseline, either way."""
    return bool(interval) and interval[0] <= 0 <= interval[1]


def drawn_unit(kind: TaskType) -> str:
    """What `margin_interval` draws: a token task's sentences, another task's rows."""
    return "sentences" if kind == TaskType.token_classification else "rows"


def row_counts(kind: TaskType, gold: Sequence, pred: Sequence, labels: Sequence[str]) -> sparse.csr_matrix:
    """(rows, counts) whose column sums give every metric of `scores_of_counts`: a sequence task's
    row is its cell of the confusion matrix (one-hot over labels x labels), a token task's sentence its
    entities right, gold and answered, its words right and its words, a multi-label row each label's
    true positive, false positive and false negative. A label outside `labels` is a KeyError."""
    if kind == TaskType.sequence_classification:
        index = {label: i for i, label in enumerate(labels)}
        cells = [index[g] * len(labels) + index[p] for g, p in zip(gold, pred)]
        return sparse.csr_matrix((np.ones(len(cells)), (np.arange(len(cells)), cells)),
                                 shape=(len(cells), len(labels) ** 2))
    if kind == TaskType.token_classification:
        rows = []
        for gold_tags, pred_tags in zip(gold, pred):
            gold_set, pred_set = set(entities(gold_tags)), set(entities(pred_tags))
            rows.append((len(gold_set & pred_set), len(gold_set), len(pred_set),
                         sum(g == q for g, q in zip(gold_tags, pred_tags)), len(gold_tags)))
        return sparse.csr_matrix(np.array(rows, dtype=np.float64).reshape(len(rows), 5))
    gold, pred = multi_hot(gold, labels), multi_hot(pred, labels)
    return sparse.csr_matrix(np.hstack([gold & pred, ~gold & pred, gold & ~pred]).astype(np.float64))


def scores_of_counts(kind: TaskType, counts: np.ndarray, labels: Sequence[str]) -> dict:
    """Each selection metric of `kind` (training.settings.METRICS) from summed `row_counts`, one per
    row of `counts` (R, columns): the numbers `classification_scores`, `entity_scores` and
    `multilabel_scores` give for the same rows."""
    counts, n_labels = np.atleast_2d(counts), len(labels)
    if kind == TaskType.sequence_classification:
        cells = counts.reshape(len(counts), n_labels, n_labels)
        right = np.diagonal(cells, axis1=1, axis2=2)
        gold, pred, rows = cells.sum(2), cells.sum(1), cells.sum((1, 2))
        f1 = _prf(right, pred - right, gold - right)[2]
        out = {"accuracy": right.sum(1) / rows, "f1_macro": f1.mean(1), "mcc": _mcc(right.sum(1), rows, gold, pred)}
        if n_labels == 2:
            out["f1"] = f1[:, 1]
        return out
    if kind == TaskType.token_classification:
        tp, gold, pred, words_right, words = counts.T
        precision, recall, f1 = _prf(tp, pred - tp, gold - tp)
        return {"precision": precision, "recall": recall, "f1": f1, "word_accuracy": words_right / words}
    tp, fp, fn = counts[:, :n_labels], counts[:, n_labels:2 * n_labels], counts[:, 2 * n_labels:]
    return {"f1_macro": _prf(tp, fp, fn)[2].mean(1), "f1_micro": _prf(tp.sum(1), fp.sum(1), fn.sum(1))[2]}


def margin_interval(kind: TaskType, metric: str, gold: Sequence, head: Sequence, other: Sequence,
                    labels: Sequence[str], seed: int = 0, rounds: int = ROUNDS) -> tuple[float, float] | None:
    """The LEVEL paired bootstrap interval of metric(head) - metric(other) on the same rows (a token
    task's: sentences): the rows drawn with replacement `rounds` times, each drawn row scored with
    both answers, so the interval is of the margin, not of either score. An interval that holds 0
    means these rows cannot tell the two apart. None where there are no rows, or a gold label is not
    one of `labels` (a file scored by a module that does not know all its labels)."""
    try:
        ours, theirs = row_counts(kind, gold, head, labels), row_counts(kind, gold, other, labels)
    except KeyError:
        return None
    n = ours.shape[0]
    if n == 0:
        return None
    rng = np.random.default_rng(seed)
    chunk = max(1, min(rounds, 2_000_000 // max(n, 1)))  # rounds drawn together: ~16 MB of weights at most
    margins = []
    for start in range(0, rounds, chunk):
        weights = rng.multinomial(n, np.full(n, 1 / n), size=min(chunk, rounds - start)).T  # (rows, rounds)
        margins.append(scores_of_counts(kind, (ours.T @ weights).T, labels)[metric]
                       - scores_of_counts(kind, (theirs.T @ weights).T, labels)[metric])
    low, high = np.quantile(np.concatenate(margins), [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return float(low), float(high)
