"""Quality table of the shipped modules, per backbone tier: layer-mix vs last-layer-only vs full
fine-tuning.

Every layer-mix and last-layer number is re-scored here from the artifact through the served path
(`tmod-train eval` on the tier's backbone, at the precision the module was trained at), never copied
from a manifest; full fine-tuning numbers come from `bench/finetune_full.py`'s JSON
(bench/results/finetune-<dataset>.json, MiniLM only). One store holds both tiers: each backbone
scores the version it serves. `--tiers mpnet` re-scores one tier and keeps the other's entry;
`--tasks entailment` re-scores those rows and keeps the tier's others.

    .venv/bin/python bench/quality.py [--tiers minilm,mpnet] [--tasks ...] [--store modules_store]

`--baselines` instead trains and scores the baselines every shipped module must beat, on the same
train -> validation split (training/baselines.py: the majority answer; TF-IDF + logistic regression
for sequence tasks, a linear window tagger for token tasks), writes bench/results/baselines.json and
prints the table of each tier's module against them (from quality.json and the emotion results); then
gives every stored module without them the `metrics.baselines` and `metrics.role` tmod-train writes
(`write_module_baselines`).

    .venv/bin/python bench/quality.py --baselines

`--intervals` gives each stored module whose baselines have no margin intervals the ones tmod-train
writes now (`write_margin_intervals`: the module scored again on its validation rows).

    .venv/bin/python bench/quality.py --intervals [TASK/VERSION ...]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.harness import machine_info  # noqa: E402

TASKS = {  # shipped task -> (dataset preset, headline metric, name in the table)
    "sentiment": ("sst2", "accuracy", "SST-2 accuracy"),
    "ner": ("conll2003", "f1", "CoNLL-2003 entity F1"),
    "acceptability": ("cola", "mcc", "CoLA Matthews corr."),
    "entailment": ("rte", "accuracy", "RTE accuracy"),
}
# backbone tiers: the named backbone, the store of its last-layer baselines and their version, the
# precision its modules were trained (and are scored) at, and the validation targets
TIERS = {
    "minilm": {"backbone": "minilm", "baselines": "runs/baselines", "last_layer": "last-layer", "precision": "fp32",
               "targets": {}},
    "mpnet": {"backbone": "mpnet", "baselines": "runs/baselines-mpnet", "last_layer": "mpnet-last-layer",
              "precision": "bf16",
              "targets": {"sentiment": 0.95, "ner": 0.90, "acceptability": 0.40, "entailment": 0.65}},
}


def rescore(store: Path, task: str, version: str | None, dataset: str, backbone: str = "minilm",
            precision: str = "fp32") -> dict | None:
    """Re-score a module through the served path; None when the store has no version of `task` for
    this backbone (or not the one asked for)."""
    from modules_store import ArtifactError, ModuleStore
    from training.cli import main

    if not ModuleStore(store).versions(task) or (version and version not in ModuleStore(store).versions(task)):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "eval.json"
        argv = ["eval", "--store", str(store), "--task", task, "--dataset", dataset, "--output", str(out), "--no-progress",
                "--backbone", backbone, "--precision", precision]
        try:
            main(argv + (["--version", version] if version else []))
        except ArtifactError as exc:
            if exc.reason == "other_backbone":
                return None
            raise
        result = json.loads(out.read_text())
    manifest = ModuleStore(store).read_manifest(task, result["version"])
    timing = manifest.training.get("timing", {})
    data = manifest.training.get("data", {})
    return {
        "version": result["version"], "metrics": result["metrics"], "precision": precision,
        "train_examples": data.get("train_examples"), "train_examples_in_file": data.get("train_examples_in_file"),
        "parameters": manifest.training.get("parameters"),
        "layers_read": manifest.layers,
        "train_seconds": timing.get("total_seconds"), "states_seconds": timing.get("states_seconds"),
        "epochs_run": manifest.training.get("epochs_run"),
        "command": manifest.training.get("command"),
    }


# shipped task -> the dataset preset its baselines train on and the metric they are compared by
BASELINE_TASKS = {**{task: (dataset, metric) for task, (dataset, metric, _) in TASKS.items()},
                  "emotion": ("goemotions", "f1_macro")}
CLEAR_MARGIN = 0.02  # a module is served by default on a tier only this far above the linear baseline
EMOTION_RESULTS = {"minilm": "emotion-served-minilm.json", "mpnet": "emotion-served-mpnet.json"}


def baselines(tasks: list[str]) -> dict:
    """Per task: the majority answer and the linear model, trained on the preset's train split and
    scored on its validation split (what the modules are scored on), with their training seconds
    (near 0 where the baselines cache, $TMOD_CACHE_DIR/baselines, held the run)."""
    import time

    from server.backbone.sources import default_cache_dir
    from training.assess import baseline_runs
    from training.data.presets import PRESETS, preset_spec

    out = {}
    for task in tasks:
        dataset, metric = BASELINE_TASKS[task]
        preset = PRESETS[dataset]
        train, validation = (preset_spec(preset, split).read() for split in ("train", "validation"))
        started = time.perf_counter()
        [(base, linear)] = baseline_runs(train, [validation], list(preset.labels),
                                         cache=default_cache_dir() / "baselines")
        seconds = time.perf_counter() - started
        out[task] = {"dataset": dataset, "metric": metric, "train_rows": len(train), "validation_rows": len(validation),
                     "majority": base[metric], "linear": linear[metric], "linear_model": linear["baseline"],
                     "seconds": seconds}
        print(f"{task}: majority {base[metric]:.4f}, {linear['baseline']} {linear[metric]:.4f} ({seconds:.0f} s)", flush=True)
    return out


def write_module_baselines(store: Path) -> None:
    """Give each stored module trained before tmod-train compared heads with baselines what tmod-train
    writes now: `metrics.role` (what its validation split chose) and `metrics.baselines` (the majority
    answer and the linear model trained on the rows its recorded settings select, document windows
    left out, scored on its validation split; the head's margins; the verdict). /v1/tasks shows them
    beside the head's numbers. Modules that have a verdict are left as they are; one
    compared before verdicts were written keeps its baselines' runs and gains the rest."""
    from modules_store import TaskType
    from server.backbone.sources import default_cache_dir
    from training.assess import against_baselines, baseline_runs, linear_baseline
    from training.metrics import validation_role
    from training.settings import TrainSettings
    from training.splits import resolve_data

    for path in sorted(store.glob("*/*/manifest.json")):
        manifest = json.loads(path.read_text())
        metrics, training = manifest.get("metrics", {}), manifest.get("training") or {}
        earlier = metrics.get("baselines", {})
        if "verdict" in earlier or metrics.get("split") != "validation" or not training.get("settings"):
            continue  # compared already, or nothing trained (an embedding module)
        kind = TaskType(manifest["task_type"])
        recorded = training["settings"]  # what its validation chose, as tmod-train says it
        role = validation_role(recorded.get("select", "best") == "best" and training.get("epochs_run", 2) > 1,
                               bool((manifest.get("decoding") or {}).get("thresholds")),
                               recorded.get("none_below") == "auto")
        head = {**metrics, "role": metrics.get("role", role)}
        if earlier:  # trained by a tmod-train that compared, before it wrote the verdict: its runs kept
            runs = [earlier["majority"], earlier[linear_baseline(kind)]]
        else:
            settings = TrainSettings(**{k: v for k, v in recorded.items() if k in TrainSettings.model_fields})
            data = resolve_data(settings)
            [runs] = baseline_runs(data.train, [data.validation], data.labels, settings.seed,
                                   default_cache_dir() / "baselines")
        head["baselines"] = against_baselines(runs, head, metrics["metric"], kind)
        manifest["metrics"] = head
        path.write_text(json.dumps(manifest, indent=2) + "\n")
        print(f"{manifest['task']}/{manifest['version']}: {head['baselines']['verdict']}", flush=True)


# how far a score measured again may stand from the recorded one (CPUs and library versions): 0.002, or two
# rows' worth where that is more (a tie flipped by another CPU's float sums); ner/3's window tagger fitted
# again scores 0.8701 against its recorded 0.8690
AGAIN, AGAIN_ROWS = 2e-3, 2.01


def write_margin_intervals(store: Path, modules: list[str] | None = None) -> None:
    """Give each stored module whose `metrics.baselines` has no margin intervals (written before
    tmod-train wrote them) what it writes now: each margin's paired bootstrap interval and the
    verdict that reads them. The module is scored again on its validation rows through the served
    path, at the precision it was trained at, and the baselines fitted again on its training rows
    (its recorded settings' rows; with document windows too where that is what reproduces the
    recorded linear score). The recorded scores and margins stay; a module whose scores here stand
    further from them than AGAIN is left as it is, and a smaller difference (another CPU's or
    library's answers) is said in `intervals`.
    `modules`: TASK/VERSION."""
    from modules_store import ModuleStore, TaskType
    from server.backbone import Backbone
    from server.backbone.sources import default_cache_dir, named_for
    from server.modules import load_module
    from training.assess import against_baselines, baseline_runs, head_answers
    from training.evaluate import score_module
    from training.settings import TrainSettings
    from training.splits import resolve_data
    from training.states import Split
    from training.trainer import add_document_windows

    backbones: dict = {}
    for path in sorted(store.glob("*/*/manifest.json")):
        manifest = json.loads(path.read_text())
        name, metrics = f"{manifest['task']}/{manifest['version']}", manifest.get("metrics", {})
        earlier = metrics.get("baselines") or {}
        if (modules and name not in modules) or not earlier.get("verdict") or metrics.get("split") != "validation" \
                or any(key.endswith("_interval") for key in earlier):
            continue
        recorded = manifest["training"]["settings"]
        settings = TrainSettings(**{k: v for k, v in recorded.items() if k in TrainSettings.model_fields})
        precision = settings.precision if settings.precision in ("bf16", "fp16") else "fp32"
        key = (manifest["backbone"]["name"], precision)
        if key not in backbones:
            backbone = Backbone.load(named_for(key[0]))
            backbones[key] = backbone if precision == "fp32" else backbone.use_backend("torch", precision)
        backbone = backbones[key]
        data = resolve_data(settings)
        module = load_module(ModuleStore(store), manifest["task"], manifest["version"], backbone)
        split, probabilities = Split(data.validation, module.head.labels, backbone), []
        metric, kind, labels = earlier["metric"], TaskType(manifest["task_type"]), module.head.labels
        rescored = score_module(split, module, progress=False, probabilities=probabilities)[metric]
        gold, answered = head_answers(split, probabilities, (manifest.get("decoding") or {}).get("thresholds"))

        def fit(train):
            """(the baselines fitted on `train`, {name: (its score here, its recorded score)}, the largest
            difference; inf where one was not trained here or then)."""
            runs = baseline_runs(train, [data.validation], labels, settings.seed, default_cache_dir() / "baselines",
                                 settings.class_weights == "balanced")[0]
            scores = {run["baseline"]: (run.get(metric), earlier.get(run["baseline"], {}).get(metric)) for run in runs}
            return runs, scores, max(abs(again - then) if None not in (again, then) else float("inf")
                                     for again, then in scores.values())

        runs, scores, off = fit(data.train)
        if off > 1e-9 and settings.document_windows:  # tmod-train fitted them on the windows too
            runs, scores, off = min((runs, scores, off), fit(add_document_windows(
                data.train, dict(data.provenance), backbone, settings.document_windows)), key=lambda fitted: fitted[2])
        scores = {"head": (rescored, earlier["head"]), **scores}
        if max(off, abs(rescored - earlier["head"])) > max(AGAIN, AGAIN_ROWS / len(gold)):
            print(f"{name}: left as it is: scored here (again, recorded) {scores}", flush=True)
            continue
        head = {**metrics, "role": metrics.get("role", earlier.get("role"))}
        # the recorded scores kept (what its run measured), each beside its answers fitted again
        runs = [{**earlier[run["baseline"]], "answers": run["answers"]} for run in runs]
        baselines = against_baselines(runs, head, metric, kind, paired=(gold, answered, labels), seed=settings.seed,
                                      balanced=settings.class_weights == "balanced")
        moved = [f"{what} {again:.4f} (recorded {then:.4f})" for what, (again, then) in scores.items()
                 if abs(again - then) > 1e-9]
        if moved:
            baselines["intervals"] += f"; the answers scored again for them: {', '.join(moved)}"
        metrics["baselines"] = baselines
        path.write_text(json.dumps(manifest, indent=2) + "\n")
        print(f"{name}: {baselines['verdict']}", flush=True)


def module_scores(results: Path) -> dict:
    """tier -> task -> (module version, validation metric) of the served modules, from quality.json
    and the served emotion results."""
    quality = json.loads((results / "quality.json").read_text())["tiers"]
    out = {}
    for tier, entry in quality.items():
        out[tier] = {task: (row["layermix"]["version"], row["layermix"]["metrics"][row["metric"]])
                     for task, row in entry["tasks"].items() if row.get("layermix")}
        emotion = results / EMOTION_RESULTS.get(tier, "")
        if emotion.is_file():  # bench/score_served_multilabel.py: the shipped thresholds' macro F1
            data = json.loads(emotion.read_text())
            out[tier]["emotion"] = (data["version"], data["f1_macro"])
    return out


def baseline_table(rows: dict, modules: dict) -> str:
    lines = ["| task (validation) | majority | linear baseline | " + " | ".join(
        f"{tier} module (margin over linear)" for tier in modules) + " |",
        "| --- | ---: | ---: | " + " | ".join("---:" for _ in modules) + " |"]
    for task, row in rows.items():
        cells = []
        for tier in modules:
            version, score = modules[tier].get(task, (None, None))
            if score is None:
                cells.append("not scored")
                continue
            margin = score - row["linear"]
            flag = "" if margin >= CLEAR_MARGIN else " **not clear**"
            cells.append(f"{100 * score:.1f} `{task}/{version}` ({100 * margin:+.1f}){flag}")
        lines.append(f"| {task}: {row['dataset']} {row['metric']} | {100 * row['majority']:.1f} | "
                     f"{100 * row['linear']:.1f} ({row['linear_model']}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default=str(REPO / "modules_store"), help="shipped store (layer-mix modules)")
    parser.add_argument("--tiers", default=",".join(TIERS), help=f"backbone tiers to re-score: {', '.join(TIERS)}")
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"rows to re-score: {', '.join(TASKS)} "
                        "(the others keep their earlier entry)")
    parser.add_argument("--results", default=str(REPO / "bench" / "results"), help="where finetune-*.json are and output goes")
    parser.add_argument("--baselines", action="store_true", help="train and score the baselines (majority, linear) "
                        "instead, write baselines.json, print each tier's modules against them and write each "
                        "stored module's metrics.baselines where it has none")
    parser.add_argument("--intervals", nargs="*", metavar="TASK/VERSION", default=None,
                        help="instead, give each stored module's baselines (or these modules') the margins' paired "
                             "bootstrap intervals where they have none: the module scored again on its validation rows")
    args = parser.parse_args()
    results = Path(args.results)
    if args.intervals is not None:
        write_margin_intervals(Path(args.store), args.intervals)
        return
    if args.baselines:
        record = {"split": "train -> validation", "machine": machine_info(), "clear_margin": CLEAR_MARGIN,
                  "command": "python bench/quality.py --baselines", "tasks": baselines(list(BASELINE_TASKS))}
        (results / "baselines.json").write_text(json.dumps(record, indent=2) + "\n")
        print(baseline_table(record["tasks"], module_scores(results)))
        write_module_baselines(Path(args.store))
        return
    previous = results / "quality.json"
    earlier = json.loads(previous.read_text()) if previous.is_file() else {}
    tiers = earlier.get("tiers", {})
    if "tasks" in earlier:  # a file from before the tiers: its rows are the MiniLM tier's
        tiers = {"minilm": {"backbone": "minilm", "machine": earlier.get("machine"), "tasks": earlier["tasks"]}}
    chosen_tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    # both lists checked before any scoring (minutes per tier)
    for tier in chosen_tiers:
        if tier not in TIERS:
            raise SystemExit(f"unknown tier {tier!r}; choose from {sorted(TIERS)}")
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        raise SystemExit(f"unknown tasks {unknown}; choose from {sorted(TASKS)}")
    for tier in chosen_tiers:
        rows = dict(tiers.get(tier, {}).get("tasks", {}))
        rows.update(score_tier(tier, Path(args.store), results, tasks, rows))
        tiers[tier] = {"backbone": TIERS[tier]["backbone"], "machine": machine_info(),
                       "tasks": {task: rows[task] for task in TASKS if task in rows}}
    out = {"split": "validation", "tiers": tiers}
    (results / "quality.json").write_text(json.dumps(out, indent=2) + "\n")
    text = "\n\n".join(f"**{name}**\n\n" + markdown(tier["tasks"]) for name, tier in tiers.items())
    (results / "quality.md").write_text(text + "\n")
    print(text)


def score_tier(tier: str, store: Path, results: Path, tasks: list[str], earlier: dict | None = None) -> dict:
    """The tier's rows for `tasks`; a baseline whose store is not on this machine (runs/ is not in
    the repository) keeps its entry from `earlier` (the previous quality.json's rows), which names
    the version and the command it was scored from."""
    config = TIERS[tier]
    baselines = REPO / config["baselines"]
    rows = {}
    for task in tasks:
        dataset, metric, title = TASKS[task]
        layermix = rescore(store, task, None, dataset, config["backbone"], config["precision"])
        last_layer = rescore(baselines, task, config["last_layer"], dataset, config["backbone"], config["precision"])
        if last_layer is None and not (baselines / task).is_dir():
            last_layer = (earlier or {}).get(task, {}).get("last_layer")
        target = config["targets"].get(task)
        if tier != "minilm":  # the full fine-tuning anchors were run on MiniLM only
            rows[task] = {"dataset": dataset, "metric": metric, "title": title, "layermix": layermix,
                          "last_layer": last_layer, "target": target,
                          "target_met": None if layermix is None or target is None
                          else layermix["metrics"][metric] >= target}
            continue
        finetune_file = results / f"finetune-{dataset}.json"
        finetune = json.loads(finetune_file.read_text()) if finetune_file.is_file() else None
        # the fine-tuning anchor may have used a training subset (CPU time); a layer-mix head trained
        # on the same subset (same seed, so the same rows) makes the comparison like for like
        settings = (finetune or {}).get("settings", {})
        subset = settings.get("train_rows_used")
        if subset and subset >= settings.get("train_rows_in_file", subset + 1):
            same_subset = layermix  # the anchor used every row: the shipped module is the match
        else:
            same_subset = rescore(baselines, task, f"subset-{subset}", dataset) if subset else None
            if same_subset is None and not (baselines / task).is_dir():
                same_subset = (earlier or {}).get(task, {}).get("layermix_same_subset_as_finetune")
        rows[task] = {"dataset": dataset, "metric": metric, "title": title, "layermix": layermix,
                      "last_layer": last_layer, "layermix_same_subset_as_finetune": same_subset,
                      "full_finetune": None if finetune is None else {
                          "value": finetune["validation_scores"].get(metric), "file": finetune_file.name,
                          "train_rows": finetune.get("settings", {}).get("train_rows_used"),
                          "train_seconds": finetune.get("train_seconds")}}
    return rows


def value(entry, metric):
    if not entry:
        return "not run"
    v = entry["metrics"][metric] if "metrics" in entry else entry["value"]
    return "n/a" if v is None else f"{100 * v:.1f}"


def markdown(rows: dict) -> str:
    if any("target" in row for row in rows.values()):
        return markdown_tier(rows)
    lines = ["| task (validation) | layer-mix (shipped, all train rows) | last layer only (all rows) | "
             "full fine-tune (subset) | layer-mix on that subset | train rows of the subset | layer-mix params | "
             "states read | layer-mix train time |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for task, row in rows.items():
        lm, ft = row["layermix"], row["full_finetune"]
        lines.append(
            f"| {task}: {row['title']} | {value(lm, row['metric'])} | {value(row['last_layer'], row['metric'])} | "
            f"{value(ft, row['metric'])} | {value(row['layermix_same_subset_as_finetune'], row['metric'])} | "
            f"{(ft or {}).get('train_rows') or 'n/a'} | {lm['parameters']:,} | {lm['layers_read']} | "
            f"{lm['train_seconds'] / 60:.1f} min |" if lm else f"| {task} | not trained | | | | | | | |")
    return "\n".join(lines)


def markdown_tier(rows: dict) -> str:
    """A tier without fine-tuning anchors: shipped layer-mix, its training rows, the last-layer
    baseline on the same rows, and the issue's target."""
    lines = ["| task (validation) | layer-mix (shipped) | train rows used (document windows counted) / rows in file | "
             "last layer only (same rows) | target | met | layer-mix params | states read | layer-mix train time |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: |"]
    for task, row in rows.items():
        lm, metric, target = row["layermix"], row["metric"], row["target"]
        if not lm:
            lines.append(f"| {task}: {row['title']} | not trained | | | | | | | |")
            continue
        met = "yes" if row["target_met"] else "**no**"
        lines.append(
            f"| {task}: {row['title']} | {value(lm, metric)} | {lm['train_examples']:,} / {lm['train_examples_in_file']:,} | "
            f"{value(row['last_layer'], metric)} | {'' if target is None else f'>= {100 * target:.1f}'} | "
            f"{met if target is not None else ''} | {lm['parameters']:,} | {lm['layers_read']} | "
            f"{lm['train_seconds'] / 60:.1f} min |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
