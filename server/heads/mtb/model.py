"""MTB head: trainable copies of backbone blocks appended after a backbone state, plus a task layer.

It reads one backbone state, so it shares the backbone pass with every other head: the blocks run
as soon as that state streams past, and the state itself is not kept.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from modules_store import Manifest, TaskType
from server.backbone.architectures import block_config, block_context, build_block, copy_positions, positions_for, run_block
from server.backbone.tokens import CASING_CLASSES, TokenBatch
from server.heads.base import Head
from server.heads.mtb.config import MTBConfig
from server.heads.mtb.layer import PooledClassifier, TokenLinear


class MTBHead(Head):
    config_class = MTBConfig

    def __init__(self, config: MTBConfig, labels: list[str] | None = None, blocks: list[nn.Module] | None = None):
        super().__init__(config, labels)
        self.hf_config = block_config(config.backbone_config)
        if blocks is None:
            blocks = [build_block(self.hf_config) for _ in config.copied_from]
        self.blocks = nn.ModuleList(blocks)
        # what the blocks need besides their weights: rotary embeddings (decoders), MPNet's
        # relative position table (frozen, a copy of the backbone's), or None
        self.positions = positions_for(self.hf_config)
        # each token's raw-text casing (as the layer-mix head reads it), added to the blocks' input; zero at
        # first, so a fresh head's blocks compute exactly the backbone's
        self.casing = nn.Embedding(CASING_CLASSES, config.hidden_size) if config.casing else None
        if self.casing is not None:
            nn.init.zeros_(self.casing.weight)
        if config.task_type == TaskType.token_classification:
            self.task_layer = TokenLinear(config.hidden_size, config.num_labels, config.dropout)
        else:
            self.task_layer = PooledClassifier(config.hidden_size, config.num_labels, config.dropout, config.pooling)

    @classmethod
    def from_backbone(cls, backbone, task_type: TaskType, labels: list[str], num_blocks: int = 1,
                      source_layer: int | None = None, **options) -> "MTBHead":
        """A new head whose blocks are copies of the backbone's blocks right after `source_layer`
        (default: the last `num_blocks` blocks, reading the state before them)."""
        source = backbone.num_layers - num_blocks if source_layer is None else source_layer
        copied = list(range(source, source + num_blocks))
        if copied[-1] >= backbone.num_layers:
            raise ValueError(f"blocks {copied} do not exist in a {backbone.num_layers}-layer backbone")
        config = cls.config_class(task_type=task_type, num_labels=len(labels), hidden_size=backbone.hidden_size,
                           source_layer=source, copied_from=copied, backbone_config=backbone.config.to_dict(),
                           **options)
        blocks = [copy.deepcopy(backbone.adapter.layers[i]) for i in copied]
        for param in (p for block in blocks for p in block.parameters()):
            param.requires_grad_(True)  # the backbone's originals are frozen; the copies train
        head = cls(config, labels, blocks)
        head.hf_config._attn_implementation = backbone.config._attn_implementation
        copy_positions(head.positions, backbone.adapter)
        return head

    # ---- streaming -------------------------------------------------------------------------
    def layers_read(self) -> list[int]:
        return [self.config.source_layer]

    def token_classes_read(self) -> set[str]:
        return {"casing"} if self.casing is not None else set()

    def start(self, batch: TokenBatch) -> dict[str, Any]:
        return {"mask": batch.attention_mask, "hidden": None,
                "casing": batch.token_classes("casing") if self.casing is not None else None}

    def blocks_input(self, hidden: torch.Tensor, casing: torch.Tensor | None) -> torch.Tensor:
        """The state read, plus the casing embedding where the head has one."""
        return hidden if self.casing is None else hidden + self.casing(casing)

    def consume(self, state: dict[str, Any], index: int, hidden: torch.Tensor) -> dict[str, Any]:
        mask = block_context(self.hf_config, hidden, state["mask"], self.positions)
        hidden = self.blocks_input(hidden, state["casing"])
        for block in self.blocks:
            hidden = run_block(block, hidden, mask)
        state["hidden"] = hidden
        return state

    def finish(self, state: dict[str, Any], batch: TokenBatch) -> torch.Tensor:
        return self.task_layer(state["hidden"], batch.attention_mask)

    # ---- artifacts -------------------------------------------------------------------------
    @classmethod
    def _check_manifest(cls, config: MTBConfig, manifest: Manifest) -> None:
        if config.task_type != manifest.task_type:
            raise ValueError(f"config task_type {config.task_type.value} != manifest {manifest.task_type.value}")
        if config.hidden_size != manifest.backbone.hidden_size:
            raise ValueError(f"head expects hidden size {config.hidden_size}, backbone has {manifest.backbone.hidden_size}")
        if config.source_layer > manifest.backbone.num_layers:
            raise ValueError(f"reads state {config.source_layer}; the backbone has {manifest.backbone.num_layers} layers")

    @classmethod
    def from_manifest(cls, manifest: Manifest, backbone=None) -> "MTBHead":
        config = cls.config_class(**manifest.config)
        cls._check_manifest(config, manifest)
        return cls(config, manifest.labels or None)

    def manifest_fields(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "task_type": self.task_type, "labels": self.labels,
            "layers": self.layers_read(), "config": self.config.model_dump(mode="json"),
        }
