"""The model runner: how a batch of encoded rows becomes passes on the device, and answers.

Layers call downwards only: runtime -> runner -> engine -> plan, in the manner of vLLM's engine ->
model runner -> graphs. The runtime hands the runner a batch; the runner decides the passes it
needs and how each runs, asks the engine for the plan once per pass and runs it (eager, or a
captured graph of it), and turns the logits into answers (server/answers.py, the one place that
decodes). The engine knows how one pass of a plan runs and nothing of shapes, graphs or answers.

- **Batch shapes** (`BatchShapes`, the one place where a CPU and a GPU differ). On a CPU compute
  scales with padded tokens, so rows (sorted by length) are cut into length runs, one pass each
  (`length_runs`). On a GPU a small pass costs its kernel launches, not its padding, so a batch is
  one pass with its rows padded up to a bucket length and the batch up to a bucket size, filler rows
  added (each sees one token; their outputs are dropped). Both lists of bucket sizes come from
  the settings, bounded by `max_batch_size` and the backbone's token limit; `reachable` lists every
  bucket a pass can land in (the ones captured at start). `bucket_runs` (opt-in) cuts a GPU batch
  into runs of rows, each padded to its own bucket, where the captured passes' times, measured at
  capture, say the runs cost less than the one pass (a batch of short rows and one long one).
- **Graphs** (`GraphCache`, `capture_cuda_graph`). On a cuda device the whole pass of a plan
  (backbone stream, every native head and group) at one bucket shape is captured once as a CUDA
  graph and replayed: inputs are copied into the graph's static input tensors, the replay writes
  every logit of the pass into one static output. Graphs are captured only between batches, never
  on a request's path: at start and after every module load, unload and reload (`warm_up`, on the
  compute thread), for the task sets requests that name no tasks run (single texts; text pairs:
  `served_task_sets`) at every reachable bucket. A request for a subset of a captured set replays
  the smallest captured superset and drops the other tasks' outputs; anything else runs eager. A
  plan with foreign modules replays the graph of its native part; its foreign tasks (a bridge
  tokenizes for its target inside the pass) run eager on the unpadded rows. Graphs belong to their
  plan (the cache holds it, so its heads stay alive while a graph may read them) and all of them
  share one memory pool, which is only ever dropped whole (`forget_plans`, then a fresh pool): no
  graph's blocks are freed while another may still replay over them. Capture stops at
  `graph_memory_mb`, counted from the pool's own segments. Capture runs in thread-local capture
  mode (the tokenizer threads may touch CUDA meanwhile), on the device's own stream, and the
  thread's stream is restored whatever the capture does (`capture_on`).
- **Host and device**: batches are collated on the host (`prepare`, which the batcher runs on a
  tokenizer thread while the device runs the previous batch) and, on cuda, copied into page-locked
  staging buffers made at warm-up (`StagingBuffers`: two sets per bucket, one per batch in flight);
  copies to the device are non-blocking; all logits of a pass come back in one device-to-host copy
  (`pack_logits`) into page-locked memory from torch's host cache, queued behind the replay; nothing
  in the pass reads a device value on the host (per-token classes, casing and segment, are made at
  collate time). The same tokenizer thread then launches a batch's captured pass (`launch`: copy
  in, replay, copy out, an event), so the device holds the next pass while the compute thread waits
  for the last (sleeping on the event) and turns its logits into answers; graphs are replayed,
  captured and dropped under one lock, since each graph's input and output tensors are static.
- **Out of memory is an answer**: a pass that does not fit (torch.OutOfMemoryError, or the CPU
  allocator's error) is split in halves and retried down to one row, after the failed pass is gone
  (only its error's text is kept: the exception's traceback would keep its states alive); a row that
  does not fit alone is refused with 503 (`OutOfMemory`), and every other row is still answered.
- **A dead device is not an answer**: a sticky CUDA error (`is_device_failure`) leaves the context
  unusable; the runtime then stops being ready and the process exits (server/runtime.py).
- **A failing head fails its own task**: a pass that raises otherwise runs again task by task; the
  task whose head fails is answered 500 (`HeadFailed`) for its rows, every other task as usual.
- **Precision**: heads run under autocast in `head_precision` (`heads_autocast`; auto: the
  backbone's 16-bit precision; int8, CPU only and opt-in: the layer-mix projections as int8
  products), with autocast's cast cache off, since a captured pass must not keep casts.
"""
from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import math
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from server.answers import answers, joined_answers
from server.backbone import EncodedInput, TokenBatch
from server.backbone.backends.torch_backend import DTYPES  # the 16-bit precisions and their torch dtypes
from server.backbone.tokens import RowBlock, window_rows
from server.config import Settings, parse_sizes
from server.engine import Engine
from server.errors import ApiError
from server.metrics import observe_all
from server.modules import LoadedModule, compares_pairs
from server.timings import Timings

