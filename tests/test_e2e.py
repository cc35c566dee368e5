"""End to end: the real `tmod-serve` process on the real default backbone, over loopback."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.helpers import free_port, populate_store


@pytest.fixture(scope="module")
def served(tmp_path_factory, minilm):
    store = populate_store(tmp_path_factory.mktemp("minilm-store"), minilm)
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMOD_MAX_INPUTS": "4"}
    process = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "--port", str(port), "--store", str(store.root), "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    else:
        process.kill()
        pytest.fail(f"tmod-serve did not become ready:\n{process.communicate()[0]}")
    yield url, process
    if process.poll() is None:
        process.kill()


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


def test_sigterm_stops_cleanly(served):
    _, process = served
    process.send_signal(signal.SIGTERM)
    # uvicorn shuts down gracefully, then re-raises the captured SIGTERM on itself
    assert process.wait(timeout=60) in (0, -signal.SIGTERM)
    assert "Traceback" not in process.stdout.read()
