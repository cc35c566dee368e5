"""Train a transformer bridge (server/bridges/transformer.py) from paired states and store it.

Two objectives:

* ``mse`` (the thesis' objective): masked log(1 + MSE) between the bridged and the real target
  states, over real target tokens, averaged over the target states; computed in the bridge's
  prediction space (per-dimension standardised, see the bridge's docstring).
* ``distill``: train the bridge THROUGH a frozen foreign module (a head stored for the target
  backbone). The module's logits on the target backbone's real states are the teacher (computed
  once); its logits on the bridged states are the student: KL(teacher || student) at temperature
  T (scaled by T^2), per input for sequence tasks and per real target token for token tasks.
  Optional extras: hard-label cross-entropy (`ce_weight`, when the dataset's labels are the
  module's) and the MSE term (`mse_weight`). The head stays in eval mode with its parameters
  frozen; gradients flow through it into the bridge.

A module given with the MSE objective is only measured (agreement with its teacher), so both
objectives report the same numbers. Training runs the bridge through `forward_train`, which is
the served start/consume/finish computation from a dict of states; after saving, the artifact is
loaded back and re-measured through start/consume/finish (its own target tokenizer included).

    tmod-train bridge --source minilm --target smollm2 --target-layers 0,5,10,15,20,25,30 --objective mse
    tmod-train bridge --objective distill --module STORE/sentiment/1 --dataset sst2 --max-texts 20000
"""
from __future__ import annotations

import copy
import json
import logging
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Sequence

import torch
import torch.nn.functional as F
from pydantic import ConfigDict, Field, field_validator
from tqdm.auto import tqdm

from modules_store import ModuleStore, TaskType, sha256_file
from server.bridges.transformer import BridgeShape, TransformerBridge
from server.heads.base import head_forward
from server.modules import LoadedModule, count_parameters, load_module
from server.probe import probe_module
from training.assess import too_few
from training.data.examples import LabelledData, SequenceExample, hold_out
from training.data.files import UsageError, read_text_lines
from training.data.presets import PRESETS, preset_spec
from training.data.word_tags import IGNORE_INDEX, token_labels
from training.distill import distill_kl
from training.metrics import optimistic, validation_role
from training.progress import progress_of
from training.serving import bridge_serving
from training.settings import check_layers, checked_version, parse_layers
from training.splits import module_folder
from training.trainer import decay_groups, next_epoch_past_budget, run_environment, seed_everything, stop_early

log = logging.getLogger("tmod")

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BRIDGE_STORE = REPO_ROOT / "modules_store" / "_bridges"


class BridgeSettings(BridgeShape):
    """Every knob of a bridge training run (saved into the bridge's manifest)."""

    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True)  # a config's `version: 2` is a name

    # ---- backbones and states
    source: str = Field("minilm", description="backbone the bridge is served on: 'minilm', 'smollm2' or a folder")
    target: str = Field("smollm2", description="backbone the foreign modules were trained on")
    source_layers: list[int] | None = Field(None, description="source states mixed (default: all)")
    target_layers: list[int] | None = Field(None, description="target states produced (default: the module's, else all)")
    # ---- objective
    objective: Literal["mse", "distill"] = "mse"
    module: str | None = Field(None, description="a module for the target backbone (TASK/VERSION of the shipped "
                               "store, or a STORE/TASK[/VERSION] folder): the teacher for distill, measured only for mse")
    temperature: float = Field(2.0, gt=0, description="distill: softmax temperature T (loss scaled by T^2)")
    ce_weight: float = Field(0.0, ge=0, description="distill: weight of hard-label cross-entropy (dataset labels)")
    mse_weight: float = Field(0.0, ge=0, description="distill: weight of the log(1+MSE) state term")
    # ---- data
    dataset: str = Field("sst2", description="preset whose texts are paired: train split for training, "
                         "validation split for validation")
    texts: str | None = Field(None, description="a UTF-8 file of your texts, one a line, paired instead of the "
                              "preset's (a seeded tenth held out for validation; no labels)")
    data_dir: str | None = None
    max_texts: int | None = Field(None, ge=1, description="seeded random subset of the training texts")
    max_validation: int | None = Field(None, ge=1, description="seeded random subset of the validation texts")
    cache_dir: str | None = Field(None, description="paired-states cache (default: the tmod cache dir)")
    # ---- bridge: d_model, heads, layers, ... come from BridgeShape
    # ---- optimisation
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    batch_size: int = Field(32, ge=1)
    eval_batch_size: int = Field(64, ge=1)
    epochs: int = Field(20, ge=1)
    max_minutes: float | None = Field(None, gt=0, description="start no epoch that would end past this many minutes "
                                      "of training (the best epoch so far is kept)")
    patience: int = Field(3, ge=1, description="early stopping: epochs without a lower validation loss")
    lr_patience: int = Field(1, ge=0, description="halve the learning rate after this many stale epochs")
    warmup_steps: int = Field(200, ge=0)
    grad_clip: float = Field(1.0, ge=0)
    seed: int = 0
    device: str = "auto"
    threads: int = Field(0, ge=0, description="CPU threads for torch; 0 keeps torch's default")
    amp: bool = Field(False, description="bf16 autocast on CUDA")
    # ---- output
    bridge_store: str | None = Field(None, description="default: modules_store/_bridges")
    name: str | None = None
    version: str | None = Field(None, description="default: the next free number of this name in the bridge store")
    report_dir: str | None = None
    run_dir: str | None = None
    description: str = ""
    overwrite: bool = False
    progress: bool | None = Field(None, description="bars (default: where stderr is a terminal)")

    @field_validator("source_layers", "target_layers", mode="before")
    @classmethod
    def _layers(cls, value):
        return parse_layers(value)

    @field_validator("version")
    @classmethod
    def _version(cls, value):
        return checked_version(value)


