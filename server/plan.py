"""Execution plan: which backbone states to compute and who reads each one.

From a set of loaded modules: the union of states they read, the deepest one (the backbone stops
there), and the readers of each state. Foreign modules (served through a bridge) do not read the
backbone: their bridge does, once for all of them, and they read the states it hands back. Layer-mix heads of the same width k are fused into a
`MixGroup`: per state one GELU, one matmul against their concatenated projections, one layer norm
and one weighted add into a stacked running buffer (B, T, K, k), whatever K is.
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F

from server.heads.layermix import LayerMixHead
from server.modules import LoadedModule


class MixGroup:
    """Layer-mix heads sharing k, run as one. Serving only (eval mode: no dropout)."""

    def __init__(self, tasks: list[str], heads: list[LayerMixHead]):
        self.tasks, self.heads = tasks, heads
        self.k = heads[0].config.project_dim
        self.steps: dict[int, tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]] = {}
        weights = [head.mix_weights().detach() for head in heads]
        for index in sorted({i for head in heads for i in head.layers_read()}):
            members = [j for j, head in enumerate(heads) if index in head.layers_read()]
            projection = torch.cat([heads[j].projection(index).detach() for j in members], dim=0)
            layer_weight = torch.stack([weights[j][heads[j]._slot[index]] for j in members])
            rows = None if len(members) == len(heads) else torch.tensor(members, device=projection.device)
            self.steps[index] = (rows, projection, layer_weight.view(-1, 1))

    def apply(self, buffer: torch.Tensor | None, index: int, hidden: torch.Tensor) -> torch.Tensor:
        rows, projection, layer_weight = self.steps[index]
        projected = (F.gelu(hidden) @ projection.T).unflatten(-1, (-1, self.k))  # (B, T, K_index, k)
        term = F.layer_norm(projected, (self.k,)) * layer_weight
        if buffer is None:
            buffer = hidden.new_zeros(*hidden.shape[:2], len(self.heads), self.k)
        if rows is None:
            buffer += term
        else:
            buffer.index_add_(2, rows, term)
        return buffer

    def hand_over(self, buffer: torch.Tensor, states: dict) -> None:
        for j, task in enumerate(self.tasks):
            states[task]["mix"] = buffer[:, :, j]


class LayerStep:
    def __init__(self, index: int, groups: list[int], single: list[str], bridges: list[str]):
        self.index = index
        self.groups = groups  # positions in ExecutionPlan.groups of the groups reading this state
        self.single = single  # tasks whose heads consume this state one by one
        self.bridges = bridges  # bridges reading this state


class ExecutionPlan:
    def __init__(self, modules: dict[str, LoadedModule], fuse: bool = True, bridges: dict | None = None):
        if not modules:
            raise ValueError("an execution plan needs at least one module")
        self.modules = modules
        self.native = [t for t, m in modules.items() if m.bridge is None]
        self.foreign: dict[str, list[str]] = defaultdict(list)  # bridge name -> its tasks
        for task, module in modules.items():
            if module.bridge is not None:
                self.foreign[module.bridge].append(task)
        self.bridges = {name: (bridges or {})[name].bridge for name in self.foreign}
        self.reads = {task: modules[task].head.layers_read() for task in self.native}
        self.reads.update({f"bridge:{name}": bridge.layers_read() for name, bridge in self.bridges.items()})
        self.layers = sorted({i for layers in self.reads.values() for i in layers})
        self.deepest = self.layers[-1]
        by_width = defaultdict(list)
        if fuse:
            for task in self.native:
                module = modules[task]
                if isinstance(module.head, LayerMixHead) and not module.head.training:
                    by_width[module.head.config.project_dim].append(task)
        self.groups = [MixGroup(tasks, [modules[t].head for t in tasks]) for tasks in by_width.values()
                       if len(tasks) >= 2]
        grouped = {t for g in self.groups for t in g.tasks}
        self.steps: dict[int, LayerStep] = {}
        for index in self.layers:
            groups = [g for g, group in enumerate(self.groups) if index in group.steps]
            single = [t for t in self.native if index in self.reads[t] and t not in grouped]
            readers = [name for name, bridge in self.bridges.items() if index in bridge.layers_read()]
            self.steps[index] = LayerStep(index, groups, single, readers)

    def describe(self) -> dict:
        return {
            "tasks": sorted(self.modules),
            "layers": self.layers,
            "deepest": self.deepest,
            "fused": [g.tasks for g in self.groups],
            "bridged": {name: sorted(tasks) for name, tasks in self.foreign.items()},
        }
