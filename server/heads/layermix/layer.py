"""Building blocks of the layer-mix head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from server.heads.pooling import masked_mean

MIX_NORM_EPS = 1e-5  # eps of the layer norm on each projected state (the head's and its grouped form's)


def cutoff_weights(weights: torch.Tensor, cutoff: float) -> torch.Tensor:
    """Zero the layer weights under `cutoff` and renormalise the rest to sum 1.

    The largest weight always survives, so the result is a distribution even for a large cutoff.
    """
    if cutoff <= 0:
        return weights
    keep = (weights >= cutoff) | (weights == weights.max())
    kept = weights * keep
    return kept / kept.sum()


def pool(attended: torch.Tensor, mask: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
    """(..., B, T, k) -> (..., B, k): masked mean over the real tokens; with `segments` (pair
    pooling) the text's and the pair's tokens are pooled apart, u and v, and the result is
    [u, v, |u - v|, u * v] (..., B, 4k), the classic sentence-pair features. A row without a pair
    has v = 0."""
    if segments is None:
        return masked_mean(attended, mask)
    real = mask.bool()
    pooled = [masked_mean(attended, (segments == segment) & real) for segment in (0, 1)]
    u, v = pooled
    return torch.cat([u, v, (u - v).abs(), u * v], dim=-1)


class SequenceClassifier(nn.Module):
    """One self-attention layer over the mix (optional), masked mean pooling (or pair pooling:
    `pool`), a linear classifier."""

    def __init__(self, dim: int, heads: int, num_labels: int, dropout: float, pair: bool = False,
                 attention: bool = True):
        super().__init__()
        self.attention = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True) if attention else None
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(4 * dim if pair else dim, num_labels)

    def forward(self, mixed: torch.Tensor, mask: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        if self.attention is not None:
            mixed, _ = self.attention(mixed, mixed, mixed, key_padding_mask=mask == 0, need_weights=False)
            mixed = F.gelu(mixed)
        return self.classifier(pool(self.dropout(mixed), mask, segments))


class TokenClassifier(nn.Module):
    """Pre-LN transformer encoder layer(s) over the mix, a linear classifier per token."""

    def __init__(self, dim: int, heads: int, num_labels: int, dropout: float, layers: int, ffn_dim: int):
        super().__init__()
        self.encoder = nn.ModuleList(
            nn.TransformerEncoderLayer(
                dim, heads, dim_feedforward=ffn_dim, dropout=dropout, activation="gelu",
                batch_first=True, norm_first=True,
            )
            for _ in range(layers)
        )
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(dim, num_labels)

    def forward(self, mixed: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        padding = mask == 0
        for layer in self.encoder:
            mixed = layer(mixed, src_key_padding_mask=padding)
        return self.classifier(self.dropout(mixed))
