"""Batch formation's cost per job does not grow with the jobs already in the batch (server/batcher.py).

No clock is read: the work is counted. Every job's module set is a dict that counts how often it is
read (lookups, membership, iteration); forming one batch of n one-input jobs must read O(tasks) per
job, the same per job for n = 16 and n = 128. The batcher this replaced compared each new job with
every job already in the batch: its reads per job grew with n (about n/2 x tasks)."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from server.batcher import Batcher, BatchSettings, DeadlineExceeded, Job


class CountingModules(dict):
    """A job's task -> module dict that counts every read into a shared counter."""

    def __init__(self, items, counter: list[int]):
        super().__init__(items)
        self.counter = counter

    def _read(self):
        self.counter[0] += 1

    def __getitem__(self, key):
        self._read()
        return super().__getitem__(key)

    def __contains__(self, key):
        self._read()
        return super().__contains__(key)

    def get(self, key, default=None):
        self._read()
        return super().get(key, default)

    def items(self):
        self._read()
        return super().items()

    def keys(self):
        self._read()
        return super().keys()

    def values(self):
        self._read()
        return super().values()

    def __iter__(self):
        self._read()
        return super().__iter__()


class Row:
    """An encoded input as the batcher sees it: a length and whether it is a pair."""

    text_pair = None

    def __init__(self, tokens: int):
        self.ids = [0] * tokens

    def __len__(self):
        return len(self.ids)


def form_one_batch(jobs: int, tasks: int, age: float = 0.0) -> tuple[int, int, list[int]]:
    """Queue `jobs` one-input jobs asking `tasks` tasks (the same module objects), let the batcher form
    and run them. -> (module-set reads, is_disconnected calls, batch sizes run)."""
    modules = {f"task{t}": object() for t in range(tasks)}
    reads, asked, sizes = [0], [0], []

    async def still_there():
        asked[0] += 1
        return False

    def run_batch(rows, batch_modules, timings):
        sizes.append(len(rows))
        return {task: [{"row": i} for i in range(len(rows))] for task in batch_modules}

    async def scenario():
        executor = ThreadPoolExecutor(1)
        batcher = Batcher(run_batch, executor, BatchSettings(max_batch_size=jobs, max_batch_tokens=10**9,
                                                             max_wait=0.01, max_queue=10**6))
        batcher.start()
        queued = [Job(rows=[Row(8 + i % 5)], modules=CountingModules(modules, reads), deadline=time.perf_counter() + 60,
                      is_disconnected=still_there, enqueued=time.perf_counter() - age) for i in range(jobs)]
        answers = await asyncio.gather(*(batcher.submit(job) for job in queued))
        await batcher.drain_and_stop()
        executor.shutdown()
        assert [len(a) for a in answers] == [1] * jobs and set(answers[0][0]) == set(modules)

    asyncio.run(scenario())
    return reads[0], asked[0], sizes


def test_batch_formation_reads_per_job_do_not_grow_with_the_batch():
    for tasks in (3, 16):
        small_reads, _, small_sizes = form_one_batch(16, tasks)
        large_reads, _, large_sizes = form_one_batch(128, tasks)
        assert small_sizes == [16] and large_sizes == [128]  # one batch each: the whole batch was formed
        per_job_small, per_job_large = small_reads / 16, large_reads / 128
        # flat in the number of jobs (the quadratic batcher read ~tasks x n / 2 per job: 8x more at 128)
        assert per_job_large <= per_job_small * 1.1, (tasks, per_job_small, per_job_large)
        assert per_job_large <= 4 + 2 * tasks  # O(tasks): a constant number of reads per task


def test_clients_are_asked_only_after_waiting():
    _, asked, _ = form_one_batch(128, 3)
    assert asked == 0  # fresh jobs: nobody asks Starlette (~50 us a question)
    _, asked, _ = form_one_batch(16, 3, age=1.0)
    assert asked == 16  # jobs that waited past disconnect_check_after are asked, once each


MODULES = {"task0": object()}


