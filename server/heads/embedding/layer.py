"""What the embedding head computes from the state it reads."""
from __future__ import annotations

import torch

from server.heads.pooling import pool_modes

NORM_EPS = 1e-12  # torch.nn.functional.normalize's, which sentence-transformers' Normalize uses


def sentence_vectors(hidden: torch.Tensor, mask: torch.Tensor, modes: list[str]) -> torch.Tensor:
    """(B, T, H) -> (B, D): the modes pooled over real tokens, in float32 whatever the state's
    precision (a bf16 sum over 256 tokens would lose the vector's last digits)."""
    return pool_modes(hidden.float(), mask, modes)


def with_norm(vectors: torch.Tensor, normalize: bool) -> torch.Tensor:
    """(B, D) -> (B, D + 1): the vectors (unit length when `normalize`) and, last, the L2 norm
    they had before: a caller that asks for the other form (TEI's `normalize`) gets it exactly."""
    norm = vectors.norm(dim=-1, keepdim=True)
    if normalize:
        vectors = vectors / norm.clamp(min=NORM_EPS)
    return torch.cat([vectors, norm], dim=-1)
