"""The model runner: how a batch of encoded rows becomes passes on the device, and answers.

engine -> runner -> graphs, in the manner of vLLM's model runner. The engine (server/engine.py)
knows how one pass of a plan runs; the runner decides the passes a batch needs and how each runs:

- **Batch shapes** (`BatchShapes`, the one place where a CPU and a GPU differ). On a CPU compute
  scales with padded tokens, so rows (sorted by length) are cut into length runs, one pass each
  (`length_runs`). On a GPU a small pass costs its kernel launches, not its padding, so a batch is
  one pass with its rows padded up to a bucket length and the batch up to a bucket size, filler rows
  added (each sees one token; their outputs are dropped). Both lists of bucket sizes come from
  the settings, bounded by `max_batch_size` and the backbone's token limit; the token budget
  (`max_batch_tokens`) picks the buckets captured at start.
- **Graphs** (`GraphCache`, `capture_cuda_graph`). On a cuda device the whole pass of a plan
  (backbone stream, every head, group and bridge it runs) at one bucket shape is captured once as a
  CUDA graph and replayed: inputs are copied into the graph's static input tensors, the replay
  writes every logit of the pass into one static output. Graphs belong to their plan: the cache is
  keyed by the plan object (and holds it, so its heads stay alive while a graph may read them) and
  is emptied by `forget_plans`, which every module load, unload and reload calls, so a replay never
  serves a stale head. All graphs share one memory pool (captured largest first, so smaller ones
  reuse its blocks; replays run one at a time on the compute thread and each output is copied out
  before the next replay, which is what makes sharing safe). Capture stops at `graph_memory_mb`.
  Plans with foreign modules (a bridge tokenizes for its target inside the pass) and shapes outside
  the buckets run eager.
- **Host and device**: batches are collated on the host into pinned memory (`prepare`, which the
  batcher can run on another thread while the device runs the previous batch) and copied
  non-blocking; all logits of a pass come back in one device-to-host copy (`pack_logits`); nothing
  in the pass reads a device value on the host (per-token classes, casing and segment, are made at collate time).
- **Out of memory is an answer**: a pass that does not fit (torch.OutOfMemoryError, or the CPU
  allocator's error) is split in halves and retried down to one row; a row that does not fit alone
  is refused with 503 (`OutOfMemory`), and every other row is still answered.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from server.backbone import EncodedInput, TokenBatch
from server.config import Settings, parse_sizes
from server.engine import Engine, Timings, decode_all
from server.errors import ApiError
from server.modules import LoadedModule

log = logging.getLogger("tmod")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# 16-bit head precisions that passed the accuracy rule (>= 99% labels equal to fp32, metric change
# < 0.3 points) on every shipped module of both tiers: `bench/bench_runner.py heads --emulate-fp16`,
# bench/results/head-precision-cpu.json and head-precision-cpu-mpnet.json (fp16 computed on the CPU)
HEAD_PRECISIONS_WITHIN_RULE = ("bf16", "fp16")
MAX_GRAPH_PLANS = 8  # plans whose graphs are kept (least recently used dropped first)


class OutOfMemory(ApiError):
    """A row that does not fit in device memory even in a pass of its own (503)."""

    def __init__(self, tokens: int, device: torch.device, cause: BaseException):
        super().__init__(503, "out_of_memory",
                         f"an input of {tokens} tokens does not fit in {device} memory even in a pass of its own "
                         f"({type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else 'no detail'}); "
                         "send a shorter input, or ask for truncation with a lower token limit")


class HeadFailed(ApiError):
    """A task's head raised during a pass: its answers for the pass's rows (500); the other tasks
    of the batch are answered."""

    def __init__(self, task: str, cause: BaseException):
        super().__init__(500, "head_failed", f"task {task!r} failed on this input: {type(cause).__name__}: "
                                             f"{str(cause)[:200]}", task=task)


def is_out_of_memory(exc: BaseException) -> bool:
    """A failed allocation: CUDA's OutOfMemoryError, Python's MemoryError, or the CPU allocator's
    RuntimeError ("DefaultCPUAllocator: can't allocate memory")."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def length_runs(lengths: list[int], max_padding_ratio: float) -> list[slice]:
    """Cut ascending `lengths` into consecutive runs with rows x longest <= ratio x real tokens."""
    runs, start, real = [], 0, 0
    for i, length in enumerate(lengths):
        if i > start and (i - start + 1) * length > max_padding_ratio * (real + length):
            runs.append(slice(start, i))
            start, real = i, 0
        real += length
    if lengths:
        runs.append(slice(start, len(lengths)))
    return runs


