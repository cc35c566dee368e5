"""`tmod-serve --workers N`: HTTP worker processes feed one engine process (server/workers/).

Real processes on loopback: the `tmod-serve` process (the engine) and its workers (forked by its forkserver)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from modules_store import ModuleStore
from server.api.app import create_app
from server.config import Settings
from server.modules import save_module
from server.temp_folders import abandoned
from bench.live_server import alive, engine_pids, engines_on_port, wait_until, worker_pids
from tests.helpers import LiveServer, metric_sample, populate_store, random_head, start_tmod_serve

TEXTS = ["Angela Merkel visited the Siemens plant in Munich.", "A gripping, beautifully acted film.",
         "John lives in New York and works for the United Nations.", "Him be went store."]


def log_records(process) -> list[dict]:
    return [json.loads(line) for line in process.stdout.read().splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_backbone):
    return populate_store(tmp_path_factory.mktemp("workers-store"), tiny_backbone)


def serve(store: ModuleStore, backbone_dir, *extra: str, wait_ms: str = "2", port: int | None = None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMOD_MAX_WAIT_MS": wait_ms, "TMOD_ADMIN_TOKEN": "secret"}
    return start_tmod_serve(["--workers", "2", "--backbone", str(backbone_dir), "--store", str(store.root),
                             "--tasks", "sentiment,ner,acceptability", "--log-level", "info", *extra], env, port=port)


@pytest.fixture(scope="module")
def served(store, tiny_backbone_dir):
    # a 300 ms batch window: requests sent together, through both workers, share one pass
    url, process = serve(store, tiny_backbone_dir, wait_ms="300")
    yield url, process
    if process.poll() is None:
        process.kill()


def test_two_workers_and_the_engine_are_up(served):
    _, process = served
    wait_until(lambda: len(worker_pids(process.pid)) == 2, "two worker processes")


def test_answers_equal_a_single_process_server(served, store, tiny_backbone):
    url, _ = served
    single = create_app(Settings(store=store.root, tasks="sentiment,ner,acceptability"), backbone=tiny_backbone)
    with LiveServer(single) as one:
        windowed = {"inputs": [" ".join(TEXTS * 8), TEXTS[0]], "window": 32}  # windows keep logits (server/windows.py)
        for body in ({"inputs": TEXTS}, {"inputs": [{"text": t, "text_pair": TEXTS[0]} for t in TEXTS[1:]]}, windowed):
            got = httpx.post(url + "/v1/infer", json=body, timeout=60)
            want = httpx.post(one.url + "/v1/infer", json=body, timeout=60)
            assert got.status_code == want.status_code == 200, got.text
            got, want = got.json(), want.json()
            assert got["tasks"] == want["tasks"] and got["model"] == want["model"]
            assert got["windows"] == want["windows"] and got["windows"][0] == (1 if body is not windowed else 13)
            for g, w in zip(got["results"], want["results"]):
                assert g["sentiment"]["label"] == w["sentiment"]["label"]
                assert g["sentiment"]["score"] == pytest.approx(w["sentiment"]["score"], abs=1e-5)
                assert g["acceptability"]["label"] == w["acceptability"]["label"]
                assert [(e["text"], e["label"], e["start"], e["end"], e.get("segment")) for e in g["ner"]["entities"]] == \
                       [(e["text"], e["label"], e["start"], e["end"], e.get("segment")) for e in w["ner"]["entities"]]
        assert httpx.get(url + "/v1/tasks").json() == httpx.get(one.url + "/v1/tasks").json()
        assert httpx.get(url + "/v2/models/ner").json() == httpx.get(one.url + "/v2/models/ner").json()
        oip = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": TEXTS[:2]}]}
        got = httpx.post(url + "/v2/models/sentiment/infer", json=oip).json()
        want = httpx.post(one.url + "/v2/models/sentiment/infer", json=oip).json()
        assert got["outputs"][0]["data"] == want["outputs"][0]["data"]


def test_refusals_are_the_same_precise_answers(served):
    url, _ = served
    unknown = httpx.post(url + "/v1/infer", params={"tasks": "nope"}, json={"inputs": ["a"]})
    assert unknown.status_code == 400 and unknown.json()["error"]["type"] == "unknown_task"
    assert httpx.post(url + "/v1/infer", content=b"{not json", headers={"content-type": "application/json"}
                      ).status_code == 422
    too_long = httpx.post(url + "/v1/infer", json={"inputs": [" ".join(["word"] * 4001)]})  # over 20,000 characters
    assert too_long.status_code == 413 and too_long.json()["error"]["type"] == "input_too_long"
    assert httpx.post(url + "/admin/modules/sentiment/reload").status_code == 401
    missing = httpx.post(url + "/admin/modules/sentiment/load", json={"version": "9"},
                         headers={"authorization": "Bearer secret"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "artifact_not_found"


def test_a_task_left_out_at_start_says_why_through_the_workers(tmp_path, tiny_backbone, tiny_backbone_dir):
    """The engine's reasons for leaving a store's task out (opt-in) reach the workers' refusals."""
    store = populate_store(tmp_path / "store", tiny_backbone)
    path = store.path("acceptability", "1") / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "opt_in": "no better than its baseline"}))
    url, process = start_tmod_serve(["--workers", "2", "--backbone", str(tiny_backbone_dir), "--store", str(store.root)],
                                    {**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        for _ in range(4):  # each worker answers some of them
            asked = httpx.post(url + "/v1/infer", params={"tasks": "acceptability"}, json={"inputs": ["a"]})
            assert asked.status_code == 400 and "acceptability is not served: acceptability/1 is opt-in (no better " \
                "than its baseline)" in asked.json()["error"]["message"]
    finally:
        process.kill()
        process.wait()


def test_requests_from_both_workers_share_passes_and_metrics_add_up(served):
    url, process = served
    page = httpx.get(url + "/metrics").text
    before = metric_sample(page, 'tmod_requests_total{outcome="success"}')
    batches_before = metric_sample(page, "tmod_batch_requests_count")

    def one(i):  # a new connection each: the kernel hands each to one of the workers
        with httpx.Client() as client:
            return client.post(url + "/v1/infer", json={"inputs": [TEXTS[i % 4]]}, timeout=60).status_code

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(one, range(32))) == [200] * 32
    page = httpx.get(url + "/metrics").text
    assert metric_sample(page, 'tmod_requests_total{outcome="success"}') - before == 32  # both workers counted
    batches = metric_sample(page, "tmod_batch_requests_count") - batches_before
    assert batches < 32  # the engine batched requests together (a 300 ms window)


def test_a_reload_reaches_every_worker(served, store, tiny_backbone):
    url, _ = served
    # a second sentiment version with other weights, written while the server runs
    save_module(store, "sentiment", "2", random_head(tiny_backbone, "sequence_classification",
                                                     ["negative", "positive"], 11), tiny_backbone)
    admin = {"authorization": "Bearer secret"}
    listing = httpx.get(url + "/admin/modules", headers=admin)  # answered by a worker, from the engine's state
    assert listing.status_code == 200, listing.text
    assert listing.json()["tasks"]["sentiment"] == "1" and listing.json()["store"] == str(store.root.resolve())
    assert listing.json()["modules_of"] == {tiny_backbone.fingerprint.short: tiny_backbone.name}
    text = TEXTS[1]
    before = httpx.post(url + "/v1/infer", params={"tasks": "sentiment"}, json={"inputs": [text]}).json()
    loaded = httpx.post(url + "/admin/modules/sentiment/load", json={"version": "2"}, headers=admin)
    assert loaded.status_code == 200 and loaded.json()["previous_version"] == "1"
    try:
        def ask(_):
            with httpx.Client() as client:  # fresh connections: whichever worker takes them
                return client.post(url + "/v1/infer", params={"tasks": "sentiment"}, json={"inputs": [text]}).json()

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(24)))
        assert {a["tasks"]["sentiment"] for a in answers} == {"2"}
        assert {a["results"][0]["sentiment"]["score"] for a in answers} != {before["results"][0]["sentiment"]["score"]}
        tasks = {t["task"]: t["version"] for t in httpx.get(url + "/v1/tasks").json()["tasks"]}
        assert tasks["sentiment"] == "2"
    finally:
        httpx.post(url + "/admin/modules/sentiment/load", json={"version": "1"}, headers=admin)


