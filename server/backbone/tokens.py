"""Tokenized batches with character offsets, so heads can answer in input coordinates."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EncodedInput:
    """One tokenized input (text or text pair), before padding into a batch."""

    text: str
    text_pair: str | None
    ids: list[int]
    type_ids: list[int]
    offsets: list[tuple[int, int]]
    sequence_ids: list[int | None]
    word_ids: list[int | None]
    truncated: bool

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) long, 1 = real token
    token_type_ids: torch.Tensor | None  # (B, T) long, or None where the model has none
    offsets: list[list[tuple[int, int]]]  # per row, per token: (start, end) chars in its own text
    sequence_ids: list[list[int | None]]  # per row, per token: 0 = text, 1 = text_pair, None = special/pad
    word_ids: list[list[int | None]]  # per row, per token: index of the pre-tokenized word
    texts: list[str]
    text_pairs: list[str] | None
    truncated: list[bool]

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def lengths(self) -> list[int]:
        return self.attention_mask.sum(dim=1).tolist()

    def to(self, device: torch.device | str) -> "TokenBatch":
        self.input_ids = self.input_ids.to(device)
        self.attention_mask = self.attention_mask.to(device)
        if self.token_type_ids is not None:
            self.token_type_ids = self.token_type_ids.to(device)
        return self