# ---- pairs and statistics ---------------------------------------------------------------------
def to_device(batch, states: dict[int, torch.Tensor], device) -> tuple:
    return batch.to(device), {i: h.to(device) for i, h in states.items()}


@torch.no_grad()
def state_statistics(pairs, side: str, batch_size: int = 64) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per-dimension (mean, std) of each `side` ('source'/'target') state over the real tokens of
    `pairs` (float64 accumulation)."""
    get = pairs.source_batch if side == "source" else pairs.target_batch
    sums, squares, count = {}, {}, 0
    for rows in pairs.batches(batch_size):
        batch, states = get(rows)
        mask = batch.attention_mask.bool()
        count += int(mask.sum())
        for index, hidden in states.items():
            real = hidden[mask].double()
            sums[index] = sums.get(index, 0) + real.sum(0)
            squares[index] = squares.get(index, 0) + (real * real).sum(0)
    out = {}
    for index in sums:
        mean = sums[index] / count
        var = (squares[index] / count - mean * mean).clamp(min=0)
        out[index] = (mean.float(), var.sqrt().float())
    return out


def masked_mse(predicted: torch.Tensor, true: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean squared error over the real tokens (mask (B, T)) and every dimension."""
    weights = mask.to(predicted.dtype).unsqueeze(-1)
    return ((predicted.float() - true.float()) ** 2 * weights).sum() / (weights.sum() * predicted.shape[-1]).clamp(min=1)


