#!/usr/bin/env python
"""Benchmark: what does serving K tasks from one shared backbone pass cost?

Measured in ONE run on this machine, as ratios between configurations timed side by side:

* backbone alone: the streaming path to the last layer with no heads (the reference for the
  target), plus the Hugging Face forward (with and without output_hidden_states) for comparison;
* K = 1, 2, 4, 8, 16, 32, 64 layer-mix heads served from one shared streaming pass (Engine.logits:
  heads of one kind grouped, their weights stacked and run as batched products; K = 4, 8, 16 also
  with Engine(fuse=False), every head on its own);
* K separate full models, each a deep copy of the backbone with one head (K backbone passes), for
  K <= 8 (--max-separate);
* early exit: K = 4 heads that read only states 0..m, engine time against m / L;
* peak activation memory of the streaming path against keeping every hidden state (HF forward
  with output_hidden_states=True, mixed from the tuple, and the same stacked into one tensor as
  the reference layer-mix code does), for a large batch, each path in a fresh subprocess.

Noise control: the machine is shared (2 cores, other jobs may run). Every timing "round" runs
every configuration once, in a freshly shuffled order; the ratios are computed per round from
measurements taken seconds apart and summarised by their median (with min/max). Throughputs are
medians over rounds.

Heads (bench/random_heads.py, which bench_gpu.py can reuse): random weights (seeded), k = 64, every
state 0..L mixed (cutoff 0, so nothing is skipped); even-numbered heads are sequence classifiers (2
labels, SST-2 style: one self-attention layer, masked mean pooling, linear), odd-numbered ones token
classifiers (9 CoNLL-2003 BIO labels: one pre-LN encoder layer, FFN 256, linear). Each head is saved
to a temporary module store and loaded back with `load_module`, the path the server uses. Timed work is `Engine.logits` (backbone + heads
to logits); tokenization and decoding are excluded (both are the same for every configuration
of shared serving; batches are tokenized once up front).

    .venv/bin/python bench/bench_sharing.py            # full run, ~15 min on 2 shared cores
    .venv/bin/python bench/bench_sharing.py --quick    # smoke run, ~1 min, *-quick.* outputs
"""
from __future__ import annotations

import argparse
import copy
import datetime as dt
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.environment import machine_info, read_sst2_sentences as read_sentences  # noqa: E402
from bench.random_heads import build_modules, task_name  # noqa: E402  (bench_backends imports build_modules from here)
from training.data import default_data_dir  # noqa: E402

import torch  # noqa: E402

TARGET_SHARED_VS_BACKBONE = 0.9  # DESIGN.md section 4: K=4 heads >= 0.9x backbone-only throughput
TARGET_K = 4
# issue 14 (many tasks per pass), batch 32, every head reading all states: K -> least throughput ratio
TARGETS_MANY = {8: 0.88, 16: 0.8}
UNFUSED_KS = (4, 8, 16)
OTHER_HEADS_KS = (1, 4, 16)  # heads in another precision than --head-precision: also timed with these K


