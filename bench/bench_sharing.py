#!/usr/bin/env python
"""One backbone pass for K heads: what does serving K tasks from one shared pass cost?

Measured in one run, as ratios between configurations timed side by side (DESIGN.md section 4):
- throughput: the backbone alone (streamed to its last state, no heads), K = 1..64 layer-mix heads
  served from one pass (`Engine.logits`: heads of one kind grouped, as served), and K separate full
  models (deep copies of the backbone, one head each: K passes) for K <= `--max-separate`;
- early exit: K = 4 heads that read only states 0..m, time against the full depth (ideal ~m/L);
- memory: peak live tensor bytes (torch profiler) of one call on a B x T batch, streaming against
  keeping every hidden state (the Hugging Face forward with output_hidden_states, as a tuple and
  stacked into one tensor as the reference layer-mix code does), each path in a fresh process.

Heads: `bench/random_heads.py` (random, seeded, k = 64, every state mixed: the worst case), saved to
a store and loaded with `load_module`, as the server does. Timed work is `Engine.logits` under the
heads' autocast, as the model runner runs a pass; tokenization is done once up front. Noise: every
round runs every configuration in a fresh random order, keeps the fastest of `--repeats`, and ratios
are taken per round (measured seconds apart), reported as median (min-max). With one torch thread
the clock is this process's CPU time (other jobs on the shared cores do not count), else wall time.

    .venv/bin/python bench/bench_sharing.py            # ~15 min on 2 shared cores -> sharing-cpu.{json,md}
    .venv/bin/python bench/bench_sharing.py --quick    # ~1 min -> sharing-cpu-quick.*
    .venv/bin/python bench/bench_sharing.py --precision bf16 --batch-sizes 32 --skip-memory --skip-early-exit --stem sharing-cpu-bf16
    .venv/bin/python bench/bench_sharing.py --head-precision int8 --skip-memory --skip-early-exit --stem sharing-cpu-int8

`--served` measures the shipped modules instead, over HTTP: one real `tmod-serve` per precision
(`--precisions`, one torch thread, the tasks of `--served-tasks`: opt-in ones named) stays up while every task set is sent
in turn, in a fresh random order each round: each single-text task alone (`embedding` alone is the
backbone's pass and its pooling: the baseline), the three tasks of the README's first request
(`ner,sentiment,acceptability`) and every shipped task at once. A measurement is `--served-texts` SST-2
validation sentences sent sequentially (one connection) in requests of B of them (`--batch-sizes`);
texts/s is taken on the server process's CPU time (all its threads: HTTP, tokenizing, the pass,
decoding, JSON), which other jobs on shared cores do not inflate, and on the wall clock beside it.
Ratios are per round (task sets measured seconds apart), median (min-max).

    .venv/bin/python bench/bench_sharing.py --served     # ~10 min -> bench/results/heads-cost-cpu.{json,md}

`--profile-head TASK[/VERSION]` splits one shipped layer-mix head's own work on a batch of SST-2
sentences (in process, one thread, CPU time, the fastest of `--repeats` per round, median over
rounds): the backbone's pass to its last state, then each part of the head on the states it reads:
the mix (projections, GELU, layer norm, weighted sum) per state, the casing embedding, the token
layer(s) (encoder layers, classifier) and decoding into answers; each as a share of the pass.

    .venv/bin/python bench/bench_sharing.py --profile-head ner --stem heads-profile-cpu
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.harness import machine_info, markdown_table, read_sst2_sentences, write_results  # noqa: E402
from bench.random_heads import build_modules, task_name  # noqa: E402
from training.data.files import default_data_dir  # noqa: E402

TARGET_K = 4  # DESIGN.md: K=4 shared >= 0.9x the backbone alone, >= 0.9*K x K separate models
TARGETS_MANY = {8: 0.88, 16: 0.8}  # issue 14, batch 32: K -> least ratio to the backbone alone
MEMORY_PATHS = ("stream_backbone_only", "stream_heads", "all_states_tuple_heads", "all_states_stacked_heads")


def interleaved_rounds(configs: dict, rounds: int, repeats: int, rng: random.Random, cpu_clock: bool) -> dict:
    """Seconds per round for every config (the fastest of `repeats`), configs shuffled every round;
    one warm-up call of each first (allocator, oneDNN kernels, plan cache)."""
    clock = time.process_time if cpu_clock else time.perf_counter
    for fn in configs.values():
        fn()
    times = {name: [] for name in configs}
    names = list(configs)
    for r in range(rounds):
        rng.shuffle(names)
        for name in names:
            runs = []
            for _ in range(repeats):
                t0 = clock()
                configs[name]()
                runs.append(clock() - t0)
            times[name].append(min(runs))
        print(f"  round {r + 1}/{rounds}", flush=True)
    return times


def paired_ratio(num: list[float], den: list[float]) -> dict:
    """Per-round ratios num[r] / den[r], as median, min and max."""
    ratios = [a / b for a, b in zip(num, den)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def shown(r: dict | None) -> str:
    return "" if r is None else f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"


def heads_autocast_run(fn, heads: str, backbone: str):
    from server.runner.precision import heads_autocast

    def run():
        with heads_autocast(heads, "cpu", backbone):
            return fn()
    return run


def throughput(bb, engine, modules, separate, batches, ks, args, rng) -> dict:
    def stream():
        for batch in batches:
            for _ in bb.stream(batch, upto=bb.num_layers):
                pass

    def shared(k):
        chosen = dict(list(modules.items())[:k])
        return lambda: [engine.logits(batch, chosen) for batch in batches]

    def apart(k):
        return lambda: [eng.logits(batch, mods) for batch in batches for eng, mods in separate[:k]]

    configs = {"backbone": stream, **{f"shared_K{k}": shared(k) for k in ks},
               **{f"separate_K{k}": apart(k) for k in ks if k <= len(separate)}}
    times = interleaved_rounds({name: heads_autocast_run(fn, args.head_precision, args.precision)
                                for name, fn in configs.items()}, args.rounds, args.repeats, rng, args.threads == 1)
    sequences = sum(b.size for b in batches)
    ratios = {}
    for k in ks:
        ratios[f"shared_K{k}_vs_backbone"] = paired_ratio(times["backbone"], times[f"shared_K{k}"])
        if f"separate_K{k}" in times:
            ratios[f"shared_K{k}_vs_separate_K{k}"] = paired_ratio(times[f"separate_K{k}"], times[f"shared_K{k}"])
    return {"sequences_per_run": sequences, "mean_padded_tokens": statistics.mean(b.seq_len for b in batches),
            "sequences_per_s": {name: statistics.median(sequences / t for t in ts) for name, ts in times.items()},
            "ratios": ratios}


def early_exit(bb, engine, store, batches, args, rng) -> dict:
    L = bb.num_layers
    configs = {}
    for m in range(L + 1):
        mods = build_modules(store, bb, TARGET_K, list(range(m + 1)), args.project_dim, args.seed, tag=f"-upto{m}")
        assert engine.plan(mods).deepest == m
        configs[f"upto{m}"] = heads_autocast_run(lambda mods=mods: [engine.logits(b, mods) for b in batches],
                                                 args.head_precision, args.precision)
    times = interleaved_rounds(configs, args.rounds, args.repeats, rng, args.threads == 1)
    return {"heads": TARGET_K, "num_layers": L, "rows": [
        {"deepest_state": m, "m_over_L": m / L, "time_vs_full_depth": paired_ratio(times[f"upto{m}"], times[f"upto{L}"])}
        for m in range(L + 1)]}


def profiler_peak_bytes(fn) -> int:
    """Peak live CPU tensor bytes allocated while `fn` runs, from torch.profiler's allocator events
    (each carries the running total allocated since profiling began)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    totals = []

    def walk(node):
        if node.tag == _EventType.Allocation:
            totals.append(node.extra_fields.total_allocated)
        for child in node.children:
            walk(child)
    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    return max(totals, default=0)


