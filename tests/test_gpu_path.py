"""The GPU path, checked as far as a CPU can: safe capture (the stream restored on any failure),
page-locked staging bookkeeping, graph memory read from the pool, warm-up that captures the plans
and buckets requests run (and nothing on a request's path), graphs only for capturable backends,
sticky device errors that flip readiness and stop tmod-serve non-zero, /v1/tasks without device
reads. Real tiny backbone, real modules, real servers; CUDA-only code is driven with CPU tensors or
stand-ins for torch.cuda objects where it is pure bookkeeping."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

import server.runtime as runtime_module
from modules_store import ModuleStore
from server.api.app import create_app
from server.config import Settings
from server.engine import Engine
from server.modules import load_module, save_module, served_task_sets
from server.runner.failures import is_device_failure, is_out_of_memory
from server.runner.graphs import GraphCache, can_capture, capture_on, pool_bytes
from server.runner.model_runner import ModelRunner
from server.runner.shapes import Bucket
from server.runner.staging import StagingBuffers
from server.timings import Timings
from tests import device_failure_head
from tests.device_failure_head import MESSAGE, STUCK, TRIGGER, DeviceFailureHead
from bench.live_server import free_port, wait_until
from tests.helpers import LiveServer, populate_store, random_head
from tests.test_runner import TEXTS, assert_same_answers, record_eager, sorted_rows

PAIRS = ["He met her.", "It was dull.", "fine", "They agreed.", "Mixed reviews.", "A meeting."]


# ---- capture: the thread's stream comes back whatever happens ---------------------------------------
class FakeGraph:
    def __init__(self, end_fails=False):
        self.calls, self.end_fails = [], end_fails

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.calls.append(("begin", pool, capture_error_mode))

    def capture_end(self):
        self.calls.append(("end",))
        if self.end_fails:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")


class FakeStreamContext:
    """Stands in for torch.cuda.stream(s): records entering and leaving the capture stream."""

    def __init__(self, log):
        self.log = log

    def __enter__(self):
        self.log.append("on capture stream")

    def __exit__(self, *exc):
        self.log.append("stream restored")
        return False


@pytest.mark.parametrize("run_fails, end_fails", [(False, False), (True, False), (False, True), (True, True)])
def test_capture_ends_and_restores_the_stream_whatever_fails(run_fails, end_fails):
    streams, graph = [], FakeGraph(end_fails)

    def run():
        streams.append("run")
        if run_fails:
            raise RuntimeError("operation not permitted when stream is capturing")
        return "output"

    if run_fails or end_fails:
        with pytest.raises(RuntimeError):
            capture_on(graph, run, FakeStreamContext(streams), pool=(0, 1))
    else:
        assert capture_on(graph, run, FakeStreamContext(streams), pool=(0, 1)) == "output"
    assert streams == ["on capture stream", "run", "stream restored"]
    assert graph.calls == [("begin", (0, 1), "thread_local"), ("end",)]  # thread-local mode; capture always ended


def test_graph_memory_is_read_from_the_pool_segments():
    snapshot = [
        {"device": 0, "total_size": 2 << 20, "segment_pool_id": (1, 7)},
        {"device": 0, "total_size": 20 << 20, "segment_pool_id": (0, 0)},  # the ordinary cache
        {"device": 0, "total_size": 4 << 20, "segment_pool_id": (1, 7)},
        {"device": 1, "total_size": 8 << 20, "segment_pool_id": (1, 7)},  # another device
        {"device": 0, "total_size": 1 << 20, "segment_pool_id": (1, 8)},  # another pool
    ]
    assert pool_bytes(snapshot, (1, 7), 0) == 6 << 20
    assert pool_bytes(snapshot, (1, 7), 1) == 8 << 20
    assert pool_bytes(snapshot, (2, 2), 0) == 0


# ---- staging: two sets per bucket, taken and given back ------------------------------------------------
def test_staging_sets_are_taken_filled_and_given_back(tiny_backbone, tiny_store):
    modules = {t: load_module(tiny_store, t, None, tiny_backbone) for t in ("sentiment", "ner")}
    staging = StagingBuffers(pin=False)  # page-locked on cuda; the bookkeeping is the same
    bucket = Bucket(8, 64)
    staging.allocate([bucket], token_types=True, classes={"casing"})
    assert len(staging) == 2
    made = [s.tensors["input_ids"] for s in staging._free[bucket]]
    staging.allocate([bucket], token_types=True, classes={"casing"})  # a second warm-up keeps what exists
    assert [s.tensors["input_ids"] for s in staging._free[bucket]] == made
    wider = StagingBuffers(pin=False)
    wider.allocate([bucket], token_types=True, classes={"casing"})
    wider.allocate([bucket], token_types=True, classes={"casing", "segment"})  # a pair head loaded: new sets
    assert all("class:segment" in s.tensors for s in wider._free[bucket]) and len(wider) == 2

    def collate(texts):
        return tiny_backbone.text.collate(sorted_rows(tiny_backbone, texts), shape=(8, 64), device="cpu",
                                          classes={"casing"})

    first, second, third = collate(TEXTS[:3]), collate(TEXTS[3:]), collate(TEXTS[:2])
    a, set_a = staging.take(first, bucket)
    b, set_b = staging.take(second, bucket)
    assert set_a is not set_b
    assert staging.take(third, bucket) is None and staging.misses == 1  # both in flight: pageable, no wait
    for staged, original in ((a, first), (b, second)):
        assert any(staged.input_ids is t for t in made)  # the staging tensors, not new ones
        assert torch.equal(staged.input_ids, original.input_ids)
        assert torch.equal(staged.attention_mask, original.attention_mask)
        assert torch.equal(staged.classes["casing"], original.classes["casing"])
        assert staged.texts == original.texts and staged.filler_rows == original.filler_rows
    staging.give_back(set_a)
    c, set_c = staging.take(third, bucket)
    assert set_c is set_a and torch.equal(c.input_ids, third.input_ids)
    assert staging.take(first, Bucket(2, 32)) is None  # a bucket with no sets
    segment = tiny_backbone.text.collate(sorted_rows(tiny_backbone, TEXTS[:2], PAIRS[:2]), shape=(8, 64),
                                         device="cpu", classes={"segment"})
    staging.give_back(set_b)
    assert staging.take(segment, bucket) is None  # a class the sets do not hold: pageable

    # a runner in bucket mode with staging: passes run from the sets, given back after, answers unchanged
    runner = ModelRunner(Engine(tiny_backbone), Settings(batch_shapes="buckets", graph_batch_sizes="8",
                                                         graph_seq_lens="64", head_precision="fp32"))
    runner.staged = True
    runner.warm_up(modules)
    assert len(runner.staging) == 2 * len(runner.reachable_buckets())
    rows = sorted_rows(tiny_backbone, TEXTS)
    prepared = runner.prepare(rows, modules)
    assert all(p.staging is not None and p.staging.busy for p in prepared.passes)
    got = runner.execute(prepared, modules, Timings())
    assert all(p.staging is None for p in prepared.passes)
    assert not any(s.busy for sets in runner.staging._free.values() for s in sets)
    want = Engine(tiny_backbone).predict(tiny_backbone.collate(rows), modules)
    assert_same_answers(got, want)


# ---- warm-up: the plans and buckets requests run, nothing captured on a request's path ----------------
@pytest.fixture
def pair_store(tmp_path, tiny_backbone, tiny_store):
    """The tiny store's three single-text tasks and a pair task (entailment: pair pooling)."""
    store = ModuleStore(tmp_path / "store")
    for task in ("sentiment", "ner", "acceptability"):
        save_module(store, task, "1", load_module(tiny_store, task, None, tiny_backbone).head, tiny_backbone)
    save_module(store, "entailment", "1", random_head(tiny_backbone, "sequence_classification",
                                                      ["entailment", "not_entailment"], 31, pooling="pair"),
                tiny_backbone)
    return store


