"""Shared test helpers: tiny random backbones and random-weight modules, real files on disk."""
from __future__ import annotations

import collections
import socket
import threading
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import torch
import uvicorn
from transformers import (AutoTokenizer, BertConfig, BertModel, DistilBertConfig, DistilBertModel, LlamaConfig, LlamaModel,
                          MPNetConfig, MPNetModel, RobertaConfig, RobertaModel)

from modules_store import ModuleStore
from server.backbone import Backbone, default_backbone_path
from server.heads.layermix import LayerMixConfig, LayerMixHead
from server.modules import save_module

NER_LABELS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]


def make_tiny_backbone_dir(root: Path, family: str = "bert", layers: int = 3, seed: int = 0) -> Path:
    """A randomly initialised encoder (or Llama-style decoder: family "llama") with the real MiniLM
    tokenizer (family "mpnet": an MPNet tokenizer over the same vocabulary), saved like a hub checkout."""
    tokenizer = AutoTokenizer.from_pretrained(default_backbone_path(), local_files_only=True)
    vocab = len(tokenizer)
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, max_position_embeddings=128)
    if family == "bert":
        model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                                     intermediate_size=64, architectures=["BertModel"], **common))
    elif family == "roberta":
        model = RobertaModel(RobertaConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                                           intermediate_size=64, pad_token_id=tokenizer.pad_token_id,
                                           architectures=["RobertaModel"], **common))
    elif family == "distilbert":
        model = DistilBertModel(DistilBertConfig(dim=32, n_layers=layers, n_heads=2, hidden_dim=64,
                                                 architectures=["DistilBertModel"], **common))
    elif family == "mpnet":
        tokenizer = mpnet_style_tokenizer(root)
        model = MPNetModel(MPNetConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=layers,
                                       num_attention_heads=2, intermediate_size=64, max_position_embeddings=130,
                                       architectures=["MPNetModel"]))
    elif family == "llama":
        model = LlamaModel(LlamaConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                                       num_key_value_heads=1, intermediate_size=64, pad_token_id=tokenizer.pad_token_id,
                                       architectures=["LlamaModel"], **common))
    else:
        raise ValueError(family)
    path = root / f"tiny-{family}"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def mpnet_style_tokenizer(root: Path):
    """A fast tokenizer laid out as all-mpnet-base-v2's (<s>=0, <pad>=1, </s>=2, <unk>=3, pairs as
    `<s> A </s></s> B </s>`, no token types) over MiniLM's lower-casing WordPiece vocabulary."""
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads((Path(default_backbone_path()) / "tokenizer.json").read_text(encoding="utf-8"))
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    words = [w for w, _ in sorted(spec["model"]["vocab"].items(), key=lambda item: item[1]) if not w.startswith("[")]
    vocab = {w: i for i, w in enumerate(specials + words + ["<mask>"])}
    spec["model"].update(vocab=vocab, unk_token="<unk>")
    spec["added_tokens"] = [{"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for t in specials + ["<mask>"]]
    spec["post_processor"] = {"type": "RobertaProcessing", "sep": ["</s>", 2], "cls": ["<s>", 0],
                              "trim_offsets": True, "add_prefix_space": False}
    spec["padding"] = spec["truncation"] = None
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token="<s>",
                                   eos_token="</s>", sep_token="</s>", cls_token="<s>", pad_token="<pad>",
                                   unk_token="<unk>", mask_token="<mask>", model_max_length=128)


def random_head(backbone: Backbone, task_type: str, labels: list[str], seed: int, **config) -> LayerMixHead:
    torch.manual_seed(seed)
    layers = config.pop("layers", list(range(backbone.num_layers + 1)))
    head = LayerMixHead(
        LayerMixConfig(task_type=task_type, num_labels=len(labels), hidden_size=backbone.hidden_size,
                       layers=layers, **{"project_dim": 16, "attention_heads": 2, "ffn_dim": 32, **config}),
        labels,
    )
    with torch.no_grad():  # spread the layer logits so the mix is not uniform
        head.layer_logits.copy_(torch.randn(len(layers)) * 0.05)
    return head.eval()


def populate_store(store_dir: Path, backbone: Backbone) -> ModuleStore:
    """sentiment (sequence), ner (token, BIO) and acceptability (reads only shallow layers)."""
    store = ModuleStore(store_dir)
    save_module(store, "sentiment", "1", random_head(backbone, "sequence_classification", ["negative", "positive"], 1), backbone)
    save_module(store, "ner", "1", random_head(backbone, "token_classification", NER_LABELS, 2, casing=True), backbone)
    save_module(store, "acceptability", "1", random_head(
        backbone, "sequence_classification", ["unacceptable", "acceptable"], 3, layers=[0, 1]), backbone)
    return store


def wait_until(condition, what: str, timeout: float = 120.0):
    """Poll `condition` until it holds: tests wait for a fact the server reports, never for a guessed time."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout} s waiting for {what}")
        time.sleep(0.02)


def metric_sample(metrics_text: str, sample: str) -> float:
    """The value of one sample in a Prometheus text page, e.g. `tmod_requests_total{outcome="success"}`; 0 if absent."""
    for line in metrics_text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """A real uvicorn server on loopback, in a thread, for API tests."""

    def __init__(self, app, ready_timeout: float = 120.0, ready_when=lambda response: response.status_code == 200):
        """`ready_when(GET /readyz's response)`: started (default: ready to serve)."""
        self.port = free_port()
        self.ready_when = ready_when
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.ready_timeout = ready_timeout

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            try:
                if self.ready_when(httpx.get(self.url + "/readyz", timeout=2)):
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.__exit__()
        raise RuntimeError("server did not become ready")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)


def served_answer(app, texts: list[str]) -> dict:
    """`app` served on loopback (LiveServer) for one POST /v1/infer of `texts`: the answer's JSON.
    The app's runtime stays readable afterwards (`app.state.runtime`)."""
    with LiveServer(app) as server:
        response = httpx.post(server.url + "/v1/infer", json={"inputs": texts}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def start_tmod_serve(args: list[str], env: dict, ready_timeout: float = 180.0, output=None):
    """The real `tmod-serve` process on a free loopback port, waited for until /readyz answers 200.
    Returns (url, process); the caller stops it. Fails the test with its output if it never gets ready.
    `output`: a file for its log (default a pipe, which a server that logs much while nobody reads it
    fills, and then waits on)."""
    import subprocess
    import sys

    import pytest

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "server.cli", "--port", str(port), *args], env=env,
                               stdout=output or subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return url, process
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    pytest.fail(f"tmod-serve {' '.join(args)} did not become ready:\n{process.communicate()[0]}")



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
    starts its workers as it joins the port, engine 0 at once, the others once loaded (server/workers.py)."""
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
                       timeout: float = 120.0) -> DrainRun:
    """For each request kind in `clients`, that many threads of `keep_alive_client` sending it to a
    running `tmod-serve`; SIGTERM once `answers_before` requests (of any kind) were answered; returns
    when every client ended (on a refused connection, or lost) and the process exited. The process is
    killed if it is still running then."""
    import signal
    from urllib.parse import urlsplit

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
        process.send_signal(signal.SIGTERM)
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
    import os
    import random

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
