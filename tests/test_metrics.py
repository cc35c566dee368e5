"""`Metrics.record_answer`: the per-request updates with labelled children kept once made."""
from prometheus_client import generate_latest

from server.metrics import Metrics
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