def log_mse_loss(bridge: TransformerBridge, predicted: dict[int, torch.Tensor], true: dict[int, torch.Tensor],
                 mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean over target states of log(1 + MSE_state), mean MSE), in the bridge's prediction space:
    `predicted` is standardised output, `true` the raw target states."""
    mses = [masked_mse(predicted[i], bridge.standardise_target(i, true[i]), mask) for i in bridge.states_out()]
    stacked = torch.stack(mses)
    return torch.log1p(stacked).mean(), stacked.mean().detach()


def masked_cosine(predicted: torch.Tensor, true: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """(sum of per-token cosine similarities over real tokens, their count)."""
    cos = F.cosine_similarity(predicted.float(), true.float(), dim=-1)
    m = mask.bool()
    return float(cos[m].sum()), int(m.sum())


# ---- the foreign module as a probe / teacher ------------------------------------------------
class ModuleProbe:
    """A frozen module of the target backbone, its logits on the real target states of each split
    (the teacher, computed once) and, where the data has them in the module's labels, hard labels."""

    def __init__(self, module: LoadedModule, splits: dict, batch_size: int, device, labels: dict | None = None,
                 progress: bool = True):
        self.module = module
        self.head = module.head.eval()
        for param in self.head.parameters():
            param.requires_grad_(False)
        self.layers = self.head.layers_read()
        self.is_token = self.head.task_type == TaskType.token_classification
        self.labels = labels or {}
        self.teacher: dict[str, list[torch.Tensor]] = {}
        for name, pairs in splits.items():
            self.teacher[name] = self._teacher(pairs, batch_size, device, progress, name)

    @torch.no_grad()
    def _teacher(self, pairs, batch_size, device, progress, name) -> list[torch.Tensor]:
        out: list = [None] * len(pairs)
        for rows in progress_of(pairs.batches(batch_size), bars=progress, desc=f"teacher logits ({name})",
                                unit="batch"):
            batch, states = to_device(*pairs.target_batch(rows), device)
            logits = head_forward(self.head, batch, ((i, states[i]) for i in self.layers)).float().cpu()
            for k, r in enumerate(rows):
                out[r] = logits[k, :len(pairs.target_encoded[r])] if self.is_token else logits[k]
        return out

    def teacher_batch(self, split: str, rows: Sequence[int], width: int) -> torch.Tensor:
        rows_logits = [self.teacher[split][r] for r in rows]
        if not self.is_token:
            return torch.stack(rows_logits)
        out = torch.zeros(len(rows), width, rows_logits[0].shape[-1])
        for k, logits in enumerate(rows_logits):
            out[k, :logits.shape[0]] = logits
        return out

    def label_batch(self, split: str, rows: Sequence[int], width: int) -> torch.Tensor | None:
        if split not in self.labels:
            return None
        if not self.is_token:
            return torch.tensor([self.labels[split][r] for r in rows], dtype=torch.long)
        out = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        for k, r in enumerate(rows):
            ids = self.labels[split][r]
            out[k, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        return out

    def student(self, target_batch, bridged: dict[int, torch.Tensor]) -> torch.Tensor:
        """The module's logits on bridged target states (gradients flow through the frozen head)."""
        return head_forward(self.head, target_batch, ((i, bridged[i]) for i in self.layers))


def hard_labels(data, head_labels: list[str], pairs, is_token: bool) -> list | None:
    """The data's labels as the module's label ids, per pair row (token tasks: per target token,
    IGNORE_INDEX off the first piece of each word); None when the data's labels are not the module's."""
    index = {label: i for i, label in enumerate(head_labels)}
    if set(data.labels_seen()) - set(index):
        return None
    if not is_token:
        return [index[ex.label] for ex in data.examples]
    return [token_labels(enc, ex.spans, [index[t] for t in ex.tags], head_labels)
            for enc, ex in zip(pairs.target_encoded, data.examples)]


def majority_share(labels: list) -> float:
    """How often the most frequent label is the right one (token tasks: over labelled words): what
    one constant answer, the best for these very rows, scores."""
    flat = [label for row in labels for label in (row if isinstance(row, list) else [row]) if label != IGNORE_INDEX]
    return max(Counter(flat).values()) / len(flat) if flat else float("nan")


# ---- one batch --------------------------------------------------------------------------------
def batch_terms(bridge: TransformerBridge, pairs, rows, split: str, probe: ModuleProbe | None, s: BridgeSettings,
                device, served: bool = False, need_mse: bool = True, need_probe: bool = True) -> dict:
    """The loss terms (and, for metrics, logits) of one batch of pairs.

    served: run the bridge through start/consume/finish and its own target tokenization (the
    artifact check); otherwise through forward_train with the pairs' target batch (training)."""
    source_batch, source_states = to_device(*pairs.source_batch(rows), device)
    target_batch, target_states = to_device(*pairs.target_batch(rows), device)
    if served:
        state = bridge.start(source_batch)
        for index in bridge.layers_read():
            state = bridge.consume(state, index, source_states[index])
        made_batch, bridged = bridge.finish(state, source_batch)
        if not torch.equal(made_batch.input_ids.cpu(), target_batch.input_ids.cpu()):
            raise RuntimeError("the bridge's target tokenization differs from the paired target batch")
        standardised = {i: bridge.standardise_target(i, h) for i, h in bridged.items()}
    else:
        standardised = bridge.forward_train(source_states, source_batch, target_batch, standardised=True)
        bridged = {i: bridge.destandardise_target(i, h) for i, h in standardised.items()}
    mask = target_batch.attention_mask
    terms: dict = {"mask": mask, "bridged": bridged, "true": target_states}
    if need_mse:
        terms["log_mse"], terms["mse"] = log_mse_loss(bridge, standardised, target_states, mask)
    if probe is not None and need_probe:
        student = probe.student(target_batch, bridged)
        teacher = probe.teacher_batch(split, rows, target_batch.seq_len).to(device)
        terms["student"], terms["teacher"] = student, teacher
        terms["kl"] = distill_kl(student, teacher, mask if probe.is_token else None, s.temperature)
        labels = probe.label_batch(split, rows, target_batch.seq_len)
        if labels is not None:
            labels = labels.to(device)
            terms["labels"] = labels
            terms["ce"] = F.cross_entropy(student.reshape(-1, student.shape[-1]).float(), labels.reshape(-1),
                                          ignore_index=IGNORE_INDEX)
    return terms


def objective_loss(terms: dict, s: BridgeSettings) -> torch.Tensor:
    if s.objective == "mse":
        return terms["log_mse"]
    loss = terms["kl"]
    if s.ce_weight and "ce" in terms:
        loss = loss + s.ce_weight * terms["ce"]
    if s.mse_weight:
        loss = loss + s.mse_weight * terms["log_mse"]
    return loss


@torch.no_grad()
def evaluate(bridge: TransformerBridge, pairs, split: str, probe: ModuleProbe | None, s: BridgeSettings, device,
             served: bool = False, progress: bool = False) -> dict:
    """Validation numbers, averaged over inputs: loss (the objective), log_mse, mse (prediction
    space), cosine (bridged vs real raw states, per real token, over every target state), and with
    a module: kl, agreement (argmax with the teacher; per real target token for token tasks) and,
    with labels, accuracy of the module on bridged and on real target states."""
    bridge.eval()
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}

    def add(key, value, n):
        sums[key] = sums.get(key, 0.0) + float(value) * n
        counts[key] = counts.get(key, 0) + n

    for rows in progress_of(pairs.batches(s.eval_batch_size), bars=progress, desc=f"evaluating ({split})",
                            unit="batch"):
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=s.amp and device.type == "cuda"):
            terms = batch_terms(bridge, pairs, rows, split, probe, s, device, served=served)
        n = len(rows)
        add("loss", objective_loss(terms, s), n)
        add("log_mse", terms["log_mse"], n)
        add("mse", terms["mse"], n)
        for index in bridge.states_out():
            total, tokens = masked_cosine(terms["bridged"][index], terms["true"][index], terms["mask"])
            sums["cosine"] = sums.get("cosine", 0.0) + total
            counts["cosine"] = counts.get("cosine", 0) + tokens
        if "kl" in terms:
            add("kl", terms["kl"], n)
            student, teacher = terms["student"].argmax(-1), terms["teacher"].argmax(-1)
            if probe.is_token:
                real = terms["mask"].bool()
                add("agreement", (student == teacher)[real].float().mean(), int(real.sum()))
            else:
                add("agreement", (student == teacher).float().mean(), n)
            if "labels" in terms:
                labels = terms["labels"]
                known = labels != IGNORE_INDEX
                tokens = int(known.sum())
                if tokens:
                    add("accuracy", (student == labels)[known].float().mean(), tokens)
                    add("teacher_accuracy", (teacher == labels)[known].float().mean(), tokens)
    return {key: sums[key] / max(counts[key], 1) for key in sums}


