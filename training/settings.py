"""Every knob of a layer-mix training run, with defaults per task type.

Precedence, lowest first: field defaults, task-type defaults (for knobs left unset), the
`--config` YAML/JSON file, then options given on the command line. The resolved settings are
saved into the artifact's manifest, so a module says exactly how it was trained.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from modules_store import ArtifactError, TaskType
from modules_store.manifest import check_name
from server.config import device_problem, quota_threads, quota_threads_line
from training.data.files import ENCODING, UsageError

# Knobs whose sensible value depends on the task type (DESIGN.md section 1: sequence heads use
# k=64 and alpha=64; token heads k=128, alpha=128, entropy penalty 1e-3, cutoff 1e-2).
TASK_DEFAULTS: dict[TaskType, dict] = {
    TaskType.sequence_classification: {
        "project_dim": 64, "alpha": 64.0, "cutoff": 5e-3, "lambda_entropy": 0.0, "ffn_dim": 256, "metric": "accuracy",
        "casing": False,
    },
    TaskType.multi_label_classification: {
        "project_dim": 64, "alpha": 64.0, "cutoff": 5e-3, "lambda_entropy": 0.0, "ffn_dim": 256, "metric": "f1_macro",
        "casing": False,
    },
    TaskType.token_classification: {
        "project_dim": 128, "alpha": 128.0, "cutoff": 1e-2, "lambda_entropy": 1e-3, "ffn_dim": 512, "metric": "f1",
        # the backbones' tokenizers lowercase; entities are mostly capitalised (WNUT-17, MiniLM: +2.7 validation
        # and +3.0 test entity F1 with it, docs/training.md)
        "casing": True,
    },
}

# the selection metrics a task type can be trained for (--metric; f1 for a sequence task: two labels only)
METRICS = {
    TaskType.sequence_classification: ("accuracy", "f1", "f1_macro", "mcc"),
    TaskType.multi_label_classification: ("f1_macro", "f1_micro"),
    TaskType.token_classification: ("f1", "precision", "recall", "word_accuracy"),
}


def parse_layers(value, option: str = "") -> list[int] | None:
    """'all' / None -> None (every state); '6' -> [6]; '0-6' -> [0..6]; '1,3,5' -> [1, 3, 5]."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "all")):
        return None
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return sorted({int(v) for v in value})
    layers = set()
    for part in str(value).split(","):
        low, _, high = part.strip().partition("-")
        if not (low.strip().isdigit() and (high.strip().isdigit() or not high)):
            raise UsageError(f"{option + ': ' if option else ''}{part.strip()!r} is not a state number or range: "
                             "give 6, 0-6 or 1,3,5 (0 = the embeddings)")
        if high and int(high) < int(low):  # an empty range: it was 'List should have at least 1 item'
            raise UsageError(f"{option + ': ' if option else ''}{part.strip()!r} runs downwards: give the range low to "
                             f"high, {int(high)}-{int(low)}")
        layers.update(range(int(low), int(high or low) + 1))
    return sorted(layers)


def check_layers(layers: list[int], backbone, option: str) -> None:
    """A state the backbone does not have, refused in one line."""
    bad = [i for i in layers if not 0 <= i <= backbone.num_layers]
    if bad:
        raise UsageError(f"{option} {bad}: {backbone.name} has states 0..{backbone.num_layers} (0 = the embeddings)")


def number(value, expected: str, kind: type = float):
    """`value` as a `kind` (float, int), or ValueError saying what was expected (not Python's 'could
    not convert string to float')."""
    try:
        return kind(str(value).strip())
    except ValueError:
        raise ValueError(f"{expected} (got {str(value).strip()!r})") from None