log = logging.getLogger("tmod")

# 16-bit head precisions that passed the accuracy rule (>= 99% labels equal to fp32, metric change
# < 0.3 points) on every shipped module of both tiers (bench/README.md names the command):
# bench/results/head-precision-cpu.json and head-precision-cpu-mpnet.json (fp16 computed on the CPU)
HEAD_PRECISIONS_WITHIN_RULE = ("bf16", "fp16")
STAGING_SETS = 2  # page-locked input sets per bucket: one batch running, the next one prepared


class OutOfMemory(ApiError):
    """A row that does not fit in device memory even in a pass of its own (503)."""

    def __init__(self, tokens: int, device: torch.device, cause: BaseException | str):
        super().__init__(503, "out_of_memory",
                         f"an input of {tokens} tokens does not fit in {device} memory even in a pass of its own "
                         f"({cause if isinstance(cause, str) else error_text(cause)}); "
                         "send a shorter input, or ask for truncation with a lower token limit")


class HeadFailed(ApiError):
    """A task's head raised during a pass: its answers for the pass's rows (500); the other tasks
    of the batch are answered."""

    def __init__(self, task: str, cause: str):
        super().__init__(500, "head_failed", f"task {task!r} failed on this input: {cause[:200]}", task=task)


def error_text(exc: BaseException) -> str:
    """'Type: first line' of an exception (what is kept of it once it is dropped)."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}"


def is_out_of_memory(exc: BaseException) -> bool:
    """A failed allocation: CUDA's OutOfMemoryError, Python's MemoryError, or the CPU allocator's
    RuntimeError ("DefaultCPUAllocator: can't allocate memory")."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


# CUDA errors that leave the context unusable ("sticky"): every later call in the process fails, so
# the only recovery is a new process (cudaErrorIllegalAddress, cudaErrorAssert, cudaErrorLaunchFailure,
# cudaErrorIllegalInstruction, cudaErrorMisalignedAddress, cudaErrorInvalidPc, cudaErrorHardwareStackError,
# cudaErrorECCUncorrectable, and cuBLAS's report of a kernel that failed to run)
STICKY_DEVICE_ERRORS = (
    "an illegal memory access was encountered", "device-side assert triggered", "unspecified launch failure",
    "an illegal instruction was encountered", "misaligned address", "invalid program counter",
    "hardware stack error", "uncorrectable ECC error", "CUBLAS_STATUS_EXECUTION_FAILED",
)


