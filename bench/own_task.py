"""Bring-your-own-task results: the reports of `tmod-train` runs on public data sets nobody here
wrote (their official test splits kept out of training and selection) gathered into one JSON with
where they ran: head on validation (chose the epoch) and test (chose nothing), the baselines on the
test split and the head's margins, per run.

    python bench/own_task.py --out bench/results/own-task.json RUN_DIR [RUN_DIR ...]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import machine_info  # noqa: E402

SOURCES = {  # what each task's files are (the data is not in the repository)
    "trec": "TREC question classification (Li and Roth 2002), 6 coarse classes: TREC.train (5,452, official "
            "train_5500; validation carved by --split 0.1, seed 0) and TREC.test (500, official TREC-10 test), from "
            "github.com/harvardnlp/sent-conv-torch data/raw",
    "wnut17": "WNUT 2017 Emerging and Rare Entities (Derczynski et al. 2017), 6 entity types, BIO: wnut17train.conll "
              "(3,394 sentences), emerging.dev.conll (1,009, official dev = validation), emerging.test.annotated "
              "(1,287, official test), from github.com/leondz/emerging_entities_17",
}


def headline(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float, str)) or k in ("per_type", "none_of_these")}


def summarise(run_dir: Path) -> dict:
    report = json.loads((run_dir / "report" / "metrics.json").read_text())
    baselines = report["baselines"]
    metric = baselines["metric"]
    return {
        "task": report["task"], "version": report["version"], "command": report["command"],
        "source": SOURCES.get(report["task"]), "metric": metric,
        "validation": headline(report["validation"]), "test": headline(report.get("test", {})),
        "baselines": {name: ({k: v for k, v in value.items() if not isinstance(v, dict)} | (
            {"per_type": value["per_type"]} if "per_type" in value else {}) if isinstance(value, dict) else value)
            for name, value in baselines.items()},
        "best_epoch": report["best_epoch"], "epochs_run": report["epochs_run"],
        "layer_weights": report["layer_weights"], "parameters": report["parameters"],
        "timing": report["timing"], "data": report["data"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="tmod-train run folders (their report/metrics.json)")
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write, e.g. bench/results/own-task.json")
    parser.add_argument("--note", default="", help="what the runs are (recorded as is)")
    args = parser.parse_args()
    runs = [summarise(run) for run in args.runs]
    result = {"benchmark": "own_task", "note": args.note, "machine": machine_info("cpu"), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for r in runs:
        b = r["baselines"]
        linear = "tfidf_logreg" if "tfidf_logreg" in b else "window_tagger"
        print(f"{r['task']} {r['version']}: validation {r['metric']} {r['validation'][r['metric']]:.4f}, test "
              f"{r['test'].get(r['metric'], float('nan')):.4f}; majority {b['majority'][r['metric']]:.4f}, "
              f"{linear} {b[linear][r['metric']]:.4f} (margin {b['margin_over_' + linear]:+.4f})")


if __name__ == "__main__":
    main()