# ---- the loop ---------------------------------------------------------------------------------
@dataclass
class BridgeFit:
    history: list[dict]
    best_epoch: int
    best_loss: float
    initial: dict  # validation numbers of the untrained bridge
    steps: int = 0


def make_optimizer(bridge: TransformerBridge, s: BridgeSettings) -> torch.optim.Optimizer:
    groups = decay_groups(bridge, s.weight_decay,
                          lambda name: name == "mix_logits" or "embedding" in name or "positions" in name)
    return torch.optim.AdamW(groups, lr=s.lr)


def fit_bridge(bridge: TransformerBridge, train_pairs, val_pairs, s: BridgeSettings, device=None,
               probe: ModuleProbe | None = None, max_steps: int | None = None) -> BridgeFit:
    """AdamW with linear warm-up, gradient clipping, the learning rate halved on a stale epoch,
    early stopping on the validation loss; the bridge ends holding its best epoch's weights.
    `max_steps` stops early (tests). The distill objective needs `probe`."""
    device = torch.device(device or "cpu")
    if s.objective == "distill" and probe is None:
        raise ValueError("the distill objective needs a module (probe) to distil from")
    amp = s.amp and device.type == "cuda"
    optimizer = make_optimizer(bridge, s)
    rng = random.Random(s.seed)
    initial = evaluate(bridge, val_pairs, "validation", probe, s, device)
    tqdm.write("untrained bridge: " + _summary(initial), file=sys.stderr)  # a log's lines too; stdout is the summary
    history, best, best_epoch, stale, step = [], math.inf, 0, 0, 0
    best_state = copy.deepcopy(bridge.state_dict())
    base_lr = s.lr
    need_mse = s.objective == "mse" or s.mse_weight > 0
    started = time.perf_counter()
    for epoch in range(1, s.epochs + 1):
        if next_epoch_past_budget(started, len(history), s.max_minutes):
            stop_early(history, "max_minutes", epoch, s.epochs, best_epoch, s.max_minutes)
            break
        try:
            entry, val, step = run_bridge_epoch(bridge, train_pairs, val_pairs, s, device, probe, optimizer, rng,
                                                epoch, step, base_lr, amp, need_mse, max_steps)
        except KeyboardInterrupt:  # Ctrl-C on a long run: the best epoch so far is a result, not lost
            if not history:
                raise
            stop_early(history, "interrupt", epoch, s.epochs, best_epoch)
            break
        history.append(entry)
        improved = val["loss"] < best
        if improved:
            best, best_epoch, stale = val["loss"], epoch, 0
            best_state = copy.deepcopy(bridge.state_dict())
        else:
            stale += 1
            if s.lr_patience and stale % s.lr_patience == 0:
                base_lr *= 0.5
        tqdm.write(f"epoch {epoch}/{s.epochs}: train loss {entry['train_loss']:.4f}  validation {_summary(val)}"
                   f"{'  (kept)' if improved else ''}  [{entry['train_seconds']:.1f}s]", file=sys.stderr)
        if stale >= s.patience and epoch < s.epochs:
            stop_early(history, "patience", epoch, s.epochs, best_epoch, patience=s.patience)
        if stale >= s.patience or (max_steps and step >= max_steps):
            break
    bridge.load_state_dict(best_state)
    bridge.eval()
    return BridgeFit(history=history, best_epoch=best_epoch, best_loss=best, initial=initial, steps=step)


