"""`tmod-serve --workers N` and `--engines N` started, interrupted and killed (server/workers/): each
process stops with its parent, a Ctrl-C while the fork server starts does not kill it, and a restart finds
its port free. Real processes on loopback, as in test_workers.py (whose helpers these share); a file of
their own so that pytest-xdist runs them beside it."""
from __future__ import annotations

import os
import signal
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from bench.live_server import alive, child_pids, engine_pids, engines_on_port, wait_until, worker_pids
from tests.helpers import populate_store, start_tmod_serve
from tests.test_workers import TEXTS, answers_until, serve


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_backbone):
    return populate_store(tmp_path_factory.mktemp("lifecycle-store"), tiny_backbone)


def test_workers_whose_forkserver_dies_stop_and_are_replaced(store, tiny_backbone_dir):
    """multiprocessing's fork server (the workers' parent) killed: the engine took both workers for dead
    and started two more while the first two, reparented, served on beside them with nobody to stop
    them (four workers of a server started with two, until the server stopped). They now drain and
    exit, and no request is refused meanwhile."""
    url, process = serve(store, tiny_backbone_dir, "--log-level", "warning")  # a minute of access lines fills the pipe
    try:
        wait_until(lambda: len(worker_pids(process.pid)) == 2, "two worker processes")
        first = worker_pids(process.pid)
        [forkserver] = [pid for pid in child_pids(process.pid)
                        if b"multiprocessing.forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        os.kill(forkserver, signal.SIGKILL)
        statuses = answers_until(url, lambda: not [pid for pid in first if alive(pid)]
                                 and len(worker_pids(process.pid)) == 2)
        assert [pid for pid in first if alive(pid)] == []
        assert len(worker_pids(process.pid)) == 2 and not set(first) & set(worker_pids(process.pid))
        assert statuses and set(statuses) == {200}
    finally:
        process.kill()
        process.wait(timeout=30)


def port_in_time_wait() -> int:
    """A free loopback port with a connection of it in TIME_WAIT, as a server's port is for a minute after
    it closed its connections (answers with `Connection: close`, a drain) and stopped."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()  # the server's side closes first: it is the side that waits
    client.recv(1)
    client.close()
    listener.close()
    return port


def test_engines_start_on_a_port_left_in_time_wait_and_stop_when_tmod_serve_is_killed(store, tiny_backbone_dir):
    """`--engines 2` restarted at once on its port exited with a traceback (`Address already in use`): the
    stopped server's connections wait there in TIME_WAIT, which the port check, one process and
    `--workers` bind past (SO_REUSEADDR), and the socket that holds the port for the engines did not.
    Then the parent tmod-serve SIGKILLed (as a supervisor does once its stop timeout passes): both engines
    and their workers served on, on the port, so the supervisor's next tmod-serve (SO_REUSEPORT) served
    beside them. They now drain and exit; the port is free."""
    port = port_in_time_wait()
    url, process = serve(store, tiny_backbone_dir, "--engines", "2", port=port)
    try:
        wait_until(lambda: engines_on_port(process.pid, 2, 2), "two engines with two workers each")
        assert httpx.post(url + "/v1/infer", json={"inputs": [TEXTS[0]]}, timeout=60).status_code == 200
        left = [pid for engine in engine_pids(process.pid) for pid in (engine, *worker_pids(engine))]
        process.kill()
        process.wait(timeout=30)
        wait_until(lambda: not [pid for pid in left if alive(pid)], "the engines and their workers to stop",
                   timeout=60)
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/healthz", timeout=5)
    finally:
        if process.poll() is None:
            process.kill()


# The fork server's import of the app held (test below): in the process whose command line names
# multiprocessing's fork server, importing server.api.app writes its pid to HOLD_AT and waits until the
# file HOLD_RELEASE exists. Put first on PYTHONPATH, every process of the server imports it.
HOLD_FORK_SERVER = '''
import importlib.machinery, os, sys, time


class HeldApp:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "server.api.app" or b"multiprocessing.forkserver" not in open("/proc/self/cmdline", "rb").read():
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            with open(os.environ["HOLD_AT"], "w") as at:
                at.write(str(os.getpid()))
            while not os.path.exists(os.environ["HOLD_RELEASE"]):
                time.sleep(0.05)
            run(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, HeldApp)
'''


def test_ctrl_c_while_the_fork_server_imports_the_app_does_not_kill_it(store, tiny_backbone_dir, tmp_path):
    """A terminal's Ctrl-C reaches every process of the group: one that came while the fork server (the
    process that forks the workers) imported the app killed it with a traceback, and the engine, whose
    worker could not start, with another (EOFError). The fork server now ignores SIGINT; the engine
    alone decides to stop. Here SIGINT reaches the fork server alone: the server starts and answers."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOLD_FORK_SERVER)
    at, release = tmp_path / "holding", tmp_path / "release"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HOLD_AT": str(at), "HOLD_RELEASE": str(release),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))}
    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(start_tmod_serve, ["--workers", "2", "--backbone", str(tiny_backbone_dir), "--store",
                                                 str(store.root), "--tasks", "sentiment", "--log-level", "warning"], env)
        wait_until(lambda: at.exists() and at.read_text(), "the fork server importing the app")
        os.kill(int(at.read_text()), signal.SIGINT)
        release.touch()
        url, process = started.result(timeout=180)
    try:
        assert httpx.post(url + "/v1/infer", json={"inputs": [TEXTS[1]]}, timeout=60).status_code == 200
        wait_until(lambda: len(worker_pids(process.pid)) == 2, "two worker processes")
    finally:
        process.kill()
        process.wait(timeout=30)
    assert "Traceback" not in process.stdout.read()


def ipv6_loopback() -> bool:
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
        return True
    except OSError:
        return False


@pytest.mark.skipif(not ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_an_ipv6_host_is_served_by_workers(store, tiny_backbone_dir, tmp_path):
    """`--host ::1`: one process served it (uvicorn takes a host with a colon for IPv6), while the workers'
    listener was made for IPv4 alone and `--workers 2` exited with an OSError traceback ("Address family for
    hostname not supported"), as `--engines 2` did. Every layout now binds one way (server/ports.py: what
    `--engines` adds is SO_REUSEPORT) and says its address as a client writes it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        url, process = start_tmod_serve(["--workers", "2", "--backbone", str(tiny_backbone_dir), "--store", str(store.root),
                                         "--tasks", "sentiment", "--log-level", "info"], env, output=log, host="::1")
    try:
        assert url.startswith("http://[::1]:")
        answer = httpx.post(url + "/v1/infer", json={"inputs": [TEXTS[1]]}, timeout=60)
        assert answer.status_code == 200 and answer.json()["results"][0]["sentiment"]["label"]
    finally:
        process.terminate()
        process.wait(timeout=60)
    assert process.returncode == 0
    text = log_path.read_text()
    assert "Traceback" not in text and url in text, text[-3000:]
