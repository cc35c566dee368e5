"""Hyper-parameters of a layer-mix head (Dremov: layer-weighted sum of projected hidden states)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from modules_store import TaskType


class LayerMixConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_type: TaskType
    num_labels: int = Field(ge=1)
    hidden_size: int = Field(ge=1, description="backbone width H")
    layers: list[int] = Field(min_length=1, description="backbone states mixed (0 = embeddings)")
    project_dim: int = Field(64, ge=1, description="k: per-layer projection width")
    alpha: float = Field(64.0, gt=0, description="temperature on the layer logits: softmax(alpha * p)")
    cutoff: float = Field(0.0, ge=0, lt=1, description="layer weights under this are zeroed, rest renormalised")
    attention_heads: int = Field(4, ge=1)
    dropout: float = Field(0.1, ge=0, lt=1)
    encoder_layers: int = Field(1, ge=1, description="token tasks: pre-LN encoder layers on the mix")
    ffn_dim: int = Field(256, ge=1, description="token tasks: feed-forward width of those layers")
    positional: bool = Field(False, description="add learned positional embeddings to the mix")
    max_positions: int = Field(512, ge=1)
    casing: bool = Field(False, description="add a learned embedding of each token's raw-text casing")
    attention: bool = Field(
        True, description="sequence tasks: a self-attention layer over the mix before pooling (off: the mix "
                          "itself is pooled: fewer weights, for small datasets)")
    pooling: Literal["mean", "pair"] = Field(
        "mean", description="sequence tasks: 'mean' over every token, or 'pair': the text's and the pair's "
                            "tokens pooled apart (u, v) and classified from [u, v, |u - v|, u * v]")

    @model_validator(mode="after")
    def _check(self) -> "LayerMixConfig":
        if sorted(set(self.layers)) != self.layers:
            raise ValueError(f"layers must be ascending and unique, got {self.layers}")
        if self.task_type == TaskType.token_classification and (self.pooling == "pair" or not self.attention):
            raise ValueError("pooling 'pair' and attention off are for sequence tasks")
        if self.project_dim % self.attention_heads:
            raise ValueError(f"project_dim {self.project_dim} not divisible by attention_heads {self.attention_heads}")
        return self
