"""`Metrics.record_answer`: the per-request updates with labelled children kept once made; the metric
files of worker processes reserved."""
import errno
import os
import subprocess
import sys

import pytest
from prometheus_client import generate_latest

from server.metrics import Metrics, MetricsFolderFull, reserve_files
from tests.helpers import metric_sample


def page(metrics: Metrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_record_answer_counts_every_update_and_adds_series_only_when_used():
    metrics = Metrics()
    before = page(metrics)
    assert 'tmod_requests_total{outcome="success"}' not in before
    assert 'tmod_task_requests_total{task="ner"}' not in before

    phases = (("queue", 0.002), ("tokenize", 0.0005), ("backbone", 0.01), ("heads", 0.001), ("total", 0.02))
    metrics.record_answer(phases, 3, ["ner", "sentiment"])
    metrics.record_answer(phases, 2, ["ner"])

    after = page(metrics)
    assert "_created" not in after  # as the workers' multiprocess page: no creation timestamps
    assert metric_sample(after, 'tmod_requests_total{outcome="success"}') == 2
    assert metric_sample(after, "tmod_inputs_total") == 5
    assert metric_sample(after, 'tmod_task_requests_total{task="ner"}') == 2
    assert metric_sample(after, 'tmod_task_requests_total{task="sentiment"}') == 1
    assert 'tmod_task_requests_total{task="acceptability"}' not in after
    for phase, seconds in phases:
        assert metric_sample(after, f'tmod_request_duration_seconds_count{{phase="{phase}"}}') == 2
        assert abs(metric_sample(after, f'tmod_request_duration_seconds_sum{{phase="{phase}"}}') - 2 * seconds) < 1e-9


def test_two_metrics_objects_keep_their_own_children():
    first, second = Metrics(), Metrics()
    first.record_answer((("total", 0.1),), 1, ["ner"])
    assert metric_sample(page(first), 'tmod_task_requests_total{task="ner"}') == 1
    assert metric_sample(page(second), 'tmod_task_requests_total{task="ner"}') == 0


def test_answers_are_tallied_and_written_once_as_each_observed_alone():
    """In an event loop the updates are tallied: while a request is in flight they are written
    FLUSH_EVERY_S after the first (nothing at the iteration's end), once none is, at the iteration's
    end; written, the page is the one `observe` / `inc` per request would give (every bucket, sum,
    count, gauge)."""
    import asyncio

    from server.metrics import FLUSH_EVERY_S

    tallied, reference = Metrics(), Metrics()
    answers = [((("queue", q), ("total", t)), n, tasks) for q, t, n, tasks in
               ((0.0004, 0.003, 1, ["ner"]), (0.002, 0.04, 3, ["ner", "sentiment"]), (0.0004, 30.0, 2, ["sentiment"]),
                (0.001, 0.001, 1, ["ner"]))]
    for phases, inputs, tasks in answers:
        for phase, seconds in phases:
            reference.duration.labels(phase).observe(seconds)
        reference.requests.labels("success").inc()
        reference.inputs.inc(inputs)
        for task in tasks:
            reference.task_requests.labels(task).inc()
    reference.requests_in_flight.inc(1)

    async def iterations():
        for _ in range(3):
            tallied.in_flight(1)
        for phases, inputs, tasks in answers:
            tallied.record_answer(phases, inputs, tasks)
        tallied.in_flight(-1)
        tallied.in_flight(-1)
        pending = page(tallied)
        await asyncio.sleep(0)  # the iteration ends with a request in flight: nothing written yet
        busy = page(tallied)
        await asyncio.sleep(FLUSH_EVERY_S * 1.5)  # the timed write ran first (its deadline is the earlier)
        written = page(tallied)
        tallied.in_flight(-1)  # the last answered: written at this iteration's end
        await asyncio.sleep(0)
        return pending, busy, written, page(tallied)

    pending, busy, written, idle = asyncio.run(iterations())
    for unwritten in (pending, busy):
        assert 'tmod_requests_total{outcome="success"}' not in unwritten
        assert metric_sample(unwritten, "tmod_inputs_total") == 0
    assert metric_sample(idle, "tmod_requests_in_flight") == 0
    expected = page(reference)
    samples = [line.split(" ")[0] for line in expected.splitlines()
               if line.startswith(("tmod_request_duration_seconds_", "tmod_requests_", "tmod_inputs_total",
                                   "tmod_task_requests_total"))]
    assert len(samples) > 30
    for name in samples:
        assert abs(metric_sample(written, name) - metric_sample(expected, name)) < 1e-9, name


def test_with_worker_processes_the_metric_files_have_their_blocks_from_the_start(tmp_path):
    """prometheus_client makes each process's files sparse and writes them through a memory map: a page
    first written once the temp filesystem is full killed the process (SIGBUS). Reserved at start, every
    byte of each file has its block (the full filesystem itself: tests/test_workers.py)."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    try:
        fd = os.open(probe, os.O_RDWR)
        os.posix_fallocate(fd, 0, 4096)
        os.close(fd)
    except OSError:
        pytest.skip("this filesystem reserves no blocks (posix_fallocate)")
    code = ("from server.metrics import Metrics; import os, sys; Metrics(); "
            "[print(e.name, e.stat().st_size, e.stat().st_blocks * 512) for e in os.scandir(sys.argv[1])]")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                         check=True).stdout
    files = [line.split() for line in out.splitlines() if line.split()[0].endswith(".db")]
    assert sorted(name.split("_")[0] for name, *_ in files) == ["counter", "gauge", "gauge", "histogram"]
    assert all(int(blocks) >= int(size) > 0 for _, size, blocks in files), files


def test_a_full_metrics_filesystem_is_one_clear_error(tmp_path, monkeypatch):
    (tmp_path / f"counter_{os.getpid()}.db").write_bytes(bytes(64))
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(MetricsFolderFull, match=r"no room for the metrics' files in .* \(its filesystem is full\)"):
        reserve_files()
