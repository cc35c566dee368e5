#!/usr/bin/env python
"""Benchmark: the model runner's choices (server/runner.py) - head precision, and how a pass is captured.

`heads` (any device; the CPU here): may the task heads compute in the backbone's 16-bit precision?
Every shipped module whose dataset is known (bench/quality.py's TASKS) is scored on its validation
set through `Engine.logits` under `ModelRunner.precision()` in these configurations:
  fp32          backbone fp32, heads fp32 (the reference)
  bf16-backbone backbone bf16, heads fp32 (what `precision bf16` served before heads followed it)
  bf16          backbone bf16, heads bf16 (matrix products under torch.autocast)
  fp16-backbone, fp16  the same in float16 (on cuda; on the CPU with --emulate-fp16: float16
                arithmetic on the CPU, which tmod refuses to serve (slow) but which rounds as a GPU's
                float16 does, so its predictions measure the rule; the bench bypasses the refusal)
  int8, bf16-int8  (CPU) backbone fp32 / bf16, heads int8: the layer-mix projections as int8
                products, the rest of the heads in the backbone's precision (`head_precision int8`)
The rule (bench/bench_backends.py's, used for every lossy default): on every module >= 99% of
predictions equal to fp32's and a metric drop < 0.3 points. Its outcome is what
`server.runner.HEAD_PRECISIONS_WITHIN_RULE` lists (auto picks 16-bit heads only for those; int8 heads
passed too but stay opt-in, as they are no faster than bf16 heads beside a bf16 backbone: docs/gpu.md).

`capture` (cuda only): one pass of the shipped modules at B = 1, 32, 128 x 32 tokens, as the
runner runs it eagerly, replayed from its manual CUDA graph capture, and as
`torch.compile(mode="reduce-overhead")` (and "max-autotune") of the same pass: seq/s per mode, the
largest logit difference from eager, capture / compile time, graph memory. This decides manual
capture vs torch.compile; bench/bench_gpu.py can call `capture_section`.

    .venv/bin/python bench/bench_runner.py heads --emulate-fp16   # -> bench/results/head-precision-cpu.{json,md}
    .venv/bin/python bench/bench_runner.py heads --emulate-fp16 --backbone mpnet   # -> head-precision-cpu-mpnet.*
    .venv/bin/python bench/bench_runner.py heads --backbone mpnet --out bench/results/head-precision-cpu-mpnet-int8
    .venv/bin/python bench/bench_runner.py capture --device cuda   # -> bench/results/capture-cuda.json
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.bench_backends import DEFAULT_MAX_DROP, DEFAULT_MIN_AGREEMENT, prediction_agreement  # noqa: E402
from bench.environment import machine_info, read_sst2_sentences  # noqa: E402
from training.data import default_data_dir  # noqa: E402

import torch  # noqa: E402

REFERENCE = "fp32"


def head_variants(device: str, emulate_fp16: bool = False) -> dict[str, tuple[str, str]]:
    """name -> (backbone precision, head precision)"""
    out = {"fp32": ("fp32", "fp32"), "bf16-backbone": ("bf16", "fp32"), "bf16": ("bf16", "bf16")}
    if device.startswith("cuda") or emulate_fp16:
        out.update({"fp16-backbone": ("fp16", "fp32"), "fp16": ("fp16", "fp16")})
    if not device.startswith("cuda"):
        out.update({"int8": ("fp32", "int8"), "bf16-int8": ("bf16", "int8")})
    return out


def variant_runner(base, device: str, precision: str, heads: str):
    """A ModelRunner for one variant. fp16 on the CPU (--emulate-fp16) is refused by the torch backend
    and by Settings (too slow to serve); the benchmark goes round both, nothing else does."""
    from unittest import mock

    from server.config import Settings
    from server.engine import Engine
    from server.runner import ModelRunner

    if precision == "fp16" and not device.startswith("cuda"):
        from server.backbone.backends import TorchBackend

        with mock.patch("server.backbone.backends.torch_backend.check_low_precision", lambda *_: None):
            bb = copy.copy(base)  # as Backbone.use_backend makes it, less its checks
            bb.backend = TorchBackend(base.adapter, precision=precision)
        settings = Settings.model_construct(device=device, precision=precision, head_precision=heads)
    else:
        bb = base if precision == "fp32" else base.use_backend("torch", precision)
        settings = Settings(device=device, precision=precision, head_precision=heads)
    return ModelRunner(Engine(bb, int8=heads == "int8"), settings)


def heads_section(args, earlier: dict | None = None) -> dict:
    """Every shipped module of the tier in every variant; with `--tasks`, those modules only, the
    others' rows kept from `earlier` (the previous result) and the decision taken over all of them."""
    from bench.quality import TASKS
    from modules_store import ArtifactError, ModuleStore
    from server.backbone import Backbone
    from server.modules import load_module
    from training.data import PRESETS, preset_spec
    from training.evaluate import collect, score
    from training.states import Split

    base = Backbone.load(args.backbone, device=args.device)
    store = ModuleStore(args.store)
    variants = head_variants(args.device, args.emulate_fp16)
    runners = {name: variant_runner(base, args.device, precision, heads)
               for name, (precision, heads) in variants.items()}
    wanted = set(args.tasks.split(",")) if args.tasks else None
    out = {}
    for task in store.tasks():
        if task not in TASKS or (wanted is not None and task not in wanted):
            if wanted is not None and earlier and task in earlier.get("tasks", {}):
                out[task] = earlier["tasks"][task]
            continue
        try:
            load_module(store, task, None, base, args.device)
        except ArtifactError as exc:  # a task shipped for another backbone only
            print(f"  {task}: skipped ({exc.message})", flush=True)
            continue
        dataset, metric, title = TASKS[task]
        data = preset_spec(PRESETS[dataset], "validation", args.data_dir).read()
        entry = {"dataset": dataset, "metric": metric, "title": title, "examples": len(data.examples),
                 "variants": {}}
        predicted = {}
        for name, runner in runners.items():
            module = load_module(store, task, None, runner.engine.backbone, args.device)
            entry["version"] = module.version
            split = Split(data, module.head.labels, runner.engine.backbone)

            def logits(rows, batch, runner=runner, module=module):
                with torch.inference_mode(), runner.precision():
                    return runner.engine.logits(batch.to(args.device), {task: module})[task].float()

            t0 = time.perf_counter()
            predicted[name] = collect(split, split.batches(128), logits)
            value = score(split, predicted[name])[metric]
            entry["variants"][name] = {"value": value, "seconds": round(time.perf_counter() - t0, 1)}
            print(f"  {task} {name}: {metric} {value:.4f}", flush=True)
        for name in runners:
            v = entry["variants"][name]
            v["agreement_with_fp32"] = prediction_agreement(predicted[REFERENCE], predicted[name])
            v["delta_vs_fp32"] = v["value"] - entry["variants"][REFERENCE]["value"]
        entry["agreement_unit"] = "data words (tags)" if isinstance(predicted[REFERENCE][0], list) else "examples"
        out[task] = entry
    decision = {}
    for name in variants:
        if name == REFERENCE:
            continue
        rows = [e["variants"][name] for e in out.values()]
        drop = max(-r["delta_vs_fp32"] for r in rows)
        agreement = min(r["agreement_with_fp32"] for r in rows)
        decision[name] = {"largest_metric_drop": drop, "lowest_agreement": agreement,
                          "within_rule": drop < DEFAULT_MAX_DROP and agreement >= DEFAULT_MIN_AGREEMENT}
    decision["rule"] = (f"on every shipped module: agreement with fp32 >= {DEFAULT_MIN_AGREEMENT:.0%}, "
                        f"metric drop < {100 * DEFAULT_MAX_DROP:.1f} points")
    return {"tasks": out, "decision": decision}