def run_bridge_epoch(bridge: TransformerBridge, train_pairs, val_pairs, s: BridgeSettings, device, probe, optimizer,
                     rng, epoch: int, step: int, base_lr: float, amp: bool, need_mse: bool,
                     max_steps: int | None) -> tuple[dict, dict, int]:
    """One epoch of training and its validation: (history entry, validation numbers, steps so far)."""
    bridge.train()
    t0 = time.perf_counter()
    total, count = 0.0, 0
    bar = progress_of(train_pairs.batches(s.batch_size, shuffle=True, rng=rng), bars=s.progress,
                      desc=f"epoch {epoch}/{s.epochs}", unit="batch")
    for rows in bar:
        lr = base_lr * min(1.0, (step + 1) / s.warmup_steps) if s.warmup_steps else base_lr
        for group in optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            terms = batch_terms(bridge, train_pairs, rows, "train", probe, s, device, need_mse=need_mse,
                                need_probe=s.objective == "distill")
        loss = objective_loss(terms, s)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if s.grad_clip:
            torch.nn.utils.clip_grad_norm_(bridge.parameters(), s.grad_clip)
        optimizer.step()
        step += 1
        total += loss.item() * len(rows)
        count += len(rows)
        bar.set_postfix(loss=f"{total / count:.4f}")
        if max_steps and step >= max_steps:
            break
    train_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    val = evaluate(bridge, val_pairs, "validation", probe, s, device)
    entry = {"epoch": epoch, "train_loss": total / max(count, 1), "validation_loss": val["loss"],
             **{f"validation_{k}": v for k, v in val.items() if k != "loss"},
             "lr": optimizer.param_groups[0]["lr"], "steps": step, "mix_weights": bridge.mix_weights().tolist(),
             "train_seconds": round(train_seconds, 2), "validation_seconds": round(time.perf_counter() - t0, 2)}
    return entry, val, step


def _summary(values: dict) -> str:
    return "  ".join(f"{k} {v:.4f}" for k, v in values.items())


# ---- the whole run ----------------------------------------------------------------------------
def read_texts(s: BridgeSettings) -> tuple[LabelledData, LabelledData, dict]:
    """(train data, validation data, where they came from) of the preset, or of a --texts file (a
    seeded tenth held out, no labels); pair datasets are not paired yet."""
    if s.texts:
        train, held = hold_out(read_text_lines(s.texts), 0.1, s.max_validation, s.seed)
        unlabelled = [SequenceExample(text, "") for text in train], [SequenceExample(text, "") for text in held]
        data = [LabelledData(TaskType.sequence_classification, rows, s.texts) for rows in unlabelled]
        return (data[0].subset(s.max_texts, s.seed), data[1],
                {"texts_file": str(Path(s.texts).resolve()), "texts_sha256": sha256_file(s.texts),
                 "train": f"the texts of {Path(s.texts).name} not held out",
                 "validation": f"a held-out tenth of {Path(s.texts).name}"})
    if s.dataset not in PRESETS:
        raise UsageError(f"unknown dataset {s.dataset!r}; presets: {sorted(PRESETS)}")
    preset = PRESETS[s.dataset]
    train_spec = preset_spec(preset, "train", s.data_dir)
    train = train_spec.read().subset(s.max_texts, s.seed)
    validation = preset_spec(preset, "validation", s.data_dir).read().subset(s.max_validation, s.seed)
    if train.has_pairs:
        raise UsageError(f"dataset {s.dataset} holds text pairs; bridges are trained on single texts for now")
    return train, validation, {"dataset": s.dataset, "train_file": str(train_spec.path),
                               "train": f"{s.dataset}'s training split", "validation": f"{s.dataset}'s validation split"}


@dataclass
class BridgeResult:
    name: str
    version: str
    artifact: Path
    report_dir: Path
    metrics: dict
    history: list[dict] = field(default_factory=list)
    training: dict = field(default_factory=dict)


