"""End to end: the real `tmod-serve` process on the real default backbone, over loopback."""
from __future__ import annotations

import json
import os
import signal
import unicodedata
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from bench.live_server import wait_until
from tests.helpers import metric_sample, populate_store, start_tmod_serve


@pytest.fixture(scope="module")
def served(tmp_path_factory, minilm):
    store = populate_store(tmp_path_factory.mktemp("minilm-store"), minilm)
    # a 1 s batch window: requests sent together wait for each other, so the SIGTERM test finds them in flight
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMOD_MAX_INPUTS": "4", "TMOD_MAX_WAIT_MS": "1000"}
    url, process = start_tmod_serve(["--store", str(store.root), "--log-level", "info"], env)
    yield url, process
    if process.poll() is None:
        process.kill()


@pytest.mark.smoke
def test_real_backbone_serves_several_tasks_in_one_pass(served, minilm):
    url, _ = served
    text = "Angela Merkel visited the Siemens plant in Munich."
    response = httpx.post(url + "/v1/infer", params={"tasks": "ner,sentiment"}, json={"inputs": [text]}, timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == {"backbone": "all-MiniLM-L6-v2", "fingerprint": minilm.fingerprint.short}
    result = body["results"][0]
    assert set(result) == {"ner", "sentiment"}
    for entity in result["ner"]["entities"]:
        assert text[entity["start"]:entity["end"]] == entity["text"]
    tasks = httpx.get(url + "/v1/tasks", timeout=10).json()
    assert tasks["backbone"]["backbone"] == "all-MiniLM-L6-v2"
    assert all(t["backbone"]["num_layers"] == 6 and t["backbone"]["hidden_size"] == 384 for t in tasks["tasks"])


def test_env_settings_reach_the_server(served):
    url, _ = served
    response = httpx.post(url + "/v1/infer", json={"inputs": ["a"] * 5}, timeout=30)  # TMOD_MAX_INPUTS=4
    assert response.status_code == 413 and "at most 4" in response.json()["error"]["message"]


def test_sigterm_drains_in_flight_requests_then_exits(served):
    url, process = served
    response = httpx.post(url + "/v1/infer", json={"inputs": ["traced"]}, headers={"x-request-id": "trace-123"})
    assert response.headers["x-request-id"] == "trace-123"
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"  # a W3C traceparent's trace id, where no x-request-id is given
    traced = httpx.post(url + "/v1/infer", json={"inputs": ["traced"]},
                        headers={"traceparent": f"00-{trace}-00f067aa0ba902b7-01"})
    assert traced.status_code == 200 and traced.headers["x-request-id"] == trace
    long_inputs = [" ".join(["The European Commission said on Thursday it disagreed."] * 12)] * 4

    def slow_request():
        return httpx.post(url + "/v1/infer", json={"inputs": long_inputs}, timeout=120)

    answered = 'tmod_requests_total{outcome="success"}'
    answered_before = metric_sample(httpx.get(url + "/metrics").text, answered)

    def reached_the_server():  # in flight, or already answered; one scrape, so the two numbers agree
        page = httpx.get(url + "/metrics").text
        return metric_sample(page, "tmod_requests_in_flight") + metric_sample(page, answered) - answered_before >= 6

    with ThreadPoolExecutor(6) as pool:
        pending = [pool.submit(slow_request) for _ in range(6)]
        wait_until(reached_the_server, "the six requests to reach the server")
        process.send_signal(signal.SIGTERM)
        statuses = [f.result().status_code for f in pending]
    assert statuses == [200] * 6  # nothing in flight was dropped
    # uvicorn shuts down gracefully, then re-raises the captured SIGTERM on itself
    assert process.wait(timeout=60) in (0, -signal.SIGTERM)
    lines = process.stdout.read().splitlines()
    assert not any("Traceback" in line for line in lines)
    records = [json.loads(line) for line in lines if line.strip()]  # each line one JSON object, no progress bar
    access = [r for r in records if r["logger"] == "tmod.access"]
    assert any(r["request_id"] == "trace-123" and r["path"] == "/v1/infer" and r["status"] == 200 for r in access)
    assert any(r["request_id"] == trace and r["path"] == "/v1/infer" and r["status"] == 200 for r in access)
    assert all(len(r["request_id"]) >= 8 for r in access)


@pytest.mark.smoke
def test_shipped_modules_answer_sensibly_on_the_real_backbone(minilm):
    """The modules that ship in modules_store/ load on the default backbone and do their jobs."""
    from server.api.app import create_app
    from server.config import Settings
    from tests.helpers import LiveServer

    text = "Angela Merkel visited the Siemens plant in Munich. What a great trip!"
    with LiveServer(create_app(Settings(), backbone=minilm)) as server:
        assert httpx.get(server.url + "/readyz").json()["refused"] == {}
        body = httpx.post(server.url + "/v1/infer", params={"tasks": "ner,acceptability"},
                          json={"inputs": [text, "The cat sat the on mat."]}, timeout=60).json()
        tasks = {t["task"]: t["inputs"] for t in httpx.get(server.url + "/v1/tasks").json()["tasks"]}
        thanks = httpx.post(server.url + "/v1/infer", params={"tasks": "emotion"}, timeout=60,
                            json={"inputs": ["Thank you so much, this made my day!"]}).json()
        decomposed = unicodedata.normalize("NFD", "Angela Merkel visited Bogotá.")  # as macOS writes it
        accents = httpx.post(server.url + "/v1/infer", params={"tasks": "ner"}, json={"inputs": [decomposed]},
                             timeout=60).json()["results"][0]["ner"]["entities"]
    # entailment/1 and sentiment/1 are opt-in on MiniLM (docs/quality.md): served when named
    with LiveServer(create_app(Settings(tasks="entailment,sentiment"), backbone=minilm)) as server:
        pair = {"text": "Angela Merkel visited Munich in May.", "text_pair": "Merkel was in Munich."}
        paired = httpx.post(server.url + "/v1/infer", params={"tasks": "entailment"}, json={"inputs": [pair]},
                            timeout=60).json()
        feeling = httpx.post(server.url + "/v1/infer", params={"tasks": "sentiment"}, json={"inputs": [text]},
                             timeout=60).json()
    assert tasks == {"ner": "text", "acceptability": "text", "embedding": "text", "emotion": "text"}
    assert "gratitude" in thanks["results"][0]["emotion"]["labels"]
    assert paired["results"][0]["entailment"]["label"] in ("entailment", "not_entailment")
    first, second = body["results"]
    assert {(e["text"], e["label"]) for e in first["ner"]["entities"]} == {
        ("Angela Merkel", "PER"), ("Siemens", "ORG"), ("Munich", "LOC")}
    assert feeling["results"][0]["sentiment"]["label"] == "positive"
    # MiniLM's tokenizer strips the decomposed accent from its tokens; the entity still ends after it
    assert [(e["text"], e["label"]) for e in accents] == [("Angela Merkel", "PER"), ("Bogota\u0301", "LOC")]
    assert all(decomposed[e["start"]:e["end"]] == e["text"] for e in accents)
    assert first["acceptability"]["label"] == "acceptable" and second["acceptability"]["label"] == "unacceptable"
    assert set(body["tasks"]) == {"ner", "acceptability"}