# ---------------------------------------------------------------------------------------------
# setup
# ---------------------------------------------------------------------------------------------
def sparse_layers(i: int, num_layers: int) -> list[int]:
    """The states head i reads in the 'sparse' variant: 3 of the L+1, as a trained head whose layer
    distribution the cutoff has pruned might (one middle state that differs between heads, plus the
    last two). For L = 6: {2,5,6}, {3,5,6}, {4,5,6}, {2,5,6}, ..."""
    return sorted({max(0, num_layers // 2 - 1 + i % 3), max(0, num_layers - 1), num_layers})


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
def interleaved_rounds(configs: dict, rounds: int, repeats: int, rng: random.Random, label: str) -> dict[str, dict]:
    """Run every config `repeats` times per round, configs in a freshly shuffled order each round;
    return, per config, one time per round: the minimum over that round's repeats (interruptions
    only ever add time). Two clocks: "wall" (time.perf_counter) and "cpu" (time.process_time: CPU
    time of this process, all threads; with one torch thread this is what the work costs on a core
    of its own, and it does not count time the scheduler gave to other jobs on the shared machine).

    One warm-up run of each config first (allocator, oneDNN kernels, plan cache).
    """
    for fn in configs.values():
        fn()
    times = {"wall": {name: [] for name in configs}, "cpu": {name: [] for name in configs}}
    names = list(configs)
    t_start = time.perf_counter()
    for r in range(rounds):
        rng.shuffle(names)
        for name in names:
            wall, cpu = [], []
            for _ in range(repeats):
                c0, t0 = time.process_time(), time.perf_counter()
                configs[name]()
                t1, c1 = time.perf_counter(), time.process_time()
                wall.append(t1 - t0)
                cpu.append(c1 - c0)
            times["wall"][name].append(min(wall))
            times["cpu"][name].append(min(cpu))
        print(f"  [{label}] round {r + 1}/{rounds} done ({time.perf_counter() - t_start:.0f}s)", flush=True)
    return times


def under(precision, fn):
    """fn run under the heads' precision as ModelRunner runs a pass (`heads_autocast`); `precision`
    is a `Precision`."""
    from server.runner import heads_autocast

    def run():
        with heads_autocast(precision.heads, "cpu", precision.backbone):
            return fn()
    return run


@dataclass(frozen=True)
class Precision:
    backbone: str = "fp32"
    heads: str = "fp32"

    def other_heads(self) -> list[str]:
        """Head precisions timed beside these heads for comparison: fp32, and the backbone's own."""
        return [p for p in dict.fromkeys(("fp32", self.backbone)) if p != self.heads]


def summarise(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def paired_ratio(num: list[float], den: list[float]) -> dict:
    """Per-round ratios num[r]/den[r] (both measured in the same round), summarised."""
    return summarise([a / b for a, b in zip(num, den)])


def throughput_section(bb, engine, engine_unfused, shared_mods, sparse_mods, separate, batches, ks, rounds,
                       repeats, rng, label, clock, precision: Precision = Precision(), other_engine=None) -> dict:
    """seq/s of every configuration for one batch size, and the ratios between them. Every timed
    run is under the heads' autocast, as ModelRunner runs a pass; the Hugging Face references
    run in fp32 only. `other_engine` (fp32 projections) times K heads in `precision.other_heads()`."""
    n_seq = sum(b.size for b in batches)
    L = bb.num_layers
    timings = {}  # Engine's own backbone/heads split, summed over the timed runs

    def run_stream():
        for batch in batches:
            for _ in bb.stream(batch, upto=L):
                pass

    def hf_kwargs(batch):
        kw = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        if batch.token_type_ids is not None:
            kw["token_type_ids"] = batch.token_type_ids
        return kw

    @torch.inference_mode()
    def run_hf():
        for batch in batches:
            bb.model(**hf_kwargs(batch))

    def run_hf_all():
        for batch in batches:
            bb.all_states(batch)

    def shared(k, eng, tag, pool=shared_mods):
        from server.engine import Timings
        mods = dict(list(pool.items())[:k])
        acc = timings.setdefault(tag, Timings())

        def run():
            for batch in batches:
                eng.logits(batch, mods, acc)
        return run

    def separate_run(k):
        def run():
            for batch in batches:
                for eng, mods in separate[:k]:
                    eng.logits(batch, mods)
        return run

    configs = {"backbone_stream": run_stream}
    if precision.backbone == "fp32":
        configs.update(hf_forward=run_hf, hf_forward_all_states=run_hf_all)
    for k in ks:
        configs[f"shared_K{k}"] = shared(k, engine, f"shared_K{k}")
    for k in ks:
        if k in UNFUSED_KS:
            configs[f"shared_K{k}_unfused"] = shared(k, engine_unfused, f"shared_K{k}_unfused")
        if k in (4, 8):
            configs[f"shared_K{k}_sparse"] = shared(k, engine, f"shared_K{k}_sparse", sparse_mods)
    for k in ks:
        if k <= len(separate):
            configs[f"separate_K{k}"] = separate_run(k)
    timed = {name: under(precision, fn) for name, fn in configs.items()}
    for heads in precision.other_heads():  # the same heads in the precisions one could choose instead
        for k in (k for k in ks if k in OTHER_HEADS_KS):
            name = f"shared_K{k}_{heads}heads"
            timed[name] = under(replace(precision, heads=heads), shared(k, other_engine, name))

    both = interleaved_rounds(timed, rounds, repeats, rng, label)

    def analyse(times: dict) -> dict:
        res = {"configs": {}, "ratios": {}}
        for name, ts in times.items():
            entry = {"seconds_per_run": summarise(ts), "sequences_per_s": summarise([n_seq / t for t in ts])}
            if name in timings:  # the Engine's own split (includes the warm-up run; fractions only)
                t = timings[name]
                entry["engine_split"] = {"heads_fraction_of_engine_time": t.heads / max(t.heads + t.backbone, 1e-12)}
            res["configs"][name] = entry
        base = times["backbone_stream"]
        ratios = res["ratios"]
        for k in ks:
            sk = times[f"shared_K{k}"]
            # throughput ratio = inverse time ratio, per round
            ratios[f"shared_K{k}_vs_backbone"] = paired_ratio(base, sk)
            if f"separate_K{k}" in times:
                ratios[f"shared_K{k}_vs_separate_K{k}"] = paired_ratio(times[f"separate_K{k}"], sk)
                ratios[f"separate_K{k}_vs_backbone"] = paired_ratio(base, times[f"separate_K{k}"])
            for variant in ("unfused", "sparse", *(f"{p}heads" for p in ("fp32", "bf16", "int8"))):
                if f"shared_K{k}_{variant}" in times:
                    ratios[f"shared_K{k}_{variant}_vs_backbone"] = paired_ratio(base, times[f"shared_K{k}_{variant}"])
        for name in ("hf_forward", "hf_forward_all_states"):
            if name in times:
                ratios[f"{name}_vs_backbone_stream"] = paired_ratio(base, times[name])
        return res

    out = {"sequences_per_run": n_seq, "clock": clock}
    out.update(analyse(both[clock]))
    other = "wall" if clock == "cpu" else "cpu"
    out[f"{other}_clock"] = analyse(both[other])
    return out


def early_exit_section(bb, engine, store, batches, k, project_dim, seed, rounds, repeats, rng, label,
                       clock, precision: Precision = Precision()) -> dict:
    L = bb.num_layers
    configs, mods_by_m = {}, {}
    for m in range(L + 1):
        mods = build_modules(store, bb, k, list(range(m + 1)), project_dim, seed, tag=f"-upto{m}")
        plan = engine.plan(mods)
        assert plan.deepest == m, plan.describe()
        mods_by_m[m] = mods

        def heads_run(mods=mods):
            for batch in batches:
                engine.logits(batch, mods)

        def stream_run(m=m):
            for batch in batches:
                for _ in bb.stream(batch, upto=m):
                    pass
        configs[f"heads_upto{m}"] = heads_run
        configs[f"stream_upto{m}"] = stream_run
    times = interleaved_rounds({name: under(precision, fn) for name, fn in configs.items()}, rounds, repeats, rng,
                               label)[clock]
    n_seq = sum(b.size for b in batches)
    rows = []
    for m in range(L + 1):
        rows.append({
            "deepest_state_m": m,
            "m_over_L": m / L,
            "heads_seconds_per_run": summarise(times[f"heads_upto{m}"]),
            "heads_sequences_per_s": statistics.median(n_seq / t for t in times[f"heads_upto{m}"]),
            "heads_time_vs_full_depth": paired_ratio(times[f"heads_upto{m}"], times[f"heads_upto{L}"]),
            "stream_time_vs_full_depth": paired_ratio(times[f"stream_upto{m}"], times[f"stream_upto{L}"]),
        })
    return {"heads": k, "num_layers_L": L, "sequences_per_run": n_seq, "clock": clock, "rows": rows,
            "note": "state 0 is the embedding output (no transformer layer run); m = deepest state read. "
                    "Ideal scaling is time(m)/time(L) ~= (embed + m*layer)/(embed + L*layer), i.e. ~m/L plus "
                    "the embedding's and the heads' fixed share."}


def run_plan(plan, batch, states) -> dict:
    """The plan's groups and heads fed from states already at hand, as Engine.run feeds them."""
    modules = plan.modules
    run = {t: modules[t].head.start(batch) for t in plan.single}
    groups = [group.start(batch) for group in plan.groups]
    for index in plan.layers:
        step = plan.steps[index]
        for g in step.groups:
            groups[g] = plan.groups[g].consume(groups[g], index, states[index])
        for t in step.single:
            run[t] = modules[t].head.consume(run[t], index, states[index])
    out = {t: modules[t].head.finish(run[t], batch) for t in plan.single}
    for group, state in zip(plan.groups, groups):
        out.update(group.finish(state, batch))
    return out


def profile_section(bb, engine, mods, batch, k: int, calls: int = 3, precision: Precision = Precision()) -> dict:
    """Where the heads' time goes, K heads on one batch: the heads' own work (the plan's groups and
    heads fed the streamed states, as Engine.run feeds them) profiled with torch.profiler, per op;
    and its CPU time against the backbone stream alone (fastest of `calls`, unprofiled)."""
    from torch.profiler import ProfilerActivity, profile

    plan = engine.plan(dict(list(mods.items())[:k]))
    with torch.inference_mode():
        states = [hidden.clone() for _, hidden in bb.stream(batch, upto=plan.deepest)]

    def stream():
        with torch.inference_mode():
            for _ in bb.stream(batch, upto=plan.deepest):
                pass

    @torch.inference_mode()
    def heads():
        return run_plan(plan, batch, states)
    stream, heads = under(precision, stream), under(precision, heads)

    def fastest(fn) -> float:
        fn()
        times = []
        for _ in range(calls):
            t0 = time.process_time()
            fn()
            times.append(time.process_time() - t0)
        return min(times)
    backbone_s, heads_s = fastest(stream), fastest(heads)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            heads()
    ops = sorted(((e.key, e.self_cpu_time_total) for e in prof.key_averages()), key=lambda kv: -kv[1])
    total = sum(t for _, t in ops)
    return {
        "heads": k, "batch": batch.size, "tokens": batch.seq_len, "calls": calls,
        "backbone_stream_cpu_seconds": backbone_s, "heads_cpu_seconds": heads_s,
        "heads_vs_backbone": heads_s / backbone_s,
        "ops": [{"op": op, "share_of_heads": t / total} for op, t in ops[:12]],
        "note": "self CPU time per op of the heads' work under torch.profiler; aten::mm (aten::_int_mm with int8 "
                "heads) is the fused per-state projection of the layer-mix heads (GELU(hidden) @ their concatenated "
                "projections), aten::bmm and aten::baddbmm the stacked classifiers' matrix products",
    }


# ---------------------------------------------------------------------------------------------
# memory (one fresh subprocess per path)
# ---------------------------------------------------------------------------------------------
MEMORY_PATHS = {
    "stream_backbone_only": "Backbone.stream to the last state, no heads (each state dropped as the next is made)",
    "stream_heads": "Engine.logits with the K heads: one backbone pass streaming into (B,T,k) running buffers",
    "all_states_tuple_heads": "HF forward with output_hidden_states=True (all L+1 states kept), then the same "
                              "heads/plan mixed from the tuple",
    "all_states_stacked_heads": "as above, then torch.stack(states) into one (L+1,B,T,H) tensor (as the reference "
                                "layer-mix code does) and mixed from the stack",
}


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: reset VmHWM to the current RSS
        return True
    except OSError:
        return False


def _profiler_peak(fn) -> tuple[int, int]:
    """Peak and net bytes of live CPU tensor storage allocated while `fn` runs, from the torch
    profiler's allocator events (profile_memory=True): each allocation/free event carries the
    running total allocated since profiling started; the peak is its maximum."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []

    def walk(node):
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.total_allocated))
        for child in node.children:
            walk(child)
    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    events.sort()
    if not events:
        return 0, 0
    return max(total for _, total in events), events[-1][1]


def memory_worker(args) -> None:
    """Runs in a subprocess: one memory path, prints one JSON line."""
    from server.backbone import Backbone
    from server.engine import Engine
    from modules_store import ModuleStore

    if args.threads:
        torch.set_num_threads(args.threads)
    bb = Backbone.load()
    L = bb.num_layers
    texts = make_long_texts(read_sentences(args.data_dir), args.memory_batch)
    batch = bb.tokenize(texts, truncate=True, max_tokens=args.memory_tokens)
    assert batch.seq_len == args.memory_tokens, batch.seq_len
    small = bb.tokenize(texts[:2], truncate=True, max_tokens=args.memory_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        store = ModuleStore(tmp)
        mods = build_modules(store, bb, args.memory_heads, list(range(L + 1)), args.project_dim, args.seed)
    engine = Engine(bb)
    plan = engine.plan(mods)
    path = args.memory_worker

    @torch.inference_mode()
    def mix_from(states, b):
        return run_plan(plan, b, states)

    def run(b):
        if path == "stream_backbone_only":
            with torch.inference_mode():
                for _ in bb.stream(b):
                    pass
            return None
        if path == "stream_heads":
            return engine.logits(b, mods)
        if path == "all_states_tuple_heads":
            return mix_from(bb.all_states(b), b)
        if path == "all_states_stacked_heads":
            states = bb.all_states(b)
            with torch.inference_mode():
                stacked = torch.stack(states)
            del states
            return mix_from(stacked, b)
        raise SystemExit(f"unknown memory path {path}")

    run(small)  # warm-up: kernels, plan; small so little freed heap is left to reuse
    gc.collect()
    rss_before = _vm("VmRSS")
    reset_ok = _reset_peak_rss()
    out = run(batch)
    hwm = _vm("VmHWM")
    del out
    gc.collect()
    peak_bytes, net_bytes = _profiler_peak(lambda: run(batch))
    print("MEMJSON " + json.dumps({
        "path": path, "batch": batch.size, "tokens": batch.seq_len,
        "profiler_peak_tensor_bytes": peak_bytes, "profiler_net_tensor_bytes": net_bytes,
        "rss_before_bytes": rss_before, "peak_rss_delta_bytes": (hwm - rss_before) if reset_ok else None,
        "peak_rss_reset_supported": reset_ok,
    }), flush=True)


def make_long_texts(sentences: list[str], count: int) -> list[str]:
    """`count` texts, each several consecutive SST-2 sentences joined, long enough to fill T tokens."""
    texts, i = [], 0
    for _ in range(count):
        parts = []
        while sum(len(p.split()) for p in parts) < 200:
            parts.append(sentences[i % len(sentences)])
            i += 1
        texts.append(" ".join(parts))
    return texts


def memory_section(args, L: int, H: int) -> dict:
    results = {}
    for path in MEMORY_PATHS:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--memory-worker", path,
               "--memory-batch", str(args.memory_batch), "--memory-tokens", str(args.memory_tokens),
               "--memory-heads", str(args.memory_heads), "--project-dim", str(args.project_dim),
               "--seed", str(args.seed), "--data-dir", str(args.data_dir), "--threads", str(args.threads)]
        print(f"  [memory] {path} ...", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("MEMJSON ")), None)
        if proc.returncode != 0 or line is None:
            raise SystemExit(f"memory worker {path} failed:\n{proc.stdout}\n{proc.stderr}")
        results[path] = json.loads(line[len("MEMJSON "):])
        results[path]["description"] = MEMORY_PATHS[path]
    B, T, k, K = args.memory_batch, args.memory_tokens, args.project_dim, args.memory_heads
    f32 = 4
    analytic = {
        "one_hidden_state_BTH_bytes": B * T * H * f32,
        "all_states_(L+1)BTH_bytes": (L + 1) * B * T * H * f32,
        "running_buffers_K*BTk_bytes": K * B * T * k * f32,
    }
    base = results["stream_backbone_only"]["profiler_peak_tensor_bytes"]
    for path, r in results.items():
        r["profiler_peak_over_backbone_stream_bytes"] = r["profiler_peak_tensor_bytes"] - base
    return {
        "batch": B, "tokens": T, "heads": K, "project_dim_k": k, "num_layers_L": L, "hidden_H": H,
        "method": (
            "Each path runs in a fresh subprocess (same backbone, same K random heads, same B x T batch of "
            "real SST-2 text joined and truncated to exactly T tokens), after one warm-up call on a 2-row batch. "
            "Primary number: profiler_peak_tensor_bytes = the peak of live CPU tensor storage allocated during "
            "one call, read from torch.profiler(profile_memory=True) allocator events (each event carries the "
            "running total allocated since the call started; weights and inputs allocated before are not "
            "counted). It sees every allocation through c10's CPU allocator (all tensors, incl. the returned "
            "logits) but not library scratch memory allocated outside it. Cross-check: peak_rss_delta_bytes = "
            "VmHWM - VmRSS around one call, with VmHWM reset via /proc/self/clear_refs; this is what the OS "
            "sees, but the allocator may reuse pages freed by the warm-up, so it can under-count slightly."
        ),
        "analytic": analytic,
        "paths": results,
    }


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def fmt_ratio(r: dict) -> str:
    return f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"Measured {result['date_utc']} on {result['machine']['cpu_model']} "
        f"({result['machine']['logical_cpus']} logical CPUs, torch threads {s['torch_threads']}, "
        f"load average at start {', '.join(f'{x:.2f}' for x in result['machine']['load_average_at_start_1_5_15min'])}), "
        f"torch {result['machine']['versions']['torch']}, precision {s.get('precision', 'fp32')}, "
        f"heads {s.get('head_precision', s.get('precision', 'fp32'))}"
        f"{' (glibc keeps freed memory, as tmod-serve on a CPU)' if s.get('host_memory_kept') else ''}, backbone {s['backbone']} "
        f"(L={s['num_layers']}, H={s['hidden_size']}), heads: layer-mix k={s['project_dim']}, all states "
        f"0..{s['num_layers']}, alternating sequence / token classifiers, random weights. "
        f"Median over {s['rounds']} interleaved rounds (each: fastest of {s['repeats_per_round_min_taken']} "
        f"back-to-back runs); ratios are per-round (min-max in brackets). "
        f"Throughput ratio > 1 means faster. Clock: {s['clock']} "
        f"({'CPU time of the benchmark process, so other jobs on the shared cores do not count' if s['clock'] == 'cpu' else 'elapsed time'}; "
        f"the other clock's numbers are in the JSON).",
        "",
    ]
    for bs, sec in result["throughput"].items():
        r = sec["ratios"]
        c = sec["configs"]
        lines += [
            f"**Batch size {bs}** ({sec['sequences_per_run']} SST-2 validation sentences per run, "
            f"mean padded length {sec['mean_padded_tokens']:.1f} tokens)",
            "",
            "| config | seq/s | vs backbone alone | shared vs K separate | heads share of engine time |",
            "| --- | ---: | ---: | ---: | ---: |",
            f"| backbone alone (stream to layer {s['num_layers']}) | "
            f"{c['backbone_stream']['sequences_per_s']['median']:.1f} | 1.00 | | |",
        ]
        for name, title in (("hf_forward", "HF forward (reference)"),
                            ("hf_forward_all_states", "HF forward, output_hidden_states")):
            if name in c:
                lines.append(f"| {title} | {c[name]['sequences_per_s']['median']:.1f} | "
                             f"{fmt_ratio(r[f'{name}_vs_backbone_stream'])} | | |")
        for k in s["ks"]:
            split = c[f"shared_K{k}"].get("engine_split", {}).get("heads_fraction_of_engine_time")
            vs_separate = r.get(f"shared_K{k}_vs_separate_K{k}")
            lines.append(
                f"| shared, K={k} | {c[f'shared_K{k}']['sequences_per_s']['median']:.1f} | "
                f"{fmt_ratio(r[f'shared_K{k}_vs_backbone'])} | {fmt_ratio(vs_separate) if vs_separate else ''} | "
                f"{split:.0%} |")
            if f"shared_K{k}_unfused" in c:
                split_u = c[f"shared_K{k}_unfused"]["engine_split"]["heads_fraction_of_engine_time"]
                lines.append(
                    f"| shared, K={k}, unfused | {c[f'shared_K{k}_unfused']['sequences_per_s']['median']:.1f} | "
                    f"{fmt_ratio(r[f'shared_K{k}_unfused_vs_backbone'])} | | {split_u:.0%} |")
            for heads in ("fp32", "bf16", "int8"):
                if f"shared_K{k}_{heads}heads" in c:
                    name = f"shared_K{k}_{heads}heads"
                    split_f = c[name]["engine_split"]["heads_fraction_of_engine_time"]
                    lines.append(f"| shared, K={k}, heads in {heads} | {c[name]['sequences_per_s']['median']:.1f} | "
                                 f"{fmt_ratio(r[f'{name}_vs_backbone'])} | | {split_f:.0%} |")
            if f"shared_K{k}_sparse" in c:
                split_s = c[f"shared_K{k}_sparse"]["engine_split"]["heads_fraction_of_engine_time"]
                lines.append(
                    f"| shared, K={k}, sparse (3 states/head) | "
                    f"{c[f'shared_K{k}_sparse']['sequences_per_s']['median']:.1f} | "
                    f"{fmt_ratio(r[f'shared_K{k}_sparse_vs_backbone'])} | | {split_s:.0%} |")
        for k in (k for k in s["ks"] if f"separate_K{k}" in c):
            lines.append(
                f"| {k} separate models (1 head each) | {c[f'separate_K{k}']['sequences_per_s']['median']:.1f} | "
                f"{fmt_ratio(r[f'separate_K{k}_vs_backbone'])} | | |")
        lines.append("")
    tgt = result["targets"]
    lines += ["**Targets (DESIGN.md section 4)**", "",
              "| target | batch | measured (median, min-max) | met |", "| --- | ---: | ---: | :---: |"]
    for bs, t in tgt.items():
        lines.append(f"| K=4 shared >= 0.9x backbone-only throughput | {bs} | "
                     f"{fmt_ratio(t['shared_K4_vs_backbone'])} | {'yes' if t['shared_K4_vs_backbone_met'] else 'no'} |")
        lines.append(f"| K=4 shared >= 0.9*4 = 3.6x K separate models | {bs} | "
                     f"{fmt_ratio(t['shared_K4_vs_separate_K4'])} | {'yes' if t['shared_K4_vs_separate_met'] else 'no'} |")
    for bs, many in result.get("targets_many_tasks", {}).items():
        for name, t in many.items():
            k = name.split("_")[1][1:]
            lines.append(f"| K={k} shared >= {t['target']}x backbone-only throughput (issue 14, stated for batch 32) | {bs} | "
                         f"{fmt_ratio(t['measured'])} | {'yes' if t['met'] else 'no'} |")
    for bs, t in tgt.items():
        other = "wall" if t["clock"] == "cpu" else "cpu"
        o = t[f"{other}_clock"]
        lines.append(f"| (same, {other} clock) K=4 vs backbone / vs 4 separate | {bs} | "
                     f"{fmt_ratio(o['shared_K4_vs_backbone'])} / {fmt_ratio(o['shared_K4_vs_separate_K4'])} | |")
    lines.append("")
    if result.get("early_exit"):
        ee = result["early_exit"]
        lines += [f"**Early exit** (K={ee['heads']} heads reading states 0..m, batch {ee['batch_size']}; "
                  "time relative to m = L, same round)", "",
                  "| m | m/L | engine time vs m=L | backbone stream time vs m=L | engine seq/s |",
                  "| ---: | ---: | ---: | ---: | ---: |"]
        for row in ee["rows"]:
            lines.append(f"| {row['deepest_state_m']} | {row['m_over_L']:.2f} | "
                         f"{fmt_ratio(row['heads_time_vs_full_depth'])} | {fmt_ratio(row['stream_time_vs_full_depth'])} | "
                         f"{row['heads_sequences_per_s']:.1f} |")
        lines.append("")
    if result.get("profile"):
        prof = result["profile"]
        lines += [f"**Where the heads' time goes** (K={prof['heads']} heads, batch {prof['batch']} x {prof['tokens']} "
                  f"tokens: the heads' own work takes {prof['heads_vs_backbone']:.0%} of the backbone stream's CPU "
                  "time; torch.profiler, self CPU time per op)", "",
                  "| op | share of the heads' time |", "| --- | ---: |"]
        for row in prof["ops"]:
            if row["share_of_heads"] >= 0.01:
                lines.append(f"| {row['op']} | {row['share_of_heads']:.0%} |")
        lines += ["", prof["note"] + ".", ""]
    if result.get("memory"):
        mem = result["memory"]
        mb = 1024 * 1024
        lines += [f"**Peak activation memory** (B={mem['batch']}, T={mem['tokens']}, K={mem['heads']} heads, "
                  "fresh process per path; profiler = peak live tensor bytes during one call, RSS = peak RSS "
                  "delta)", "",
                  "| path | profiler peak MiB | RSS peak delta MiB |", "| --- | ---: | ---: |"]
        for path, r in mem["paths"].items():
            rss = r["peak_rss_delta_bytes"]
            lines.append(f"| {path} | {r['profiler_peak_tensor_bytes'] / mb:.1f} | "
                         f"{(rss / mb) if rss is not None else float('nan'):.1f} |")
        a = mem["analytic"]
        lines += ["", f"For scale: one hidden state B*T*H*4 = {a['one_hidden_state_BTH_bytes'] / mb:.1f} MiB; all "
                  f"L+1 states = {a['all_states_(L+1)BTH_bytes'] / mb:.1f} MiB; K running buffers K*B*T*k*4 = "
                  f"{a['running_buffers_K*BTk_bytes'] / mb:.1f} MiB.", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 1 + bool(result.get("early_exit")) + bool(result.get("memory"))
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2))
    axes = list(axes) if panels > 1 else [axes]
    ax = axes[0]
    ks = result["settings"]["ks"]
    for idx, (bs, sec) in enumerate(result["throughput"].items()):
        r = sec["ratios"]
        color, marker = f"C{idx}", "os^v"[idx % 4]
        ax.plot(ks, [r[f"shared_K{k}_vs_backbone"]["median"] for k in ks], marker=marker, color=color,
                label=f"shared, B={bs}")
        sep_ks = [k for k in ks if f"separate_K{k}_vs_backbone" in r]
        ax.plot(sep_ks, [r[f"separate_K{k}_vs_backbone"]["median"] for k in sep_ks], marker=marker, linestyle="--",
                color=color, alpha=0.6, label=f"K separate, B={bs}")
        sparse_ks = [k for k in ks if f"shared_K{k}_sparse_vs_backbone" in r]
        if sparse_ks:
            ax.scatter(sparse_ks, [r[f"shared_K{k}_sparse_vs_backbone"]["median"] for k in sparse_ks], marker="*",
                       s=70, zorder=3, color=color, label=f"shared, 3 states/head, B={bs}")
    ax.plot(ks, [1 / k for k in ks], color="grey", linestyle=":", label="1/K")
    ax.axhline(TARGET_SHARED_VS_BACKBONE, color="red", linewidth=0.8, label="target 0.9 (K=4)")
    many = [k for k in TARGETS_MANY if k in ks]
    ax.scatter(many, [TARGETS_MANY[k] for k in many], marker="_", s=300, color="red", zorder=4,
               label="issue-14 targets (B=32)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("tasks K")
    ax.set_ylabel("throughput / backbone-only throughput")
    settings = result["settings"]
    precision = settings.get("precision", "fp32")
    ax.set_title(f"Sharing one backbone pass (backbone {precision}, heads {settings.get('head_precision') or precision})",
                 fontsize=10)
    ax.legend(fontsize=7)
    i = 1
    if result.get("early_exit"):
        ee = result["early_exit"]
        ax = axes[i]
        i += 1
        xs = [row["m_over_L"] for row in ee["rows"]]
        ax.plot(xs, [row["heads_time_vs_full_depth"]["median"] for row in ee["rows"]], marker="o",
                label=f"engine, K={ee['heads']}")
        ax.plot(xs, [row["stream_time_vs_full_depth"]["median"] for row in ee["rows"]], marker="s",
                label="backbone stream")
        ax.plot([0, 1], [0, 1], color="grey", linestyle=":", label="m/L")
        ax.set_xlabel("deepest state read m / L")
        ax.set_ylabel("time / time at m = L")
        ax.set_title(f"Early exit (B={ee['batch_size']})")
        ax.legend(fontsize=7)
    if result.get("memory"):
        mem = result["memory"]
        ax = axes[i]
        names = list(mem["paths"])
        vals = [mem["paths"][n]["profiler_peak_tensor_bytes"] / 2**20 for n in names]
        rss = [(mem["paths"][n]["peak_rss_delta_bytes"] or 0) / 2**20 for n in names]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], vals, width=0.4, label="profiler peak tensors")
        ax.bar([x + 0.2 for x in xs], rss, width=0.4, label="peak RSS delta")
        ax.set_xticks(list(xs), [n.replace("_", "\n", 2) for n in names], fontsize=7)
        ax.set_ylabel("MiB")
        ax.set_title(f"Peak activation memory (B={mem['batch']}, T={mem['tokens']}, K={mem['heads']})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Throughput and memory of K layer-mix heads sharing one backbone pass, vs the backbone "
                    "alone and vs K separate models, as ratios measured in one run (see module docstring).")
    p.add_argument("--quick", action="store_true", help="short smoke run (few rounds, small memory batch); "
                   "writes <stem>-quick.* so the recorded results are not overwritten")
    p.add_argument("--data-dir", type=Path, default=default_data_dir(),
                   help="datasets folder with sst2/validation.tsv (default: $TMOD_DATA_DIR or ../shared/data "
                        "relative to the repo)")
    p.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--stem", default="sharing-cpu", help="output file stem (.json, .md, .png)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 5, quick 2)")
    p.add_argument("--repeats", type=int, default=None,
                   help="back-to-back runs of a config within a round; the round keeps the fastest "
                        "(default 2, quick 1)")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="numbers of heads K")
    p.add_argument("--max-separate", type=int, default=8,
                   help="time K separate models (deep copies of the backbone) only up to this K")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--batches-per-run", type=int, default=None,
                   help="batches per timed run, per batch size; at least 32 sentences per run "
                        "(default 1)")
    p.add_argument("--project-dim", type=int, default=64, help="k of every head")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: on a shared 2-core machine, 2 OpenMP threads "
                        "competing with another job make timings erratic; 0 = torch default)")
    p.add_argument("--clock", choices=["auto", "cpu", "wall"], default="auto",
                   help="clock for the reported numbers: cpu = CPU time of this process (time.process_time), "
                        "wall = elapsed time; auto = cpu with 1 thread (immune to other jobs taking turns on "
                        "the core), wall otherwise. Both are recorded in the JSON.")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="backbone and heads precision: fp32, or bf16 (the backbone's bf16 layers and the heads "
                        "under bf16 autocast: what tmod-serve runs by default on a CPU with native bfloat16); "
                        "the sanity check and the Hugging Face references stay fp32")
    p.add_argument("--head-precision", choices=["fp32", "bf16", "int8"], default=None,
                   help="the heads' precision as tmod-serve's head_precision (default: --precision); int8: "
                        "layer-mix projections as int8 products. Heads in fp32 and in the backbone's precision "
                        "are timed beside them for K in (1, 4, 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--early-exit-batch", type=int, default=32)
    p.add_argument("--memory-batch", type=int, default=None, help="B for the memory comparison (default 64, quick 16)")
    p.add_argument("--memory-tokens", type=int, default=None, help="T for the memory comparison (default 128, quick 64)")
    p.add_argument("--memory-heads", type=int, default=4)
    p.add_argument("--profile-k", type=int, default=16,
                   help="profile one Engine.logits call with this many heads against the backbone alone (0: skip)")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--skip-early-exit", action="store_true")
    p.add_argument("--memory-worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    q = args.quick
    args.rounds = args.rounds or (2 if q else 5)
    args.repeats = args.repeats or (1 if q else 2)
    args.batches_per_run = args.batches_per_run or 1
    args.memory_batch = args.memory_batch or (16 if q else 64)
    args.memory_tokens = args.memory_tokens or (64 if q else 128)
    args.head_precision = args.head_precision or args.precision
    if args.clock == "auto":
        args.clock = "cpu" if args.threads == 1 else "wall"
    if q and args.stem == "sharing-cpu":
        args.stem = "sharing-cpu-quick"
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.memory_worker:
        memory_worker(args)
        return
    started = time.perf_counter()
    machine = machine_info()  # load average first, before we add to it
    if args.threads:
        torch.set_num_threads(args.threads)
    from server.host_memory import keep_freed_memory
    keeps_memory = keep_freed_memory()  # as tmod-serve does on a CPU (timing only; the memory workers do not)
    from modules_store import ModuleStore
    from server.backbone import Backbone
    from server.engine import Engine

    rng = random.Random(args.seed)
    print(f"load average at start: {machine['load_average_at_start_1_5_15min']}, torch threads "
          f"{torch.get_num_threads()}", flush=True)
    bb = Backbone.load()
    L, H = bb.num_layers, bb.hidden_size
    sentences = read_sentences(args.data_dir)
    ks = sorted(set(args.ks))
    K = max(ks)
    result = {
        "benchmark": "sharing",
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "command": "python bench/bench_sharing.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "settings": {
            "quick": args.quick, "rounds": args.rounds, "repeats_per_round_min_taken": args.repeats, "ks": ks, "batch_sizes": args.batch_sizes,
            "batches_per_run": args.batches_per_run, "project_dim": args.project_dim, "seed": args.seed,
            "torch_threads": torch.get_num_threads(), "clock": args.clock, "precision": args.precision,
            "head_precision": args.head_precision,
            "host_memory_kept": keeps_memory, "backbone": bb.name, "num_layers": L, "hidden_size": H,
            "data": str(args.data_dir / "sst2" / "validation.tsv"),
            "heads": "layer-mix, random weights (seeded), k=project_dim, states 0..L all mixed (cutoff 0); "
                     "even i: sequence classification, 2 labels (1 self-attention layer, masked mean, linear); "
                     "odd i: token classification, 9 CoNLL BIO labels (1 pre-LN encoder layer, FFN 256, linear); "
                     "saved to a temp ModuleStore and loaded with load_module",
            "timed_work": "Engine.logits (backbone + heads to logits); tokenization (once up front) and decoding "
                          "excluded; inference_mode; precision as in settings.precision (fp32, or bf16: the backbone's bf16 "
                          "layers and the heads under bf16 autocast)",
            "separate_models": "K deep copies of the backbone, each a Backbone + Engine serving one head; run one "
                               "after the other on each batch",
            "shared_fusion": "Engine(fuse=True): heads of one kind grouped (server/plan.py): the layer-mix "
                             "projections of all heads reading a state in one matmul, their classifiers' "
                             "weights stacked and run as batched matrix products; 'unfused' = "
                             "Engine(fuse=False), every head on its own",
            "sparse_variant": "K=4 and K=8 also timed with heads that read only 3 states each "
                              f"(head i: {sparse_layers(0, L)}, {sparse_layers(1, L)}, {sparse_layers(2, L)}, ...), "
                              "as trained heads pruned by the distribution cutoff would; the default heads read "
                              "all L+1 states (the worst case for the heads' cost)",
        },
    }
    with tempfile.TemporaryDirectory() as tmp:
        store = ModuleStore(tmp)
        shared_mods = build_modules(store, bb, K, list(range(L + 1)), args.project_dim, args.seed)
        sparse_mods = build_modules(store, bb, K, lambda i: sparse_layers(i, L), args.project_dim, args.seed,
                                    tag="-sparse")
        separate = []
        for i in range(min(K, args.max_separate)):
            copy_bb = Backbone(copy.deepcopy(bb.model), bb.tokenizer, name=bb.name)
            from server.modules import load_module
            name = task_name(i)
            separate.append((Engine(copy_bb), {name: load_module(store, name, None, copy_bb)}))
        engine, engine_unfused = Engine(bb), Engine(bb, fuse=False)  # fp32, for the sanity check

        # sanity: shared, unfused and separate serving give the same logits
        check = bb.tokenize(sentences[:8])
        ref = engine.logits(check, shared_mods)
        unf = engine_unfused.logits(check, shared_mods)
        sep = {}
        for eng, mods in separate:
            sep.update(eng.logits(check, mods))
        diff = max(max((ref[t] - unf[t]).abs().max().item(), (ref[t] - sep.get(t, unf[t])).abs().max().item())
                   for t in ref)
        result["sanity_max_abs_logit_diff_shared_vs_unfused_vs_separate"] = diff
        assert diff < 1e-4, diff
        int8 = args.head_precision == "int8"
        if args.precision != "fp32":  # timed from here on as served: the backbone's bf16 layers
            bb = bb.use_backend("torch", args.precision)
        separate = [(Engine(eng.backbone.use_backend("torch", args.precision), int8=int8), mods)
                    for eng, mods in separate]
        engine, engine_unfused, other_engine = Engine(bb, int8=int8), Engine(bb, fuse=False, int8=int8), Engine(bb)
        precision = Precision(args.precision, args.head_precision)

        result["throughput"] = {}
        for bs in args.batch_sizes:
            texts = sentences[: max(32, bs * args.batches_per_run)]
            batches = [bb.tokenize(texts[i:i + bs]) for i in range(0, len(texts), bs)]
            print(f"throughput, batch size {bs}: {len(batches)} batches per run", flush=True)
            sec = throughput_section(bb, engine, engine_unfused, shared_mods, sparse_mods, separate, batches, ks,
                                     args.rounds, args.repeats, rng, f"B={bs}", args.clock, precision, other_engine)
            sec["mean_padded_tokens"] = statistics.mean(b.seq_len for b in batches)
            result["throughput"][str(bs)] = sec
        del separate
        gc.collect()
        if args.profile_k and args.profile_k <= K:
            bs = args.early_exit_batch
            batch = bb.tokenize(sentences[:bs])
            print(f"profile, K={args.profile_k}, batch size {bs}", flush=True)
            result["profile"] = profile_section(bb, engine, shared_mods, batch, args.profile_k,
                                               precision=precision)

        if not args.skip_early_exit:
            bs = args.early_exit_batch
            texts = sentences[: bs * args.batches_per_run]
            batches = [bb.tokenize(texts[i:i + bs]) for i in range(0, len(texts), bs)]
            print(f"early exit, batch size {bs}", flush=True)
            result["early_exit"] = early_exit_section(bb, engine, store, batches, TARGET_K, args.project_dim,
                                                      args.seed, args.rounds, args.repeats, rng, "early exit",
                                                      args.clock, precision)
            result["early_exit"]["batch_size"] = bs
    if not args.skip_memory:
        print("memory", flush=True)
        result["memory"] = memory_section(args, L, H)

    result["targets"] = {}
    for bs, sec in result["throughput"].items():
        if f"shared_K{TARGET_K}_vs_backbone" not in sec["ratios"]:
            continue
        a = sec["ratios"][f"shared_K{TARGET_K}_vs_backbone"]
        b = sec["ratios"][f"shared_K{TARGET_K}_vs_separate_K{TARGET_K}"]
        other = "wall" if args.clock == "cpu" else "cpu"
        o = sec[f"{other}_clock"]["ratios"]
        result["targets"][bs] = {
            "clock": args.clock,
            "shared_K4_vs_backbone": a, "shared_K4_vs_backbone_met": a["median"] >= TARGET_SHARED_VS_BACKBONE,
            "shared_K4_vs_separate_K4": b, "shared_K4_vs_separate_met": b["median"] >= 0.9 * TARGET_K,
            f"{other}_clock": {"shared_K4_vs_backbone": o[f"shared_K{TARGET_K}_vs_backbone"],
                               "shared_K4_vs_separate_K4": o[f"shared_K{TARGET_K}_vs_separate_K{TARGET_K}"]},
            "shared_K4_sparse_vs_backbone": sec["ratios"].get(f"shared_K{TARGET_K}_sparse_vs_backbone"),
        }
    result["targets_many_tasks"] = {}  # issue 14: stated for batch 32; recorded for every batch size
    for bs, sec in result["throughput"].items():
        result["targets_many_tasks"][bs] = {
            f"shared_K{k}_vs_backbone": {"target": least, "measured": sec["ratios"][f"shared_K{k}_vs_backbone"],
                                         "met": sec["ratios"][f"shared_K{k}_vs_backbone"]["median"] >= least}
            for k, least in TARGETS_MANY.items() if f"shared_K{k}_vs_backbone" in sec["ratios"]
        }
    result["load_average_at_end_1_5_15min"] = list(os.getloadavg())
    result["wall_seconds"] = time.perf_counter() - started

    args.out_dir.mkdir(parents=True, exist_ok=True)
    md = markdown(result)
    (args.out_dir / f"{args.stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out_dir / f"{args.stem}.md").write_text(md + "\n")
    plot(result, args.out_dir / f"{args.stem}.png")
    print()
    print(md)
    print(f"wrote {args.out_dir / (args.stem + '.json')}, .md, .png in {result['wall_seconds']:.0f}s")


if __name__ == "__main__":
    main()