def answers_until(url: str, done, timeout: float = 60) -> list[int]:
    """The statuses of one-text requests sent one after another, each on a new connection, until `done()`
    (checked after each) or `timeout` seconds."""
    statuses = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with httpx.Client() as client:
            statuses.append(client.post(url + "/v1/infer", json={"inputs": [TEXTS[0]]}, timeout=60).status_code)
        if done():
            break
    return statuses


def test_a_dead_worker_is_replaced_and_nothing_is_refused(served):
    url, process = served
    wait_until(lambda: len(worker_pids(process.pid)) == 2, "two worker processes")
    victim, survivor = worker_pids(process.pid)
    os.kill(victim, signal.SIGKILL)
    statuses = answers_until(url, lambda: len(worker_pids(process.pid)) == 2 and victim not in worker_pids(process.pid))
    assert survivor in worker_pids(process.pid) and victim not in worker_pids(process.pid)
    assert len(worker_pids(process.pid)) == 2
    assert statuses and set(statuses) == {200}
    wait_until(lambda: httpx.get(url + "/readyz").status_code == 200, "readiness")


def test_sigterm_answers_in_flight_requests_through_workers_then_exits(served):
    url, process = served
    workers = worker_pids(process.pid)
    long_inputs = [" ".join(["The European Commission said on Thursday it disagreed."] * 2)] * 4

    def slow_request(_):
        with httpx.Client() as client:
            return client.post(url + "/v1/infer", json={"inputs": long_inputs}, timeout=120).status_code

    answered = 'tmod_requests_total{outcome="success"}'
    answered_before = metric_sample(httpx.get(url + "/metrics").text, answered)

    def reached_the_server():
        page = httpx.get(url + "/metrics").text
        return metric_sample(page, "tmod_requests_in_flight") + metric_sample(page, answered) - answered_before >= 6

    with ThreadPoolExecutor(6) as pool:
        pending = pool.map(slow_request, range(6))
        wait_until(reached_the_server, "the six requests to reach the workers")
        process.send_signal(signal.SIGTERM)
        assert list(pending) == [200] * 6
    assert process.wait(timeout=60) == 0
    assert not [pid for pid in workers if alive(pid)]
    records = log_records(process)
    assert not [r for r in records if "exception" in r]
    serving = {r["pid"] for r in records if r["logger"] == "tmod.access" and r["path"] == "/v1/infer"}
    assert len(serving) >= 2 and process.pid not in serving  # the workers answered, not the engine


