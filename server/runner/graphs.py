"""CUDA graphs: a plan's whole pass at one bucket shape captured once and replayed, its logits packed
for one copy to the host; the cache of captured passes (see the package docstring)."""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from server.backbone import TokenBatch
from server.config import Settings
from server.engine import Engine
from server.modules import LoadedModule, token_classes_read
from server.runner.failures import error_text, is_device_failure, is_out_of_memory
from server.runner.shapes import Bucket

log = logging.getLogger("tmod")


def pack_logits(logits: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[tuple[str, tuple[int, ...]]]]:
    """Every task's logits as one flat float32 tensor (one device-to-host copy) and its layout."""
    layout = [(task, tuple(value.shape)) for task, value in logits.items()]
    return torch.cat([value.float().reshape(-1) for value in logits.values()]), layout


def unpack_logits(flat: torch.Tensor, layout, rows: int, tasks=None) -> dict[str, torch.Tensor]:
    """Views of `flat` per task (those in `tasks`, default all), the first `rows` rows of each
    (filler rows dropped)."""
    out, offset = {}, 0
    for task, shape in layout:
        count = 1
        for n in shape:
            count *= n
        if tasks is None or task in tasks:
            out[task] = flat[offset:offset + count].view(shape)[:rows]
        offset += count
    return out


@dataclass
class CapturedPass:
    """A plan's pass at one bucket shape: its static inputs, and `replay` that runs the pass on
    whatever they hold and returns the packed logits (a static output, valid until the next replay)."""

    inputs: TokenBatch  # static: what a batch is copied into
    replay: Callable[[], torch.Tensor]
    layout: list
    memory_bytes: int = 0
    graph: object = None  # the torch.cuda.CUDAGraph (kept alive with its pool blocks)
    deepest: int | None = None  # the last backbone state the captured plan computes (set by GraphCache)
    seconds: float | None = None  # a replay's time, measured at capture (`time_replay`): what bucket_runs weighs

    def __call__(self, batch: TokenBatch) -> torch.Tensor:
        if tuple(batch.input_ids.shape) != tuple(self.inputs.input_ids.shape):
            raise ValueError(f"batch shape {tuple(batch.input_ids.shape)} is not the captured "
                             f"{tuple(self.inputs.input_ids.shape)}")
        self.inputs.input_ids.copy_(batch.input_ids, non_blocking=True)
        self.inputs.attention_mask.copy_(batch.attention_mask, non_blocking=True)
        if self.inputs.token_type_ids is not None:
            self.inputs.token_type_ids.copy_(batch.token_type_ids, non_blocking=True)
        for name, static in self.inputs.classes.items():
            if name in batch.classes:
                static.copy_(batch.classes[name], non_blocking=True)
            else:  # read only by heads of a superset whose outputs this batch drops
                static.zero_()
        return self.replay()


@dataclass
class LaunchedPass:
    """A captured pass queued on the device, with its logits' copy to the host queued behind it: the
    copy's page-locked destination, and an event recorded after it (None on a CPU: ran already)."""

    captured: CapturedPass
    host: torch.Tensor
    begun: object = None  # torch.cuda.Event recorded before the copy in (timing)
    done: object = None  # recorded after the copy out; blocking=True: a wait on it sleeps, it does not spin
    seconds: float = 0.0  # a CPU's replay: how long it ran (it ran when queued)

    @classmethod
    def enqueue(cls, captured: CapturedPass, batch: TokenBatch) -> "LaunchedPass":
        """Copy `batch` in, replay, and copy the packed logits out, all queued (the caller holds the
        runner's graph lock: the graph's static tensors are one per graph)."""
        if captured.inputs.input_ids.device.type != "cuda":
            start = time.perf_counter()
            flat = captured(batch)
            return cls(captured, flat, seconds=time.perf_counter() - start)
        stream = torch.cuda.current_stream(captured.inputs.input_ids.device)  # whatever this thread's device
        begun, done = (torch.cuda.Event(enable_timing=True, blocking=True) for _ in range(2))
        begun.record(stream)
        flat = captured(batch)
        # page-locked (torch's host cache: reused once a batch's answers let go of it), so the copy is
        # queued behind the replay instead of waiting for it; the next replay overwrites the graph's
        # output only after this copy has read it (one stream, in order)
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        done.record(stream)
        return cls(captured, host, begun, done)

    def wait(self) -> tuple[torch.Tensor, float]:
        """The packed logits on the host, once there, and the pass's seconds on the device (copies
        included; not its wait behind the pass before it)."""
        if self.done is None:
            return self.host, self.seconds
        self.done.synchronize()
        return self.host, self.begun.elapsed_time(self.done) / 1000


