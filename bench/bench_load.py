#!/usr/bin/env python
"""Load benchmark: throughput and latency of a real `tmod-serve` on loopback, batching on vs off.

What it does
------------
1. Module store: with `--store PATH` the tasks are served from that store; without it a temporary
   store is written with random-weight layer-mix heads on the real backbone (default
   all-MiniLM-L6-v2), sized like the `tmod-train` defaults: `sentiment` (sequence, 2 labels, k=64,
   one self-attention layer) and `ner` (token, 9 CoNLL BIO labels, k=128, one pre-LN encoder layer,
   FFN 512), plus `acceptability` (sequence, k=64). Every head mixes all L+1 states (cutoff 0),
   so every request runs the full backbone. Random weights cost exactly what trained ones do.
2. Two servers are started as subprocesses (`tmod-serve`, 127.0.0.1 only, free ports), both kept
   up for the whole run: one with batching on (TMOD_BATCHING=true) and one with batching off
   (TMOD_BATCHING=false: one request per backbone pass, "batch-1 serving"). Settings are passed as
   TMOD_* environment variables. The idle one costs no CPU while the other is measured.
3. A closed-loop asyncio httpx load generator drives one server at a time at each concurrency
   level (default 1, 2, 4, 8, 16, 32, 64): `c` workers, each sending its next request as soon as
   the previous one is answered, each over its own keep-alive connection (one httpx.AsyncClient
   per worker: in a first version, one shared pool of 64 connections cost the generator ~5x more
   CPU per request at concurrency 64 under bursty batched replies and added seconds to their p99). Every request is one real sentence
   from SST-2 validation (shuffled with a seed; both servers get the same sequence) and asks for
   `--tasks` (default ner,sentiment). Each measurement: `--warmup` seconds of load (not recorded),
   then a window bounded by `--duration` seconds AND `--max-requests` completed requests,
   whichever comes first; then in-flight requests are drained.
4. Drift control: the machine is shared and noisy. Each level is measured `--rounds` times, and
   within a level the order of the two servers alternates (round 1: on/off, round 2: off/on, and
   the starting order alternates between levels), so each on/off pair is measured seconds apart.
   Results pool the rounds (throughput = all completions / all window time; percentiles over all
   latencies) and also give the per-round on/off ratios. The 1-minute load average is recorded at
   the start and end of the run and around every measurement, with the CPU time that the server,
   the load generator and the whole machine used in each window (from /proc).
5. Recorded per level and configuration: requests/s, sequences/s, p50/p95/p99/max latency (client
   side: request sent to response parsed), errors (any non-200 or transport error, by kind), and
   from the server's /metrics (diffed around the window): achieved mean batch size in requests
   (`tmod_batch_requests`) and in inputs (`tmod_batch_size`), mean padded batch tokens, and mean
   queue / backbone / heads time per request.

Threads: the server's torch intra-op threads are pinned with `--threads` (default 1). On a 2-core
machine the compute thread gets one core; the other is left to the server's event loop (HTTP,
JSON, pydantic), its tokenizer threads and this load generator, which all need CPU at hundreds of
requests/s. Giving torch 2 threads would oversubscribe the cores (the event loop and generator
preempt a torch worker and the whole parallel region waits for it).

Outputs: `bench/results/load-cpu.{json,png,md}` (`--quick`: `load-cpu-quick.*`).

    .venv/bin/python bench/bench_load.py            # full run, ~8 min
    .venv/bin/python bench/bench_load.py --quick    # smoke run, ~1 min
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import itertools
import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.environment import loadavg, machine_info, read_sst2_sentences as read_sentences  # noqa: E402
from training.data import default_data_dir  # noqa: E402

CONLL_LABELS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]
SST2_LABELS = ["negative", "positive"]
COLA_LABELS = ["unacceptable", "acceptable"]
TARGET_CONCURRENCY = 32
TARGET_THROUGHPUT_RATIO = 3.0  # batching on / off at concurrency 32: at least this
TARGET_P99_RATIO = 2.0  # batching on / off p99 at concurrency 32: at most this
CONFIGS = {"batching_on": "true", "batching_off": "false"}
LABELS = {"batching_on": "batching on", "batching_off": "batching off (batch-1)"}


# ---------------------------------------------------------------------------------------------
# inputs, store, machine
# ---------------------------------------------------------------------------------------------
def build_store(store_dir: Path, backbone_path: str | None, seed: int) -> dict:
    """Random-weight layer-mix heads sized like the tmod-train defaults, saved as real artifacts."""
    import torch

    from modules_store import ModuleStore
    from server.backbone import Backbone
    from server.heads.layermix import LayerMixConfig, LayerMixHead
    from server.modules import save_module

    t0 = time.perf_counter()
    backbone = Backbone.load(backbone_path)
    store = ModuleStore(store_dir)
    layers = list(range(backbone.num_layers + 1))
    specs = {
        "sentiment": dict(task_type="sequence_classification", labels=SST2_LABELS, project_dim=64, alpha=64.0,
                          ffn_dim=256),
        "ner": dict(task_type="token_classification", labels=CONLL_LABELS, project_dim=128, alpha=128.0,
                    ffn_dim=512),
        "acceptability": dict(task_type="sequence_classification", labels=COLA_LABELS, project_dim=64, alpha=64.0,
                              ffn_dim=256),
    }
    described = {}
    for i, (task, spec) in enumerate(specs.items()):
        labels = spec.pop("labels")
        torch.manual_seed(seed * 100 + i)
        config = LayerMixConfig(num_labels=len(labels), hidden_size=backbone.hidden_size, layers=layers,
                                cutoff=0.0, **spec)
        head = LayerMixHead(config, labels)
        with torch.no_grad():  # spread the layer logits a little so the mix is not uniform
            head.layer_logits.copy_(torch.randn(len(layers)) * 0.05)
        save_module(store, task, "1", head.eval(), backbone, description="bench_load: random weights")
        described[task] = {**spec, "labels": len(labels), "layers": layers}
    info = {"backbone": backbone.name, "num_layers": backbone.num_layers, "hidden_size": backbone.hidden_size,
            "heads": described, "seconds": round(time.perf_counter() - t0, 1)}
    del backbone
    return info










# ---------------------------------------------------------------------------------------------
# CPU accounting from /proc (Linux; absent elsewhere -> None)
# ---------------------------------------------------------------------------------------------
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime, all threads
    except (OSError, IndexError, ValueError):
        return None


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """{thread id: utime + stime seconds} for every thread of a process."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
        except (OSError, IndexError, ValueError):
            pass
    return out


