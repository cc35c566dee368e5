"""A running `tmod-serve` seen from outside, for benchmarks and tests alike: its process tree (the
engines and their HTTP workers), raw keep-alive clients and a SIGTERM under their load, and a module
file rewritten under it. Nothing here imports server/: bench_frontend's served process imports
server/ from another checkout (`--before`) and may import this file first."""
from __future__ import annotations

import collections
import os
import random
import signal
import socket
import threading
import time
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition, what: str, timeout: float = 120.0):
    """Poll `condition` until it holds: wait for a fact the server reports, never for a guessed time."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout} s waiting for {what}")
        time.sleep(0.02)


def child_pids(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


def worker_pids(engine_pid: int) -> list[int]:
    """A `tmod-serve --workers N` process's live worker processes: the children of its forkserver
    (multiprocessing's process that forks each worker), itself a child of the engine; in a checkout
    from before workers were forked (bench_frontend's --before), its spawned children but the
    resource tracker."""
    pids = []
    for child in child_pids(engine_pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing.forkserver" in cmdline:
            pids += [pid for pid in child_pids(child) if alive(pid)]
        elif b"multiprocessing.spawn" in cmdline and b"resource_tracker" not in cmdline and alive(child):
            pids.append(child)
    return pids


def engine_pids(server_pid: int) -> list[int]:
    """The engine processes of a `tmod-serve` process: itself (`--workers N`, or one process), or with
    `--engines N` its N engine children (the processes that have HTTP workers of their own)."""
    return [pid for pid in child_pids(server_pid) if worker_pids(pid)] or [server_pid]


def engines_on_port(server_pid: int, engines: int, workers: int) -> bool:
    """Whether `tmod-serve --engines N` has its N engines each with its `workers` HTTP workers: an engine
    starts its workers as it joins the port, engine 0 at once, the others once loaded (server/workers/processes.py)."""
    found = engine_pids(server_pid)
    return len(found) == engines and all(len(worker_pids(pid)) == workers for pid in found)


def read_http_response(stream) -> tuple[int, dict[str, str], bytes] | None:
    """One HTTP/1.1 response from a socket's file (`sock.makefile("rb")`) framed by Content-Length:
    (status, headers lower-cased, body), or None if the connection ended before a status line."""
    status_line = stream.readline()
    if not status_line:
        return None
    headers = {}
    while (line := stream.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, stream.read(int(headers.get("content-length", 0)))


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything a socket receives until the server closes it (or resets it)."""
    received = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        received += chunk
    return received


def keep_alive_client(host: str, port: int, request: bytes, outcomes) -> None:
    """A keep-alive client as RFC 9112 allows one to be: `request` again and again on one connection,
    a new connection only after a response that said `Connection: close`, until a connection is
    refused (the server stopped listening). A `request` that says `connection: close` makes it a
    client that opens a connection per request. Counts into `outcomes` (a Counter): each status,
    "closing" (answers that said Connection: close), "refused" (connect refused: never sent), "lost"
    (sent on an open connection and never answered: reset or closed)."""
    sock = stream = None
    while True:
        if sock is None:
            try:
                sock = socket.create_connection((host, port), timeout=120)
            except OSError:
                outcomes["refused"] += 1
                return
            stream = sock.makefile("rb")
        try:
            sock.sendall(request)
            response = read_http_response(stream)
        except OSError:
            response = None
        if response is None:
            outcomes["lost"] += 1
            sock.close()
            return
        status, headers, _ = response
        outcomes[status] += 1
        if headers.get("connection", "").lower() == "close":
            outcomes["closing"] += 1
            stream.close()
            sock.close()
            sock = None


class DrainRun(NamedTuple):
    outcomes: dict[bytes, collections.Counter]  # per request kind, as `keep_alive_client` counts them
    answered_before_sigterm: int
    exit_code: int


def sigterm_under_load(url: str, process, clients: dict[bytes, int], answers_before: int,
                       timeout: float = 120.0, sig: int = signal.SIGTERM, group: bool = False) -> DrainRun:
    """For each request kind in `clients`, that many threads of `keep_alive_client` sending it to a
    running `tmod-serve`; SIGTERM (or `sig`) once `answers_before` requests (of any kind) were answered,
    to the process (as Docker and Kubernetes stop a container) or, `group`, to every process of its
    process group (a terminal's Ctrl-C and SIGHUP, systemd's stop); returns when every client ended (on a
    refused connection, or lost) and the process exited. The process is killed if it is still running then."""
    address = urlsplit(url)
    outcomes = {request: collections.Counter() for request in clients}
    threads = [threading.Thread(target=keep_alive_client, args=(address.hostname, address.port, request, outcomes[request]))
               for request, count in clients.items() for _ in range(count)]

    def answered() -> int:
        return sum(counts[200] for counts in outcomes.values())

    try:
        for thread in threads:
            thread.start()
        wait_until(lambda: answered() >= answers_before, f"{answers_before} answers", timeout)
        answered_before = answered()
        if group:
            os.killpg(process.pid, sig)
        else:
            process.send_signal(sig)
        for thread in threads:
            thread.join(timeout)
        return DrainRun(outcomes, answered_before, process.wait(timeout=timeout))
    finally:
        if process.poll() is None:
            process.kill()


def rows_swapped(data: bytes) -> bytes:
    """A safetensors file of the same size whose classifier tensors of 2 labels have their rows
    swapped: another module's answers under the checked file's sha256 (store race checks)."""
    from safetensors.torch import load, save

    tensors = load(data)
    for name, tensor in tensors.items():
        if "classifier" in name and tensor.shape and tensor.shape[0] == 2:
            tensors[name] = tensor.flip(0).contiguous()
    swapped = save(tensors)
    assert len(swapped) == len(data) and swapped != data
    return swapped


def rewrite_until(target: Path, versions: list[bytes], how: str, stop: threading.Event, calm_every: int = 0
                  ) -> None:
    """Until `stop`: write each of `versions` in turn over `target`, 0-20 ms apart, in place (truncate,
    then write, as `cp` does) or as a new file renamed over it (store race checks). `calm_every` N:
    every Nth round, the first version stays whole for 0.25 s (a reload can read it complete: on a busy
    box, 25 reloads between back-to-back writes of a 16 MB file all met a half-written or swapped one)."""
    staging, pauses, turn = target.with_name(".incoming"), random.Random(0), 0
    calm = len(versions) * calm_every
    while not stop.wait(0.25 if calm and turn % calm == 1 else pauses.uniform(0, 0.02)):
        data = versions[turn % len(versions)]
        turn += 1
        if how == "in_place":
            with open(target, "wb") as out:
                for start in range(0, len(data), 1 << 16):
                    out.write(data[start:start + (1 << 16)])
        else:
            staging.write_bytes(data)
            os.replace(staging, target)
