#!/usr/bin/env python
"""Benchmark: what the MPNet quality tier costs against the MiniLM default, serving on this machine.

For each backbone (all-MiniLM-L6-v2: 6x384; all-mpnet-base-v2: 12x768) and torch precision (fp32;
bf16 where the CPU has native bfloat16; fp16 too on a GPU): sequences and tokens per second of
`Engine.logits` at batch 32 over SST-2 validation sentences (sorted by length and cut into batches,
as the batcher's length runs do), for the backbone alone (every state streamed) and with the
backbone's shipped single-text modules from the store (those of sentiment, ner, acceptability that
both backbones have: the version each backbone serves). Tokenization is done once up front.

Noise control as in bench_backends.py: every round runs every configuration over the same batches
in a freshly shuffled order; the MPNet / MiniLM ratio is computed per round and summarised by its
median (min-max). With one thread on a CPU the clock is the process's CPU time (other jobs on the
shared cores do not count); wall-clock numbers are in the JSON too.

    .venv/bin/python bench/bench_tiers.py                 # -> bench/results/tiers-cpu.{json,md}
    .venv/bin/python bench/bench_tiers.py --device cuda   # -> tiers-cuda.* (on a GPU)
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.bench_sharing import paired_ratio, summarise  # noqa: E402
from bench.environment import machine_info, read_sst2_sentences  # noqa: E402

import torch  # noqa: E402

BACKBONES = {"minilm": "all-MiniLM-L6-v2", "mpnet": "all-mpnet-base-v2"}
TASKS = ("sentiment", "ner", "acceptability")


def precisions(device: str) -> list[str]:
    from server.config import cpu_has_native_bf16

    if device.startswith("cuda"):
        return ["fp32", "bf16", "fp16"]
    return ["fp32", "bf16"] if cpu_has_native_bf16() else ["fp32"]


def load_tier(name: str, device: str, store: Path):
    """The backbone and the modules it serves from the store (none if the store has none for it)."""
    from modules_store import ArtifactError, ModuleStore
    from server.backbone import Backbone
    from server.modules import load_module

    backbone = Backbone.load(name, device=device)
    modules = {}
    for task in TASKS:
        try:
            modules[task] = load_module(ModuleStore(store), task, None, backbone, device)
        except ArtifactError as exc:
            print(f"{name}: {task} not measured ({exc.message})", file=sys.stderr)
    return backbone, modules


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=2, help="batches per timed run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--store", default=str(REPO / "modules_store"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="default: bench/results/tiers-<cpu|cuda>")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from server.engine import Engine

    rng = random.Random(args.seed)
    sentences = rng.sample(read_sst2_sentences(), args.batch_size * args.batches)
    gpu = args.device.startswith("cuda")
    configs, meta = {}, {}
    tiers = {tier: load_tier(tier, args.device, Path(args.store)) for tier in BACKBONES}
    common = set.intersection(*(set(modules) for _, modules in tiers.values()))  # the same tasks on both
    for tier, (base, modules) in tiers.items():
        modules = {task: m for task, m in modules.items() if task in common}
        rows = sorted(base.encode(sentences), key=len)
        batches = [base.collate(rows[i:i + args.batch_size]) for i in range(0, len(rows), args.batch_size)]
        tokens = sum(int(b.attention_mask.sum()) for b in batches)
        for precision in precisions(args.device):
            bb = base if precision == "fp32" else base.use_backend("torch", precision)
            engine = Engine(bb)

            def backbone_only(bb=bb, batches=batches):
                for batch in batches:
                    for _ in bb.stream(batch):
                        pass

            def with_modules(engine=engine, batches=batches, modules=modules):
                for batch in batches:
                    engine.logits(batch, modules)

            configs[f"{tier}-{precision}-backbone"] = backbone_only
            meta[f"{tier}-{precision}-backbone"] = {"tier": tier, "precision": precision, "modules": [], "tokens": tokens}
            if modules:
                configs[f"{tier}-{precision}-modules"] = with_modules
                meta[f"{tier}-{precision}-modules"] = {"tier": tier, "precision": precision,
                                                       "modules": [f"{m.task}/{m.version}" for m in modules.values()],
                                                       "tokens": tokens}
        meta[tier] = {"backbone": BACKBONES[tier], "layers": base.num_layers, "hidden": base.hidden_size,
                      "parameters": sum(p.numel() for p in base.model.parameters()), "tokens_per_run": tokens}
    for run in configs.values():  # warm-up (first-call allocations, oneDNN kernels)
        run()

    clock = time.perf_counter if gpu or args.threads != 1 else time.process_time
    cpu_seconds = {name: [] for name in configs}
    wall_seconds = {name: [] for name in configs}
    for _ in range(args.rounds):
        order = list(configs)
        rng.shuffle(order)
        for name in order:
            if gpu:
                torch.cuda.synchronize()
            c0, w0 = clock(), time.perf_counter()
            configs[name]()
            if gpu:
                torch.cuda.synchronize()
            cpu_seconds[name].append(clock() - c0)
            wall_seconds[name].append(time.perf_counter() - w0)
    n = args.batch_size * args.batches
    results = {}
    for name, seconds in cpu_seconds.items():
        m = meta[name]
        results[name] = {**m, "sequences_per_second": summarise([n / s for s in seconds]),
                         "tokens_per_second": summarise([m["tokens"] / s for s in seconds]),
                         "wall_sequences_per_second": summarise([n / s for s in wall_seconds[name]])}
    ratios = {}
    for name in configs:
        if name.startswith("mpnet-"):
            other = "minilm-" + name[len("mpnet-"):]
            if other in cpu_seconds:  # throughput ratio = inverse time ratio, per round
                ratios[name[len("mpnet-"):]] = paired_ratio(cpu_seconds[other], cpu_seconds[name])
    out = {
        "machine": machine_info(args.device), "clock": "process CPU time" if clock is time.process_time else "wall",
        "settings": {"threads": args.threads, "batch_size": args.batch_size, "batches": args.batches,
                     "rounds": args.rounds, "inputs": "SST-2 validation sentences, sorted by length"},
        "backbones": {k: meta[k] for k in BACKBONES}, "results": results,
        "mpnet_over_minilm_throughput": ratios,
    }
    stem = Path(args.out) if args.out else REPO / "bench" / "results" / f"tiers-{'cuda' if gpu else 'cpu'}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(out, indent=2) + "\n")
    text = markdown(out)
    stem.with_suffix(".md").write_text(text + "\n")
    print(text)


def markdown(out: dict) -> str:
    s = out["settings"]
    lines = [f"Batch {s['batch_size']}, {s['threads']} thread(s), {out['machine']['device']}, clock: {out['clock']}; "
             f"median of {s['rounds']} rounds (min-max).", "",
             "| backbone | precision | what runs | sequences/s | tokens/s | MPNet / MiniLM |",
             "| --- | --- | --- | ---: | ---: | ---: |"]
    for name, r in out["results"].items():
        key = name.split("-", 1)[1]
        ratio = out["mpnet_over_minilm_throughput"].get(key) if r["tier"] == "mpnet" else None
        what = "backbone only" if not r["modules"] else "backbone + " + ", ".join(r["modules"])
        seq, tok = r["sequences_per_second"], r["tokens_per_second"]
        lines.append(f"| {BACKBONES[r['tier']]} | {r['precision']} | {what} | {seq['median']:.1f} "
                     f"({seq['min']:.1f}-{seq['max']:.1f}) | {tok['median']:.0f} | "
                     + (f"{ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f})" if ratio else "") + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
