"""Constrained BIO decoding in plain Python, one sequence at a time: the oracle the vectorised
decoder (server.heads.decode.word_tags) is tested against."""
from __future__ import annotations

import math

import numpy as np


def allowed_after(labels: list[str], before: int | None, tag: int) -> bool:
    """The BIO rule: an I-X, or an E-X / L-X that ends an entity (where the labels have a B-X), only
    after B-X or I-X (None: the start)."""
    name = labels[tag]
    if name[:2] not in ("I-", "E-", "L-") or "B-" + name[2:] not in labels:
        return True
    return before is not None and labels[before] in ("I-" + name[2:], "B-" + name[2:])


def reference_tags(labels: list[str], probs: list[list[float]]) -> list[int]:
    """The best label of each word where that sequence follows the rules; else the most probable
    sequence that does (Viterbi over floored logs; equal scores: the lower label index)."""
    best = [max(range(len(p)), key=p.__getitem__) for p in probs]
    if all(allowed_after(labels, best[i - 1] if i else None, best[i]) for i in range(len(best))):
        return best
    logs = np.log(np.maximum(np.array(probs, dtype=np.float64), np.finfo(np.float64).tiny)).tolist()
    labels_ = range(len(labels))
    score = [logs[0][c] if allowed_after(labels, None, c) else -math.inf for c in labels_]
    back = []
    for t in range(1, len(logs)):
        pointers = [max((i for i in labels_ if allowed_after(labels, i, c)), key=lambda i: score[i]) for c in labels_]
        score = [score[pointers[c]] + logs[t][c] for c in labels_]
        back.append(pointers)
    path = [max(labels_, key=score.__getitem__)]
    for pointers in reversed(back):
        path.append(pointers[path[-1]])
    return path[::-1]
