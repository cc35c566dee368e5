"""The backend seam: what runs the backbone's layers, one at a time.

In the manner of TEI's small backend trait: a backend is loaded once for a backbone and then runs a
batch up to state m, handing out each state as soon as it is computed. Everything else (tokenizing,
collating, fingerprint, the heads) stays with `Backbone` and the engine, which see only this.
"""
from __future__ import annotations

from typing import Iterator, Protocol, runtime_checkable

import torch

from server.backbone.tokens import TokenBatch


@runtime_checkable
class BackboneBackend(Protocol):
    name: str  # "torch", "onnx"
    precision: str  # "fp32", "bf16", "fp16" (torch), "int8" (onnx)

    def stream(self, batch: TokenBatch, upto: int) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (state index, hidden (B, T, H) float32 torch tensor) for states 0..upto, in order,
        computing state i+1 only when asked for it (a consumer that stops early stops the compute).
        State 0 is the embedding output, state l the output of layer l. `upto` is already checked."""
        ...

    def describe(self) -> dict:
        """What a benchmark or a log line should record about this backend."""
        ...
