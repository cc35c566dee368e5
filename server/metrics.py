"""Prometheus metrics, one registry per app so several apps can live in one process (tests).

With `--workers N` the server is N + 1 processes; prometheus_client's multiprocess mode
(`PROMETHEUS_MULTIPROC_DIR`, set by `tmod-serve` before any process imports the library) keeps each
process's values in files there, and any worker's /metrics adds them up: counters and histograms
summed, gauges as their `multiprocess_mode` says.

Answered requests are tallied in Python (`record_answer`, `in_flight`) and written as one update per
series: each update is a write to a memory-mapped file in multiprocess mode (a histogram observation
two), ~17 per request when written one by one, ~25 per write of a tally (~75 us of CPU in a worker
under load, issue 37). A tally is written at the end of the event-loop iteration in which this
process has no request left in flight, and while requests keep coming at most `FLUSH_EVERY_S`
after its first update (a busy worker writes ~10 a second, not once per iteration); /metrics writes
this process's tally before it reads. Outside an event loop (tests, tools) they are written at once.
"""
from __future__ import annotations

import asyncio
import errno
import os
from bisect import bisect_left

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest,
                               multiprocess)

# no `*_created` series (a timestamp per counter and histogram child, which dashboards do not read;
# half the page's series): one process's page then names the same series as the workers' multiprocess one
disable_created_metrics()

FLUSH_EVERY_S = 0.1  # while busy: the most time a tallied answer waits to be written
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class MetricsFolderFull(RuntimeError):
    """The metrics folder's filesystem has no room for this process's files."""