def static_batch(bucket: Bucket, device: torch.device, token_types: bool, classes: set[str]) -> TokenBatch:
    """Input tensors of a bucket's shape on `device`, holding a valid batch (every row one token)."""
    shape = (bucket.size, bucket.seq_len)
    mask = torch.zeros(shape, dtype=torch.long, device=device)
    mask[:, 0] = 1
    empty = [[] for _ in range(bucket.size)]
    return TokenBatch(
        input_ids=torch.zeros(shape, dtype=torch.long, device=device), attention_mask=mask,
        token_type_ids=torch.zeros(shape, dtype=torch.long, device=device) if token_types else None,
        offsets=empty, sequence_ids=empty, word_ids=empty, texts=[""] * bucket.size, text_pairs=None,
        truncated=[False] * bucket.size,
        classes={name: torch.zeros(shape, dtype=torch.long, device=device) for name in sorted(classes)},
    )


def capture_on(graph, run: Callable, stream_context: contextlib.AbstractContextManager, pool):
    """`run()` captured into `graph` inside `stream_context` (the capture stream), in thread-local
    capture mode (other threads may use CUDA meanwhile: the tokenizer threads, a decode). Capture is
    ended and the thread's stream restored whatever `run` or the capture raises (torch.cuda.graph's
    own exit ends the capture first and, when that raises, leaves the thread on the capture stream)."""
    with stream_context:
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            return run()
        finally:
            graph.capture_end()


def pool_bytes(snapshot: list[dict], pool, device_index: int) -> int:
    """Bytes the caching allocator holds in graph memory pool `pool` on a device, from
    torch.cuda.memory_snapshot() (segments carry the pool they belong to)."""
    pool = tuple(pool)
    return sum(seg["total_size"] for seg in snapshot
               if seg.get("device", device_index) == device_index and tuple(seg.get("segment_pool_id", ())) == pool)


def capture_cuda_graph(engine: Engine, plan, bucket: Bucket,
                       precision: Callable[[], contextlib.AbstractContextManager], pool, timed: bool = False
                       ) -> CapturedPass:
    """Capture `plan`'s whole pass at `bucket` as one CUDA graph (warm-up on the capture stream
    first, as torch.cuda.graph asks: lazy initialisation and autotuning must not happen inside
    capture). `memory_bytes`: what the pool grew by, read from the pool's segments; `timed`: its
    replay timed too (`seconds`, which only bucket_runs reads)."""
    device = torch.device(engine.backbone.device)
    torch.cuda.set_device(device)  # cuda:N: the capture stream, the pool and the graph on device N
    inputs = static_batch(bucket, device, engine.backbone.text.uses_token_types, token_classes_read(plan.modules))

    def run() -> tuple[torch.Tensor, list]:
        with precision():
            logits, _ = engine.run_plan(plan, inputs)
        return pack_logits(logits)

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()  # before reading the pool: cached blocks released now are not the graph's
    before = pool_bytes(torch.cuda.memory_snapshot(), pool, device.index or 0)
    graph = torch.cuda.CUDAGraph()
    output, layout = capture_on(graph, run, torch.cuda.stream(stream), pool)
    torch.cuda.synchronize(device)
    grown = pool_bytes(torch.cuda.memory_snapshot(), pool, device.index or 0) - before

    def replay() -> torch.Tensor:
        graph.replay()
        return output

    seconds = None
    if timed:
        try:
            seconds = time_replay(graph, device)
        except Exception as exc:  # noqa: BLE001 - only bucket_runs reads the time: the graph still serves without it
            if is_device_failure(exc):
                raise
            log.warning("graph %s: its replay could not be timed (%s); bucket_runs will not cut at it", bucket,
                        error_text(exc))
    return CapturedPass(inputs, replay, layout, max(grown, 0), graph, seconds=seconds)