def held_batcher() -> tuple[Batcher, ThreadPoolExecutor, threading.Event]:
    """A started batcher of one-job batches whose compute thread holds each batch until the returned
    event is set (10 s at most). Call it inside the event loop the batcher is to run on."""
    release = threading.Event()

    def run_batch(rows, batch_modules, timings):
        release.wait(10)
        return {task: [{"row": i} for i in range(len(rows))] for task in batch_modules}

    executor = ThreadPoolExecutor(1)
    batcher = Batcher(run_batch, executor, BatchSettings(max_batch_size=1, max_wait=0.0, max_queue=100))
    batcher.start()
    return batcher, executor, release


def test_waiting_jobs_fail_at_their_own_deadlines_while_a_batch_runs():
    """One timer keeps every waiting job's deadline (server/batcher.py): jobs queued behind a running
    batch fail in the order of their deadlines, before that batch ends; one queued first with a later
    deadline does not hold back the timer of those after it, and is answered."""

    async def scenario():
        batcher, executor, release = held_batcher()  # the first batch holds the compute thread until the late jobs failed
        now = time.perf_counter()

        def job(seconds):
            return Job(rows=[Row(8)], modules=MODULES, deadline=now + seconds)

        first = job(60)
        running = asyncio.create_task(batcher.submit(first))
        while not first.running:
            await asyncio.sleep(0.005)
        failed = []

        async def wait(name, j):
            try:
                return await batcher.submit(j)
            except DeadlineExceeded:
                failed.append((name, release.is_set()))
                raise

        queued = {name: job(seconds) for name, seconds in (("later", 30), ("b", 0.2), ("a", 0.1))}
        waiting = [asyncio.create_task(wait(name, j)) for name, j in queued.items()]
        while len(failed) < 2:
            await asyncio.sleep(0.01)
        release.set()
        answers = await asyncio.gather(running, *waiting, return_exceptions=True)
        await batcher.drain_and_stop()
        executor.shutdown()
        return failed, answers

    failed, answers = asyncio.run(scenario())
    assert failed == [("a", False), ("b", False)]  # deadline order, both while the first batch ran
    assert answers[0] == [{"task0": {"row": 0}}] and answers[1] == [{"task0": {"row": 0}}]
    assert all(isinstance(a, DeadlineExceeded) for a in answers[2:])


def test_a_group_of_entries_expires_entry_by_entry_at_each_deadline():
    """Entries queued together (a worker's frame) keep one deadline group (server/batcher.py): while a
    batch holds the compute thread, each waiting entry of the group fails at its own deadline, not the
    group's first, and the one whose deadline is far is answered."""
    from server.batcher import KEY, Owner

    class Recorder(Owner):
        def __init__(self, keys):
            self.waiting_keys, self.expired, self.answered = set(keys), [], []

        def waiting(self, key):
            return key in self.waiting_keys

        def take(self, key):
            if key not in self.waiting_keys:
                return False
            self.waiting_keys.discard(key)
            return True

        def expire(self, key):
            if key not in self.waiting_keys:
                return False
            self.waiting_keys.discard(key)
            self.expired.append((key, time.perf_counter()))
            return True

        def answer(self, items, outputs, timings, started):
            self.answered += [entry[KEY] for entry, _ in items]

        def fail(self, entries, exc):
            raise AssertionError(exc)

    async def scenario():
        batcher, executor, release = held_batcher()
        now = time.perf_counter()
        owner = Recorder(["first", "a", "b", "late"])
        batcher.put(([Row(8)], MODULES, now + 60, now, owner, "first", [8]))
        while "first" in owner.waiting_keys:  # taken into the batch that holds the compute thread
            await asyncio.sleep(0.005)
        group = [([Row(8)], MODULES, now + seconds, now, owner, key, [8]) for key, seconds in
                 (("late", 30.0), ("a", 0.1), ("b", 0.3))]
        assert batcher.put_many(group) == 3
        give_up = time.perf_counter() + 10
        while len(owner.expired) < 2:
            assert time.perf_counter() < give_up, owner.expired  # each deadline, not the group's last
            await asyncio.sleep(0.01)
        release.set()
        while len(owner.answered) < 2:
            await asyncio.sleep(0.01)
        await batcher.drain_and_stop()
        executor.shutdown()
        return now, owner

    now, owner = asyncio.run(scenario())
    assert [key for key, _ in owner.expired] == ["a", "b"]
    assert owner.expired[1][1] >= now + 0.3  # b failed at its own deadline, not at the group's first (a's)
    assert owner.answered == ["first", "late"]


