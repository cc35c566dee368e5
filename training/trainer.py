"""Train a layer-mix head on a frozen backbone and write it as a served module plus a report.

The head is trained through the same start/consume/finish path the server runs; only the source
of the backbone states differs (a cache, or a fresh backbone pass per batch). The artifact's
metrics are re-measured at the end through the served path (Engine.logits on the real backbone).
"""
from __future__ import annotations

import copy
import math
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.utils.class_weight import compute_class_weight
from tqdm.auto import tqdm

from modules_store import ModuleStore, TaskType, misplaced_store
from server import __version__
from server.backbone import Backbone
from server.backbone.sources import default_cache_dir
from server.backbone.tokens import IDS
from server.heads import Head
from server.heads.base import head_forward
from server.heads.layermix import LayerMixConfig, LayerMixHead
from server.heads.mtb import MTBHead
from server.modules import LoadedModule, count_parameters, load_module, save_module
from server.probe import probe_module
from training.data.conll import document_windows
from training.data.examples import LabelledData
from training.data.files import UsageError
from training.data.word_tags import IGNORE_INDEX
from training import serving
from training.progress import progress_of
from training.splits import Splits, resolve_data
from training.distill import DistillTargets, teacher_words
from training.assess import assess, linear_baseline
from training.evaluate import predictions, score, score_module
from training.metrics import answered_scores, choose_none_threshold, choose_thresholds, rows_seen, validation_role
from training.report import write_report
from training.runs import RunOutputs, save_as_free_version, stored_name
from training.settings import TrainSettings, check_layers, pick_device, set_threads
from training.states import CachedStates, RecomputedStates, Split, free_memory

@dataclass
class TrainResult:
    task: str
    version: str
    artifact: Path
    report_dir: Path
    metrics: dict  # validation metrics through the served path
    history: list[dict] = field(default_factory=list)
    layer_weights: dict[int, float] = field(default_factory=dict)
    training: dict = field(default_factory=dict)
    decoding: dict = field(default_factory=dict)  # the manifest's answer defaults (multi-label thresholds)
    assessment: dict = field(default_factory=dict)  # baselines and per-class / per-type scores (training/assess.py)
    request: str = ""  # a request that queries the new task beside the loaded ones
    loaded_into: str | None = None  # the server it was hot-loaded into
    serve: str = ""  # else the tmod-serve command that serves it


# ---- data ----------------------------------------------------------------------------------
def add_document_windows(train: LabelledData, provenance: dict, backbone: Backbone, windows: list[int]) -> LabelledData:
    """The training sentences plus the training file's documents read in windows of each length in
    `windows` (training/data/conll.py document_windows), counted in `provenance`."""
    if train.task_type != TaskType.token_classification:
        raise ValueError("--document-windows: only token tasks read from a CoNLL file have documents")
    added = document_windows(provenance["train_file"], backbone.text, windows)
    # only windows of training words: with --split (or --max-train) the file's other sentences are
    # validation's, test's or left out, and a window holding one would teach what is then scored
    trained = {ex.file_offset + w for ex in train.examples for w in range(len(ex.words))}
    added = {w: [ex for ex in examples if all(ex.file_offset + k in trained for k in range(len(ex.words)))]
             for w, examples in added.items()}
    provenance["document_window_examples"] = {str(w): len(examples) for w, examples in added.items()}
    tqdm.write("--document-windows: " + ", ".join(f"{len(added[w])} windows of {w} word pieces" for w in windows)
               + f" of the training documents, beside their {len(train)} sentences", file=sys.stderr)
    examples = [*train.examples, *(ex for w in windows for ex in added[w])]
    provenance["train_examples"] = len(examples)
    return LabelledData(train.task_type, examples, train.source, train.has_pairs)


# ---- the model -------------------------------------------------------------------------------
def build_head(s: TrainSettings, task_type: TaskType, labels: list[str], backbone: Backbone) -> Head:
    """A fresh head of the kind `s.kind` (layermix, mtb, lora-mtb) for this task and backbone."""
    if s.kind == "layermix":
        layers = s.layers if s.layers is not None else list(range(backbone.num_layers + 1))
        check_layers(layers, backbone, "--layers")
        config = LayerMixConfig(
            task_type=task_type, num_labels=len(labels), hidden_size=backbone.hidden_size, layers=layers,
            project_dim=s.project_dim, alpha=s.alpha, cutoff=s.cutoff, attention_heads=s.attention_heads,
            dropout=s.dropout, encoder_layers=s.encoder_layers, ffn_dim=s.ffn_dim, positional=s.positional,
            max_positions=backbone.max_tokens, casing=s.casing, pooling=s.pooling,
            attention=s.attention,
        )
        return LayerMixHead(config, labels)
    blocks = backbone.num_layers
    if s.blocks > blocks or (s.source_layer or 0) + s.blocks > blocks:
        raise UsageError(f"--blocks {s.blocks}" + (f" from --source-layer {s.source_layer}" if s.source_layer else "")
                         + f": {backbone.name} has {blocks} blocks (state N is the input of block N + 1), so at most "
                         + (f"--source-layer {blocks - s.blocks}" if s.blocks <= blocks else f"--blocks {blocks}"))
    options = dict(num_blocks=s.blocks, source_layer=s.source_layer, pooling=s.pooling, dropout=s.dropout,
                   casing=s.casing)
    if s.kind == "mtb":
        return MTBHead.from_backbone(backbone, task_type, labels, **options)
    from training.lora import TrainableLoraMTB  # here only: peft is needed for LoRA heads alone

    return TrainableLoraMTB.from_backbone(backbone, task_type, labels, rank=s.rank, lora_alpha=s.lora_alpha,
                                          targets=s.targets, **options)


