"""Attack and fault checks against a real `tmod-serve` (issue 26): counts, not speeds.

For each process layout (`--workers 1`, `--workers 2`), on the shipped modules (MiniLM) copied into a
scratch store:
- load: mixed requests (v1 by task set, pairs, OIP JSON and binary, GETs, and hostile bodies) at a
  concurrency; every answer's status is checked against what that request kind may answer;
- burst: requests all at once at a high concurrency: only 200, 429 (with Retry-After) or 503;
- hostile: a 20,000-name `tasks=` list beside /healthz; slow clients (heads and bodies trickled);
- reloads: corrupted artifacts (NaN weights with a right checksum, finite weights that compute NaN,
  a checksum mismatch, a broken manifest) loaded through the admin API while load runs: requests
  that fail, and what each admin call answered;
- SIGTERM under load: requests answered, refused, or lost (a connection dropped without an answer);
- clients: tritonclient (and the `kserve` package's v2 client where installed) calling the server;
- reload race (issue 38): reloads of sentiment while its weights file is rewritten in place (as `cp`
  does) or replaced by rename, alternating with a copy whose classifier rows are swapped, under
  traffic: crashes (the server gone) and wrong answers (any answer not the checked weights');
- tokenize stall (issue 38): the largest tokenize requests the limits allow, many at once, with
  /healthz asked every 50 ms meanwhile: its latency, and one request over the cap (413).
- framing and drain (issue 38), on a server of their own: requests with both Content-Length and
  Transfer-Encoding hiding a second request after their last chunk (raw sockets: answers per
  connection, smuggled requests answered), then keep-alive clients (one connection each, reused
  until an answer says `Connection: close`) through a SIGTERM: answered, refused, lost.

    python bench/bench_attack.py --requests 2000 --concurrency 64 --burst 512
    python bench/bench_attack.py --checks reload_race,tokenize_stall --out bench/results/attack-cpu-store-tokenize.json

Writes bench/results/attack-cpu.json (machine, CPU flags, versions, date, every count).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.harness import (  # noqa: E402
    ServerProcess,
    machine_info,
    percentile,
    running_server,
    serve_command,
    write_json,
)
from bench.live_server import rewrite_until, rows_swapped, sigterm_under_load  # noqa: E402

TOKEN = "bench-attack-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
SENTENCES = ["A fine, moving film.", "Peter Blackburn met Angela Merkel in Brussels on Monday.",
             "The plot is dull and the acting worse.", "Das ist ein Test \U0001F600 in Paris."]
OK = {200}
OVERLOAD = {429, 503}


def oip_body(texts):
    return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": texts}]}


def request_kinds():
    """(kind, method, path, kwargs, allowed statuses): the mix the load check draws from, in turn."""
    many = ",".join(["sentiment"] * 1000 + ["a"] * 19_000)
    return [
        ("v1-all", "POST", "/v1/infer", {"json": {"inputs": SENTENCES[:2]}}, OK | OVERLOAD),
        ("v1-ner", "POST", "/v1/infer?tasks=ner", {"json": {"inputs": SENTENCES}}, OK | OVERLOAD),
        ("v1-sentiment", "POST", "/v1/infer?tasks=sentiment,acceptability", {"json": {"inputs": SENTENCES[2:]}},
         OK | OVERLOAD),
        ("v1-pairs", "POST", "/v1/infer?tasks=entailment",
         {"json": {"inputs": [{"text": SENTENCES[0], "text_pair": SENTENCES[2]}]}}, OK | OVERLOAD),
        ("v2-json", "POST", "/v2/models/sentiment/infer", {"json": oip_body(SENTENCES[:3])}, OK | OVERLOAD),
        ("v2-ner", "POST", "/v2/models/ner/infer", {"json": oip_body(SENTENCES[1:2])}, OK | OVERLOAD),
        ("get-tasks", "GET", "/v1/tasks", {}, OK),
        ("get-healthz", "GET", "/healthz", {}, OK),
        ("get-metrics", "GET", "/metrics", {}, OK),
        ("bad-shape", "POST", "/v2/models/sentiment/infer", {"json": {**oip_body(["a"]), "inputs": [
            {"name": "text", "datatype": "BYTES", "shape": [1e300, 1e300], "data": ["a"]}]}}, {400}),
        ("bad-truncate", "POST", "/v2/models/sentiment/infer",
         {"json": {**oip_body(["a"]), "parameters": {"truncate": "false"}}}, {400}),
        ("bad-deep", "POST", "/v1/infer", {"content": b'{"inputs": ' + b"[" * 20000 + b"]" * 20000 + b"}",
                                           "headers": {"content-type": "application/json"}}, {413}),
        ("bad-tasks", "POST", "/v1/infer?tasks=" + many, {"json": {"inputs": ["a"]}}, {400}),
        ("bad-unknown-route", "GET", "/v2/nope", {}, {404}),
        ("bad-version", "POST", "/admin/modules/sentiment/load", {"json": {"version": "../ner/1"}, "headers": AUTH},
         {422}),
    ]


async def run_mix(url: str, total: int, concurrency: int, kinds=None) -> dict:
    """`total` requests drawn in turn from the kinds, `concurrency` at a time."""
    kinds = kinds or request_kinds()
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    unexpected, latencies = [], []
    retry_after_missing = 0
    queue = asyncio.Queue()
    for i in range(total):
        queue.put_nowait(kinds[i % len(kinds)])
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        async def worker():
            nonlocal retry_after_missing
            while not queue.empty():
                kind, method, path, kwargs, allowed = queue.get_nowait()
                t0 = time.perf_counter()
                try:
                    response = await client.request(method, path, **kwargs)
                except httpx.HTTPError as exc:
                    counts[kind][type(exc).__name__] += 1
                    unexpected.append((kind, type(exc).__name__))
                    continue
                latencies.append(time.perf_counter() - t0)
                counts[kind][response.status_code] += 1
                if response.status_code not in allowed:
                    unexpected.append((kind, response.status_code, response.text[:200]))
                if response.status_code == 429 and "retry-after" not in response.headers:
                    retry_after_missing += 1
                if response.status_code >= 400 and not response.headers.get("x-request-id"):
                    unexpected.append((kind, "no x-request-id"))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    by_status = collections.Counter()
    for c in counts.values():
        by_status.update(c)
    return {"requests": total, "concurrency": concurrency, "by_status": dict(sorted((str(k), v) for k, v in by_status.items())),
            "by_kind": {k: {str(s): n for s, n in v.items()} for k, v in counts.items()},
            "unexpected": len(unexpected), "unexpected_examples": [list(map(str, u)) for u in unexpected[:10]],
            "errors_5xx": sum(v for k, v in by_status.items() if isinstance(k, int) and k >= 500 and k not in OVERLOAD),
            "retry_after_missing_on_429": retry_after_missing,
            "latency_p50_ms": round(1000 * percentile(latencies, 50), 1) if latencies else None,
            "latency_p99_ms": round(1000 * percentile(latencies, 99), 1) if latencies else None}


async def burst(url: str, size: int) -> dict:
    kinds = [k for k in request_kinds() if k[0] in ("v1-all", "v1-ner", "v2-json")]
    return await run_mix(url, size, size, kinds)


async def task_list_attack(url: str) -> dict:
    """Three 20,000-name requests beside /healthz probes: their latencies."""
    many = "/v1/infer?tasks=" + ",".join(["sentiment"] * 1000 + ["a"] * 19_000)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async def big():
            t0 = time.perf_counter()
            r = await client.post(many, json={"inputs": ["a"]})
            return r.status_code, time.perf_counter() - t0

        async def health():
            out = []
            for _ in range(10):
                t0 = time.perf_counter()
                r = await client.get("/healthz")
                out.append((r.status_code, time.perf_counter() - t0))
            return out

        results = await asyncio.gather(big(), big(), big(), health())
    bigs, probes = results[:3], results[3]
    return {"statuses": [s for s, _ in bigs], "seconds_max": round(max(t for _, t in bigs), 4),
            "healthz_statuses": sorted({s for s, _ in probes}), "healthz_seconds_max": round(max(t for _, t in probes), 4)}


def slow_clients(url: str, connections: int, timeout_s: float) -> dict:
    """`connections` sockets that each send part of a request head and stop; /healthz is asked
    meanwhile; then how each slow connection ended."""
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for i in range(connections):
        s = socket.create_connection((host, int(port)), timeout=timeout_s * 10)
        s.sendall(b"POST /v1/infer HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n" + (b"\r\n{" if i % 2 else b"x-slow: a"))
        socks.append(s)
    health = httpx.get(url + "/healthz", timeout=5).status_code
    endings = collections.Counter()
    for s in socks:
        try:
            data = s.recv(4096)
            endings[data.split(b"\r\n", 1)[0].decode(errors="replace") or "closed without answer"] += 1
        except OSError as exc:
            endings[type(exc).__name__] += 1
        finally:
            s.close()
    return {"connections": connections, "healthz_meanwhile": health, "endings": dict(endings)}


def corrupt_versions(store: Path, backbone_path) -> dict[str, str]:
    """Bad versions of sentiment beside the good one: version -> what is wrong with it."""
    import torch

    from modules_store import ModuleStore
    from server.backbone import Backbone
    from server.modules import load_module, save_module

    backbone = Backbone.load(backbone_path)
    modules = ModuleStore(store)
    head = load_module(modules, "sentiment", "1", backbone).head
    state = {k: v.clone() for k, v in head.state_dict().items()}
    with torch.no_grad():
        head.projections[0, 0, 0] = float("nan")
    save_module(modules, "sentiment", "91", head, backbone)
    head.load_state_dict(state)
    with torch.no_grad():
        head.layer_logits.copy_(torch.tensor([3e38, -3e38] * len(head.layer_logits))[: len(head.layer_logits)])
    save_module(modules, "sentiment", "92", head, backbone)
    head.load_state_dict(state)
    folder = save_module(modules, "sentiment", "93", head, backbone)
    weights = folder / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    folder = save_module(modules, "sentiment", "94", head, backbone)
    (folder / "manifest.json").write_text("{broken")
    return {"91": "NaN weight, right checksum", "92": "finite weights computing NaN", "93": "checksum mismatch",
            "94": "broken manifest"}


async def reloads_under_load(url: str, total: int, concurrency: int, bad: dict[str, str], rounds: int) -> dict:
    admin = collections.Counter()

    async def reloader():
        async with httpx.AsyncClient(base_url=url, timeout=120, headers=AUTH) as client:
            for _ in range(rounds):
                for version in bad:
                    r = await client.post("/admin/modules/sentiment/load", json={"version": version})
                    admin[f"{version}:{r.status_code}"] += 1
                r = await client.post("/admin/modules/sentiment/reload", json={"version": "1"})
                admin[f"1:{r.status_code}"] += 1

    kinds = [k for k in request_kinds() if k[0].startswith(("v1-", "v2-"))]
    load, _ = await asyncio.gather(run_mix(url, total, concurrency, kinds), reloader())
    return {"load": load, "admin": dict(admin), "bad_versions": bad}


async def sigterm_with_fresh_connections(server: ServerProcess, total: int, concurrency: int) -> dict:
    outcomes = collections.Counter()
    kinds = [k for k in request_kinds() if k[0] in ("v1-all", "v1-ner", "v2-json")]
    # one connection per request: a request written onto a keep-alive connection the server is
    # closing would read as lost when the server never received it
    async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                 limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)) as client:
        async def one(i):
            kind, method, path, kwargs, _ = kinds[i % len(kinds)]
            try:
                r = await client.request(method, path, **kwargs)
                outcomes[str(r.status_code)] += 1
            except httpx.ConnectError:
                outcomes["refused (not accepted)"] += 1
            except httpx.HTTPError as exc:
                outcomes[f"lost ({type(exc).__name__})"] += 1  # connected, sent, no answer

        async def stop_midway():
            await asyncio.sleep(0.5)
            server.proc.send_signal(signal.SIGTERM)

        await asyncio.gather(*(one(i) for i in range(total)), stop_midway())
    code = await asyncio.get_running_loop().run_in_executor(None, server.proc.wait, 60)
    return {"requests": total, "outcomes": dict(outcomes), "exit_code": code,
            "lost": sum(v for k, v in outcomes.items() if k.startswith("lost"))}


def clients(url: str) -> dict:
    import numpy as np

    out = {}
    try:
        import tritonclient.http as th
        from tritonclient.utils import InferenceServerException

        client = th.InferenceServerClient(url=url.removeprefix("http://"))
        text = th.InferInput("text", [2], "BYTES")
        text.set_data_from_numpy(np.array([s.encode() for s in SENTENCES[:2]], dtype=object))
        ok = sum(client.infer(m, [text]).as_numpy(o) is not None for m, o in (("sentiment", "label"), ("ner", "entities")))
        formatted = 0
        for call in (lambda: client.infer("nope", [text]), lambda: client.get_model_metadata("nope"),
                     lambda: client.infer("sentiment", [text], parameters={"truncate": "false"})):
            try:
                call()
            except InferenceServerException as exc:
                formatted += str(exc).startswith("[4")
        out["tritonclient"] = {"infer_ok": ok, "of": 2, "errors_formatted": formatted, "errors_of": 3}
    except ImportError:
        out["tritonclient"] = "not installed"
    argv, sys.argv = sys.argv, sys.argv[:1]  # kserve parses the command line when imported (its --workers is an int)
    try:
        from kserve.inference_client import InferenceRESTClient, RESTConfig
        from kserve.protocol.infer_type import InferInput, InferRequest
    except ImportError:
        out["kserve"] = "not installed"
        return out
    finally:
        sys.argv = argv

    async def kserve_calls():
        tensor = InferInput("text", [2], "BYTES")
        tensor.set_data_from_numpy(np.array([s.encode() for s in SENTENCES[:2]], dtype=np.object_), binary_data=True)
        ok, refused = 0, 0
        async with InferenceRESTClient(RESTConfig(protocol="v2", timeout=60)) as client:
            for task in ("sentiment", "ner"):
                response = await client.infer(url, InferRequest(task, [tensor]), model_name=task)
                ok += len(response.outputs) > 0
            try:
                await client.infer(url, InferRequest("nope", [tensor]), model_name="nope")
            except httpx.HTTPStatusError as exc:
                refused += exc.response.status_code == 404 and isinstance(exc.response.json()["error"], str)
        return {"infer_ok": ok, "of": 2, "unknown_model_404_in_oip_shape": refused}

    out["kserve"] = asyncio.run(kserve_calls())
    return out


async def reload_race(server: ServerProcess, weights: Path, how: str, seconds: float, concurrency: int) -> dict:
    """Reloads of sentiment back to back while its weights change under the server, and traffic
    comparing every answer with the checked weights' answer (labels exactly, scores within 0.01:
    batch composition moves bf16 scores by ~1e-3, swapped rows move them by far more)."""
    checked = weights.read_bytes()
    body = {"inputs": SENTENCES[:3]}
    statuses, admin, wrong, lost = collections.Counter(), collections.Counter(), [], 0
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        expected = (await client.post("/v1/infer?tasks=sentiment", json=body)).raise_for_status().json()["results"]
        stop = threading.Event()
        writer = threading.Thread(target=rewrite_until, args=(weights, [checked, rows_swapped(checked)], how, stop))
        writer.start()
        end = time.monotonic() + seconds

        async def reloader():
            nonlocal lost
            while time.monotonic() < end:
                try:
                    r = await client.post("/admin/modules/sentiment/reload", headers=AUTH)
                    admin[r.status_code if r.status_code != 409 else f"409 {r.json()['error']['type']}"] += 1
                except httpx.HTTPError as exc:
                    admin[type(exc).__name__] += 1
                    lost += 1
                    await asyncio.sleep(0.5)

        async def traffic():
            nonlocal lost
            while time.monotonic() < end:
                try:
                    r = await client.post("/v1/infer?tasks=sentiment", json=body)
                except httpx.HTTPError as exc:
                    statuses[type(exc).__name__] += 1
                    lost += 1
                    await asyncio.sleep(0.5)
                    continue
                statuses[r.status_code] += 1
                if r.status_code == 200:
                    for got, want in zip(r.json()["results"], expected):
                        g, w = got["sentiment"], want["sentiment"]
                        if g["label"] != w["label"] or abs(g["score"] - w["score"]) > 0.01:
                            wrong.append((g["label"], round(g["score"], 4), w["label"], round(w["score"], 4)))

        try:
            await asyncio.gather(reloader(), *(traffic() for _ in range(concurrency)))
        finally:
            stop.set()
            writer.join()
            weights.write_bytes(checked)
        alive = server.proc.poll() is None
        after = None
        if alive:
            after = (await client.post("/admin/modules/sentiment/reload", headers=AUTH)).status_code
    return {"how": how, "seconds": seconds, "concurrency": concurrency, "reloads": dict((str(k), v) for k, v in admin.items()),
            "answers": dict((str(k), v) for k, v in statuses.items()), "wrong_answers": len(wrong),
            "wrong_examples": wrong[:5], "lost_or_refused_connections": lost, "server_alive": alive,
            "exit_code": server.proc.poll(), "reload_after": after}


async def tokenize_stall(url: str, requests: int, max_chars: int, max_tokenize_chars: int) -> dict:
    """`requests` tokenize requests at the character cap at once (half /v1/tokenize, half TEI
    /tokenize), /healthz asked every 50 ms until they are answered; then one over the cap."""
    text = (" ".join(SENTENCES) + " ") * (max_chars // len(" ".join(SENTENCES)) + 1)
    inputs = [text[:max_chars]] * (max_tokenize_chars // max_chars)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def tokenize(i):
            t0 = time.perf_counter()
            r = await client.post("/v1/tokenize" if i % 2 == 0 else "/tokenize", json={"inputs": inputs})
            return r.status_code, len(r.content), time.perf_counter() - t0

        async def probe(running):
            latencies, statuses = [], collections.Counter()
            while not running.done():
                t0 = time.perf_counter()
                r = await client.get("/healthz")
                latencies.append(time.perf_counter() - t0)
                statuses[r.status_code] += 1
                await asyncio.sleep(0.05)
            return latencies, statuses

        running = asyncio.ensure_future(asyncio.gather(*(tokenize(i) for i in range(requests))))
        latencies, health = await probe(running)
        answers = await running
        over = await client.post("/v1/tokenize", json={"inputs": inputs + ["x" * max_chars]})
        tei_over = await client.post("/tokenize", json={"inputs": inputs + ["x" * max_chars]})
    return {"requests": requests, "characters_each": sum(map(len, inputs)),
            "statuses": dict(collections.Counter(str(s) for s, _, _ in answers)),
            "answer_mb_max": round(max(b for _, b, _ in answers) / 1e6, 2),
            "seconds_max": round(max(t for _, _, t in answers), 2),
            "healthz_probes": len(latencies), "healthz_statuses": {str(k): v for k, v in health.items()},
            "healthz_seconds_max": round(max(latencies), 4),
            "healthz_seconds_p99": round(percentile(latencies, 99), 4),
            "over_cap": {"/v1/tokenize": over.status_code, "/tokenize": tei_over.status_code}}
def smuggling(url: str, rounds: int) -> dict:
    """Raw requests with Content-Length and Transfer-Encoding: chunked, a GET hidden after the last
    chunk: RFC 9112 6.1 wants one answer (here 400) and the connection closed."""
    from urllib.parse import urlsplit

    address = urlsplit(url)
    paths = ["/v1/infer", "/v2/models/sentiment/infer", "/v1/embeddings", "/embed", "/tokenize", "/v1/tokenize"]
    smuggled = b"GET /v1/tasks HTTP/1.1\r\nhost: x\r\n\r\n"
    body = b"0\r\n\r\n" + smuggled
    statuses, answers_per_connection = collections.Counter(), collections.Counter()
    smuggled_answered = closed = 0
    for i in range(rounds):
        path = paths[i % len(paths)]
        head = (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\ntransfer-encoding: chunked\r\n\r\n").encode()
        received = b""
        with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
            sock.sendall(head + body)
            try:
                while chunk := sock.recv(65536):
                    received += chunk
                closed += 1
            except (socket.timeout, ConnectionResetError):
                pass
        answers = received.count(b"HTTP/1.1 ")
        answers_per_connection[answers] += 1
        smuggled_answered += max(0, answers - 1)
        if answers:
            statuses[int(received.split(b" ", 2)[1])] += 1
    return {"requests": rounds, "statuses": dict(statuses), "answers_per_connection": dict(answers_per_connection),
            "smuggled_answered": smuggled_answered, "connections_closed_by_server": closed}


def drain_with_keep_alive_clients(server: ServerProcess, clients: int, answers_before: int) -> dict:
    """`clients` keep-alive clients (bench/live_server.py `sigterm_under_load`) until the server stops
    listening; SIGTERM once `answers_before` requests were answered. Lost: sent on an open connection
    and never answered."""
    body = json.dumps({"inputs": SENTENCES})
    request = (f"POST /v1/infer?tasks=sentiment,ner HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               f"content-length: {len(body)}\r\n\r\n{body}").encode()
    run = sigterm_under_load(server.url, server.proc, {request: clients}, answers_before, timeout=300)
    outcomes = run.outcomes[request]
    return {"clients": clients, "answered_before_sigterm": run.answered_before_sigterm, "outcomes": dict(outcomes),
            "lost": outcomes["lost"], "exit_code": run.exit_code}


def framing_and_drain(name: str, env: dict, log: Path, clients: int, smuggling_rounds: int) -> dict:
    """The framing and drain checks on a server of their own (the drain stops it)."""
    with running_server(name, env, log) as server:
        out = {"smuggling": smuggling(server.url, smuggling_rounds)}
        out["drain_keep_alive"] = drain_with_keep_alive_clients(server, clients, answers_before=clients * 5)
    return out


def missing_backbone(tmp: Path) -> dict:
    import subprocess

    empty = tmp / "empty-backbone"
    empty.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    p = subprocess.run([*serve_command(), "--port", "0", "--backbone", str(empty), "--store", str(tmp)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [line for line in p.stderr.splitlines() if line.startswith("tmod-serve: cannot serve")]
    return {"exit_code": p.returncode, "seconds": round(time.perf_counter() - t0, 1), "stderr_line": lines[:1]}


CHECKS = ("missing_backbone", "load", "burst", "task_list_attack", "slow_clients", "reloads", "tokenize_stall",
          "reload_race", "clients", "sigterm", "framing_and_drain")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000,
                        help="requests of the load check (half of them under the reloads, a quarter at the SIGTERM)")
    parser.add_argument("--concurrency", type=int, default=64,
                        help="requests at once in the load and SIGTERM checks, keep-alive clients in the drain")
    parser.add_argument("--burst", type=int, default=512, help="requests sent all at once in the burst check")
    parser.add_argument("--reload-rounds", type=int, default=5,
                        help="reloads: rounds of loading every corrupted version, then the good one, under load")
    parser.add_argument("--workers", default="1,2", help="comma list of --workers layouts to check")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server (the machine is shared)")
    parser.add_argument("--backbone", default=None, help="default: the shipped MiniLM")
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma list of checks to run (of {','.join(CHECKS)})")
    parser.add_argument("--race-seconds", type=float, default=30.0, help="each reload race (in place, by rename)")
    parser.add_argument("--tokenize-requests", type=int, default=8, help="tokenize requests at the cap at once")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "attack-cpu.json"),
                        help="JSON results (default bench/results/attack-cpu.json)")
    args = parser.parse_args(argv)
    checks = set(args.checks.split(","))
    if checks - set(CHECKS):
        parser.error(f"unknown checks {sorted(checks - set(CHECKS))}; choose from {','.join(CHECKS)}")

    tmp = Path(tempfile.mkdtemp(prefix="tmod-attack-"))
    result = {"machine": machine_info("cpu"), "settings": vars(args), "layouts": {}}
    try:
        store = tmp / "store"
        for task in ("sentiment", "ner", "acceptability", "entailment"):
            shutil.copytree(REPO / "modules_store" / task, store / task)
        bad = corrupt_versions(store, args.backbone) if "reloads" in checks else {}
        if "missing_backbone" in checks:
            result["missing_backbone"] = missing_backbone(tmp)
        for workers in [int(w) for w in args.workers.split(",")]:
            env = {"TMOD_STORE": str(store), "TMOD_WORKERS": str(workers), "TMOD_THREADS": str(args.threads),
                   "TMOD_ADMIN_TOKEN": TOKEN, "TMOD_HEADER_TIMEOUT_S": "2", "TMOD_BODY_TIMEOUT_S": "2",
                   "TMOD_TASKS": "sentiment,ner,acceptability,entailment", "TMOD_LOG_LEVEL": "warning",
                   "HF_HUB_OFFLINE": "1", **({"TMOD_BACKBONE": args.backbone} if args.backbone else {})}
            layout = {}
            with running_server(f"workers{workers}", env, tmp / f"workers{workers}.log") as server:
                layout["readyz"] = httpx.get(server.url + "/readyz").json()
                if "load" in checks:
                    layout["load"] = asyncio.run(run_mix(server.url, args.requests, args.concurrency))
                if "burst" in checks:
                    layout["burst"] = asyncio.run(burst(server.url, args.burst))
                if "task_list_attack" in checks:
                    layout["task_list_attack"] = asyncio.run(task_list_attack(server.url))
                if "slow_clients" in checks:
                    layout["slow_clients"] = slow_clients(server.url, 40, 2)
                if "reloads" in checks:
                    layout["reloads"] = asyncio.run(reloads_under_load(server.url, args.requests // 2, 16, bad,
                                                                       args.reload_rounds))
                if "tokenize_stall" in checks:
                    layout["tokenize_stall"] = asyncio.run(tokenize_stall(server.url, args.tokenize_requests,
                                                                          20_000, 100_000))
                if "reload_race" in checks:
                    for how in ("in_place", "rename"):
                        layout[f"reload_race_{how}"] = asyncio.run(reload_race(
                            server, store / "sentiment" / "1" / "weights.safetensors", how, args.race_seconds, 8))
                        if server.proc.poll() is not None:
                            break
                if "clients" in checks:
                    layout["clients"] = clients(server.url)
                if server.proc.poll() is None:
                    layout["healthy_after"] = httpx.post(server.url + "/v1/infer", json={"inputs": SENTENCES}).status_code
                if "sigterm" in checks and server.proc.poll() is None:
                    layout["sigterm"] = asyncio.run(
                        sigterm_with_fresh_connections(server, args.requests // 4, args.concurrency))
            if "framing_and_drain" in checks:
                layout["framing_and_drain"] = framing_and_drain(f"workers{workers}-drain", env, tmp / f"drain{workers}.log",
                                                                args.concurrency, 60)
            result["layouts"][f"workers={workers}"] = layout
            print(json.dumps({k: (v if k in ("sigterm", "clients", "slow_clients", "task_list_attack", "tokenize_stall",
                                             "framing_and_drain") or k.startswith("reload_race") else
                                  {kk: vv for kk, vv in v.items() if kk in ("by_status", "unexpected", "errors_5xx")}
                                  if isinstance(v, dict) and "by_status" in v else None)
                              for k, v in layout.items()}, indent=1, default=str), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
