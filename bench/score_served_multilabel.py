"""Re-score a shipped multi-label module through a real tmod-serve: every validation text goes to
/v1/infer, the labels the server answers (at the module's shipped thresholds) are compared with the
gold labels; macro and micro F1 (training/metrics.py `multilabel_scores`) and per label.

    .venv/bin/python bench/score_served_multilabel.py --backbone minilm --precision fp32
    .venv/bin/python bench/score_served_multilabel.py --backbone mpnet --precision bf16

The server runs the store's version for that backbone at the precision the module was trained at
(as bench/quality.py scores the other shipped modules). Writes bench/results/<task>-served-<backbone>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.environment import machine_info  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="emotion")
    parser.add_argument("--dataset", default="goemotions", help="multi-label preset whose validation split is scored")
    parser.add_argument("--backbone", default="minilm")
    parser.add_argument("--precision", default="fp32", help="tmod-serve --precision (the module's training precision)")
    parser.add_argument("--store", default=str(REPO / "modules_store"))
    parser.add_argument("--batch", type=int, default=64, help="inputs per request")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    from tests.helpers import start_tmod_serve
    from training.data import PRESETS, preset_spec
    from training.metrics import multilabel_scores

    data = preset_spec(PRESETS[args.dataset], "validation").read()
    url, process = start_tmod_serve(["--backbone", args.backbone, "--precision", args.precision, "--store", args.store,
                                     "--tasks", args.task, "--threads", str(args.threads), "--max-inputs", str(args.batch)],
                                    {**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        info = httpx.get(f"{url}/v1/tasks/{args.task}", timeout=60).json()
        labels = info["labels"]
        index = {label: i for i, label in enumerate(labels)}
        gold = np.zeros((len(data), len(labels)), dtype=bool)
        pred = np.zeros_like(gold)
        started = time.perf_counter()
        with httpx.Client(base_url=url, timeout=600) as client:
            for start in range(0, len(data), args.batch):
                rows = data.examples[start:start + args.batch]
                response = client.post("/v1/infer", params={"tasks": args.task},
                                       json={"inputs": [ex.text for ex in rows], "truncate": True})
                response.raise_for_status()
                for r, (ex, result) in enumerate(zip(rows, response.json()["results"])):
                    gold[start + r, [index[label] for label in ex.label]] = True
                    pred[start + r, [index[label] for label in result[args.task]["labels"]]] = True
        seconds = time.perf_counter() - started
    finally:
        process.terminate()
        process.wait(timeout=60)
    scores = multilabel_scores(gold, pred, labels)
    manifest = info["manifest"]
    result = {
        "what": f"{args.task}/{info['version']} re-scored through a real tmod-serve (/v1/infer, shipped thresholds) "
                f"on the {args.dataset} validation split",
        "command": " ".join([".venv/bin/python", "bench/score_served_multilabel.py", *sys.argv[1:]]),
        "task": args.task, "version": info["version"], "backbone": args.backbone, "precision": args.precision,
        "validation_file": data.source, "examples": len(data),
        "f1_macro": scores["f1_macro"], "f1_micro": scores["f1_micro"],
        "precision_micro": scores["precision_micro"], "recall_micro": scores["recall_micro"],
        "manifest_f1_macro": manifest["metrics"].get("f1_macro"), "manifest_f1_micro": manifest["metrics"].get("f1_micro"),
        "threshold_rule": manifest["decoding"].get("threshold_rule"), "thresholds": manifest["decoding"].get("thresholds"),
        "per_label": scores["per_label"], "seconds": round(seconds, 1),
        "environment": machine_info(),
    }
    output = Path(args.output or REPO / "bench" / "results" / f"{args.task}-served-{args.backbone}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("task", "version", "backbone", "f1_macro", "f1_micro",
                                             "manifest_f1_macro", "manifest_f1_micro", "seconds")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