def memory_worker(args) -> None:
    """In a fresh process: one memory path's peak, printed as one JSON line."""
    from modules_store import ModuleStore
    from server.backbone import Backbone
    from server.engine import Engine, run_head

    torch.set_num_threads(args.threads)
    bb = Backbone.load()
    sentences = read_sst2_sentences(args.data_dir)
    texts = [" ".join(sentences[i * 12:(i + 1) * 12]) for i in range(args.memory_batch)]  # long enough for T
    batch = bb.tokenize(texts, truncate=True, max_tokens=args.memory_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        mods = build_modules(ModuleStore(tmp), bb, TARGET_K, None, args.project_dim, args.seed)
    engine = Engine(bb)

    @torch.inference_mode()
    def run():
        if args.memory_worker == "stream_backbone_only":
            for _ in bb.stream(batch):
                pass
        elif args.memory_worker == "stream_heads":
            engine.logits(batch, mods)
        else:
            states = bb.all_states(batch)
            if args.memory_worker == "all_states_stacked_heads":
                states = torch.stack(states)
            for m in mods.values():
                run_head(m.head, batch, states)

    run()  # warm-up
    print("MEMJSON " + json.dumps({"path": args.memory_worker, "batch": batch.size, "tokens": batch.seq_len,
                                   "peak_tensor_bytes": profiler_peak_bytes(run)}), flush=True)


def memory(args) -> dict:
    paths = {}
    for path in MEMORY_PATHS:
        done = subprocess.run([sys.executable, __file__, "--memory-worker", path, "--memory-batch", str(args.memory_batch),
                               "--memory-tokens", str(args.memory_tokens), "--project-dim", str(args.project_dim),
                               "--seed", str(args.seed), "--data-dir", str(args.data_dir), "--threads", str(args.threads)],
                              capture_output=True, text=True, cwd=REPO)
        line = next((x for x in done.stdout.splitlines() if x.startswith("MEMJSON ")), None)
        if done.returncode or line is None:
            raise SystemExit(f"memory worker {path} failed:\n{done.stdout}\n{done.stderr}")
        paths[path] = json.loads(line[len("MEMJSON "):])
    return {"batch": args.memory_batch, "tokens": args.memory_tokens, "heads": TARGET_K, "paths": paths}


SERVED_TRIO = "ner,sentiment,acceptability"  # the tasks issue 39's target names: >= 0.85x one task (batch 32)


def served_sets(tasks: dict) -> dict[str, str]:
    """Task sets to time, from /v1/tasks: each single-text task alone, the trio, all of them."""
    single = sorted(name for name, info in tasks.items() if info.get("inputs", "text") == "text")
    sets = {name: name for name in single}
    if all(t in single for t in SERVED_TRIO.split(",")):
        sets["trio"] = SERVED_TRIO
    sets["all"] = ",".join(single)
    return sets


def served(args) -> None:
    """Each shipped module's cost beside the backbone, over HTTP (the --served mode; see the docstring)."""
    import httpx

    from bench.harness import ServerProcess, proc_cpu_seconds, serve_command

    rng = random.Random(args.seed)
    machine = machine_info()
    sentences = read_sst2_sentences(args.data_dir)[:args.served_texts]
    result = {"benchmark": "heads-cost-served", "machine": machine, "settings": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "precisions": {}}
    tmp = Path(tempfile.mkdtemp(prefix="heads-cost-"))
    servers = {}
    try:
        for precision in args.precisions:
            env = {"TMOD_STORE": str(args.store), "TMOD_PRECISION": precision, "TMOD_THREADS": str(args.threads),
                   **({"TMOD_TASKS": args.served_tasks} if args.served_tasks else {})}
            servers[precision] = ServerProcess(precision, env, tmp / f"{precision}.log", serve_command())
            servers[precision].start()
        for server in servers.values():
            server.wait_ready(300)
        clients = {p: httpx.Client(base_url=s.url, timeout=120) for p, s in servers.items()}
        tasks = {t["task"]: t for t in clients[args.precisions[0]].get("/v1/tasks").json()["tasks"]}
        sets = served_sets(tasks)
        result["versions"] = {name: t.get("version") for name, t in tasks.items()}
        result["sets"] = sets
        headers = {"content-type": "application/json"}

        def run(precision: str, tasks_param: str, size: int) -> tuple[float, float]:
            bodies = [json.dumps({"inputs": sentences[i:i + size]}).encode() for i in range(0, len(sentences), size)]
            client, pid = clients[precision], servers[precision].proc.pid
            cpu0, t0 = proc_cpu_seconds(pid), time.perf_counter()
            for body in bodies:
                r = client.post("/v1/infer?tasks=" + tasks_param, content=body, headers=headers)
                if r.status_code != 200:
                    raise SystemExit(f"{precision} {tasks_param}: HTTP {r.status_code} {r.text[:300]}")
            wall, cpu = time.perf_counter() - t0, proc_cpu_seconds(pid) - cpu0
            return len(sentences) / cpu, len(sentences) / wall

        for precision in args.precisions:
            for size in args.batch_sizes:  # warm-up: every set once (oneDNN kernels, plan cache)
                for tasks_param in sets.values():
                    run(precision, tasks_param, size)
        for precision in args.precisions:
            out = result["precisions"][precision] = {}
            for size in args.batch_sizes:
                cpu = {name: [] for name in sets}
                wall = {name: [] for name in sets}
                names = list(sets)
                for r in range(args.rounds):
                    rng.shuffle(names)
                    for name in names:
                        c, w = run(precision, sets[name], size)
                        cpu[name].append(c)
                        wall[name].append(w)
                    print(f"  {precision} batch {size}: round {r + 1}/{args.rounds}", flush=True)
                base = "embedding" if "embedding" in sets else names[0]
                one = {name: statistics.median(v) for name, v in cpu.items()}
                out[str(size)] = {
                    "texts_per_cpu_s": one,
                    "texts_per_wall_s": {name: statistics.median(v) for name, v in wall.items()},
                    "vs_backbone_alone": {name: paired_ratio(cpu[name], cpu[base]) for name in sets},
                    "rounds_texts_per_cpu_s": cpu,
                }
                if "trio" in sets:
                    out[str(size)]["trio_vs_each_task_alone"] = {
                        t: paired_ratio(cpu["trio"], cpu[t]) for t in SERVED_TRIO.split(",")}
    finally:
        for server in servers.values():
            server.stop()
    tables = []
    for precision, section in result["precisions"].items():
        for size, row in section.items():
            lines = [[name, f"`{sets[name]}`" if name in ("trio", "all") else f"`{result['versions'].get(name)}`",
                      f"{row['texts_per_cpu_s'][name]:.1f}", f"{row['texts_per_wall_s'][name]:.1f}",
                      shown(row["vs_backbone_alone"][name])] for name in sets]
            text = markdown_table(["tasks", "version / set", "texts per server CPU s", "texts per wall s",
                                   "vs `embedding` alone (the backbone)"], lines)
            if "trio_vs_each_task_alone" in row:
                text += "\n\nThe trio against each of its tasks alone: " + ", ".join(
                    f"{t} {shown(v)}" for t, v in row["trio_vs_each_task_alone"].items())
            tables.append(f"{precision}, batch {size} (texts per request), one torch thread:\n\n" + text)
    notes = ("Target (issue 39): the trio at >= 0.85x the texts/s of one task, batch 32, fp32. "
             "Ratios: median (min-max) over rounds, on the server's CPU time.")
    path = write_results(args.stem, result, "Each shipped module's cost beside the backbone (over HTTP)", tables, notes)
    print(path.with_suffix(".md").read_text())


def profile_head(args) -> None:
    """One head's parts against the backbone's pass (the --profile-head mode; see the docstring)."""
    import torch.nn.functional as F

    from modules_store import ModuleStore
    from server.answers import decode_all
    from server.backbone import Backbone
    from server.engine import Engine
    from server.heads.layermix.layer import MIX_NORM_EPS
    from server.modules import load_module

    torch.set_num_threads(args.threads)
    task, _, version = args.profile_head.partition("/")
    bb = Backbone.load()
    if args.precision != "fp32":
        bb = bb.use_backend("torch", args.precision)
    module = load_module(ModuleStore(args.store), task, version or None, bb)
    head = module.head
    size = max(args.batch_sizes)
    batch = bb.tokenize(read_sst2_sentences(args.data_dir)[:size])
    with torch.inference_mode():
        states = {i: h.float() for i, h in bb.stream(batch, upto=bb.num_layers)}
        weights = head.mix_weights()
        read = head.layers_read()
        engine = Engine(bb)

        def mix_one(i):
            return lambda: weights[head._slot[i]] * F.layer_norm(
                F.gelu(states[i]) @ head.projection(i).T, (head.config.project_dim,), eps=MIX_NORM_EPS)
        mixed = F.gelu(sum(mix_one(i)() for i in read))
        casing = (lambda: head.casing(batch.token_classes("casing"))) if head.casing is not None else None
        layer_input = mixed + casing() if casing else mixed
        logits, batches = engine.run(batch, {task: module})
        configs = {
            "backbone_pass": lambda: [None for _ in bb.stream(batch, upto=bb.num_layers)],
            "whole_pass_with_head": lambda: engine.run(batch, {task: module}),
            **{f"mix_state_{i}": mix_one(i) for i in read},
            **({"casing_embedding": casing} if casing else {}),
            "token_layers_and_classifier": lambda: head.classifier(layer_input, batch.attention_mask),
            "decode_answers": lambda: decode_all({task: module}, logits, batches),
        }
        times = interleaved_rounds(configs, args.rounds, args.repeats, random.Random(args.seed), args.threads == 1)
    base = statistics.median(times["backbone_pass"])
    parts = {name: {"ms": 1000 * statistics.median(t), "share_of_backbone_pass": statistics.median(t) / base}
             for name, t in times.items()}
    result = {"benchmark": "head-profile", "task": task, "version": module.version, "layers_read": read,
              "config": head.config.model_dump(mode="json"), "batch": list(batch.input_ids.shape),
              "precision": args.precision, "parts": parts, "machine": machine_info()}
    rows = [[name, f"{p['ms']:.1f}", f"{100 * p['share_of_backbone_pass']:.1f}%"] for name, p in parts.items()]
    table = markdown_table(["part", "ms (CPU, median)", "of the backbone's pass"], rows)
    path = write_results(args.stem, result, f"What `{task}/{module.version}` costs, part by part", [
        f"Batch {batch.input_ids.shape[0]} x {batch.input_ids.shape[1]} word pieces, {args.precision}, one thread; "
        f"reads states {read}:\n\n" + table])
    print(path.with_suffix(".md").read_text())


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_sharing.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 rounds of 1, memory at 16 x 64; writes <stem>-quick")
    p.add_argument("--data-dir", type=Path, default=default_data_dir(), help="holds sst2/validation.tsv")
    p.add_argument("--stem", default="sharing-cpu", help="results stem under bench/results/ (or a path)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 5, quick 2)")
    p.add_argument("--repeats", type=int, help="runs per config and round, the fastest kept (default 2, quick 1)")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="numbers of heads K")
    p.add_argument("--max-separate", type=int, default=8, help="time K separate models up to this K")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32],
                   help="sentences per batch, a throughput table each (default 1 32; --served: per request; "
                        "--profile-head: the largest only)")
    p.add_argument("--project-dim", type=int, default=64, help="k of every head")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the CPU clock is used)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="the backbone's precision")
    p.add_argument("--head-precision", choices=["fp32", "bf16", "int8"], help="the heads' (default --precision)")
    p.add_argument("--seed", type=int, default=0, help="random heads and the order of each round")
    p.add_argument("--early-exit-batch", type=int, default=32, help="sentences in the early-exit batch")
    p.add_argument("--memory-batch", type=int, help="B of the memory comparison (default 64, quick 16)")
    p.add_argument("--memory-tokens", type=int, help="T of the memory comparison (default 128, quick 64)")
    p.add_argument("--skip-memory", action="store_true", help="leave out the memory comparison")
    p.add_argument("--skip-early-exit", action="store_true", help="leave out the early-exit timing")
    p.add_argument("--memory-worker", help=argparse.SUPPRESS)
    p.add_argument("--served", action="store_true", help="the shipped modules over HTTP instead (docstring)")
    p.add_argument("--store", type=Path, default=REPO / "modules_store", help="--served: the store to serve")
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], help="--served: one server each")
    p.add_argument("--served-texts", type=int, default=256, help="--served: sentences per measurement")
    p.add_argument("--served-tasks", default="acceptability,embedding,emotion,ner,sentiment",
                   help="--served: the tasks the servers load (opt-in ones must be named; '' = the store's defaults)")
    p.add_argument("--profile-head", help="TASK[/VERSION]: one shipped head's parts against the pass (docstring)")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.repeats = args.repeats or (1 if args.quick else 2)
    args.memory_batch = args.memory_batch or (16 if args.quick else 64)
    args.memory_tokens = args.memory_tokens or (64 if args.quick else 128)
    args.head_precision = args.head_precision or args.precision
    if args.served:
        args.rounds = args.rounds if "--rounds" in (argv or sys.argv) else 3
        if args.stem == "sharing-cpu":
            args.stem = "heads-cost-cpu" + ("-quick" if args.quick else "")
        if args.quick:
            args.served_texts = min(args.served_texts, 64)
    elif args.quick and args.stem == "sharing-cpu":
        args.stem = "sharing-cpu-quick"
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.memory_worker:
        return memory_worker(args)
    if args.served:
        return served(args)
    if args.profile_head:
        return profile_head(args)
    machine = machine_info()  # the load average before this run adds to it
    torch.set_num_threads(args.threads)
    from modules_store import ModuleStore
    from server.backbone import Backbone
    from server.engine import Engine
    from server.host_memory import keep_freed_memory
    from server.modules import load_module

    keep_freed_memory()  # as tmod-serve does on a CPU
    rng = random.Random(args.seed)
    bb = Backbone.load()
    sentences = read_sst2_sentences(args.data_dir)
    ks = sorted(set(args.ks))
    result = {"benchmark": "sharing", "machine": machine, "settings": {k: str(v) if isinstance(v, Path) else v
                                                                      for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory() as tmp:
        store = ModuleStore(tmp)
        modules = build_modules(store, bb, max(ks), None, args.project_dim, args.seed)
        copies = [Backbone(copy.deepcopy(bb.model), bb.tokenizer, name=bb.name)
                  for _ in range(min(max(ks), args.max_separate))]
        separate = [(Engine(c), {task_name(i): load_module(store, task_name(i), None, c)}) for i, c in enumerate(copies)]
        check = bb.tokenize(sentences[:8])  # shared and separate serving give the same logits (fp32)
        shared_logits = Engine(bb).logits(check, modules)
        for eng, mods in separate:
            for task, logits in eng.logits(check, mods).items():
                assert torch.allclose(logits, shared_logits[task], atol=1e-4), task
        int8 = args.head_precision == "int8"
        if args.precision != "fp32":  # timed from here on as served: the backbone's 16-bit layers
            bb = bb.use_backend("torch", args.precision)
            separate = [(Engine(eng.backbone.use_backend("torch", args.precision), int8=int8), mods)
                        for eng, mods in separate]
        engine = Engine(bb, int8=int8)
        result["throughput"] = {}
        for size in args.batch_sizes:
            texts = sentences[:max(32, size)]
            batches = [bb.tokenize(texts[i:i + size]) for i in range(0, len(texts), size)]
            print(f"throughput, batch size {size}", flush=True)
            result["throughput"][str(size)] = throughput(bb, engine, modules, separate, batches, ks, args, rng)
        del separate, copies
        if not args.skip_early_exit:
            print("early exit", flush=True)
            batches = [bb.tokenize(sentences[:args.early_exit_batch])]
            result["early_exit"] = early_exit(bb, engine, store, batches, args, rng)
    if not args.skip_memory:
        print("memory", flush=True)
        result["memory"] = memory(args)

    tables = []
    for size, section in result["throughput"].items():
        r = section["ratios"]
        tables.append(f"Batch {size}, {args.precision} backbone, {args.head_precision} heads; backbone alone "
                      f"{section['sequences_per_s']['backbone']:.1f} seq/s:\n\n" + markdown_table(
                          ["K", "shared / backbone alone", "shared / K separate models"],
                          [[k, shown(r[f"shared_K{k}_vs_backbone"]), shown(r.get(f"shared_K{k}_vs_separate_K{k}"))]
                           for k in ks]))
    if "early_exit" in result:
        tables.append("Early exit (K = 4, heads read states 0..m):\n\n" + markdown_table(
            ["m", "m / L", "time / full depth"], [[row["deepest_state"], f"{row['m_over_L']:.2f}",
                                                   shown(row["time_vs_full_depth"])] for row in result["early_exit"]["rows"]]))
    if "memory" in result:
        paths = result["memory"]["paths"]
        tables.append(f"Peak live tensors, B = {args.memory_batch}, T = {args.memory_tokens}, K = 4:\n\n" + markdown_table(
            ["path", "MiB"], [[path, f"{paths[path]['peak_tensor_bytes'] / 2**20:.0f}"] for path in MEMORY_PATHS]))
    targets = f"Targets: K={TARGET_K} >= 0.9x the backbone alone and >= {0.9 * TARGET_K:.1f}x {TARGET_K} separate models; " + \
        ", ".join(f"K={k} >= {v}x" for k, v in TARGETS_MANY.items()) + " (batch 32). Ratios: median (min-max) over rounds."
    path = write_results(args.stem, result, "One backbone pass for K heads", tables, targets)
    print((path.with_suffix(".md")).read_text())


if __name__ == "__main__":
    main()
