"""Dynamic batching: requests queue up; one backbone pass answers many of them.

A batch takes queued jobs of one input signature (single texts or text pairs) until a token
budget or a row limit is reached or `max_wait` has passed since its first job; rows are sorted by
length to cut padding; the backbone runs once for the union of the tasks its jobs asked for, and
each job gets only its own tasks back. The queue is bounded: a full queue refuses at once (429).
Jobs whose client went away or whose deadline passed are dropped before any compute.

Forming a batch costs O(tasks) per job (`Forming` keeps the module answering each task, so a job is
checked against it, not against every job already in), and the client of a job is asked whether
it is still there only once the job has waited `disconnect_check_after` (asking costs ~50 us per job
in Starlette; a job answered sooner than that is not worth the question).
"""
from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field
from functools import cached_property
from operator import itemgetter
from typing import Awaitable, Callable

from server.backbone import EncodedInput
from server.modules import LoadedModule
from server.timings import Timings

log = logging.getLogger("tmod.batcher")

DEPTH_EVERY = 0.01  # seconds: the queue-depth gauge is written at most this often on submit (and per batch)


class QueueFull(Exception):
    pass


class DeadlineExceeded(Exception):
    pass


class ClientGone(Exception):
    pass


@dataclass
class Job:
    rows: list[EncodedInput]
    modules: dict[str, LoadedModule]
    deadline: float
    is_disconnected: Callable[[], Awaitable[bool]] | None = None
    timings: Timings = field(default_factory=Timings)
    enqueued: float = field(default_factory=time.perf_counter)
    future: asyncio.Future | None = None
    running: bool = False  # taken into a batch that runs: its deadline no longer applies

    @property
    def pairs(self) -> bool:
        return self.rows[0].text_pair is not None

    @property
    def tokens(self) -> int:
        return sum(len(row) for row in self.rows)

    @cached_property
    def longest(self) -> int:
        return max(len(row) for row in self.rows)


@dataclass
class BatchSettings:
    max_batch_tokens: int = 16384  # padded tokens (rows x longest row) per backbone pass
    max_batch_size: int = 128
    max_wait: float = 0.002  # seconds a batch waits for company after its first job
    max_queue: int = 256  # jobs waiting; beyond this, 429
    enabled: bool = True  # False: one job per backbone pass (for comparison)
    in_flight: int = 1  # batches handed to compute at once: 2 forms and prepares the next while one runs
    disconnect_check_after: float = 0.05  # seconds queued before a job's client is asked whether it is still there