def listed(value, expected: str, kind: type = str) -> list | None:
    """A list setting given as the command line gives it ('256,128') or as a config file may (that string,
    one value, or a list): a list of `kind`, or ValueError saying what was expected."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, (list, tuple)) else [value]
    return [number(v, expected, kind) for v in items if str(v).strip()]


def parse_label_map(value) -> dict[str, str] | None:
    """'0=negative,1=positive' or a dict -> {'0': 'negative', '1': 'positive'}."""
    if value is None or isinstance(value, dict):
        return {str(k): str(v) for k, v in value.items()} if value else None
    pairs = [item.split("=", 1) for item in str(value).split(",") if item.strip()]
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"label map {value!r}: expected raw=name pairs separated by commas")
    mapped = {}
    for raw, name in pairs:  # a raw label mapped twice kept the last name, quietly
        if raw.strip() in mapped and mapped[raw.strip()] != name.strip():
            raise ValueError(f"label map {value!r}: {raw.strip()!r} is mapped twice ({mapped[raw.strip()]!r} and "
                             f"{name.strip()!r}); one raw label has one name (several raw labels may share one)")
        mapped[raw.strip()] = name.strip()
    return mapped


# Learning rates per head kind: a fresh small head learns fast; copied transformer blocks are
# fine-tuned gently; LoRA factors sit in between.
KIND_LR = {"layermix": 1e-3, "mtb": 5e-5, "lora-mtb": 5e-4}
# Token tasks' layer-mix heads learn better slower: WNUT-17 on MiniLM, two seeds each, validation entity F1
# 0.4654 / 0.4692 at 1e-3 against 0.4925 / 0.4884 at 3e-4 (test 0.3303 / 0.3080 against 0.3268 / 0.3290;
# docs/training.md, bench/results/own-task-wnut17-sweep-minilm.json)
TOKEN_LAYERMIX_LR = 3e-4


def checked_version(value: str | None) -> str | None:
    """A --version (or a config's `version`) a store takes as a folder name, checked before anything
    loads: '../x' was refused by the store only after the backbone had loaded."""
    if value is not None:
        try:
            check_name(value)
        except ArtifactError as exc:
            raise ValueError(exc.message) from None
    return value

class TrainSettings(BaseModel):
    # a YAML config's `version: 7` or `task: 2024` is a name, not a refused "valid string"
    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True)

    kind: Literal["layermix", "mtb", "lora-mtb"] = Field("layermix", description="head kind to train")

    # ---- data
    dataset: str | None = Field(None, description="preset: sst2, cola, rte, conll2003, goemotions")
    train: str | None = Field(None, description="training file (instead of a preset)")
    validation: str | None = Field(None, description="validation file (instead of a preset)")
    test: str | None = Field(None, description="test file: scored once at the end, never used to choose anything")
    split: list[float] | None = Field(
        None, description="validation and test fractions carved from the training file (seeded, stratified by label "
        "for single-label tasks), for a single labelled file: '0.1,0.1'; one number carves validation only")
    format: Literal["tsv", "csv", "jsonl", "conll"] | None = None
    text_column: str | int | None = None
    pair_column: str | int | None = None
    label_column: str | int | None = None
    header: bool = True
    label_map: dict[str, str] | None = None
    labels: list[str] | None = Field(None, description="label order of the head (default: preset or sorted)")
    multi_label: bool = Field(False, description="independent labels (one sigmoid each, binary cross-entropy): a "
                              "label cell holds comma-separated labels; decision thresholds are chosen on validation")
    data_dir: str | None = None
    max_train: int | None = Field(None, ge=1, description="seeded random subset of the training split (with "
                                  "document_windows: whole documents, N sentences in all)")
    max_validation: int | None = Field(None, ge=1)
    document_windows: list[int] | None = Field(
        None, description="token tasks from a CoNLL file: also train on its documents (the sentences between "
        "-DOCSTART- lines, words joined with spaces) read in windows of these many word pieces, cut as the server "
        "cuts a long text (server/windows.py), so the head learns sentences inside running text; validation stays "
        "sentence by sentence")
    none_below: float | Literal["auto"] | None = Field(
        None, description="single-label tasks: answer no label (none of these) when the best probability is under "
        "this; auto: chosen on validation (the threshold with the most right minus wrong answers). Stored in the "
        "manifest (decoding.threshold); a request's `threshold` overrides it")
    # ---- head
    layers: list[int] | None = Field(None, description="backbone states to mix (0 = embeddings); default all")
    project_dim: int | None = Field(None, ge=1)
    alpha: float | None = Field(None, gt=0)
    cutoff: float | None = Field(None, ge=0, lt=1)
    lambda_entropy: float | None = Field(None, ge=0)
    dropout: float = Field(0.1, ge=0, lt=1)
    attention_heads: int = Field(4, ge=1)
    encoder_layers: int = Field(1, ge=1)
    ffn_dim: int | None = Field(None, ge=1)
    positional: bool = False
    casing: bool | None = Field(None, description="casing embedding read from the raw text (default: token tasks)")
    attention: bool = True
    # ---- MTB / LoRA-MTB heads
    blocks: int = Field(1, ge=1, description="MTB: backbone blocks copied and trained")
    source_layer: int | None = Field(None, ge=0, description="MTB: state the blocks read (default: before the copied last blocks)")
    pooling: Literal["mean", "cls", "pair"] = Field(
        "mean", description="sequence tasks: pooling before the classifier (layer-mix: mean, pair; MTB: mean, cls)")
    rank: int = Field(8, ge=1, description="LoRA-MTB: rank of the updates")
    lora_alpha: float = Field(16.0, gt=0, description="LoRA-MTB: updates are scaled by lora_alpha / rank")
    targets: list[str] | None = Field(None, description="LoRA-MTB: block linears to adapt (default: all six)")
    # ---- knowledge distillation (training/distill.py)
    distill_from: str | None = Field(
        None, description="token tasks from a CoNLL file: a stored module tags every training word once (the "
        "teacher: TASK/VERSION in the shipped store, or a STORE/TASK/VERSION folder; e.g. ner/mpnet-2), through the "
        "served path on its own backbone at the precision it was trained at (fp32 where this device would emulate "
        "that); its word logits are kept in $TMOD_CACHE_DIR/teacher. The loss mixes the gold tags' cross-entropy with KL towards the teacher's tag "
        "distribution of each word (the words' first sub-tokens on both sides)")
    distill_backbone: str | None = Field(None, description="the teacher's backbone: a folder, or minilm / smollm2 / "
                                         "mpnet (default: the one its manifest names)")
    distill_temperature: float = Field(2.0, gt=0, description="softmax temperature T of the KL term (scaled by T^2)")
    distill_weight: float = Field(0.5, ge=0, le=1, description="loss = (1 - w) * cross-entropy + w * T^2 * KL")
    # ---- optimisation
    optimizer: Literal["adam", "adamw"] = "adamw"
    lr: float | None = Field(None, gt=0, description="default per kind: layermix 1e-3 (3e-4 for token tasks), "
                             "mtb 5e-5, lora-mtb 5e-4")
    weight_decay: float = Field(0.01, ge=0)
    batch_size: int = Field(32, ge=1)
    eval_batch_size: int = Field(128, ge=1, description="batch size of backbone passes and evaluation")
    epochs: int = Field(10, ge=1)
    patience: int = Field(3, ge=1, description="early stopping: epochs without a better validation metric")
    max_minutes: float | None = Field(None, gt=0, description="time budget (a shared machine): no epoch is started "
                                      "that would end, at the last epoch's pace, past this many minutes of epochs; "
                                      "the kept epoch is still chosen by validation")
    min_delta: float = Field(0.002, ge=0, description="an epoch replaces the kept one when its validation metric is "
                             "higher by at least this, or within this and its validation loss is lower by min_loss_delta")
    min_loss_delta: float = Field(0.01, ge=0, lt=1, description="relative drop of the validation loss that counts as "
                                  "better among epochs whose metrics are within min_delta")
    select: Literal["best", "last"] = Field(
        "best", description="best: keep the epoch with the best validation metric (early stopping, learning rate "
                            "cut on plateaus); last: train exactly --epochs epochs and keep the last (validation "
                            "is only reported: for an epoch count chosen beforehand, e.g. on a held-out split)")
    lr_patience: int = Field(1, ge=0, description="ReduceLROnPlateau patience (epochs)")
    lr_factor: float = Field(0.5, gt=0, lt=1)
    min_lr: float = Field(1e-6, ge=0)
    grad_clip: float = Field(1.0, ge=0, description="max gradient norm; 0 turns clipping off")
    metric: str | None = Field(None, description="validation metric to select on (default per task)")
    class_weights: Literal["none", "balanced"] = Field(
        "none", description="single-label sequence tasks: balanced weighs each class's loss by the inverse of its "
        "share of the training rows (scikit-learn's class_weight='balanced'), so a rare class counts as much as "
        "a frequent one; the head's scores then lean toward rare classes")
    seed: int = 0
    states: Literal["cache", "recompute"] = Field(
        "cache", description="cache backbone states once (fp16) or recompute them every epoch")
    device: str = "auto"
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "fp32", description="backbone precision (backend torch, as `tmod-serve --precision`): the states the "
        "head is trained and scored on. auto: bf16 on a CPU with native bfloat16, else fp32")
    state_cache: bool = Field(False, description="also keep the split's backbone states on disk "
                              "($TMOD_CACHE_DIR/states), so a later run on the same data (a baseline) reuses them; and "
                              "the linear baseline's result ($TMOD_CACHE_DIR/baselines)")
    threads: int = Field(0, ge=0, description="CPU threads for torch; 0: one per core, or a container's smaller CPU "
                         "quota. 1 is much faster when other processes compete for the cores")
    amp: bool | None = Field(None, description="bf16 autocast; default on for CUDA")
    # ---- output
    task: str | None = None
    version: str | None = None  # None: the next free number in the store (training/trainer.py)
    store: str | None = None
    run_dir: str | None = None
    report_dir: str | None = None
    backbone: str | None = Field(None, description="backbone folder, or minilm (default) / smollm2 / mpnet")
    description: str = ""
    overwrite: bool = False
    progress: bool | None = Field(None, description="progress bars (default: only when stderr is a terminal)")
    load_into: str | None = Field(None, description="URL of a running tmod-serve whose --store is --store: hot-load "
                                  "the new module there (admin token from $TMOD_ADMIN_TOKEN)")

    @field_validator("layers", mode="before")
    @classmethod
    def _layers(cls, value):
        return parse_layers(value)

    @field_validator("version")
    @classmethod
    def _version(cls, value):
        return checked_version(value)

    @field_validator("document_windows", mode="before")
    @classmethod
    def _document_windows(cls, value):
        return listed(value, "word pieces a window, comma-separated: 256,128", int)

    @field_validator("labels", mode="before")
    @classmethod
    def _labels(cls, value):
        value = listed(value, "label names, comma-separated")
        twice = sorted({label for label in value or () if value.count(label) > 1})
        if twice:  # class ids named by place: two ids of one name made every row one label
            raise ValueError(f"names {twice} more than once: each label once, in the head's order")
        return value

    @field_validator("none_below", mode="before")
    @classmethod
    def _none_below(cls, value):
        if value is None or value == "auto":
            return value
        value = number(value, "a probability between 0 and 1, or auto")
        if not 0 < value < 1:
            raise ValueError("a probability between 0 and 1, or auto")
        return value

    @field_validator("split", mode="before")
    @classmethod
    def _split(cls, value):
        parts = listed(value, "one or two fractions, VALIDATION[,TEST]: 0.1 or 0.1,0.1", float)
        if parts is not None and not (1 <= len(parts) <= 2 and all(0 < p < 1 for p in parts) and sum(parts) < 1):
            raise ValueError("give one or two fractions between 0 and 1 that sum to under 1: VALIDATION[,TEST]")
        if parts is not None and sum(parts) > 0.5:  # '--split 0.8' meant as the training share trains on a fifth
            raise ValueError(f"{','.join(map(str, parts))} holds out {sum(parts):.0%} of the file and trains on "
                             f"{1 - sum(parts):.0%}: it gives the held-out fractions, VALIDATION[,TEST] (e.g. 0.1 or "
                             "0.1,0.1); to train on fewer rows, --max-train N")
        return parts

    @field_validator("targets", mode="before")
    @classmethod
    def _targets(cls, value):
        return listed(value, "block linears, comma-separated: query,value")

    @field_validator("label_map", mode="before")
    @classmethod
    def _label_map(cls, value):
        return parse_label_map(value)

    def with_task_defaults(self, task_type: TaskType) -> "TrainSettings":
        """A copy with the knobs left unset filled from TASK_DEFAULTS."""
        unset = {k: v for k, v in TASK_DEFAULTS[task_type].items() if getattr(self, k) is None}
        if self.lr is None:
            token_mix = self.kind == "layermix" and task_type == TaskType.token_classification
            unset["lr"] = TOKEN_LAYERMIX_LR if token_mix else KIND_LR[self.kind]
        return self.model_copy(update=unset)


def pick_device(name: str):
    """--device: auto (cuda where torch sees a GPU, else cpu), or a device torch can use here; one
    it cannot (cuda on a CPU-only build, a GPU index not there) is a UsageError naming why."""
    import torch  # here only: a usage error is answered before torch is imported

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    problem = device_problem(name)
    if problem:
        raise UsageError(f"--device {name}: {problem}")
    return torch.device(name)


def set_threads(threads: int | None) -> None:
    """torch's CPU threads: `threads` (--threads) when given; else, in a container whose CPU quota is below
    the cores this process sees, the quota, said in a line (as tmod-serve: a thread per core under a smaller
    quota is throttled); else torch's own, one per core."""
    import torch

    if not threads and (threads := quota_threads()):
        print(quota_threads_line(threads), file=sys.stderr)
    if threads:
        torch.set_num_threads(threads)


def read_config_file(path: str | Path) -> dict:
    """A YAML or JSON mapping of settings (keys as in TrainSettings, '-' or '_' both accepted)."""
    path = Path(path)
    try:
        text = path.read_text(encoding=ENCODING)
        data = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except OSError as exc:
        raise UsageError(f"--config {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"--config {path}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"--config {path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise UsageError(f"--config {path}:{mark.line + 1 if mark else '?'}: not valid YAML "
                         f"({getattr(exc, 'problem', None) or exc})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: a config file must hold a mapping of settings, got {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}