def test_workers_stop_when_the_engine_process_dies(store, tiny_backbone_dir):
    url, process = serve(store, tiny_backbone_dir)
    wait_until(lambda: len(worker_pids(process.pid)) == 2, "two worker processes")
    workers = worker_pids(process.pid)
    process.kill()  # SIGKILL: no chance to stop its workers
    process.wait(timeout=30)

    wait_until(lambda: not [pid for pid in workers if alive(pid)], "the orphaned workers to stop", timeout=60)
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/healthz", timeout=5)


def test_the_next_start_removes_the_folders_a_killed_server_left(store, tiny_backbone_dir, tmp_path):
    """SIGKILL runs no clean-up: the engine's socket folder and the metrics' files (~0.8 MB a start) stayed
    in the temp directory for ever, one pair per kill. The next start removes those nobody holds."""
    temp = tmp_path  # (a Unix socket's path holds 107 bytes: the engine's goes in here)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(temp)}
    args = ["--workers", "2", "--backbone", str(tiny_backbone_dir), "--store", str(store.root), "--tasks", "sentiment",
            "--log-level", "info"]
    other = temp / "tmod-engine-not-ours"  # no lock file: another program's, or one being made: kept
    other.mkdir()
    elsewhere = temp / "elsewhere"  # a link is never followed, whatever it leads to
    elsewhere.mkdir()
    (elsewhere / ".lock").touch()
    os.utime(elsewhere / ".lock", (time.time() - 3600,) * 2)
    (temp / "tmod-metrics-link").symlink_to(elsewhere)
    url, killed = start_tmod_serve(args, env)
    workers = worker_pids(killed.pid)
    killed.kill()
    killed.wait(timeout=30)
    wait_until(lambda: not [pid for pid in workers if alive(pid)], "the orphaned workers to stop", timeout=60)
    left = sorted(p for p in temp.glob("tmod-*-*/.lock") if not p.parent.is_symlink())
    assert [p.parent.name.split("-")[1] for p in left] == ["engine", "metrics"]
    old = time.time() - 3600  # a lock file under a minute old may not be locked yet by its maker: left alone
    for lock in left:
        os.utime(lock, (old, old))

    url, process = start_tmod_serve(args, env)
    try:
        now = sorted(p for p in temp.glob("tmod-*-*/.lock") if not p.parent.is_symlink())
        assert len(now) == 2 and not set(now) & set(left) and other.is_dir() and (elsewhere / ".lock").exists()
        for lock in now:  # a running server's folders are held: another start takes nothing
            os.utime(lock, (old, old))
            assert not abandoned(lock)
        assert httpx.post(url + "/v1/infer", json={"inputs": ["fine"]}).status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        records = log_records(process)
        assert [r["message"] for r in records if r["message"].startswith("removed 1 tmod-")] == \
               [f"removed 1 tmod-metrics-* folder(s) that stopped servers left in {temp}",
                f"removed 1 tmod-engine-* folder(s) that stopped servers left in {temp}"]
        assert list(temp.glob("tmod-*-*/.lock")) == [temp / "tmod-metrics-link/.lock"]  # a stopped server removes its own
    finally:
        if process.poll() is None:
            process.kill()