def train_bridge(s: BridgeSettings, *, source=None, target=None, command: str = "") -> BridgeResult:
    """Backbones, texts, pairs, (module), bridge, fit, save, load back, served-path metrics, report."""
    from server.backbone import Backbone
    from server.bridges import bridge_store, load_bridge, save_bridge
    from training.bridges.pairing import PairedStates
    from training.settings import pick_device, set_threads
    from training.runs import (RunOutputs, check_cache_dir, save_as_free_version, say_if_bridge_outranked,
                               stored_name)

    if s.objective == "distill" and not s.module:  # a user's mistake: before any backbone loads
        raise UsageError("--objective distill needs --module (a module of the target backbone: TASK/VERSION of "
                         "the shipped store, or a STORE/TASK[/VERSION] folder)")
    train_data, val_data, provenance = read_texts(s)  # the user's files and presets before any backbone loads
    started = time.perf_counter()
    s = s.model_copy(update={"progress": s.progress if s.progress is not None else sys.stderr.isatty()})
    seed_everything(s.seed)
    set_threads(s.threads)
    device = pick_device(s.device)
    source = source or Backbone.load(s.source, device=str(device))
    target = target or Backbone.load(s.target, device=str(device))

    module = None
    if s.module:
        folder, task, version = module_folder(s.module, "--module")
        store = ModuleStore(folder)
        module = load_module(store, task, version, target, device=str(device), probe=probe_module)  # checks the TARGET fingerprint

    source_layers, target_layers = bridge_layers(s, source, target, module)
    s = s.model_copy(update={"source_layers": source_layers, "target_layers": target_layers})

    name = stored_name(s.name, "-".join([source.name, "to", target.name, s.objective]
                                        + ([module.task] if module and s.objective == "distill" else [])),
                       "--name", "bridge")
    store = bridge_store(s.bridge_store or DEFAULT_BRIDGE_STORE)
    numbered = s.version is None
    s = s.model_copy(update={"version": store.next_version(name) if numbered else s.version})
    outputs = RunOutputs.checked(f"bridge-{name}-{s.version}", s.run_dir, store, s.report_dir,
                                 name, s.version, s.overwrite, what="bridge ",
                                 fix="give --run-dir (or --bridge-store and --report-dir) in a folder you can write")
    check_cache_dir(s.cache_dir)

    t0 = time.perf_counter()
    build = dict(source=source, target=target, source_layers=source_layers, target_layers=target_layers,
                 cache_dir=Path(s.cache_dir) if s.cache_dir else None, batch_size=s.eval_batch_size,
                 progress=s.progress)
    train_pairs = PairedStates.build(train_data.texts(), **build)
    val_pairs = PairedStates.build(val_data.texts(), **build)
    pairs_seconds = time.perf_counter() - t0

    probe = module_probe(s, module, (train_data, train_pairs), (val_data, val_pairs), device) if module else None

    shape = {name: getattr(s, name) for name in BridgeShape.model_fields}
    bridge = TransformerBridge.for_backbones(source, target, source_layers, target_layers, **shape).to(device)
    if s.standardise:
        bridge.set_standardisation(state_statistics(train_pairs, "source", s.eval_batch_size),
                                   state_statistics(train_pairs, "target", s.eval_batch_size))
        bridge.to(device)
    result = fit_bridge(bridge, train_pairs, val_pairs, s, device, probe)
    train_seconds = time.perf_counter() - started

    metrics = validation_metrics(s, result, probe)
    training = {
        "command": command, "objective": s.objective, "settings": s.model_dump(mode="json"),
        "module": ({"task": module.task, "version": module.version, "spec": s.module,
                    "task_type": module.head.task_type.value,
                    "weights_sha256": module.manifest.weights_sha256} if module else None),
        "data": {**provenance, "train_texts": len(train_pairs), "validation_texts": len(val_pairs),
                 "train_texts_sha256": _texts_sha(train_pairs.texts), "validation_texts_sha256": _texts_sha(val_pairs.texts)},
        "best_epoch": result.best_epoch, "epochs_run": len(result.history), "steps": result.steps,
        "history": result.history, "parameters": count_parameters(bridge),
        "timing": {"pairs_seconds": round(pairs_seconds, 2), "total_seconds": round(train_seconds, 2),
                   "epoch_seconds": [h["train_seconds"] for h in result.history]},
        "environment": run_environment(device),
    }
    description = s.description or (f"transformer bridge {source.name} -> {target.name}, {s.objective} objective"
                                     + (f" through {module.task}/{module.version}" if module and s.objective == "distill" else ""))
    bridge.cpu()
    outputs = outputs.claimed()
    report_dir = outputs.report_dir

    def save(version: str) -> Path:
        training["settings"]["version"] = version
        return save_bridge(store, name, version, bridge, source, target, training=training, metrics=metrics,
                           description=description, overwrite=s.overwrite and not numbered)

    artifact, version = save_as_free_version(save, store, name, s.version, numbered, outputs)
    s = s.model_copy(update={"version": version})
    say_if_bridge_outranked(store, name, version)
    # refuse to report success on an artifact that does not load; measure it the way it serves
    loaded = load_bridge(store, name, s.version, source, device=str(device))
    served = evaluate(loaded.bridge, val_pairs, "validation", probe, s, device, served=True, progress=s.progress)
    metrics["served"] = served
    outcome = BridgeResult(name=name, version=s.version, artifact=artifact, report_dir=report_dir, metrics=metrics,
                           history=result.history, training=training)
    write_bridge_report(report_dir, outcome)
    return outcome