def system_cpu() -> tuple[float, float, float] | None:
    """(busy, total, steal) jiffies over all CPUs since boot (busy excludes idle, iowait, steal)."""
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    steal = values[7] if len(values) > 7 else 0
    total = sum(values[:8])
    return total - idle - steal, total, steal


class CpuWindow:
    """CPU cores used over a window by the server, this process (load generator) and the machine."""

    def __init__(self, server_pid: int):
        self.pid = server_pid

    def start(self):
        self.t = time.perf_counter()
        self.server = proc_cpu_seconds(self.pid)
        self.threads = thread_cpu_seconds(self.pid)
        self.me = time.process_time()
        self.system = system_cpu()
        self.load_start = loadavg()

    def stop(self) -> dict:
        wall = time.perf_counter() - self.t
        server, me, system = proc_cpu_seconds(self.pid), time.process_time(), system_cpu()
        out = {"load_avg_1min_start": self.load_start[0] if self.load_start else None,
               "load_avg_1min_end": (loadavg() or [None])[0],
               "server_cores": round((server - self.server) / wall, 3) if server is not None and self.server is not None else None,
               "generator_cores": round((me - self.me) / wall, 3)}
        threads = thread_cpu_seconds(self.pid)
        if threads:
            # Python 3.11 does not name OS threads: the main thread (tid == pid) runs the event loop
            # (HTTP, JSON, validation, the batcher); the busiest other thread is the compute thread
            delta = {tid: threads[tid] - self.threads.get(tid, 0.0) for tid in threads}
            main_thread = delta.pop(self.pid, 0.0)
            busiest = max(delta.values(), default=0.0)
            out["server_threads_cores"] = {
                "event_loop_main_thread": round(main_thread / wall, 3),
                "busiest_other_thread_compute": round(busiest / wall, 3),
                "all_other_threads": round((sum(delta.values()) - busiest) / wall, 3),
            }
        if system and self.system and system[1] > self.system[1]:
            busy = (system[0] - self.system[0]) / (system[1] - self.system[1])
            out["machine_busy_cores"] = round(busy * (os.cpu_count() or 1), 3)
            out["steal_cores"] = round((system[2] - self.system[2]) / (system[1] - self.system[1]) * (os.cpu_count() or 1), 3)
            if out["server_cores"] is not None:
                out["other_cores"] = round(out["machine_busy_cores"] - out["server_cores"] - out["generator_cores"], 3)
        return out


# ---------------------------------------------------------------------------------------------
# the servers
# ---------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(custom: str | None = None) -> list[str]:
    if custom:
        return shlex.split(custom)
    script = Path(sys.executable).parent / "tmod-serve"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "server.cli"]


class ServerProcess:
    def __init__(self, name: str, env: dict[str, str], log_path: Path, command: list[str]):
        self.name = name
        self.command = command
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, **env, "TMOD_HOST": "127.0.0.1", "TMOD_PORT": str(self.port)}
        self.settings = {k: v for k, v in env.items() if k.startswith("TMOD_")}
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command, cwd=REPO, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                r = httpx.get(self.url + "/readyz", timeout=2)
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"{self.name} server not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)  # graceful: drain and exit
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()
        return self.proc.returncode


