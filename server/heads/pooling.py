"""Pooling token states into one vector per row: the one implementation every head (layer-mix and
MTB classifiers, the embedding head) and every script uses.

Every function works on (..., B, T, H) states with a (B, T) mask (1 = real token) and makes no host
sync and no tensor from a Python value, so a pass that pools can be captured as a CUDA graph.
"""
from __future__ import annotations

import torch

# the order in which sentence-transformers' Pooling concatenates the modes its older flags name
POOLING_MODES = ("cls", "max", "mean")


def masked_mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(..., B, T, H) -> (..., B, H): the mean over real tokens (a row without one gives zeros)."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(-2) / weights.sum(-2).clamp(min=1)


def masked_max(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(..., B, T, H) -> (..., B, H): the largest value of each feature over real tokens (padding
    counts as -1e9, as sentence-transformers fills it)."""
    padding = mask.unsqueeze(-1) == 0
    return hidden.masked_fill(padding, -1e9).amax(-2)


def first_token(hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(..., B, T, H) -> (..., B, H): the first token's state ([CLS] on BERT-style encoders)."""
    return hidden[..., 0, :]


POOLERS = {"cls": first_token, "max": masked_max, "mean": masked_mean}


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """One pooling mode by name: 'mean', 'cls' or 'max'."""
    try:
        return POOLERS[mode](hidden, mask)
    except KeyError:
        raise ValueError(f"unknown pooling {mode!r}; known: {sorted(POOLERS)}") from None


def pool_modes(hidden: torch.Tensor, mask: torch.Tensor, modes: list[str] | tuple[str, ...]) -> torch.Tensor:
    """Several modes concatenated along the last axis, in the order given."""
    pooled = [pool(hidden, mask, mode) for mode in modes]
    return pooled[0] if len(pooled) == 1 else torch.cat(pooled, dim=-1)