# ---- batch shapes --------------------------------------------------------------------------------
@dataclass(frozen=True, order=True)
class Bucket:
    size: int  # rows
    seq_len: int  # tokens per row

    def __str__(self) -> str:
        return f"{self.size}x{self.seq_len}"


def bounded(sizes: list[int], limit: int, hard: bool = False) -> list[int]:
    """The sizes under `limit`, then the smallest one covering it (or the limit itself; always the
    limit itself when it is `hard`: no row is longer than the backbone's token limit, and its
    position table ends there)."""
    under = [s for s in sizes if s < limit]
    return under + [limit if hard else next((s for s in sizes if s >= limit), limit)]


class BatchShapes:
    """Rows (sorted by length) -> passes: [(rows slice, bucket or None)]. "length_runs": runs within
    `max_padding_ratio`, no bucket; "buckets": one pass per `batch_sizes[-1]` rows, each padded to
    the smallest bucket covering it (None if its longest row is over every bucket length)."""

    def __init__(self, mode: str, batch_sizes: list[int], seq_lens: list[int], max_padding_ratio: float = 1.25):
        if mode not in ("length_runs", "buckets"):
            raise ValueError(f"unknown batch shape mode {mode!r}")
        self.mode = mode
        self.batch_sizes, self.seq_lens = sorted(batch_sizes), sorted(seq_lens)
        self.max_padding_ratio = max_padding_ratio

    @classmethod
    def for_settings(cls, settings: Settings, device: torch.device, max_tokens: int) -> "BatchShapes":
        mode = settings.batch_shapes
        if mode == "auto":
            mode = "buckets" if device.type == "cuda" else "length_runs"
        return cls(mode, bounded(parse_sizes(settings.graph_batch_sizes), settings.max_batch_size),
                   bounded(parse_sizes(settings.graph_seq_lens), max_tokens, hard=True), settings.max_padding_ratio)

    def bucket(self, rows: int, longest: int) -> Bucket | None:
        size = next((s for s in self.batch_sizes if s >= rows), None)
        seq_len = next((n for n in self.seq_lens if n >= longest), None)
        return None if size is None or seq_len is None else Bucket(size, seq_len)

    def passes(self, lengths: list[int]) -> list[tuple[slice, Bucket | None]]:
        if self.mode == "length_runs":
            return [(run, None) for run in length_runs(lengths, self.max_padding_ratio)]
        out, step = [], self.batch_sizes[-1]
        for start in range(0, len(lengths), step):
            run = slice(start, min(start + step, len(lengths)))
            out.append((run, self.bucket(run.stop - run.start, max(lengths[run]))))
        return out

    def common(self, max_batch_tokens: int) -> list[Bucket]:
        """The buckets a batch within the token budget can need, largest first (captured at start)."""
        buckets = [Bucket(s, n) for s in self.batch_sizes for n in self.seq_lens if s * n <= max_batch_tokens]
        return sorted(buckets, reverse=True)


# ---- one pass's logits, packed for one copy --------------------------------------------------------
def pack_logits(logits: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[tuple[str, tuple[int, ...]]]]:
    """Every task's logits as one flat float32 tensor (one device-to-host copy) and its layout."""
    layout = [(task, tuple(value.shape)) for task, value in logits.items()]
    return torch.cat([value.float().reshape(-1) for value in logits.values()]), layout


def unpack_logits(flat: torch.Tensor, layout, rows: int) -> dict[str, torch.Tensor]:
    """Views of `flat` per task, the first `rows` rows of each (filler rows dropped)."""
    out, offset = {}, 0
    for task, shape in layout:
        count = 1
        for n in shape:
            count *= n
        out[task] = flat[offset:offset + count].view(shape)[:rows]
        offset += count
    return out