def test_warm_up_captures_what_default_requests_run_at_every_reachable_bucket(tiny_backbone, pair_store,
                                                                             monkeypatch):
    made, asked = [], []
    original_init, original_find = ModelRunner.__init__, GraphCache.find

    def init(self, engine, settings, metrics=None, capture=None):
        # the CPU's stand-in for capture_cuda_graph: the pass at a bucket, eager on static inputs
        capture, heads = record_eager(engine, [self])
        made.append(heads)
        original_init(self, engine, settings, metrics, capture=capture)

    def find(self, modules, bucket):
        found = original_find(self, modules, bucket)
        asked.append((frozenset(modules), bucket, found is not None))
        return found

    monkeypatch.setattr(ModelRunner, "__init__", init)
    monkeypatch.setattr(GraphCache, "find", find)
    settings = Settings(store=pair_store.root, batch_shapes="buckets", graph_batch_sizes="1,4,8",
                        graph_seq_lens="16,32,64", max_batch_tokens=64, max_inputs=8, head_precision="fp32")
    app = create_app(settings, backbone=tiny_backbone)
    runtime = app.state.runtime
    with LiveServer(app) as server:
        runner = runtime.runner
        reachable = runner.reachable_buckets()
        # 4 rows of 17 tokens (68 > 64 tokens: the old rule left 8x32 out) reach 8x32 through one request
        assert Bucket(8, 32) in reachable and Bucket(8, 64) in reachable
        captured = {frozenset(plan.modules): runner.graphs.buckets(plan) for plan in runner.graphs.plans()}
        assert captured == {frozenset({"sentiment", "ner", "acceptability", "entailment"}): reachable,
                            frozenset({"sentiment", "ner", "acceptability"}): reachable}
        assert {frozenset(heads) for heads in made[0]} == set(captured)
        captures = runner.graphs.captures
        single = httpx.post(server.url + "/v1/infer", json={"inputs": TEXTS[:3]})
        pair = httpx.post(server.url + "/v1/infer", json={"inputs": [{"text": t, "text_pair": p}
                                                                     for t, p in zip(TEXTS[:3], PAIRS)]})
        named = httpx.post(server.url + "/v1/infer", params={"tasks": "ner"}, json={"inputs": TEXTS[3:5]})
        assert single.status_code == pair.status_code == named.status_code == 200, (single.text, pair.text)
        assert runner.graphs.captures == captures  # nothing captured on a request's path
    # what the requests ran: the default single-text set, the pair set (their own graphs) and a subset
    # (the smallest captured superset's graph, its other outputs dropped), every one replayed
    assert [(set(tasks), found) for tasks, _, found in asked] == [
        ({"sentiment", "ner", "acceptability"}, True), ({"sentiment", "ner", "acceptability", "entailment"}, True),
        ({"ner"}, True)]
    assert runner.graphs.replays == 3
    # the subset built no plan of its own (stacks of its heads): the replayed plan serves it
    assert sorted(len(key) for key in runtime.engine._plans) == [3, 4]
    assert set(single.json()["results"][0]) == {"sentiment", "ner", "acceptability"}
    assert set(named.json()["results"][0]) == {"ner"}
    # the answers are those of eager passes of the requests' own sets
    modules = runtime.modules
    eager = Engine(tiny_backbone)
    for response, texts, pairs, tasks in ((single, TEXTS[:3], None, ("sentiment", "ner", "acceptability")),
                                          (pair, TEXTS[:3], PAIRS[:3], tuple(modules)),
                                          (named, TEXTS[3:5], None, ("ner",))):
        want = eager.predict(tiny_backbone.tokenize(texts, pairs), {t: modules[t] for t in tasks})
        assert_same_answers({t: [r[t] for r in response.json()["results"]] for t in tasks}, want)


