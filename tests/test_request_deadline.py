"""One deadline per request (issue 38, item 5): `request_timeout_s` runs from when a request's body
has been read and is shared by every part of a long request; parts not yet run when it passes are
not run, and the request is answered 503 deadline_exceeded. Against a server (one process, and a
real `tmod-serve --workers 2`) whose one head takes at least `slow_head.SECONDS` per pass."""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager

import httpx
import pytest

from modules_store import ModuleStore
from server.api.app import create_app
from server.config import Settings
from server.modules import save_module
from tests import slow_head
from bench.live_server import free_port, wait_until
from tests.helpers import LiveServer, metric_sample, random_head

TIMEOUT_S = 1.5
INPUTS = 12  # one part each (max_batch_size 1): 12 x SECONDS of passes, well past TIMEOUT_S


@contextmanager
def serving_slow(tmp_path, backbone_dir, backbone, workers: int):
    """A server of one slow sentiment head, `max_batch_size` 1 and `request_timeout_s` TIMEOUT_S: with
    `workers` 1 the app `tmod-serve` serves in one process, served from this one (LiveServer; the
    deadline lives in the app and the runtime, so no process start is needed to check it); with 2 a
    real `tmod-serve --workers 2`, whose workers forward each part to the engine process."""
    store = ModuleStore(tmp_path / "store")
    template = random_head(backbone, "sequence_classification", ["negative", "positive"], 1)
    head = slow_head.SlowHead(template.config, template.labels)
    head.load_state_dict(template.state_dict())
    save_module(store, "sentiment", "1", head.eval(), backbone)
    if workers == 1:
        settings = Settings(store=store.root, precision="fp32", max_batch_size=1, request_timeout_s=TIMEOUT_S)
        with LiveServer(create_app(settings, backbone=backbone)) as server:
            yield server.url
        return
    port = free_port()
    command = [sys.executable, "-c", "import sys, tests.slow_head; from server.cli import main; main(sys.argv[1:])",
               "--port", str(port), "--store", str(store.root), "--backbone", str(backbone_dir), "--precision", "fp32",
               "--workers", str(workers), "--max-batch-size", "1", "--request-timeout-s", str(TIMEOUT_S)]
    process = subprocess.Popen(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready():
        assert process.poll() is None, "tmod-serve exited during start-up"
        try:
            return httpx.get(url + "/readyz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(ready, "tmod-serve ready", timeout=180)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)


def passes_run(url: str) -> float:
    return metric_sample(httpx.get(url + "/metrics").text, "tmod_batch_requests_count")


@pytest.mark.parametrize("workers", [1, 2])
def test_a_request_of_many_parts_stops_at_its_one_deadline(tmp_path, tiny_backbone_dir, tiny_backbone, workers):
    with serving_slow(tmp_path, tiny_backbone_dir, tiny_backbone, workers) as url:
        before = passes_run(url)
        texts = [f"Text number {i} of a long request." for i in range(INPUTS)]
        answer = httpx.post(url + "/v1/infer", json={"inputs": texts}, timeout=120)
        assert answer.status_code == 503, answer.text[:300]
        assert answer.json()["error"]["type"] == "deadline_exceeded"
        # the parts left when the deadline passed never ran (each part is one batch of one request)
        ran = passes_run(url) - before
        assert 0 < ran < INPUTS, ran
        # a request that fits in its deadline is answered
        assert httpx.post(url + "/v1/infer", json={"inputs": texts[:1]}, timeout=60).status_code == 200