def test_workers_that_keep_dying_at_start_stop_the_server_with_a_reason(store, tiny_backbone_dir, tmp_path):
    """The engine's socket removed (a /tmp cleaner) and the workers killed: each new worker died at
    start, and was started again every second for ever, the port held with nobody to answer. Five deaths
    in a row at start stop the server, non-zero, saying why."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp_path)}
    with open(tmp_path / "log", "w") as log:
        url, process = start_tmod_serve(["--workers", "2", "--backbone", str(tiny_backbone_dir), "--store",
                                         str(store.root), "--tasks", "sentiment"], env, output=log)
    try:
        workers = worker_pids(process.pid)
        (socket_path,) = tmp_path.glob("tmod-engine-*/engine.sock")
        socket_path.unlink()
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        assert process.wait(timeout=120) == 1
        said = (tmp_path / "log").read_text()
        assert re.search(r"tmod-serve: cannot serve: HTTP worker \d exited at start 5 times in a row \(the last with "
                         r"code 3; the log says why\)", said)
        assert said.count("starting another") <= 2 * 4  # each worker: four restarts, then the stop
        started = [int(pid) for pid in re.findall(r"worker \d \(pid (\d+)\) serving", said)]
        assert len(started) >= 10 and not [pid for pid in started if alive(pid)]
    finally:
        if process.poll() is None:
            process.kill()


def test_a_worker_whose_engine_closes_during_start_up_gives_up(tmp_path):
    """A worker that connects while the engine dies gets EOF before any state: `open` must fail (its
    app then fails start-up and the process exits), never wait for a state that cannot come."""
    import asyncio

    from server.workers.remote_runtime import RemoteRuntime

    async def scenario():
        async def close_at_once(reader, writer):
            writer.close()

        server = await asyncio.start_unix_server(close_at_once, path=str(tmp_path / "engine.sock"))
        runtime = RemoteRuntime(Settings(), tmp_path / "engine.sock")
        try:
            with pytest.raises(RuntimeError, match="closed its connection during start-up"):
                await asyncio.wait_for(runtime.open(), timeout=30)
        finally:
            server.close()
            runtime.tokenize_executor.shutdown()

    with pytest.MonkeyPatch.context() as patch:  # the worker signals itself to stop; not this test process
        patch.setattr(os, "kill", lambda pid, sig: None)
        asyncio.run(scenario())


def test_several_engines_share_the_port_and_one_that_dies_stops_them_all(store, tiny_backbone_dir):
    """`--engines 2`: two engine processes, each with its own two workers, on one port (SO_REUSEPORT);
    both answer; admin module changes are refused (409). Then one engine killed (-9, as the OOM killer
    would) takes the server down, with a line saying so, for the supervisor to start afresh: the other
    engine and every worker stop, none left behind. (SIGTERM with --engines: test_drain.py's 2x2.)"""
    url, process = serve(store, tiny_backbone_dir, "--engines", "2")
    try:
        wait_until(lambda: engines_on_port(process.pid, 2, 2), "two engines with two workers each")
        engines = engine_pids(process.pid)
        workers_of = {engine: set(worker_pids(engine)) for engine in engines}
        everyone = [*engines, *(w for workers in workers_of.values() for w in workers)]
        for i in range(40):  # a new connection each: the kernel spreads them over both engines' listeners
            with httpx.Client() as client:
                answer = client.post(url + "/v1/infer", json={"inputs": [TEXTS[i % 4]]}, timeout=60)
            assert answer.status_code == 200
        # /metrics, from a worker of either engine, counts every engine's requests (a worker writes its
        # tallies once per event-loop iteration: waited for)
        def answered() -> float:
            return metric_sample(httpx.get(url + "/metrics", timeout=60).text, 'tmod_requests_total{outcome="success"}')

        wait_until(lambda: answered() == 40, "the 40 answers counted")
        assert {answered() for _ in range(8)} == {40.0}
        # a hot change would reach one engine of the two: refused, and every engine keeps the version it serves
        served = httpx.get(url + "/v1/tasks/sentiment", timeout=60).json()["version"]
        for action in ("load", "reload", "unload"):
            refused = httpx.post(url + f"/admin/modules/sentiment/{action}", json={"version": "1"},
                                 headers={"authorization": "Bearer secret"}, timeout=60)
            assert refused.status_code == 409 and refused.json()["error"]["type"] == "several_engines", refused.text
            assert "--engines 2" in refused.json()["error"]["message"]
        listing = httpx.get(url + "/admin/modules", headers={"authorization": "Bearer secret"}, timeout=60)
        assert listing.status_code == 409 and listing.json()["error"]["type"] == "several_engines", listing.text
        for _ in range(8):  # a new connection each: both engines asked
            assert httpx.get(url + "/v1/tasks/sentiment", timeout=60).json()["version"] == served
        os.kill(engines[1], signal.SIGKILL)
        assert process.wait(timeout=120) != 0
        output = process.stdout.read()
        assert "tmod-serve: an engine process exited with code -9 (SIGKILL)" in output
        wait_until(lambda: not [pid for pid in everyone if alive(pid)], "every engine and worker gone", timeout=60)
        records = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
        serving = {r["pid"] for r in records if r["logger"] == "tmod.access" and r["path"] == "/v1/infer"}
        assert all(serving & workers for workers in workers_of.values()), (serving, workers_of)  # both engines answered
    finally:
        if process.poll() is None:
            process.kill()


# A start-up held (tests below): in the engine process named HOLD_ENGINE, `Runtime.start` waits until the
# file HOLD_RELEASE exists. Put first on PYTHONPATH, every process of the server imports it.
HOLD_START = '''
import importlib.machinery, multiprocessing, os, sys, time


class HeldRuntime:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "server.runtime":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            start = module.Runtime.start

            def held_start(self):
                if multiprocessing.current_process().name == os.environ["HOLD_ENGINE"]:
                    while not os.path.exists(os.environ["HOLD_RELEASE"]):
                        time.sleep(0.05)
                start(self)

            module.Runtime.start = held_start

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, HeldRuntime)
'''


@pytest.mark.parametrize("held", [0, 1])
def test_an_engine_takes_connections_only_while_every_listening_engine_is_loaded(store, tiny_backbone_dir, tmp_path,
                                                                                  held):
    """`--engines 2`, one engine's start-up held. Every connection goes to any engine listening on the port,
    so one that listened while loading would answer some requests 503 not_ready while the other's /readyz
    said ready. Engine 1 held: engine 0 serves alone, every request on a new connection answered, and engine
    1 has no workers. Engine 0 held: engine 1, loaded, stays off the port; /readyz says loading every time.
    Released: engine 1 joins, and both take connections and answer."""
    import subprocess
    import sys

    from bench.live_server import free_port

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOLD_START)
    release = tmp_path / "release"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMOD_MAX_WAIT_MS": "2", "HOLD_ENGINE": f"tmod-engine-{held}",
           "HOLD_RELEASE": str(release), "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "server.cli", "--port", str(port), "--workers", "2",
                                    "--engines", "2", "--backbone", str(tiny_backbone_dir), "--store", str(store.root),
                                    "--tasks", "sentiment,ner,acceptability", "--log-level", "info"],
                                   env=env, stdout=log, stderr=subprocess.STDOUT)

    def records() -> list[dict]:
        return [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]

    def status(path: str) -> int | None:
        try:  # a new connection each: the kernel picks among the engines listening
            if path == "/readyz":
                return httpx.get(url + path, timeout=30).status_code
            return httpx.post(url + path, json={"inputs": [TEXTS[0]]}, timeout=30).status_code
        except httpx.TransportError:
            return None

    try:
        def engines_in_order() -> list[int] | None:  # tmod-serve logs its engines' pids, engine 0 first
            said = [re.search(r"engine processes \(pids \[(\d+), (\d+)\]\)", r["message"]) for r in records()]
            return next(([int(m[1]), int(m[2])] for m in said if m), None)

        wait_until(lambda: engines_in_order() is not None, "the engines' pids logged", timeout=120)
        first, second = engines_in_order()
        loaded = second if held == 0 else first
        wait_until(lambda: any(r["pid"] == loaded and r["message"].startswith("ready in") for r in records()),
                   f"engine {1 - held} loaded", timeout=120)
        if held == 1:  # engine 0 serves alone
            wait_until(lambda: status("/readyz") == 200, "engine 0 ready", timeout=60)
            assert [status("/v1/infer") for _ in range(30)] == [200] * 30
        else:  # engine 0 listens, loading; engine 1, loaded, waits for it
            wait_until(lambda: status("/readyz") is not None, "engine 0 listening", timeout=60)
            assert [status("/readyz") for _ in range(20)] == [503] * 20
        assert worker_pids(second) == [] and alive(second) and len(worker_pids(first)) == 2
        release.touch()
        wait_until(lambda: len(worker_pids(second)) == 2 and status("/readyz") == 200, "engine 1 joined", timeout=120)
        served = set()
        for _ in range(60):
            assert status("/v1/infer") == 200
            served = {r["pid"] for r in records() if r.get("logger") == "tmod.access" and r.get("path") == "/v1/infer"}
            if served & set(worker_pids(second)):
                break
        assert served & set(worker_pids(second)), "engine 1, joined late, took connections"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 0
    finally:
        release.touch()
        if process.poll() is None:
            process.kill()


