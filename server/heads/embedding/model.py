"""Embedding head: the backbone's own sentence vector (a sentence-transformers model's pooling and
normalisation over one state), served beside every other task from the same pass.

It has no trained weights; its artifact records the backbone fingerprint and the pooling settings.
It reads one state and pools it as it streams past, so it holds a (B, D) vector, never the state.
Its "logits" are (B, D + 1): the vector and, last, its norm before normalisation (`with_norm`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from modules_store import Manifest
from server.backbone.tokens import TokenBatch
from server.heads.base import Head
from server.heads.embedding.config import EmbeddingConfig, sentence_transformers_settings
from server.heads.embedding.layer import sentence_vectors, with_norm


class EmbeddingHead(Head):
    config_class = EmbeddingConfig

    def __init__(self, config: EmbeddingConfig, labels: list[str] | None = None):
        super().__init__(config, labels)

    @classmethod
    def from_backbone(cls, backbone, folder: str | Path | None, name: str | None = None, **overrides) -> "EmbeddingHead":
        """The head of the sentence-transformers model in `folder` (the backbone's own folder):
        its pooling over the last state, normalised if it says so; the stated default (mean,
        normalised) where the folder has no sentence-transformers configuration."""
        settings = sentence_transformers_settings(folder, name) if folder is not None else {
            "pooling": ["mean"], "normalize": True, "max_tokens": None,
            "settings_from": "default (no backbone folder given): mean over real tokens, normalised"}
        settings.update(overrides)
        if settings["max_tokens"] is not None and settings["max_tokens"] > backbone.max_tokens:
            settings["max_tokens"] = backbone.max_tokens
        config = cls.config_class(**{"hidden_size": backbone.hidden_size, "source_layer": backbone.num_layers, **settings})
        return cls(config)

    # ---- streaming -------------------------------------------------------------------------
    def layers_read(self) -> list[int]:
        return [self.config.source_layer]

    def start(self, batch: TokenBatch) -> dict[str, Any]:
        return {"mask": batch.attention_mask, "vectors": None}

    def consume(self, state: dict[str, Any], index: int, hidden: torch.Tensor) -> dict[str, Any]:
        state["vectors"] = sentence_vectors(hidden, state["mask"], self.config.pooling)
        return state

    def finish(self, state: dict[str, Any], batch: TokenBatch) -> torch.Tensor:
        return with_norm(state["vectors"], self.config.normalize)

    # ---- artifacts -------------------------------------------------------------------------
    @classmethod
    def from_manifest(cls, manifest: Manifest, backbone=None) -> "EmbeddingHead":
        config = cls.config_class(**manifest.config)
        if config.hidden_size != manifest.backbone.hidden_size:
            raise ValueError(f"head expects hidden size {config.hidden_size}, backbone has {manifest.backbone.hidden_size}")
        if config.source_layer > manifest.backbone.num_layers:
            raise ValueError(f"reads state {config.source_layer}; the backbone has {manifest.backbone.num_layers} layers")
        if manifest.labels:
            raise ValueError(f"an embedding has no labels, the manifest names {manifest.labels}")
        return cls(config)

    def manifest_fields(self) -> dict[str, Any]:
        return {"kind": self.kind, "task_type": self.task_type, "labels": [], "layers": self.layers_read(),
                "config": self.config.model_dump(mode="json")}
