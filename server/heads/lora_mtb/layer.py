"""Merging low-rank factors into a block's linear weights: W <- W + scale * B @ A."""
from __future__ import annotations

import torch
from torch import nn


def factor_names(block_index: int, target: str) -> tuple[str, str]:
    return f"lora.{block_index}.{target}.A", f"lora.{block_index}.{target}.B"


def merge_factors(block: nn.Module, block_index: int, targets: list[str], factors: dict[str, torch.Tensor],
                  rank: int, scale: float, where: str) -> None:
    for target in targets:
        try:
            linear = block.get_submodule(target)
        except AttributeError as exc:
            raise ValueError(f"{where}: block has no layer {target!r}") from exc
        a_name, b_name = factor_names(block_index, target)
        for name in (a_name, b_name):
            if name not in factors:
                raise ValueError(f"{where}: missing tensor {name!r}")
        a, b = factors[a_name], factors[b_name]
        out_features, in_features = linear.weight.shape
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise ValueError(
                f"{where}: '{a_name}' {tuple(a.shape)} / '{b_name}' {tuple(b.shape)} do not fit "
                f"{target} ({out_features}x{in_features}) at rank {rank}"
            )
        with torch.no_grad():
            linear.weight += scale * (b.to(linear.weight.dtype) @ a.to(linear.weight.dtype))