def test_served_task_sets_follow_the_apps_rule(tiny_backbone, pair_store, tiny_store):
    with_pairs = {t: load_module(pair_store, t, None, tiny_backbone)
                  for t in ("sentiment", "ner", "acceptability", "entailment")}
    assert [set(s) for s in served_task_sets(with_pairs)] == [set(with_pairs), {"sentiment", "ner", "acceptability"}]
    singles = {t: with_pairs[t] for t in ("sentiment", "ner")}
    assert [set(s) for s in served_task_sets(singles)] == [{"sentiment", "ner"}]
    assert [set(s) for s in served_task_sets({"entailment": with_pairs["entailment"]})] == [{"entailment"}]


def test_graphs_only_for_backends_torch_can_capture(tiny_backbone):
    cuda = Settings.model_construct(device="cuda", cuda_graphs=True)
    assert can_capture(cuda, tiny_backbone)  # backend torch
    onnx = type("Onnx", (), {"backend": type("B", (), {"name": "onnx"})()})()
    assert not can_capture(cuda, onnx)  # ONNX Runtime on cuda: no capture tried
    assert not can_capture(Settings.model_construct(device="cuda", cuda_graphs=False), tiny_backbone)
    assert not can_capture(Settings(), tiny_backbone)  # the CPU
    runner = ModelRunner(Engine(tiny_backbone), Settings(batch_shapes="buckets"))
    assert not runner.graphs.enabled


