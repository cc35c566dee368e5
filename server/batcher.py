"""Dynamic batching: requests queue up; one backbone pass answers many of them.

A batch takes queued entries of one input signature (single texts or text pairs) until a token
budget or a row limit is reached (then it goes at once) or `max_wait` has passed since its first
entry; rows are sorted by length to cut padding; the backbone runs once for the union of the tasks
its entries asked for, and each entry gets only its own tasks back. The queue is bounded: a full
queue refuses at once (429).
Entries whose client went away or whose deadline passed are dropped before any compute.

An entry is a tuple `(rows, modules, deadline, enqueued, owner, key, lengths)` (`lengths`: each row's
token count, known from the frame: forming a batch never asks a row, nor does the runner, which gets
them beside the sorted rows, `SortedRows`; a worker's request holds its rows as `BlockRows`, a range of
its frame's `RowBlock`, and a batch of them reaches the runner as one RowBlock, sorted by numpy), no
object of its own: the
owner keeps what it needs per key and is told per batch what happened (`Owner`). The engine process
of `--workers N` is one owner per worker connection: it answers a whole batch's requests of that
worker in one frame (server/workers/). A `Job` of the one-process path is its own key under the
`JOBS` owner, whose future the HTTP handler awaits (`Batcher.submit`).

While a batch waits for company, entries queued meanwhile (a worker's frame) join it at once, as long as
they fit: the loop is woken only when one does not, not once per frame. A batch is handed to the
compute thread with one submit and comes back with one call onto the loop (`_finish`): no task, future
or await per batch.

Deadlines are kept in groups (the entries queued together: one worker frame), one heap item and
one timer for all of them; a group whose entries are all answered leaves the heap from its front.

Forming a batch costs O(tasks) per entry (`Forming` keeps the module answering each task, so an
entry is checked against it, not against every entry already in), and the client of a job is asked
whether it is still there only once the job has waited `disconnect_check_after` (asking costs ~50 us
per job in Starlette; a job answered sooner than that is not worth the question).
"""
from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import numpy as np

from server.backbone import EncodedInput
from server.backbone.tokens import BlockRows, are_pairs, gather_rows
from server.metrics import observe_all
from server.modules import LoadedModule
from server.runner.model_runner import SortedRows
from server.timings import Timings

log = logging.getLogger("tmod.batcher")

DEPTH_EVERY = 0.01  # seconds: the queue-depth gauge is written at most this often on submit (and per batch)
ROWS, MODULES, DEADLINE, ENQUEUED, OWNER, KEY, LENGTHS = range(7)  # an entry's fields


class QueueFull(Exception):
    pass


class DeadlineExceeded(Exception):
    pass


class ClientGone(Exception):
    pass


@dataclass
class Job:
    """A request of the one-process path (and a worker's request before it crosses to the engine)."""

    rows: list[EncodedInput]
    modules: dict[str, LoadedModule]
    deadline: float
    is_disconnected: Callable[[], Awaitable[bool]] | None = None
    timings: Timings = field(default_factory=Timings)
    enqueued: float = field(default_factory=time.perf_counter)
    future: asyncio.Future | None = None
    running: bool = False  # taken into a batch that runs: its deadline no longer applies


class Owner:
    """Whoever queued entries: told, by key, what became of them. Every method runs on the loop."""

    asks_clients = False  # whether `gone` is worth asking (a job's HTTP client)

    def waiting(self, key) -> bool:
        """Still waiting for a batch (not answered, failed, cancelled or running)."""
        raise NotImplementedError

    def take(self, key) -> bool:
        """The entry goes into a batch that runs (its deadline no longer applies); False: it is no
        longer waiting (cancelled, failed), leave it out."""
        raise NotImplementedError

    def expire(self, key) -> bool:
        """Its deadline passed while it waited: fail it. False if it was no longer waiting."""
        raise NotImplementedError

    async def gone(self, key) -> bool:
        """Whether its client left (then it is failed here and True)."""
        return False

    def answer(self, items: list, outputs: dict[str, list], timings: Timings, started: float) -> None:
        """A batch ran: `items` are (entry, places) of this owner's entries, `places` each of its rows'
        index into `outputs` (per task, the answer of every row of the batch)."""
        raise NotImplementedError

    def fail(self, entries: list, exc: Exception) -> None:
        """A batch failed as a whole: each of these entries gets `exc`."""
        raise NotImplementedError


