"""Hyper-parameters of a Modular Transformer Block head (O'Dwyer Wha Binda, Transformer Modules)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from modules_store import TaskType


class MTBConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_type: TaskType
    num_labels: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    source_layer: int = Field(ge=0, description="backbone state the blocks read (0 = embeddings)")
    copied_from: list[int] = Field(min_length=1, description="backbone block indices the blocks started as")
    backbone_config: dict[str, Any] = Field(description="the backbone's Hugging Face config (rebuilds the blocks)")
    pooling: Literal["mean", "cls"] = "mean"
    dropout: float = Field(0.1, ge=0, lt=1)
    casing: bool = Field(False, description="add a learned embedding of each token's raw-text casing to the "
                                            "blocks' input (the tokenizer may lowercase)")

    @property
    def num_blocks(self) -> int:
        return len(self.copied_from)

    @model_validator(mode="after")
    def _check(self) -> "MTBConfig":
        if "model_type" not in self.backbone_config:
            raise ValueError("backbone_config needs a model_type")
        return self