def row_logits(modules: dict[str, LoadedModule], logits: dict[str, torch.Tensor], batches: dict[str, TokenBatch],
               lengths: list[int]) -> dict[str, list]:
    """Per task, each row's host logits as a numpy array ((tokens, labels) over its own tokens for
    token tasks, (labels,) otherwise), for a frontend process to decode (`decode_rows`). A foreign
    task's logits lie on its bridge's tokenization, which only this process has: decoded here."""
    out = {}
    for task, module in modules.items():
        if module.bridge:
            out[task] = decode_all({task: module}, logits, batches)[task]
        elif logits[task].dim() == 3:
            host = logits[task].numpy()
            out[task] = [host[r, :n] for r, n in enumerate(lengths)]
        else:
            out[task] = list(logits[task].numpy())
    return out


def to_host(flat: torch.Tensor) -> torch.Tensor:
    """One copy of a pass's packed logits to the host (pinned, asynchronous, then one wait)."""
    if flat.device.type != "cuda":
        return flat
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    torch.cuda.current_stream(flat.device).synchronize()
    return host


# ---- graphs ---------------------------------------------------------------------------------------
@dataclass
class CapturedPass:
    """A plan's pass at one bucket shape: its static inputs, and `replay` that runs the pass on
    whatever they hold and returns the packed logits (a static output, valid until the next replay)."""

    inputs: TokenBatch  # static: what a batch is copied into
    replay: Callable[[], torch.Tensor]
    layout: list
    memory_bytes: int = 0
    graph: object = None  # the torch.cuda.CUDAGraph (kept alive with its pool blocks)

    def __call__(self, batch: TokenBatch) -> torch.Tensor:
        if tuple(batch.input_ids.shape) != tuple(self.inputs.input_ids.shape):
            raise ValueError(f"batch shape {tuple(batch.input_ids.shape)} is not the captured "
                             f"{tuple(self.inputs.input_ids.shape)}")
        self.inputs.input_ids.copy_(batch.input_ids, non_blocking=True)
        self.inputs.attention_mask.copy_(batch.attention_mask, non_blocking=True)
        if self.inputs.token_type_ids is not None:
            self.inputs.token_type_ids.copy_(batch.token_type_ids, non_blocking=True)
        for name, static in self.inputs.classes.items():
            static.copy_(batch.token_classes(name), non_blocking=True)
        return self.replay()


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


def token_classes_read(modules: dict[str, LoadedModule]) -> set[str]:
    """The per-token classes the native heads of these modules read (casing, segment): made at
    collate time, and static inputs of a captured pass."""
    return {name for m in modules.values() if m.bridge is None for name in m.head.token_classes_read()}


def capture_cuda_graph(engine: Engine, modules: dict[str, LoadedModule], bucket: Bucket,
                       precision: Callable[[], contextlib.AbstractContextManager], pool) -> CapturedPass:
    """Capture `modules`' whole pass at `bucket` as one CUDA graph (warm-up on a side stream first,
    as torch.cuda.graph asks: lazy initialisation and autotuning must not happen inside capture)."""
    device = engine.backbone.device
    inputs = static_batch(bucket, device, engine.backbone.text.uses_token_types, token_classes_read(modules))

    def run() -> tuple[torch.Tensor, list]:
        with precision():
            logits, _ = engine.run(inputs, modules)
        return pack_logits(logits)

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_reserved(device)  # the pool's growth is what the graph holds
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output, layout = run()
    torch.cuda.synchronize(device)

    def replay() -> torch.Tensor:
        graph.replay()
        return output

    return CapturedPass(inputs, replay, layout, torch.cuda.memory_reserved(device) - before, graph)


@dataclass
class _PlanGraphs:
    plan: object  # the ExecutionPlan: held so its heads outlive the graphs that read them
    graphs: dict = field(default_factory=dict)  # Bucket -> CapturedPass
    refused: set = field(default_factory=set)  # buckets whose capture failed: they run eager