def test_rows_of_many_input_jobs_are_sorted_by_length_and_each_job_gets_its_own_back():
    """A batch of many-input jobs: the runner gets every row sorted by length (stable: equal lengths
    keep their queue order) with those lengths beside them (`SortedRows`, no row asked), and each job
    gets the answers of its own rows, in its own order."""
    from server.runner.model_runner import SortedRows

    modules = {"task0": object()}
    lengths = [[9, 3, 7], [3], [12, 1, 3, 9], [5, 5]]
    seen = []

    def run_batch(rows, batch_modules, timings):
        seen.append((type(rows), list(rows.lengths), [len(row) for row in rows]))
        return {"task0": [("row", len(row), id(row)) for row in rows]}

    async def scenario():
        executor = ThreadPoolExecutor(1)
        batcher = Batcher(run_batch, executor, BatchSettings(max_batch_tokens=10**9, max_wait=0.05, max_queue=100))
        batcher.start()
        jobs = [Job(rows=[Row(n) for n in job], modules=modules, deadline=time.perf_counter() + 60) for job in lengths]
        answers = await asyncio.gather(*(batcher.submit(job) for job in jobs))
        await batcher.drain_and_stop()
        executor.shutdown()
        return jobs, answers

    jobs, answers = asyncio.run(scenario())
    assert len(seen) == 1  # one batch
    kind, given, asked = seen[0]
    flat = [n for job in lengths for n in job]
    assert kind is SortedRows and given == asked == sorted(flat)
    for job, answered in zip(jobs, answers):
        assert [a["task0"] for a in answered] == [("row", len(row), id(row)) for row in job.rows]


def run_full_batches(settings: BatchSettings, first: int, then: int) -> list[int]:
    """`first` one-row jobs (8 tokens each) submitted, then, once the batcher waits for company with
    them, `then` more: -> the sizes of the batches run. Each wait is bounded at 20 s, far under the
    settings' `max_wait` of 60 s: a batch that waited out `max_wait` would fail the wait."""
    sizes = []

    def run_batch(rows, batch_modules, timings):
        sizes.append(len(rows))
        return {task: [{"row": i} for i in range(len(rows))] for task in batch_modules}

    async def scenario():
        executor = ThreadPoolExecutor(1)
        batcher = Batcher(run_batch, executor, settings)
        batcher.start()

        def job():
            return batcher.submit(Job(rows=[Row(8)], modules=MODULES, deadline=time.perf_counter() + 120))

        answers = [asyncio.ensure_future(job()) for _ in range(first)]
        if then:
            while batcher._forming is None:  # the first jobs wait for company in a forming batch
                await asyncio.sleep(0.001)
            answers += [asyncio.ensure_future(job()) for _ in range(then)]  # they join it in put_many
        await asyncio.wait_for(asyncio.gather(*answers), 20)
        await batcher.drain_and_stop()
        executor.shutdown()

    asyncio.run(scenario())
    return sizes


def test_a_full_batch_goes_at_once():
    """A batch that no entry could join runs at once rather than waiting out `max_wait` (60 s here):
    full by rows, queued together or joining a batch already waiting for company, and full by the
    token budget (three 8-token rows in 24 tokens: a fourth row would need 32)."""
    by_rows = BatchSettings(max_batch_size=4, max_batch_tokens=10**9, max_wait=60.0, max_queue=100)
    assert run_full_batches(by_rows, 4, 0) == [4]
    assert run_full_batches(by_rows, 1, 3) == [4]
    by_tokens = BatchSettings(max_batch_size=100, max_batch_tokens=24, max_wait=60.0, max_queue=100)
    assert run_full_batches(by_tokens, 1, 2) == [3]
