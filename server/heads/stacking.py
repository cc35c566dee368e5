"""Weights of K same-shaped layers stacked along a leading head dimension, run as batched matrix
products (the grouped heads in server/heads/*/grouped.py).

Weights keep nn.Linear's (out, in) layout and enter bmm transposed: on the CPU (oneDNN, one thread,
B=32 x 47 tokens, k=64) that is as fast as a pre-transposed copy for wide outputs and twice as fast
for a 9-label classifier; classifiers are padded to a multiple of 16 labels, which halves their time
again (all three measured with torch.bmm, 8 heads).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

LABEL_MULTIPLE = 16


def stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.detach() for t in tensors]).contiguous()


def linear_stack(linears) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, out, in) weights and (K, 1, out) biases of K linear layers of one shape."""
    return stack([m.weight for m in linears]), stack([m.bias for m in linears]).unsqueeze(1)


def padded_classifiers(linears) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear_stack` of classifiers whose label counts may differ: zero rows up to the largest
    count, rounded up to a multiple of LABEL_MULTIPLE (callers slice each head's labels back)."""
    most = max(m.out_features for m in linears)
    width = -(-most // LABEL_MULTIPLE) * LABEL_MULTIPLE
    weight = stack([F.pad(m.weight, (0, 0, 0, width - m.out_features)) for m in linears])
    bias = stack([F.pad(m.bias, (0, width - m.out_features)) for m in linears])
    return weight, bias.unsqueeze(1)


def batched_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x (K, N, in) through K linear layers: (K, N, out). The bias enters the product (baddbmm), not
    a separate add: under bf16 autocast a bf16 product plus an fp32 bias is a cast and an add over
    the whole output (10x the product itself on the CPU, 8 heads x 1504 tokens x 64 -> 256)."""
    return torch.baddbmm(bias, x, weight.transpose(1, 2))