class GraphCache:
    """Captured passes keyed by (plan, bucket). `capture(modules, bucket) -> CapturedPass` is
    injected (the CUDA capture on a GPU; a test can give any other). Capture is refused once the
    graphs hold `memory_cap` bytes; a capture that fails (out of memory, an operation a graph cannot
    hold) is logged once and that shape runs eager."""

    def __init__(self, capture: Callable[[dict, Bucket], CapturedPass] | None, memory_cap: int,
                 max_plans: int = MAX_GRAPH_PLANS):
        self.capture = capture
        self.memory_cap = memory_cap
        self.max_plans = max_plans
        self.memory_bytes = 0
        self.captures = 0  # captures made since start (a test counts recaptures with it)
        self._plans: OrderedDict[int, _PlanGraphs] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.capture is not None and self.memory_cap > 0

    def __len__(self) -> int:
        return sum(len(entry.graphs) for entry in self._plans.values())

    def get(self, plan, bucket: Bucket) -> CapturedPass | None:
        """The plan's graph at `bucket`, captured now if need be; None: run eager."""
        if not self.enabled:
            return None
        entry = self._plans.get(id(plan))
        if entry is None or entry.plan is not plan:
            entry = self._plans[id(plan)] = _PlanGraphs(plan)
            while len(self._plans) > self.max_plans:
                self._drop(self._plans.popitem(last=False)[1])
        self._plans.move_to_end(id(plan))
        if bucket in entry.graphs:
            return entry.graphs[bucket]
        if bucket in entry.refused or self.memory_bytes >= self.memory_cap:
            return None
        t0 = time.perf_counter()
        try:
            captured = self.capture(plan.modules, bucket)
        except Exception as exc:  # noqa: BLE001  (a shape that cannot be captured still serves, eager)
            entry.refused.add(bucket)
            if is_out_of_memory(exc) and torch.cuda.is_available():
                torch.cuda.empty_cache()
            log.warning("graph %s for tasks %s not captured, it runs eager: %s: %s", bucket,
                        sorted(plan.modules), type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return None
        entry.graphs[bucket] = captured
        self.memory_bytes += captured.memory_bytes
        self.captures += 1
        log.debug("graph %s captured in %.0f ms (%d graphs, %.1f MiB)", bucket, 1000 * (time.perf_counter() - t0),
                  len(self), self.memory_bytes / 2**20)
        return captured

    def _drop(self, entry: _PlanGraphs) -> None:
        self.memory_bytes -= sum(g.memory_bytes for g in entry.graphs.values())

    def forget(self) -> None:
        """Drop every graph (module load / unload / reload: plans change, heads may be freed)."""
        self._plans.clear()
        self.memory_bytes = 0

    def describe(self) -> dict:
        return {"graphs": len(self), "plans": len(self._plans), "memory_bytes": self.memory_bytes,
                "memory_cap_bytes": self.memory_cap}


# ---- the runner -----------------------------------------------------------------------------------
@dataclass
class PreparedPass:
    rows: slice  # which of the batch's rows
    bucket: Bucket | None
    batch: TokenBatch  # collated on the host (pinned on cuda), padded to the bucket if any


@dataclass
class PreparedBatch:
    """A batch collated into passes on the host, ready for the device (`ModelRunner.prepare`)."""

    rows: list[EncodedInput]
    passes: list[PreparedPass]


def head_precision(settings: Settings) -> str:
    """What `head_precision` means here: auto -> the backbone's 16-bit precision where it passed the
    accuracy rule (on a CPU that is bf16, which `precision` auto picks where bfloat16 is native),
    fp32 otherwise. On the CPU, bf16 heads run 16 grouped heads in 0.4x fp32 heads' time
    (bench/results/sharing-cpu-bf16.md)."""
    if settings.head_precision != "auto":
        return settings.head_precision
    if settings.precision in HEAD_PRECISIONS_WITHIN_RULE:
        return settings.precision
    return "fp32"


def heads_autocast(precision: str, device_type: str, backbone_precision: str = "fp32") -> contextlib.AbstractContextManager:
    """The context a pass runs in for heads of `precision`: autocast to that 16-bit dtype, or nothing
    for fp32. int8 heads compute their projections in int8 whatever the context (the engine's
    `int8`) and the rest in the backbone's precision: beside a bf16 backbone, 16 heads' classifiers
    in bf16 left 0.74x the backbone's throughput, in fp32 0.67x (scratch measurement, one thread)."""
    if precision == "int8":
        precision = backbone_precision if backbone_precision in DTYPES else "fp32"
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=DTYPES[precision], cache_enabled=False)