def reserve_files() -> None:
    """With worker processes: give this process's metric files their blocks now. prometheus_client makes
    each sparse (64 KiB, of which a server uses at most ~20) and writes it through a memory map; a page
    first written once the filesystem is full kills the process with SIGBUS: a full temp directory
    took every worker down, each new one dying at its first request. Reserved, a running server
    outlives a full temp directory; a process started on one stops at once, saying so."""
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not folder:
        return
    mine = f"_{os.getpid()}.db"  # prometheus_client's file names: <type>_<pid>.db, made as the metrics were
    for entry in os.scandir(folder):
        if not entry.name.endswith(mine):
            continue
        fd = os.open(entry.path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise MetricsFolderFull(f"no room for the metrics' files in {folder} (its filesystem is full): "
                                        "free room there, or choose another folder (TMPDIR)") from None
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):  # cannot reserve: as before
                raise
        finally:
            os.close(fd)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tmod_requests", "Inference requests (/v1/infer, embeddings, classify, OIP infer) "
                                "by outcome", ["outcome"], registry=r)
        self.errors = Counter("tmod_request_errors", "Refused requests by error type, on every route", ["type"], registry=r)
        self.task_requests = Counter("tmod_task_requests", "Requests per task", ["task"], registry=r)
        self.inputs = Counter("tmod_inputs", "Input texts processed", registry=r)
        self.duration = Histogram(
            "tmod_request_duration_seconds", "Time per request by phase", ["phase"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.batch_size = Histogram(
            "tmod_batch_size", "Inputs per backbone pass", buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r
        )
        self.batch_tokens = Histogram(
            "tmod_batch_tokens", "Padded tokens per backbone pass",
            buckets=(16, 64, 256, 1024, 4096, 16384, 65536), registry=r,
        )
        self.batch_requests = Histogram(
            "tmod_batch_requests", "Requests answered per backbone pass (achieved batching)",
            buckets=(1, 2, 4, 8, 16, 32, 64), registry=r,
        )
        self.dropped = Counter("tmod_dropped_requests", "Requests dropped before compute", ["reason"], registry=r)
        self.queue_depth = Gauge("tmod_queue_depth", "Requests waiting for a backbone pass", registry=r,
                                 multiprocess_mode="livesum")
        self.requests_in_flight = Gauge(
            "tmod_requests_in_flight", "Inference requests received and not yet answered", registry=r,
            multiprocess_mode="livesum",
        )
        self.modules_loaded = Gauge("tmod_modules_loaded", "Task modules loaded", registry=r, multiprocess_mode="livemax")
        self.modules_refused = Gauge("tmod_modules_refused", "Tasks (and bridges) with an artifact refused at its "
                                     "last load: /readyz 'refused' says which and why", registry=r,
                                     multiprocess_mode="livemax")
        self.module_refusals = Counter("tmod_module_refusals", "Artifacts refused at load, by reason", ["reason"],
                                       registry=r)
        self.backbone_layers = Histogram(
            "tmod_backbone_layers_run", "Backbone layers run per pass (early exit)",
            buckets=tuple(range(0, 49, 2)), registry=r,
        )
        # labelled children kept once made: a `labels()` lookup (validation, a lock, a dict) per
        # request costs more than the update itself (bench/bench_frontend.py). Made on first use, so
        # a series still appears only once something happened.
        self._children: dict = {}
        # what this event-loop iteration answered, written by `flush` at its end
        self._phases: dict[str, list[float]] = {}  # phase -> its durations
        self._tasks: dict[str, int] = {}
        self._answered = self._inputs = self._in_flight = 0
        self._open = 0  # requests in flight in this process
        self._flush: asyncio.Handle | None = None  # the write of the tally, once scheduled
        self._flush_idle = False  # whether it is scheduled at an iteration's end (the process went idle)
        reserve_files()

    def exposition(self) -> bytes:
        """The /metrics page: this registry, or with worker processes every live process's values."""
        self.flush()
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)

    def child(self, metric, label: str):
        key = (metric, label)  # metric objects hash by identity
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(label)
        return found

    def record_answer(self, phase_seconds, inputs: int, tasks) -> None:
        """An inference request answered: its phase durations, its inputs, its tasks."""
        phases = self._phases
        for phase, seconds in phase_seconds:
            found = phases.get(phase)
            if found is None:
                phases[phase] = [seconds]
            else:
                found.append(seconds)
        self._answered += 1
        self._inputs += inputs
        for task in tasks:
            self._tasks[task] = self._tasks.get(task, 0) + 1
        self._soon()

    def in_flight(self, change: int) -> None:
        """An inference request received (1) or answered (-1): `tmod_requests_in_flight`."""
        self._in_flight += change
        self._open += change
        self._soon()

    def _soon(self) -> None:
        """Schedule the write: at this iteration's end once nothing is in flight, else within FLUSH_EVERY_S."""
        idle = self._open <= 0
        if self._flush is not None and (self._flush_idle or not idle):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop: written now
            self.flush()
            return
        if self._flush is not None:  # a timed write, and now nothing is in flight: sooner
            self._flush.cancel()
        self._flush_idle = idle
        self._flush = loop.call_soon(self.flush) if idle else loop.call_later(FLUSH_EVERY_S, self.flush)

    def flush(self) -> None:
        """Write what was tallied: one update per series (a histogram: its sum and each bucket hit)."""
        if self._flush is not None:
            self._flush.cancel()  # (called before its time: by /metrics)
            self._flush = None
        if self._in_flight:
            self.requests_in_flight.inc(self._in_flight)
            self._in_flight = 0
        if self._answered:
            self.child(self.requests, "success").inc(self._answered)
            self.inputs.inc(self._inputs)
            self._answered = self._inputs = 0
        if self._tasks:
            for task, count in self._tasks.items():
                self.child(self.task_requests, task).inc(count)
            self._tasks = {}
        if self._phases:
            for phase, durations in self._phases.items():
                observe_all(self.child(self.duration, phase), durations)
            self._phases = {}


def observe_all(histogram, values: list[float]) -> None:
    """`histogram.observe(v)` for every v, as one update of its sum and one of each bucket hit
    (prometheus_client's Histogram child: `_upper_bounds`, `_sum`, `_buckets`; `observe` puts a value
    in the first bucket whose bound is at least it)."""
    bounds, hits = histogram._upper_bounds, {}
    for value in values:
        i = bisect_left(bounds, value)
        if i < len(bounds):  # (a NaN is in no bucket, as observe has it)
            hits[i] = hits.get(i, 0) + 1
    histogram._sum.inc(sum(values))
    for i, count in hits.items():
        histogram._buckets[i].inc(count)
