"""Hardening (issue 26): modules prove themselves before they serve, a failing head fails only its
own task, errors keep their shape and request id, overload and deadlines answer on time, a store
serves the best artifact it has, and a process that cannot serve exits."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch

from modules_store import ArtifactError, ModuleStore
from modules_store.store import WEIGHTS_FILE
from server.api.app import create_app
from server.config import Settings
from server.heads.layermix import LayerMixConfig, LayerMixHead
from server.logs import JsonFormatter
from server.modules import load_module, save_module
from server.probe import probe_module
from server.timings import Timings
from bench.live_server import wait_until
from tests.helpers import LiveServer, metric_sample, populate_store, random_head

TOKEN = "hardening-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
TEXTS = ["A fine film.", "Peter met Angela in Paris."]


def live_app(store_root, backbone, **settings):
    settings = Settings(store=store_root, admin_token=TOKEN, head_precision="fp32", **settings)
    return create_app(settings, backbone=backbone)


# ---- a module proves itself before it serves ------------------------------------------------------
def nan_module(backbone):
    head = random_head(backbone, "sequence_classification", ["negative", "positive"], 5)
    with torch.no_grad():
        head.projections[0, 0, 0] = float("nan")
    return head


def exploding_module(backbone):
    """Finite weights whose layer mix is NaN: softmax over +-inf logits (the poisoned batches of the
    issue came from such a mix: it reads no layer)."""
    head = random_head(backbone, "sequence_classification", ["negative", "positive"], 6)
    with torch.no_grad():
        head.layer_logits.copy_(torch.tensor([3e38, -3e38] * (len(head.layer_logits) // 2)
                                             + [3e38] * (len(head.layer_logits) % 2)))
    return head


def test_store_refuses_non_finite_weights_naming_the_tensor(tmp_path, tiny_backbone):
    store = ModuleStore(tmp_path)
    save_module(store, "sentiment", "1", nan_module(tiny_backbone), tiny_backbone)  # its checksum is right
    with pytest.raises(ArtifactError) as caught:
        load_module(store, "sentiment", None, tiny_backbone)
    assert caught.value.reason == "non_finite" and "'projections'" in caught.value.message


def test_probe_refuses_a_module_whose_outputs_are_not_finite(tmp_path, tiny_backbone):
    store = ModuleStore(tmp_path)
    save_module(store, "sentiment", "1", exploding_module(tiny_backbone), tiny_backbone)
    with pytest.raises(ArtifactError) as caught:
        load_module(store, "sentiment", None, tiny_backbone, probe=probe_module)
    assert caught.value.reason == "probe_failed"


def test_probe_checks_output_shapes_against_the_manifest(tmp_path, tiny_backbone):
    from dataclasses import replace

    store = ModuleStore(tmp_path)
    save_module(store, "sentiment", "1", random_head(tiny_backbone, "sequence_classification",
                                                     ["negative", "positive"], 1), tiny_backbone)
    module = load_module(store, "sentiment", None, tiny_backbone)
    probe_module(module, tiny_backbone)  # as stored: passes
    wrong = replace(module, manifest=module.manifest.model_copy(update={"labels": ["a", "b", "c"]}))
    with pytest.raises(ArtifactError) as caught:
        probe_module(wrong, tiny_backbone)  # two outputs per row, where the manifest names three labels
    assert caught.value.reason == "probe_failed" and "(2, 2)" in caught.value.message


def test_admin_load_of_a_nan_module_answers_409_and_others_keep_serving(tmp_path, tiny_backbone):
    store = populate_store(tmp_path / "store", tiny_backbone)
    save_module(store, "sentiment", "2", nan_module(tiny_backbone), tiny_backbone)
    save_module(store, "sentiment", "3", exploding_module(tiny_backbone), tiny_backbone)
    with LiveServer(live_app(store.root, tiny_backbone, tasks="sentiment,ner")) as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        for version, reason, named in (("2", "artifact_non_finite", "'projections'"),
                                       ("3", "artifact_probe_failed", "not finite")):
            response = client.post("/admin/modules/sentiment/load", json={"version": version}, headers=AUTH)
            assert response.status_code == 409, response.text
            assert response.json()["error"]["type"] == reason and named in response.json()["error"]["message"]
        answer = client.post("/v1/infer", json={"inputs": TEXTS})
        assert answer.status_code == 200 and answer.json()["tasks"] == {"sentiment": "1", "ner": "1"}
        assert all(isinstance(r["sentiment"]["score"], float) for r in answer.json()["results"])
        # at start-up the newest good version was served (3 and 2 refused), then each admin load refused
        assert "sentiment/3" in client.get("/readyz").json()["refused"]["sentiment"]
        metrics = client.get("/metrics").text
        assert metric_sample(metrics, 'tmod_module_refusals_total{reason="non_finite"}') == 2
        assert metric_sample(metrics, 'tmod_module_refusals_total{reason="probe_failed"}') == 2


# ---- a failing head fails only its own task -------------------------------------------------------------
def fragile_store(root: Path, backbone) -> ModuleStore:
    """sentiment and ner (grouped: one width), and `fragile`, a head of another width (it runs alone)."""
    store = populate_store(root, backbone)
    torch.manual_seed(9)
    head = LayerMixHead(LayerMixConfig(task_type="sequence_classification", num_labels=2, hidden_size=backbone.hidden_size,
                                       layers=[1, 2], project_dim=8, attention_heads=2), ["no", "yes"]).eval()
    save_module(store, "fragile", "1", head, backbone)
    return store


def break_head(runtime, task: str) -> None:
    def finish(state, batch):
        raise RuntimeError("forced failure in the head")
    runtime.modules[task].head.finish = finish  # forced to raise during every pass from now on


def test_a_head_that_raises_fails_only_its_own_task_in_a_shared_batch(tmp_path, tiny_backbone):
    store = fragile_store(tmp_path / "store", tiny_backbone)
    with LiveServer(live_app(store.root, tiny_backbone, tasks="sentiment,ner,fragile")) as server:
        runtime = server.server.config.app.state.runtime
        break_head(runtime, "fragile")
        rows = runtime.encode(TEXTS * 2, None, False, None)
        outputs = runtime.run_batch(rows, dict(runtime.modules), Timings())  # one batch, all three tasks
        from server.runner.failures import HeadFailed# (imported here: the module's other tests run without it)

        assert all(isinstance(answer, HeadFailed) for answer in outputs["fragile"])
        assert all(isinstance(answer, dict) and "entities" in answer for answer in outputs["ner"])
        assert all(isinstance(answer, dict) and "label" in answer for answer in outputs["sentiment"])


def test_requests_batched_with_a_failing_head_answer_200(tmp_path, tiny_backbone):
    store = fragile_store(tmp_path / "store", tiny_backbone)
    app = live_app(store.root, tiny_backbone, tasks="sentiment,ner,fragile", max_wait_ms=1000)
    with LiveServer(app) as server:
        runtime = server.server.config.app.state.runtime
        break_head(runtime, "fragile")
        answers = {}

        def ask(tasks):
            answers[tasks] = httpx.post(server.url + "/v1/infer", params={"tasks": tasks}, json={"inputs": TEXTS},
                                        timeout=60)

        threads = [threading.Thread(target=ask, args=(t,)) for t in ("ner", "sentiment", "fragile", "ner,fragile")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert answers["ner"].status_code == 200 and answers["sentiment"].status_code == 200
        for tasks in ("fragile", "ner,fragile"):
            assert answers[tasks].status_code == 500
            assert answers[tasks].json()["error"]["type"] == "head_failed" and answers[tasks].headers["x-request-id"]
        # they shared a pass (the wait window holds the four): one batch answered several requests
        histogram = runtime.metrics.exposition().decode()
        assert metric_sample(histogram, 'tmod_batch_requests_bucket{le="1.0"}') < \
            metric_sample(histogram, "tmod_batch_requests_count")


# ---- shapes, request ids, overload and deadlines ---------------------------------------------------------
def test_a_queued_request_is_answered_503_at_its_deadline_while_compute_is_busy(tmp_path, tiny_backbone):
    store = populate_store(tmp_path / "store", tiny_backbone)
    app = live_app(store.root, tiny_backbone, tasks="sentiment", request_timeout_s=0.5)
    with LiveServer(app) as server:
        runtime = server.server.config.app.state.runtime
        release = threading.Event()
        runtime.executor.submit(release.wait)  # the compute thread is held until the test lets it go
        first = []
        thread = threading.Thread(target=lambda: first.append(
            httpx.post(server.url + "/v1/infer", json={"inputs": TEXTS}, timeout=60)))
        thread.start()
        try:
            wait_until(lambda: runtime.batcher._running, "the first request taken into a batch")
            queued = httpx.post(server.url + "/v1/infer", json={"inputs": TEXTS}, timeout=30)
            held = not release.is_set()  # compute is still held: the answer came from the deadline, not a dequeue
        finally:
            release.set()
            thread.join()
        assert held and queued.status_code == 503, queued.text
        assert queued.json()["error"]["type"] == "deadline_exceeded" and queued.headers["x-request-id"]
        assert first[0].status_code == 200  # taken into a batch before its deadline: answered


def test_429_says_when_to_retry(tmp_path, tiny_backbone, tiny_backbone_dir):
    from server.heads.embedding import EmbeddingHead

    store = populate_store(tmp_path / "store", tiny_backbone)
    save_module(store, "embedding", "1", EmbeddingHead.from_backbone(tiny_backbone, tiny_backbone_dir), tiny_backbone)
    app = live_app(store.root, tiny_backbone, tasks="sentiment,embedding", max_queue=1, retry_after_s=3)
    with LiveServer(app) as server:
        runtime = server.server.config.app.state.runtime
        release = threading.Event()
        runtime.executor.submit(release.wait)
        results = []
        first = threading.Thread(target=lambda: results.append(
            httpx.post(server.url + "/v1/infer", json={"inputs": TEXTS}, timeout=60)))
        second = threading.Thread(target=lambda: results.append(
            httpx.post(server.url + "/v1/infer", json={"inputs": TEXTS}, timeout=60)))
        first.start()
        try:
            wait_until(lambda: runtime.batcher._running, "the first request taken into a batch")
            second.start()
            wait_until(lambda: runtime.batcher.depth() == 1, "the second request queued")
            refused = httpx.post(server.url + "/v1/infer", json={"inputs": TEXTS}, timeout=30)
            oip_refused = httpx.post(server.url + "/v2/models/sentiment/infer", timeout=30, json={
                "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["a"]}]})
            openai_refused = httpx.post(server.url + "/v1/embeddings", json={"model": "embedding", "input": "a"})
            tei_refused = httpx.post(server.url + "/embed", json={"inputs": "a"})
        finally:
            release.set()
            first.join()
            if second.is_alive() or second.ident:
                second.join()
        assert refused.status_code == 429 and refused.headers["retry-after"] == "3"
        assert oip_refused.status_code == 429 and oip_refused.headers["retry-after"] == "3"
        assert isinstance(oip_refused.json()["error"], str)
        assert openai_refused.status_code == 429 and openai_refused.headers["retry-after"] == "3"
        assert openai_refused.json()["error"]["code"] == "overloaded"  # OpenAI's shape: message, type, param, code
        assert tei_refused.status_code == 429 and tei_refused.headers["retry-after"] == "3"
        assert tei_refused.json()["error_type"] == "Overloaded"  # TEI's shape
        assert [r.status_code for r in results] == [200, 200]


class CapturedLog(logging.Handler):
    def __init__(self):
        super().__init__()
        self.setFormatter(JsonFormatter())
        self.lines: list[dict] = []

    def emit(self, record):
        self.lines.append(json.loads(self.format(record)))


def test_json_log_lines_keep_extra_fields_but_not_uvicorns_colour_codes():
    record = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, "Finished server process [%d]", (7,), None)
    record.color_message, record.task = "Finished server process [\x1b[36m%d\x1b[0m]", "ner"  # as uvicorn logs it
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "Finished server process [7]" and line["task"] == "ner" and "color_message" not in line
    assert line["logger"] == "uvicorn"  # its server's lines, of every level, come as "uvicorn.error"


def test_log_lines_are_text_on_a_terminal_and_json_elsewhere(monkeypatch):
    """Started by a person in a terminal (the README's first command), every line was a JSON object;
    auto writes text there and JSON where a collector reads (a pipe, a file, a container)."""
    from server.logs import TextFormatter, log_formatter

    record = logging.LogRecord("tmod.access", logging.INFO, __file__, 1, "request", (), None)
    record.method, record.status = "POST", 200
    text = TextFormatter().format(record)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z info    tmod\.access: request method=POST "
                        r"status=200", text)
    for tty, chosen in ((True, TextFormatter), (False, JsonFormatter)):
        monkeypatch.setattr(sys.stderr, "isatty", lambda tty=tty: tty)
        assert type(log_formatter("auto")) is chosen
        assert type(log_formatter("json")) is JsonFormatter and type(log_formatter("text")) is TextFormatter


def raw_get(sock: socket.socket, path: str) -> tuple[int, dict, bytes]:
    sock.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def test_an_unhandled_error_keeps_its_shape_request_id_log_line_and_connection(tmp_path, tiny_backbone, monkeypatch):
    store = populate_store(tmp_path / "store", tiny_backbone)
    with LiveServer(live_app(store.root, tiny_backbone, tasks="sentiment")) as server:
        runtime = server.server.config.app.state.runtime

        def describe(module):
            raise KeyError("a bug")
        monkeypatch.setattr(runtime, "describe", describe)
        monkeypatch.setattr("server.api.oip.model_metadata", describe)
        captured = CapturedLog()
        logging.getLogger("tmod").addHandler(captured)
        try:
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
                status, headers, body = raw_get(sock, "/v1/tasks")
                assert status == 500 and json.loads(body)["error"]["type"] == "internal_error"
                rid = headers["x-request-id"]
                status, headers, body = raw_get(sock, "/v2/models/sentiment")  # the same connection
                assert status == 500 and isinstance(json.loads(body)["error"], str) and headers["x-request-id"]
                status, _, _ = raw_get(sock, "/healthz")
                assert status == 200
        finally:
            logging.getLogger("tmod").removeHandler(captured)
        tracebacks = [line for line in captured.lines if "exception" in line]
        assert tracebacks and tracebacks[0]["request_id"] == rid and "KeyError" in tracebacks[0]["exception"]


def test_body_size_refusals_are_counted(tmp_path, tiny_backbone):
    store = populate_store(tmp_path / "store", tiny_backbone)
    with LiveServer(live_app(store.root, tiny_backbone, tasks="sentiment", max_body_bytes=4096)) as server:
        def chunked():
            for _ in range(4):
                yield b"x" * 2048
        response = httpx.post(server.url + "/v1/infer", content=chunked(), headers={"content-type": "application/json"})
        assert response.status_code == 413 and response.json()["error"]["type"] == "payload_too_large"
        declared = httpx.post(server.url + "/v1/infer", json={"inputs": ["x" * 5000]})
        assert declared.status_code == 413
        metrics = httpx.get(server.url + "/metrics").text
        assert metric_sample(metrics, 'tmod_request_errors_total{type="payload_too_large"}') == 2


# ---- the store serves the best artifact it has --------------------------------------------------------
def test_restart_with_a_corrupt_newest_version_serves_the_previous_one_and_says_so(tmp_path, tiny_backbone):
    store = populate_store(tmp_path / "store", tiny_backbone)
    folder = save_module(store, "sentiment", "2", random_head(tiny_backbone, "sequence_classification",
                                                              ["negative", "positive"], 4), tiny_backbone)
    weights = folder / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-16] + b"\0" * 16)  # corrupted on disk: its checksum fails
    broken_manifest = store.path("ner", "1").parent / "2"
    broken_manifest.mkdir()
    (broken_manifest / "manifest.json").write_text("{not json")
    with LiveServer(live_app(store.root, tiny_backbone)) as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        served = {t["task"]: t["version"] for t in client.get("/v1/tasks").json()["tasks"]}
        assert served == {"sentiment": "1", "ner": "1", "acceptability": "1"}
        ready = client.get("/readyz")
        assert ready.status_code == 200
        refused = ready.json()["refused"]
        assert set(refused) == {"sentiment", "ner"}
        assert "sentiment/2" in refused["sentiment"] and "checksum" in refused["sentiment"]
        assert "serving sentiment/1" in refused["sentiment"] and "serving ner/1" in refused["ner"]
        metrics = client.get("/metrics").text
        assert metric_sample(metrics, "tmod_modules_refused") == 2
        assert metric_sample(metrics, 'tmod_module_refusals_total{reason="checksum_mismatch"}') == 1
        assert metric_sample(metrics, 'tmod_module_refusals_total{reason="bad_manifest"}') == 1


def test_a_version_pinned_in_tasks_is_served_and_never_swapped_for_another(tmp_path, tiny_backbone):
    """--tasks sentiment/1: a rollback that holds across restarts (the newest, sentiment/2, was what
    every start loaded); a pinned version that fails its checks is refused, not replaced."""
    store = populate_store(tmp_path / "store", tiny_backbone)
    save_module(store, "sentiment", "2", random_head(tiny_backbone, "sequence_classification",
                                                     ["negative", "positive"], 4), tiny_backbone)
    folder = save_module(store, "ner", "2", random_head(tiny_backbone, "token_classification",
                                                        ["O", "B-PER", "I-PER"], 5), tiny_backbone)
    weights = folder / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-16] + b"\0" * 16)  # corrupted on disk: its checksum fails
    with LiveServer(live_app(store.root, tiny_backbone, tasks="sentiment/1,ner/2,acceptability")) as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        served = {t["task"]: t["version"] for t in client.get("/v1/tasks").json()["tasks"]}
        assert served == {"sentiment": "1", "acceptability": "1"}  # not sentiment/2; ner/1 not served instead
        refused = client.get("/readyz").json()["refused"]
        assert set(refused) == {"ner"} and "ner/2" in refused["ner"] and "checksum" in refused["ner"]
        answer = client.post("/v1/infer", params={"tasks": "sentiment"}, json={"inputs": ["A fine film."]})
        assert answer.json()["tasks"] == {"sentiment": "1"}
        reloaded = client.post("/admin/modules/sentiment/reload", headers=AUTH)  # the loaded version again
        assert reloaded.status_code == 200 and reloaded.json()["version"] == "1"


def test_a_request_for_a_task_refused_at_load_says_why(tmp_path, tiny_backbone):
    store = populate_store(tmp_path / "store", tiny_backbone)
    weights = store.path("acceptability", "1") / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-16] + b"\0" * 16)  # its only version: refused, nothing served
    with LiveServer(live_app(store.root, tiny_backbone)) as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        v1 = client.post("/v1/infer", params={"tasks": "acceptability,ner"}, json={"inputs": ["A fine film."]})
        assert v1.status_code == 400 and v1.json()["error"]["type"] == "unknown_task"
        message = v1.json()["error"]["message"]
        assert message.startswith("unknown task(s) ['acceptability'] (acceptability was refused at load: "
                                  "acceptability/1: checksum mismatch"), message
        assert message.endswith("; loaded tasks: ['ner', 'sentiment']")
        oip = client.post("/v2/models/acceptability/infer", json={"inputs": [
            {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["A fine film."]}]})
        assert oip.status_code == 404 and "(acceptability was refused at load: acceptability/1: checksum mismatch" in oip.json()["error"]


def test_store_refuses_names_that_are_not_plain_names(tmp_path):
    store = ModuleStore(tmp_path)
    for task, version in (("..", "1"), ("sentiment", "../ner/1"), ("sentiment", "/etc"), ("sentiment", "1\n")):
        with pytest.raises(ArtifactError) as caught:
            store.read_manifest(task, version)
        assert caught.value.reason == "invalid_name"


# ---- start-up: a process that cannot serve exits ----------------------------------------------------------
@pytest.mark.parametrize("layout", [["--workers", "1"], ["--workers", "2"], ["--workers", "2", "--engines", "2"]])
def test_a_backbone_that_cannot_load_exits_non_zero_with_the_reason_on_stderr(tmp_path, layout):
    empty = tmp_path / "empty-backbone"  # a model folder (what is checked before start-up) without weights
    empty.mkdir()
    (empty / "config.json").write_text('{"model_type": "bert"}')
    process = subprocess.run(
        [sys.executable, "-m", "server.cli", "--port", "0", "--backbone", str(empty), "--store", str(tmp_path),
         *layout],
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=120)
    assert process.returncode != 0
    lines = [line for line in process.stderr.splitlines() if line.startswith("tmod-serve: cannot serve")]
    assert len(lines) == 1 and str(empty) in lines[0], process.stderr[-2000:]


def test_a_backbone_name_tmod_does_not_know_is_named_in_one_line(tmp_path):
    process = subprocess.run([sys.executable, "-m", "server.cli", "--port", "0", "--backbone", "MiniLM", "--store",
                              str(tmp_path)], env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                             timeout=120)
    assert process.returncode != 0
    assert [line for line in process.stderr.splitlines() if line.startswith("tmod-serve:")] == [
        "tmod-serve: --backbone / TMOD_BACKBONE: no backbone 'MiniLM': name one of minilm, smollm2, mpnet, or a "
        "local Hugging Face model folder (nothing is downloaded from a model hub)"]  # before anything loads
    assert process.stderr.startswith("tmod-serve:"), process.stderr[-2000:]


def test_cache_dir_is_where_a_named_backbone_is_found(tmp_path):
    from server.backbone.sources import MPNET_FOLDER, MPNET_ZIP_SHA256
    from server.runtime import Runtime
    from tests.helpers import make_tiny_backbone_dir

    cache = tmp_path / "cache"
    made = make_tiny_backbone_dir(tmp_path, "mpnet", layers=2)
    (cache / "backbones").mkdir(parents=True)
    shutil.move(made, cache / "backbones" / f"{MPNET_FOLDER}-{MPNET_ZIP_SHA256[:12]}")
    runtime = Runtime(Settings(backbone="mpnet", cache_dir=cache, store=tmp_path / "no-store"))
    try:
        runtime.start()  # in this thread: loads the backbone from the cache the flag names
        assert runtime.startup_error is None and runtime.ready.is_set()
        assert runtime.backbone.hidden_size == 32 and runtime.backbone.num_layers == 2
    finally:
        runtime.close()