def is_device_failure(exc: BaseException) -> bool:
    """A sticky CUDA error (see STICKY_DEVICE_ERRORS): torch raises them as RuntimeError (or its
    subclass torch.AcceleratorError) with the CUDA runtime's message in the text."""
    if not isinstance(exc, RuntimeError) or is_out_of_memory(exc):
        return False
    text = str(exc)
    return any(marker in text for marker in STICKY_DEVICE_ERRORS)


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
    the smallest bucket covering it (None if its longest row is over every bucket length);
    "bucket_runs": as "buckets", each pass then cut into the runs of rows whose buckets cost least
    by `cost` (`cheapest_runs`)."""

    def __init__(self, mode: str, batch_sizes: list[int], seq_lens: list[int], max_padding_ratio: float = 1.25):
        if mode not in ("length_runs", "buckets", "bucket_runs"):
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

    @property
    def bucketed(self) -> bool:
        """Passes padded to buckets (captured graphs, staging sets): the GPU's modes."""
        return self.mode != "length_runs"

    def passes(self, lengths: list[int], cost: Callable[[Bucket], float | None] | None = None
               ) -> list[tuple[slice, Bucket | None]]:
        """`cost`: with "bucket_runs", a pass's time at a bucket (None: not known, the pass is not cut)."""
        if self.mode == "length_runs":
            return [(run, None) for run in length_runs(lengths, self.max_padding_ratio)]
        out, step = [], self.batch_sizes[-1]
        for start in range(0, len(lengths), step):
            run = slice(start, min(start + step, len(lengths)))
            runs = self.cheapest_runs(lengths, run, cost) if self.mode == "bucket_runs" and cost else None
            out.extend(runs or [(run, self.bucket(run.stop - run.start, max(lengths[run])))])
        return out

    def cheapest_runs(self, lengths: list[int], rows: slice, cost: Callable[[Bucket], float | None]
                      ) -> list[tuple[slice, Bucket]] | None:
        """`rows` (sorted by length) cut where a row's bucket length changes, into the runs whose
        buckets' summed `cost` is least (the whole, one run, on a tie); None where the whole's cost is
        not known. The cuts are few (one per bucket length), so every way of grouping them is tried
        (a shortest path over the cut points)."""
        whole = self.bucket(rows.stop - rows.start, lengths[rows.stop - 1])
        if whole is None or cost(whole) is None:
            return None
        cuts = [rows.start]
        for seq_len in self.seq_lens:  # the first row over each bucket length starts a group
            at = bisect.bisect_right(lengths, seq_len, rows.start, rows.stop)
            if cuts[-1] < at < rows.stop:
                cuts.append(at)
        cuts.append(rows.stop)
        best = [0.0] + [math.inf] * (len(cuts) - 1)  # best[j]: the least cost of the rows before cuts[j]
        came_from = [0] * len(cuts)
        for j in range(1, len(cuts)):
            for i in range(j):  # i = 0 first: on a tie, fewer passes
                bucket = self.bucket(cuts[j] - cuts[i], lengths[cuts[j] - 1])
                c = cost(bucket) if bucket is not None else None
                if c is not None and best[i] + c < best[j]:
                    best[j], came_from[j] = best[i] + c, i
        runs, j = [], len(cuts) - 1
        while j > 0:
            i = came_from[j]
            runs.append((slice(cuts[i], cuts[j]), self.bucket(cuts[j] - cuts[i], lengths[cuts[j] - 1])))
            j = i
        return runs[::-1]

    def reachable(self, max_batch_tokens: int, max_request_rows: int, max_row_tokens: int) -> list[Bucket]:
        """Every bucket a pass can land in, largest first (captured at start). The batcher adds a
        request to a batch while rows x longest stays within `max_batch_tokens`, but a batch's first
        request is taken whatever its size (up to `max_request_rows` rows), and no row is longer than
        `max_row_tokens`. A bucket is reachable when the smallest pass that lands in it (one row more
        than the next smaller size, one token more than the next shorter length) can be formed."""
        out, smaller_size = [], 0
        for size in self.batch_sizes:
            shorter = 0
            for seq_len in self.seq_lens:
                rows, longest = smaller_size + 1, shorter + 1
                if longest <= max_row_tokens and (rows * longest <= max_batch_tokens or rows <= max_request_rows):
                    out.append(Bucket(size, seq_len))
                shorter = seq_len
            smaller_size = size
        return sorted(out, reverse=True)


# ---- one pass's logits, packed for one copy --------------------------------------------------------
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


def to_host(flat: torch.Tensor) -> torch.Tensor:
    """One copy of an eager pass's packed logits to the host, into fresh pageable memory (the answers
    may hold views of it after the next pass); a replay's copy is queued instead (`LaunchedPass`)."""
    if flat.device.type != "cuda":
        return flat
    return flat.to("cpu")  # waits for the pass: the one sync per pass


# ---- page-locked staging for inputs ---------------------------------------------------------------
@dataclass
class StagingSet:
    """One set of host input tensors of a bucket's shape (page-locked on cuda)."""

    bucket: Bucket
    tensors: dict[str, torch.Tensor]  # input_ids, attention_mask, token_type_ids?, class:<name>
    busy: bool = False


