"""The engine process under a GPU server's load, on a CPU: how often one batch follows another, and
its CPU per request, with the device a stand-in queue.

A real `Runtime` and `EngineService` in one process, set up as on a GPU (batch shapes "buckets", two
batches in flight, each collated on a tokenizer thread), its device pass a stand-in: passes run one
after the other in the order they were queued, `--pass-ms` each, as on a CUDA stream, and queueing
one lets go of the GIL `--releases` times, as the torch calls of a copy-in and replay do. A driver
process plays `--conns` HTTP workers over the engine's Unix socket: it keeps `--concurrency` one-text
requests in the engine (SST-2 sentences; the three shipped tasks) and sends each answered request
back after a think time drawn around `--think-ms` (what a worker and its client take), in frames of
the requests due in the same `--tick-ms`, as a worker writes one frame per event-loop iteration.
Engine on CPU 0, driver on the others.

Why: on an H200 one batch followed another every 6.9 ms against a pass of 3.9 (docs/gpu.md), and a GPU
is lent to few sessions. This puts the same question to the engine's code on any machine: a code
whose compute thread launches each pass only after answering the one before shows the gap; the
batch-to-batch time against `--pass-ms` says how much of it is left.

    python bench/bench_engine_load.py --before /tmp/before --runs 3 --out bench/results/engine-load-cpu.json

`--before`: a checkout of other code run alternately with this tree (same stand-in, same driver);
`--sequential`: this tree with the launch from the preparing thread left out; `--bucket-runs`: this
tree with batch shapes "bucket_runs", whose pass times (the graphs' measured times on a GPU) are then
`--pass-model`'s, as are the stand-in passes of every code: FLOOR,PER_TOKEN ms, a pass at bucket
B x T taking FLOOR + PER_TOKEN x B x T (a model, not a measurement: what the engine's own CPU does
with the passes a GPU's times would ask for is what is measured).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # bench.harness (the engine puts the measured code before it)
from bench.bench_frontend import standin_outputs  # noqa: E402  (this tree's stand-in; it imports nothing of server/)

TASKS = "sentiment,ner,acceptability"


def engine(config: dict) -> None:
    """The engine process (on the code at config["code"]): serve, then report the window between the
    driver's two SIGUSR1s."""
    from bench.harness import engine_side_of_workers  # this tree's (bench/ is a namespace package: after the
    sys.path.insert(0, config["code"])              # insert, bench.harness would be the measured checkout's)
    from server.config import Settings
    from server.runner.model_runner import ModelRunner
    from server.runtime import Runtime, one_host_thread

    workers = engine_side_of_workers()
    one_host_thread()  # as on cuda (server/runtime.py)
    releases, clock, device, model = config["releases"], threading.Lock(), {"end": 0.0, "busy": 0.0}, config["pass_model"]

    def pass_seconds(bucket) -> float:
        """A pass's time on the stand-in device: --pass-ms, or --pass-model's at its bucket."""
        if model is None:
            return config["pass_ms"] / 1000
        return (model[0] + model[1] * bucket.size * bucket.seq_len) / 1000

    def queue_pass(seconds: float) -> float:
        """A pass queued on the stand-in device -> when it ends there."""
        for _ in range(releases):
            time.sleep(0)  # lets go of the GIL and takes it back, as a torch call does
        with clock:
            device["end"] = max(time.perf_counter(), device["end"]) + seconds
            device["busy"] += seconds
            return device["end"]

    def launch(self, prepared, modules):  # called by code that launches from the preparing thread
        if config["launch_ahead"]:
            for item in prepared.passes:
                item.launched = queue_pass(pass_seconds(item.bucket))
        return prepared

    def device_pass(self, item, rows, modules, timings):  # the compute thread's: wait for the pass, then logits
        launched = getattr(item, "launched", None)
        item.launched = None
        end = launched if launched is not None else queue_pass(pass_seconds(item.bucket))
        time.sleep(max(0.0, end - time.perf_counter()))
        timings.backbone += pass_seconds(item.bucket)
        return standin_outputs(item, modules)

    ModelRunner.launch, ModelRunner._pass = launch, device_pass
    if config["batch_shapes"] == "bucket_runs":  # the graphs' measured times, on a GPU
        ModelRunner._pass_costs = lambda self, modules: pass_seconds

    async def main():
        settings = Settings(store=str(REPO / "modules_store"), workers=config["conns"], tasks=TASKS, max_queue=100000,
                            batch_shapes=config["batch_shapes"], max_wait_ms=config["max_wait_ms"])
        runtime = Runtime(settings)
        runtime.batcher.settings.in_flight = 2  # as on cuda
        runtime.batcher.prepare = runtime.prepare_batch
        service = workers.EngineService(runtime)
        await service.start(config["path"])
        while not runtime.ready.is_set():
            await asyncio.sleep(0.05)
        count = runtime.metrics.registry.get_sample_value
        marks, done = [], asyncio.Event()

        def mark():
            marks.append((time.perf_counter(), time.process_time(), count("tmod_batch_requests_count") or 0.0,
                          count("tmod_batch_requests_sum") or 0.0, count("tmod_batch_tokens_count") or 0.0,
                          count("tmod_batch_tokens_sum") or 0.0, device["busy"]))
            if len(marks) == 2:
                done.set()

        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, mark)
        print("READY", flush=True)
        await done.wait()
        (t0, c0, b0, r0, p0, k0, d0), (t1, c1, b1, r1, p1, k1, d1) = marks
        wall, batches, requests, passes = t1 - t0, b1 - b0, r1 - r0, p1 - p0
        print(json.dumps({"requests_per_s": round(requests / wall), "requests_per_batch": round(requests / batches, 1),
                          "batch_to_batch_ms": round(wall / batches * 1e3, 2), "engine_cores": round((c1 - c0) / wall, 3),
                          "engine_cpu_us_per_request": round((c1 - c0) / requests * 1e6, 1),
                          "passes_per_batch": round(passes / batches, 2),
                          "padded_tokens_per_batch": round((k1 - k0) / batches),
                          "device_busy": round((d1 - d0) / wall, 3)}), flush=True)
        os._exit(0)

    getattr(workers, "run_engine_loop", asyncio.run)(main())