def training_states(head: Head) -> list[int]:
    """States to feed while training: every state a layer-mix head may still weigh (the cutoff
    moves as p learns), or the fixed states other kinds read."""
    return head.config.layers if isinstance(head, LayerMixHead) else head.layers_read()


def layer_distribution(head: Head) -> dict[int, float]:
    """The weight each state gets: the learned p~ for layer-mix, 1 for the state an MTB reads."""
    if isinstance(head, LayerMixHead):
        return dict(zip(head.config.layers, head.mix_weights().detach().cpu().tolist()))
    return {index: 1.0 for index in head.layers_read()}


def task_loss(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy over one label (class ids; `weights`: one per class, `class_weights`), or binary
    cross-entropy per label (multi-hot float targets: multi-label tasks, one sigmoid each)."""
    if targets.is_floating_point():
        return F.binary_cross_entropy_with_logits(logits.float(), targets)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), weight=weights,
                           ignore_index=IGNORE_INDEX)


def class_weights(split: Split, s: TrainSettings, device) -> torch.Tensor | None:
    """--class-weights balanced: each class's loss weighed by rows / (classes * its rows), over the
    classes the training rows hold (scikit-learn's 'balanced'); a class no row holds keeps 1. None: unweighed."""
    if s.class_weights == "none":
        return None
    present = np.unique(split.label_ids)
    weights = np.ones(len(split.labels))
    weights[present] = compute_class_weight("balanced", classes=present, y=split.label_ids)
    return torch.tensor(weights, dtype=torch.float32, device=device)


def layer_entropy(head: LayerMixHead) -> torch.Tensor:
    """Entropy of softmax(alpha * p) (before the cutoff, so it stays smooth)."""
    log_p = torch.log_softmax(head.config.alpha * head.layer_logits, dim=0)
    return -(log_p.exp() * log_p).sum()


def decay_groups(model: torch.nn.Module, weight_decay: float, no_decay) -> list[dict]:
    """The optimizer's parameter groups: weight decay on every trainable parameter but biases, norms
    (fewer than 2 dimensions) and those `no_decay(name)` names; frozen ones are left out."""
    decay, kept = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (kept if param.ndim < 2 or no_decay(name) else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": kept, "weight_decay": 0.0}]


def make_optimizer(s: TrainSettings, head: Head) -> torch.optim.Optimizer:
    # No decay on the layer logits (decay would pull the mix toward uniform, which is the
    # entropy penalty's job). Frozen weights (LoRA-MTB's copied blocks) are not handed to the
    # optimizer at all.
    groups = decay_groups(head, s.weight_decay, lambda name: name == "layer_logits")
    if s.optimizer == "adam":  # Adam's weight decay is the L2 kind (added to the gradient)
        return torch.optim.Adam(groups, lr=s.lr)
    return torch.optim.AdamW(groups, lr=s.lr)


def cache_size(splits: list[Split], layers: list[int], hidden_size: int) -> tuple[int, int]:
    """(rows, bytes) of the fp16 state cache of `splits`: every real token and one zero row a split,
    each row `layers` states of `hidden_size` (TokenStateCache)."""
    rows = sum(sum(split.lengths) + 1 for split in splits)
    return rows, rows * len(layers) * hidden_size * 2


def cache_device(device: torch.device, splits: list[Split], layers: list[int], hidden_size: int) -> torch.device:
    """Keep the state cache in GPU memory when it takes under half of what is free (SST-2 with
    every MiniLM state is ~5 GB); otherwise in host memory, copied per batch."""
    if device.type != "cuda":
        return torch.device("cpu")
    _, needed = cache_size(splits, layers, hidden_size)
    free, _ = torch.cuda.mem_get_info(device)
    return device if needed < free / 2 else torch.device("cpu")


def check_cache_fits(splits: list[Split], layers: list[int], hidden_size: int) -> None:
    """A state cache over 80 % of the free host memory is refused up front: allocating it, the kernel
    killed the run with no message (150,000 texts: 74.6 GB on a 24 GB machine)."""
    tokens, needed = cache_size(splits, layers, hidden_size)
    free = free_memory()
    if free is not None and needed > 0.8 * free:
        raise UsageError(
            f"the backbone states of {len(splits[0])} training and {len(splits[1])} validation examples "
            f"({tokens:,} word pieces x {len(layers)} states x {hidden_size}, fp16) would take {needed / 1e9:.1f} GB "
            f"of memory and {free / 1e9:.1f} GB is free: give --states recompute (no cache: the backbone reads the "
            "data every epoch), --layers with fewer states, or --max-train N")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_environment(device) -> dict:
    """What a trained artifact's manifest records of the run's software and machine."""
    return {"device": str(device), "tmod": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "threads": torch.get_num_threads()}


def label_names_beside(train_file: str, highest_id: int) -> Path | None:
    """A labels.txt (or classes.txt) in the training file's folder with a name for every class id up
    to `highest_id`, one a line, as GoEmotions and many data sets ship their ids' names; or None."""
    for name in ("labels.txt", "classes.txt"):
        path = Path(train_file).parent / name
        try:
            lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError):
            continue
        if len(lines) > highest_id:
            return path
    return None


UNKNOWN_SHARE = 0.01  # of the training word pieces; GoEmotions' emoji make 0.13%, a Thai file ~100%


def say_unknown_pieces(split: Split, backbone: Backbone, provenance: dict) -> None:
    """Word pieces the backbone's vocabulary lacks ([UNK]: a script it was not trained on, emoji) carry
    nothing the head can learn from: counted in the manifest, said where they are UNKNOWN_SHARE or more."""
    tokenizer = backbone.text.tokenizer
    unknown_id = getattr(tokenizer, "unk_token_id", None)
    added = {getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "cls", "sep", "pad")}
    if unknown_id is None or unknown_id in added:  # a byte-level vocabulary (SmolLM2's) spells every text
        return
    per_row = [int((row.tokens[:, IDS] == unknown_id).sum()) for row in split.encoded]
    unknown, pieces = sum(per_row), sum(len(row) for row in split.encoded)
    provenance["training_word_pieces_unknown"], provenance["training_word_pieces"] = unknown, pieces
    if pieces and unknown / pieces >= UNKNOWN_SHARE:
        worst = max(range(len(per_row)), key=lambda r: per_row[r] / len(split.encoded[r]))
        example = split.encoded[worst].text
        print(f"{unknown} of the {pieces} training word pieces ({100 * unknown / pieces:.1f}%, in "
              f"{sum(n > 0 for n in per_row)} of {len(per_row)} texts, e.g. {example[:60]!r}) are "
              f"{tokenizer.unk_token}: {backbone.name}'s vocabulary lacks them, so the head learns nothing from "
              "them (another script, emoji): a backbone whose vocabulary covers these texts would (--backbone FOLDER, a "
              "local Hugging Face model, served as tmod-serve --backbone FOLDER)", file=sys.stderr)


# ---- the loop --------------------------------------------------------------------------------
def run_epoch(head, split: Split, source, optimizer, s: TrainSettings, rng: random.Random, device, amp: bool,
              desc: str, teacher: DistillTargets | None = None, weights: torch.Tensor | None = None) -> float:
    """One pass over the training rows; the mean of the loss trained on (with a teacher: the mix of
    cross-entropy and KL, training/distill.py; `weights`: per class, `class_weights`)."""
    head.train()
    total, count = 0.0, 0
    lam = (s.lambda_entropy or 0.0) if isinstance(head, LayerMixHead) else 0.0
    bar = progress_of(split.batches(s.batch_size, shuffle=True, rng=rng), bars=s.progress, desc=desc, unit="batch")
    for rows in bar:
        batch = split.token_batch(rows).to(device)
        targets = split.targets(rows, batch.seq_len).to(device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            logits = head_forward(head, batch, source.states(rows, batch))
        loss = task_loss(logits, targets, weights)
        if teacher is not None:
            loss = teacher.loss(loss, logits, rows)
        objective = loss + lam * layer_entropy(head) if lam else loss
        optimizer.zero_grad(set_to_none=True)
        objective.backward()
        if s.grad_clip:
            torch.nn.utils.clip_grad_norm_(head.parameters(), s.grad_clip)
        optimizer.step()
        total += loss.item() * len(rows)
        count += len(rows)
        bar.set_postfix(loss=f"{total / count:.4f}")
    return total / max(count, 1)


@torch.no_grad()
def validate(head, split: Split, source, s: TrainSettings, device, amp: bool,
             weights: torch.Tensor | None = None) -> tuple[float, dict]:
    """Validation loss (weighed per class as training's, `weights`) and metrics from the same states
    source used in training."""
    head.eval()
    predicted: list = [None] * len(split)
    total, count = 0.0, 0
    for rows in split.batches(s.eval_batch_size):
        batch = split.token_batch(rows).to(device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            logits = head_forward(head, batch, source.states(rows, batch))
        total += task_loss(logits, split.targets(rows, batch.seq_len).to(device), weights).item() * len(rows)
        count += len(rows)
        for r, p in zip(rows, predictions(split, rows, logits.float())):
            predicted[r] = p
    if split.is_multi_label:  # scored at the best global threshold on this split (the epoch's own)
        chosen = choose_thresholds(split.multi_hot(range(len(split))).numpy(), np.stack(predicted), split.labels)
        return total / max(count, 1), {**score(split, predicted, chosen["global_threshold"]),
                                       "threshold": chosen["global_threshold"]}
    return total / max(count, 1), score(split, predicted)


@dataclass
class Fit:
    history: list[dict]
    best_epoch: int
    best_value: float
    states_seconds: float
    cache_bytes: int


def fit(head: Head, train_split: Split, val_split: Split, s: TrainSettings, device, amp: bool,
        teacher: DistillTargets | None = None) -> Fit:
    """The states the head learns from (cached or recomputed per batch), then `train_epochs`."""
    layers = training_states(head)
    t0 = time.perf_counter()
    hidden_size = train_split.backbone.hidden_size
    where = cache_device(device, [train_split, val_split], layers, hidden_size) if s.states == "cache" else None
    if where is not None and where.type == "cpu":
        check_cache_fits([train_split, val_split], layers, hidden_size)
    tqdm.write(f"backbone states of {len(train_split)} training and {len(val_split)} validation examples: "
               f"{'cached once' if where is not None else 'recomputed every epoch'}", file=sys.stderr)
    if where is not None:
        disk = default_cache_dir() / "states" if s.state_cache else None
        train_source = CachedStates(train_split, layers, s.eval_batch_size, device=where, progress=s.progress,
                                    desc="caching train states", disk=disk)
        val_source = CachedStates(val_split, layers, s.eval_batch_size, device=where, progress=s.progress,
                                  desc="caching validation states", disk=disk)
        cache_bytes = train_source.nbytes() + val_source.nbytes()
    else:
        train_source, val_source = RecomputedStates(train_split, layers), RecomputedStates(val_split, layers)
        cache_bytes = 0
    states_seconds = time.perf_counter() - t0

    history, best_epoch, best = train_epochs(head, train_split, val_split, train_source, val_source, s, device, amp,
                                             teacher=teacher)
    return Fit(history, best_epoch, best, states_seconds, cache_bytes)


def better_epoch(value: float, loss: float, best_value: float, best_loss: float, s: TrainSettings) -> bool:
    """Whether an epoch replaces the kept one: its validation metric higher by at least
    `min_delta`, or within `min_delta` of it with a validation loss lower by `min_loss_delta`
    (relative). A small validation set's noise is not chased, nor a metric blip while the loss rises."""
    if value >= best_value + s.min_delta:
        return True
    return value > best_value - s.min_delta and loss <= best_loss * (1 - s.min_loss_delta)


def next_epoch_past_budget(started: float, epochs_done: int, max_minutes: float | None) -> bool:
    """Whether one more epoch at the pace so far would end past `max_minutes` since `started`
    (perf_counter seconds): --max-minutes starts no epoch it cannot finish."""
    if not epochs_done or max_minutes is None:
        return False
    spent = time.perf_counter() - started
    return spent + spent / epochs_done > 60 * max_minutes


def stop_early(history: list[dict], why: str, epoch: int, epochs: int, best_epoch: int,
               max_minutes: float | None = None, patience: int | None = None) -> None:
    """Say and record why the epoch loop stops before its last epoch, heads' and bridges' alike:
    `max_minutes` (before epoch `epoch`: it would end past the budget), `interrupt` (Ctrl-C in it) or
    `patience` (after it: `patience` epochs in a row without a better one)."""
    if why == "max_minutes":
        said = (f"stopping after epoch {epoch - 1}/{epochs}: the time budget of {max_minutes:g} min would be passed "
                "(--max-minutes)")
    elif why == "patience":
        said = (f"stopping after epoch {epoch}/{epochs}: {patience} epochs in a row without a better validation "
                f"result (--patience {patience}); keeping epoch {best_epoch}")
    else:
        said = (f"interrupted in epoch {epoch}/{epochs}: keeping epoch {best_epoch}, the best so far, and finishing "
                "the run (Ctrl-C again quits before it is saved)")
    tqdm.write(said, file=sys.stderr)
    history[-1]["stopped_by"] = why


def train_epochs(model, train_split: Split, val_split: Split, train_source, val_source, s: TrainSettings, device,
                 amp: bool, state=None, teacher: DistillTargets | None = None) -> tuple[list[dict], int, float]:
    """The epoch loop: train, validate, keep the best epoch's weights (`select` best: `better_epoch`,
    early stop after `patience` epochs without a better one, learning rate cut on a plateau) or the
    last (`select` last: validation decides nothing). One summary line per epoch on stderr.
    `state` says what to keep of a model with frozen parts (default: its whole state dict). The
    model ends holding the kept weights; returns (history, best epoch, its value). `teacher`: the
    training loss mixes in KL towards it (the validation loss stays the gold tags' cross-entropy)."""
    keep = state or model.state_dict
    optimizer = make_optimizer(s, model)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer, mode="max", factor=s.lr_factor, patience=s.lr_patience, min_lr=s.min_lr)
    rng = random.Random(s.seed)
    weights = class_weights(train_split, s, device)
    history, best, best_loss, best_epoch, stale = [], -math.inf, math.inf, 0, 0
    best_state = copy.deepcopy(keep())
    started = time.perf_counter()
    for epoch in range(1, s.epochs + 1):
        if next_epoch_past_budget(started, len(history), s.max_minutes):
            stop_early(history, "max_minutes", epoch, s.epochs, best_epoch, s.max_minutes)
            break
        t0 = time.perf_counter()
        try:
            train_loss = run_epoch(model, train_split, train_source, optimizer, s, rng, device, amp,
                                   desc=f"epoch {epoch}/{s.epochs}", teacher=teacher, weights=weights)
            train_seconds = time.perf_counter() - t0
            t0 = time.perf_counter()
            val_loss, val_metrics = validate(model, val_split, val_source, s, device, amp, weights)
        except KeyboardInterrupt:  # Ctrl-C on a long run: the best epoch so far is a result, not lost
            if not history or s.select != "best":  # nothing kept yet, or a fixed epoch count not reached
                raise
            stop_early(history, "interrupt", epoch, s.epochs, best_epoch)
            break
        value = val_metrics[s.metric]
        history.append({
            "epoch": epoch, "train_loss": train_loss, "validation_loss": val_loss, s.metric: value,
            "lr": optimizer.param_groups[0]["lr"],
            **({"layer_weights": list(layer_distribution(model).values())} if isinstance(model, LayerMixHead) else {}),
            "train_seconds": round(train_seconds, 2), "validation_seconds": round(time.perf_counter() - t0, 2),
        })
        if s.select == "best":
            improved = better_epoch(value, val_loss, best, best_loss, s)
        else:
            improved = epoch == s.epochs
        if improved:
            best, best_loss, best_epoch, stale = value, val_loss, epoch, 0
            best_state = copy.deepcopy(keep())
        else:
            stale += 1
        # a multi-label epoch is scored at one threshold for every label; the kept head's per-label
        # thresholds, chosen after training, score higher: said, so the two numbers do not puzzle
        at = f" at threshold {val_metrics['threshold']:.2f} for all labels" if val_split.is_multi_label else ""
        tqdm.write(f"epoch {epoch}/{s.epochs}: train loss {train_loss:.4f}  validation loss {val_loss:.4f}  "
                   f"validation {s.metric} {value:.4f}{at}{'  (kept)' if improved else ''}  [{train_seconds:.1f}s]",
                   file=sys.stderr)
        if s.select == "best":
            scheduler.step(value)
            if stale >= s.patience:
                if epoch < s.epochs:
                    stop_early(history, "patience", epoch, s.epochs, best_epoch, patience=s.patience)
                break
    model.load_state_dict(best_state, strict=state is None)
    return history, best_epoch, best


def served_scores(served: LoadedModule, val_split: Split, data: Splits, labels: list[str], backbone: Backbone,
                  s: TrainSettings, epoch_chosen: bool) -> tuple[dict, dict, Split, list, list]:
    """The kept head measured the way the server runs it: on validation (which chose the epoch where
    `epoch_chosen`, and here any decision threshold) and on the test split (which chose nothing).
    -> (metrics, the decoding thresholds chosen, the split the baselines are scored on, its probabilities,
    the validation split's probabilities)."""
    task_type, metric, val_data = data.train.task_type, s.metric, data.validation
    decoding, thresholds = {}, None
    val_probabilities: list = []
    if task_type == TaskType.multi_label_classification:
        score_module(val_split, served, s.eval_batch_size, progress=s.progress, thresholds=0.5,
                     probabilities=val_probabilities)
        chosen = choose_thresholds(val_split.multi_hot(range(len(val_split))).numpy(), np.stack(val_probabilities), labels)
        decoding = {k: chosen[k] for k in ("thresholds", "threshold_rule")}
        thresholds = [chosen["thresholds"][label] for label in labels]
        metrics = score(val_split, val_probabilities, thresholds)
        metrics.update({k: chosen[k] for k in ("rule", "global_threshold", "global_f1_macro", "per_label_f1_macro")})
    else:
        metrics = score_module(val_split, served, s.eval_batch_size, progress=s.progress, probabilities=val_probabilities)
    if s.none_below is not None:
        gold = [ex.label for ex in val_data.examples]
        chosen = (choose_none_threshold(gold, np.stack(val_probabilities), labels) if s.none_below == "auto" else
                  {**answered_scores(gold, np.stack(val_probabilities), labels, s.none_below),
                   "threshold_rule": f"none of these under p {s.none_below}: set by --none-below"})
        decoding = {"threshold": chosen.pop("threshold"), "threshold_rule": chosen.pop("threshold_rule")}
        metrics["none_of_these"] = chosen
    metrics.update(metric=metric, split="validation",
                   role=validation_role(epoch_chosen, "thresholds" in decoding, s.none_below == "auto"))
    evaluated, probabilities = val_split, val_probabilities
    if data.test is not None:
        evaluated, probabilities = Split(data.test, labels, backbone), []
        say_examples_cut("test", evaluated, backbone, data.provenance)
        metrics["test"] = {**score_module(evaluated, served, s.eval_batch_size, progress=s.progress,
                                          thresholds=thresholds, probabilities=probabilities),
                           "split": "test", "role": "scored once at the end; chose nothing"}
        if seen := rows_seen(data.provenance, "test", metrics["role"]):  # read with the number, in every place
            metrics["test"]["rows_seen"] = seen
        if "threshold" in decoding and task_type == TaskType.sequence_classification:
            metrics["test"]["none_of_these"] = answered_scores([ex.label for ex in data.test.examples],
                                                               np.stack(probabilities), labels, decoding["threshold"])
    return metrics, decoding, evaluated, probabilities, val_probabilities


def say_what_the_data_holds(s: TrainSettings, train_data, labels: list[str], provenance: dict) -> None:
    """What a user should know of their data before training on it, said on stderr: numbers for labels,
    a pair recipe left unmeasured, IOB1 tags, a text labelled two ways, rows the splits share."""
    task_type = train_data.task_type
    if task_type != TaskType.token_classification and all(label.isdigit() for label in labels) and not s.label_map:
        ids = sorted(labels, key=int)  # 0, 1, 2, ... where the head's order is 0, 1, 10, ...
        example = ",".join(f"{label}=..." for label in ids[:3]) + (",..." if len(ids) > 3 else "")
        names = label_names_beside(s.train, int(ids[-1])) if s.train else None
        beside = f' (the {names.name} beside the file lists them: --labels "$(paste -sd, {names})")' if names else ""
        print(f"the labels are numbers ({', '.join(ids[:5])}{', ...' if len(ids) > 5 else ''}): the server will "
              f"answer them as they are; --labels NAME,NAME,... (class 0's name first, then 1's, ...){beside} or "
              f"--label-map {example} names them", file=sys.stderr)
    if train_data.has_pairs and s.kind == "layermix" and s.pooling != "pair":  # the one recipe measured on pairs
        print("a pair task with its two texts pooled together: on RTE, held out, --pooling pair --no-attention "
              "(each text pooled apart, no attention layer) scored 60.8-62.4% against 54.6-58.2% with attention and "
              "56.0% pooled together (bench/results/holdout-search-minilm.md)", file=sys.stderr)
    if provenance.get("entities_begun_with_i"):  # said: the tags the head learns are not the file's
        counts = ", ".join(f"{n} in the {split} file" for split, n in provenance["entities_begun_with_i"].items())
        print(f"entities that begin with I- ({counts}): IOB1 tags, as CoNLL-2003's original release writes them, or "
              "slips in BIO; learnt as beginning with B- (BIO, the order the server decodes tags in), the same "
              "entities", file=sys.stderr)
    if provenance.get("train_texts_labelled_two_ways"):  # said: the head cannot learn both answers
        print(f"training texts labelled more than one way (the same text, different labels): "
              f"{provenance['train_texts_labelled_two_ways']}; check them, or keep one label each", file=sys.stderr)
    # said, not silent: scores on texts the head learnt flatter it; what validation will choose (several epochs
    # kept at their best, thresholds): where nothing, test rows it shares are harmless
    chooses = validation_role(s.select == "best" and s.epochs > 1, task_type == TaskType.multi_label_classification,
                              s.none_below == "auto")
    for split in ("validation", "test"):
        if seen := rows_seen(provenance, split, chooses):
            print(f"the {split} split is not wholly unseen: {seen}; drop those rows from one of the files (--split "
                  "keeps a text's rows in one part)", file=sys.stderr)


def encoded_splits(train_data, val_data, labels: list[str], backbone: Backbone,
                   provenance: dict) -> tuple[Split, Split]:
    """The training and validation splits tokenized; examples longer than the backbone reads at once
    (cut to its first window) and word pieces it does not know are said, not silent."""
    train_split, val_split = Split(train_data, labels, backbone), Split(val_data, labels, backbone)
    for name, split in (("training", train_split), ("validation", val_split)):
        say_examples_cut(name, split, backbone, provenance)
    say_unknown_pieces(train_split, backbone, provenance)
    return train_split, val_split


def say_examples_cut(name: str, split: Split, backbone: Backbone, provenance: dict) -> None:
    """How many of a split's examples are longer than the backbone reads at once (cut to their first
    window), in `provenance` (the report says it) and on stderr."""
    cut = sum(row.truncated for row in split.encoded)
    provenance[f"{name}_examples_cut"] = cut
    if cut:  # the server reads such texts whole, in windows; so are a sequence task's scored (score_module)
        limit = backbone.text.max_tokens
        provenance["examples_cut_at"] = limit
        served = "the server reads long texts in windows (docs/windows.md)"
        if name == "training":
            how = f"learnt on their first {limit}; {served}"
        elif split.is_token_task:
            how = f"scored on their first {limit}; {served}"
        elif name == "validation":  # its cached states choose the epoch; score_module reads as served
            how = (f"each epoch's line scores their first {limit}, the number reported scores them as the server "
                   "answers them, in windows (docs/windows.md)")
        else:
            how = "scored as the server answers them, in windows (docs/windows.md)"
        print(f"{cut} of {len(split.encoded)} {name} examples are longer than the backbone reads at once "
              f"({limit} word pieces): {how}", file=sys.stderr)


def offer_to_serve(s: TrainSettings, task: str, store: ModuleStore, backbone: Backbone, server: dict | None,
                   example) -> tuple[str, str | None, UsageError | None]:
    """(the request that asks the new task beside the served ones, the --load-into URL that loaded it,
    the server's refusal of it): a refused load keeps the trained module and its report."""
    others = list(server["tasks"]) if server else serving.served_at_start(store, backbone)
    request = serving.example_request(s.load_into or "http://127.0.0.1:8080", task, others, example.text,
                                      getattr(example, "text_pair", None), bool(server and server.get("api_key")))
    if not server:
        return request, None, None
    try:
        loaded = serving.load_into(s.load_into, task, s.version)
    except UsageError as exc:
        return request, None, exc
    serving.say_if_replaced_live(s.load_into, store, task, s.version, loaded.get("previous_version"))
    serving.say_if_bridged(s.load_into, server, task, s.version, s.store, backbone)
    return request, s.load_into, None


def train(s: TrainSettings, *, backbone: Backbone | None = None, command: str = "",
          config_file: str | None = None, splits: Splits | None = None) -> TrainResult:
    """The whole run: data, head, fit, served-path validation (and test), baselines, artifact, report.
    `splits`: the data as `resolve_data(s)` gave it, where the caller checked it first (tmod-train)."""
    started = time.perf_counter()
    seed_everything(s.seed)
    data = splits if splits is not None else resolve_data(s)
    train_data, val_data, labels, provenance = data.train, data.validation, data.labels, data.provenance
    task_type = train_data.task_type
    metric = data.metric  # --metric, else the preset's, else the task type's (training/splits.py)
    progress = s.progress if s.progress is not None else sys.stderr.isatty()
    s = s.with_task_defaults(task_type).model_copy(update={"metric": metric, "progress": progress})

    task = stored_name(s.task, s.dataset or Path(s.train).stem, "--task", "task", served=True)
    numbered = s.version is None  # the next free number; without --store the run's own new store: 1
    if numbered:
        s = s.model_copy(update={"version": ModuleStore(Path(s.store)).next_version(task) if s.store else "1"})
    if s.store and (misplaced := misplaced_store(Path(s.store))):  # the module would land where no store finds it
        raise UsageError(f"--store: {misplaced}")
    outputs = RunOutputs.checked(f"{task}-{s.version}", s.run_dir, ModuleStore(Path(s.store)) if s.store else None,
                                 s.report_dir, task, s.version, s.overwrite,
                                 fix="give --run-dir (or --store and --report-dir) in a folder you can write",
                                 task_type=task_type)
    server = serving.check_server(s.load_into, s.store) if s.load_into else None

    say_what_the_data_holds(s, train_data, labels, provenance)
    set_threads(s.threads)
    device = pick_device(s.device)
    amp = s.amp if s.amp is not None else device.type == "cuda"
    backbone = backbone or Backbone.load(s.backbone, device=str(device))
    if s.precision != "fp32":  # the states the head learns from are the ones served at this precision
        backbone = backbone.use_backend("torch", s.precision)
    if server:
        serving.check_backbone(s.load_into, server, backbone)
    head = build_head(s, task_type, labels, backbone).to(device)
    trainable = sum(p.numel() for p in head.parameters() if p.requires_grad)
    if s.document_windows:
        train_data = add_document_windows(train_data, provenance, backbone, s.document_windows)
    train_split, val_split = encoded_splits(train_data, val_data, labels, backbone, provenance)
    teacher, distillation = None, None
    if s.distill_from:
        words = teacher_words(s.distill_from, provenance["train_file"], s.distill_backbone, device=str(device),
                              batch_size=s.eval_batch_size, progress=s.progress, rows=train_split.data.examples)
        teacher = DistillTargets(train_split, words, s.distill_temperature, s.distill_weight)
        distillation = {**words.about, "temperature": s.distill_temperature, "weight": s.distill_weight,
                        "training_words_with_teacher": int(sum(len(p) for p in teacher.positions))}
    result = fit(head, train_split, val_split, s, device, amp, teacher=teacher)
    train_seconds = time.perf_counter() - started

    head.eval()
    for param in head.parameters():
        param.requires_grad_(False)
    served = LoadedModule(task=task, version=s.version, manifest=None, head=head)  # the numbers that ship
    # validation chose among epochs only where the run kept its best of several
    metrics, decoding, evaluated, probabilities, val_probabilities = served_scores(
        served, val_split, data, labels, backbone, s, s.select == "best" and len(result.history) > 1)
    cache = default_cache_dir() / "baselines" if s.state_cache else None
    tqdm.write(f"scoring against simple baselines: the majority answer, and {linear_baseline(task_type)} fitted on "
               f"the {len(train_data):,} training rows", file=sys.stderr)  # a big file's fit takes a while: said, not silent
    # the verdict is on test where there is one; the validation numbers then get the baselines on their own rows
    assessment = assess(train_data, evaluated, probabilities, metrics.get("test", metrics), metric, s.seed, cache=cache,
                        validation=(val_split, metrics, val_probabilities) if data.test is not None else None,
                        balanced=s.class_weights == "balanced", thresholds=decoding.get("thresholds"))
    metrics["baselines"] = assessment["baselines"]
    if "validation_baselines" in assessment:
        metrics["validation_baselines"] = assessment["validation_baselines"]
    tqdm.write(f"against simple baselines: {metrics['baselines']['verdict']}", file=sys.stderr)
    # the last of several epochs kept (one epoch shows no trend), and a perfect score has nowhere left to go
    still_improving = (s.select == "best" and result.best_epoch == len(result.history) == s.epochs > 1
                       and result.best_value < 1.0)
    if still_improving:
        tqdm.write(f"the kept epoch is the last one ({s.epochs}): validation {metric} was still improving; "
                   f"train longer (e.g. --epochs {2 * s.epochs}) for a better head", file=sys.stderr)

    weights = layer_distribution(head)
    training = {
        "command": command,
        "config_file": config_file,
        "settings": s.model_dump(mode="json"),
        "data": provenance,
        **({"distillation": distillation} if distillation else {}),
        "best_epoch": result.best_epoch,
        "epochs_run": len(result.history),
        "still_improving": still_improving,
        "best_epoch_metric": result.best_value,  # on the training-time states (fp16 when cached)
        "history": result.history,
        "layer_weights": {str(k): v for k, v in weights.items()},
        "parameters": count_parameters(head),  # what serving runs (LoRA merged)
        "trainable_parameters": trainable,
        "artifact_parameters": sum(t.numel() for t in head.artifact_weights().values()),
        "timing": {
            "states_mode": s.states,
            "states_seconds": round(result.states_seconds, 2),
            "state_cache_bytes": result.cache_bytes,
            "epoch_seconds": [h["train_seconds"] for h in result.history],
            "total_seconds": round(train_seconds, 2),
        },
        "environment": {**run_environment(device), "amp": amp, "backbone_backend": backbone.backend.describe()},
    }
    # the file's name, not its path: /v1/tasks shows the description to every client
    description = s.description or (f"{s.kind} head on {backbone.name}, trained on {s.dataset or Path(s.train).name}"
                                     + (f", distilled from {s.distill_from}" if s.distill_from else ""))
    outputs = outputs.claimed()
    store, report_dir = outputs.store, outputs.report_dir

    def save(version: str) -> Path:
        training["settings"]["version"] = version
        return save_module(store, task, version, head, backbone, training=training, metrics=metrics,
                           description=description, overwrite=s.overwrite and not numbered, decoding=decoding)

    artifact, version = save_as_free_version(save, store, task, s.version, numbered, outputs)
    s = s.model_copy(update={"version": version})
    load_module(store, task, s.version, backbone, probe=probe_module)  # refuse to report success on an unloadable artifact
    serving.say_which_version_serves(store, task, s.version, backbone)
    request, loaded_into, refusal = offer_to_serve(s, task, store, backbone, server, val_data.examples[0])
    outcome = TrainResult(task=task, version=s.version, artifact=artifact, report_dir=report_dir, metrics=metrics,
                          history=result.history, layer_weights=weights, training=training, decoding=decoding,
                          assessment=assessment, request=request, loaded_into=loaded_into,
                          serve="" if loaded_into else serving.serve_command(store, s.backbone))
    try:
        write_report(report_dir, outcome)
    except OSError as exc:  # a full disk: the module is saved, and the one line says where
        raise UsageError(f"the report cannot be written ({exc.strerror or exc}: {exc.filename}); the module is saved "
                         f"in {artifact}") from None
    if refusal:
        raise UsageError(f"{refusal} (the module is saved in {artifact}, its report in {report_dir})")
    return outcome