# ---- a dead device -------------------------------------------------------------------------------------
def test_what_counts_as_a_sticky_device_error():
    assert is_device_failure(RuntimeError(MESSAGE))
    for text in ("CUDA error: device-side assert triggered", "CUDA error: unspecified launch failure",
                 "CUDA error: misaligned address", "CUDA error: an illegal instruction was encountered",
                 "CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, ...)`"):
        assert is_device_failure(RuntimeError(text)), text
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch's subclass for CUDA errors
    if accelerator_error is not None and issubclass(accelerator_error, RuntimeError):
        assert is_device_failure(accelerator_error(MESSAGE))
    for other in (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), torch.OutOfMemoryError("x"),
                  RuntimeError("mat1 and mat2 shapes cannot be multiplied"), ValueError(MESSAGE),
                  RuntimeError("operation not permitted when stream is capturing")):
        assert not is_device_failure(other), other
    assert not is_out_of_memory(RuntimeError(MESSAGE))


def device_failure_store(root, backbone) -> ModuleStore:
    store = ModuleStore(root)
    template = random_head(backbone, "sequence_classification", ["negative", "positive"], 5)
    head = DeviceFailureHead(template.config, template.labels)
    head.load_state_dict(template.state_dict())
    save_module(store, "fragile", "1", head.eval(), backbone)
    return store


def test_a_sticky_device_error_makes_the_server_not_ready_and_not_live(tiny_backbone, tmp_path, monkeypatch):
    monkeypatch.setattr(runtime_module, "_device_failure", None)  # process-wide: left as it was after the test
    store = device_failure_store(tmp_path, tiny_backbone)
    settings = Settings(store=store.root, precision="fp32")
    with LiveServer(create_app(settings, backbone=tiny_backbone)) as server:
        assert httpx.post(server.url + "/v1/infer", json={"inputs": ["fine"]}).status_code == 200
        failed = httpx.post(server.url + "/v1/infer", json={"inputs": [f"a {TRIGGER} here"]})
        assert failed.status_code == 503 and failed.json()["error"]["type"] == "device_failed"
        assert "an illegal memory access" in failed.json()["error"]["message"]
        for probe in ("/readyz", "/healthz", "/v2/health/ready"):
            response = httpx.get(server.url + probe)
            assert response.status_code == 503, probe
        assert httpx.get(server.url + "/readyz").json()["error"]["type"] == "device_failed"
        again = httpx.post(server.url + "/v1/infer", json={"inputs": ["fine"]})
        assert again.status_code == 503  # nothing more runs on the dead context
    assert runtime_module.device_failure() is not None