class ModelRunner:
    """Runs batches of encoded rows for a set of modules on the engine's device (see the module
    docstring). One compute thread calls `run` / `execute`; `prepare` is host-only and may run on
    another thread."""

    def __init__(self, engine: Engine, settings: Settings, metrics=None,
                 capture: Callable[[dict, Bucket], CapturedPass] | None = None):
        self.engine = engine
        self.settings = settings
        self.device = torch.device(engine.backbone.device)
        self.shapes = BatchShapes.for_settings(settings, self.device, engine.backbone.max_tokens)
        self.head_precision = head_precision(settings)
        self.pinned = self.device.type == "cuda"
        # with HTTP worker processes (settings.workers > 1) the workers decode: answers leave as each
        # row's logits, and the engine process spends its CPU on passes (bench/bench_frontend.py)
        self.decode_here = settings.workers == 1
        if capture is None and self.device.type == "cuda" and settings.cuda_graphs:
            self._pool = torch.cuda.graph_pool_handle()  # one pool for every capture of a module set

            def capture(modules, bucket):
                return capture_cuda_graph(engine, modules, bucket, self.precision, self._pool)
        self.graphs = GraphCache(capture, settings.graph_memory_mb * 2**20)
        self.metrics = metrics
        if metrics is not None:
            from prometheus_client import Counter, Gauge

            r = metrics.registry
            self._graph_count = Gauge("tmod_cuda_graphs", "Captured CUDA graphs (plan x bucket shape)", registry=r,
                                      multiprocess_mode="livemax")
            self._graph_memory = Gauge("tmod_cuda_graph_memory_bytes", "GPU memory held by captured graphs",
                                       registry=r, multiprocess_mode="livemax")
            self._oom = Counter("tmod_out_of_memory", "Passes that ran out of memory, by what followed",
                                ["outcome"], registry=r)

    # ---- precision ------------------------------------------------------------------------------
    def precision(self) -> contextlib.AbstractContextManager:
        """Heads (and the whole pass) under autocast in the head precision, else nothing. The torch
        backend's own 16-bit layers run under the same dtype, so the backbone is unchanged."""
        return heads_autocast(self.head_precision, self.device.type, self.settings.precision)

    # ---- plans and graphs -----------------------------------------------------------------------
    def forget_plans(self) -> None:
        """After a module load, unload or reload: plans and their graphs are dropped (the next pass
        builds and captures anew; `warm_up` does it at once for the full module set)."""
        self.engine.forget_plans()
        self.graphs.forget()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the dropped graphs' pool goes back to the driver: later captures measure theirs
            if hasattr(self, "_pool"):
                # a fresh pool: capturing into the released one trips the caching allocator's
                # use-count assertion (seen on an H100, torch 2.11), and every later shape ran eager
                self._pool = torch.cuda.graph_pool_handle()
        self._observe_graphs()

    def warm_up(self, modules: dict[str, LoadedModule]) -> None:
        """Capture the common buckets (those within the token budget) of the plan for `modules`,
        largest first, with progress in the log."""
        if not self.graphs.enabled or not modules or self.shapes.mode != "buckets":
            return
        if any(m.bridge for m in modules.values()):
            log.info("CUDA graphs: tasks %s include foreign modules; their passes run eager", sorted(modules))
            return
        buckets = self.shapes.common(self.settings.max_batch_tokens)
        plan = self.engine.plan(modules)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for i, bucket in enumerate(buckets, 1):
                self.graphs.get(plan, bucket)
                if i == 1 or i == len(buckets) or i % 10 == 0:
                    log.info("CUDA graphs: %d/%d buckets for %s (last %s), %.1f MiB, %.1fs", i, len(buckets),
                             sorted(modules), bucket, self.graphs.memory_bytes / 2**20, time.perf_counter() - t0)
        self._observe_graphs()
        log.info("CUDA graphs ready: %s", self.graphs.describe())

    def _observe_graphs(self) -> None:
        if self.metrics is not None:
            self._graph_count.set(len(self.graphs))
            self._graph_memory.set(self.graphs.memory_bytes)

    # ---- host side ------------------------------------------------------------------------------
    def prepare(self, rows: list[EncodedInput], modules: dict[str, LoadedModule]) -> PreparedBatch:
        """Cut rows (sorted by length) into passes and collate each on the host (host work only:
        safe on another thread while the device runs the previous batch)."""
        foreign = any(m.bridge for m in modules.values())  # a bridge tokenizes per real row: no filler rows
        classes = token_classes_read(modules)
        passes = []
        for run, bucket in self.shapes.passes([len(row.ids) for row in rows]):
            if foreign:
                bucket = None
            batch = self.engine.backbone.text.collate(
                rows[run], shape=(bucket.size, bucket.seq_len) if bucket else None, device="cpu", classes=classes)
            passes.append(PreparedPass(run, bucket, batch.pin_memory() if self.pinned else batch))
        return PreparedBatch(rows, passes)

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
        outputs: dict[str, list] = {task: [] for task in modules}
        for item in prepared.passes:
            for task, answers in self._answer(item, prepared.rows[item.rows], modules, timings).items():
                outputs[task].extend(answers)
        return outputs

    def _answer(self, item: PreparedPass, rows: list[EncodedInput], modules, timings) -> dict[str, list]:
        try:
            logits, batches = self.logits(item.batch, item.bucket, modules, timings)
            if self.decode_here:
                return decode_all(modules, logits, batches)
            return row_logits(modules, logits, batches, [len(row) for row in rows])
        except Exception as exc:
            if not is_out_of_memory(exc):
                return self._answer_apart(item, rows, modules, timings, exc)
            cause = exc
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if len(rows) == 1:
            log.warning("refused: an input of %d tokens does not fit in %s memory alone", len(rows[0]), self.device)
            self._count_oom("refused")
            refusal = OutOfMemory(len(rows[0]), self.device, cause)
            return {task: [refusal] for task in modules}
        self._count_oom("split")
        half = len(rows) // 2
        log.warning("out of memory on a pass of %d rows (%s); retrying as two halves", len(rows),
                    type(cause).__name__)
        outputs: dict[str, list] = {task: [] for task in modules}
        for part in (rows[:half], rows[half:]):
            for task, answers in self.execute(self.prepare(part, modules), modules, timings).items():
                outputs[task].extend(answers)
        return outputs

    def _answer_apart(self, item: PreparedPass, rows: list[EncodedInput], modules, timings,
                      error: Exception) -> dict[str, list]:
        """A pass that raised (not for memory): a failing head fails its own task's answers, never
        another task's. Each task runs again in a pass of its own; a task whose pass raises too is
        answered 500 (`HeadFailed`) for these rows, the others as usual."""
        if len(modules) == 1:
            (task, module), = modules.items()
            log.error("task %s/%s failed a pass of %d rows: %s: %s", task, module.version, len(rows),
                      type(error).__name__, error, exc_info=error)
            return {task: [HeadFailed(task, error)] * len(rows)}
        log.warning("a pass for tasks %s failed (%s: %s); running each task alone", sorted(modules),
                    type(error).__name__, error)
        outputs = {}
        for task, module in modules.items():
            outputs.update(self._answer(item, rows, {task: module}, timings))
        return outputs

    @torch.inference_mode()
    def logits(self, batch: TokenBatch, bucket: Bucket | None, modules: dict[str, LoadedModule],
               timings: Timings) -> tuple[dict[str, torch.Tensor], dict[str, TokenBatch]]:
        """One pass: host logits per task (filler rows dropped) and the batch each is laid out on."""
        real = batch.real()
        plan = self.engine.plan(modules)
        captured = self.graphs.get(plan, bucket) if bucket is not None and not plan.foreign else None
        if captured is not None:
            start = time.perf_counter()
            flat, layout = captured(batch), captured.layout
            batches = {task: real for task in modules}
            self._observe_graphs()
        else:
            batch = replace(batch).to(self.device, non_blocking=self.pinned)  # the host batch stays as it is
            with self.precision():
                out, batches = self.engine.run(batch, modules, timings)
            start = time.perf_counter()
            flat, layout = pack_logits(out)
            batches = {task: real if b is batch else b for task, b in batches.items()}
        host = unpack_logits(to_host(flat), layout, real.size)
        timings.backbone += time.perf_counter() - start  # a replay: the whole pass (heads included)
        return host, batches

    def _count_oom(self, outcome: str) -> None:
        if self.metrics is not None:
            self._oom.labels(outcome).inc()