def driver(config: dict, engine_pid: int) -> None:
    """The workers' side: `conns` connections keeping `concurrency` requests in the engine."""
    import io
    import pickle

    import numpy as np

    from bench.harness import engine_side_of_workers, read_sst2_sentences

    workers = engine_side_of_workers()

    class StateReader(pickle.Unpickler):
        """A --before engine's messages: its state's classes were in server/workers.py before that became
        the package server/workers/ (frames.py holds them)."""

        def find_class(self, module, name):
            return super().find_class("server.workers.frames" if module == "server.workers" else module, name)

    per_connection = config["concurrency"] // config["conns"]
    answered = [0]
    latencies: list[float] = []  # seconds from a request's frame written to its answer's frame read
    recording = [False]

    async def connection(k: int):
        reader, writer = await asyncio.open_unix_connection(config["path"])
        text = None
        while text is None:  # the engine's state, with its tokenizer, comes first
            body = await workers.read_frame(reader)
            for message in StateReader(io.BytesIO(memoryview(body)[1:])).load():
                if message[0] == "state" and message[1].text is not None:
                    text = message[1].text
        sentences = read_sst2_sentences()
        sentences = sentences[k * 100:] + sentences[:k * 100]
        rows = itertools.cycle([text.encode([s], None, True, None) for s in sentences])
        ids, draw, loop, tick = itertools.count(1), random.Random(k), asyncio.get_running_loop(), config["tick_ms"]
        sent: dict[int, float] = {}  # request id -> when its frame was written

        def send(n: int) -> None:
            now, requests = time.perf_counter(), []
            for _ in range(n):
                ident = next(ids) & 0x7FFFFFFF
                sent[ident] = now
                requests.append((ident, next(rows), TASKS, 60.0))
            workers.write_frame(writer, workers.request_frame(requests, []))

        def later(n: int) -> None:  # each request back after its think time, those due in one tick in one frame
            due: dict[int, int] = {}
            for _ in range(n):
                t = round(config["think_ms"] * (0.5 + draw.random()) / tick)
                due[t] = due.get(t, 0) + 1
            for t, m in due.items():
                loop.call_later(t * tick / 1000, send, m)

        send(per_connection)
        while True:
            body = await workers.read_frame(reader)
            if body[:1] == workers.ANSWERS:
                n = workers.ANSWER_HEAD.unpack_from(body)[1]
                now = time.perf_counter()
                # the ids follow the header and each request's three timings (server/workers/frames.py, answer_frame)
                done = np.frombuffer(body, dtype=np.int32, count=n, offset=workers.ANSWER_HEAD.size + 24 * n).tolist()
                took = [now - sent.pop(ident) for ident in done]
                if recording[0]:
                    latencies.extend(took)
                answered[0] += n
                later(n)

    async def main():
        for k in range(config["conns"]):
            asyncio.get_running_loop().create_task(connection(k))
            await asyncio.sleep(0.3)  # one at a time: each reads a large first frame (the tokenizer)
        await asyncio.sleep(config["warmup"])
        a0, c0 = answered[0], time.process_time()
        recording[0] = True
        os.kill(engine_pid, signal.SIGUSR1)
        await asyncio.sleep(config["duration"])
        os.kill(engine_pid, signal.SIGUSR1)
        recording[0] = False
        p50, p99 = np.percentile(latencies, [50, 99]) * 1e3 if latencies else (None, None)
        print(json.dumps({"driver_answered_per_s": round((answered[0] - a0) / config["duration"]),
                          "driver_cores": round((time.process_time() - c0) / config["duration"], 3),
                          "engine_round_trip_ms": {"p50": round(float(p50), 2), "p99": round(float(p99), 2)}}),
              flush=True)
        os._exit(0)

    import uvloop

    uvloop.run(main())


