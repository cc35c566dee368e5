#!/usr/bin/env python
"""Serving load: throughput and latency of a real `tmod-serve` on loopback, batching on vs off (or
two batch windows, `--window-against`).

Two servers (bench/harness.py `ServerProcess`) serve one store, one with TMOD_BATCHING=true, one
with false (one request per backbone pass); both stay up, the idle one costs nothing. With
`--window-against MS` both batch, one with `--max-wait-ms`, the other with MS. At each
concurrency level a closed-loop load generator (`harness.measure`: c clients, each with its own
keep-alive connection, one SST-2 validation sentence per request, `--tasks`) drives one server at a
time: `--warmup` seconds unrecorded, then a window of at most `--duration` seconds and
`--max-requests` answers. Each level is measured `--rounds` times with the servers' order
alternating, so every on/off pair is measured seconds apart on a shared, noisy machine; rounds are
pooled (throughput = answers / window time, percentiles over all latencies). /metrics gives the
achieved batch size and the server's phase times; /proc the CPU each process used.

Without `--store`, a temporary store of random-weight heads sized like tmod-train's defaults
(`harness.build_store`: sentiment, ner, acceptability, every state mixed) costs what trained ones do.

    .venv/bin/python bench/bench_load.py            # full run, ~8 min -> bench/results/load-cpu.{json,md}
    .venv/bin/python bench/bench_load.py --quick    # levels 1, 8, 32, one round -> load-cpu-quick.*
    .venv/bin/python bench/bench_load.py --max-wait-ms 2 --window-against 0 --out load-cpu-window-2-vs-0
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import shutil
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.harness import (  # noqa: E402
    ServerProcess,
    build_store,
    fmt,
    loadavg,
    markdown_table,
    measure,
    read_sst2_sentences,
    serve_command,
    summarise_latency,
    write_results,
)
from training.data.files import default_data_dir  # noqa: E402

TARGET = {"concurrency": 32, "throughput_ratio_min": 3.0, "p99_ratio_max": 2.0}  # batching on / off
CONFIGS = {"batching_on": {"TMOD_BATCHING": "true"}, "batching_off": {"TMOD_BATCHING": "false"}}


def server_configs(args) -> dict[str, dict[str, str]]:
    """The two servers compared, by name: batching on and off, or two batch windows (both batching)."""
    if args.window_against is None:
        return {name: {**env, "TMOD_MAX_WAIT_MS": str(args.max_wait_ms)} for name, env in CONFIGS.items()}
    return {f"window_{ms:g}ms": {"TMOD_BATCHING": "true", "TMOD_MAX_WAIT_MS": str(ms)}
            for ms in (args.max_wait_ms, args.window_against)}


def pool(runs: list[dict], inputs_per_request: int) -> dict:
    """The rounds of one (config, level) as one: all answers over all window time."""
    window = sum(r["window_s"] for r in runs)
    rps = sum(r["ok_completed_in_window"] for r in runs) / window if window else 0.0
    passes = sum(r["server"]["backbone_passes"] for r in runs)
    batch = [r["server"]["mean_batch_requests"] * r["server"]["backbone_passes"] for r in runs
             if r["server"]["mean_batch_requests"] is not None]
    cores = [r["cpu"]["server_cores"] for r in runs if r["cpu"].get("server_cores") is not None]
    return {"rounds": len(runs), "window_s": round(window, 3), "requests_per_s": rps,
            "sequences_per_s": rps * inputs_per_request, "requests_per_s_by_round": [r["requests_per_s"] for r in runs],
            "latency_ms": summarise_latency([x for r in runs for x in r["latencies_ms"]]),
            "p99_ms_by_round": [r["latency_ms"]["p99"] for r in runs],
            "errors": sum(r["errors"] for r in runs), "backbone_passes": passes,
            "mean_batch_requests": sum(batch) / passes if passes and batch else None,
            "server_cores": sum(cores) / len(cores) if cores else None}


def ratio(a, b):
    return a / b if a is not None and b else None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_load.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="levels 1,8,32, one round, 1 s warm-up, 3 s windows")
    p.add_argument("--store", type=Path, help="module store to serve (default: random-weight heads, temporary)")
    p.add_argument("--backbone", help="local Hugging Face model folder (default all-MiniLM-L6-v2)")
    p.add_argument("--data-dir", type=Path, default=default_data_dir(), help="holds sst2/validation.tsv")
    p.add_argument("--tasks", default="ner,sentiment", help="tasks every request asks for")
    p.add_argument("--levels", default="1,2,4,8,16,32,64", help="concurrency levels")
    p.add_argument("--rounds", type=int, default=2, help="measurements per (level, config), order alternating")
    p.add_argument("--warmup", type=float, default=2.0, help="unrecorded seconds before each window")
    p.add_argument("--duration", type=float, default=10.0, help="most seconds per window")
    p.add_argument("--max-requests", type=int, default=4000, help="most answers per window")
    p.add_argument("--inputs-per-request", type=int, default=1, help="sentences per request")
    p.add_argument("--threads", type=int, default=1, help="server torch threads (TMOD_THREADS)")
    p.add_argument("--max-wait-ms", type=float, default=2.0, help="TMOD_MAX_WAIT_MS")
    p.add_argument("--window-against", type=float, default=None, metavar="MS",
                   help="compare two batching servers, batch window --max-wait-ms against MS, instead of on vs off")
    p.add_argument("--max-queue", type=int, default=256, help="TMOD_MAX_QUEUE (above the top level: no 429)")
    p.add_argument("--seed", type=int, default=0, help="sentence order and random heads")
    p.add_argument("--out", default=None, help="results stem (default load-cpu, or load-cpu-quick)")
    args = p.parse_args(argv)
    if args.quick:
        args.levels, args.rounds, args.warmup, args.duration = "1,8,32", 1, 1.0, 3.0
    args.level_list = [int(x) for x in args.levels.split(",")]
    args.task_list = args.tasks.split(",")
    args.out = args.out or ("load-cpu-quick" if args.quick else "load-cpu")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    load_start = loadavg()
    sentences = read_sst2_sentences(args.data_dir)
    random.Random(args.seed).shuffle(sentences)
    per = args.inputs_per_request
    bodies = [json.dumps({"inputs": sentences[i * per:(i + 1) * per]}).encode() for i in range(len(sentences) // per)]
    workdir = Path(tempfile.mkdtemp(prefix="tmod-bench-load-"))
    servers: dict[str, ServerProcess] = {}
    try:
        store = args.store or workdir / "store"
        store_info = {"path": str(args.store)} if args.store else build_store(store, args.backbone, args.seed)
        env = {"TMOD_STORE": str(store), "TMOD_THREADS": str(args.threads),
               "TMOD_MAX_QUEUE": str(args.max_queue), "TMOD_MAX_INPUTS": str(max(64, per)),
               **({"TMOD_BACKBONE": args.backbone} if args.backbone else {})}
        configs = server_configs(args)
        first, second = configs
        for config, config_env in configs.items():
            servers[config] = ServerProcess(config, {**env, **config_env}, workdir / f"{config}.log", serve_command())
            servers[config].start()
        for server in servers.values():
            server.wait_ready(timeout=300)
            # warm-up burst at the top level (kernels, allocator), not recorded
            asyncio.run(measure(server, bodies, args.task_list, max(args.level_list), 1.0, 0.5, 10**9, per, 60.0))
        runs: dict[tuple[str, int], list[dict]] = {}
        for r in range(args.rounds):
            for i, c in enumerate(args.level_list):
                for config in (list(configs) if (r + i) % 2 == 0 else list(reversed(configs))):
                    run = asyncio.run(measure(servers[config], bodies, args.task_list, c, args.warmup, args.duration,
                                              args.max_requests, per, 60.0))
                    runs.setdefault((config, c), []).append(run)
                    print(f"round {r + 1} c={c} {config}: {run['requests_per_s']:.1f} req/s, "
                          f"p99 {fmt(run['latency_ms']['p99'])} ms, errors {run['errors']}", flush=True)
        levels = []
        for c in args.level_list:
            a, b = (pool(runs[(config, c)], per) for config in configs)
            levels.append({"concurrency": c, first: a, second: b, "ratios": {
                "of": f"{first} / {second}",
                "throughput": ratio(a["requests_per_s"], b["requests_per_s"]),
                "p99": ratio(a["latency_ms"]["p99"], b["latency_ms"]["p99"]),
                "p50": ratio(a["latency_ms"]["p50"], b["latency_ms"]["p50"]),
                "throughput_by_round": [ratio(x, y) for x, y in zip(a["requests_per_s_by_round"],
                                                                     b["requests_per_s_by_round"])]}})
        at = next((lv for lv in levels if lv["concurrency"] == TARGET["concurrency"]), None)
        met = None if at is None or args.window_against is not None else (
            at["ratios"]["throughput"] >= TARGET["throughput_ratio_min"] and at["ratios"]["p99"] <= TARGET["p99_ratio_max"]
            and at["batching_on"]["errors"] == 0)
        result = {"benchmark": "bench_load", "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  "servers": configs, "store": store_info, "load_average_start": load_start,
                  "load_average_end": loadavg(), "levels": levels,
                  **({"target": {**TARGET, "met": met}} if args.window_against is None else {})}
        rows = [[lv["concurrency"], config, fmt(lv[config]["requests_per_s"]), fmt(lv[config]["latency_ms"]["p50"]),
                 fmt(lv[config]["latency_ms"]["p99"]), lv[config]["errors"], fmt(lv[config]["mean_batch_requests"], 2),
                 fmt(lv[config]["server_cores"], 2)] for lv in levels for config in configs]
        ratios = [[lv["concurrency"], fmt(lv["ratios"]["throughput"], 2), fmt(lv["ratios"]["p99"], 2),
                   fmt(lv["ratios"]["p50"], 2)] for lv in levels]
        title = (f"Serving load: batching on vs off (target at c=32: "
                 f"{'met' if met else 'not met' if met is not None else 'not measured'})"
                 if args.window_against is None else f"Serving load: two batch windows, {first} against {second}")
        notes = (f"Target: throughput on / off >= {TARGET['throughput_ratio_min']}x and p99 <= "
                 f"{TARGET['p99_ratio_max']}x at c = {TARGET['concurrency']}, no errors. " if args.window_against is None
                 else "") + "Latency client side."
        path = write_results(args.out, result, title, [
            markdown_table(["c", "server", "req/s", "p50 ms", "p99 ms", "errors", "requests per pass", "server cores"],
                           rows),
            markdown_table(["c", f"throughput {first} / {second}", "p99 ratio", "p50 ratio"], ratios)], notes)
        print(f"wrote {path} and its .md", flush=True)
        return 0
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