def test_a_temp_directory_that_fills_up_does_not_take_the_workers_down(store, tiny_backbone_dir, tmp_path):
    """The workers' metrics live in memory-mapped files in the temp directory, made sparse: once that
    filesystem was full, a worker's first write to a new page killed it (SIGBUS), and each worker
    started in its place died at its first request. Their blocks are reserved at start: a running
    server answers on; a worker that cannot start there says so in one line (needs root for a tmpfs)."""
    temp = Path(tempfile.mkdtemp())  # a short path: the engine's socket goes in it (107 bytes at most)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(temp)],
                                           capture_output=True).returncode != 0:
        temp.rmdir()
        pytest.skip("mounting a small tmpfs needs root")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(temp)}
    process = None
    try:
        with open(tmp_path / "log", "w") as log:
            url, process = start_tmod_serve(["--workers", "2", "--backbone", str(tiny_backbone_dir), "--store",
                                             str(store.root), "--tasks", "sentiment,ner,acceptability"], env,
                                            output=log)
        workers = worker_pids(process.pid)
        with open(temp / "filler", "wb") as filler:  # the temp filesystem full
            try:
                while True:
                    filler.write(bytes(1 << 16))
                    filler.flush()
            except OSError:
                pass
        with httpx.Client(base_url=url, timeout=60) as client:
            for i in range(12):  # each worker's answers, refusals and phases: new series, new pages
                assert client.post("/v1/infer", json={"inputs": [f"{TEXTS[0]} {i}"]}).status_code == 200
                assert client.post("/v1/infer?tasks=ner", json={"inputs": TEXTS}).status_code == 200
                assert client.post(f"/v1/infer?tasks=nosuch{i}", json={"inputs": ["a"]}).status_code == 400
                assert client.get(f"/nowhere{i}").status_code == 404
            assert "tmod_requests_total" in client.get("/metrics").text
        assert worker_pids(process.pid) == workers
        os.kill(workers[0], signal.SIGKILL)  # its replacement has no room for its files
        assert process.wait(timeout=120) == 1
        said = (tmp_path / "log").read_text()
        assert re.search(r"worker \d \(pid \d+\) cannot start: no room for the metrics' files in \S+ \(its "
                         r"filesystem is full\)", said)
        assert "Traceback" not in said and "code -7" not in said
    finally:
        if process is not None and process.poll() is None:
            process.kill()
        subprocess.run(["umount", "-l", str(temp)])
        temp.rmdir()