class JobOwner(Owner):
    """The one-process path: each entry's key is its Job, answered through the job's future."""

    asks_clients = True

    def waiting(self, job: Job) -> bool:
        return not (job.running or job.future.done())

    def take(self, job: Job) -> bool:
        if job.future.done():  # cancelled by the handler
            return False
        job.running = True
        return True

    def expire(self, job: Job) -> bool:
        if job.running or job.future.done():
            return False
        job.future.set_exception(DeadlineExceeded("the request waited past its deadline"))
        return True

    async def gone(self, job: Job) -> bool:
        if job.is_disconnected is None or not await job.is_disconnected():
            return False
        if not job.future.done():
            job.future.set_exception(ClientGone("client disconnected"))
        return True

    def answer(self, items, outputs, timings, started) -> None:
        for entry, places in items:
            job = entry[KEY]
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

    def fail(self, entries, exc) -> None:
        for entry in entries:
            if not entry[KEY].future.done():
                entry[KEY].future.set_exception(exc)


JOBS = JobOwner()


def job_entry(job: Job) -> tuple:
    return (job.rows, job.modules, job.deadline, job.enqueued, JOBS, job, [len(row) for row in job.rows])


@dataclass
class BatchSettings:
    max_batch_tokens: int = 16384  # padded tokens (rows x longest row) per backbone pass
    max_batch_size: int = 128
    max_wait: float = 0.002  # seconds a batch waits for company after its first entry
    max_queue: int = 256  # entries waiting; beyond this, 429
    enabled: bool = True  # False: one entry per backbone pass (for comparison)
    in_flight: int = 1  # batches handed to compute at once: 2 forms and prepares the next while one runs
    disconnect_check_after: float = 0.05  # seconds queued before a job's client is asked whether it is still there


class Running:
    """A batch handed to compute: its rows (sorted), the union of its tasks, each owner's (entry,
    places), and what its answers report (timings, when it started, how many requests)."""

    __slots__ = ("work", "modules", "owners", "requests", "started", "slots", "timings")

    def __init__(self, work, modules: dict, owners: dict, requests: int, started: float, slots: asyncio.Semaphore):
        self.work, self.modules, self.owners, self.requests = work, modules, owners, requests
        self.started, self.slots, self.timings = started, slots, Timings()