def heads_markdown(result: dict) -> str:
    section = result["heads"]
    names = list(next(iter(section["tasks"].values()))["variants"])
    lines = [f"# Head precision ({result['machine']['device']}, {result['machine']['date']}, "
             f"backbone {result.get('backbone') or 'minilm'})", "",
             "Validation metric (x100) of every shipped module; agreement = share of predictions equal to "
             "fp32's (labels; NER: data-word tags). Backbone / heads precision per column.", "",
             "| task | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]
    for task, e in section["tasks"].items():
        cells = [f"{100 * v['value']:.2f} ({100 * v['agreement_with_fp32']:.2f}%)" for v in e["variants"].values()]
        lines.append(f"| {task} ({e['metric']}, {e['examples']} examples) | " + " | ".join(cells) + " |")
    if result.get("earlier_rows_from"):
        lines += ["", f"Measured in this run: {result['measured_tasks']}; the other rows are kept from the run of "
                      f"{result['earlier_rows_from']}."]
    lines += ["", f"Rule: {section['decision']['rule']}.", ""]
    for name, d in section["decision"].items():
        if name != "rule":
            lines.append(f"- {name}: largest drop {100 * d['largest_metric_drop']:.2f} points, lowest agreement "
                         f"{100 * d['lowest_agreement']:.2f}% -> {'within' if d['within_rule'] else 'outside'} the rule")
    return "\n".join(lines)


# ---- capture: eager vs manual CUDA graphs vs torch.compile ------------------------------------
def capture_section(device: str = "cuda", batch_sizes=(1, 32, 128), tokens: int = 32, repeats: int = 50,
                    store: Path | None = None, data_dir: Path | None = None, precision: str = "fp16") -> dict:
    """seq/s of one pass of the shipped modules per mode; needs a cuda device."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        raise SystemExit("the capture comparison needs a cuda device (torch sees none)")
    from modules_store import ModuleStore
    from server.backbone import Backbone
    from server.config import Settings
    from server.engine import Engine
    from server.modules import load_module, servable_tasks
    from server.runner import ModelRunner, pack_logits

    bb = Backbone.load(device=device)
    if precision != "fp32":
        bb = bb.use_backend("torch", precision)
    store = ModuleStore(store or REPO / "modules_store")
    modules = {t: load_module(store, t, None, bb, device) for t in servable_tasks(store, bb)}
    sentences = read_sst2_sentences(data_dir)
    text = " ".join(sentences[:20])
    settings = dict(device=device, precision=precision, graph_seq_lens=str(tokens),
                    graph_batch_sizes=",".join(map(str, batch_sizes)), max_batch_size=max(batch_sizes))
    eager = ModelRunner(Engine(bb), Settings(cuda_graphs=False, **settings))
    graphs = ModelRunner(Engine(bb), Settings(**settings))
    out = {"modules": sorted(modules), "precision": precision, "head_precision": eager.head_precision,
           "tokens": tokens, "batches": {}}
    for size in batch_sizes:
        rows = bb.encode([text] * size, truncate=True, max_tokens=tokens)
        prepared = eager.prepare(rows, modules).passes[0]
        batch, bucket = prepared.batch, prepared.bucket
        device_batch = eager.prepare(rows, modules).passes[0].batch.to(device)

        def eager_pass():
            return eager.logits(batch, bucket, modules, _timings())[0]

        def graph_pass():
            return graphs.logits(batch, bucket, modules, _timings())[0]

        entry = {}
        t0 = time.perf_counter()
        reference = eager_pass()
        graph_pass()
        entry["capture_seconds"] = time.perf_counter() - t0
        entry["graph_memory_bytes"] = graphs.graphs.memory_bytes
        modes = {"eager": eager_pass, "manual_graph": graph_pass}
        for mode in ("reduce-overhead", "max-autotune"):
            def compiled_run(ids, mask, engine=eager.engine):
                with eager.precision():
                    return pack_logits(engine.run(replace(device_batch, input_ids=ids, attention_mask=mask),
                                                  modules)[0])[0]
            try:
                fn = torch.compile(compiled_run, mode=mode)
                ids, mask = device_batch.input_ids.clone(), device_batch.attention_mask.clone()
                t0 = time.perf_counter()
                with torch.inference_mode():
                    for _ in range(3):
                        fn(ids, mask)
                torch.cuda.synchronize()
                entry[f"compile_{mode}_seconds"] = time.perf_counter() - t0

                def compiled_pass(fn=fn, ids=ids, mask=mask):
                    with torch.inference_mode():
                        return fn(ids, mask).clone().cpu()
                modes[f"compile_{mode}"] = compiled_pass
            except Exception as exc:  # noqa: BLE001  (record why a mode could not run)
                entry[f"compile_{mode}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        for mode, fn in modes.items():
            with torch.inference_mode():
                for _ in range(3):
                    result = fn()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(repeats):
                    result = fn()
                torch.cuda.synchronize()
                seconds = (time.perf_counter() - t0) / repeats
            if isinstance(result, dict):
                diff = max(float((result[t] - reference[t]).abs().max()) for t in reference)
            else:
                flat = torch.cat([reference[t].reshape(-1) for t in reference])
                diff = float((result[: flat.numel()] - flat).abs().max()) if result.numel() >= flat.numel() else None
            entry[mode] = {"seq_per_s": size / seconds, "ms_per_pass": 1000 * seconds, "max_abs_diff_vs_eager": diff}
            print(f"  B={size} {mode}: {size / seconds:,.0f} seq/s, {1000 * seconds:.2f} ms", flush=True)
        out["batches"][str(size)] = entry
    return out


def _timings():
    from server.engine import Timings

    return Timings()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("section", choices=["heads", "capture"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--store", type=Path, default=REPO / "modules_store")
    p.add_argument("--backbone", default=None, help="heads: the tier (default minilm; mpnet: its shipped modules)")
    p.add_argument("--emulate-fp16", action="store_true",
                   help="heads on the CPU: add the fp16 variants, computed in float16 on the CPU")
    p.add_argument("--data-dir", type=Path, default=default_data_dir())
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--precision", default="fp16", help="capture: backbone (and head) precision")
    p.add_argument("--tasks", default=None,
                   help="heads: re-measure these shipped tasks only (comma-separated), keep the others' rows")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    kind = args.device.split(":")[0]
    result = {"benchmark": f"runner-{args.section}", "machine": machine_info(args.device),
              "command": "python bench/bench_runner.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "torch_threads": args.threads}
    if args.section == "heads":
        result["backbone"] = args.backbone or "minilm"
        tier = "" if result["backbone"] == "minilm" else f"-{result['backbone']}"
        out = args.out or REPO / "bench" / "results" / f"head-precision-{kind}{tier}"
        earlier = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").is_file() else {}
        result["heads"] = heads_section(args, earlier.get("heads"))
        if args.tasks:
            result["measured_tasks"] = args.tasks
            result["earlier_rows_from"] = earlier.get("earlier_rows_from") or earlier.get("machine", {}).get("date")
        out.with_suffix(".md").write_text(heads_markdown(result) + "\n")
        print(heads_markdown(result))
    else:
        result["capture"] = capture_section(args.device, store=args.store, data_dir=args.data_dir,
                                            precision=args.precision)
        out = args.out or REPO / "bench" / "results" / f"capture-{kind}"
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