def test_an_engine_that_stops_answering_is_said_by_the_workers_and_requests_do_not_hang(store, tiny_backbone_dir):
    """The engine process stopped (SIGSTOP; as stuck or swapping): the workers answered /healthz and
    /readyz 200 and held each request for ever. A worker that hears nothing from it for ENGINE_SILENT_S
    answers 503 engine_unresponsive, its health routes too; once the engine goes on, all is as before."""
    url, process = serve(store, tiny_backbone_dir)
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            assert client.post("/v1/infer", json={"inputs": TEXTS}).status_code == 200
            os.kill(process.pid, signal.SIGSTOP)  # the tmod-serve process is the engine
            try:
                waited = client.post("/v1/infer", json={"inputs": TEXTS})
                assert waited.status_code == 503 and waited.json()["error"]["type"] == "engine_unresponsive"
                assert "the engine process has sent nothing for" in waited.json()["error"]["message"]
                close = {"connection": "close"}  # each probe a new connection: on one worker, then the other
                wait_until(lambda: {client.get("/healthz", headers=close).status_code for _ in range(4)} == {503},
                           "both workers to say so")
                for path in ("/healthz", "/readyz", "/v2/health/ready", "/health"):  # tmod's, OIP's, TEI's
                    answers = [client.get(path, headers=close) for _ in range(4)]
                    assert {r.status_code for r in answers} == {503}
                    assert all("the engine process has sent nothing for" in r.text for r in answers)
            finally:
                os.kill(process.pid, signal.SIGCONT)
            wait_until(lambda: client.get("/healthz").status_code == 200, "the engine heard again")
            assert client.post("/v1/infer", json={"inputs": TEXTS}).status_code == 200
            assert client.get("/readyz").status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
