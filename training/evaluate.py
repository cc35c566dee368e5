"""From logits to predictions to validation metrics, shared by training and `tmod-train eval`.

`score_module` measures a stored module the way the server runs it: batches tokenized by the
backbone and pushed through `Engine.logits`.
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np
import torch
from tqdm.auto import tqdm

from server.backbone import TokenBatch
from server.engine import Engine
from server.heads.decode import word_tags
from server.modules import LoadedModule
from training.data import word_label_ids_from_tokens
from training.metrics import classification_scores, entity_scores, multilabel_scores
from training.states import Split


def predictions(split: Split, rows: list[int], logits: torch.Tensor) -> list:
    """Per row: the predicted label, for token tasks the predicted tag of every data word (as the
    server decodes them: `word_tags`), for multi-label tasks every label's probability (a threshold
    decides later: `score`)."""
    if split.is_multi_label:
        return list(torch.sigmoid(logits.float()).cpu().numpy())
    if not split.is_token_task:
        return [split.labels[int(i)] for i in logits.argmax(dim=-1).cpu()]
    outside = split.labels.index("O") if "O" in split.labels else 0
    probs = torch.softmax(logits.float(), dim=-1).cpu().numpy()
    out = []
    for i, r in enumerate(rows):
        # each data word reads its first sub-token's probabilities (a word truncation cut: outside),
        # tagged as the server tags words (BIO rules where the labels have them)
        first = np.array(word_label_ids_from_tokens(split.encoded[r], split.spans[r], range(probs.shape[1]), -1),
                         dtype=np.int64)
        words = probs[i, np.maximum(first, 0)]
        words[first < 0] = np.eye(len(split.labels), dtype=words.dtype)[outside]
        starts = np.arange(len(first)) == 0
        out.append([split.labels[j] for j in word_tags(words, starts, split.labels)])
    return out


def score(split: Split, predicted: list, thresholds=None) -> dict:
    """Metrics of predictions given in split order. Multi-label: a label is predicted where its
    probability is at least its threshold (`thresholds`: one number, or one per label)."""
    if split.is_multi_label:
        gold = split.multi_hot(range(len(split))).numpy().astype(bool)
        return multilabel_scores(gold, np.stack(predicted) >= np.asarray(thresholds, dtype=np.float32), split.labels)
    if split.is_token_task:
        return entity_scores([ex.tags for ex in split.data.examples], predicted)
    return classification_scores([ex.label for ex in split.data.examples], predicted, split.labels)


def collect(split: Split, batches: Iterable[list[int]],
            logits_for: Callable[[list[int], TokenBatch], torch.Tensor]) -> list:
    """Run `logits_for` over batches and return predictions in split order."""
    predicted: list = [None] * len(split)
    for rows in batches:
        batch = split.token_batch(rows)
        for r, p in zip(rows, predictions(split, rows, logits_for(rows, batch))):
            predicted[r] = p
    return predicted


def score_module(split: Split, module: LoadedModule, batch_size: int = 128, progress: bool = True,
                 engine: Engine | None = None, answer_split: Split | None = None, thresholds=None,
                 probabilities: list | None = None) -> dict:
    """Validation metrics of a loaded module through the served path (Engine.logits).

    A foreign module behind a bridge that re-tokenizes answers on the target backbone's tokens:
    `answer_split` is the same data encoded by the target backbone, where predictions are read.
    Multi-label: `thresholds` (default: the manifest's). `probabilities`, a list, receives each
    row's label probabilities (sequence and multi-label tasks)."""
    engine = engine or Engine(split.backbone)
    task = module.task
    answers = answer_split or split
    predicted: list = [None] * len(split)
    kept: list = [None] * len(split)
    for rows in tqdm(split.batches(batch_size), desc=f"scoring {task}", unit="batch", disable=not progress, leave=False):
        logits = engine.logits(split.token_batch(rows), {task: module})[task]
        for r, p in zip(rows, predictions(answers, rows, logits)):
            predicted[r] = p
        if probabilities is not None and not split.is_token_task and not split.is_multi_label:
            for r, p in zip(rows, torch.softmax(logits.float(), dim=-1).cpu().numpy()):
                kept[r] = p
    if not split.is_multi_label:
        if probabilities is not None and not split.is_token_task:
            probabilities.extend(kept)
        return score(split, predicted)
    if probabilities is not None:
        probabilities.extend(predicted)
    if thresholds is None:
        thresholds = [module.manifest.decoding["thresholds"][label] for label in split.labels]
    return score(split, predicted, thresholds)
