"""Execution plan: which backbone states to compute and who reads each one.

From a set of loaded modules: the union of states they read, the deepest one (the backbone stops
there), the readers of each state, and fusions: layer-mix heads reading the same state share one
GELU and one matmul against their concatenated projections.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from server.heads.layermix import LayerMixHead
from server.modules import LoadedModule


@dataclass
class FusedProjection:
    """All layer-mix projections of one backbone state as one (sum k, H) matmul."""

    index: int
    tasks: list[str]
    heads: list[LayerMixHead]
    weight: torch.Tensor = field(init=False)
    sizes: list[int] = field(init=False)

    def __post_init__(self):
        parts = [head.projection(self.index) for head in self.heads]
        self.weight = torch.cat(parts, dim=0).detach()
        self.sizes = [p.shape[0] for p in parts]

    def apply(self, states: dict, hidden: torch.Tensor) -> None:
        projected = F.gelu(hidden) @ self.weight.T
        for task, head, chunk in zip(self.tasks, self.heads, projected.split(self.sizes, dim=-1)):
            states[task] = head.accumulate(states[task], self.index, chunk)


@dataclass
class LayerStep:
    index: int
    fused: FusedProjection | None  # layer-mix readers, when two or more share this state
    single: list[str]  # readers fed one by one


class ExecutionPlan:
    def __init__(self, modules: dict[str, LoadedModule], fuse: bool = True):
        if not modules:
            raise ValueError("an execution plan needs at least one module")
        self.modules = modules
        self.reads = {task: m.head.layers_read() for task, m in modules.items()}
        self.layers = sorted({i for layers in self.reads.values() for i in layers})
        self.deepest = self.layers[-1]
        self.steps: dict[int, LayerStep] = {}
        for index in self.layers:
            readers = [task for task in modules if index in self.reads[task]]
            mixers = [t for t in readers if isinstance(modules[t].head, LayerMixHead)]
            fused = None
            if fuse and len(mixers) >= 2:
                fused = FusedProjection(index, mixers, [modules[t].head for t in mixers])
            single = [t for t in readers if fused is None or t not in fused.tasks]
            self.steps[index] = LayerStep(index, fused, single)

    def describe(self) -> dict:
        return {
            "tasks": sorted(self.modules),
            "layers": self.layers,
            "deepest": self.deepest,
            "fused": {i: s.fused.tasks for i, s in self.steps.items() if s.fused},
        }