# ---------------------------------------------------------------------------------------------
# /metrics
# ---------------------------------------------------------------------------------------------
def parse_metrics(text: str) -> dict[str, float]:
    """Flat {sample name + labels: value} from the Prometheus text format."""
    from prometheus_client.parser import text_string_to_metric_families

    flat = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            if "le" in sample.labels:
                continue  # buckets are not needed
            flat[f"{sample.name}{{{labels}}}"] = sample.value
    return flat


def metrics_delta(before: dict, after: dict) -> dict:
    def d(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    def mean(name):
        count = d(f"{name}_count{{}}")
        return d(f"{name}_sum{{}}") / count if count else None

    def phase(p):
        count = d(f"tmod_request_duration_seconds_count{{phase={p}}}")
        return d(f"tmod_request_duration_seconds_sum{{phase={p}}}") / count * 1000 if count else None

    passes = d("tmod_batch_size_count{}")
    return {
        "backbone_passes": int(passes),
        "mean_batch_requests": mean("tmod_batch_requests"),
        "mean_batch_inputs": mean("tmod_batch_size"),
        "mean_batch_padded_tokens": mean("tmod_batch_tokens"),
        "server_successes": int(d("tmod_requests_total{outcome=success}")),
        "server_mean_ms": {p: phase(p) for p in ("queue", "tokenize", "backbone", "heads", "total")},
        "server_errors": {k.split("type=", 1)[1].rstrip("}"): int(after[k] - before.get(k, 0.0))
                          for k in after if k.startswith("tmod_request_errors_total{") and after[k] - before.get(k, 0.0)},
        "dropped": {k.split("reason=", 1)[1].rstrip("}"): int(after[k] - before.get(k, 0.0))
                    for k in after if k.startswith("tmod_dropped_requests_total{") and after[k] - before.get(k, 0.0)},
    }


# ---------------------------------------------------------------------------------------------
# the load generator
# ---------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile, linear between order statistics (numpy's default); None for no values."""
    if not values:
        return None
    import numpy as np

    return float(np.percentile(np.asarray(values), q))


async def measure(server: ServerProcess, bodies: list[bytes], tasks: list[str], concurrency: int,
                  warmup_s: float, duration_s: float, max_requests: int, inputs_per_request: int,
                  timeout_s: float) -> dict:
    """One closed-loop measurement of one server at one concurrency."""
    import httpx

    # one client (one keep-alive connection) per worker: a single pool of `concurrency` connections
    # costs the generator more CPU per request as it grows, and more under bursty (batched) replies
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    clients = [httpx.AsyncClient(base_url=server.url, limits=limits, timeout=timeout_s) for _ in range(concurrency)]
    scraper = httpx.AsyncClient(base_url=server.url, timeout=30)
    path = "/v1/infer?tasks=" + ",".join(tasks)
    headers = {"content-type": "application/json"}
    counter = itertools.count()
    state = {"measure_start": None, "stop": False, "done": 0}
    stopped = asyncio.Event()
    records: list[tuple[float, float, str]] = []  # (start, end, outcome) for requests started in the window
    warm_errors: dict[str, int] = {}

    def check(r) -> str:
        if r.status_code != 200:
            return f"http_{r.status_code}"
        try:
            results = r.json()["results"]
            if len(results) != inputs_per_request or any(set(res) != set(tasks) for res in results):
                return "bad_body"
        except (ValueError, KeyError, TypeError):
            return "bad_body"
        return "ok"

    async def worker(client):
        while not state["stop"]:
            body = bodies[next(counter) % len(bodies)]
            t0 = time.perf_counter()
            try:
                outcome = check(await client.post(path, content=body, headers=headers))
            except httpx.HTTPError as exc:
                outcome = type(exc).__name__
            t1 = time.perf_counter()
            start = state["measure_start"]
            if start is not None and t0 >= start:
                records.append((t0, t1, outcome))
                state["done"] += 1
                if state["done"] >= max_requests and not stopped.is_set():
                    stopped.set()
            elif outcome != "ok":
                warm_errors[outcome] = warm_errors.get(outcome, 0) + 1

    cpu = CpuWindow(server.proc.pid)
    workers = [asyncio.create_task(worker(client)) for client in clients]
    try:
        await asyncio.sleep(warmup_s)
        before = parse_metrics((await scraper.get("/metrics")).text)
        cpu.start()
        state["measure_start"] = time.perf_counter()
        try:
            await asyncio.wait_for(stopped.wait(), duration_s)
        except asyncio.TimeoutError:
            pass
        t_stop = time.perf_counter()
        state["stop"] = True
        await asyncio.gather(*workers)
        usage = cpu.stop()
        after = parse_metrics((await scraper.get("/metrics")).text)
    finally:
        state["stop"] = True
        for w in workers:
            w.cancel()
        for client in clients:
            await client.aclose()
        await scraper.aclose()

    window = t_stop - state["measure_start"]
    completed_in_window = [r for r in records if r[1] <= t_stop]
    ok_in_window = sum(1 for r in completed_in_window if r[2] == "ok")
    latencies = [(end - start) * 1000 for start, end, outcome in records if outcome == "ok"]
    errors: dict[str, int] = {}
    for _, _, outcome in records:
        if outcome != "ok":
            errors[outcome] = errors.get(outcome, 0) + 1
    rps = ok_in_window / window
    return {
        "concurrency": concurrency,
        "window_s": round(window, 3),
        "bounded_by": "requests" if stopped.is_set() else "time",
        "requests_recorded": len(records),
        "ok_completed_in_window": ok_in_window,
        "requests_per_s": rps,
        "sequences_per_s": rps * inputs_per_request,
        "latency_ms": summarise_latency(latencies),
        "latencies_ms": latencies,
        "errors": sum(errors.values()),
        "errors_by_kind": errors,
        "warmup_errors_by_kind": warm_errors,
        "server": metrics_delta(before, after),
        "cpu": usage,
    }


def summarise_latency(latencies: list[float]) -> dict:
    if not latencies:
        return {"n": 0, "mean": None, "p50": None, "p95": None, "p99": None, "max": None}
    return {"n": len(latencies), "mean": sum(latencies) / len(latencies), "p50": percentile(latencies, 50),
            "p95": percentile(latencies, 95), "p99": percentile(latencies, 99), "max": max(latencies)}


def pool(runs: list[dict], inputs_per_request: int) -> dict:
    """Combine the rounds of one (config, level): all completions over all window time."""
    window = sum(r["window_s"] for r in runs)
    ok = sum(r["ok_completed_in_window"] for r in runs)
    latencies = [x for r in runs for x in r["latencies_ms"]]
    errors: dict[str, int] = {}
    for r in runs:
        for kind, n in r["errors_by_kind"].items():
            errors[kind] = errors.get(kind, 0) + n
    passes = sum(r["server"]["backbone_passes"] for r in runs)
    rps = ok / window if window else 0.0

    def weighted(key):
        vals = [(r["server"][key], r["server"]["backbone_passes"]) for r in runs if r["server"][key] is not None]
        total = sum(w for _, w in vals)
        return sum(v * w for v, w in vals) / total if total else None

    def avg_cpu(key):
        vals = [r["cpu"].get(key) for r in runs if r["cpu"].get(key) is not None]
        return round(sum(vals) / len(vals), 3) if vals else None

    def phase(p):
        vals = [(r["server"]["server_mean_ms"][p], r["server"]["server_successes"]) for r in runs
                if r["server"]["server_mean_ms"][p] is not None]
        total = sum(w for _, w in vals)
        return sum(v * w for v, w in vals) / total if total else None

    return {
        "rounds": len(runs),
        "window_s": round(window, 3),
        "ok_completed_in_window": ok,
        "requests_per_s": rps,
        "sequences_per_s": rps * inputs_per_request,
        "requests_per_s_by_round": [r["requests_per_s"] for r in runs],
        "latency_ms": summarise_latency(latencies),
        "p99_ms_by_round": [r["latency_ms"]["p99"] for r in runs],
        "errors": sum(errors.values()),
        "errors_by_kind": errors,
        "backbone_passes": passes,
        "mean_batch_requests": weighted("mean_batch_requests"),
        "mean_batch_inputs": weighted("mean_batch_inputs"),
        "mean_batch_padded_tokens": weighted("mean_batch_padded_tokens"),
        "padded_tokens_per_input": (weighted("mean_batch_padded_tokens") / weighted("mean_batch_inputs")
                                    if weighted("mean_batch_inputs") else None),
        "server_mean_ms": {p: phase(p) for p in ("queue", "tokenize", "backbone", "heads", "total")},
        "server_threads_cores": {k: round(sum(r["cpu"]["server_threads_cores"][k] for r in runs) / len(runs), 3)
                                 for k in ("event_loop_main_thread", "busiest_other_thread_compute", "all_other_threads")}
        if all("server_threads_cores" in r["cpu"] for r in runs) else None,
        "server_cpu_ms_per_request": ({k: v * 1000 / rps for k, v in {
            "event_loop_main_thread": sum(r["cpu"]["server_threads_cores"]["event_loop_main_thread"] for r in runs) / len(runs),
            "compute_thread": sum(r["cpu"]["server_threads_cores"]["busiest_other_thread_compute"] for r in runs) / len(runs),
            "whole_process": sum(r["cpu"]["server_cores"] for r in runs) / len(runs),
        }.items()} if rps and all("server_threads_cores" in r["cpu"] and r["cpu"]["server_cores"] is not None
                                  for r in runs) else None),
        "cpu_cores": {k: avg_cpu(k) for k in ("server_cores", "generator_cores", "machine_busy_cores", "other_cores",
                                                  "steal_cores")},
    }


# ---------------------------------------------------------------------------------------------
# reports
# ---------------------------------------------------------------------------------------------
def fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def write_markdown(path: Path, result: dict) -> None:
    s = result["settings"]
    m = result["machine"]
    t = result["target"]
    lines = [
        f"# Load benchmark: batching on vs off ({'quick' if s['quick'] else 'full'} run, CPU)",
        "",
        f"{result['date']} · {m['cpu_model']}, {m['logical_cpus']} logical CPUs (shared, noisy) · "
        f"torch {m['versions']['torch']} · transformers {m['versions']['transformers']} · "
        f"tmod {(m['versions']['tmod_git']['commit'] or '?')[:10]}"
        f"{' (dirty)' if m['versions']['tmod_git']['dirty_tracked_files'] else ''}",
        "",
        f"Real `tmod-serve` processes on 127.0.0.1, backbone {result['store']['backbone']}, "
        f"tasks `{','.join(s['tasks'])}` per request, {s['inputs_per_request']} SST-2 validation sentence(s) "
        f"per request; closed-loop httpx load generator; per level {s['warmup_s']}s warm-up then "
        f"min({s['max_requests']} requests, {s['duration_s']}s), {s['rounds']} round(s) alternating the order "
        f"of the two servers. Server: {s['server_threads']} torch thread(s), max_wait {s['max_wait_ms']} ms, "
        f"max_batch_size {s['max_batch_size']}, max_batch_tokens {s['max_batch_tokens']}. "
        f"Load average (1/5/15 min) at start {result['load_average_start']}, at end {result['load_average_end']}.",
        "",
        f"## Target at concurrency {TARGET_CONCURRENCY}: "
        + ("**met**" if t["met"] else ("**not met**" if t["met"] is not None else "not measured")),
        "",
    ]
    if t["met"] is not None:
        lines += [
            f"- throughput batching on / off: **{t['throughput_ratio']:.2f}x** (target >= {TARGET_THROUGHPUT_RATIO:g}x; "
            f"per round: {', '.join(f'{x:.2f}' for x in t['throughput_ratio_by_round'])})",
            f"- p99 latency on / off: **{t['p99_ratio']:.2f}x** (target <= {TARGET_P99_RATIO:g}x; "
            f"per round: {', '.join(f'{x:.2f}' for x in t['p99_ratio_by_round'])})",
            f"- errors at this level: on {t['errors_on']}, off {t['errors_off']}",
            "",
        ]
    lines += [
        "## Results (rounds pooled)",
        "",
        "| conc. | config | req/s | seq/s | p50 ms | p95 ms | p99 ms | errors | mean batch (requests) "
        "| mean batch (inputs) | padded tokens / input | server ms: queue / backbone / heads | server cores "
        "| server CPU ms / request: all / event loop / compute | generator cores | other load (cores) |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: | ---: |",
    ]
    for level in result["levels"]:
        for config in CONFIGS:
            r = level[config]
            ph, lat, cpu = r["server_mean_ms"], r["latency_ms"], r["cpu_cores"]
            ms = r["server_cpu_ms_per_request"]
            per_request = (f"{fmt(ms['whole_process'])} / {fmt(ms['event_loop_main_thread'])} / "
                           f"{fmt(ms['compute_thread'])}" if ms else "-")
            lines.append(
                f"| {level['concurrency']} | {LABELS[config]} | {fmt(r['requests_per_s'])} | {fmt(r['sequences_per_s'])} "
                f"| {fmt(lat['p50'])} | {fmt(lat['p95'])} | {fmt(lat['p99'])} | {r['errors']} "
                f"| {fmt(r['mean_batch_requests'], 2)} | {fmt(r['mean_batch_inputs'], 2)} | {fmt(r['padded_tokens_per_input'])} "
                f"| {fmt(ph['queue'])} / {fmt(ph['backbone'])} / {fmt(ph['heads'])} "
                f"| {fmt(cpu['server_cores'], 2)} | {per_request} "
                f"| {fmt(cpu['generator_cores'], 2)} | {fmt(cpu['other_cores'], 2)} |"
            )
    lines += [
        "",
        "## Batching on / off, per concurrency",
        "",
        "| conc. | throughput ratio | p99 ratio | p50 ratio |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for level in result["levels"]:
        r = level["ratios_on_over_off"]
        lines.append(f"| {level['concurrency']} | {fmt(r['throughput'], 2)} | {fmt(r['p99'], 2)} | {fmt(r['p50'], 2)} |")
    lines += [
        "",
        "Latency is client side (request sent to response parsed). \"server ms\" are the server's own mean "
        "phase times per request from `/metrics`; \"backbone\" and \"heads\" are the time of the pass the "
        "request rode in (shared by every request of its batch). \"padded tokens / input\": rows x longest row "
        "per pass, divided by the inputs in it (batch-1: the real token count). CPU columns are cores used "
        "during the window by the server process, by the load generator, and by everything else on the "
        "machine (other jobs; hypervisor steal excluded, recorded in the JSON). Server CPU per request splits the "
        "server process's CPU time by thread: the main thread runs the event loop (HTTP, JSON, validation, "
        "batcher), the busiest other thread is the compute thread (backbone, heads, decoding).",
        "",
        f"Command: `{s['command']}`",
        "",
    ]
    path.write_text("\n".join(lines))


def write_plot(path: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    styles = {"batching_on": dict(color="tab:blue", marker="o"), "batching_off": dict(color="tab:orange", marker="s")}
    conc = [lv["concurrency"] for lv in result["levels"]]
    for config in CONFIGS:
        rows = [lv[config] for lv in result["levels"]]
        axes[0].plot(conc, [r["requests_per_s"] for r in rows], label=LABELS[config], **styles[config])
        axes[1].plot(conc, [r["latency_ms"]["p99"] for r in rows], label=f"{LABELS[config]} p99", **styles[config])
        axes[1].plot(conc, [r["latency_ms"]["p50"] for r in rows], label=f"{LABELS[config]} p50", linestyle=":",
                     color=styles[config]["color"], marker=".")
        axes[2].plot(conc, [r["mean_batch_requests"] for r in rows], label=LABELS[config], **styles[config])
    axes[0].set_ylim(bottom=0)
    axes[0].set_title("throughput")
    axes[0].set_ylabel("requests / s (1 sentence each)")
    axes[1].set_title("latency (client side)")
    axes[1].set_ylabel("ms")
    axes[1].set_yscale("log")
    axes[2].set_title("achieved batch size (server /metrics)")
    axes[2].set_ylabel("mean requests per backbone pass")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc)
        ax.set_xticklabels([str(c) for c in conc])
        ax.set_xlabel("concurrency (closed loop)")
        ax.axvline(TARGET_CONCURRENCY, color="grey", linewidth=0.8, linestyle="--")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    t = result["target"]
    if t["met"] is not None:
        fig.suptitle(f"tmod-serve on loopback, {result['machine']['cpu_model']} ({result['machine']['logical_cpus']} CPUs): "
                     f"at concurrency {TARGET_CONCURRENCY} batching gives {t['throughput_ratio']:.2f}x throughput, "
                     f"p99 ratio {t['p99_ratio']:.2f}x (target >= {TARGET_THROUGHPUT_RATIO:g}x, <= {TARGET_P99_RATIO:g}x)",
                     fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench_load.py",
        description="Bounded closed-loop load benchmark of tmod-serve on loopback (127.0.0.1): throughput and "
        "p50/p95/p99 latency per concurrency level, dynamic batching on vs off (batch-1). Starts its own "
        "servers; writes JSON, PNG and Markdown results.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--quick", action="store_true",
                   help="smoke run: levels 1,8,32, 1 round, 1s warm-up, 3s windows; writes *-quick.* outputs")
    p.add_argument("--store", type=Path, default=None,
                   help="module store to serve (default: a temporary store of random-weight heads "
                   "sentiment/ner/acceptability on the backbone)")
    p.add_argument("--backbone", default=None, help="local Hugging Face model directory (default all-MiniLM-L6-v2)")
    p.add_argument("--data-dir", type=Path, default=default_data_dir(),
                   help="datasets root holding sst2/validation.tsv (env TMOD_DATA_DIR)")
    p.add_argument("--tasks", default="ner,sentiment", help="tasks every request asks for")
    p.add_argument("--levels", default="1,2,4,8,16,32,64", help="concurrency levels (comma-separated)")
    p.add_argument("--rounds", type=int, default=2, help="measurements per (level, config); order alternates")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of unrecorded load before each window")
    p.add_argument("--duration", type=float, default=10.0, help="most seconds per measurement window")
    p.add_argument("--max-requests", type=int, default=4000, help="most requests per measurement window")
    p.add_argument("--inputs-per-request", type=int, default=1, help="sentences per request")
    p.add_argument("--threads", type=int, default=1, help="server torch intra-op threads (TMOD_THREADS)")
    p.add_argument("--max-wait-ms", type=float, default=2.0, help="TMOD_MAX_WAIT_MS of the batching server")
    p.add_argument("--max-batch-size", type=int, default=128, help="TMOD_MAX_BATCH_SIZE")
    p.add_argument("--max-batch-tokens", type=int, default=16384, help="TMOD_MAX_BATCH_TOKENS")
    p.add_argument("--max-queue", type=int, default=256, help="TMOD_MAX_QUEUE (above the top concurrency: no 429s)")
    p.add_argument("--log-level", default="info", help="server TMOD_LOG_LEVEL (info = one JSON access line per request, as shipped)")
    p.add_argument("--request-timeout", type=float, default=60.0, help="client timeout per request, seconds")
    p.add_argument("--seed", type=int, default=0, help="seed for the sentence order and the random heads")
    p.add_argument("--out", type=Path, default=None,
                   help="output path prefix (default bench/results/load-cpu, or load-cpu-quick with --quick)")
    p.add_argument("--serve-command", default=None,
                   help="server command line instead of tmod-serve (for experiments; it must read the TMOD_* "
                   "environment, including TMOD_HOST/TMOD_PORT)")
    p.add_argument("--keep-logs", action="store_true", help="copy the server logs next to the outputs")
    args = p.parse_args(argv)
    if args.quick:
        args.levels, args.rounds, args.warmup, args.duration = "1,8,32", 1, 1.0, 3.0
    args.level_list = [int(x) for x in args.levels.split(",") if x.strip()]
    if not args.level_list or min(args.level_list) < 1:
        p.error("--levels: positive integers")
    args.task_list = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if args.out is None:
        args.out = REPO / "bench" / "results" / ("load-cpu-quick" if args.quick else "load-cpu")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_begin = time.perf_counter()
    load_start = loadavg()
    print(f"load average at start: {load_start}", flush=True)
    sentences = read_sentences(args.data_dir)
    rng = random.Random(args.seed)
    rng.shuffle(sentences)
    per = args.inputs_per_request
    bodies = [json.dumps({"inputs": sentences[i * per:(i + 1) * per]}).encode()
              for i in range(len(sentences) // per)]
    print(f"{len(sentences)} sentences from {args.data_dir / 'sst2' / 'validation.tsv'}; {len(bodies)} request bodies",
          flush=True)

    workdir = Path(tempfile.mkdtemp(prefix="tmod-bench-load-"))
    servers: dict[str, ServerProcess] = {}
    try:
        if args.store is None:
            store_dir = workdir / "store"
            store_info = build_store(store_dir, args.backbone, args.seed)
            store_info["path"] = "temporary (random-weight heads)"
            print(f"built store of random heads in {store_info['seconds']}s: {list(store_info['heads'])}", flush=True)
        else:
            store_dir = args.store.resolve()
            store_info = {"path": str(store_dir), "backbone": args.backbone or "all-MiniLM-L6-v2 (default)"}
        common = {
            "TMOD_STORE": str(store_dir), "TMOD_THREADS": str(args.threads), "TMOD_MAX_WAIT_MS": str(args.max_wait_ms),
            "TMOD_MAX_BATCH_SIZE": str(args.max_batch_size), "TMOD_MAX_BATCH_TOKENS": str(args.max_batch_tokens),
            "TMOD_MAX_QUEUE": str(args.max_queue), "TMOD_LOG_LEVEL": args.log_level,
            "TMOD_MAX_INPUTS": str(max(64, per)),
        }
        if args.backbone:
            common["TMOD_BACKBONE"] = args.backbone
        for config, flag in CONFIGS.items():
            servers[config] = ServerProcess(config, {**common, "TMOD_BATCHING": flag}, workdir / f"{config}.log",
                                            serve_command(args.serve_command))
            servers[config].start()
        for config, server in servers.items():
            server.wait_ready(timeout=300)
            print(f"{config}: ready at {server.url} (pid {server.proc.pid})", flush=True)

        # preflight: one request each, and a warm-up burst at the top concurrency (oneDNN kernels, allocator)
        import httpx

        for config, server in servers.items():
            r = httpx.post(server.url + "/v1/infer", params={"tasks": ",".join(args.task_list)}, content=bodies[0],
                           headers={"content-type": "application/json"}, timeout=60)
            if r.status_code != 200:
                raise SystemExit(f"{config}: preflight request answered {r.status_code}: {r.text[:500]}")
        for config, server in servers.items():
            asyncio.run(measure(server, bodies, args.task_list, max(args.level_list), 2.0 if not args.quick else 1.0,
                                0.5, 10**9, per, args.request_timeout))
        print(f"servers warm ({time.perf_counter() - t_begin:.0f}s since start)", flush=True)

        runs: dict[tuple[str, int], list[dict]] = {}
        for r in range(args.rounds):
            for i, c in enumerate(args.level_list):
                order = list(CONFIGS) if (r + i) % 2 == 0 else list(reversed(CONFIGS))
                for config in order:
                    run = asyncio.run(measure(servers[config], bodies, args.task_list, c, args.warmup, args.duration,
                                              args.max_requests, per, args.request_timeout))
                    run["round"] = r + 1
                    run["order_position"] = order.index(config)
                    runs.setdefault((config, c), []).append(run)
                    lat = run["latency_ms"]
                    print(f"round {r + 1}/{args.rounds} c={c:<3} {config:<13} {run['requests_per_s']:7.1f} req/s "
                          f"p50 {fmt(lat['p50']):>7} p95 {fmt(lat['p95']):>7} p99 {fmt(lat['p99']):>7} ms "
                          f"errors {run['errors']} batch {fmt(run['server']['mean_batch_requests'], 2)} "
                          f"cores srv/gen/other {run['cpu'].get('server_cores')}/{run['cpu'].get('generator_cores')}/"
                          f"{run['cpu'].get('other_cores')} load {run['cpu']['load_avg_1min_end']} "
                          f"({time.perf_counter() - t_begin:.0f}s)", flush=True)

        exit_codes = {config: server.stop() for config, server in servers.items()}
        load_end = loadavg()
        levels = []
        for c in args.level_list:
            entry = {"concurrency": c}
            for config in CONFIGS:
                entry[config] = pool(runs[(config, c)], per)
            on, off = entry["batching_on"], entry["batching_off"]

            def ratio(a, b):
                return a / b if a is not None and b else None
            entry["ratios_on_over_off"] = {
                "throughput": ratio(on["requests_per_s"], off["requests_per_s"]),
                "p99": ratio(on["latency_ms"]["p99"], off["latency_ms"]["p99"]),
                "p50": ratio(on["latency_ms"]["p50"], off["latency_ms"]["p50"]),
                "throughput_by_round": [ratio(a, b) for a, b in zip(on["requests_per_s_by_round"],
                                                                     off["requests_per_s_by_round"])],
                "p99_by_round": [ratio(a, b) for a, b in zip(on["p99_ms_by_round"], off["p99_ms_by_round"])],
            }
            levels.append(entry)

        target = {"concurrency": TARGET_CONCURRENCY, "throughput_ratio_min": TARGET_THROUGHPUT_RATIO,
                  "p99_ratio_max": TARGET_P99_RATIO, "met": None}
        at = next((lv for lv in levels if lv["concurrency"] == TARGET_CONCURRENCY), None)
        if at is not None:
            r = at["ratios_on_over_off"]
            target.update(
                throughput_ratio=r["throughput"], p99_ratio=r["p99"],
                throughput_ratio_by_round=r["throughput_by_round"], p99_ratio_by_round=r["p99_by_round"],
                errors_on=at["batching_on"]["errors"], errors_off=at["batching_off"]["errors"],
                met=bool(r["throughput"] is not None and r["p99"] is not None and r["throughput"] >= TARGET_THROUGHPUT_RATIO
                         and r["p99"] <= TARGET_P99_RATIO and at["batching_on"]["errors"] == 0),
            )

        result = {
            "benchmark": "bench_load",
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(httpx=__import__("httpx").__version__),
            "load_average_start": load_start,
            "load_average_end": load_end,
            "wall_seconds": round(time.perf_counter() - t_begin, 1),
            "settings": {
                "command": " ".join([".venv/bin/python", "bench/bench_load.py", *(argv if argv is not None else sys.argv[1:])]),
                "quick": args.quick, "levels": args.level_list, "rounds": args.rounds, "warmup_s": args.warmup,
                "duration_s": args.duration, "max_requests": args.max_requests, "tasks": args.task_list,
                "inputs_per_request": per, "server_threads": args.threads, "max_wait_ms": args.max_wait_ms,
                "max_batch_size": args.max_batch_size, "max_batch_tokens": args.max_batch_tokens,
                "max_queue": args.max_queue, "server_log_level": args.log_level, "seed": args.seed,
                "data": str(args.data_dir / "sst2" / "validation.tsv"), "sentences": len(sentences),
                "server_env": {config: s.settings for config, s in servers.items()},
                "server_command": serve_command(args.serve_command), "host": "127.0.0.1",
                "generator": "closed loop, one asyncio process, `concurrency` workers each with its own "
                             "httpx.AsyncClient (one keep-alive connection); latency measured client side",
            },
            "store": store_info,
            "server_exit_codes": exit_codes,
            "target": target,
            "levels": levels,
            "runs": [{k: v for k, v in run.items() if k != "latencies_ms"} | {"config": config}
                     for (config, _), rs in runs.items() for run in rs],
        }
        # raw latencies stay out of the JSON (large); the percentiles above were computed from them
        args.out.parent.mkdir(parents=True, exist_ok=True)
        json_path, png_path, md_path = (args.out.with_name(args.out.name + ext) for ext in (".json", ".png", ".md"))
        json_path.write_text(json.dumps(result, indent=2) + "\n")
        write_plot(png_path, result)
        write_markdown(md_path, result)
        if args.keep_logs:
            for config, server in servers.items():
                shutil.copy(server.log_path, args.out.with_name(f"{args.out.name}-{config}.log"))
        print(md_path.read_text(), flush=True)
        print(f"wrote {json_path}, {png_path}, {md_path} ({time.perf_counter() - t_begin:.0f}s)", flush=True)
        return 0
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
