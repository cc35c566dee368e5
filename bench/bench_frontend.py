#!/usr/bin/env python
"""The serving path's ceiling: a real `tmod-serve` whose device pass is a constant-time stand-in.

What is measured is everything but the backbone: HTTP (uvicorn), JSON in and out, request
validation, tokenization, batching, collation and decode. The stand-in (benchmark-only, installed
here by `--serve`, never in server/) replaces `ModelRunner._pass`: each pass sleeps `--pass-ms`
(default 1 ms, about one replayed CUDA-graph pass on an H100) and returns logits of the right shape
for every task (random, copied out of a seeded pool drawn once, as a device pass's host side costs a
copy of its logits; decode does real work: token tasks get real BIO spans). The sleep releases the
GIL, as a device wait does. Since it stands for a GPU's pass, the
server cuts batches as on a GPU (`--batch-shapes buckets`: one pass per batch); `length_runs` gives
a CPU's several passes per batch, each with its own sleep and per-pass host work.

1. A store of random-weight heads (`harness.build_store`: sentiment, ner, acceptability on the real
   all-MiniLM-L6-v2 tokenizer and config) is written to a temporary folder.
2. One server is started (`python bench/bench_frontend.py --serve`, 127.0.0.1, batching on).
3. Two such servers, both up for the whole run: uvicorn's pure-Python stack (h11 parser, asyncio
   loop: before) and httptools + uvloop (after: what tmod-serve runs since issue 37, with its head limits
   and drain). Levels alternate which server goes first.
   For each (inputs per request, concurrency) of 1 x 64, 1 x 256, 32 x 64, 32 x 256: `--clients`
   load-generator processes share the concurrency, each an asyncio loop of closed-loop workers on
   their own keep-alive connection, speaking minimal HTTP/1.1 over raw streams (an httpx client
   costs several times the server's CPU per request; this one leaves the server most of the
   machine). Real SST-2 validation sentences. `--warmup` s unrecorded, then `--duration` s.
4. Server CPU per request and per input = the server process's CPU time (utime + stime, all
   threads, from /proc) over the window / completed requests (inputs). This is the number that
   carries to a bigger machine; requests/s on this 2-core shared box is capped by the generator too.
5. A further server (httptools + uvloop) is run under cProfile (event-loop thread and every other thread via
   threading.setprofile) for one 1-input and one 32-input level; top functions by own time.

6. `--workers`: the same levels on `tmod-serve --workers 1` and `--workers 2` (server/workers/), with
   the CPU of the engine process (the one that cannot be multiplied), of each worker and of the load
   generator per request, and requests per batch from /metrics.
   `--before DIR` (another checkout, e.g. `git worktree add /tmp/base <commit>`): its servers run
   beside this tree's, level by level in alternating order, so before and after share one run; both
   get this file's stand-in pass (only the server code differs).

7. `--engine-only`: the engine process's loop alone, in this process (`engine_only`): request frames of
   1-64 requests fed to EngineService, one batch each, CPU per request at a known batch size (the mean,
   and the median over chunks of 20 frames, which a burst of another job on a shared box moves less).

8. `--spread RESULT.json ...`: several recorded `--workers --before` runs -> each issue-37 figure's median,
   quartiles, range and how many runs met its target, as a markdown table (no server is started). On a
   shared box one run's figures move by ~40% within minutes, so one run decides little.

The servers run on --server-cpus and the load generator on --generator-cpus, CPUs apart (default:
half each; on 2 cores, one each), so the benchmark does not measure itself.

Outputs: bench/results/frontend-cpu.{json,md}; with --workers, bench/results/frontend-workers-cpu.{json,md};
with --engine-only, bench/results/frontend-engine-cpu.{json,md}.

    .venv/bin/python bench/bench_frontend.py             # ~3 min
    .venv/bin/python bench/bench_frontend.py --workers   # ~2 min
    .venv/bin/python bench/bench_frontend.py --workers --before /tmp/base   # ~4 min
    .venv/bin/python bench/bench_frontend.py --engine-only   # ~1 min
    .venv/bin/python bench/bench_frontend.py --quick     # smoke run
    .venv/bin/python bench/bench_frontend.py --spread bench/results/frontend-workers-cpu-issue37-session*-run*.json
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import datetime as dt
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

LEVELS = [(1, 64), (1, 256), (32, 64), (32, 256)]
# uvicorn's HTTP parser and event loop: before (pure Python, what `pip install uvicorn` gives) and after
# (httptools + uvloop, tmod's `fast` extra: what uvicorn picks by itself once they are installed)
STACKS = {"h11+asyncio": "h11,asyncio", "httptools+uvloop": "httptools,uvloop"}
TASKS = ["sentiment", "ner", "acceptability"]


# ---------------------------------------------------------------------------------------------
# the server side: stand-in device pass (+ optional profile)
# ---------------------------------------------------------------------------------------------
def install_standin(pass_s: float) -> None:
    """Replace the serving path's device pass (`ModelRunner._pass`) with a fixed sleep returning
    correctly shaped host logits (`standin_logits`)."""
    try:
        from server.runner.model_runner import ModelRunner
    except ImportError:  # a --before checkout from before server/runner/ became a package (2026-11-30)
        from server.runner import ModelRunner

    def standin_pass(self, item, rows, modules, timings):
        start = time.perf_counter()
        time.sleep(pass_s)
        out = standin_outputs(item, modules)
        timings.backbone += time.perf_counter() - start
        return out

    ModelRunner._pass = standin_pass


def standin_outputs(item, modules: dict) -> tuple[dict, dict]:
    """What `ModelRunner._pass` returns for a pass (`item`: a PreparedPass) of `modules`: host logits
    of each task's shape (`standin_logits`) and the batch they lie on; the pass's depth set to 0."""
    real = item.batch.real()
    host = {}
    for task, module in modules.items():
        labels = len(module.head.labels)
        shape = (real.size, real.input_ids.shape[1], labels) if module.head.task_type == "token_classification" \
            else (real.size, labels)
        host[task] = standin_logits(shape)
    item.deepest = 0
    return host, {task: real for task in modules}


_POOLS: dict = {}  # random logits drawn once per kind of shape, grown when a shape needs more


def standin_logits(shape: tuple[int, ...]):
    """Random logits of `shape`, copied out of a pool drawn once (from a random first row): the host
    side of a device pass costs a copy of its logits (the runner's to_host), not drawing them.
    Drawing them anew (torch.randn) cost ~300 us of CPU per 128-text batch of the three tasks,
    about 2.4 us per text, more than the engine's own per-text work (issue 37, docs/host-path-log.md)."""
    import numpy as np
    import torch

    kind = (len(shape), shape[-1])
    pool = _POOLS.get(kind)
    # drawn anew only when a shape does not fit, then twice as large: kept at twice the largest batch so
    # far, a server's pools were drawn 7 times over its four levels (17-25 ms each), one inside a level's
    # measured window (a probe, issue 37); drawn this way, twice in the same probe, both in a warm-up
    if pool is None or any(have < want for have, want in zip(pool.shape[:-1], shape[:-1])):
        sizes = [max(2 * want, 256) for want in shape[:-1]]
        pool = _POOLS[kind] = np.random.default_rng(len(_POOLS)).standard_normal((*sizes, shape[-1]), dtype=np.float32)
    first = random.randrange(pool.shape[0] - shape[0] + 1)
    # a numpy copy: torch's copy of a strided slice took ms with two threads on a loaded 2-core box
    return torch.from_numpy(pool[(slice(first, first + shape[0]), *(slice(0, n) for n in shape[1:-1]))].copy())


def serve(argv: list[str]) -> None:
    code = os.environ.get("BENCH_SERVER_CODE")
    if code:  # before anything of server/ is imported: that checkout is served (the HTTP workers get it from
        # PYTHONPATH, `start_server`: the forkserver that starts them does not see this sys.path)
        sys.path.insert(0, code)
    if int(os.environ.get("TMOD_WORKERS", "1")) > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # tmod-serve points prometheus_client at a folder before anything imports it (server/cli.py); the
        # stand-in imports the runner, and with it prometheus_client, first: so point it here, or the
        # engine process's metrics stay in its memory and /metrics (a worker's) shows no batches
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = made = tempfile.mkdtemp(prefix="tmod-metrics-")
        atexit.register(shutil.rmtree, made, True)
    install_standin(float(os.environ.get("BENCH_PASS_MS", "1")) / 1000)
    stack = os.environ.get("BENCH_UVICORN")  # "h11,asyncio": the pure-Python HTTP parser and event loop
    if stack and stack.startswith("h11"):  # httptools + uvloop is what tmod-serve runs (with its own limits)
        try:
            from server.api import http_limits
        except ImportError:  # a --before checkout from before server/api/ (2026-11-30)
            from server import http_limits

        made, (http, loop) = http_limits.uvicorn_config, stack.split(",")

        def with_stack(app, settings):
            config = made(app, settings)
            config.http, config.loop = http, loop  # uvicorn's stock h11 protocol: tmod's head limits are not in it
            return config

        http_limits.uvicorn_config = with_stack
    profile_path = os.environ.get("BENCH_PROFILE")
    if not profile_path:
        from server.cli import main as serve_main

        serve_main(argv)
        return
    import cProfile
    import threading

    # every thread gets its own profiler timed by its own CPU clock: waits (queues, locks, epoll,
    # the stand-in's sleep) cost nothing, so own times are where the CPU goes
    profiles = []

    def thread_profile(*args):  # the first event of each new thread starts that thread's profiler
        p = cProfile.Profile(time.thread_time)
        profiles.append(p)
        sys.setprofile(None)
        p.enable()

    threading.setprofile(thread_profile)
    main_profile = cProfile.Profile(time.thread_time)
    profiles.append(main_profile)
    # SIGUSR1 (sent when the measured window starts) forgets start-up and warm-up
    signal.signal(signal.SIGUSR1, lambda *_: [p.clear() for p in profiles])
    from server.cli import main as serve_main

    # uvicorn drains on SIGTERM, puts the previous handler back and raises the signal again: a
    # handler that does nothing lets this process reach the dump below instead of dying there
    signal.signal(signal.SIGTERM, lambda *_: None)
    main_profile.enable()
    try:
        serve_main(argv)
    finally:
        main_profile.disable()
        import pstats

        stats = pstats.Stats(main_profile)
        for p in profiles[1:]:
            try:
                p.disable()
            except Exception:  # noqa: BLE001 - a profiler of another thread: its data is still readable
                pass
            try:
                stats.add(p)
            except TypeError:  # an empty profile
                pass
        stats.dump_stats(profile_path)


# ---------------------------------------------------------------------------------------------
# the load generator: minimal HTTP/1.1 keep-alive clients in several processes
# ---------------------------------------------------------------------------------------------
async def _client_loop(port: int, path: str, bodies: list[bytes], workers: int, start_at: float, stop_at: float,
                       record_from: float, inputs: int, seed: int) -> dict:
    latencies: list[float] = []
    errors: dict[str, int] = {}
    ok_in_window = 0
    cpu = {}

    async def clock():  # this generator process's own CPU over the recorded window
        await asyncio.sleep(max(0.0, record_from - time.time()))
        cpu["start"] = time.process_time()
        await asyncio.sleep(max(0.0, stop_at - time.time()))
        cpu["stop"] = time.process_time()

    async def worker(index: int):
        nonlocal ok_in_window
        rng = random.Random(seed * 10_000 + index)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while time.time() < start_at:
            await asyncio.sleep(0.01)
        while time.time() < stop_at:
            body = bodies[rng.randrange(len(bodies))]
            t0 = time.time()
            try:
                writer.write(b"POST " + path + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                             b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                head = await reader.readuntil(b"\r\n\r\n")
                status = int(head[9:12])
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                payload = await reader.readexactly(length)
                outcome = "ok" if status == 200 else f"http_{status}"
                if status == 200 and len(json.loads(payload)["results"]) != inputs:
                    outcome = "bad_body"
            except (OSError, asyncio.IncompleteReadError, ValueError, KeyError) as exc:
                outcome = type(exc).__name__
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            t1 = time.time()
            if outcome == "ok" and record_from <= t1 <= stop_at:
                ok_in_window += 1  # throughput: completions in the window
            if t0 >= record_from:  # latency and errors: requests started in the window
                if outcome == "ok":
                    latencies.append((t1 - t0) * 1000)
                else:
                    errors[outcome] = errors.get(outcome, 0) + 1
        writer.close()

    await asyncio.gather(clock(), *(worker(i) for i in range(workers)))
    return {"latencies": latencies, "errors": errors, "ok_in_window": ok_in_window,
            "cpu_s": cpu.get("stop", 0.0) - cpu.get("start", 0.0)}


def _client_process(args, queue, cpus=None):
    from bench.harness import pin_to

    pin_to(cpus)  # off the server's cores: the benchmark does not measure itself
    queue.put(asyncio.run(_client_loop(*args)))


def measure(server, bodies: list[bytes], inputs: int, concurrency: int, clients: int, warmup: float,
            duration: float, signal_window: bool = False, generator_cpus: set[int] | None = None) -> dict:
    """One level against `server`, the load generator's processes on `generator_cpus` (None: any).
    CPU per request of the server (the process tmod-serve started: with --workers the engine; with
    --engines N its N engines, summed and each), of each worker process and of the generator, and
    requests per batch from /metrics."""
    # here, not at the top: this file is also the served process (`--serve`), which must import server/
    # from BENCH_SERVER_CODE's checkout
    from bench.harness import busiest_threads, metrics_delta, proc_cpu_seconds, summarise_latency, thread_cpu_seconds
    from bench.live_server import engine_pids, worker_pids

    now = time.time()
    start_at = now + 1.0  # every client connected before load starts
    record_from = start_at + warmup
    stop_at = record_from + duration
    path = ("/v1/infer?tasks=" + ",".join(TASKS)).encode()
    queue = mp.Queue()
    procs = []
    for i in range(clients):
        share = concurrency // clients + (1 if i < concurrency % clients else 0)
        p = mp.Process(target=_client_process,
                       args=((server.port, path, bodies, share, start_at, stop_at, record_from, inputs, i), queue,
                             generator_cpus))
        p.start()
        procs.append(p)
    time.sleep(max(0.0, record_from - time.time()))
    if signal_window:
        os.kill(server.proc.pid, signal.SIGUSR1)
    engines = engine_pids(server.proc.pid)  # tmod-serve's process, or with --engines N its N engines
    workers = [pid for engine in engines for pid in worker_pids(engine)]  # with --workers: the HTTP workers
    # with --engines N, the process that started them (it holds the port) counts with them
    counted = engines if engines == [server.proc.pid] else [*engines, server.proc.pid]
    metrics0 = server_metrics(server)
    cpu0, threads0, t0 = ([proc_cpu_seconds(pid) or 0.0 for pid in counted],
                          [thread_cpu_seconds(pid) for pid in engines], time.time())
    each0 = [proc_cpu_seconds(pid) or 0.0 for pid in workers]
    time.sleep(max(0.0, stop_at - time.time()))
    cpu1, threads1, t1 = ([proc_cpu_seconds(pid) or 0.0 for pid in counted],
                          [thread_cpu_seconds(pid) for pid in engines], time.time())
    each1 = [proc_cpu_seconds(pid) or 0.0 for pid in workers]
    metrics1 = server_metrics(server)
    parts = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join()
    latencies = [x for part in parts for x in part["latencies"]]
    errors: dict[str, int] = {}
    for part in parts:
        for k, v in part["errors"].items():
            errors[k] = errors.get(k, 0) + v
    ok = sum(part["ok_in_window"] for part in parts)
    window = t1 - t0
    per_batch = metrics_delta(metrics0, metrics1)["mean_batch_requests"]
    # the process tmod-serve started: everything, or with workers the engine (with --engines, the engines)
    each_engine = [b - a for a, b in zip(cpu0, cpu1)]
    engine_cpu = sum(each_engine)
    each = [b - a for a, b in zip(each0, each1)]
    workers_cpu = sum(each)
    generator_cpu = sum(part["cpu_s"] for part in parts)
    server_cpu = engine_cpu + workers_cpu
    main_thread = sum(after.get(pid, 0.0) - before.get(pid, 0.0) for pid, before, after in zip(engines, threads0, threads1))
    busiest = sorted(({**thread, "engine": i} if len(engines) > 1 else thread
                      for i, (pid, before, after) in enumerate(zip(engines, threads0, threads1))
                      for thread in busiest_threads(pid, before, after, window)), key=lambda t: -t["cores"])[:8]
    return {
        "inputs_per_request": inputs, "concurrency": concurrency, "window_s": round(window, 2),
        "requests": ok, "requests_per_s": round(ok / window, 1), "sequences_per_s": round(ok * inputs / window, 1),
        "latency_ms": summarise_latency(latencies), "errors": sum(errors.values()), "errors_by_kind": errors,
        "server_cores": round(server_cpu / window, 3),
        "server_event_loop_cores": round(main_thread / window, 3),
        "server_cpu_us_per_request": round(server_cpu / ok * 1e6, 1) if ok else None,
        "server_cpu_us_per_input": round(server_cpu / (ok * inputs) * 1e6, 1) if ok else None,
        "event_loop_cpu_us_per_request": round(main_thread / ok * 1e6, 1) if ok else None,
        "worker_processes": len(workers), "engine_processes": len(engines),
        "engine_process_cpu_us_per_request": round(engine_cpu / ok * 1e6, 1) if ok else None,  # all engines
        # with --engines N: each engine's part, and that of the process holding the port (it takes no request)
        **({"each_engine_cpu_us_per_request": [round(e / ok * 1e6, 1) for e in each_engine[:len(engines)]],
            "port_holder_cpu_us_per_request": round(each_engine[-1] / ok * 1e6, 1)} if ok and len(engines) > 1 else {}),
        "engine_process_cpu_us_per_input": round(engine_cpu / (ok * inputs) * 1e6, 1) if ok else None,
        "workers_cpu_us_per_request": round(workers_cpu / ok * 1e6, 1) if ok and workers else None,
        "each_worker_cpu_us_per_request": [round(w / ok * 1e6, 1) for w in each] if ok else None,
        "generator_cpu_us_per_request": round(generator_cpu / ok * 1e6, 1) if ok else None,
        "generator_cores": round(generator_cpu / window, 3),
        # requests per batch over the window (the server's tmod_batch_requests): the engine's per-batch
        # work is shared by this many requests, so its CPU per request falls as batches fill
        "requests_per_batch": round(per_batch, 1) if per_batch else None,
        # which of the server process's threads used its CPU (with workers: the engine's event loop, compute
        # thread, tokenizer threads, and any of torch's or the GPU driver's own; with --engines, every
        # engine's, each tagged with its engine's index)
        "server_busiest_threads": busiest,
    }


def server_metrics(server) -> dict[str, float]:
    """The server's /metrics (every process's, summed), flat as harness.parse_metrics reads them."""
    import urllib.request

    from bench.harness import parse_metrics

    return parse_metrics(urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30).read().decode())


# ---------------------------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------------------------
def start_server(workdir: Path, store: Path, name: str, args, extra_env: dict | None = None, code: Path = REPO):
    """A stand-in server of the checkout `code`, with this tree's stand-in pass (`serve`): every
    checkout compared gets the same device pass, so only its own code differs."""
    from bench.harness import ServerProcess

    env = {"TMOD_STORE": str(store), "TMOD_THREADS": "1", "TMOD_LOG_LEVEL": "warning", "TMOD_MAX_INPUTS": "64",
           "TMOD_MAX_QUEUE": "100000", "TMOD_MAX_WAIT_MS": str(args.max_wait_ms),
           "TMOD_MAX_BATCH_SIZE": str(args.max_batch_size),
           "BENCH_PASS_MS": str(args.pass_ms), "TMOD_BATCH_SHAPES": args.batch_shapes, "BENCH_SERVER_CODE": str(code),
           # the forkserver that starts a server's HTTP workers imports from its own path, not the engine's
           # sys.path: `code` first there too, and not the working directory (this tree), or a --before
           # server's workers would run this tree's files
           "PYTHONPATH": str(code), "PYTHONSAFEPATH": "1",
           **(extra_env or {})}
    server = ServerProcess(name, env, workdir / f"{name}.log", [sys.executable, str(Path(__file__).resolve()),
                                                                "--serve"], cpus=args.server_cpus)
    server.start()
    server.wait_ready(300)
    return server


# where a request's CPU goes: cumulative CPU of these functions (file, function) / all profiled CPU
AREAS = {
    "HTTP parse and write (uvicorn)": [("h11_impl.py", "handle_events"), ("h11_impl.py", "send"),
                                        ("httptools_impl.py", "data_received"), ("httptools_impl.py", "send")],
    "request body -> pydantic (FastAPI)": [("routing.py", "request_body_to_args"), ("routing.py", "_extract_form_body"),
                                            ("utils.py", "request_body_to_args")],
    "response model -> JSON (FastAPI)": [("routing.py", "serialize_response")],
    "tokenize (Backbone.encode)": [("tokens.py", "encode")],
    "collate": [("tokens.py", "collate")],
    "decode (decode_all)": [("answers.py", "decode_all")],
    "stand-in device pass (random logits)": [("bench_frontend.py", "standin_logits")],
    "metrics (prometheus_client)": [("metrics.py", "labels"), ("metrics.py", "inc"), ("metrics.py", "observe"),
                                    ("values.py", "inc")],
}


# blocking waits: near zero CPU in principle, yet cProfile charged `lock.acquire` more thread-CPU
# seconds than the whole process used in a run: left out of the totals and reported apart
WAITS = {"<method 'acquire' of '_thread.lock' objects>", "<method 'get' of '_queue.SimpleQueue' objects>",
         "<method 'poll' of 'select.epoll' objects>", "<built-in method time.sleep>"}


def load_profile(path: Path) -> tuple[dict, dict]:
    """(stats without the blocking waits, {wait: own seconds charged})"""
    import pstats

    stats = pstats.Stats(str(path)).stats
    waits = {k[2]: round(v[2], 3) for k, v in stats.items() if k[2] in WAITS}
    return {k: v for k, v in stats.items() if k[2] not in WAITS}, waits


def profile_areas(path: Path) -> dict:
    stats, waits = load_profile(path)
    total = sum(v[2] for v in stats.values()) or 1.0
    out = {"profiled_cpu_s": round(total, 3), "waits_left_out_s": waits}
    for area, keys in AREAS.items():
        seconds = sum(v[3] for (f, _, fn), v in stats.items() if (Path(f).name, fn) in keys)
        out[area] = round(min(seconds, total) / total, 3)
    return out


def profile_table(path: Path, top: int = 25) -> list[dict]:
    stats, _ = load_profile(path)
    total = sum(v[2] for v in stats.values()) or 1.0
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [{"function": f"{Path(f).name}:{line}({fn})", "calls": v[1], "own_s": round(v[2], 3),
             "own_share": round(v[2] / total, 3), "cumulative_s": round(v[3], 3)}
            for (f, line, fn), v in rows]


def level_cells(r: dict) -> str:
    """The table cells every level has: inputs, c, req/s, seq/s, p50, p99, errors."""
    lat = r["latency_ms"]
    return (f"{r['inputs_per_request']} | {r['concurrency']} | {r['requests_per_s']:,} | {r['sequences_per_s']:,} | "
            f"{lat['p50'] or 0:.1f} | {lat['p99'] or 0:.1f} | {r['errors']}")


def write_markdown(path: Path, result: dict) -> None:
    lines = [f"# Frontend ceiling (CPU, constant-time stand-in for the device pass: {result['pass_ms']} ms)", "",
             f"{result['date']} · {result['machine'].get('cpu_model', '')} · {result['machine'].get('logical_cpus', '')} "
             f"cores (shared) · `{result['command']}`", "",
             "| uvicorn stack | inputs/request | c | req/s | seq/s | p50 ms | p99 ms | errors | server cores | server CPU us/request "
             "| us/input | event-loop us/request |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["levels"]:
        lines.append(f"| {r['stack']} | {level_cells(r)} | {r['server_cores']} | {r['server_cpu_us_per_request']} | "
                     f"{r['server_cpu_us_per_input']} | {r['event_loop_cpu_us_per_request']} |")
    lines += ["", "Before / after in this run (httptools+uvloop over h11+asyncio, same level):", ""]
    for inputs, c in LEVELS:
        pair = {r["stack"]: r for r in result["levels"] if (r["inputs_per_request"], r["concurrency"]) == (inputs, c)}
        before, after = pair.get("h11+asyncio"), pair.get("httptools+uvloop")
        if before and after and before["server_cpu_us_per_request"] and after["server_cpu_us_per_request"]:
            lines.append(f"- {inputs} input(s), c={c}: server CPU per request x"
                         f"{after['server_cpu_us_per_request'] / before['server_cpu_us_per_request']:.2f}, "
                         f"req/s x{after['requests_per_s'] / before['requests_per_s']:.2f}")
    mu = result.get("metric_updates")
    if mu:
        lines += ["", f"Metric updates of one 3-task request, in process (process CPU, best of {mu['rounds']} "
                  f"interleaved rounds): labels looked up per request {mu['labels_per_request_us']} us, "
                  f"`Metrics.record_answer` (children kept) {mu['record_answer_us']} us (x{mu['ratio']})."]
    lines += ["", "Extrapolation (labelled, not measured): " + result["extrapolation"]["text"], ""]
    for name, prof in result.get("profiles", {}).items():
        lines += [f"## Profile: {name} (CPU time, all server threads, cProfile)", "",
                  f"Share of the {prof['areas']['profiled_cpu_s']} s profiled CPU ({prof['requests_profiled']} "
                  "requests) under each area (cumulative; areas can nest, the rest is ASGI/FastAPI plumbing, "
                  "asyncio and threads):", ""]
        lines += [f"- {area}: {share:.1%}" for area, share in prof["areas"].items() if area in AREAS]
        lines += ["", "Top functions by own CPU time:", "",
                  "| function | calls | own CPU s | share |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| `{row['function']}` | {row['calls']} | {row['own_s']} | {row['own_share']:.1%} |"
                  for row in prof["functions"][:20]]
        lines.append("")
    path.write_text("\n".join(lines))


def metric_updates(repeats: int = 20_000) -> dict:
    """A 3-task request's metric updates, in process: children looked up per request (as the app did
    before) vs `Metrics.record_answer` (children kept once made). us per request."""
    from server.metrics import Metrics

    phases = [(phase, 0.001) for phase in ("queue", "tokenize", "backbone", "heads", "total")]

    def looked_up(m):
        for phase, seconds in phases:
            m.duration.labels(phase).observe(seconds)
        m.requests.labels("success").inc()
        m.inputs.inc(1)
        for task in TASKS:
            m.task_requests.labels(task).inc()

    def kept(m):
        m.record_answer(phases, 1, TASKS)

    out = {"repeats": repeats, "rounds": 5}
    times = {"labels_per_request_us": [], "record_answer_us": []}
    for _ in range(5):  # interleaved rounds, best of each
        for name, fn in (("labels_per_request_us", looked_up), ("record_answer_us", kept)):
            m = Metrics()
            t0 = time.process_time()
            for _ in range(repeats):
                fn(m)
            times[name].append((time.process_time() - t0) / repeats * 1e6)
    out.update({k: round(min(v), 2) for k, v in times.items()})
    out["ratio"] = round(out["record_answer_us"] / out["labels_per_request_us"], 3)
    return out


def compare_workers(args, bodies: dict, workdir: Path, counts=(1, 2)) -> list[dict]:
    """The same levels on `tmod-serve --workers N` for each N (uvicorn picks httptools + uvloop), and
    with --before for the other checkout's code too. Each level also records how fast the servers'
    CPUs ran Python just before and after it (`box_loop_ms`)."""
    from bench.harness import loop_ms_on

    codes = {"after": REPO, "before": Path(args.before).resolve()} if args.before else {"after": REPO}
    keys = [(code, n) for code in codes for n in counts]
    runs = []
    servers = {}
    try:
        for code, n in keys:  # all up for the whole run; the idle ones cost nothing
            servers[code, n] = start_server(workdir, workdir / "store", f"{code}-workers{n}", args,
                                            {"TMOD_WORKERS": str(n)}, codes[code])
        speed = loop_ms_on(args.server_cpus)  # the box's speed (harness.loop_ms_on) before the first level
        for i, (inputs, c) in enumerate(LEVELS):
            for code, n in (keys if i % 2 == 0 else list(reversed(keys))):  # drift: alternate who goes first
                run = {"code": code, "workers": n, **measure(servers[code, n], bodies[inputs], inputs, c,
                                                               args.clients, args.warmup, args.duration,
                                                               generator_cpus=args.generator_cpus)}
                after = loop_ms_on(args.server_cpus)  # also the next level's "before": nothing runs between them
                run["box_loop_ms"], speed = [speed, after], after
                print(json.dumps(run), flush=True)
                runs.append(run)
    finally:
        for server in servers.values():
            server.stop()
    return runs


def python_and_idle(machine: dict) -> str:
    """'Python 3.11.7 (/path/python, pure-Python loop 40.0 ms) · idle vCPUs poll 0 ns before they halt · '
    for a result that recorded them (harness.interpreter, harness.cpu_idle); '' for parts it did not."""
    parts = []
    python, idle = machine.get("python"), machine.get("cpu_idle") or {}
    if python:
        parts.append(f"Python {python['version']} ({python['executable']}, pure-Python loop "
                     f"{python['interpreter_loop_ms']} ms)")
    if idle.get("guest_halt_poll_ns") is not None:
        parts.append(f"idle vCPUs poll {idle['guest_halt_poll_ns']:,} ns before they halt ({idle['driver']})")
    return "".join(f"{part} · " for part in parts)


def write_workers_markdown(path: Path, result: dict) -> None:
    m = result["machine"]
    from bench.harness import vector_flags

    lines = [f"# Frontend with worker processes (CPU, constant-time stand-in for the device pass: {result['pass_ms']} ms, "
             f"batch shapes {result.get('batch_shapes', 'length_runs')}, up to {result.get('max_batch_size', 128)} rows per batch)",
             "", f"{result['date']} · {m.get('cpu_model', '')} ({vector_flags(m)}) · {m.get('logical_cpus', '')} "
             f"logical CPUs, shared with other work (load average at start {m.get('load_average_at_start_1_5_15min')}) · "
             f"servers pinned to CPUs {result.get('server_cpus')}, load generator to {result.get('generator_cpus')} · "
             f"{python_and_idle(m)}`{result['command']}`",
             "", "`tmod-serve --workers N`: N HTTP processes (HTTP, JSON, tokenization, decode) and one engine process "
             "(batching, collation, the pass), all on the server's CPUs; the load generator runs on others, so what "
             "is measured is the server. CPU = utime + stime from /proc over the recorded window / answered requests; "
             "requests per batch from the server's /metrics (tmod_batch_requests) over the same window. Box: a fixed "
             "pure-Python loop's best time on the servers' CPUs just before and after the level (the machine's speed "
             "moves; higher is slower)."
             + (f" `before`: the code at {result['before']}; `after`: this tree ({m['versions']['tmod_git']['commit']})."
                if result.get("before") else ""), "",
             "| code | workers | inputs/request | c | req/s | seq/s | p50 ms | p99 ms | errors | CPU us/request (all) "
             "| engine process us/request | engine us/input | workers us/request | each worker us/request "
             "| generator us/request | requests/batch | box: Python loop ms before / after |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
             "| ---: |"]
    for r in result["levels"]:
        each = " / ".join(str(w) for w in r.get("each_worker_cpu_us_per_request") or []) or "-"
        lines.append(f"| {r.get('code', 'after')} | {r['workers']} | {level_cells(r)} | {r['server_cpu_us_per_request']} | "
                     f"{r['engine_process_cpu_us_per_request']} | {r['engine_process_cpu_us_per_input']} | "
                     f"{r['workers_cpu_us_per_request'] or '-'} | {each} | {r.get('generator_cpu_us_per_request', '-')} | "
                     f"{r.get('requests_per_batch') or '-'} | {' / '.join(map(str, r.get('box_loop_ms') or [])) or '-'} |")
    lines += ["", "Ceilings (labelled, not measured: CPU per request as measured here, every process on a core of "
              "its own):", ""] + [f"- {line}" for line in result["ceilings"]] + [""]
    path.write_text("\n".join(lines))


def workers_ceilings(levels: list[dict]) -> list[str]:
    out = []
    for code in sorted({r.get("code", "after") for r in levels}):
        for inputs, c in LEVELS:
            pair = {r["workers"]: r for r in levels
                    if (r["inputs_per_request"], r["concurrency"]) == (inputs, c) and r.get("code", "after") == code}
            one, split = pair.get(1), pair.get(2)
            if not (one and split and one["requests"] and split["requests"]):
                continue
            engine = split["engine_process_cpu_us_per_request"]
            worker = split["workers_cpu_us_per_request"]
            out.append(f"{code}, {inputs} input(s), c={c}: one process ~{1e6 / one['server_cpu_us_per_request'] * inputs:,.0f} "
                       f"seq/s; with workers the engine process caps at ~{1e6 / engine * inputs:,.0f} seq/s "
                       f"(~{1e6 / engine:,.0f} req/s), reached with ~{worker / engine:.1f} worker cores per engine core")
    return out


ENGINE_LEVELS = [(1, 1), (8, 1), (32, 1), (64, 1), (1, 32), (4, 32)]  # (requests per frame, inputs per request)


def engine_only(args, store: Path) -> list[dict]:
    """The engine process's own work, without HTTP workers or a load generator to share its core:
    for each level and code (this tree, and `--before`'s checkout, alternating which goes first), a
    process of that code's Runtime with the stand-in pass and its EngineService, fed the request
    frames one of its workers would send (`engine_driver`)."""
    import subprocess

    codes = {"after": REPO, **({"before": Path(args.before).resolve()} if args.before else {})}
    rows = []
    for i, level in enumerate(ENGINE_LEVELS):
        for code in (list(codes) if i % 2 == 0 else list(reversed(codes))):
            config = {"code": str(codes[code]), "store": str(store), "pass_ms": args.pass_ms, "frames": args.frames,
                      "batch_shapes": args.batch_shapes, "max_wait_ms": args.max_wait_ms,
                      "max_batch_size": args.max_batch_size, "level": level}
            done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--engine-driver", json.dumps(config)],
                                  capture_output=True, text=True, cwd=REPO)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode or not lines:
                raise SystemExit(f"engine driver ({code}, {level}) failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
            row = {"code": code, **json.loads(lines[-1])}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


CHUNK = 20  # frames per chunk of the engine loop's CPU (engine_driver)


def engine_driver(config: dict) -> None:
    """One level of `engine_only`, in a process of its own, on the code at config["code"]: a Runtime
    (stand-in pass) and EngineService fed frames of N requests as a worker's connection would (this
    tree's binary frames, or the pickled messages of a checkout from before them), one frame at a
    time, each answered (its answer frame written) before the next. CPU = this process's utime +
    stime (every thread) over the frames / requests. Each frame is one batch."""
    import pickle

    from bench.harness import engine_side_of_workers, read_sst2_sentences  # this tree's: bench/ is a namespace
    sys.path.insert(0, config["code"])  # package. Before anything of server/ is imported: that code is measured
    from server.config import Settings
    from server.runtime import Runtime

    install_standin(config["pass_ms"] / 1000)
    requests, inputs = config["level"]
    engine_side = engine_side_of_workers()
    binary = hasattr(engine_side, "RequestFrame")

    class Connection:  # what the engine writes to
        answered: asyncio.Event

        def write(self, data):
            self.answered.set()

        def writelines(self, parts):  # (this tree's engine writes a frame's parts as they are)
            self.answered.set()

        def is_closing(self):
            return False

        def close(self):
            pass

    async def run() -> dict:
        settings = Settings(store=config["store"], workers=2, threads=1, batch_shapes=config["batch_shapes"],
                            max_wait_ms=config["max_wait_ms"], max_batch_size=config["max_batch_size"],
                            max_queue=100000, max_inputs=64, tasks=",".join(TASKS))
        runtime = Runtime(settings)
        service = engine_side.EngineService(runtime)
        await runtime.open()
        while not runtime.ready.is_set():
            await asyncio.sleep(0.05)
        sentences = read_sst2_sentences()
        texts = sentences * (1 + requests * inputs // len(sentences))
        encoded = [runtime.encode(texts[i * inputs:(i + 1) * inputs], None, False, None) for i in range(requests)]
        connection = Connection()
        if binary:
            frame = b"".join(engine_side.request_frame([(i, rows, ",".join(TASKS), 60.0)
                                                        for i, rows in enumerate(encoded)], []))
            peer = engine_side.Peer(connection, runtime)

            def feed():
                service._requests(peer, engine_side.RequestFrame.read(frame))
        else:  # before: pickled ("infer", id, PackedRows, tasks, seconds left) messages, answered per request
            from server.backbone.tokens import PackedRows

            frame = pickle.dumps([("infer", i, PackedRows.of(rows), list(TASKS), 60.0) for i, rows in enumerate(encoded)],
                                 protocol=pickle.HIGHEST_PROTOCOL)
            peer = engine_side.Outbox(connection)

            def feed():
                for message in pickle.loads(frame):
                    service._infer(peer, *message[1:])

        async def one():
            connection.answered = asyncio.Event()
            feed()
            await connection.answered.wait()

        for _ in range(20):  # warm
            await one()
        count = runtime.metrics.registry.get_sample_value
        batches0 = count("tmod_batch_requests_count") or 0.0
        cpu0, t0 = time.process_time(), time.perf_counter()
        chunks = []  # CPU of each CHUNK frames: their median is less moved by a neighbour's burst than the mean
        for done in range(config["frames"]):
            if done % CHUNK == 0:
                chunks.append(time.process_time())
            await one()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
        chunks = [b - a for a, b in zip(chunks, chunks[1:] + [cpu0 + cpu])][:config["frames"] // CHUNK]
        batches = (count("tmod_batch_requests_count") or 0.0) - batches0
        await runtime.shutdown()
        frames = config["frames"]
        return {"requests_per_frame": requests, "inputs_per_request": inputs, "frames": frames, "batches": int(batches),
                "requests_per_batch": round(requests * frames / batches, 1),
                "engine_cpu_us_per_request": round(cpu / (requests * frames) * 1e6, 1),
                "engine_cpu_us_per_input": round(cpu / (requests * inputs * frames) * 1e6, 1),
                "engine_cpu_us_per_input_chunk_median":
                    round(statistics.median(chunks) / (requests * inputs * CHUNK) * 1e6, 1) if chunks else None,
                "engine_cpu_ms_per_batch": round(cpu / batches * 1e3, 3),
                "wall_ms_per_frame": round(wall / frames * 1e3, 2)}

    # the engine process's own loop (uvloop since issue 37's engine loop work); a checkout from before ran asyncio's
    print(json.dumps(getattr(engine_side, "run_engine_loop", asyncio.run)(run())), flush=True)


def write_engine_markdown(path: Path, result: dict) -> None:
    m = result["machine"]
    from bench.harness import vector_flags

    lines = [f"# The engine process's loop alone (stand-in pass {result['pass_ms']} ms, batch shapes "
             f"{result['batch_shapes']}, up to {result.get('max_batch_size', 128)} rows per batch)", "",
             f"{result['date']} · {m.get('cpu_model', '')} ({vector_flags(m)}) · {m.get('logical_cpus')} logical CPUs, "
             f"shared with other work (load average at start {m.get('load_average_at_start_1_5_15min')}) · "
             f"`{result['command']}`", "",
             "A Runtime and EngineService in one process, fed a worker's request frames (one frame = one batch, "
             "answered before the next): what the engine process spends per request with no HTTP worker or load "
             "generator beside it. CPU = process utime + stime (all threads) / requests."
             + (f" `before`: the code at {result['before']}; "
                f"`after`: this tree ({m['versions']['tmod_git']['commit']})." if result.get("before") else ""), "",
             "| code | requests/frame | inputs/request | requests/batch | engine us/request | engine us/input | "
             f"us/input, median of {CHUNK}-frame chunks | engine ms/batch | wall ms/frame |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["levels"]:
        lines.append(f"| {r['code']} | {r['requests_per_frame']} | {r['inputs_per_request']} | {r['requests_per_batch']} | "
                     f"{r['engine_cpu_us_per_request']} | {r['engine_cpu_us_per_input']} | "
                     f"{r.get('engine_cpu_us_per_input_chunk_median', '-')} | "
                     f"{r['engine_cpu_ms_per_batch']} | {r['wall_ms_per_frame']} |")
    path.write_text("\n".join(lines) + "\n")


def _times_lower(workers: int, c: int, figure: str):
    """One-text requests: the before tree's CPU per request over this tree's."""
    return lambda levels: levels[("before", workers, 1, c)][figure] / levels[("after", workers, 1, c)][figure]


def _after(workers: int, inputs: int, c: int, figure: str):
    return lambda levels: levels[("after", workers, inputs, c)][figure]


# issue 37's CPU targets as a `--workers --before` run records them: (what, the figure, the target, met when)
SPREAD = [
    ("one process, one-text, c=64: times lower than before", _times_lower(1, 64, "server_cpu_us_per_request"),
     ">= 3x", lambda v, levels: v >= 3),
    ("one process, one-text, c=256: times lower than before", _times_lower(1, 256, "server_cpu_us_per_request"),
     ">= 3x", lambda v, levels: v >= 3),
    ("workers, one-text, c=64 (µs per request)", _after(2, 1, 64, "workers_cpu_us_per_request"),
     "<= 300", lambda v, levels: v <= 300),
    ("workers, one-text, c=64: times lower than before's workers", _times_lower(2, 64, "workers_cpu_us_per_request"),
     "", None),
    ("workers, one-text, c=256 (µs per request)", _after(2, 1, 256, "workers_cpu_us_per_request"),
     "<= 300", lambda v, levels: v <= 300),
    ("engine, one-text, c=256 (µs per request; met at >= 30 requests per batch)",
     _after(2, 1, 256, "engine_process_cpu_us_per_request"), "<= 40 at >= 30/batch",
     lambda v, levels: v <= 40 and levels[("after", 2, 1, 256)]["requests_per_batch"] >= 30),
    ("engine, one-text, c=256: requests per batch", _after(2, 1, 256, "requests_per_batch"), "", None),
    ("engine, 32-text, c=64 (µs per text)", _after(2, 32, 64, "engine_process_cpu_us_per_input"),
     "<= 10", lambda v, levels: v <= 10),
    ("engine, 32-text, c=256 (µs per text)", _after(2, 32, 256, "engine_process_cpu_us_per_input"),
     "<= 10", lambda v, levels: v <= 10),
]


def spread(paths: list[Path]) -> str:
    """Recorded `--workers --before` runs -> a markdown table: each figure's median, quartiles, range and
    how many of the runs met its target. A run without a figure's level is a ValueError naming both."""
    values: list[list[float]] = [[] for _ in SPREAD]
    met = [0] * len(SPREAD)
    for path in paths:
        try:
            recorded = json.loads(Path(path).read_text()).get("levels")
            levels = {(level.get("code", "after"), level["workers"], level["inputs_per_request"], level["concurrency"]):
                      level for level in recorded}
        except (json.JSONDecodeError, AttributeError, TypeError, KeyError) as exc:
            raise ValueError(f"{path}: not a bench_frontend result ({type(exc).__name__}: {exc}); --spread reads "
                             "`--workers --before` results") from None
        for i, (what, figure, _, is_met) in enumerate(SPREAD):
            try:
                value = figure(levels)
                met[i] += bool(is_met and is_met(value, levels))
            except KeyError as missing:
                key = missing.args[0]
                if isinstance(key, tuple):
                    code, workers, inputs, c = key
                    raise ValueError(f"{path}: no level ({code}, --workers {workers}, {inputs} input(s), c={c}); "
                                     "--spread reads `--workers --before` results") from None
                raise ValueError(f"{path}: a level without {key!r} ({what})") from None
            values[i].append(value)
    lines = [f"{len(paths)} run(s): " + ", ".join(Path(p).stem for p in paths), "",
             "| what | median | quartiles | range | target | met |", "| --- | ---: | --- | --- | --- | --- |"]
    for (what, _, target, is_met), v, count in zip(SPREAD, values, met):
        v = sorted(v)
        quartiles = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0], v[0], v[0]]
        lines.append(f"| {what} | {statistics.median(v):.4g} | {quartiles[0]:.4g}-{quartiles[2]:.4g} | "
                     f"{v[0]:.4g}-{v[-1]:.4g} | {target} | {f'{count} of {len(v)}' if is_met else ''} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pass-ms", type=float, default=1.0, help="stand-in device pass time")
    p.add_argument("--batch-shapes", choices=["buckets", "length_runs"], default="buckets",
                   help="how the server cuts a batch into passes (TMOD_BATCH_SHAPES): buckets, one pass per batch as "
                        "on a GPU, whose pass the stand-in stands for; length_runs, a CPU's several passes per batch")
    p.add_argument("--max-wait-ms", type=float, default=2.0, help="the servers' TMOD_MAX_WAIT_MS (ms)")
    p.add_argument("--max-batch-size", type=int, default=512,
                   help="rows per batch (TMOD_MAX_BATCH_SIZE): default 512, a GPU host's default (server/config.py), "
                        "whose pass the stand-in stands for")
    p.add_argument("--clients", type=int, default=4, help="load-generator processes")
    p.add_argument("--warmup", type=float, default=2.0, help="unrecorded seconds per level")
    p.add_argument("--duration", type=float, default=6.0, help="recorded seconds per level")
    p.add_argument("--no-profile", action="store_true",
                   help="leave out step 5, the server run under cProfile (one 1-input and one 32-input level)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 s warm-up, 2 s windows")
    p.add_argument("--workers", action="store_true",
                   help="compare tmod-serve --workers 1 and 2 instead (bench/results/frontend-workers-cpu.{json,md})")
    p.add_argument("--worker-counts", type=lambda text: [int(n) for n in text.split(",")], default=[1, 2],
                   help="with --workers: the --workers N values compared, e.g. 2 for the engine process alone "
                        "(default 1,2)")
    p.add_argument("--before", type=Path, default=None,
                   help="with --workers: another checkout whose servers run beside this tree's (before / after)")
    p.add_argument("--engine-only", action="store_true",
                   help="the engine process's loop alone, in this process: request frames of N requests fed to "
                        "EngineService as a worker's connection would, one frame per batch "
                        "(bench/results/frontend-engine-cpu.{json,md})")
    p.add_argument("--frames", type=int, default=300, help="--engine-only: frames (batches) per level")
    p.add_argument("--spread", type=Path, nargs="+", default=None, metavar="RESULT",
                   help="recorded --workers --before results (JSON): print each issue-37 figure's median, quartiles, "
                        "range and how many runs met its target; no server is started")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "frontend-cpu.json",
                   help="JSON results, a .md beside it (default bench/results/frontend-cpu.json; with --workers or "
                        "--engine-only that name becomes frontend-workers-cpu.json or frontend-engine-cpu.json)")
    p.add_argument("--server-cpus", type=cpu_list, default=None,
                   help="CPUs the servers run on, e.g. 0 or 0-7 (default: the first half of the usable CPUs)")
    p.add_argument("--generator-cpus", type=cpu_list, default=None,
                   help="CPUs the load generator runs on (default: the rest): apart from the server's, so the "
                        "benchmark does not measure itself")
    args = p.parse_args(argv)
    add_cpu_split(args)
    return args


def cpu_list(text: str) -> set[int]:
    """'0', '0,2', '0-7' -> a set of CPU numbers."""
    out = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


def add_cpu_split(args) -> None:
    """Fill --server-cpus / --generator-cpus left out (bench/harness.py `split_cpus`)."""
    from bench.harness import split_cpus

    server, generator = split_cpus()
    args.server_cpus = args.server_cpus or server
    args.generator_cpus = args.generator_cpus or (generator - args.server_cpus or generator)


def main(argv=None) -> int:
    from bench.harness import build_store
    from bench.harness import machine_info, read_sst2_sentences

    args = parse_args(argv)
    if args.spread:
        try:
            print(spread(args.spread), end="")
        except (OSError, ValueError) as exc:
            print(f"bench_frontend --spread: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.quick:
        args.warmup, args.duration = 1.0, 2.0
    sentences = read_sst2_sentences()
    random.Random(0).shuffle(sentences)
    result = {"benchmark": "bench_frontend", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "command": "python bench/bench_frontend.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": machine_info("cpu"), "pass_ms": args.pass_ms, "batch_shapes": args.batch_shapes,
              "max_wait_ms": args.max_wait_ms, "max_batch_size": args.max_batch_size,
              "clients": args.clients, "warmup_s": args.warmup, "duration_s": args.duration, "tasks": TASKS,
              "server_cpus": sorted(args.server_cpus), "generator_cpus": sorted(args.generator_cpus),
              "levels": [], "profiles": {}}
    with tempfile.TemporaryDirectory(prefix="bench_frontend_") as tmp:
        workdir = Path(tmp)
        result["store"] = build_store(workdir / "store", None, 0)
        bodies = {n: [json.dumps({"inputs": sentences[i * n:(i + 1) * n]}).encode() for i in range(len(sentences) // n)]
                  for n in {n for n, _ in LEVELS}}
        if args.engine_only:
            if args.before:
                import subprocess

                commit = subprocess.run(["git", "-C", str(args.before), "rev-parse", "HEAD"], capture_output=True, text=True)
                result["before"] = commit.stdout.strip() or str(args.before)
            result["levels"] = engine_only(args, workdir / "store")
            out = args.out.with_name("frontend-engine-cpu.json") if args.out.name == "frontend-cpu.json" else args.out
            out.write_text(json.dumps(result, indent=2) + "\n")
            write_engine_markdown(out.with_suffix(".md"), result)
            print("wrote", out, out.with_suffix(".md"))
            return 0
        if args.workers:
            if args.before:
                import subprocess

                commit = subprocess.run(["git", "-C", str(args.before), "rev-parse", "HEAD"], capture_output=True, text=True)
                result["before"] = commit.stdout.strip() or str(args.before)
            result["levels"] = compare_workers(args, bodies, workdir, counts=args.worker_counts)
            result["ceilings"] = workers_ceilings(result["levels"])
            out = args.out.with_name("frontend-workers-cpu.json") if args.out.name == "frontend-cpu.json" else args.out
            out.write_text(json.dumps(result, indent=2) + "\n")
            write_workers_markdown(out.with_suffix(".md"), result)
            print("\n".join(result["ceilings"]))
            print("wrote", out, out.with_suffix(".md"))
            return 0
        servers = {}
        try:
            for name, stack in STACKS.items():  # both up for the whole run; the idle one costs nothing
                servers[name] = start_server(workdir, workdir / "store", name.replace("+", "_"), args,
                                             {"BENCH_UVICORN": stack})
            for i, (inputs, c) in enumerate(LEVELS):
                order = list(STACKS) if i % 2 == 0 else list(reversed(STACKS))  # drift: alternate who goes first
                for name in order:
                    run = {"stack": name, **measure(servers[name], bodies[inputs], inputs, c, args.clients,
                                                    args.warmup, args.duration, generator_cpus=args.generator_cpus)}
                    print(json.dumps(run), flush=True)
                    result["levels"].append(run)
        finally:
            for server in servers.values():
                server.stop()
        if not args.no_profile:
            for inputs in (1, 32):
                prof = workdir / f"profile-{inputs}.pstats"
                server = start_server(workdir, workdir / "store", f"profile{inputs}", args,
                                      {"BENCH_PROFILE": str(prof), "BENCH_UVICORN": STACKS["httptools+uvloop"]})
                try:
                    profiled = measure(server, bodies[inputs], inputs, 64, args.clients, args.warmup, args.duration, True,
                                       generator_cpus=args.generator_cpus)
                finally:
                    server.stop()
                if prof.exists():
                    result["profiles"][f"{inputs}-input requests, c=64"] = {
                        "requests_profiled": profiled["requests"], "areas": profile_areas(prof),
                        "functions": profile_table(prof)}
    after = [r for r in result["levels"] if r["stack"] == "httptools+uvloop"]
    result["metric_updates"] = metric_updates()
    print("metric updates per request:", result["metric_updates"], flush=True)
    one = next(r for r in after if r["inputs_per_request"] == 1 and r["server_cpu_us_per_request"])
    many = next(r for r in after if r["inputs_per_request"] == 32 and r["server_cpu_us_per_input"])
    cores = 16
    req_ceiling = cores * 1e6 / one["server_cpu_us_per_request"]
    seq_ceiling = cores * 1e6 / many["server_cpu_us_per_input"]
    result["extrapolation"] = {
        "cores": cores, "requests_per_s_1_input": round(req_ceiling), "sequences_per_s_32_input": round(seq_ceiling),
        "text": f"if the frontend's CPU cost per request stayed as measured here (1-input: "
                f"{one['server_cpu_us_per_request']} us/request at c={one['concurrency']}; 32-input: "
                f"{many['server_cpu_us_per_input']} us/input at c={many['concurrency']}) and scaled perfectly over "
                f"{cores} cores (several frontend processes; today's server is one process with one event loop, "
                f"so it does not), the frontend would cap at ~{req_ceiling:,.0f} req/s (target 8,000) and "
                f"~{seq_ceiling:,.0f} seq/s (target 30,000). One process is bounded by its event loop: "
                f"1e6 / event-loop us/request = ~{1e6 / one['event_loop_cpu_us_per_request']:,.0f} req/s."}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(args.out.with_suffix(".md"), result)
    print(result["extrapolation"]["text"])
    print("wrote", args.out, args.out.with_suffix(".md"))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2:])
    elif sys.argv[1:2] == ["--engine-driver"]:
        engine_driver(json.loads(sys.argv[2]))
    else:
        sys.exit(main())