def assert_stuck_and_the_next_answered_503(url: str, limit: str, timeout: float) -> None:
    """A request whose pass never returns, and one sent behind it, are both answered 503 device_failed
    naming the pass timeout `limit` ("2 s")."""
    with ThreadPoolExecutor(2) as pool:
        stuck = pool.submit(httpx.post, url + "/v1/infer", json={"inputs": [f"a {STUCK} here"]}, timeout=timeout)
        time.sleep(0.5)  # the stuck one on the compute thread first
        behind = pool.submit(httpx.post, url + "/v1/infer", json={"inputs": ["fine"]}, timeout=timeout)
        for answer in (stuck.result(), behind.result()):
            assert answer.status_code == 503 and answer.json()["error"]["type"] == "device_failed", answer.text
            assert f"past --pass-timeout-s ({limit})" in answer.json()["error"]["message"]


def test_a_pass_that_never_returns_makes_the_server_not_live_and_answers_its_requests(tiny_backbone, tmp_path,
                                                                                      monkeypatch):
    """A hung kernel raises nothing: past `pass_timeout_s` the runtime fails as on a device error, and
    the requests on the stuck compute thread, and those queued after them, are answered 503 there."""
    monkeypatch.setattr(runtime_module, "_device_failure", None)
    monkeypatch.setattr(device_failure_head, "STUCK_S", 8.0)  # stuck well past the timeout, then back: ignored
    store = device_failure_store(tmp_path, tiny_backbone)
    settings = Settings(store=store.root, precision="fp32", pass_timeout_s=1.0)
    with LiveServer(create_app(settings, backbone=tiny_backbone)) as server:
        assert httpx.post(server.url + "/v1/infer", json={"inputs": ["fine"]}).status_code == 200
        assert_stuck_and_the_next_answered_503(server.url, "1 s", timeout=6)
        for probe in ("/readyz", "/healthz", "/v2/health/ready"):
            assert httpx.get(server.url + probe).status_code == 503, probe


