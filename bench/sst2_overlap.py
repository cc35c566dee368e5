"""SST-2 validation rows split by whether their text occurs verbatim inside a training row (the split
is carved from SST-2's phrase-level training rows, a leak bag-of-words models exploit): the linear
baseline (training/baselines.py) against the shipped sentiment module on each part, row by row.

Both answer every validation row once (the baseline fitted once on all training rows); on each part
the accuracies, the paired counts (rows only the module gets right, only the baseline) and McNemar's
exact test on those discordant rows (two-sided binomial, p = 0.5): how surely the difference is not
chance on that many rows.

    .venv/bin/python bench/sst2_overlap.py minilm     # -> bench/results/sst2-overlap-minilm.json
    .venv/bin/python bench/sst2_overlap.py mpnet      # (bf16, as served on this CPU)
"""
import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.harness import machine_info  # noqa: E402
from training.data.presets import PRESETS, preset_spec  # noqa: E402
from training.baselines import tfidf_logreg_predictions  # noqa: E402
from server.backbone import Backbone  # noqa: E402
from server.engine import Engine  # noqa: E402
from server.modules import load_module  # noqa: E402
from modules_store import DEFAULT_STORE, ModuleStore  # noqa: E402


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value: the discordant rows as a binomial(n, 1/2)."""
    n, k = only_a + only_b, min(only_a, only_b)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired(gold: list, module: list, baseline: list) -> dict:
    m_ok = [m == g for m, g in zip(module, gold)]
    b_ok = [b == g for b, g in zip(baseline, gold)]
    only_m = sum(1 for m, b in zip(m_ok, b_ok) if m and not b)
    only_b = sum(1 for m, b in zip(m_ok, b_ok) if b and not m)
    n = len(gold)
    return {"rows": n, "module_accuracy": sum(m_ok) / n, "tfidf_logreg_accuracy": sum(b_ok) / n,
            "margin_points": 100 * (sum(m_ok) - sum(b_ok)) / n,
            "only_module_right": only_m, "only_baseline_right": only_b,
            "mcnemar_exact_p": mcnemar_exact(only_m, only_b)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tier", choices=("minilm", "mpnet"), help="the shipped sentiment module of this tier")
    tier = parser.parse_args().tier
    preset = PRESETS["sst2"]
    train, val = (preset_spec(preset, s).read().examples for s in ("train", "validation"))
    joined = "\n" + "\n".join(e.text.strip() for e in train) + "\n"
    inside = [e.text.strip() in joined for e in val]
    bb = Backbone.load(tier)
    if tier == "mpnet":
        bb = bb.use_backend("torch", "bf16", None, None)
    module = load_module(ModuleStore(DEFAULT_STORE), "sentiment", None, bb)
    engine = Engine(bb)
    pred = []
    with torch.inference_mode():
        for i in range(0, len(val), 64):
            batch = bb.text.tokenize([e.text for e in val[i:i + 64]], truncate=True)
            pred += [module.head.labels[j] for j in engine.logits(batch, {"s": module})["s"].argmax(-1).tolist()]
    lin = tfidf_logreg_predictions([e.text for e in train], [e.label for e in train], [e.text for e in val])
    out = {"tier": tier, "version": module.version, "machine": machine_info(),
           "command": f"python bench/sst2_overlap.py {tier}"}
    for name, keep in (("all", [True] * len(val)), ("inside_a_train_row", inside),
                       ("not_inside", [not x for x in inside])):
        rows = [i for i, k in enumerate(keep) if k]
        out[name] = paired([val[i].label for i in rows], [pred[i] for i in rows], [lin[i] for i in rows])
        print(name, out[name], flush=True)
    Path(__file__).resolve().parent.joinpath("results", f"sst2-overlap-{tier}.json").write_text(
        json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
