"""Quality table of the shipped modules: layer-mix vs last-layer-only vs full fine-tuning.

Every layer-mix and last-layer number is re-scored here from the artifact through the served path
(`tmod-train eval`), never copied from a manifest; full fine-tuning numbers come from
`bench/finetune_full.py`'s JSON (bench/results/finetune-<dataset>.json).

    .venv/bin/python bench/quality.py [--store modules_store] [--baselines runs/baselines]
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

from bench.environment import machine_info  # noqa: E402

TASKS = {  # shipped task -> (dataset preset, headline metric, name in the table)
    "sentiment": ("sst2", "accuracy", "SST-2 accuracy"),
    "ner": ("conll2003", "f1", "CoNLL-2003 entity F1"),
    "acceptability": ("cola", "mcc", "CoLA Matthews corr."),
}


def rescore(store: Path, task: str, version: str | None, dataset: str) -> dict | None:
    from modules_store import ModuleStore
    from training.cli import main

    if not ModuleStore(store).versions(task) or (version and version not in ModuleStore(store).versions(task)):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "eval.json"
        argv = ["eval", "--store", str(store), "--task", task, "--dataset", dataset, "--output", str(out), "--no-progress"]
        main(argv + (["--version", version] if version else []))
        result = json.loads(out.read_text())
    manifest = ModuleStore(store).read_manifest(task, result["version"])
    timing = manifest.training.get("timing", {})
    return {
        "version": result["version"], "metrics": result["metrics"],
        "parameters": manifest.training.get("parameters"),
        "layers_read": manifest.layers,
        "train_seconds": timing.get("total_seconds"), "states_seconds": timing.get("states_seconds"),
        "epochs_run": manifest.training.get("epochs_run"),
        "command": manifest.training.get("command"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default=str(REPO / "modules_store"), help="shipped store (layer-mix modules)")
    parser.add_argument("--baselines", default=str(REPO / "runs" / "baselines"),
                        help="store of the last-layer-only baselines (training/train_shipped.sh writes it)")
    parser.add_argument("--results", default=str(REPO / "bench" / "results"), help="where finetune-*.json are and output goes")
    args = parser.parse_args()
    results = Path(args.results)
    rows = {}
    for task, (dataset, metric, title) in TASKS.items():
        layermix = rescore(Path(args.store), task, None, dataset)
        last_layer = rescore(Path(args.baselines), task, "last-layer", dataset)
        finetune_file = results / f"finetune-{dataset}.json"
        finetune = json.loads(finetune_file.read_text()) if finetune_file.is_file() else None
        # the fine-tuning anchor may have used a training subset (CPU time); a layer-mix head trained
        # on the same subset (same seed, so the same rows) makes the comparison like for like
        settings = (finetune or {}).get("settings", {})
        subset = settings.get("train_rows_used")
        if subset and subset >= settings.get("train_rows_in_file", subset + 1):
            same_subset = layermix  # the anchor used every row: the shipped module is the match
        else:
            same_subset = rescore(Path(args.baselines), task, f"subset-{subset}", dataset) if subset else None
        rows[task] = {"dataset": dataset, "metric": metric, "title": title, "layermix": layermix,
                      "last_layer": last_layer, "layermix_same_subset_as_finetune": same_subset,
                      "full_finetune": None if finetune is None else {
                          "value": finetune["validation_scores"].get(metric), "file": finetune_file.name,
                          "train_rows": finetune.get("settings", {}).get("train_rows_used"),
                          "train_seconds": finetune.get("train_seconds")}}
    out = {"machine": machine_info(), "split": "validation", "tasks": rows}
    (results / "quality.json").write_text(json.dumps(out, indent=2) + "\n")
    (results / "quality.md").write_text(markdown(rows) + "\n")
    print(markdown(rows))


def markdown(rows: dict) -> str:
    def value(entry, metric):
        if not entry:
            return "not run"
        v = entry["metrics"][metric] if "metrics" in entry else entry["value"]
        return "n/a" if v is None else f"{100 * v:.1f}"

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


if __name__ == "__main__":
    main()
