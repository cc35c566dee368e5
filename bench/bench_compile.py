#!/usr/bin/env python
"""Benchmark: does torch.compile (inductor, CPU) on the per-layer call pay over eager?

The torch backend calls the backbone one layer at a time (states stream into the heads), so the
unit to compile is one layer call: `torch.compile(fn, dynamic=True)` per layer, where `fn` runs the
layer as the backend does (fp32: the backbone's own layer; bf16: the backend's copy with bf16
Linear weights under torch.autocast, state cast back to float32). Dynamic shapes, because batch
size and sequence length change from one pass to the next.

Measured: the backbone's stream to the last layer (embeddings + L layer calls; no heads, which
are the same in every configuration) on MiniLM, one torch thread, CPU time of the process, over
the same batches in 5 interleaved rounds (fresh random order per round); throughput ratios per
round against eager at the same precision and against eager fp32. Short inputs: SST-2 validation
sentences sorted by length and cut into batches (every batch a different length: dynamic shapes
are exercised); long inputs: 128-token texts. Also recorded: the first pass over the batches
(compile included) and the largest difference of the last state from eager fp32.

    .venv/bin/python bench/bench_compile.py     # -> bench/results/compile-cpu.{json,md}
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

from bench.bench_backends import long_batches, short_batches  # noqa: E402
from bench.bench_sharing import default_data_dir  # noqa: E402
from bench.environment import machine_info, read_sst2_sentences  # noqa: E402

import torch  # noqa: E402


def layer_function(layer, dtype):
    from server.backbone.architectures import run_block

    if dtype is None:
        return lambda hidden, mask: run_block(layer, hidden, mask)

    def run(hidden, mask):
        with torch.autocast(hidden.device.type, dtype=dtype):
            return run_block(layer, hidden, mask).float()

    return run


def stream_runner(adapter, functions):
    @torch.inference_mode()
    def run(batch):
        hidden = adapter.embed(batch.input_ids, batch.token_type_ids)
        mask = adapter.mask(hidden, batch.attention_mask)
        for fn in functions:
            hidden = fn(hidden, mask)
        return hidden

    return run


def ratio_summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="torch.compile (inductor) on the per-layer call vs eager, fp32 and bf16, "
                                            "on the CPU (see the module docstring)")
    p.add_argument("--data-dir", type=Path, default=default_data_dir())
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "compile-cpu",
                   help="output path prefix (.json, .md)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    machine = machine_info()
    torch.set_num_threads(1)
    from server.backbone import Backbone
    from server.backbone.backends.torch_backend import low_precision_layers

    bb = Backbone.load()
    adapter = bb.adapter
    sentences = read_sst2_sentences(args.data_dir)
    rng = random.Random(args.seed)
    eager = {"fp32": [layer_function(layer, None) for layer in adapter.layers],
             "bf16": [layer_function(layer, torch.bfloat16)
                      for layer in low_precision_layers(adapter.layers, torch.bfloat16)]}
    compiled = {p_: [torch.compile(fn, dynamic=True) for fn in fns] for p_, fns in eager.items()}
    configs = {f"{mode}-{p_}": stream_runner(adapter, fns)
               for mode, table in (("eager", eager), ("compiled", compiled)) for p_, fns in table.items()}
    result = {"benchmark": "compile", "date_utc": machine["date"], "machine": machine,
              "command": "python bench/bench_compile.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "settings": {"threads": 1, "clock": "cpu (time.process_time)", "rounds": args.rounds,
                           "backbone": bb.name, "compile": "torch.compile(per-layer function, dynamic=True), "
                           "inductor backend, default mode", "timed": "Backbone stream to the last layer, no heads"},
              "inputs": {}}
    plan = [("short", bs) for bs in args.batch_sizes] + [("long", 32)]
    for kind, bs in plan:
        if kind == "short":
            batches = short_batches(bb, sentences, bs, 128 if bs > 1 else 32, rng)
        else:
            batches = long_batches(bb, sentences, bs, 64, 128, rng)
        first = {}
        for name, fn in configs.items():  # the first pass compiles (and specialises) the layers
            t0 = time.perf_counter()
            for batch in batches:
                fn(batch)
            first[name] = round(time.perf_counter() - t0, 2)
        ref = configs["eager-fp32"](batches[-1])
        mask = batches[-1].attention_mask.bool()
        diffs = {name: (fn(batches[-1]).float() - ref)[mask].abs().max().item() for name, fn in configs.items()}
        totals = {name: [] for name in configs}
        names = list(configs)
        for r in range(args.rounds):
            rng.shuffle(names)
            for name in names:
                c0 = time.process_time()
                for batch in batches:
                    configs[name](batch)
                totals[name].append(time.process_time() - c0)
        n_seq = sum(b.size for b in batches)
        entry = {"batch_size": bs, "batches": len(batches), "sequences": n_seq,
                 "mean_padded_length": sum(b.size * b.seq_len for b in batches) / n_seq,
                 "distinct_lengths": len({b.seq_len for b in batches}),
                 "first_pass_seconds_incl_compile": first, "max_abs_diff_last_state_vs_eager_fp32": diffs,
                 "configs": {}}
        for name in configs:
            precision = name.split("-")[1]
            entry["configs"][name] = {
                "cpu_seconds_per_round": totals[name],
                "sequences_per_s": n_seq / statistics.median(totals[name]),
                "vs_eager_same_precision": ratio_summary([a / b for a, b in zip(totals[f"eager-{precision}"], totals[name])]),
                "vs_eager_fp32": ratio_summary([a / b for a, b in zip(totals["eager-fp32"], totals[name])]),
            }
            c = entry["configs"][name]
            print(f"{kind} B={bs} {name:<14} {c['sequences_per_s']:7.1f} seq/s  vs eager same precision "
                  f"{c['vs_eager_same_precision']['median']:.2f}  vs eager fp32 {c['vs_eager_fp32']['median']:.2f}  "
                  f"first pass {first[name]}s", flush=True)
        result["inputs"][f"{kind}-B{bs}"] = entry
    result["machine"]["load_average_at_end"] = machine_info()["load_average_at_start_1_5_15min"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result) + "\n")
    print(markdown(result))


def markdown(result: dict) -> str:
    m = result["machine"]

    def fr(r):
        return f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"

    lines = [
        "# torch.compile on the per-layer call (CPU)", "",
        f"Measured {result['date_utc']} on {m['cpu_model']} ({m['logical_cpus']} logical CPUs, load average "
        f"{m['load_average_at_start_1_5_15min']} at start, {m.get('load_average_at_end')} at end), torch "
        f"{m['versions']['torch']}; {result['settings']['backbone']}, {result['settings']['compile']}; timed: "
        f"{result['settings']['timed']}; one thread, CPU time, {result['settings']['rounds']} interleaved rounds, "
        "ratios per round, median (min-max).", "",
        f"Command: `{result['command']}`", "",
        "| inputs | config | seq/s | vs eager, same precision | vs eager fp32 | first pass s (compile) | "
        "max abs diff vs eager fp32 |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, e in result["inputs"].items():
        for name, c in e["configs"].items():
            lines.append(f"| {key} (padded len {e['mean_padded_length']:.0f}, {e['distinct_lengths']} lengths) | {name} | "
                         f"{c['sequences_per_s']:.1f} | {fr(c['vs_eager_same_precision'])} | {fr(c['vs_eager_fp32'])} | "
                         f"{e['first_pass_seconds_incl_compile'][name]} | "
                         f"{e['max_abs_diff_last_state_vs_eager_fp32'][name]:.2e} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
