"""Knowledge distillation for token heads (`tmod-train ... --distill-from TASK/VERSION`).

A stored module, the teacher (e.g. the quality tier's `ner/mpnet-2`), tags every word the run
trains on once; the student learns from a mix of the gold tags' cross-entropy and the KL
divergence towards the teacher's tag distribution of each word (Hinton et al., 2015):

    loss = (1 - w) * CE(gold) + w * T^2 * KL(softmax(teacher / T) || softmax(student / T))

the KL term averaged over the words the teacher tagged.

The two backbones tokenize differently, so the two are aligned by the data's WORDS: each head's
logits of a word are read at the word's first sub-token, as scoring and the server read a word
(`training.evaluate.word_values`). The teacher reads each training sentence once, through the served
path (`training.evaluate.served_logits`: Engine.logits on its own backbone at the precision it was
trained at, or fp32 where this device would emulate that one), only the sentences that hold a
training word (--max-train and --split leave most of a large file out); every training row, a
sentence or a document window (training/data/conll.py), knows where its words start among the file's
words (`TokenExample.file_offset`) and looks their teacher logits up there. The teacher's word
logits are kept in $TMOD_CACHE_DIR/teacher/<key>.safetensors (key: the teacher's weights and
backbone, its precision, the training file) with a mask of the sentences read so far, so a later run
with the same teacher and file reads only those it lacks.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from modules_store import ModuleStore, TaskType
from server.backbone import Backbone
from server.backbone.sources import default_cache_dir, named_for
from server.config import auto_precision, cpu_has_native_bf16
from server.modules import load_module
from server.probe import probe_module
from training.data.conll import read_conll
from training.data.examples import LabelledData
from training.data.files import UsageError
from training.data.word_tags import word_first_tokens
from training.evaluate import served_logits, word_values
from training.splits import module_folder
from training.runs import write_cache_file
from training.states import Split

TEACHER_FORMAT = 2  # 2: a `tagged` mask (sentences read so far)


def distill_kl(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """T^2 * KL(softmax(teacher/T) || softmax(student/T)), averaged over inputs (mask None) or
    over the positions where `mask` (B, T) is true."""
    t = F.log_softmax(teacher.float() / temperature, dim=-1)
    s = F.log_softmax(student.float() / temperature, dim=-1)
    kl = (t.exp() * (t - s)).sum(-1)
    if mask is None:
        return kl.mean() * temperature ** 2
    weights = mask.to(kl.dtype)
    return (kl * weights).sum() / weights.sum().clamp(min=1) * temperature ** 2


def resolve_teacher(spec: str) -> tuple[ModuleStore, str, str]:
    """(store, task, version) of `--distill-from` (where it lies: `module_folder`)."""
    folder, task, version = module_folder(spec)
    return ModuleStore(folder), task, version


@dataclass
class TeacherWords:
    """The teacher's logits of every word of a CoNLL file, in file order."""

    words: list[str]  # the file's words
    logits: np.ndarray  # (words, labels) float32, in `labels` order
    has_token: np.ndarray  # (words,) bool: False where truncation cut the word (no logits)
    labels: list[str]
    about: dict  # teacher, backbone, precision, file, cache, seconds: what the manifest records

    def in_order(self, labels: list[str]) -> "TeacherWords":
        """The same with the label columns in `labels`' order (the student's)."""
        if set(labels) != set(self.labels):
            raise UsageError(f"--distill-from: the teacher's labels {self.labels} are not the student's {labels}")
        columns = [self.labels.index(label) for label in labels]
        return TeacherWords(self.words, self.logits[:, columns], self.has_token, list(labels), self.about)


def teacher_precision(trained_at: str, device: str) -> str:
    """The precision the teacher reads at: the one it was trained at (the states it learnt from),
    but fp32 where this device would emulate that one, as `tmod-serve --precision auto` serves it
    there: bf16 on a CPU without native bfloat16 took 7.7x fp32's time on an AVX2 CPU, fp16 on a CPU."""
    if trained_at == "auto":  # what suits the device, here as where it was trained
        return auto_precision("torch", device)
    native = trained_at == "fp32" or torch.device(device).type == "cuda" or (trained_at == "bf16" and cpu_has_native_bf16())
    return trained_at if native else "fp32"