class Forming:
    """A batch being formed: its entries, rows, longest row, and the module answering each task (the
    union of its entries' tasks), so that adding an entry costs O(its tasks), whatever the batch holds;
    an entry with the task set (the same dict) of the one before costs no look-up at all (the engine
    process hands every request of one task set the same dict)."""

    def __init__(self, first: tuple):
        rows = first[ROWS]
        self.entries = [first]
        self.rows, self.longest, self.pairs = len(rows), max(first[LENGTHS]), are_pairs(rows)
        self.modules: dict[str, LoadedModule] = dict(first[MODULES])
        self.last = first[MODULES]  # a task set already checked and added

    def add(self, entry: tuple, settings: BatchSettings) -> bool:
        """Add `entry` if it may join: same input signature, no task answered by another version
        (mid-reload two versions cannot share a pass), within the row limit and token budget."""
        rows = entry[ROWS]
        if not settings.enabled or are_pairs(rows) != self.pairs:
            return False
        modules = entry[MODULES]
        if modules is not self.last:
            known = self.modules
            for task, module in modules.items():
                if known.get(task, module) is not module:
                    return False
        count, tokens = self.rows + len(rows), max(entry[LENGTHS])
        if count > settings.max_batch_size or count * max(self.longest, tokens) > settings.max_batch_tokens:
            return False
        self.entries.append(entry)
        self.rows = count
        if tokens > self.longest:
            self.longest = tokens
        if modules is not self.last:
            self.modules.update(modules)
            self.last = modules
        return True

    def full(self, settings: BatchSettings) -> bool:
        """No entry can join: the row limit is reached, or one more row as long as the longest would
        pass the token budget (a longer one would too)."""
        return self.rows >= settings.max_batch_size or (self.rows + 1) * self.longest > settings.max_batch_tokens


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
        # hands the compute thread a batch: with no future where the executor can (runtime.ComputeThread)
        self._compute_call = getattr(executor, "call", None) or executor.submit
        self.prepare = prepare
        self.prepare_executor = prepare_executor
        self._running: set = set()  # batches handed on (Running), or asking their clients (a task), not yet answered
        self.settings = settings
        self.metrics = metrics
        self._queue: collections.deque[tuple] = collections.deque()
        self._arrival: asyncio.Future | None = None  # what the loop awaits while the queue is empty
        self._held: collections.deque[tuple] = collections.deque()  # taken but not fitting the last batch
        self._forming: Forming | None = None  # the batch waiting for company, which `put_many` adds to
        self._task: asyncio.Task | None = None
        self._closing = False
        # waiting entries' deadlines, earliest first, kept by one timer for all of them (a timer per
        # request cost the engine process a handle, a callback and a cancel per request)
        self._deadlines: list[tuple[float, int, tuple]] = []
        self._order = itertools.count()
        self._expiry: asyncio.TimerHandle | None = None
        self._expiry_at = float("inf")
        self._depth_seen = 0.0

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="tmod-batcher")

    async def drain_and_stop(self) -> None:
        """Refuse new entries, answer every queued one, then stop."""
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
        """Entries waiting: queued, left by the last batch, or in the batch forming."""
        forming = self._forming
        return len(self._queue) + len(self._held) + (len(forming.entries) if forming is not None else 0)

    # ---- submitting --------------------------------------------------------------------------
    def put(self, entry: tuple) -> None:
        """Queue an entry (`(rows, modules, deadline, enqueued, owner, key, lengths)`); its owner hears what
        became of it. A full queue raises QueueFull at once."""
        if not self.put_many([entry]):
            raise QueueFull(f"queue is full ({self.settings.max_queue} requests waiting)")

    def put_many(self, entries: list[tuple]) -> int:
        """Queue entries that came together (a worker's frame): as many as the queue has room for, in
        order; -> how many (the rest are the caller's to refuse, 429). Their deadlines are kept as one
        group (one heap item, not one per request). Closing: none, QueueFull."""
        if self._closing:
            raise QueueFull("the server is shutting down")
        room = self.settings.max_queue - len(self._queue) - len(self._held)
        if room < len(entries):
            entries = entries[:max(0, room)]
        if not entries:
            return 0
        self._keep_deadlines(entries)  # kept while the entries wait, not only when a batch takes them
        count = len(entries)
        if entries[0][ENQUEUED] - self._depth_seen >= DEPTH_EVERY:  # a gauge write per request is not worth it
            self._observe_depth()
        forming = self._forming
        if forming is not None:  # a batch waits for company: they join it now, in order, while they fit
            for i, entry in enumerate(entries):
                if not forming.add(entry, self.settings):
                    self._forming = None  # the rest wait for the next batch, behind this one
                    entries = entries[i:]
                    break
            else:
                if not forming.full(self.settings):
                    return count
                self._forming, entries = None, []  # full: woken below, it goes now
        self._queue.extend(entries)
        if self._arrival is not None and not self._arrival.done():
            self._arrival.set_result(None)
        return count

    def enqueue(self, job: Job) -> asyncio.Future:
        """Queue `job`; the future returned gets its answers, or the reason it got none
        (DeadlineExceeded, ClientGone, a refusal). A full queue raises QueueFull at once."""
        job.future = asyncio.get_running_loop().create_future()
        self.put(job_entry(job))
        return job.future

    async def submit(self, job: Job):
        return await self.enqueue(job)

    @staticmethod
    def _settled(group: list[tuple]) -> bool:
        """No entry of a deadline group is still waiting."""
        return not any(entry[OWNER].waiting(entry[KEY]) for entry in group)

    def _keep_deadlines(self, group: list[tuple]) -> None:
        deadlines = self._deadlines
        while deadlines and self._settled(deadlines[0][2]):  # answered groups leave from the front
            heapq.heappop(deadlines)
        first = min(entry[DEADLINE] for entry in group) if len(group) > 1 else group[0][DEADLINE]
        heapq.heappush(deadlines, (first, next(self._order), group))
        if first < self._expiry_at:
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
        """Fail every waiting entry whose deadline has passed (the rest of its group goes back under
        the group's next deadline); arm the timer for the next one."""
        now, deadlines = time.perf_counter(), self._deadlines
        while deadlines and (deadlines[0][0] <= now or self._settled(deadlines[0][2])):
            rest = []
            for entry in heapq.heappop(deadlines)[2]:
                if not entry[OWNER].waiting(entry[KEY]):
                    continue
                if entry[DEADLINE] > now:
                    rest.append(entry)
                elif entry[OWNER].expire(entry[KEY]):
                    self._count_dropped("deadline")
            if rest:
                heapq.heappush(deadlines, (min(entry[DEADLINE] for entry in rest), next(self._order), rest))
        self._arm_expiry()

    # ---- the loop ----------------------------------------------------------------------------
    async def _wait(self, timeout: float | None) -> None:
        """Until an entry is queued, or `timeout` seconds (None: no limit). A future and a timer, not
        `wait_for(queue.get())`: that cost a task per batch."""
        loop = asyncio.get_running_loop()
        self._arrival = loop.create_future()
        timer = loop.call_later(timeout, _wake, self._arrival) if timeout is not None else None
        try:
            await self._arrival
        finally:
            self._arrival = None
            if timer is not None:
                timer.cancel()

    async def _first(self) -> tuple:
        """A batch's first entry: the one a batch before left (it did not fit), else the next queued."""
        if self._held:
            return self._held.popleft()
        while not self._queue:
            await self._wait(None)
        return self._queue.popleft()

    async def _fill(self, forming: Forming, window_end: float) -> None:
        """Add entries to `forming` in order until one does not fit (first in line for the next batch)
        or the wait is over, or the batch is full (then it goes at once: waiting could add nothing).
        While it waits, entries queued meanwhile join it as they come (`put_many`): a worker's frame
        wakes this loop only when an entry does not fit or the batch became full."""
        queue, held, settings = self._queue, self._held, self.settings
        while True:
            while held or queue:  # what is queued already: no wait
                entry = held.popleft() if held else queue.popleft()
                if not forming.add(entry, settings):
                    held.appendleft(entry)
                    return
            if forming.full(settings):
                return
            remaining = window_end - time.perf_counter()
            if remaining <= 0:
                return
            self._forming = forming
            try:
                await self._wait(remaining)
            finally:
                self._forming = None

    async def _loop(self) -> None:
        slots = asyncio.Semaphore(self.settings.in_flight)
        while True:
            await slots.acquire()  # taken before the first entry: with one slot a batch forms after the last ran
            forming = Forming(await self._first())
            if self.settings.enabled:
                await self._fill(forming, time.perf_counter() + self.settings.max_wait)
            self._observe_depth()
            self._hand_on(forming.entries, slots)

    def _hand_on(self, batch: list[tuple], slots: asyncio.Semaphore) -> None:
        """A formed batch: its live entries handed to compute now, or, where a job's client is to be
        asked first whether it is still there (the one-process path), once asked (a task)."""
        ask_before = time.perf_counter() - self.settings.disconnect_check_after  # entries queued before this are asked
        if not any(entry[OWNER].asks_clients and entry[ENQUEUED] < ask_before for entry in batch):
            self._run(self._live(batch), slots)
            return
        task = asyncio.get_running_loop().create_task(self._ask_then_run(batch, slots))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _ask_then_run(self, batch: list[tuple], slots: asyncio.Semaphore) -> None:
        ask_before = time.perf_counter() - self.settings.disconnect_check_after
        asked = []
        for entry in batch:
            owner, key = entry[OWNER], entry[KEY]
            if owner.asks_clients and entry[ENQUEUED] < ask_before and owner.waiting(key) and await owner.gone(key):
                self._count_dropped("client_gone")
                continue
            asked.append(entry)
        self._run(self._live(asked), slots)

    def _live(self, batch: list[tuple]) -> list[tuple]:
        """The entries still waiting and within their deadline, taken (the rest expire or are left out)."""
        now = time.perf_counter()
        live = []
        for entry in batch:
            owner, key = entry[OWNER], entry[KEY]
            if now > entry[DEADLINE]:
                if owner.expire(key):
                    self._count_dropped("deadline")
                continue
            if owner.take(key):
                live.append(entry)
        return live

    def _run(self, batch: list[tuple], slots: asyncio.Semaphore) -> None:
        """Hand a batch's rows to compute: one submit to the compute thread (on a GPU, to a tokenizer
        thread that prepares them and submits them on), and one call back onto the loop with its
        outputs (`_finish`); no task, future or await per batch."""
        if not batch:
            slots.release()
            return
        try:
            running = self._start(batch, slots)
        except Exception:  # never let one batch kill the loop
            log.exception("batch failed")
            slots.release()
            return
        self._running.add(running)
        loop = asyncio.get_running_loop()

        def report(outputs, error) -> None:  # on the thread that ran the batch
            try:
                loop.call_soon_threadsafe(self._finish, running, outputs, error)
            except RuntimeError:  # the loop is closed: nobody is waiting for these answers
                pass

        try:
            if self.prepare is not None:
                self.prepare_executor.submit(self._prepare_then_compute, running, report)
            else:
                self._compute_call(self._compute, running.work, running.modules, running.timings, report)
        except RuntimeError as exc:  # an executor shut down: the server is stopping
            self._finish(running, None, exc)

    def _start(self, batch: list[tuple], slots: asyncio.Semaphore) -> "Running":
        started = time.perf_counter()
        # sort rows by length so similar lengths share padding (stable: equal lengths keep their
        # order); `where[j]` remembers where entry j's rows went
        if all(type(entry[ROWS]) is BlockRows for entry in batch):  # a worker's frames: rows as arrays, sorted by numpy
            block, index = gather_rows([entry[ROWS] for entry in batch])
            order = np.argsort(block.lengths[index], kind="stable")
            rows = block.take(index[order])
            place = np.empty_like(order)  # each row's place in the sorted batch
            place[order] = np.arange(len(order))
            if len(order) == len(batch):  # one row per request
                where = [[p] for p in place.tolist()]
            else:
                place = place.tolist()
                bounds = [0, *itertools.accumulate(len(entry[ROWS]) for entry in batch)]
                where = [place[a:b] for a, b in zip(bounds, bounds[1:])]
        elif all(len(entry[ROWS]) == 1 for entry in batch):  # one row each (the common case): no inner loop
            lengths = [entry[LENGTHS][0] for entry in batch]
            order = sorted(range(len(batch)), key=lengths.__getitem__)
            rows = SortedRows([batch[j][ROWS][0] for j in order], [lengths[j] for j in order])
            where = [None] * len(batch)
            for i, j in enumerate(order):
                where[j] = [i]
        else:  # every row of the batch sorted at once (numpy), no object per row
            counts = [len(entry[ROWS]) for entry in batch]
            lengths = np.fromiter(itertools.chain.from_iterable(entry[LENGTHS] for entry in batch), dtype=np.int64,
                                  count=sum(counts))
            order = np.argsort(lengths, kind="stable")
            flat = list(itertools.chain.from_iterable(entry[ROWS] for entry in batch))
            rows = SortedRows([flat[i] for i in order.tolist()], lengths[order].tolist())
            place = np.empty_like(order)  # each row's place in the sorted batch
            place[order] = np.arange(len(order))
            place = place.tolist()
            bounds = [0, *itertools.accumulate(counts)]
            where = [place[a:b] for a, b in zip(bounds, bounds[1:])]
        modules: dict[str, LoadedModule] | None = None
        owners: dict[Owner, list] = {}
        last = mine = None
        merged = False
        for entry, places in zip(batch, where):
            if entry[MODULES] is not last:
                last = entry[MODULES]
                if modules is None:  # the entries' own dict while they share one (the runner caches by it)
                    modules = last
                elif last is not modules:
                    if not merged:  # never mutated: a union of several task sets is a dict of its own
                        modules, merged = dict(modules), True
                    modules.update(last)
            if entry[OWNER] is not mine:
                mine = entry[OWNER]
                items = owners.get(mine)
                if items is None:
                    items = owners[mine] = []
            items.append((entry, places))
        return Running(rows, modules, owners, len(batch), started, slots)

    def _compute(self, work, modules: dict, timings: Timings, report: Callable) -> None:
        """On the compute thread: run the batch and report its outputs (or what it raised)."""
        try:
            outputs = self.run_batch(work, modules, timings)
        except BaseException as exc:  # noqa: BLE001 - reported to the batch's owners, on the loop
            report(None, exc)
            return
        report(outputs, None)

    def _prepare_then_compute(self, running: "Running", report: Callable) -> None:
        """On a tokenizer thread: prepare the batch (collate) and hand it straight to the compute thread."""
        try:
            work = self.prepare(running.work, running.modules)
            self._compute_call(self._compute, work, running.modules, running.timings, report)
        except BaseException as exc:  # noqa: BLE001 - reported to the batch's owners, on the loop
            report(None, exc)

    def oldest_running(self) -> float | None:
        """When (perf_counter) the batch handed to compute longest ago was, or None: none is running."""
        return min((r.started for r in self._running if type(r) is Running), default=None)

    def abandon_running(self, error: Exception) -> None:
        """Answer every batch handed to compute with `error` now: the compute thread is stuck, and none
        of them will report (one that does later is ignored, `_finish`)."""
        for running in [r for r in self._running if type(r) is Running]:
            self._finish(running, None, error)

    def _finish(self, running: "Running", outputs, error: BaseException | None) -> None:
        """On the loop: a batch's outputs (or its failure) to each owner of its entries."""
        if running not in self._running:  # abandoned: its owners have their answer
            return
        self._running.remove(running)
        running.slots.release()
        try:
            if error is not None:
                if not isinstance(error, Exception):
                    error = RuntimeError(f"the batch stopped: {type(error).__name__}")
                for owner, items in running.owners.items():
                    owner.fail([entry for entry, _ in items], error)
                return
            if self.metrics is not None:
                observe_all(self.metrics.batch_requests, [running.requests])
            for owner, items in running.owners.items():
                owner.answer(items, outputs, running.timings, running.started)
        except Exception:  # never let one batch kill the loop
            log.exception("batch failed")

    def _count_dropped(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.child(self.metrics.dropped, reason).inc()

    def _observe_depth(self) -> None:
        self._depth_seen = time.perf_counter()
        if self.metrics is not None:
            self.metrics.queue_depth.set(self.depth())
