"""Weights of K same-shaped layers stacked along a leading head dimension, run as batched matrix
products (the grouped heads in server/heads/*/grouped.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.detach() for t in tensors]).contiguous()


def linear_stack(linears) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, in, out) transposed weights and (K, 1, out) biases of K linear layers, for bmm."""
    return stack([m.weight.T for m in linears]), stack([m.bias for m in linears]).unsqueeze(1)


def padded_classifiers(linears) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear_stack` of classifiers with different label counts: zero rows up to the largest."""
    width = max(m.out_features for m in linears)
    weight = torch.stack([F.pad(m.weight.detach().T, (0, width - m.out_features)) for m in linears])
    bias = torch.stack([F.pad(m.bias.detach(), (0, width - m.out_features)) for m in linears])
    return weight.contiguous(), bias.unsqueeze(1).contiguous()


def batched_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x (K, N, in) through K linear layers: (K, N, out)."""
    return torch.bmm(x, weight).add_(bias)