def teacher_words(spec: str, train_file: str | Path, backbone_spec: str | None = None, device: str = "cpu",
                  batch_size: int = 128, progress: bool = True, cache_dir: Path | None = None,
                  rows: Sequence | None = None) -> TeacherWords:
    """The teacher's word logits of `train_file` (a CoNLL file) wherever `rows` (the examples a run
    trains on: sentences and document windows, each knowing its file_offset; default: the whole
    file) hold a word: the file's sentences that hold one are tagged, the others not (with
    --max-train or --split, most of a large file). The cache keeps every sentence tagged so far, so a
    later run with the same teacher and file tags only the sentences it lacks."""
    store, task, version = resolve_teacher(spec)
    manifest = store.read_manifest(task, version)
    if manifest.task_type != TaskType.token_classification:
        raise UsageError(f"--distill-from {spec}: a {manifest.task_type.value} module; the teacher must tag tokens")
    backbone_spec = backbone_spec or named_for(manifest.backbone.name)
    if backbone_spec is None:
        raise UsageError(f"--distill-from {spec}: its backbone {manifest.backbone.name!r} has no name here; "
                         f"give its folder with --distill-backbone")
    precision = teacher_precision((manifest.training or {}).get("settings", {}).get("precision", "fp32"), device)
    data = read_conll(train_file)
    file_sha = hashlib.sha256(Path(train_file).read_bytes()).hexdigest()
    key = hashlib.sha256(json.dumps({
        "format": TEACHER_FORMAT, "weights": manifest.weights_sha256, "backbone": list(manifest.backbone.identity()),
        "precision": precision, "file": file_sha}, sort_keys=True).encode()).hexdigest()
    path = (cache_dir or default_cache_dir() / "teacher") / f"{key}.safetensors"
    words = [w for ex in data.examples for w in ex.words]
    wanted = np.zeros(len(words), dtype=bool)
    for example in (data.examples if rows is None else rows):
        wanted[example.file_offset:example.file_offset + len(example.words)] = True
    sentences = [ex for ex in data.examples if wanted[ex.file_offset:ex.file_offset + len(ex.words)].any()]
    gold = [t for ex in data.examples for t in ex.tags]
    cached = read_cache(path, len(words))
    logits, has_token, tagged, labels = cached or (None, np.zeros(len(words), dtype=bool),
                                                    np.zeros(len(words), dtype=bool), None)
    missing = [ex for ex in sentences if not tagged[ex.file_offset:ex.file_offset + len(ex.words)].all()]
    about = {"teacher": f"{task}/{version}", "teacher_weights_sha256": manifest.weights_sha256,
             "teacher_backbone": manifest.backbone.name, "teacher_precision": precision,
             "train_file_sha256": file_sha, "words": int(wanted.sum()), "sentences": len(sentences),
             "sentences_tagged_now": len(missing), "cache_key": key}
    if missing:
        started = time.perf_counter()
        backbone = Backbone.load(backbone_spec, device=device)
        if precision != "fp32":
            backbone = backbone.use_backend("torch", precision)
        module = load_module(store, task, version, backbone, device=device, probe=probe_module)
        labels = list(module.head.labels)
        if logits is None:
            logits = np.zeros((len(words), len(labels)), dtype=np.float32)
        split = Split(LabelledData(data.task_type, missing, data.source), labels, backbone)
        tqdm.write(f"teacher {task}/{version} ({manifest.backbone.name}, {precision}): tagging "
                   f"{sum(len(ex.words) for ex in missing)} words of {len(missing)} training sentences once "
                   f"(of the file's {len(data.examples)}; kept for later runs)", file=sys.stderr)
        read = 0
        try:
            for batch_rows, batch_logits in served_logits(split, module, batch_size, progress):
                batch_logits = batch_logits.float().cpu().numpy()
                for i, r in enumerate(batch_rows):
                    values, has = word_values(split, r, batch_logits[i])
                    offset = missing[r].file_offset
                    logits[offset:offset + len(values)] = values
                    has_token[offset:offset + len(values)] = has
                    tagged[offset:offset + len(values)] = True
                read += len(batch_rows)
        finally:  # what was read is kept, Ctrl-C or not: a rerun reads only the rest
            if read:
                write_cache(path, logits, has_token, tagged, labels)
            if read < len(missing):
                tqdm.write(f"teacher: stopped after {read} of {len(missing)} sentences; those are kept in {path.parent} "
                           "and a rerun reads only the rest", file=sys.stderr)
        about.update(teacher_seconds=round(time.perf_counter() - started, 1), teacher_tokens=sum(split.lengths))
    about.update(from_cache=not missing,
                 teacher_train_word_accuracy=word_accuracy(logits, has_token & wanted, labels, gold))
    return TeacherWords(words, logits, has_token & wanted, labels, about)


