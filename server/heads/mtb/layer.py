"""Task layers on top of MTB blocks: pooled linear (sequence) or per-token linear (token)."""
from __future__ import annotations

import torch
from torch import nn

from server.heads.pooling import pool


class PooledClassifier(nn.Module):
    def __init__(self, hidden: int, num_labels: int, dropout: float, pooling: str):
        super().__init__()
        self.pooling = pooling
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(pool(hidden, mask, self.pooling)))


class TokenLinear(nn.Module):
    def __init__(self, hidden: int, num_labels: int, dropout: float):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(hidden))
