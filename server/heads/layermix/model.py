"""The layer-mix head, computed as a running weighted sum while the backbone streams.

F = GELU(sum_i w_i * LN(GELU(Z_i) W_i^T)),  w = cutoff(softmax(alpha * p)).
Because F is a sum, the head keeps one (B, T, k) buffer and adds each layer's term as that layer
arrives; the stack of all hidden states never exists. Layers whose weight the cutoff zeroed are
not read at all.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from modules_store import Manifest, TaskType
from server.backbone.tokens import CASING_CLASSES, TokenBatch
from server.heads.base import Head
from server.heads.layermix.config import LayerMixConfig
from server.heads.layermix.layer import MIX_NORM_EPS, SequenceClassifier, TokenClassifier, cutoff_weights


class LayerMixHead(Head):
    def __init__(self, config: LayerMixConfig, labels: list[str] | None = None):
        super().__init__(config, labels)
        k = config.project_dim
        # one projection per mixed state, no bias (the LN that follows removes any offset)
        self.projections = nn.Parameter(torch.empty(len(config.layers), k, config.hidden_size))
        nn.init.xavier_uniform_(self.projections)
        self.layer_logits = nn.Parameter(torch.ones(len(config.layers)))  # p, initialised to ones
        self.dropout = nn.Dropout(config.dropout)
        self.positions = nn.Embedding(config.max_positions, k) if config.positional else None
        self.casing = nn.Embedding(CASING_CLASSES, k) if config.casing else None
        if config.task_type == TaskType.token_classification:
            self.classifier = TokenClassifier(
                k, config.attention_heads, config.num_labels, config.dropout, config.encoder_layers, config.ffn_dim
            )
        else:
            self.classifier = SequenceClassifier(k, config.attention_heads, config.num_labels, config.dropout,
                                                 pair=config.pooling == "pair", attention=config.attention)
        self._slot = {layer: i for i, layer in enumerate(config.layers)}

    # ---- the layer distribution ------------------------------------------------------------
    def mix_weights(self) -> torch.Tensor:
        """w: softmax(alpha * p) with the cutoff applied, one weight per entry of config.layers."""
        return cutoff_weights(torch.softmax(self.config.alpha * self.layer_logits, dim=0), self.config.cutoff)

    def layers_read(self) -> list[int]:
        weights = self.mix_weights().detach()
        return [layer for layer, w in zip(self.config.layers, weights.tolist()) if w > 0]

    def token_classes_read(self) -> set[str]:
        return {name for name, used in (("casing", self.config.casing), ("segment", self.config.pooling == "pair"))
                if used}

    # ---- streaming -------------------------------------------------------------------------
    def start(self, batch: TokenBatch) -> dict[str, Any]:
        # The weights are fixed at inference; computing them once per batch keeps consume() cheap.
        return {"mix": None, "weights": self.mix_weights()}

    def projection(self, index: int) -> torch.Tensor:
        """W_i (k, H) for backbone state `index`."""
        return self.projections[self._slot[index]]

    def consume(self, state: dict[str, Any], index: int, hidden: torch.Tensor) -> dict[str, Any]:
        return self.accumulate(state, index, F.gelu(hidden) @ self.projection(index).T)

    def accumulate(self, state: dict[str, Any], index: int, projected: torch.Tensor) -> dict[str, Any]:
        """Add w_i * LN(projected) to the running mix (the engine may compute `projected` fused)."""
        weight = state["weights"][self._slot[index]]
        term = weight * self.dropout(F.layer_norm(projected, projected.shape[-1:], eps=MIX_NORM_EPS))
        state["mix"] = term if state["mix"] is None else state["mix"] + term
        return state

    def finish(self, state: dict[str, Any], batch: TokenBatch) -> torch.Tensor:
        mixed = F.gelu(state["mix"])
        if self.positions is not None:
            positions = torch.arange(mixed.shape[1], device=mixed.device).clamp(max=self.config.max_positions - 1)
            mixed = mixed + self.positions(positions)
        if self.casing is not None:
            mixed = mixed + self.casing(batch.token_classes("casing"))
        if self.config.pooling == "pair":
            return self.classifier(mixed, batch.attention_mask, batch.token_classes("segment"))
        return self.classifier(mixed, batch.attention_mask)

    # ---- artifacts -------------------------------------------------------------------------
    @classmethod
    def from_manifest(cls, manifest: Manifest, backbone=None) -> "LayerMixHead":
        config = LayerMixConfig(**manifest.config)
        if config.task_type != manifest.task_type:
            raise ValueError(f"config task_type {config.task_type.value} != manifest {manifest.task_type.value}")
        if config.hidden_size != manifest.backbone.hidden_size:
            raise ValueError(
                f"head expects hidden size {config.hidden_size}, backbone has {manifest.backbone.hidden_size}"
            )
        if max(config.layers) > manifest.backbone.num_layers:
            raise ValueError(f"reads layer {max(config.layers)} but the backbone has {manifest.backbone.num_layers}")
        return cls(config, manifest.labels or None)

    def manifest_fields(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "task_type": self.task_type,
            "labels": self.labels,
            "layers": self.layers_read(),
            "config": self.config.model_dump(mode="json"),
        }
