"""The engine: one backbone pass per batch, states streamed into the heads of a plan.

Layers call downwards only: runtime -> runner (server/runner/) -> engine -> plan (server/plan.py).
The runner asks for a plan once per pass (`plan`) and runs it (`run_plan`); the engine knows
nothing of batch shapes, graphs or answers (logits become answers in server/answers.py, which the
runner calls).

The backbone streams states 0..deepest (`Backbone.stream`: state 0 is the embedding output, state l
the output of layer l); each state is handed to its readers (the plan's groups, single heads and
bridges) and dropped, so at most two states are alive at once
(tests/test_streaming.py::test_at_most_two_layer_outputs_alive checks it with weak references), and
layers past the deepest are never run. Nothing in the pass reads a device value on the host, so the
whole pass can be captured as one CUDA graph (server/runner/graphs.py)."""
from __future__ import annotations

import time
from collections import OrderedDict

import torch

from server.backbone import Backbone, TokenBatch
from server.answers import decode_all
from server.heads.base import head_forward
from server.modules import LoadedModule
from server.plan import ExecutionPlan
from server.timings import Timings


class Engine:
    def __init__(self, backbone: Backbone, plan_cache_size: int = 64, fuse: bool = True, bridges: dict | None = None,
                 int8: bool = False):
        self.backbone = backbone
        self.fuse = fuse
        self.int8 = int8  # layer-mix projections as int8 products (head_precision int8; ExecutionPlan)
        self.bridges = bridges or {}  # name -> LoadedBridge (replaced whole, with forget_plans)
        self._plans: OrderedDict[tuple, ExecutionPlan] = OrderedDict()
        self._plan_cache_size = plan_cache_size
        self._last: tuple[dict, ExecutionPlan] | None = None  # the last modules dict asked for, and its plan

    def plan(self, modules: dict[str, LoadedModule]) -> ExecutionPlan:
        # the same dict as the last call (a batch of one task set: the batcher hands on the requests'
        # own dict, which nobody mutates): no key to build
        last = self._last
        if last is not None and last[0] is modules:
            return last[1]
        # keyed by head identity: a reloaded module is a new head and gets a new plan
        key = tuple(sorted((task, id(m.head), m.bridge or "", id(self.bridges.get(m.bridge)))
                           for task, m in modules.items()))
        plan = self._plans.get(key)
        if plan is None:
            plan = ExecutionPlan(modules, fuse=self.fuse, bridges=self.bridges, int8=self.int8)
            self._plans[key] = plan
            if len(self._plans) > self._plan_cache_size:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        self._last = (modules, plan)
        return plan

    def forget_plans(self) -> None:
        """Drop cached plans (after a module is unloaded or replaced, so its head can be freed)."""
        self._plans.clear()
        self._last = None

    @torch.inference_mode()
    def logits(self, batch: TokenBatch, modules: dict[str, LoadedModule],
               timings: Timings | None = None) -> dict[str, torch.Tensor]:
        """Run the backbone once, up to the deepest state any head needs; return logits per task."""
        return self.run(batch, modules, timings)[0]

    @torch.inference_mode()
    def run(self, batch: TokenBatch, modules: dict[str, LoadedModule],
            timings: Timings | None = None) -> tuple[dict[str, torch.Tensor], dict[str, TokenBatch]]:
        """(logits per task, the batch each task's logits are laid out on). Native tasks answer on
        `batch`; foreign tasks on the batch their bridge hands back (the target tokenization)."""
        return self.run_plan(self.plan(modules), batch, timings)

    @torch.inference_mode()
    def run_plan(self, plan: ExecutionPlan, batch: TokenBatch,
                 timings: Timings | None = None) -> tuple[dict[str, torch.Tensor], dict[str, TokenBatch]]:
        """`run` for a plan already at hand (the runner gets it once per pass)."""
        modules = plan.modules
        timings = timings or Timings()
        start = time.perf_counter()
        head_time = 0.0
        states = {task: modules[task].head.start(batch) for task in plan.single}
        bridge_states = {name: bridge.start(batch) for name, bridge in plan.bridges.items()}
        group_states = [group.start(batch) for group in plan.groups]
        for index, hidden in self.backbone.stream(batch, upto=plan.deepest):
            step = plan.steps.get(index)
            if step is None:
                continue
            t0 = time.perf_counter()
            for g in step.groups:
                group_states[g] = plan.groups[g].consume(group_states[g], index, hidden)
            for task in step.single:
                states[task] = modules[task].head.consume(states[task], index, hidden)
            for name in step.bridges:
                bridge_states[name] = plan.bridges[name].consume(bridge_states[name], index, hidden)
            head_time += time.perf_counter() - t0
        t0 = time.perf_counter()
        out = {task: modules[task].head.finish(states[task], batch) for task in plan.single}
        for group, state in zip(plan.groups, group_states):
            out.update(group.finish(state, batch))
        batches = {task: batch for task in plan.native}
        for name, tasks in plan.foreign.items():
            target_batch, target_states = plan.bridges[name].finish(bridge_states[name], batch)
            for task in tasks:
                out[task] = run_head(modules[task].head, target_batch, target_states)
                batches[task] = target_batch
        head_time += time.perf_counter() - t0
        timings.heads += head_time
        timings.backbone += time.perf_counter() - start - head_time
        return out, batches

    def predict(self, batch: TokenBatch, modules: dict[str, LoadedModule],
                timings: Timings | None = None) -> dict[str, list[dict]]:
        """Decoded answers per task, each a list in batch row order (for tests and tools: the
        served path decodes in the runner, through server/answers.py)."""
        return decode_all(modules, *self.run(batch, modules, timings))


def run_head(head, batch: TokenBatch, states: dict[int, torch.Tensor]) -> torch.Tensor:
    """A head over states already at hand (a bridge's output, or cached states), in index order."""
    return head_forward(head, batch, ((index, states[index]) for index in head.layers_read()))
