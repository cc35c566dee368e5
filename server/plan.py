"""Execution plan: which backbone states to compute and who reads each one.

From a set of loaded modules: the union of states they read, the deepest one (the backbone stops
there), and the readers of each state. Foreign modules (served through a bridge) do not read the
backbone: their bridge does, once for all of them, and they read the states it hands back.

Heads of one architecture run as one group, with their weights stacked along a head dimension and
built once per plan (a plan is cached per set of heads and forgotten when a module changes, so a
reloaded module never meets stale stacks): layer-mix heads of one width k form a `MixGroup`
(server/heads/layermix/grouped.py), MTB and merged LoRA-MTB heads reading one state with blocks of
one architecture a `BlockGroup` (server/heads/mtb/grouped.py), embedding heads an `EmbeddingGroup`
(server/heads/embedding/grouped.py: each state pooled once per pooling setting). A group follows the head contract
(start / consume / finish) for all its heads at once; its finish returns every head's logits. A
kind with a single head in the plan runs as that head, except that with int8 projections
(`head_precision int8`, which only `MixGroup` computes) a lone layer-mix head forms a group of one.
"""
from __future__ import annotations

from collections import defaultdict
from functools import partial

from server.heads.embedding import EmbeddingHead
from server.heads.embedding.grouped import EmbeddingGroup
from server.heads.layermix import LayerMixHead
from server.heads.layermix.grouped import MixGroup
from server.heads.mtb import MTBHead
from server.heads.mtb.grouped import BlockGroup, block_shape
from server.modules import LoadedModule


def group_key(head) -> tuple | None:
    """Heads with equal keys run as one group; None: the head runs alone."""
    if head.training:
        return None
    if isinstance(head, LayerMixHead):
        return ("layermix", head.config.project_dim)
    if isinstance(head, MTBHead):
        return ("mtb", *block_shape(head))
    if isinstance(head, EmbeddingHead):
        return ("embedding",)
    return None


class LayerStep:
    def __init__(self, index: int, groups: list[int], single: list[str], bridges: list[str]):
        self.index = index
        self.groups = groups  # positions in ExecutionPlan.groups of the groups reading this state
        self.single = single  # tasks whose heads consume this state one by one
        self.bridges = bridges  # bridges reading this state


class ExecutionPlan:
    def __init__(self, modules: dict[str, LoadedModule], fuse: bool = True, bridges: dict | None = None,
                 int8: bool = False):
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
        by_key = defaultdict(list)
        for task in self.native:
            key = group_key(modules[task].head)
            if key is not None:
                by_key[key if fuse else (*key, task)].append(task)  # unfused: every head on its own
        kinds = {"layermix": partial(MixGroup, int8=int8), "mtb": BlockGroup, "embedding": EmbeddingGroup}
        self.groups = [kinds[key[0]](tasks, [modules[t].head for t in tasks])
                       for key, tasks in by_key.items() if len(tasks) >= 2 or (int8 and key[0] == "layermix")]
        grouped = {t for g in self.groups for t in g.tasks}
        self.single = [t for t in self.native if t not in grouped]  # native tasks whose heads run alone
        self.steps: dict[int, LayerStep] = {}
        for index in self.layers:
            groups = [g for g, group in enumerate(self.groups) if index in group.layers]
            single = [t for t in self.single if index in self.reads[t]]
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
