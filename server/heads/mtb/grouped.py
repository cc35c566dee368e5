"""MTB heads (merged LoRA-MTBs included: they are plain blocks) that read the same state with blocks
of one architecture, run as one group (serving only: eval mode).

The block context (attention mask, rotary positions or MPNet's position bias) is built once for the group, and the task
layers run stacked: heads with the same task type and pooling form a `TaskLayerStack` whose
classifiers carry a leading head dimension (padded to the largest label count) and run as one
batched matrix product. The blocks themselves run one head after another: with stacked block
weights under `torch.func.vmap(functional_call)` a MiniLM block took 1.4x the time of a loop over
the heads on the CPU at batch 32 (SDPA has no batching rule there and falls back to a loop anyway),
and each block is a large computation of its own, so a loop costs no launch overhead worth saving.
"""
from __future__ import annotations

import json
from itertools import groupby

import torch

from modules_store import TaskType
from server.backbone.architectures import block_context, run_block
from server.backbone.tokens import TokenBatch
from server.heads.mtb.model import MTBHead
from server.heads.pooling import pool
from server.heads.stacking import batched_linear, padded_classifiers


def block_shape(head: MTBHead) -> tuple:
    """Heads with equal keys share a group: same state read, same block architecture and weights'
    names and shapes (a LoRA-MTB still in training form, with its adapters, differs), and the same
    position weights (MPNet's table: the group builds one context for all its heads)."""
    names = tuple((name, tuple(p.shape)) for name, p in head.blocks.named_parameters())
    positions = b"" if head.positions is None else b"".join(
        p.detach().cpu().numpy().tobytes() for p in head.positions.parameters())
    return (head.config.source_layer, json.dumps(head.config.backbone_config, sort_keys=True, default=str),
            head.hf_config._attn_implementation, names, positions)


def task_layer_shape(head: MTBHead) -> tuple:
    if head.config.task_type == TaskType.token_classification:
        return ("token",)
    return ("sequence", head.config.pooling)


class TaskLayerStack:
    """K MTB task layers of one shape: pooled linear (sequence) or per-token linear (token)."""

    def __init__(self, tasks: list[str], heads: list[MTBHead], start: int):
        self.tasks, self.start, self.stop = tasks, start, start + len(heads)
        self.shape = task_layer_shape(heads[0])
        self.num_labels = [head.config.num_labels for head in heads]
        self.weight, self.bias = padded_classifiers([head.task_layer.classifier for head in heads])

    def __call__(self, hidden: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """hidden (K, B, T, H) -> each head's logits."""
        K, B, T, H = hidden.shape
        if self.shape[0] == "token":
            logits = batched_linear(hidden.reshape(K, B * T, H), self.weight, self.bias).view(K, B, T, -1)
        else:
            pooled = pool(hidden, mask, self.shape[1])  # (K, B, H)
            logits = batched_linear(pooled, self.weight, self.bias)  # (K, B, C_max)
        return {task: logits[j, ..., :labels] for j, (task, labels) in enumerate(zip(self.tasks, self.num_labels))}


class BlockGroup:
    """MTB heads with one `block_shape`: one block context, blocks per head, task layers stacked."""

    def __init__(self, tasks: list[str], heads: list[MTBHead]):
        order = sorted(range(len(heads)), key=lambda j: task_layer_shape(heads[j]))
        self.tasks, self.heads = [tasks[j] for j in order], [heads[j] for j in order]
        heads = self.heads
        self.hf_config, self.positions = heads[0].hf_config, heads[0].positions
        self.layers = [heads[0].config.source_layer]
        self.stacks: list[TaskLayerStack] = []
        for _, members in groupby(range(len(heads)), key=lambda j: task_layer_shape(heads[j])):
            members = list(members)
            self.stacks.append(TaskLayerStack([self.tasks[j] for j in members], [heads[j] for j in members], members[0]))

    def start(self, batch: TokenBatch) -> dict:
        reads_casing = any(head.casing is not None for head in self.heads)
        return {"mask": batch.attention_mask, "hidden": None,
                "casing": batch.token_classes("casing") if reads_casing else None}

    def consume(self, state: dict, index: int, hidden: torch.Tensor) -> dict:
        context = block_context(self.hf_config, hidden, state["mask"], self.positions)
        outputs = []
        for head in self.heads:
            out = head.blocks_input(hidden, state["casing"])
            for block in head.blocks:
                out = run_block(block, out, context)
            outputs.append(out)
        state["hidden"] = torch.stack(outputs)  # (K, B, T, H)
        return state

    def finish(self, state: dict, batch: TokenBatch) -> dict[str, torch.Tensor]:
        out = {}
        for s in self.stacks:
            out.update(s(state["hidden"][s.start:s.stop], batch.attention_mask))
        return out