def failing_server(tmp_path, tiny_backbone, tiny_backbone_dir, *extra: str) -> tuple[str, subprocess.Popen]:
    """The real tmod-serve process (its cli main) serving the test head kind (registered first), ready."""
    store = device_failure_store(tmp_path / "store", tiny_backbone)
    port = free_port()
    command = [sys.executable, "-c", "import sys, tests.device_failure_head; from server.cli import main; "
               "main(sys.argv[1:])", "--port", str(port), "--store", str(store.root), "--backbone",
               str(tiny_backbone_dir), "--precision", "fp32", "--threads", "1", *extra]
    process = subprocess.Popen(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def ready():
        assert process.poll() is None, process.communicate()[0]
        try:
            return httpx.get(url + "/readyz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(ready, "tmod-serve ready")
    except BaseException:
        process.kill()
        raise
    return url, process


def stops_failed(url: str, process: subprocess.Popen) -> str:
    """Until the failed server has exited (probes never 200 meanwhile): its output."""
    try:
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline:
            for probe in ("/readyz", "/healthz"):
                try:
                    assert httpx.get(url + probe, timeout=2).status_code == 503, probe
                except httpx.TransportError:
                    pass  # stopping: no longer listening
            time.sleep(0.1)
        return process.communicate(timeout=30)[0]
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.mark.slow
def test_tmod_serve_exits_non_zero_after_a_sticky_device_error(tiny_backbone_dir, tiny_backbone, tmp_path):
    """The failing request is answered 503, probes never answer 200 again, and the process exits non-zero."""
    url, process = failing_server(tmp_path, tiny_backbone, tiny_backbone_dir)
    try:
        assert httpx.post(url + "/v1/infer", json={"inputs": ["fine"]}).status_code == 200
        failed = httpx.post(url + "/v1/infer", json={"inputs": [f"a {TRIGGER} here"]}, timeout=30)
        assert failed.status_code == 503 and failed.json()["error"]["type"] == "device_failed"
    finally:
        output = stops_failed(url, process)
    assert process.returncode == 1, output  # SystemExit with the reason: not a signal's status
    assert "stopped after a device failure" in output and "an illegal memory access" in output


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_pass_that_never_returns_fails_the_server_past_the_pass_timeout(tiny_backbone_dir, tiny_backbone, tmp_path,
                                                                          workers):
    """A hung kernel or driver raises nothing: its request waited for ever, every later one 503 at its
    deadline, while /healthz and /readyz said 200, so no supervisor restarted the server. Past
    --pass-timeout-s the server now fails as on a device error: that request and the ones after it
    are answered 503 device_failed, and the process exits non-zero (its compute thread still stuck)."""
    url, process = failing_server(tmp_path, tiny_backbone, tiny_backbone_dir, "--workers", workers,
                                  "--pass-timeout-s", "2")
    try:
        assert httpx.post(url + "/v1/infer", json={"inputs": ["fine"]}).status_code == 200
        assert_stuck_and_the_next_answered_503(url, "2 s", timeout=60)
    finally:
        output = stops_failed(url, process)
    assert process.returncode == 1, output
    assert "tmod-serve: stopped after a device failure: a batch has run for" in output


# ---- /v1/tasks reads nothing from the device ---------------------------------------------------------
def test_task_list_uses_the_layers_read_at_load(tiny_backbone, tiny_store, monkeypatch):
    settings = Settings(store=tiny_store.root)
    app = create_app(settings, backbone=tiny_backbone)
    with LiveServer(app) as server:
        runtime = app.state.runtime
        want = {t: m.head.layers_read() for t, m in runtime.modules.items()}
        calls = []
        for module in runtime.modules.values():
            real = module.head.layers_read
            monkeypatch.setattr(module.head, "layers_read", lambda real=real: calls.append(1) or real())
        listed = httpx.get(server.url + "/v1/tasks").json()["tasks"]
        assert {t["task"]: t["layers"] for t in listed} == want
        assert httpx.get(server.url + "/v1/tasks/ner").json()["layers"] == want["ner"]
        assert calls == []  # read at load, in the compute thread; never on the event loop


def test_a_cuda_device_is_made_current_and_fp32_products_use_tf32(monkeypatch):
    from server.runner.model_runner import use_device

    made_current = []
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)  # no GPU here: recorded
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        use_device(torch.device("cpu"))
        assert made_current == [] and not torch.backends.cuda.matmul.allow_tf32
        use_device(torch.device("cuda:1"))
        assert made_current == [torch.device("cuda:1")]  # capture streams and pools on device 1, not 0
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


# ---- on a GPU ------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("tier", ["minilm", "mpnet"])
def test_cuda_captures_the_shipped_plans_and_replays_them_as_eager_passes_answer(tier):
    """Both tiers' shipped modules (NER's k=128 head, the pair task): warm-up captures the single-text
    and pair sets at every reachable bucket; requests of either kind replay them, nothing is captured
    on their path, and the answers are those of eager passes (default precision: fp16 on cuda)."""
    from modules_store import DEFAULT_STORE
    from server.backbone import Backbone
    from server.backbone.sources import mpnet_path
    from server.modules import servable_tasks

    if tier == "mpnet":
        try:
            mpnet_path()  # tmod's cache (a lent GPU gets it from bench/gpu_bundle.sh mpnet), else the parts
        except FileNotFoundError as exc:
            pytest.skip(str(exc))
    backbone = Backbone.load(tier, device="cuda")
    store = ModuleStore(DEFAULT_STORE)
    modules = {t: load_module(store, t, None, backbone, "cuda") for t in servable_tasks(store, backbone)}
    shapes = dict(graph_batch_sizes="8,32", graph_seq_lens="32,64", max_inputs=8, max_batch_tokens=512)
    runner = ModelRunner(Engine(backbone), Settings(device="cuda", **shapes))
    runner.warm_up(modules)
    sets = served_task_sets(modules)
    assert len(sets) == 2 and len(runner.graphs) == 2 * len(runner.reachable_buckets()), runner.graphs.describe()
    assert 0 < runner.graphs.memory_bytes <= runner.graphs.memory_cap
    captures = runner.graphs.captures
    eager = ModelRunner(Engine(backbone), Settings(device="cuda", cuda_graphs=False, **shapes))
    for task_set, pairs in ((sets[1], None), (sets[0], PAIRS)):
        rows = sorted_rows(backbone, TEXTS, pairs)
        got, want = runner.run(rows, task_set), eager.run(rows, task_set)
        assert_same_answers(got, want, abs_tol=2e-3)
    assert runner.graphs.captures == captures and runner.graphs.replays >= 2


@pytest.mark.cuda
def test_cuda_soak_over_many_task_subsets_with_reloads_fails_no_request(tiny_backbone_dir, tmp_path):
    """A real server on cuda with graphs, under concurrent load: requests name every one of the 15
    subsets of four single-text tasks (more than the 8 plans an LRU once held) while sentiment is
    reloaded back and forth. Every request is answered 200, each subset with the answers of the full
    default set at the sentiment version it names (a subset replays its superset's graph), and graphs
    keep replaying after the reloads."""
    import asyncio
    import itertools

    from server.backbone import Backbone

    backbone = Backbone.load(tiny_backbone_dir, device="cuda")
    store = populate_store(tmp_path, backbone)
    save_module(store, "sentiment", "2", random_head(backbone, "sequence_classification",
                                                     ["negative", "positive"], 12), backbone)
    save_module(store, "topic", "1", random_head(backbone, "sequence_classification",
                                                 ["world", "sports", "business"], 13), backbone)
    tasks = ("sentiment", "ner", "acceptability", "topic")
    subsets = [",".join(c) for n in range(1, 5) for c in itertools.combinations(tasks, n)]
    assert len(subsets) == 15
    token = "t0ken"
    settings = Settings(store=store.root, device="cuda", admin_token=token, precision="fp32", head_precision="fp32",
                        graph_batch_sizes="1,2,4,8,16,32", graph_seq_lens="32,64")
    auth = {"authorization": f"Bearer {token}"}

    async def soak(url):
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async def ask(names, i):
                texts = [TEXTS[(i + k) % len(TEXTS)] for k in range(1 + i % 3)]
                return texts, await client.post("/v1/infer", params={"tasks": names}, json={"inputs": texts})

            reference = {}
            for version in ("1", "2"):
                assert (await client.post("/admin/modules/sentiment/load", json={"version": version},
                                          headers=auth)).status_code == 200
                answer = (await client.post("/v1/infer", json={"inputs": TEXTS})).json()
                reference[version] = dict(zip(TEXTS, answer["results"]))
            answers, switches = [], []
            for round_ in range(8):
                burst = [asyncio.create_task(ask(s, i)) for i, s in enumerate(subsets * 3)]
                switches.append(await client.post("/admin/modules/sentiment/load",
                                                  json={"version": "12"[round_ % 2]}, headers=auth))
                answers += await asyncio.gather(*burst, *[ask(s, i) for i, s in enumerate(subsets)])
            return reference, answers, switches

    app = create_app(settings, backbone=backbone)
    with LiveServer(app) as server:
        replays_before = app.state.runtime.runner.graphs.replays
        reference, answers, switches = asyncio.run(soak(server.url))
        metrics = httpx.get(server.url + "/metrics").text
        replays = app.state.runtime.runner.graphs.replays - replays_before
    assert all(s.status_code == 200 for s in switches), [s.text for s in switches]
    failed = [(r.status_code, r.text) for _, r in answers if r.status_code != 200]
    assert not failed and len(answers) == 8 * 4 * 15
    assert reference["1"] != reference["2"]
    for texts, response in answers:
        body = response.json()
        version = body["tasks"].get("sentiment", "1")
        for text, result in zip(texts, body["results"]):
            assert set(result) == set(body["tasks"])
            assert_same_answers({t: [a] for t, a in result.items()},
                                {t: [reference[version][text][t]] for t in result}, abs_tol=1e-3)
    assert replays > 0  # subsets replayed captured graphs (not silently eager)
    graphs = [line for line in metrics.splitlines() if line.startswith("tmod_cuda_graphs ")]
    assert graphs and float(graphs[0].split()[1]) > 0, graphs


def test_host_threads_on_cuda_default_to_one_and_no_tokenizer_pool(monkeypatch):
    import server.config
    from server.runtime import set_host_threads

    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    monkeypatch.setattr(server.config, "cpu_quota", lambda: None)  # outside a container with a CPU quota
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        set_host_threads(Settings.model_construct(device="cpu", threads=None))  # the CPU keeps torch's choice
        assert torch.get_num_threads() == 2 and "TOKENIZERS_PARALLELISM" not in os.environ
        set_host_threads(Settings.model_construct(device="cuda:0", threads=None))
        assert torch.get_num_threads() == 1 and os.environ["TOKENIZERS_PARALLELISM"] == "false"
        set_host_threads(Settings.model_construct(device="cuda", threads=3))  # what the operator sets wins
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_host_threads_on_a_cpu_follow_a_container_quota_smaller_than_its_cores(monkeypatch, tmp_path, capsys):
    """Unset, torch (and ONNX Runtime) took a thread per core the process sees, which a container's smaller
    CPU quota then throttles (1-CPU quota, 2 cores: 6.5 MiniLM passes a second against 10.2 with one
    thread). The quota, read from the container's cgroup (v2 cpu.max, else v1's quota and period), now
    sets them, in tmod-serve and in every tmod-train command (set_threads); --threads still wins, and a
    quota as large as the cores changes nothing."""
    import server.config
    from server.config import cpu_quota
    from server.runtime import host_threads, set_host_threads
    from training.settings import set_threads

    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    v2.mkdir()
    for text, quota in (("max 100000\n", None), ("150000 100000\n", 2), ("50000 100000\n", 1)):
        (v2 / "cpu.max").write_text(text)
        assert cpu_quota(v2) == quota
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    for text, quota in (("-1\n", None), ("250000\n", 3)):
        (v1 / "cpu" / "cpu.cfs_quota_us").write_text(text)
        assert cpu_quota(v1) == quota
    assert cpu_quota(tmp_path / "none") is None

    cores = len(os.sched_getaffinity(0))
    cpu = Settings.model_construct(device="cpu", threads=None)
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(server.config, "cpu_quota", lambda: 1)
        assert host_threads(cpu) == (1 if cores > 1 else None)
        set_host_threads(cpu)
        assert torch.get_num_threads() == 1
        assert host_threads(Settings.model_construct(device="cpu", threads=2)) == 2  # what the operator sets wins
        torch.set_num_threads(cores + 1)
        set_threads(0)  # tmod-train's unset --threads
        assert torch.get_num_threads() == (1 if cores > 1 else cores + 1)
        said = capsys.readouterr().err
        assert said == (f"threads: 1, as the container's CPU quota allows (this process sees {cores} cores; --threads "
                        f"sets them)\n" if cores > 1 else "")
        set_threads(cores + 2)
        assert torch.get_num_threads() == cores + 2
        monkeypatch.setattr(server.config, "cpu_quota", lambda: cores)
        assert host_threads(cpu) is None  # the library's choice
    finally:
        torch.set_num_threads(before)
