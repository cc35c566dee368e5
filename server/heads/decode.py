"""Logits -> response objects, by task type (shared by every head kind)."""
from __future__ import annotations

from typing import Any

import torch

from modules_store import TaskType
from server.backbone.tokens import TokenBatch


def decode(task_type: TaskType, labels: list[str], logits: torch.Tensor, batch: TokenBatch) -> list[dict[str, Any]]:
    logits = logits.float().cpu()
    if task_type == TaskType.sequence_classification:
        return [_classification(labels, row) for row in logits]
    if task_type == TaskType.regression:
        return [{"value": float(row.reshape(-1)[0])} for row in logits]
    if task_type == TaskType.token_classification:
        return [_entities(labels, logits[r], batch, r) for r in range(batch.size)]
    raise ValueError(f"no decoder for task type {task_type}")


def _classification(labels: list[str], row: torch.Tensor) -> dict[str, Any]:
    probs = torch.softmax(row, dim=-1).tolist()
    best = max(range(len(probs)), key=probs.__getitem__)
    return {"label": labels[best], "score": probs[best], "scores": dict(zip(labels, probs))}


def _split_tag(tag: str) -> tuple[str, str]:
    """BIO tag -> (prefix, type): 'B-PER' -> ('B', 'PER'), 'O' -> ('O', ''), 'PER' -> ('I', 'PER')."""
    if tag == "O":
        return "O", ""
    if len(tag) > 2 and tag[1] == "-" and tag[0] in "BIE":
        return tag[0], tag[2:]
    return "I", tag


def word_predictions(labels: list[str], logits: torch.Tensor, batch: TokenBatch, row: int):
    """Per word (as the tokenizer pre-split it): (segment, start, end, tag, score).

    A word's tag is the prediction on its first sub-token (the one training labels); its span
    runs to the end of its last sub-token.
    """
    probs = torch.softmax(logits, dim=-1)
    scores, best = probs.max(dim=-1)
    words: dict[tuple[int, int], list] = {}
    for t, (seq, word) in enumerate(zip(batch.sequence_ids[row], batch.word_ids[row])):
        if seq is None or word is None:
            continue
        start, end = batch.offsets[row][t]
        key = (seq, word)
        if key not in words:
            words[key] = [seq, start, end, labels[int(best[t])], float(scores[t])]
        else:
            words[key][2] = max(words[key][2], end)
    return list(words.values())


def _entities(labels: list[str], logits: torch.Tensor, batch: TokenBatch, row: int) -> dict[str, Any]:
    entities: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    word_scores: list[float] = []

    def close():
        nonlocal current
        if current is not None:
            current["score"] = sum(word_scores) / len(word_scores)
            source = batch.texts[row] if current["segment"] == 0 else batch.text_pairs[row]
            current["text"] = source[current["start"]:current["end"]]
            entities.append(current)
        current = None

    for seq, start, end, tag, score in word_predictions(labels, logits, batch, row):
        prefix, kind = _split_tag(tag)
        continues = current is not None and prefix == "I" and kind == current["label"] and seq == current["segment"]
        if continues:
            current["end"] = end
            word_scores.append(score)
            continue
        close()
        if prefix != "O":
            current = {"label": kind, "start": start, "end": end, "segment": seq}
            word_scores = [score]
    close()
    # offsets index the text they came from; pairs say which one ("segment": 0 text, 1 text_pair)
    fields = ("text", "label", "start", "end", "score") + (("segment",) if batch.text_pairs is not None else ())
    return {"entities": [{k: e[k] for k in fields} for e in entities]}
