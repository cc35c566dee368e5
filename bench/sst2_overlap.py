"""SST-2 validation rows split by whether their text occurs verbatim inside a training row (the split
is carved from SST-2's phrase-level training rows, a leak bag-of-words models exploit): the linear
baseline (training/baselines.py) against the shipped sentiment module on each part.

    .venv/bin/python bench/sst2_overlap.py minilm     # -> bench/results/sst2-overlap-minilm.json
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.harness import machine_info  # noqa: E402
from training.data import PRESETS, preset_spec  # noqa: E402
from training.baselines import tfidf_logreg  # noqa: E402
from training.metrics import classification_scores  # noqa: E402
from server.backbone import Backbone  # noqa: E402
from server.engine import Engine  # noqa: E402
from server.modules import load_module  # noqa: E402
from modules_store import DEFAULT_STORE, ModuleStore  # noqa: E402

tier = sys.argv[1]
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
out = {"tier": tier, "version": module.version, "machine": machine_info(),
       "command": f"python bench/sst2_overlap.py {tier}"}
for name, keep in (("all", [True] * len(val)), ("inside_a_train_row", inside), ("not_inside", [not x for x in inside])):
    rows = [i for i, k in enumerate(keep) if k]
    gold = [val[i].label for i in rows]
    lin = tfidf_logreg([e.text for e in train], [e.label for e in train], [val[i].text for i in rows], gold,
                       labels=list(preset.labels))
    mod = classification_scores(gold, [pred[i] for i in rows], list(preset.labels))
    out[name] = {"rows": len(rows), "module_accuracy": mod["accuracy"], "tfidf_logreg_accuracy": lin["accuracy"]}
    print(name, out[name], flush=True)
Path(__file__).resolve().parent.joinpath("results", f"sst2-overlap-{tier}.json").write_text(json.dumps(out, indent=1) + "\n")
