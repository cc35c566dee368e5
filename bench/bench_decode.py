#!/usr/bin/env python
"""Benchmark: decode time, the per-row per-token decoder (before issue 13) against the vectorised one.

Batches: CoNLL-2003 validation sentences, `--batch` (128) rows each, tokenized by the real
all-MiniLM-L6-v2 tokenizer; logits: the shipped `ner` module's (9 BIO tags) on those batches, so
entities are as dense as in real answers. Also a sentence classification decode: the shipped
`sentiment` module's logits (2 labels) on the same rows.

Timed per batch (median of `--repeats`, the variants interleaved in each repeat), host CPU, one
torch thread:
- `old`: the per-row, per-token decoder (tests/test_decode.py keeps it as the oracle of the equality tests,
  tagging under the BIO rules in plain Python since issue 39);
- `new`: server/heads/decode.py, the batch's token arrays built on the way (what an eager decode
  of a fresh batch pays);
- `new_arrays_ready`: the same with the token arrays already built (`TokenBatch.token_arrays`,
  which a batch preparation stage can do while the device runs the previous batch);
- `token_arrays`: building them alone.
Every batch's answers are checked equal (old == new) before timing.

    .venv/bin/python bench/bench_decode.py        # -> bench/results/decode-cpu.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.environment import machine_info  # noqa: E402

import torch  # noqa: E402


def timed(fn, before=None) -> float:
    if before is not None:
        before()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Decode time: the old per-token decoder against the vectorised one")
    p.add_argument("--batch", type=int, default=128, help="rows per batch")
    p.add_argument("--batches", type=int, default=8, help="batches (consecutive CoNLL validation sentences)")
    p.add_argument("--repeats", type=int, default=30, help="timed repeats per batch and variant")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "decode-cpu.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from modules_store import DEFAULT_STORE, ModuleStore, TaskType
    from server.backbone import Backbone
    from server.engine import Engine
    from server.heads.decode import decode
    from server.modules import load_module
    from tests.test_decode import reference_decode
    from training.data import default_data_dir, read_conll

    backbone = Backbone.load()
    store = ModuleStore(DEFAULT_STORE)
    modules = {task: load_module(store, task, None, backbone) for task in ("ner", "sentiment")}
    engine = Engine(backbone)
    texts = read_conll(default_data_dir() / "conll2003" / "validation.txt").texts()

    times: dict[str, dict[str, list[float]]] = {"ner": {}, "sentiment": {}}
    shapes, entities = [], 0
    for b in range(args.batches):
        batch = backbone.text.tokenize(texts[b * args.batch:(b + 1) * args.batch], truncate=True)
        with torch.inference_mode():
            logits, _ = engine.run(batch, modules)
        shapes.append(list(batch.input_ids.shape))
        for task, module in modules.items():
            head = module.head
            new = decode(head.task_type, head.labels, logits[task], batch)
            if new != reference_decode(head.task_type, head.labels, logits[task], batch):
                raise SystemExit(f"batch {b}, {task}: the decoders disagree")
            entities += sum(len(a.get("entities", [])) for a in new)

            def fresh_arrays():
                batch.arrays = None

            variants = {
                "old": (lambda: reference_decode(head.task_type, head.labels, logits[task], batch), None),
                "new": (lambda: decode(head.task_type, head.labels, logits[task], batch), fresh_arrays),
                "new_arrays_ready": (lambda: decode(head.task_type, head.labels, logits[task], batch), None),
            }
            if head.task_type == TaskType.token_classification:
                variants["token_arrays"] = (batch.token_arrays, fresh_arrays)
            samples = {name: [] for name in variants}
            for _ in range(args.repeats):
                for name, (fn, before) in variants.items():
                    samples[name].append(timed(fn, before))
                batch.token_arrays()  # `new_arrays_ready` finds them built
            for name, values in samples.items():
                times[task].setdefault(name, []).append(statistics.median(values))

    results = {}
    for task, per_variant in times.items():
        ms = {name: round(1e3 * statistics.mean(values), 3) for name, values in per_variant.items()}
        results[task] = {
            "ms_per_batch": ms,
            "speedup_old_over_new": round(ms["old"] / ms["new"], 1),
            "speedup_old_over_new_arrays_ready": round(ms["old"] / ms["new_arrays_ready"], 1),
        }
    record = {
        "benchmark": "bench/bench_decode.py",
        "machine": machine_info("cpu"),
        "settings": {"batch_rows": args.batch, "batches": args.batches, "repeats": args.repeats,
                     "threads": args.threads, "data": "CoNLL-2003 validation, consecutive sentences",
                     "logits": "shipped ner (9 BIO tags) and sentiment (2 labels) modules on all-MiniLM-L6-v2"},
        "batch_shapes": shapes,
        "entities_decoded_per_pass": entities,
        "answers_equal_old_and_new": True,  # checked above for every batch and task, else no record
        "timing": "per batch: median over repeats; then the mean over batches (ms, wall clock)",
        "results": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
