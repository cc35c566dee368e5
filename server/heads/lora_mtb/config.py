"""LoRA-MTB: MTB blocks frozen at the backbone's values plus trainable low-rank updates."""
from __future__ import annotations

from pydantic import Field

from server.heads.mtb.config import MTBConfig

# the linear layers of a BERT-family block, by their names inside the block
DEFAULT_TARGETS = ["attention.self.query", "attention.self.key", "attention.self.value",
                   "attention.output.dense", "intermediate.dense", "output.dense"]


class LoraMTBConfig(MTBConfig):
    rank: int = Field(8, ge=1)
    lora_alpha: float = Field(16.0, gt=0, description="update scale is lora_alpha / rank")
    targets: list[str] = Field(default_factory=lambda: list(DEFAULT_TARGETS), min_length=1)

    @property
    def scale(self) -> float:
        return self.lora_alpha / self.rank
