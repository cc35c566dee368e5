#!/usr/bin/env python
"""Memory of one tmod-serve replica, for sizing pods (deploy/README.md "Sizing").

Starts real `tmod-serve` processes on 127.0.0.1 (TMOD_THREADS=1, as in the CPU overlay) and reads
their resident memory from /proc (VmRSS now, VmHWM = peak):
1. an empty store: the backbone alone;
2. the load benchmark's store (bench/bench_load.py build_store: random-weight layer-mix heads
   `sentiment`, `ner`, `acceptability`, sized like the tmod-train defaults), after start, after a
   warm-up of short requests (SST-2 sentences, ner+sentiment), and after the largest requests the
   default limits admit: TMOD_MAX_INPUTS (64) inputs of about TMOD_MAX_TOKENS tokens each
   (truncated), which fill one backbone pass of max_batch_tokens;
3. the worst request mix the default limits allow (`--worst-clients`): at once, long-document
   requests at the limits (inputs of max_chars characters, as many as max_request_tokens word pieces
   admit, every task), tokenize requests at max_tokenize_chars, and short requests, for
   `--worst-seconds`, at each number of long-document clients given; RSS is sampled every 50 ms and
   VmHWM read at the end of each level (one fresh server per level);
4. sustained mixed traffic (`--mixed-rounds`): 8 clients sending requests of 1, 4 or 16 texts of 3 to
   400 words for varied task sets, tokenize requests and refused ones, the RSS read after each round of
   `--mixed-requests`, one fresh server per oneDNN primitive cache capacity in `--onednn-cache`
   (`default`: oneDNN's 1024; the cache of compiled bf16 matrix-product kernels grows with the
   distinct batch shapes a server meets, so it is what sustained traffic adds over one peak).
Head sizes are the servers' own `parameters` from GET /v1/tasks (x 4 bytes, fp32).

    .venv/bin/python deploy/measure_memory.py --out deploy/results/memory-cpu.json
    .venv/bin/python deploy/measure_memory.py --worst-only --worst-clients 1,8,32 --out deploy/results/memory-worst-minilm.json
    .venv/bin/python deploy/measure_memory.py --worst-only --backbone mpnet --out deploy/results/memory-worst-mpnet.json
    .venv/bin/python deploy/measure_memory.py --mixed-only --out deploy/results/memory-mixed-minilm.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import build_store, machine_info, read_sst2_sentences, running_server  # noqa: E402


def proc_memory_mib(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = round(int(value.split()[0]) / 1024, 1)
    return out


def serve(tmp: Path, store: Path, backbone: str | None = None, onednn_cache: str = "default"):
    """A fresh tmod-serve replica with one torch thread, loaded (bench/harness.py running_server; its
    log in `tmp`; an empty store counts as loaded once /readyz says no_modules); stopped with SIGTERM
    on leaving."""
    env = {"TMOD_STORE": str(store), "TMOD_THREADS": "1", "TMOD_LOG_LEVEL": "warning", "HF_HUB_OFFLINE": "1",
           **({"TMOD_BACKBONE": backbone} if backbone else {}),
           **({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": onednn_cache} if onednn_cache != "default" else {})}
    return running_server("memory", env, Path(tmp) / f"server-{store.name}-{onednn_cache}.log",
                          modules=any(store.iterdir()))


class PeakSampler:
    """The largest VmRSS of a process, read every `every` seconds in a thread."""

    def __init__(self, pid: int, every: float = 0.05):
        self.pid, self.every, self.peak_mib = pid, every, 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.wait(self.every):
            try:
                self.peak_mib = max(self.peak_mib, proc_memory_mib(self.pid)["VmRSS"])
            except (OSError, KeyError):
                return

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def long_document(sentences: list[str], chars: int) -> str:
    text, i = "", 0
    while len(text) < chars:
        text += sentences[i % len(sentences)] + " "
        i += 1
    return text[:chars]


async def worst_mix(url: str, sentences: list[str], long_clients: int, tokenize_clients: int, short_clients: int,
                    seconds: float) -> dict:
    """The mix of requests at the default limits, `seconds` long: what each kind was answered."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        limits = {"max_inputs": 64, "max_chars": 20_000, "max_request_tokens": 131_072, "max_tokenize_chars": 100_000}
        document = long_document(sentences, limits["max_chars"])
        read = (await client.post("/v1/tokenize", json={"inputs": [document]})).raise_for_status().json()
        per_input = sum(w["tokens"] for w in read["results"][0]["windows"])  # what max_request_tokens counts
        inputs = min(limits["max_inputs"], limits["max_request_tokens"] // per_input)
        long_body = {"inputs": [document[i:] + document[:i] for i in range(inputs)]}
        tokenize_body = {"inputs": [document] * (limits["max_tokenize_chars"] // limits["max_chars"])}
        kinds = {"long": ("/v1/infer", long_body, long_clients), "tokenize": ("/v1/tokenize", tokenize_body, tokenize_clients),
                 "short": ("/v1/infer?tasks=ner,sentiment", {"inputs": sentences[:4]}, short_clients)}
        answered = {kind: {} for kind in kinds}
        end = time.monotonic() + seconds

        async def one_client(kind):
            path, body, _ = kinds[kind]
            while time.monotonic() < end:
                try:
                    status = str((await client.post(path, json=body)).status_code)
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                answered[kind][status] = answered[kind].get(status, 0) + 1

        await asyncio.gather(*(one_client(kind) for kind, (_, _, n) in kinds.items() for _ in range(n)))
    return {"long_request": {"inputs": inputs, "characters_each": len(document), "word_pieces_counted": inputs * per_input},
            "tokenize_request_characters": sum(map(len, tokenize_body["inputs"])),
            "clients": {kind: n for kind, (_, _, n) in kinds.items()}, "seconds": seconds, "answered": answered}


def measure_worst(report: dict, tmp: Path, sentences: list[str], args) -> None:
    """Phase 3, one fresh server per number of long-document clients."""
    store = Path(tmp) / "store"
    if not store.exists():
        report["store"] = build_store(store, args.backbone, seed=0)
    levels = []
    for long_clients in [int(n) for n in args.worst_clients.split(",")]:
        with serve(tmp, store, args.backbone) as server:
            time.sleep(1)
            pid = server.proc.pid
            started = proc_memory_mib(pid)
            with PeakSampler(pid) as sampler:
                mix = asyncio.run(worst_mix(server.url, sentences, long_clients, args.worst_tokenize_clients,
                                            args.worst_short_clients, args.worst_seconds))
            levels.append({**mix, "after_start_mib": started, "peak_rss_sampled_mib": sampler.peak_mib,
                           "end_mib": proc_memory_mib(pid)})
            print(json.dumps(levels[-1]), flush=True)
    report["worst_mix"] = levels


async def mixed_round(url: str, words: list[str], requests: int, seed: int) -> dict:
    """`requests` requests from 8 clients, varied in size, tasks and kind: what each was answered."""
    import random

    pick = random.Random(seed)
    answered: dict[str, int] = {}

    def text() -> str:
        return " ".join(pick.choices(words, k=pick.choice([3, 10, 30, 120, 400])))

    async def one_client(client, count):
        for _ in range(count):
            kind = pick.random()
            if kind < 0.75:
                tasks = pick.choice(["ner", "ner,sentiment", "acceptability,sentiment", "sentiment", ""])
                body = {"inputs": [text() for _ in range(pick.choice([1, 1, 4, 16]))]}
                response = await client.post("/v1/infer" + (f"?tasks={tasks}" if tasks else ""), json=body)
            elif kind < 0.85:
                response = await client.post("/v1/tokenize", json={"inputs": [text()]})
            elif kind < 0.93:
                response = await client.post("/v1/infer?tasks=nope", json={"inputs": ["x"]})
            else:
                response = await client.post("/v1/infer", content=b'{"inputs": [1')
            answered[str(response.status_code)] = answered.get(str(response.status_code), 0) + 1

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await asyncio.gather(*(one_client(client, requests // 8) for _ in range(8)))
    return answered


def measure_mixed(report: dict, tmp: Path, sentences: list[str], args) -> None:
    """Phase 4, one fresh server per oneDNN primitive cache capacity."""
    store = Path(tmp) / "store"
    if not store.exists():
        report["store"] = build_store(store, args.backbone, seed=0)
    words = " ".join(sentences).split()
    levels = []
    for capacity in args.onednn_cache.split(","):
        with serve(tmp, store, args.backbone, capacity) as server:
            pid = server.proc.pid
            level = {"onednn_primitive_cache_capacity": capacity, "after_start_mib": proc_memory_mib(pid),
                     "rounds": []}
            for round_ in range(args.mixed_rounds):
                began = time.monotonic()
                answered = asyncio.run(mixed_round(server.url, words, args.mixed_requests, seed=round_))
                level["rounds"].append({"requests": args.mixed_requests, "seconds": round(time.monotonic() - began, 1),
                                        "answered": answered, **proc_memory_mib(pid)})
                print(json.dumps({"capacity": capacity, **level["rounds"][-1]}), flush=True)
            levels.append(level)
    report["mixed"] = levels


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Memory of one tmod-serve replica (RSS from /proc).")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    parser.add_argument("--backbone", default=None, help="the server's backbone (default: MiniLM; mpnet: the quality tier)")
    parser.add_argument("--worst-only", action="store_true", help="measure only phase 3, the worst allowed mix")
    parser.add_argument("--worst-clients", default="1,8,32", help="long-document clients at once, one level each")
    parser.add_argument("--worst-tokenize-clients", type=int, default=8,
                        help="phase 3: clients sending tokenize requests at max_tokenize_chars beside them")
    parser.add_argument("--worst-short-clients", type=int, default=8, help="phase 3: clients sending short requests")
    parser.add_argument("--worst-seconds", type=float, default=60.0, help="phase 3: how long each level runs")
    parser.add_argument("--mixed-only", action="store_true", help="measure only phase 4, sustained mixed traffic")
    parser.add_argument("--mixed-rounds", type=int, default=3, help="phase 4: rounds, RSS read after each")
    parser.add_argument("--mixed-requests", type=int, default=800, help="requests a round (8 clients)")
    parser.add_argument("--onednn-cache", default="default,8",
                        help="oneDNN primitive cache capacities, one fresh server each (default: oneDNN's own)")
    args = parser.parse_args(argv)
    sentences = read_sst2_sentences()
    report = {"command": "python deploy/measure_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "backbone": args.backbone or "minilm", "threads": 1, "machine": machine_info()}
    with tempfile.TemporaryDirectory(prefix="tmod-memory-") as tmp:
        if args.worst_only:
            measure_worst(report, Path(tmp), sentences, args)
        elif args.mixed_only:
            measure_mixed(report, Path(tmp), sentences, args)
        else:
            measure_baseline(report, Path(tmp), sentences)
            measure_worst(report, Path(tmp), sentences, args)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


def measure_baseline(report: dict, tmp: Path, sentences: list[str]) -> None:
    """Phases 1 and 2."""
    empty = Path(tmp) / "empty"
    empty.mkdir()
    with serve(tmp, empty) as server:
        time.sleep(1)
        report["backbone_only_after_start_mib"] = proc_memory_mib(server.proc.pid)

    store = Path(tmp) / "store"
    report["store"] = build_store(store, None, seed=0)
    with serve(tmp, store) as server:
        time.sleep(1)
        report["three_heads_after_start_mib"] = proc_memory_mib(server.proc.pid)
        tasks = httpx.get(server.url + "/v1/tasks", timeout=30).json()["tasks"]
        report["heads"] = {t["task"]: {"parameters": t["parameters"],
                                       "fp32_mib": round(t["parameters"] * 4 / 2**20, 2)} for t in tasks}
        with httpx.Client(base_url=server.url, timeout=120) as client:
            for text in sentences[:300]:
                client.post("/v1/infer", params={"tasks": "ner,sentiment"}, json={"inputs": [text]}).raise_for_status()
            report["after_300_short_requests_mib"] = proc_memory_mib(server.proc.pid)
            long_text = " ".join(sentences[:60])  # far beyond the token limit: truncated to it
            body = {"inputs": [long_text[i:] for i in range(64)], "truncate": True}
            for _ in range(3):
                response = client.post("/v1/infer", json=body)  # every loaded task
                response.raise_for_status()
            report["largest_request"] = {"inputs": 64, "tasks": sorted(response.json()["tasks"]),
                                         "truncated_inputs": len(response.json()["truncated"])}
            report["after_3_largest_requests_mib"] = proc_memory_mib(server.proc.pid)


if __name__ == "__main__":
    sys.exit(main())