def run_one(config: dict) -> dict:
    cpus = sorted(os.sched_getaffinity(0))
    engine_cpus, driver_cpus = {cpus[0]}, set(cpus[1:]) or {cpus[0]}
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    me = str(Path(__file__).resolve())
    started = subprocess.Popen([sys.executable, me, "--engine", json.dumps(config)], stdout=subprocess.PIPE, text=True,
                               env=env, cwd=REPO, preexec_fn=lambda: os.sched_setaffinity(0, engine_cpus))
    for line in started.stdout:
        if line.startswith("READY"):
            break
    else:
        raise SystemExit(f"the engine ({config['code']}) did not start")
    drove = subprocess.run([sys.executable, me, "--driver", json.dumps(config), str(started.pid)], capture_output=True,
                           text=True, env=env, cwd=REPO, preexec_fn=lambda: os.sched_setaffinity(0, driver_cpus))
    lines = started.stdout.read().splitlines() + drove.stdout.splitlines()
    started.wait()
    if drove.returncode:
        raise SystemExit(f"the driver failed:\n{drove.stderr[-3000:]}")
    row = {}
    for line in lines:
        if line.startswith("{"):
            row.update(json.loads(line))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="a checkout of other code, run alternately with this tree")
    parser.add_argument("--sequential", action="store_true",
                        help="compare with this tree whose passes are queued by the compute thread when it reaches "
                             "them (`ModelRunner.launch` left out), instead of with --before")
    parser.add_argument("--bucket-runs", action="store_true",
                        help="compare with this tree whose batch shapes are bucket_runs, its pass times --pass-model's")
    parser.add_argument("--pass-model", help="FLOOR,PER_TOKEN (ms): every stand-in pass takes FLOOR + PER_TOKEN x "
                                             "its bucket's rows x tokens, instead of --pass-ms (needed by --bucket-runs)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each level and code")
    parser.add_argument("--think-ms", default="20,5", help="levels: the think times (ms), comma-separated")
    parser.add_argument("--pass-ms", type=float, default=3.9, help="the stand-in pass (H200: 3.9 ms at ~61 rows)")
    parser.add_argument("--releases", type=int, default=6, help="GIL releases per queued pass")
    parser.add_argument("--conns", type=int, default=4,
                        help="emulated HTTP workers: the driver's connections to the engine's Unix socket")
    parser.add_argument("--concurrency", type=int, default=256,
                        help="one-text requests kept in the engine, shared evenly by the --conns connections")
    parser.add_argument("--tick-ms", type=float, default=0.25,
                        help="a worker's event-loop tick (ms): the requests due in one tick go back in one frame")
    parser.add_argument("--max-wait-ms", type=float, default=2.0, help="the engine's TMOD_MAX_WAIT_MS (ms)")
    parser.add_argument("--warmup", type=float, default=4.0, help="unrecorded seconds before each run's window")
    parser.add_argument("--duration", type=float, default=6.0, help="recorded seconds per run")
    parser.add_argument("--out", help="JSON results (and a .md beside it)")
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--driver", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        return engine(json.loads(args.engine))
    if args.driver:
        return driver(json.loads(args.driver[0]), int(args.driver[1]))
    from bench.harness import machine_info

    if args.bucket_runs and not args.pass_model:
        parser.error("--bucket-runs needs --pass-model (the times bucket_runs weighs passes by)")
    model = [float(x) for x in args.pass_model.split(",")] if args.pass_model else None
    codes = {"after": str(REPO), **({"before": str(Path(args.before).resolve())} if args.before else {}),
             **({"sequential": str(REPO)} if args.sequential else {}),
             **({"bucket_runs": str(REPO)} if args.bucket_runs else {})}
    rows = []
    for run in range(args.runs):
        for think in [float(t) for t in args.think_ms.split(",")]:
            for code in (list(codes) if run % 2 == 0 else list(reversed(codes))):
                config = {"code": codes[code], "launch_ahead": code != "sequential",
                          "batch_shapes": "bucket_runs" if code == "bucket_runs" else "buckets", "pass_model": model,
                          "path": f"/tmp/tmod-engine-load-{os.getpid()}.sock", "pass_ms": args.pass_ms, "releases": args.releases, "conns": args.conns,
                          "concurrency": args.concurrency, "think_ms": think, "tick_ms": args.tick_ms,
                          "max_wait_ms": args.max_wait_ms, "warmup": args.warmup, "duration": args.duration}
                row = {"code": code, "run": run + 1, "think_ms": think, **run_one(config)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        result = {"benchmark": "bench/bench_engine_load.py", "command": " ".join(sys.argv),
                  "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info("cpu"),
                  "settings": {k: v for k, v in vars(args).items() if k not in ("engine", "driver", "out")},
                  "before": args.before, "rows": rows}
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        write_markdown(Path(args.out).with_suffix(".md"), result)


def write_markdown(path: Path, result: dict) -> None:
    m, s = result["machine"], result["settings"]
    from bench.harness import vector_flags

    codes = {"after": f"`after`: this tree ({m['versions']['tmod_git']['commit']})",
             "before": f"`before`: the code at {result['before']}",
             "sequential": "`sequential`: this tree with each pass queued by the compute thread when it reaches it",
             "bucket_runs": "`bucket_runs`: this tree with batch shapes bucket_runs, weighing passes by the stand-in's times"}
    model = s.get("pass_model")
    passes = f"a pass at B x T: {model.replace(',', ' + ')} x B x T ms" if model else f"{s['pass_ms']} ms a pass"
    lines = [f"# The engine process under load, its device a stand-in queue ({passes}, "
             f"{s['releases']} GIL releases per queued pass)", "",
             f"{result['date']} · {m.get('cpu_model', '')} ({vector_flags(m)}) · {m.get('logical_cpus')} logical CPUs · "
             f"`{result['command']}`", "",
             f"{s['conns']} emulated workers keep {s['concurrency']} one-text requests in the engine, each sent back "
             "after a think time; engine on CPU 0, driver on the rest. "
             + "; ".join(what for code, what in codes.items() if code in {r["code"] for r in result["rows"]}) + ".", "",
             "| code | think ms | run | requests/s | requests/batch | batch to batch, ms | engine round trip p50 / p99, ms "
             "| engine cores | engine CPU µs/request | passes/batch | padded tokens/batch | device busy |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(result["rows"], key=lambda r: (r["think_ms"], r["code"], r["run"])):
        trip = r.get("engine_round_trip_ms", {})
        lines.append(f"| {r['code']} | {r['think_ms']:g} | {r['run']} | {r['requests_per_s']:,} | {r['requests_per_batch']} | "
                     f"{r['batch_to_batch_ms']} | {trip.get('p50')} / {trip.get('p99')} | {r['engine_cores']} | "
                     f"{r['engine_cpu_us_per_request']} | {r.get('passes_per_batch')} | {r.get('padded_tokens_per_batch')} | "
                     f"{r.get('device_busy')} |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
