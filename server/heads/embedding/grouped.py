"""Embedding heads of one plan run as one group: each state is pooled once per pooling setting,
however many heads read it (heads differ in the state they read, normalisation or length)."""
from __future__ import annotations

import torch

from server.backbone.tokens import TokenBatch
from server.heads.embedding.layer import sentence_vectors, with_norm
from server.heads.embedding.model import EmbeddingHead


class EmbeddingGroup:
    def __init__(self, tasks: list[str], heads: list[EmbeddingHead]):
        self.tasks, self.heads = tasks, heads
        self.layers = sorted({head.config.source_layer for head in heads})

    def start(self, batch: TokenBatch) -> dict:
        return {"mask": batch.attention_mask, "pooled": {}}

    def consume(self, state: dict, index: int, hidden: torch.Tensor) -> dict:
        for head in self.heads:
            key = (index, tuple(head.config.pooling))
            if head.config.source_layer == index and key not in state["pooled"]:
                state["pooled"][key] = sentence_vectors(hidden, state["mask"], head.config.pooling)
        return state

    def finish(self, state: dict, batch: TokenBatch) -> dict[str, torch.Tensor]:
        return {task: with_norm(state["pooled"][(head.config.source_layer, tuple(head.config.pooling))],
                                head.config.normalize)
                for task, head in zip(self.tasks, self.heads)}
