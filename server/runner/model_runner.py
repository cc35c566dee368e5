"""The model runner: a batch of encoded rows -> passes on the device (eager, or captured graphs
launched ahead) -> answers, with out-of-memory splits and failing heads kept to their own task
(see the package docstring)."""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from server.answers import answers, joined_answers
from server.backbone import EncodedInput, TokenBatch
from server.backbone.tokens import RowBlock, window_rows
from server.config import Settings
from server.engine import Engine
from server.metrics import observe_all
from server.modules import LoadedModule, native_part, served_task_sets, token_classes_read
from server.runner.failures import HeadFailed, OutOfMemory, error_text, is_device_failure, is_out_of_memory
from server.runner.graphs import GraphCache, LaunchedPass, can_capture, capture_cuda_graph, pack_logits, unpack_logits
from server.runner.precision import head_precision, heads_autocast
from server.runner.shapes import BatchShapes, Bucket
from server.runner.staging import StagingBuffers, StagingSet
from server.timings import Timings

log = logging.getLogger("tmod")


def to_host(flat: torch.Tensor) -> torch.Tensor:
    """One copy of an eager pass's packed logits to the host, into fresh pageable memory (the answers
    may hold views of it after the next pass); a replay's copy is queued instead (`LaunchedPass`)."""
    if flat.device.type != "cuda":
        return flat
    return flat.to("cpu")  # waits for the pass: the one sync per pass


class SortedRows(list):
    """A batch's rows as the batcher hands them (sorted by length) with `lengths`, each row's token
    count, which the batcher's entries carry: the runner never asks a row for its length."""

    def __init__(self, rows, lengths: list[int]):
        super().__init__(rows)
        self.lengths = lengths


@dataclass
class PreparedPass:
    rows: slice  # which of the batch's rows
    bucket: Bucket | None
    batch: TokenBatch  # collated on the host (in a staging set on cuda), padded to the bucket if any
    staging: StagingSet | None = None  # given back once the pass has run
    deepest: int | None = None  # the last backbone state the pass computed, once it has run
    launched: "LaunchedPass | None" = None  # already on the device's queue (`ModelRunner.launch`)


@dataclass
class PreparedBatch:
    """A batch collated into passes on the host, ready for the device (`ModelRunner.prepare`)."""

    rows: list[EncodedInput]
    passes: list[PreparedPass]
    lengths: list[int]  # each row's token count (from `SortedRows`, else asked of each row once)


def use_device(device: torch.device) -> None:
    """Make `device` the calling thread's current cuda device, and let fp32 matrix products use
    TF32 (fp32 heads and an fp32 backbone on a GPU: ~8x the fp32 rate on an H100, 10-bit mantissa
    products with fp32 accumulation). Nothing on the CPU."""
    if device.type != "cuda":
        return
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


