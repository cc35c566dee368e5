"""Held-out search of a pair task's head settings (RTE entailment), so the shipped recipe is chosen
without looking at the validation split it is reported on.

RTE's 2,490 training pairs are split once (seed 0) into 80% for training and 20% held out
(runs/rte-split/{train,holdout}.tsv, made from ../shared/data, never copied into the repo). Each
setting trains a layer-mix head on the 80% with `tmod-train layermix` and is scored on the held-out
20% after every epoch; the best (setting, epoch) by held-out accuracy is the recipe then trained on
all training pairs with that fixed epoch count (`--select last`, training/train_shipped*.sh) and
reported on RTE's validation split. Writes bench/results/holdout-search-<backbone>.{json,md}.

    .venv/bin/python bench/holdout_search.py --backbone minilm|mpnet [--settings g1,n1,...]
"""
from __future__ import annotations

import argparse
import csv
import json
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.environment import machine_info  # noqa: E402
from training.data import default_data_dir  # noqa: E402

SPLIT = REPO / "runs" / "rte-split"
# name -> tmod-train layermix options searched (mean pooling with attention is the first recipe's shape)
SETTINGS = {
    "g1": "--pooling pair --lr 1e-4 --dropout 0.3",
    "g2": "--pooling pair --lr 3e-4 --dropout 0.3 --weight-decay 0.1",
    "g3": "--pooling pair --lr 1e-4 --dropout 0.3 --k 32",
    "g4": "--pooling pair --lr 3e-5 --dropout 0.1",
    "g5": "--pooling mean --lr 1e-4 --dropout 0.3",
    "g6": "--pooling pair --lr 1e-3 --dropout 0.1",
    "n1": "--no-attention --pooling pair --lr 1e-3 --dropout 0.1",
    "n2": "--no-attention --pooling pair --lr 3e-4 --dropout 0.3",
    "n3": "--no-attention --pooling pair --lr 1e-4 --dropout 0.1",
    "n4": "--no-attention --pooling mean --lr 3e-4 --dropout 0.3",
}
BACKBONE_OPTIONS = {"minilm": ["--state-cache"],
                    "mpnet": ["--precision", "bf16", "--state-cache", "--layers", "0,2,4,6,8,10,12"]}


def make_split(data_dir: Path, holdout: float = 0.2, seed: int = 0) -> dict:
    """Write the split; -> its sizes and seed, for the results."""
    with open(data_dir / "rte" / "train.tsv", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    header, body = rows[0], rows[1:]
    random.Random(seed).shuffle(body)
    n = int(len(body) * holdout)
    SPLIT.mkdir(parents=True, exist_ok=True)
    for name, part in (("holdout", body[:n]), ("train", body[n:])):
        with open(SPLIT / f"{name}.tsv", "w", newline="") as f:
            writer = csv.writer(f, delimiter="\t", quoting=csv.QUOTE_NONE, escapechar="\\", lineterminator="\n")
            writer.writerow(header)
            writer.writerows(part)
    return {"train": len(body) - n, "holdout": n, "seed": seed, "source": "rte/train.tsv"}


def run_setting(backbone: str, name: str, options: str) -> dict:
    run_dir = REPO / "runs" / "rte-grid" / f"{backbone}-{name}"
    command = [sys.executable, "-m", "training.cli", "layermix", "--backbone", backbone, "--threads", "1",
               "--train", str(SPLIT / "train.tsv"), "--validation", str(SPLIT / "holdout.tsv"),
               "--text-column", "sentence1", "--pair-column", "sentence2", "--label-column", "label",
               "--labels", "entailment,not_entailment", "--metric", "accuracy", *BACKBONE_OPTIONS[backbone],
               *options.split(), "--task", "entailment", "--version", f"grid-{name}",
               "--store", str(REPO / "runs" / "rte-grid-store" / backbone), "--run-dir", str(run_dir),
               "--report-dir", str(run_dir / "report"), "--no-progress", "--overwrite"]
    if not (run_dir / "report" / "metrics.json").is_file():
        subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    history = json.loads((run_dir / "report" / "metrics.json").read_text())["history"]
    curve = [h["accuracy"] for h in history]
    best = max(range(len(curve)), key=lambda i: curve[i])
    return {"setting": name, "options": options, "holdout_accuracy_per_epoch": curve,
            "best_epoch": best + 1, "best_holdout_accuracy": curve[best]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backbone", choices=sorted(BACKBONE_OPTIONS), required=True)
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated names of SETTINGS")
    args = p.parse_args()
    split = make_split(default_data_dir())
    rows = [run_setting(args.backbone, name, SETTINGS[name]) for name in args.settings.split(",")]
    chosen = max(rows, key=lambda r: r["best_holdout_accuracy"])
    result = {"benchmark": "holdout_search", "backbone": args.backbone, "machine": machine_info(),
              "split": split,
              "command": " ".join(["python", "bench/holdout_search.py", *sys.argv[1:]]),
              "settings": rows, "chosen": chosen}
    out = REPO / "bench" / "results" / f"holdout-search-{args.backbone}"
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Held-out search: entailment (RTE) on {args.backbone}", "",
             f"Trained on {split['train']:,} of RTE's training pairs, scored on the other {split['holdout']:,} "
             f"(seed {split['seed']}) after every epoch; RTE's validation split is not used here.", "",
             "| setting | options | held-out accuracy per epoch | best (epoch) |", "| --- | --- | --- | ---: |"]
    for r in rows:
        curve = ", ".join(f"{a * 100:.1f}" for a in r["holdout_accuracy_per_epoch"])
        lines.append(f"| {r['setting']} | `{r['options']}` | {curve} | {r['best_holdout_accuracy'] * 100:.1f} "
                     f"({r['best_epoch']}) |")
    lines += ["", f"Chosen: {chosen['setting']} (`{chosen['options']}`), {chosen['best_epoch']} epoch(s)."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
