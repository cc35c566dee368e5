"""The contract every head kind follows.

A head declares which backbone states it reads, keeps its own running state while those states
stream past, and turns that state into logits at the end. Decoding logits into the response shape
is shared by task type (see server/heads/decode.py), not per kind.

The contract: `layers_read()`, `start(batch)`, `consume(state, index, hidden)`,
`finish(state, batch) -> logits`, `from_manifest`, `manifest_fields`, and `load_weights` (strict:
it names each missing, unexpected or mis-shaped tensor). Kinds register by name
(`register_head("layermix", LayerMixHead)`, in each kind's folder as PEFT's `tuners/<method>/`
do), so a manifest's `kind` picks its class. Training uses the same classes and the same
start / consume / finish path, so what is trained is what is served.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from modules_store import ArtifactError, Manifest, TaskType
from server.backbone.tokens import TokenBatch


class Head(nn.Module):
    kind: ClassVar[str]
    task_type: TaskType
    labels: list[str]

    def __init__(self, config, labels: list[str] | None = None):
        """`config` is the kind's pydantic config; it names task_type and num_labels."""
        super().__init__()
        self.config = config
        self.task_type = config.task_type
        self.labels = list(labels) if labels else [str(i) for i in range(config.num_labels)]
        if len(self.labels) != config.num_labels:
            raise ValueError(f"{len(self.labels)} labels for num_labels={config.num_labels}")

    def layers_read(self) -> list[int]:
        """Backbone state indices (0 = embeddings) this head needs, ascending."""
        raise NotImplementedError

    def token_classes_read(self) -> set[str]:
        """Per-token classes (server/backbone/tokens.py TOKEN_CLASSES) this head reads from the batch."""
        return set()

    def start(self, batch: TokenBatch) -> Any:
        """A fresh running state for this batch."""
        raise NotImplementedError

    def consume(self, state: Any, index: int, hidden: torch.Tensor) -> Any:
        """Fold backbone state `index` (B, T, H) into the running state and return it."""
        raise NotImplementedError

    def finish(self, state: Any, batch: TokenBatch) -> torch.Tensor:
        """Logits: (B, C) for sequence tasks, (B, T, C) for token tasks."""
        raise NotImplementedError

    # ---- artifacts ---------------------------------------------------------------------------
    @classmethod
    def from_manifest(cls, manifest: Manifest, backbone=None) -> "Head":
        raise NotImplementedError

    def manifest_fields(self) -> dict[str, Any]:
        """kind, task_type, labels, layers, config: what a Manifest needs from the head."""
        raise NotImplementedError

    def artifact_weights(self) -> dict[str, torch.Tensor]:
        """What the artifact stores (LoRA-MTB stores only its low-rank factors and classifier)."""
        return self.state_dict()

    def load_weights(self, weights: dict[str, torch.Tensor], where: str = "module") -> None:
        """Strict load that names every missing, unexpected or mis-shaped tensor."""
        expected = self.state_dict()
        problems = []
        missing = sorted(set(expected) - set(weights))
        unexpected = sorted(set(weights) - set(expected))
        if missing:
            problems.append(f"missing tensors {missing}")
        if unexpected:
            problems.append(f"unexpected tensors {unexpected}")
        for name in sorted(set(expected) & set(weights)):
            if tuple(weights[name].shape) != tuple(expected[name].shape):
                problems.append(
                    f"tensor '{name}' has shape {tuple(weights[name].shape)}, "
                    f"the manifest's config implies {tuple(expected[name].shape)}"
                )
        if problems:
            raise ArtifactError("shape_mismatch", f"{where}: weights disagree with the manifest: " + "; ".join(problems))
        self.load_state_dict(weights, strict=True)


def head_forward(head, batch: TokenBatch, states) -> torch.Tensor:
    """A head's served computation over states already at hand: start, consume each (index, hidden)
    of `states` in order, finish. (The engine streams instead: it consumes each state as the backbone
    makes it.)"""
    state = head.start(batch)
    for index, hidden in states:
        state = head.consume(state, index, hidden)
    return head.finish(state, batch)