def word_accuracy(logits: np.ndarray, has_token: np.ndarray, labels: list[str], gold: list[str]) -> float:
    """How often the teacher's most likely tag (no BIO rules) is the gold tag, over the words it
    tagged: on its own training data, so a check that the logits sit on the right words, not a score."""
    predicted = np.array(labels)[logits.argmax(axis=1)]
    return round(float((predicted == np.array(gold))[has_token].mean()), 4)


def read_cache(path: Path, words: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]] | None:
    """(logits, has_token, tagged: the words whose sentence the teacher read, labels), or None."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "np") as fh:
            labels = json.loads(fh.metadata()["labels"])
            logits, has_token = fh.get_tensor("logits"), fh.get_tensor("has_token").astype(bool)
            tagged = fh.get_tensor("tagged").astype(bool)
    except Exception as exc:  # a damaged file is recomputed, whatever the damage
        tqdm.write(f"ignoring the teacher cache {path}: {exc} (recomputing)", file=sys.stderr)
        return None
    return (logits, has_token, tagged, labels) if logits.shape[0] == words else None


def write_cache(path: Path, logits: np.ndarray, has_token: np.ndarray, tagged: np.ndarray, labels: list[str]) -> None:
    from safetensors.numpy import save_file

    tensors = {"logits": logits, "has_token": has_token.astype(np.uint8), "tagged": tagged.astype(np.uint8)}
    write_cache_file(path, lambda tmp: save_file(tensors, tmp, metadata={"labels": json.dumps(labels)}))


class DistillTargets:
    """The teacher's logits of a training split's rows, laid out on the student's tokens: each
    data word's logits at its first sub-token, a mask of where they are."""

    def __init__(self, split: Split, teacher: TeacherWords, temperature: float, weight: float):
        teacher = teacher.in_order(split.labels)
        self.teacher, self.temperature, self.weight = teacher, temperature, weight
        self.positions: list[np.ndarray] = []  # per row: student token of each tagged word
        self.words: list[np.ndarray] = []  # per row: that word's index in the file
        for r, example in enumerate(split.data.examples):
            offset = example.file_offset
            if offset is None or teacher.words[offset:offset + len(example.words)] != example.words:
                raise ValueError(f"training row {r} ({' '.join(example.words[:6])} ...) is not a run of the training "
                                 f"file's words at its file_offset {offset}: cannot find its teacher logits")
            first = np.array(word_first_tokens(split.encoded[r], split.spans[r]), dtype=np.int64)
            word = offset + np.arange(len(first))
            keep = (first >= 0) & teacher.has_token[word]
            self.positions.append(first[keep])
            self.words.append(word[keep])

    def batch(self, rows: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, width, labels) teacher logits and a (B, width) mask of the positions that hold one."""
        logits = torch.zeros(len(rows), width, self.teacher.logits.shape[1])
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, r in enumerate(rows):
            positions = torch.from_numpy(self.positions[r])
            logits[i, positions] = torch.from_numpy(self.teacher.logits[self.words[r]])
            mask[i, positions] = True
        return logits, mask

    def loss(self, gold_loss: torch.Tensor, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """(1 - w) * the gold tags' loss + w * T^2 * KL towards the teacher, over the rows' words."""
        teacher, mask = self.batch(rows, logits.shape[1])
        kl = distill_kl(logits, teacher.to(logits.device), mask.to(logits.device), self.temperature)
        return (1 - self.weight) * gold_loss + self.weight * kl