class StagingBuffers:
    """Host input tensors per bucket, `sets` of each, made once (`allocate`, at warm-up) and reused:
    a prepared batch is copied into a free set (`take`) and the set is given back once the pass that
    reads it has run (`give_back`). With two batches in flight (one running, the next prepared) two
    sets suffice; when none is free (or the bucket or a class is not held) `take` answers None and
    the batch stays in pageable memory. Thread-safe: `take` runs on a tokenizer thread, `give_back`
    on the compute thread."""

    def __init__(self, pin: bool, sets: int = STAGING_SETS):
        self.pin, self.sets = pin, sets
        self._free: dict[Bucket, list[StagingSet]] = {}
        self._lock = threading.Lock()
        self.misses = 0  # batches left in pageable memory (no free set)

    def __len__(self) -> int:
        return sum(len(v) for v in self._free.values())

    def allocate(self, buckets: list[Bucket], token_types: bool, classes: set[str]) -> None:
        """Sets for every bucket not held yet, or held without a tensor now needed (a module that
        reads another class was loaded); sets that are fine stay. A replaced set still taken by an
        in-flight batch is only dropped when that batch gives it back."""
        names = ["input_ids", "attention_mask"] + (["token_type_ids"] if token_types else []) + \
            [f"class:{name}" for name in sorted(classes)]
        for bucket in buckets:
            held = self._free.get(bucket)
            if held and set(names) <= set(held[0].tensors):
                continue
            shape = (bucket.size, bucket.seq_len)
            made = [StagingSet(bucket, {name: torch.zeros(shape, dtype=torch.long, pin_memory=self.pin)
                                        for name in names}) for _ in range(self.sets)]
            with self._lock:
                self._free[bucket] = made

    def take(self, batch: TokenBatch, bucket: Bucket) -> tuple[TokenBatch, StagingSet] | None:
        """`batch` copied into a free set of `bucket` -> (the staged batch, its set), or None."""
        wanted = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
                  **({"token_type_ids": batch.token_type_ids} if batch.token_type_ids is not None else {}),
                  **{f"class:{name}": t for name, t in batch.classes.items()}}
        with self._lock:
            sets = self._free.get(bucket, [])
            chosen = next((s for s in sets if not s.busy and set(wanted) <= set(s.tensors)), None)
            if chosen is None:
                self.misses += 1
                return None
            chosen.busy = True
        for name, value in wanted.items():
            chosen.tensors[name].copy_(value)
        t = chosen.tensors
        staged = replace(batch, input_ids=t["input_ids"], attention_mask=t["attention_mask"],
                         token_type_ids=t.get("token_type_ids") if batch.token_type_ids is not None else None,
                         classes={name: t[f"class:{name}"] for name in batch.classes})
        return staged, chosen

    def give_back(self, staging: StagingSet | None) -> None:
        if staging is not None:
            with self._lock:
                staging.busy = False

    def clear(self) -> None:
        with self._lock:
            self._free = {}


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


def token_classes_read(modules: dict[str, LoadedModule]) -> set[str]:
    """The per-token classes the native heads of these modules read (casing, segment): made at
    collate time, and static inputs of a captured pass."""
    return {name for m in modules.values() if m.bridge is None for name in m.head.token_classes_read()}


def native_part(modules: dict[str, LoadedModule]) -> dict[str, LoadedModule]:
    """The modules that read this backbone's states themselves (not through a bridge)."""
    return {task: m for task, m in modules.items() if m.bridge is None}


def served_task_sets(modules: dict[str, LoadedModule]) -> list[dict[str, LoadedModule]]:
    """The task sets requests that name no tasks run (server/api/serving.py, `fit_to_inputs`): single texts
    get every task but the pair tasks, text pairs every task. Distinct and non-empty, pairs first."""
    single = {task: m for task, m in modules.items() if not compares_pairs(m.manifest)}
    return [s for s in ([modules, single] if len(single) < len(modules) else [modules]) if s]


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


# ---- the runner -----------------------------------------------------------------------------------
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


def head_precision(settings: Settings) -> str:
    """What `head_precision` means here: auto -> the backbone's 16-bit precision where it passed the
    accuracy rule (on a CPU that is bf16, which `precision` auto picks where bfloat16 is native;
    on cuda fp16, `precision` auto's pick there), fp32 otherwise. On the CPU, bf16 heads run 16
    grouped heads in 0.4x fp32 heads' time (bench/results/sharing-cpu-bf16.md)."""
    if settings.head_precision != "auto":
        return settings.head_precision
    if settings.precision in HEAD_PRECISIONS_WITHIN_RULE:
        return settings.precision
    return "fp32"


def heads_autocast(precision: str, device_type: str, backbone_precision: str = "fp32") -> contextlib.AbstractContextManager:
    """The context a pass runs in for heads of `precision`: autocast to that 16-bit dtype, or nothing
    for fp32. int8 heads compute their projections in int8 whatever the context (the engine's
    `int8`) and the rest in the backbone's precision: beside a bf16 backbone, 16 heads' classifiers
    in bf16 left 0.74x the backbone's throughput, in fp32 0.67x (scratch measurement, one thread).
    The autocast cache is off: a captured pass must not keep casts made at capture time."""
    if precision == "int8":
        precision = backbone_precision if backbone_precision in DTYPES else "fp32"
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=DTYPES[precision], cache_enabled=False)


def can_capture(settings: Settings, backbone) -> bool:
    """CUDA graphs need a cuda device, the setting on, and a backend whose pass torch can capture
    (torch; ONNX Runtime's CUDA provider runs outside torch's streams: no capture is tried)."""
    return (torch.device(settings.device).type == "cuda" and settings.cuda_graphs
            and getattr(backbone.backend, "name", "torch") == "torch")


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
    """Runs batches of encoded rows for a set of modules on the engine's device (see the module
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