def time_replay(graph, device: torch.device, repeats: int = 3) -> float:
    """What one more pass at a graph's shape costs: from an event recorded on the idle stream before
    the replay is launched to one after it (the launch and the run), the median of `repeats` (at
    capture, between batches)."""
    stream = torch.cuda.current_stream(device)
    begun, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        begun.record(stream)
        graph.replay()
        done.record(stream)
        done.synchronize()
        times.append(begun.elapsed_time(done) / 1000)
    return sorted(times)[len(times) // 2]


@dataclass
class _PlanGraphs:
    plan: object  # the ExecutionPlan: held so its heads outlive the graphs that read them
    graphs: dict = field(default_factory=dict)  # Bucket -> CapturedPass
    refused: set = field(default_factory=set)  # buckets whose capture failed: they run eager


def runs_every(plan, modules: dict[str, LoadedModule]) -> bool:
    """Whether `plan` runs every one of `modules` (the same heads, not only the same task names)."""
    return len(plan.modules) >= len(modules) and all(plan.modules.get(task) is m for task, m in modules.items())


class GraphCache:
    """Captured passes per (plan, bucket). `capture(plan, bucket) -> CapturedPass` is injected (the
    CUDA capture on a GPU; a test can give any other). `capture_plan` captures (between batches);
    `find` looks up (on the serving path: never captures). Capture is refused once the graphs hold
    `memory_cap` bytes; a capture that fails (out of memory, an operation a graph cannot hold) is
    logged once and that shape runs eager. Graphs are dropped all at once (`forget`): they share one
    memory pool, and no part of it may be freed while other graphs replay over it."""

    def __init__(self, capture: Callable | None, memory_cap: int):
        self.capture = capture
        self.memory_cap = memory_cap
        self.memory_bytes = 0
        self.captures = 0  # captures made since start (a test counts recaptures with it)
        self.replays = 0
        self.generation = 0  # counts every change to the graphs held (a capture, a drop): caches key on it
        self._cap_said = -1  # the generation whose reaching the memory cap was logged
        self._plans: dict[int, _PlanGraphs] = {}

    @property
    def enabled(self) -> bool:
        return self.capture is not None and self.memory_cap > 0

    def __len__(self) -> int:
        return sum(len(entry.graphs) for entry in self._plans.values())

    def plans(self) -> list:
        return [entry.plan for entry in self._plans.values()]

    def buckets(self, plan) -> list[Bucket]:
        entry = self._plans.get(id(plan))
        return sorted(entry.graphs, reverse=True) if entry is not None and entry.plan is plan else []

    def find(self, modules: dict[str, LoadedModule], bucket: Bucket) -> CapturedPass | None:
        """A captured pass at `bucket` whose plan runs every one of `modules` (the same heads):
        the smallest such plan; None: run eager."""
        best, best_size = None, None
        for entry in self._plans.values():
            captured = entry.graphs.get(bucket)
            if captured is not None and runs_every(entry.plan, modules):
                if best is None or len(entry.plan.modules) < best_size:
                    best, best_size = captured, len(entry.plan.modules)
        return best

    def covering(self, modules: dict[str, LoadedModule]) -> list[Bucket]:
        """The buckets some captured plan running every one of `modules` holds a graph at, largest first."""
        found = {bucket for entry in self._plans.values() if runs_every(entry.plan, modules) for bucket in entry.graphs}
        return sorted(found, reverse=True)

    def get(self, plan, bucket: Bucket) -> CapturedPass | None:
        """The plan's graph at `bucket`, captured now if need be (off the serving path only:
        warm-up, benchmarks); None: run eager."""
        if not self.enabled:
            return None
        entry = self._plans.get(id(plan))
        if entry is None or entry.plan is not plan:
            entry = self._plans[id(plan)] = _PlanGraphs(plan)
        if bucket in entry.graphs:
            return entry.graphs[bucket]
        if bucket in entry.refused:
            return None
        if self.memory_bytes >= self.memory_cap:
            if self._cap_said != self.generation:  # once per set of graphs: the passes it leaves eager are many
                self._cap_said = self.generation
                log.warning("CUDA graphs hold %.0f MiB, the cap (--graph-memory-mb %d): shape %s for tasks %s and "
                            "every shape not captured yet run eager; raise the cap to capture them",
                            self.memory_bytes / 2**20, self.memory_cap // 2**20, bucket, sorted(plan.modules))
            return None
        t0 = time.perf_counter()
        try:
            captured = self.capture(plan, bucket)
        except Exception as exc:  # noqa: BLE001  (a shape that cannot be captured still serves, eager)
            if is_device_failure(exc):
                raise  # the context is dead: not a shape to skip
            entry.refused.add(bucket)
            oom = is_out_of_memory(exc)
            reason = error_text(exc)
            del exc  # its traceback holds the failed capture's tensors
            if oom and torch.cuda.is_available():
                torch.cuda.empty_cache()
            log.warning("graph %s for tasks %s not captured, it runs eager: %s", bucket, sorted(plan.modules), reason)
            return None
        captured.deepest = plan.deepest
        entry.graphs[bucket] = captured
        self.memory_bytes += captured.memory_bytes
        self.captures += 1
        self.generation += 1
        log.debug("graph %s captured in %.0f ms (%d graphs, %.1f MiB)", bucket, 1000 * (time.perf_counter() - t0),
                  len(self), self.memory_bytes / 2**20)
        return captured

    def capture_plan(self, plan, buckets: list[Bucket], progress: Callable[[int, Bucket], None] | None = None) -> None:
        """Capture `plan` at every bucket (largest first: smaller graphs reuse the pool's blocks)."""
        for i, bucket in enumerate(sorted(buckets, reverse=True), 1):
            self.get(plan, bucket)
            if progress is not None:
                progress(i, bucket)

    def forget(self) -> None:
        """Drop every graph (module load / unload / reload: plans change, heads may be freed)."""
        self._plans.clear()
        self.memory_bytes = 0
        self.generation += 1

    def describe(self) -> dict:
        return {"graphs": len(self), "plans": len(self._plans), "memory_bytes": self.memory_bytes,
                "memory_cap_bytes": self.memory_cap}


def can_capture(settings: Settings, backbone) -> bool:
    """CUDA graphs need a cuda device, the setting on, and a backend whose pass torch can capture
    (torch; ONNX Runtime's CUDA provider runs outside torch's streams: no capture is tried)."""
    return (torch.device(settings.device).type == "cuda" and settings.cuda_graphs
            and getattr(backbone.backend, "name", "torch") == "torch")
