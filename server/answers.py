"""A pass's host logits -> what leaves the model runner: the one place where logits become answers.

With one process (`--workers 1`) every task is decoded here (`decode_all`). With HTTP worker
processes the workers decode: native tasks leave as each row's logits (`row_logits`; the worker's
`decode_rows` turns them into the same answers), while a foreign task's logits lie on its bridge's
tokenization, which only the engine process has, so it is decoded here.
"""
from __future__ import annotations

import torch

from server.backbone import TokenBatch
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


def row_logits(modules: dict[str, LoadedModule], logits: dict[str, torch.Tensor], batches: dict[str, TokenBatch],
               lengths: list[int], rows: list | None = None) -> dict[str, list]:
    """Per task, each row's host logits as a numpy array ((tokens, labels) over its own tokens for
    token tasks, (labels,) otherwise), for a frontend process to decode (`decode_rows`). A foreign
    task's logits lie on its bridge's tokenization, which only this process has: decoded here."""
    out = {}
    for task, module in modules.items():
        if module.bridge:
            out[task] = decode_all({task: module}, logits, batches, rows)[task]
        elif logits[task].dim() == 3:
            host = logits[task].numpy()
            out[task] = [host[r, :n] for r, n in enumerate(lengths)]
        else:
            out[task] = list(logits[task].numpy())
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
