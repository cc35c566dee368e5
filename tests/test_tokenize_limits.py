"""Tokenize answers are bounded and built off the event loop (issue 38, item 3), over a real loopback
server: a request over `max_tokenize_chars` answers 413 before anything is tokenized, and while an
answer is being built (held here until /healthz has answered) the server keeps answering /healthz."""
from __future__ import annotations

import threading

import httpx
import pytest

from server.api import tokenize
from server.api.app import create_app
from server.config import Settings
from tests.helpers import LiveServer

CAP = 5000
ROUTES = {"/v1/tokenize": "describe", "/tokenize": "tei_tokens"}


@pytest.fixture(scope="module")
def live(tiny_store, tiny_backbone):
    settings = Settings(store=tiny_store.root, head_precision="fp32", max_chars=20_000, max_tokenize_chars=CAP)
    with LiveServer(create_app(settings, backbone=tiny_backbone)) as server:
        yield server


@pytest.mark.parametrize("route", ROUTES)
def test_a_tokenize_request_over_the_character_cap_answers_413(live, route):
    text = "word " * (CAP // 5)
    assert httpx.post(live.url + route, json={"inputs": [text[:CAP // 2], text[:CAP // 2]]}).status_code == 200
    refused = httpx.post(live.url + route, json={"inputs": [text, "one more"]})
    assert refused.status_code == 413, refused.text[:200]
    body = refused.json()
    if route == "/tokenize":  # TEI's error shape: {"error": message, "error_type"}
        assert body["error_type"] == "Validation" and str(CAP) in body["error"]
    else:
        assert body["error"]["type"] == "too_many_characters" and str(CAP) in body["error"]["message"]


@pytest.mark.parametrize("route", ROUTES)
def test_healthz_answers_while_a_tokenize_answer_is_built(live, route, monkeypatch):
    """The answer's builder is held until /healthz has answered: were it built on the event loop,
    /healthz could not answer (it times out, and the builder is let go only then)."""
    healthz_answered, building = threading.Event(), threading.Event()
    build = getattr(tokenize, ROUTES[route])

    def held(*args, **kwargs):
        building.set()
        healthz_answered.wait(timeout=20)
        return build(*args, **kwargs)

    monkeypatch.setattr(tokenize, ROUTES[route], held)
    answers = []
    client = threading.Thread(target=lambda: answers.append(
        httpx.post(live.url + route, json={"inputs": ["A text of " + "many words " * 300]}, timeout=60)))
    client.start()
    try:
        assert building.wait(timeout=30)
        health = httpx.get(live.url + "/healthz", timeout=5)
        healthz_answered.set()
    finally:
        healthz_answered.set()
        client.join()
    assert health.status_code == 200
    assert answers[0].status_code == 200 and answers[0].json()