def bridge_layers(s: BridgeSettings, source, target, module) -> tuple[list[int], list[int]]:
    """(the source states mixed, the target states produced): --source-layers, default every state;
    --target-layers, default the module's, else every state; each the backbone's, and every state the
    module reads among those produced."""
    source_layers = s.source_layers or list(range(source.num_layers + 1))
    target_layers = s.target_layers or (module.head.layers_read() if module else list(range(target.num_layers + 1)))
    check_layers(source_layers, source, "--source-layers")
    check_layers(target_layers, target, "--target-layers")
    if module is not None:
        missing = sorted(set(module.head.layers_read()) - set(target_layers))
        if missing:
            raise UsageError(f"module {module.task}/{module.version} reads target states {missing} "
                             f"that --target-layers {target_layers} leaves out")
    return source_layers, target_layers


def module_probe(s: BridgeSettings, module, train: tuple, validation: tuple, device) -> ModuleProbe:
    """The target module read through the bridge while it trains: its answers on the validation texts
    (and on the training texts, for the distill objective), scored against the data's labels where
    they are the module's. `train`, `validation`: (the split's data, its paired states)."""
    labels = {}
    for split, (data, pairs) in (("train", train), ("validation", validation)):
        found = hard_labels(data, module.head.labels, pairs, module.head.task_type == TaskType.token_classification)
        if found is not None:
            labels[split] = found
    if s.objective == "distill" and s.ce_weight and "train" not in labels:
        raise UsageError(f"--ce-weight needs the dataset's labels to be the module's {module.head.labels}")
    read = {"train": train[1], "validation": validation[1]} if s.objective == "distill" else {"validation": validation[1]}
    return ModuleProbe(module, read, s.eval_batch_size, device, labels, progress=s.progress)


def validation_metrics(s: BridgeSettings, result, probe: ModuleProbe | None) -> dict:
    """The kept epoch's validation figures (the epoch validation chose), the untrained bridge's, and the
    majority answer's accuracy where the module's labels are known."""
    best = result.history[result.best_epoch - 1] if result.best_epoch else {}
    metrics = {"objective": s.objective, "split": "validation", "best_epoch": result.best_epoch,
               "validation_loss": result.best_loss,
               **{k.removeprefix("validation_"): v for k, v in best.items()
                  if k.startswith("validation_") and k != "validation_seconds"},
               "untrained": result.initial}
    if probe is not None and "validation" in probe.labels:
        metrics["majority_accuracy"] = majority_share(probe.labels["validation"])
    return metrics


def _texts_sha(texts) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(list(texts), ensure_ascii=False).encode()).hexdigest()


# ---- report -----------------------------------------------------------------------------------
def findings(result: BridgeResult) -> list[str]:
    """The validation numbers in words, each beside the same texts' baselines: the untrained bridge
    and, with the module's labels, the majority answer and the module on its own backbone."""
    m, untrained = result.metrics, result.metrics.get("untrained", {})
    data = result.training.get("data", {})
    token_task = (result.training.get("module") or {}).get("task_type") == TaskType.token_classification.value
    role = validation_role(result.training.get("epochs_run", 1) > 1, False, False)  # one epoch: nothing chosen
    lines = [f"validation: {data.get('validation_texts', '?')} texts, {data.get('validation', '?')}; they {role}"
             + (", so the numbers are optimistic" if optimistic(role) else "")]
    if "agreement" in m:
        lines.append(f"the module's answer through the bridge is its answer on its own backbone for "
                     f"{m['agreement']:.1%} of the {'tokens' if token_task else 'texts'} "
                     f"(untrained bridge {untrained.get('agreement', float('nan')):.1%})")
    if "accuracy" in m:
        lines.append(f"the module's accuracy through the bridge {m['accuracy']:.4f}; on its own backbone "
                     f"{m['teacher_accuracy']:.4f}; untrained bridge {untrained.get('accuracy', float('nan')):.4f}; "
                     f"the majority answer {m.get('majority_accuracy', float('nan')):.4f}")
        if "majority_accuracy" in m:
            lines.append(bridge_verdict(m, data.get("validation_texts")))
    lines.append(f"cosine of the bridged states to the target's real ones {m['cosine']:.4f} "
                 f"(untrained bridge {untrained.get('cosine', float('nan')):.4f})")
    epochs, best = result.training.get("epochs_run"), result.training.get("best_epoch")
    stopped = result.history[-1].get("stopped_by") if result.history else None
    if stopped:
        patience = result.training.get("settings", {}).get("patience")
        why = {"interrupt": "interrupted (Ctrl-C)", "max_minutes": "stopped by --max-minutes",
               "patience": f"stopped early ({patience} epochs in a row without a lower validation loss, --patience)"}
        lines.append(f"{why[stopped]} after epoch {epochs}: kept epoch {best}, the best so far")
    elif best and best == epochs == result.training.get("settings", {}).get("epochs") > 1:  # one shows no trend
        lines.append(f"kept epoch {best} of {epochs}, the last: validation was still improving; train longer")
    elif best:
        lines.append(f"kept epoch {best} of {epochs} run")
    return lines