class Forming:
    """A batch being formed: its jobs, rows, longest row, and the module answering each task (the
    union of its jobs' tasks), so that adding a job costs O(its tasks), whatever the batch holds."""

    def __init__(self, first: Job):
        self.jobs = [first]
        self.rows, self.longest, self.pairs = len(first.rows), first.longest, first.pairs
        self.modules: dict[str, LoadedModule] = dict(first.modules)

    def admits(self, job: Job, settings: BatchSettings) -> bool:
        """Whether `job` may join: same input signature, no task answered by another version
        (mid-reload two versions cannot share a pass), within the row limit and token budget."""
        if not settings.enabled or job.pairs != self.pairs:
            return False
        known = self.modules
        for task, module in job.modules.items():
            if known.get(task, module) is not module:
                return False
        rows = self.rows + len(job.rows)
        return rows <= settings.max_batch_size and rows * max(self.longest, job.longest) <= settings.max_batch_tokens

    def add(self, job: Job) -> None:
        self.jobs.append(job)
        self.rows += len(job.rows)
        self.longest = max(self.longest, job.longest)
        self.modules.update(job.modules)


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class Batcher:
    def __init__(self, run_batch: Callable, executor, settings: BatchSettings, metrics=None,
                 prepare: Callable | None = None, prepare_executor=None):
        """`run_batch(rows, modules, timings)` runs on `executor` (the compute thread) and
        returns the outputs per task, in row order; an answer that is an exception fails its
        request with it (a row refused for memory) and leaves the others answered. `prepare(rows,
        modules)`, if given, runs first on `prepare_executor` (host work such as collating, beside
        the compute thread) and what it returns is handed to run_batch in place of the rows."""
        self.run_batch = run_batch
        self.executor = executor
        self.prepare = prepare
        self.prepare_executor = prepare_executor
        self._running: set[asyncio.Task] = set()  # batches handed on, not yet answered
        self.settings = settings
        self.metrics = metrics
        self._queue: collections.deque[Job] = collections.deque()
        self._arrival: asyncio.Future | None = None  # what the loop awaits while the queue is empty
        self._held: collections.deque[Job] = collections.deque()  # taken but not fitting the last batch
        self._task: asyncio.Task | None = None
        self._closing = False
        # waiting jobs' deadlines, earliest first, kept by one timer for all of them (a timer per job
        # cost the engine process a handle, a callback and a cancel per request)
        self._deadlines: list[tuple[float, int, Job]] = []
        self._order = itertools.count()
        self._expiry: asyncio.TimerHandle | None = None
        self._expiry_at = float("inf")
        self._depth_seen = 0.0

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="tmod-batcher")

    async def drain_and_stop(self) -> None:
        """Refuse new jobs, answer every queued one, then stop."""
        self._closing = True
        while self.depth() or self._running:
            await asyncio.sleep(0.01)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def depth(self) -> int:
        return len(self._queue) + len(self._held)

    # ---- submitting --------------------------------------------------------------------------
    def enqueue(self, job: Job) -> asyncio.Future:
        """Queue `job`; the future returned gets its answers, or the reason it got none
        (DeadlineExceeded, ClientGone, a refusal). A full queue raises QueueFull at once."""
        if self._closing:
            raise QueueFull("the server is shutting down")
        if self.depth() >= self.settings.max_queue:
            raise QueueFull(f"queue is full ({self.settings.max_queue} requests waiting)")
        job.future = asyncio.get_running_loop().create_future()
        self._keep_deadline(job)  # kept while the job waits, not only when a batch takes it
        self._queue.append(job)
        if self._arrival is not None and not self._arrival.done():
            self._arrival.set_result(None)
        if job.enqueued - self._depth_seen >= DEPTH_EVERY:  # a gauge write per request is not worth it
            self._observe_depth()
        return job.future

    async def submit(self, job: Job):
        return await self.enqueue(job)

    def _keep_deadline(self, job: Job) -> None:
        deadlines = self._deadlines
        while deadlines and deadlines[0][2].future.done():  # answered jobs leave from the front
            heapq.heappop(deadlines)
        heapq.heappush(deadlines, (job.deadline, next(self._order), job))
        if job.deadline < self._expiry_at:
            self._arm_expiry()

    def _arm_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry, self._expiry_at = None, float("inf")
        if self._deadlines:
            self._expiry_at = self._deadlines[0][0]
            delay = max(0.0, self._expiry_at - time.perf_counter())
            self._expiry = asyncio.get_running_loop().call_later(delay, self._expire_due)

    def _expire_due(self) -> None:
        """Fail every waiting job whose deadline has passed; arm the timer for the next one."""
        now, deadlines = time.perf_counter(), self._deadlines
        while deadlines and (deadlines[0][0] <= now or deadlines[0][2].future.done()):
            job = heapq.heappop(deadlines)[2]
            if not job.future.done() and not job.running:
                job.future.set_exception(DeadlineExceeded("the request waited past its deadline"))
                self._count_dropped("deadline")
        self._arm_expiry()

    # ---- the loop ----------------------------------------------------------------------------
    async def _next(self, timeout: float | None) -> Job | None:
        """The next job, waiting up to `timeout` seconds (None: until one comes) for one to be
        queued. A future and a timer, not `wait_for(queue.get())`: that cost a task per batch."""
        if self._held:
            return self._held.popleft()
        loop = asyncio.get_running_loop()
        while not self._queue:
            if timeout is not None and timeout <= 0:
                return None
            self._arrival = loop.create_future()
            timer = loop.call_later(timeout, _wake, self._arrival) if timeout is not None else None
            try:
                await self._arrival
            finally:
                self._arrival = None
                if timer is not None:
                    timer.cancel()
            if timeout is not None:
                timeout = 0.0  # woken by a job, or the time is up
        return self._queue.popleft()

    async def _loop(self) -> None:
        slots = asyncio.Semaphore(self.settings.in_flight)
        while True:
            await slots.acquire()  # taken before the first job: with one slot a batch forms after the last ran
            forming = Forming(await self._next(None))
            window_end = time.perf_counter() + self.settings.max_wait
            while self.settings.enabled:
                job = await self._next(max(0.0, window_end - time.perf_counter()))
                if job is None:
                    break
                if forming.admits(job, self.settings):
                    forming.add(job)
                else:
                    self._held.appendleft(job)  # first in line for the next batch
                    break
            self._observe_depth()
            task = asyncio.get_running_loop().create_task(self._execute_logged(forming.jobs, slots))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _execute_logged(self, batch: list[Job], slots: asyncio.Semaphore) -> None:
        try:
            await self._execute(batch)
        except Exception:  # never let one batch kill the loop
            log.exception("batch failed")
        finally:
            slots.release()

    async def _live(self, batch: list[Job]) -> list[Job]:
        now = time.perf_counter()
        ask_before = now - self.settings.disconnect_check_after  # jobs queued before this are asked
        live = []
        for job in batch:
            if job.future.done():  # cancelled by the handler
                continue
            if now > job.deadline:
                job.future.set_exception(DeadlineExceeded("the request waited past its deadline"))
                self._count_dropped("deadline")
                continue
            if job.is_disconnected is not None and job.enqueued < ask_before and await job.is_disconnected():
                job.future.set_exception(ClientGone("client disconnected"))
                self._count_dropped("client_gone")
                continue
            job.running = True
            live.append(job)
        return live

    async def _execute(self, batch: list[Job]) -> None:
        batch = await self._live(batch)
        if not batch:
            return
        started = time.perf_counter()
        # sort rows by length so similar lengths share padding (stable: equal lengths keep their
        # order); `where[j]` remembers where job j's rows went
        order = sorted(((len(row), j, r) for j, job in enumerate(batch) for r, row in enumerate(job.rows)),
                       key=itemgetter(0))
        rows = [batch[j].rows[r] for _, j, r in order]
        where = [[0] * len(job.rows) for job in batch]
        for i, (_, j, r) in enumerate(order):
            where[j][r] = i
        modules: dict[str, LoadedModule] = {}
        for job in batch:
            modules.update(job.modules)
        timings = Timings()
        loop = asyncio.get_running_loop()
        try:
            work = rows
            if self.prepare is not None:
                work = await loop.run_in_executor(self.prepare_executor, self.prepare, rows, modules)
            outputs = await loop.run_in_executor(self.executor, self.run_batch, work, modules, timings)
        except Exception as exc:
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(exc)
            return
        if self.metrics is not None:
            self.metrics.batch_requests.observe(len(batch))
        for job, places in zip(batch, where):
            if job.future.done():
                continue
            job.timings.extra["queue"] = started - job.enqueued
            job.timings.backbone, job.timings.heads = timings.backbone, timings.heads
            answers = {task: outputs[task] for task in job.modules}
            results = [{task: answer[i] for task, answer in answers.items()} for i in places]
            refusal = next((a for row in results for a in row.values() if isinstance(a, Exception)), None)
            if refusal is not None:
                job.future.set_exception(refusal)
            else:
                job.future.set_result(results)

    def _count_dropped(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.dropped.labels(reason).inc()

    def _observe_depth(self) -> None:
        self._depth_seen = time.perf_counter()
        if self.metrics is not None:
            self.metrics.queue_depth.set(self.depth())
