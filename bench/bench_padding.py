#!/usr/bin/env python
"""Benchmark: padding waste, with length runs (max_padding_ratio 1.25) and without (one pass per batch).

The server sorts a batch's rows by length and cuts them into length runs whose padded tokens stay
within `max_padding_ratio` of their real tokens, one backbone pass per run (server/runtime.py,
`length_runs`). This measures what that buys on the served path itself: `Runtime.run_batch` (collate,
backbone, heads, decoded answers) of two runtimes that share one backbone and one module set and
differ only in `max_padding_ratio`: 1.25 (the default) and 1000 (in effect no cut: every batch is one
pass padded to its longest row).

Batches: `batch size` rows drawn at random, sorted by length as the batcher sorts them, from
- `sst2`: SST-2 validation sentences (the load benchmark's traffic), or
- `mixed`: the same with a share (`--long-share`, 25%) of RTE dev premises, longer real passages
  (bench/README.md; the datasets README gives their source).
Batch sizes 8 / 32 / 128 stand for the batch a closed-loop load at concurrency 8 / 32 / 128 gathers
(one sentence per request).

Recorded per (mix, batch size, ratio): real and padded tokens and passes (from the rows, exact),
sequences per CPU-second (one torch thread, CPU time of the process: other jobs on the shared cores
do not count), per-batch time p50 / p99 (the compute part of a request's latency), and per round the
throughput ratio of the two settings (interleaved rounds: every round runs every setting over the
same batches in a fresh random order). A sanity check compares the labels both settings give.

    .venv/bin/python bench/bench_padding.py     # -> bench/results/padding-cpu.{json,md}
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.bench_load import percentile  # noqa: E402
from bench.bench_sharing import paired_ratio  # noqa: E402
from bench.environment import machine_info, read_sst2_sentences  # noqa: E402
from training.data import default_data_dir  # noqa: E402

import torch  # noqa: E402


def read_rte_premises(data_dir: Path) -> list[str]:
    path = Path(data_dir) / "rte" / "dev.tsv"
    if not path.is_file():
        raise SystemExit(f"no RTE dev file at {path} (set --data-dir or TMOD_DATA_DIR)")
    lines = path.read_text(encoding="utf-8").splitlines()[1:]
    return [line.split("\t")[1].strip() for line in lines if line.count("\t") >= 3]


def padding_stats(lengths: list[int], ratio: float) -> dict:
    from server.runtime import length_runs

    runs = length_runs(lengths, ratio)
    return {"passes": len(runs), "real_tokens": sum(lengths),
            "padded_tokens": sum((r.stop - r.start) * lengths[r.stop - 1] for r in runs)}


def labels_of(outputs: dict) -> list:
    out = []
    for task in sorted(outputs):
        for answer in outputs[task]:
            if "entities" in answer:
                out.append((task, tuple((e["label"], e["start"], e["end"]) for e in answer["entities"])))
            else:
                out.append((task, answer.get("label")))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Padding waste with length runs (max_padding_ratio 1.25) and without "
                                            "(one pass per batch), on Runtime.run_batch (see the module docstring)")
    p.add_argument("--data-dir", type=Path, default=default_data_dir())
    p.add_argument("--store", type=Path, default=REPO / "modules_store", help="module store (default: the shipped modules)")
    p.add_argument("--tasks", default="ner,sentiment", help="tasks every batch asks for (as bench_load.py)")
    p.add_argument("--ratios", default="1.25,1000", help="max_padding_ratio values; the first is the reference")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--mixes", nargs="+", choices=["sst2", "mixed"], default=["sst2", "mixed"])
    p.add_argument("--long-share", type=float, default=0.25, help="share of RTE premises in the mixed batches")
    p.add_argument("--sequences", type=int, default=512, help="rows per (mix, batch size) per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--precision", default="auto", help="TMOD_PRECISION of both runtimes (default: the server's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "padding-cpu")
    args = p.parse_args(argv)
    ratios = [float(x) for x in args.ratios.split(",") if x.strip()]

    machine = machine_info()
    torch.set_num_threads(args.threads)
    from server.backbone import Backbone
    from server.config import Settings
    from server.engine import Timings
    from server.runtime import Runtime

    bb = Backbone.load()
    sst2 = read_sst2_sentences(args.data_dir)
    rte = read_rte_premises(args.data_dir)
    rng = random.Random(args.seed)
    runtimes = {}
    for ratio in ratios:
        runtime = Runtime(Settings(store=args.store, tasks=args.tasks, max_padding_ratio=ratio,
                                    precision=args.precision), backbone=bb)
        runtime.start()
        if runtime.startup_error:
            raise SystemExit(runtime.startup_error)
        runtimes[ratio] = runtime
    modules = runtimes[ratios[0]].modules
    result = {
        "benchmark": "padding", "date_utc": machine["date"], "machine": machine,
        "command": "python bench/bench_padding.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "settings": {"ratios": ratios, "batch_sizes": args.batch_sizes, "mixes": args.mixes,
                     "long_share": args.long_share, "sequences_per_round": args.sequences, "rounds": args.rounds,
                     "threads": args.threads, "clock": "cpu (time.process_time)", "tasks": sorted(modules),
                     "module_versions": {t: m.version for t, m in modules.items()}, "backbone": bb.name,
                     "backend": runtimes[ratios[0]].backbone.backend.describe(), "seed": args.seed,
                     "timed": "Runtime.run_batch(rows sorted by length): collate, backbone, heads, decoded answers"},
        "results": {},
    }
    for mix in args.mixes:
        result["results"][mix] = {}
        for bs in args.batch_sizes:
            n_batches = max(1, args.sequences // bs)
            batches = []
            for _ in range(n_batches):
                if mix == "sst2":
                    texts = rng.sample(sst2, bs)
                else:
                    n_long = round(bs * args.long_share)
                    texts = rng.sample(sst2, bs - n_long) + rng.sample(rte, n_long)
                rows = sorted(bb.encode(texts, truncate=True), key=len)  # the batcher sorts by length
                batches.append(rows)
            lengths = [len(r) for rows in batches for r in rows]
            # sanity: both settings give the same answers (padding is masked)
            agree = {}
            for ratio, runtime in runtimes.items():
                agree[ratio] = [labels_of(runtime.run_batch(rows, modules, Timings())) for rows in batches[:4]]
            same = all(agree[r] == agree[ratios[0]] for r in ratios)
            calls = {r: [] for r in ratios}
            totals = {r: [] for r in ratios}
            order = list(ratios)
            for _ in range(args.rounds):
                rng.shuffle(order)
                for ratio in order:
                    runtime, total = runtimes[ratio], 0.0
                    for rows in batches:
                        c0 = time.process_time()
                        runtime.run_batch(rows, modules, Timings())
                        dt = time.process_time() - c0
                        calls[ratio].append(dt)
                        total += dt
                    totals[ratio].append(total)
            n_seq = sum(len(rows) for rows in batches)
            entry = {"batches": n_batches, "sequences_per_round": n_seq,
                     "row_tokens": {"mean": statistics.fmean(lengths), "p50": percentile(lengths, 50),
                                    "p90": percentile(lengths, 90), "max": max(lengths)},
                     "same_labels_across_ratios_first_4_batches": same, "by_ratio": {}}
            ref = ratios[0]
            for ratio in ratios:
                stats = [padding_stats([len(r) for r in rows], ratio) for rows in batches]
                real = sum(s["real_tokens"] for s in stats)
                padded = sum(s["padded_tokens"] for s in stats)
                entry["by_ratio"][str(ratio)] = {
                    "passes_per_batch": sum(s["passes"] for s in stats) / n_batches,
                    "real_tokens": real, "padded_tokens": padded, "padded_over_real": padded / real,
                    "sequences_per_cpu_s": n_seq / statistics.median(totals[ratio]),
                    "batch_ms": {"p50": 1000 * percentile(calls[ratio], 50), "p99": 1000 * percentile(calls[ratio], 99)},
                    "throughput_vs_reference": paired_ratio(totals[ref], totals[ratio]),
                    "cpu_seconds_per_round": totals[ratio],
                }
            for ratio in ratios:
                e = entry["by_ratio"][str(ratio)]
                e["p50_vs_reference"] = e["batch_ms"]["p50"] / entry["by_ratio"][str(ref)]["batch_ms"]["p50"]
                e["p99_vs_reference"] = e["batch_ms"]["p99"] / entry["by_ratio"][str(ref)]["batch_ms"]["p99"]
                print(f"{mix} B={bs} ratio {ratio:g}: {e['passes_per_batch']:.2f} passes/batch, padded/real "
                      f"{e['padded_over_real']:.3f}, {e['sequences_per_cpu_s']:.1f} seq/cpu-s, throughput vs {ref:g} "
                      f"{e['throughput_vs_reference']['median']:.2f}, p50 {e['batch_ms']['p50']:.1f} ms, "
                      f"p99 {e['batch_ms']['p99']:.1f} ms", flush=True)
            result["results"][mix][str(bs)] = entry
    for runtime in runtimes.values():
        runtime.close()
    result["machine"]["load_average_at_end"] = machine_info()["load_average_at_start_1_5_15min"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    args.out.with_suffix(".md").write_text(text + "\n")
    print(text)


def markdown(result: dict) -> str:
    s, m = result["settings"], result["machine"]
    ref = s["ratios"][0]
    lines = [
        "# Padding waste: length runs on and off (CPU)", "",
        f"Measured {result['date_utc']} on {m['cpu_model']} ({m['logical_cpus']} logical CPUs, load average "
        f"{m['load_average_at_start_1_5_15min']} at start, {m.get('load_average_at_end')} at end), torch "
        f"{m['versions']['torch']}; backbone {s['backbone']} ({s['backend']['backend']} {s['backend']['precision']}); "
        f"tasks {', '.join(f'{t}/{v}' for t, v in s['module_versions'].items())}. Timed: {s['timed']}; "
        f"{s['threads']} thread, CPU time, {s['rounds']} interleaved rounds. max_padding_ratio {ref:g} (the default) "
        f"is the reference; {', '.join(f'{r:g}' for r in s['ratios'][1:])} = one pass per batch, padded to its "
        "longest row. Throughput ratio: per round, median (min-max); p50 / p99: per batch, over all rounds.", "",
        f"Command: `{result['command']}`", "",
        "| inputs | batch | max_padding_ratio | passes / batch | padded / real tokens | seq / CPU-s | "
        f"throughput vs {ref:g} | p50 ms | p99 ms | p50, p99 vs {ref:g} |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mix, per_bs in result["results"].items():
        for bs, e in per_bs.items():
            t = e["row_tokens"]
            label = (f"{mix} (tokens/row mean {t['mean']:.0f}, p90 {t['p90']:.0f}, max {t['max']})")
            for ratio, r in e["by_ratio"].items():
                tr = r["throughput_vs_reference"]
                lines.append(f"| {label} | {bs} | {float(ratio):g} | {r['passes_per_batch']:.2f} | "
                             f"{r['padded_over_real']:.3f} | {r['sequences_per_cpu_s']:.1f} | "
                             f"{tr['median']:.2f} ({tr['min']:.2f}-{tr['max']:.2f}) | {r['batch_ms']['p50']:.1f} | "
                             f"{r['batch_ms']['p99']:.1f} | {r['p50_vs_reference']:.2f}, {r['p99_vs_reference']:.2f} |")
                label = ""
            if not e["same_labels_across_ratios_first_4_batches"]:
                lines.append("| | | | | | | | | | labels differ between ratios |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