def bridge_verdict(m: dict, rows: int | None) -> str:
    """Whether the module, served through this bridge, is worth serving (above the majority answer), and
    what serving it this way costs against the module on its own backbone."""
    bridged, majority, own = m["accuracy"], m["majority_accuracy"], m["teacher_accuracy"]
    few = too_few(rows)
    if bridged <= majority:
        line = (f"verdict: through this bridge the module answers no better than the majority answer ({bridged:.4f} "
                f"against {majority:.4f}): not worth serving this way; pair more texts (--max-texts, --texts) or "
                "train longer (--epochs)")
    else:
        line = (f"verdict: through this bridge the module is {bridged - majority:+.4f} over the majority answer and "
                f"{bridged - own:+.4f} against itself on its own backbone")
    return line + (f"; {few}" if few else "")


def report_text(result: BridgeResult) -> str:
    settings = result.training.get("settings", {})
    data = result.training.get("data", {})
    module = result.training.get("module")
    lines = [f"# bridge {result.name}/{result.version}", "",
             f"{settings.get('target')} modules served on {settings.get('source')}: {result.training.get('objective')} "
             f"objective{' through ' + module['task'] + '/' + module['version'] if module else ''}, trained on "
             f"{data.get('train_texts')} texts, {data.get('train')}.", ""]
    lines += [f"- {line}" for line in findings(result)]
    lines += ["- the losses and validation numbers by epoch (0: untrained): curves.png", "",
              bridge_serving(settings.get("source"), Path(result.artifact).parents[1], settings.get("target")), ""]
    return "\n".join(lines)


def write_bridge_report(report_dir: Path, result: BridgeResult) -> dict[str, Path]:
    """report.md, metrics.json and curves.png (losses; cosine / agreement with the teacher)."""
    from training.report import mark_epochs, plt  # matplotlib on the Agg backend

    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    paths = {"report": report_dir / "report.md", "metrics": report_dir / "metrics.json",
             "curves": report_dir / "curves.png"}
    paths["report"].write_text(report_text(result))
    summary = {"bridge": result.name, "version": result.version, "artifact": str(result.artifact),
               "validation": result.metrics, "history": result.history,
               **{k: result.training[k] for k in ("command", "objective", "module", "best_epoch", "epochs_run",
                                                  "steps", "parameters", "timing", "data") if k in result.training}}
    paths["metrics"].write_text(json.dumps(summary, indent=2) + "\n")

    history = result.history
    epochs = [h["epoch"] for h in history]
    untrained = result.metrics.get("untrained", {})  # drawn as epoch 0 of the validation curves
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    axes[0].plot(epochs, [h["train_loss"] for h in history], marker="o", label="train")
    axes[0].plot([0] * ("loss" in untrained) + epochs,
                 [untrained["loss"]] * ("loss" in untrained) + [h["validation_loss"] for h in history],
                 marker="o", label="validation (0: untrained)")
    axes[0].set_title(f"loss ({result.training.get('objective', '')})")
    axes[0].legend()
    for key, label in (("cosine", "cosine to real states"), ("agreement", "agreement with teacher"),
                       ("accuracy", "module accuracy (bridged)")):
        if history and f"validation_{key}" in history[0]:
            start = [0] * (key in untrained)
            axes[1].plot(start + epochs, [untrained[key]] * len(start) + [h[f"validation_{key}"] for h in history],
                         marker="o", label=label)
    if history and "validation_teacher_accuracy" in history[0]:
        axes[1].axhline(history[0]["validation_teacher_accuracy"], color="grey", linestyle=":", label="module accuracy (real)")
    if "majority_accuracy" in result.metrics:  # the verdict's bar: a bridged accuracy under it serves nothing
        axes[1].axhline(result.metrics["majority_accuracy"], color="black", linestyle="-.", linewidth=1,
                        label="the majority answer's accuracy")
    axes[1].set_title("validation")
    axes[1].legend(fontsize=7)
    mark_epochs(axes, result.training.get("best_epoch"))
    fig.suptitle(f"bridge {result.name}/{result.version} (dashed: best epoch, the one kept)")
    fig.tight_layout()
    fig.savefig(paths["curves"], dpi=110)
    plt.close(fig)
    return paths


def cmd_bridge(args, command: str) -> int:
    """`tmod-train bridge`: options given win over the --config file's, which win over BridgeSettings' defaults."""
    from training.settings import read_config_file

    values = read_config_file(args.config) if args.config else {}
    values.update({k: v for k, v in vars(args).items() if k not in ("command", "config") and v is not None})
    result = train_bridge(BridgeSettings(**values), command=command)
    for line in findings(result):
        print(line, file=sys.stderr)
    headline = {k: v for k, v in result.metrics.items() if isinstance(v, (int, float, str))}
    print(json.dumps({"bridge": result.name, "version": result.version, "artifact": str(result.artifact),
                      "report": str(result.report_dir), "validation": headline,
                      "untrained": result.metrics.get("untrained", {})}, indent=2))
    return 0
