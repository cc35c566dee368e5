"""From logits to predictions to validation metrics, shared by training and `tmod-train eval`.

`score_module` measures a stored module the way the server runs it: batches tokenized by the
backbone and pushed through `Engine.logits`; a sequence task's long text read in the server's
windows, their logits combined by its rule (server/windows.py).
"""
from __future__ import annotations

import sys
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from server.backbone import TokenBatch
from server.engine import Engine
from server.errors import ApiError
from server.heads.decode import word_tags
from server.modules import LoadedModule
from server.windows import measured_window, read, rule_for, settings_for
from training.data.word_tags import word_first_tokens
from training.metrics import classification_scores, entity_scores, multilabel_scores
from training.progress import progress_of
from training.states import Split, length_batches, padded_tokens


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
        # a word truncation cut is outside; the words are tagged as the server tags words (BIO rules
        # where the labels have them)
        words, has_token = word_values(split, r, probs[i])
        words[~has_token] = np.eye(len(split.labels), dtype=words.dtype)[outside]
        starts = np.arange(len(words)) == 0
        out.append([split.labels[j] for j in word_tags(words, starts, split.labels)])
    return out


def word_values(split: Split, row: int, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A token task's per-token `values` (T, labels) of one row read per data word, each at its first
    sub-token as the server reads a word: (the words' values (words, labels), whether each word has a
    token; a word truncation cut has none, and its values row is token 0's)."""
    first = np.array(word_first_tokens(split.encoded[row], split.spans[row]), dtype=np.int64)
    return values[np.maximum(first, 0)].copy(), first >= 0


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


def served_logits(split: Split, module: LoadedModule, batch_size: int = 128, progress: bool = True,
                  engine: Engine | None = None) -> Iterator[tuple[list[int], torch.Tensor]]:
    """(rows, the module's logits) for batches of `split`, through the served path (Engine.logits)."""
    return rows_logits(split.encoded, split.backbone, module, batch_size, progress, engine)


def rows_logits(rows: list, backbone, module: LoadedModule, batch_size: int = 128, progress: bool = True,
                engine: Engine | None = None) -> Iterator[tuple[list[int], torch.Tensor]]:
    """(indices into `rows`, the module's logits) for batches of encoded `rows` of similar length,
    through Engine.logits, with progress counted in padded word pieces."""
    engine = engine or Engine(backbone)
    lengths = [len(row) for row in rows]
    batches = length_batches(lengths, batch_size)
    total = sum(padded_tokens(lengths, chunk) for chunk in batches)
    with progress_of(total=total, bars=progress, desc=f"scoring {module.task}", unit="tok") as bar:
        for chunk in batches:
            yield chunk, engine.logits(backbone.collate([rows[r] for r in chunk]), {module.task: module})[module.task]
            bar.update(padded_tokens(lengths, chunk))


def served_text_logits(split: Split, module: LoadedModule, batch_size: int = 128, progress: bool = True,
                       engine: Engine | None = None) -> torch.Tensor | None:
    """(texts, labels) logits of a sequence or multi-label task for `split`'s texts as the server
    answers a request that asks this task alone: each text read in the rows such a request is read in
    (one where it fits the task's default window, else overlapping windows: server/windows.py), every
    row through Engine.logits, a text's windows combined by its task type's rule. None where a text
    cannot be read so (a text pair that leaves a window no room: the server refuses it, 413)."""
    backbone, task, rule = split.backbone, module.task, rule_for(split.data.task_type)
    settings = settings_for(backbone.text, None,
                            task_window=measured_window(backbone.fingerprint.name, [split.data.task_type]))
    try:
        reading = read(backbone.text, split.data.texts(), split.data.text_pairs(), settings, truncate=False)
    except ApiError as exc:
        print(f"scoring {task}: {exc.message}; its texts are scored on their first {backbone.text.max_tokens} word "
              "pieces instead", file=sys.stderr)
        return None
    row_logits: list = [None] * len(reading.rows)
    for chunk, logits in rows_logits(reading.rows, backbone, module, batch_size, progress, engine):
        for r, values in zip(chunk, logits.float().cpu().numpy()):
            row_logits[r] = values
    combined, first = [], 0
    for text in reading.texts:
        outputs = row_logits[first:first + len(text.rows)]
        first += len(text.rows)
        combined.append(rule.combine(text, outputs) if text.windowed else outputs[0])
    return torch.from_numpy(np.stack(combined))


def score_module(split: Split, module: LoadedModule, batch_size: int = 128, progress: bool = True,
                 engine: Engine | None = None, answer_split: Split | None = None, thresholds=None,
                 probabilities: list | None = None) -> dict:
    """Validation metrics of a loaded module through the served path (Engine.logits; a sequence
    task's texts read as the server reads them: `served_text_logits`).

    A foreign module behind a bridge that re-tokenizes answers on the target backbone's tokens:
    `answer_split` is the same data encoded by the target backbone, where predictions are read.
    Multi-label: `thresholds` (default: the manifest's). `probabilities`, a list, receives each
    row's label probabilities (sequence and multi-label tasks), or its word tags (token tasks)."""
    answers = answer_split or split
    predicted: list = [None] * len(split)
    kept: list = [None] * len(split)
    # a sequence task's texts as the server reads them, long ones in windows; not through a bridge that
    # re-tokenizes (server/windows.py window_rule: it reads one window only; the rule is the split's task
    # type's, since no manifest is written yet while training scores the head)
    by_text = None
    if not split.is_token_task and not module.retokenized:
        by_text = served_text_logits(split, module, batch_size, progress, engine)
    batches = ([(list(range(len(split))), by_text)] if by_text is not None else
               served_logits(split, module, batch_size, progress, engine))
    for rows, logits in batches:
        for r, p in zip(rows, predictions(answers, rows, logits)):
            predicted[r] = p
        if probabilities is not None and not split.is_token_task and not split.is_multi_label:
            for r, p in zip(rows, torch.softmax(logits.float(), dim=-1).cpu().numpy()):
                kept[r] = p
    if not split.is_multi_label:
        if probabilities is not None:
            probabilities.extend(predicted if split.is_token_task else kept)
        return score(split, predicted)
    if probabilities is not None:
        probabilities.extend(predicted)
    if thresholds is None:
        thresholds = [module.manifest.decoding["thresholds"][label] for label in split.labels]
    return score(split, predicted, thresholds)
