"""Head precision on validation: may the heads compute in 16 bits, or their projections in int8?

Every shipped module of the tier whose dataset bench/quality.py knows is scored on its validation
split through `Engine.logits` under `ModelRunner.precision()`, as the server runs it, in each
variant (backbone precision, head precision):

    fp32       fp32, fp32   the reference
    bf16       bf16, bf16   what `auto` serves on a CPU with bfloat16
    int8       fp32, int8   `--head-precision int8` beside an fp32 backbone
    bf16-int8  bf16, int8   beside a bf16 backbone

against the accuracy rule every lossy setting is held to: on every module >= 99% of predictions
equal to fp32's (labels; NER: data-word tags) and a metric drop < 0.3 points. int8 answers are the
same on every x86 CPU (server/heads/layermix/grouped.py `WEIGHT_LEVELS`); run it under
`ONEDNN_MAX_CPU_ISA=AVX2` to see so on an AVX-512 machine.

    .venv/bin/python bench/head_precision.py                    # -> bench/results/head-precision-minilm.{json,md}
    .venv/bin/python bench/head_precision.py --backbone mpnet   # -> head-precision-mpnet.*
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.harness import markdown_table, write_results  # noqa: E402

VARIANTS = {"fp32": ("fp32", "fp32"), "bf16": ("bf16", "bf16"), "int8": ("fp32", "int8"), "bf16-int8": ("bf16", "int8")}
MIN_AGREEMENT, MAX_DROP = 0.99, 0.003


def agreement(reference: list, predicted: list) -> float:
    """Share of predictions equal to the reference's: labels, or data-word tags for token tasks."""
    same = total = 0
    for a, b in zip(reference, predicted):
        pairs = list(zip(a, b)) if isinstance(a, list) else [(a, b)]
        same += sum(x == y for x, y in pairs)
        total += len(pairs)
    return same / total


def score_tasks(backbone_name: str, variants: list[str], tasks: list[str] | None, limit: int | None) -> dict:
    import torch

    from bench.quality import TASKS
    from modules_store import ArtifactError, ModuleStore
    from server.backbone import Backbone
    from server.config import Settings
    from server.engine import Engine
    from server.modules import load_module
    from server.runner.model_runner import ModelRunner
    from training.data.presets import PRESETS, preset_spec
    from training.evaluate import collect, score
    from training.states import Split

    fp32 = Backbone.load(backbone_name)
    backbones = {"fp32": fp32, "bf16": fp32.use_backend("torch", "bf16")}
    store = ModuleStore(REPO / "modules_store")
    out = {}
    for task in (tasks or [t for t in store.tasks() if t in TASKS]):
        try:
            load_module(store, task, None, fp32)
        except ArtifactError as exc:  # a task shipped for the other tier only
            print(f"{task}: skipped ({exc.message})", flush=True)
            continue
        dataset, metric, title = TASKS[task]
        data = preset_spec(PRESETS[dataset], "validation").read().subset(limit, seed=0)
        entry = {"dataset": dataset, "metric": metric, "title": title, "examples": len(data.examples), "variants": {}}
        predicted = {}
        for name in ["fp32", *variants]:
            precision, heads = VARIANTS[name]
            backbone = backbones[precision]
            runner = ModelRunner(Engine(backbone, int8=heads == "int8"), Settings(precision=precision, head_precision=heads))
            module = load_module(store, task, None, backbone)
            split = Split(data, module.head.labels, backbone)

            def logits(rows, batch, runner=runner, module=module):
                with torch.inference_mode(), runner.precision():
                    return runner.engine.logits(batch, {task: module})[task].float()

            started = time.perf_counter()
            predicted[name] = collect(split, split.batches(128), logits)
            value = score(split, predicted[name])[metric]
            entry["version"] = module.version
            entry["variants"][name] = {"value": value, "seconds": round(time.perf_counter() - started, 1),
                                       "agreement_with_fp32": agreement(predicted["fp32"], predicted[name]),
                                       "delta_vs_fp32": value - entry["variants"]["fp32"]["value"] if name != "fp32" else 0.0}
            print(f"{task} {name}: {metric} {100 * value:.2f}", flush=True)
        out[task] = entry
    return out


def decide(tasks: dict, variants: list[str]) -> dict:
    decision = {}
    for name in variants:
        rows = [entry["variants"][name] for entry in tasks.values()]
        drop, agree = max(-r["delta_vs_fp32"] for r in rows), min(r["agreement_with_fp32"] for r in rows)
        decision[name] = {"largest_metric_drop": drop, "lowest_agreement": agree,
                          "within_rule": drop < MAX_DROP and agree >= MIN_AGREEMENT}
    return decision


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbone", default="minilm", help="minilm or mpnet: the tier whose shipped modules are scored")
    parser.add_argument("--variants", default="bf16,int8,bf16-int8", help=f"beside fp32, of {', '.join(VARIANTS)}")
    parser.add_argument("--tasks", default=None, help="comma list (default: every shipped module with a known dataset)")
    parser.add_argument("--limit", type=int, default=None, help="N validation examples only, a seeded subset (a quick check)")
    parser.add_argument("--stem", default=None, help="results name under bench/results/, or a path "
                        "(default: head-precision-<backbone>)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # one thread, as the rest of the CPU figures (the machine is shared)
    variants = [v for v in args.variants.split(",") if v != "fp32"]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    tasks = score_tasks(args.backbone, variants, args.tasks.split(",") if args.tasks else None, args.limit)
    result = {"backbone": args.backbone, "tasks": tasks, "decision": decide(tasks, variants),
              "rule": f"on every module: agreement with fp32 >= {MIN_AGREEMENT:.0%}, metric drop < {100 * MAX_DROP:.1f} points",
              "isa_environment": {k: os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                                 "MKL_ENABLE_INSTRUCTIONS")}}
    names = ["fp32", *variants]
    rows = [[f"{task} ({e['metric']}, {e['examples']} examples)",
             *(f"{100 * e['variants'][n]['value']:.2f} ({100 * e['variants'][n]['agreement_with_fp32']:.2f}%)" for n in names)]
            for task, e in tasks.items()]
    notes = "\n".join([f"Rule: {result['rule']}."] + [
        f"- {n}: largest drop {100 * d['largest_metric_drop']:.2f} points, lowest agreement "
        f"{100 * d['lowest_agreement']:.2f}% -> {'within' if d['within_rule'] else 'outside'} the rule"
        for n, d in result["decision"].items()])
    title = f"Head precision (backbone {args.backbone}): validation metric x100 (agreement with fp32)"
    path = write_results(args.stem or f"head-precision-{args.backbone}", result, title,
                         [markdown_table(["task", *names], rows)], notes)
    print(notes, f"\nwrote {path}")


if __name__ == "__main__":
    main()
