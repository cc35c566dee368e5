"""Dynamic batching over a real loopback server: shared passes, same answers, bounded queue."""
from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from server.api.app import create_app
from server.config import Settings
from bench.live_server import wait_until
from tests.helpers import LiveServer, metric_sample

TEXTS = ["Peter Blackburn met Angela Merkel in Brussels.", "A dull film.", "Great acting, poor plot, fine music.",
         "ok", "The European Commission said on Thursday it disagreed with German advice."]
TASK_SETS = ["sentiment", "ner", "sentiment,ner", "acceptability", "ner,acceptability"]


def serve(store, backbone, **overrides):
    overrides.setdefault("head_precision", "fp32")  # answers compared across paths: fp32 heads (16-bit heads round differently when grouped)
    return LiveServer(create_app(Settings(store=store.root, **overrides), backbone=backbone))


async def fire(url, requests):
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await asyncio.gather(*(
            client.post("/v1/infer", params={"tasks": tasks}, json={"inputs": inputs}) for inputs, tasks in requests
        ))


def histogram_sum_count(metrics_text, name):
    total = float(re.search(rf"^{name}_sum (\S+)$", metrics_text, re.M).group(1))
    count = float(re.search(rf"^{name}_count (\S+)$", metrics_text, re.M).group(1))
    return total, count


def assert_same_answer(batched, alone):
    assert set(batched) == set(alone)
    for task in alone:
        if "scores" in alone[task]:
            assert batched[task]["label"] == alone[task]["label"]
            for label, p in alone[task]["scores"].items():
                assert batched[task]["scores"][label] == pytest.approx(p, abs=1e-4)
        else:
            assert [(e["label"], e["start"], e["end"]) for e in batched[task]["entities"]] == \
                   [(e["label"], e["start"], e["end"]) for e in alone[task]["entities"]]


def test_concurrent_requests_share_passes_and_get_their_own_answers(tiny_store, tiny_backbone):
    requests = [([TEXTS[i % 5], TEXTS[(i + 2) % 5]][: 1 + i % 2], TASK_SETS[i % 5]) for i in range(20)]
    with serve(tiny_store, tiny_backbone, batching=False) as server:
        alone = asyncio.run(fire(server.url, requests))
    with serve(tiny_store, tiny_backbone, max_wait_ms=200) as server:
        batched = asyncio.run(fire(server.url, requests))
        metrics = httpx.get(server.url + "/metrics").text
    for (inputs, tasks), a, b in zip(requests, alone, batched):
        assert a.status_code == b.status_code == 200
        for row_a, row_b in zip(a.json()["results"], b.json()["results"]):
            assert set(row_b) == set(tasks.split(","))  # only the tasks this request asked for
            assert_same_answer(row_b, row_a)
    requests_sum, passes = histogram_sum_count(metrics, "tmod_batch_requests")
    assert requests_sum == 20 and passes < 20  # some backbone passes answered several requests
    rows_sum, _ = histogram_sum_count(metrics, "tmod_batch_size")
    assert rows_sum == sum(len(inputs) for inputs, _ in requests)


def test_pairs_and_single_texts_are_never_mixed_in_a_batch(tiny_store, tiny_backbone):
    pair = {"text": "Paris is big.", "text_pair": "London is bigger."}
    requests = [(["Paris is big."], "sentiment"), ([pair], "sentiment")] * 3
    with serve(tiny_store, tiny_backbone, batching=False) as server:
        alone = asyncio.run(fire(server.url, requests))
    with serve(tiny_store, tiny_backbone, max_wait_ms=200) as server:
        batched = asyncio.run(fire(server.url, requests))
    for a, b in zip(alone, batched):
        assert_same_answer(b.json()["results"][0], a.json()["results"][0])


def test_full_queue_answers_429_at_once(tiny_store, tiny_backbone):
    with serve(tiny_store, tiny_backbone, max_queue=2, max_batch_size=2, max_wait_ms=500) as server:
        responses = asyncio.run(fire(server.url, [(["some text"], "sentiment")] * 12))
        metrics = httpx.get(server.url + "/metrics").text
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429} and statuses.count(429) >= 1 and statuses.count(200) >= 2
    refused = next(r for r in responses if r.status_code == 429).json()["error"]
    assert refused["type"] == "overloaded" and "queue is full" in refused["message"]
    assert 'tmod_request_errors_total{type="overloaded"}' in metrics


def test_requests_past_their_deadline_are_dropped_before_compute(tiny_store, tiny_backbone):
    with serve(tiny_store, tiny_backbone, max_wait_ms=800, request_timeout_s=0.2) as server:
        response = httpx.post(server.url + "/v1/infer", json={"inputs": ["late"]}, timeout=30)
        metrics = httpx.get(server.url + "/metrics").text
    assert response.status_code == 503 and response.json()["error"]["type"] == "deadline_exceeded"
    assert 'tmod_dropped_requests_total{reason="deadline"} 1.0' in metrics
    assert "tmod_batch_size_count 0.0" in metrics  # no backbone pass ran for it


def test_requests_whose_client_left_are_dropped_before_compute(tiny_store, tiny_backbone):
    with serve(tiny_store, tiny_backbone, max_wait_ms=800) as server:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/infer", json={"inputs": ["impatient"]}, timeout=0.2)
        # the batch window closes; the batcher finds the client gone
        wait_until(lambda: metric_sample(httpx.get(server.url + "/metrics").text,
                                         'tmod_dropped_requests_total{reason="client_gone"}') == 1,
                   "the request to be dropped")
        metrics = httpx.get(server.url + "/metrics").text
    assert "tmod_batch_size_count 0.0" in metrics


def test_length_runs_bound_padding():
    from server.runner.shapes import length_runs
    lengths = [3, 4, 4, 5, 9, 10, 30, 31]
    runs = length_runs(lengths, 1.25)
    assert [lengths[r] for r in runs] == [[3, 4, 4, 5], [9, 10], [30, 31]]
    for r in runs:
        part = lengths[r]
        assert len(part) * max(part) <= 1.25 * sum(part)
    assert length_runs(lengths, 1e9) == [slice(0, 8)]  # no cutting: one pass
    assert length_runs([7], 1.0) == [slice(0, 1)] and length_runs([], 1.25) == []