class ModelRunner:
    """Runs batches of encoded rows for a set of modules on the engine's device (see the package
    docstring). One compute thread calls `execute` / `run` / `warm_up` / `forget_plans`; `prepare`
    (host-only) and `launch` (replays under the graph lock) may run on another thread."""

    def __init__(self, engine: Engine, settings: Settings, metrics=None,
                 capture: Callable | None = None):
        self.engine = engine
        self.settings = settings
        self.device = torch.device(engine.backbone.device)
        use_device(self.device)
        self.shapes = BatchShapes.for_settings(settings, self.device, engine.backbone.max_tokens)
        self.head_precision = head_precision(settings)
        self.staging = StagingBuffers(pin=self.device.type == "cuda")
        self._classes: tuple[dict | None, set[str]] = (None, set())  # the last modules dict prepared, its token classes
        self._costs: tuple = (None, -1, None)  # bucket_runs: the last modules dict prepared, the graphs' generation, costs
        self.staged = self.device.type == "cuda"  # inputs through staging sets (page-locked) on cuda
        # with HTTP worker processes (settings.workers > 1) the workers decode: answers leave as each
        # row's logits, and the engine process spends its CPU on passes (bench/bench_frontend.py)
        self.decode_here = settings.workers == 1
        if capture is None and can_capture(settings, engine.backbone):
            self._pool = torch.cuda.graph_pool_handle()  # one pool for every capture of a module set

            def capture(plan, bucket):
                # replays timed only where bucket_runs weighs passes by them (3 replays a graph at start-up)
                return capture_cuda_graph(engine, plan, bucket, self.precision, self._pool,
                                          timed=self.shapes.mode == "bucket_runs")
        self.graphs = GraphCache(capture, settings.graph_memory_mb * 2**20)
        # graphs are replayed from the tokenizer thread that prepared a batch (`launch`) and from the
        # compute thread, and captured and dropped on the compute thread: one thread at a time
        self._graph_lock = threading.Lock()
        self._eager_said: set[tuple] = set()  # (bucket, tasks) of passes told to have run eager, once each
        self.metrics = metrics
        if metrics is not None:
            from prometheus_client import Counter, Gauge

            r = metrics.registry
            self._graph_count = Gauge("tmod_cuda_graphs", "Captured CUDA graphs (plan x bucket shape)", registry=r,
                                      multiprocess_mode="livemax")
            self._graph_memory = Gauge("tmod_cuda_graph_memory_bytes", "GPU memory held by captured graphs",
                                       registry=r, multiprocess_mode="livemax")
            # the counters `_count` adds to, by name
            oom = Counter("tmod_out_of_memory", "Passes that ran out of memory, by what followed", ["outcome"],
                          registry=r)
            self._counted = {f"out_of_memory_{outcome}": oom.labels(outcome) for outcome in ("split", "refused")}
            # how passes ran, to read a GPU run by: launched ahead or not, inputs page-locked or not
            passes = Counter("tmod_passes", "Device passes by how they ran: graph_ahead (a captured graph queued "
                             "by the thread that prepared its batch), graph (queued by the compute thread), eager",
                             ["path"], registry=r)
            self._counted.update({path: passes.labels(path) for path in ("graph_ahead", "graph", "eager")})
            self._counted["pageable"] = Counter(
                "tmod_pageable_passes", "Passes padded to a bucket whose inputs stayed in pageable memory (no "
                "page-locked set free, or the halves of a pass split for memory): on cuda their copy in waits for "
                "the device", registry=r)

    # ---- precision ------------------------------------------------------------------------------
    def precision(self) -> contextlib.AbstractContextManager:
        """Heads (and the whole pass) under autocast in the head precision, else nothing. The torch
        backend's own 16-bit layers run under the same dtype, so the backbone is unchanged."""
        return heads_autocast(self.head_precision, self.device.type, self.settings.precision)

    # ---- plans and graphs (compute thread, between batches) -------------------------------------
    def reachable_buckets(self) -> list[Bucket]:
        max_row_tokens = min(self.settings.max_tokens or self.engine.backbone.max_tokens,
                             self.engine.backbone.max_tokens)
        return self.shapes.reachable(self.settings.max_batch_tokens, self.settings.max_inputs, max_row_tokens)

    def forget_plans(self) -> None:
        """After a module load, unload or reload: plans and their graphs are dropped (`warm_up`
        captures anew for the new module set)."""
        self.engine.forget_plans()
        with self._graph_lock:
            self.graphs.forget()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()  # the dropped graphs' pool goes back to the driver: later captures measure theirs
                if hasattr(self, "_pool"):
                    # a fresh pool: capturing into the released one trips the caching allocator's
                    # use-count assertion (seen on an H100, torch 2.11), and every later shape ran eager
                    self._pool = torch.cuda.graph_pool_handle()
        self._observe_graphs()

    def warm_up(self, modules: dict[str, LoadedModule]) -> None:
        """Between batches (start-up, every module change): staging sets for every reachable bucket
        and, with graphs, the native part of every task set a request naming no tasks runs
        (`served_task_sets`) captured at every reachable bucket, with progress in the log."""
        if not modules or not self.shapes.bucketed:
            return
        buckets = self.reachable_buckets()
        if self.staged:
            self.staging.allocate(buckets, self.engine.backbone.text.uses_token_types, token_classes_read(modules))
        if not self.graphs.enabled:
            return
        t0 = time.perf_counter()
        with torch.inference_mode(), self._graph_lock:
            for task_set in served_task_sets(modules):
                native = native_part(task_set)
                if not native:
                    continue
                plan = self.engine.plan(native)

                def progress(i, bucket, tasks=sorted(native)):
                    if i == 1 or i == len(buckets) or i % 10 == 0:
                        log.info("CUDA graphs: %d/%d buckets for %s (last %s), %.1f MiB, %.1fs", i, len(buckets),
                                 tasks, bucket, self.graphs.memory_bytes / 2**20, time.perf_counter() - t0)
                self.graphs.capture_plan(plan, buckets, progress)
        self._observe_graphs()
        log.info("CUDA graphs ready: %s", self.graphs.describe())

    def _observe_graphs(self) -> None:
        if self.metrics is not None:
            self._graph_count.set(len(self.graphs))
            self._graph_memory.set(self.graphs.memory_bytes)

    # ---- host side ------------------------------------------------------------------------------
    def prepare(self, rows: list[EncodedInput], modules: dict[str, LoadedModule], staged: bool = True
                ) -> PreparedBatch:
        """Cut rows (sorted by length) into passes and collate each on the host (host work only:
        safe on another thread while the device runs the previous batch); on cuda, into a free
        staging set of its bucket."""
        cached = self._classes  # one tuple, swapped whole: prepare may run on a tokenizer thread
        if cached[0] is modules:
            classes = cached[1]
        else:
            classes = token_classes_read(modules)
            self._classes = (modules, classes)
        if type(rows) is RowBlock:  # a worker's rows, as arrays
            lengths = rows.lengths.tolist()
        else:
            lengths = rows.lengths if type(rows) is SortedRows else [len(row) for row in rows]
        passes = []
        cost = self._pass_costs(modules) if self.shapes.mode == "bucket_runs" else None
        for run, bucket in self.shapes.passes(lengths, cost):
            batch = self.engine.backbone.text.collate(
                rows[run], shape=(bucket.size, bucket.seq_len) if bucket else None, device="cpu", classes=classes,
                lengths=lengths[run])
            taken = self.staging.take(batch, bucket) if staged and self.staged and bucket is not None else None
            passes.append(PreparedPass(run, bucket, *taken) if taken else PreparedPass(run, bucket, batch))
        return PreparedBatch(rows, passes, lengths)

    def _pass_costs(self, modules: dict[str, LoadedModule]) -> Callable[[Bucket], float | None] | None:
        """bucket_runs: each bucket's pass time for `modules`, measured when its graph was captured
        (None: no graph; None for all with a foreign task: such passes are not launched whole). Made
        once per modules dict and graph change (prepare runs on a tokenizer thread: one tuple, swapped whole)."""
        cached = self._costs
        if cached[0] is modules and cached[1] == self.graphs.generation:
            return cached[2]
        table = None
        with self._graph_lock:
            generation = self.graphs.generation
            if not any(m.bridge for m in modules.values()):
                found = ((bucket, self.graphs.find(modules, bucket)) for bucket in self.reachable_buckets())
                table = {bucket: captured.seconds for bucket, captured in found
                         if captured is not None and captured.seconds is not None}.get
        self._costs = (modules, generation, table)
        return table

    @torch.inference_mode()
    def launch(self, prepared: PreparedBatch, modules: dict[str, LoadedModule]) -> PreparedBatch:
        """Queue on the device now each pass a captured graph runs whole, from the thread that
        prepared the batch (a tokenizer thread), so that the device has the next pass before the
        compute thread has answered the last: that thread only waits for it (`execute`). Measured
        why: on an H200 one batch followed another every 6.9 ms against a pass of 3.9 when the compute
        thread launched each pass only after answering the one before (docs/gpu.md). A pass that
        cannot be launched so (no graph, a foreign task, an error) runs in `execute` as before."""
        if not self.graphs.enabled or any(m.bridge for m in modules.values()):
            return prepared
        for item in prepared.passes:
            if item.bucket is None:
                continue
            try:
                item.launched = self._enqueue(modules, item.bucket, item.batch)
            except Exception:  # noqa: BLE001 - the compute thread runs it, and meets the error its own way
                log.warning("a pass could not be launched ahead; it runs on the compute thread", exc_info=True)
        return prepared

    def _enqueue(self, modules: dict[str, LoadedModule], bucket: Bucket, batch: TokenBatch) -> "LaunchedPass | None":
        """The pass of a captured graph running every one of `modules` at `bucket`, queued on the
        device under the graph lock; None: no such graph (the pass runs eager)."""
        with self._graph_lock:
            captured = self.graphs.find(modules, bucket)
            return LaunchedPass.enqueue(captured, batch) if captured is not None else None

    # ---- device side ----------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, rows: list[EncodedInput], modules: dict[str, LoadedModule], timings: Timings | None = None
            ) -> dict[str, list]:
        return self.execute(self.prepare(rows, modules), modules, timings or Timings())

    @torch.inference_mode()
    def execute(self, prepared: PreparedBatch, modules: dict[str, LoadedModule], timings: Timings
                ) -> dict[str, list]:
        """Answers per task in row order. A row refused for memory holds an `OutOfMemory` in place
        of its answer (for every task); every other row is answered."""
        try:
            outputs = self._execute(prepared, modules, timings)
        finally:
            for item in prepared.passes:
                self.staging.give_back(item.staging)
                item.staging = None
        if self.metrics is not None:  # observe_all: a bisect, where Histogram.observe scans every bucket in Python
            m = self.metrics
            observe_all(m.batch_size, [item.batch.real_rows for item in prepared.passes])
            observe_all(m.batch_tokens, [item.batch.size * item.batch.seq_len for item in prepared.passes])
            # a pass split for memory ran as halves: their plan's depth
            observe_all(m.backbone_layers, [self.engine.plan(modules).deepest if item.deepest is None else item.deepest
                                            for item in prepared.passes])
        return outputs

    def _execute(self, prepared: PreparedBatch, modules: dict[str, LoadedModule], timings: Timings
                 ) -> dict[str, list]:
        # a worker's row logits stay arrays (RowLogits) over every pass of the batch: its answer frame
        # gathers them with numpy (a list of each row's view cost ~0.5 ms a pass, bench_engine_load.py)
        return joined_answers([self._answer(item, prepared.rows[item.rows], prepared.lengths[item.rows], modules,
                                            timings) for item in prepared.passes])

    def _answer(self, item: PreparedPass, rows: list[EncodedInput], lengths: list[int], modules, timings
                ) -> dict[str, list]:
        failure = broken = None
        try:
            logits, batches = self._pass(item, rows, modules, timings)
            # windows keep their logits only where rows are decoded (a worker decodes from logits anyway)
            return answers(modules, logits, batches, lengths, self.decode_here,
                           window_rows(rows) if self.decode_here else (), rows)
        except Exception as exc:
            if is_device_failure(exc):  # the whole device is gone: the runtime stops (not one head's fault)
                raise
            # only the text is kept: the exception's traceback holds the failed pass's frames, and
            # through them its states, which the retry needs the memory of
            if is_out_of_memory(exc):
                failure = error_text(exc)
            else:
                log.warning("a pass for tasks %s failed", sorted(modules), exc_info=True)
                broken = error_text(exc)
        if broken is not None:
            return self._answer_apart(item, rows, lengths, modules, timings, broken)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if len(rows) == 1:
            log.warning("refused: an input of %d tokens does not fit in %s memory alone", lengths[0], self.device)
            self._count("out_of_memory_refused")
            refusal = OutOfMemory(lengths[0], self.device, failure)
            return {task: [refusal] for task in modules}
        self._count("out_of_memory_split")
        half = len(rows) // 2
        log.warning("out of memory on a pass of %d rows (%s); retrying as two halves", len(rows), failure)
        # pageable inputs: this batch's staging set is still taken, the other may be the next batch's
        return joined_answers([self._execute(self.prepare(part, modules, staged=False), modules, timings)
                               for part in (rows[:half], rows[half:])])

    def _answer_apart(self, item: PreparedPass, rows: list[EncodedInput], lengths: list[int], modules, timings,
                      error: str) -> dict[str, list]:
        """A pass that raised (not for memory): a failing head fails its own task's answers, never
        another task's. Each task runs again in a pass of its own; a task whose pass raises too is
        answered 500 (`HeadFailed`) for these rows, the others as usual."""
        if len(modules) == 1:
            (task, module), = modules.items()
            log.error("task %s/%s failed a pass of %d rows: %s", task, module.version, len(rows), error)
            return {task: [HeadFailed(task, error)] * len(rows)}
        log.warning("a pass for tasks %s failed (%s); running each task alone", sorted(modules), error)
        outputs = {}
        for task, module in modules.items():
            outputs.update(self._answer(item, rows, lengths, {task: module}, timings))
        return outputs

    def _pass(self, item: PreparedPass, rows: list[EncodedInput], modules: dict[str, LoadedModule],
              timings: Timings) -> tuple[dict[str, torch.Tensor], dict[str, TokenBatch]]:
        """One pass on the serving path (never captures): the native tasks from a captured graph
        when one covers them, the rest eager; foreign tasks beside a bucket-padded batch on the
        rows collated unpadded (a bridge tokenizes each real row for its target)."""
        rest = modules
        host, batches, deepest = {}, {}, 0
        launched, item.launched = item.launched, None  # waited for once: a retry (`_answer_apart`) replays anew
        path = "graph_ahead"
        if item.bucket is not None:
            if self.staged and item.staging is None:
                self._count("pageable")
            native = native_part(modules)
            if launched is None and native:
                launched, path = self._enqueue(native, item.bucket, item.batch), "graph"
            if launched is not None:
                self._count(path)
                host, batches = self._replay(launched, item.batch, native, timings)
                rest = {task: m for task, m in modules.items() if task not in native}
                deepest = launched.captured.deepest or 0
        if rest:
            batch = item.batch
            if item.bucket is not None and len(native_part(rest)) < len(rest):
                batch = self.engine.backbone.text.collate(rows, device="cpu", classes=token_classes_read(rest))
            self._count("eager")
            self._say_eager(item, native_part(rest), len(rows) if rows is not None else item.batch.real_rows)
            more_host, more_batches, eager_deepest = self._eager(batch, rest, timings)
            host.update(more_host)
            batches.update(more_batches)
            deepest = max(deepest, eager_deepest)
        item.deepest = deepest
        return host, batches

    def _say_eager(self, item: PreparedPass, native: dict[str, LoadedModule], rows: int) -> None:
        """Once per shape and task set: why native tasks ran eager where graphs are captured (on
        the H200s of 2026-11-28 to 11-30 a third to a half of one-text passes did, unexplained)."""
        if not self.graphs.enabled or not native:
            return
        key = (item.bucket, frozenset(native))
        if key in self._eager_said:
            return
        self._eager_said.add(key)
        if item.bucket is None:
            why = f"{rows} rows of up to {item.batch.seq_len} tokens fit no bucket"
        else:
            reachable = item.bucket in self.reachable_buckets()
            why = (f"no captured graph at {item.bucket} covers these tasks ({'a' if reachable else 'not a'} "
                   f"reachable bucket; {len(self.graphs)} graphs held, {self.graphs.memory_bytes / 2**20:.0f} of "
                   f"{self.graphs.memory_cap / 2**20:.0f} MiB; captured for them: "
                   f"{[str(b) for b in self.graphs.covering(native)] or 'none'})")
        log.warning("a pass of %d rows for tasks %s ran eager: %s", rows, sorted(native), why)

    def _replay(self, launched: LaunchedPass, batch: TokenBatch, tasks, timings: Timings):
        real = batch.real()
        flat, seconds = launched.wait()
        host = unpack_logits(flat, launched.captured.layout, real.size, tasks)
        timings.backbone += seconds  # a replay: the whole pass (heads included)
        self.graphs.replays += 1
        return host, {task: real for task in tasks}

    def _eager(self, batch: TokenBatch, modules: dict[str, LoadedModule], timings: Timings):
        real = batch.real()
        plan = self.engine.plan(modules)
        device_batch = replace(batch).to(self.device, non_blocking=self.staged)  # the host batch stays as it is
        with self.precision():
            out, batches = self.engine.run_plan(plan, device_batch, timings)
        start = time.perf_counter()
        flat, layout = pack_logits(out)
        host = unpack_logits(to_host(flat), layout, real.size)
        timings.backbone += time.perf_counter() - start
        return host, {task: real if b is device_batch else b for task, b in batches.items()}, plan.deepest

    @torch.inference_mode()
    def logits(self, batch: TokenBatch, bucket: Bucket | None, modules: dict[str, LoadedModule],
               timings: Timings) -> tuple[dict[str, torch.Tensor], dict[str, TokenBatch]]:
        """One pass outside serving (benchmarks, tests): host logits per task (filler rows dropped)
        and the batch each is laid out on. Unlike the serving path it captures the plan's graph at
        `bucket` first if it has none."""
        if bucket is not None and not any(m.bridge for m in modules.values()):
            with self._graph_lock:
                self.graphs.get(self.engine.plan(modules), bucket)
            self._observe_graphs()
        rows = None  # a foreign task beside a bucket re-collates from rows: only the serving path has them
        if bucket is not None and any(m.bridge for m in modules.values()):
            bucket = None
        return self._pass(PreparedPass(slice(0, batch.real_rows), bucket, batch), rows, modules, timings)

    def _count(self, what: str) -> None:
        """A pass by how it ran (graph_ahead, graph, eager), one whose inputs were pageable, or one
        that ran out of memory (out_of_memory_split, out_of_memory_refused)."""
        if self.metrics is not None:
            self._counted[what].inc()
