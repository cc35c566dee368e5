"""Knowledge distillation for token heads (`tmod-train ... --distill-from TASK/VERSION`).

A stored module, the teacher (e.g. the quality tier's `ner/mpnet-2`), tags every word of the
training file once; the student learns from a mix of the gold tags' cross-entropy and the KL
divergence towards the teacher's tag distribution of each word (Hinton et al., 2015):

    loss = (1 - w) * CE(gold) + w * T^2 * KL(softmax(teacher / T) || softmax(student / T))

the KL term averaged over the words the teacher tagged.

The two backbones tokenize differently, so the two are aligned by the data's WORDS: each head's
logits of a word are read at the word's first sub-token, as scoring and the server read a word
(`training.evaluate.word_values`). The teacher reads each training sentence once, through the
served path (`training.evaluate.served_logits`: Engine.logits on its own backbone at the precision
it was trained at); every training row, a sentence or a document window (training/data/conll.py), knows
where its words start among the file's words (`TokenExample.file_offset`) and looks their teacher
logits up there. The teacher's word logits are kept in $TMOD_CACHE_DIR/teacher/<key>.safetensors
(key: the teacher's weights and backbone, its precision, the training file), so a later run with
the same teacher and file does not run it again.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from modules_store import ModuleStore, TaskType
from server.backbone import Backbone
from server.backbone.sources import default_cache_dir, named_for
from server.modules import load_module
from server.probe import probe_module
from training.data.conll import read_conll
from training.data.files import UsageError
from training.data.word_tags import word_first_tokens
from training.evaluate import served_logits, word_values
from training.splits import module_folder
from training.runs import write_cache_file
from training.states import Split

TEACHER_FORMAT = 1
# the backbone a manifest names -> the name `Backbone.load` knows it by


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


def teacher_words(spec: str, train_file: str | Path, backbone_spec: str | None = None, device: str = "cpu",
                  batch_size: int = 128, progress: bool = True, cache_dir: Path | None = None) -> TeacherWords:
    """The teacher's word logits for every sentence of `train_file` (a CoNLL file), read from the
    cache or computed once through the served path and cached."""
    store, task, version = resolve_teacher(spec)
    manifest = store.read_manifest(task, version)
    if manifest.task_type != TaskType.token_classification:
        raise UsageError(f"--distill-from {spec}: a {manifest.task_type.value} module; the teacher must tag tokens")
    backbone_spec = backbone_spec or named_for(manifest.backbone.name)
    if backbone_spec is None:
        raise UsageError(f"--distill-from {spec}: its backbone {manifest.backbone.name!r} has no name here; "
                         f"give its folder with --distill-backbone")
    precision = (manifest.training or {}).get("settings", {}).get("precision", "fp32")
    data = read_conll(train_file)
    file_sha = hashlib.sha256(Path(train_file).read_bytes()).hexdigest()
    key = hashlib.sha256(json.dumps({
        "format": TEACHER_FORMAT, "weights": manifest.weights_sha256, "backbone": list(manifest.backbone.identity()),
        "precision": precision, "file": file_sha}, sort_keys=True).encode()).hexdigest()
    path = (cache_dir or default_cache_dir() / "teacher") / f"{key}.safetensors"
    words = [w for ex in data.examples for w in ex.words]
    about = {"teacher": f"{task}/{version}", "teacher_weights_sha256": manifest.weights_sha256,
             "teacher_backbone": manifest.backbone.name, "teacher_precision": precision,
             "train_file_sha256": file_sha, "words": len(words), "cache_key": key}
    gold = [t for ex in data.examples for t in ex.tags]
    cached = read_cache(path, len(words))
    if cached is not None:
        logits, has_token, labels = cached
        about.update(from_cache=True, teacher_train_word_accuracy=word_accuracy(logits, has_token, labels, gold))
        return TeacherWords(words, logits, has_token, labels, about)

    started = time.perf_counter()
    backbone = Backbone.load(backbone_spec, device=device)
    if precision != "fp32":  # the states it was trained (and is scored) on
        backbone = backbone.use_backend("torch", precision)
    module = load_module(store, task, version, backbone, device=device, probe=probe_module)
    labels = list(module.head.labels)
    split = Split(data, labels, backbone)
    logits = np.zeros((len(words), len(labels)), dtype=np.float32)
    has_token = np.zeros(len(words), dtype=bool)
    tqdm.write(f"teacher {task}/{version} ({manifest.backbone.name}, {precision}): tagging {len(words)} words of "
               f"{len(split)} training sentences once", file=sys.stderr)
    for rows, batch_logits in served_logits(split, module, batch_size, progress):
        batch_logits = batch_logits.float().cpu().numpy()
        for i, r in enumerate(rows):
            values, has = word_values(split, r, batch_logits[i])
            offset = data.examples[r].file_offset
            logits[offset:offset + len(values)] = values
            has_token[offset:offset + len(values)] = has
    seconds = time.perf_counter() - started
    write_cache(path, logits, has_token, labels)
    about.update(from_cache=False, teacher_seconds=round(seconds, 1), teacher_tokens=sum(split.lengths),
                 teacher_train_word_accuracy=word_accuracy(logits, has_token, labels, gold))
    return TeacherWords(words, logits, has_token, labels, about)


def word_accuracy(logits: np.ndarray, has_token: np.ndarray, labels: list[str], gold: list[str]) -> float:
    """How often the teacher's most likely tag (no BIO rules) is the gold tag, over the words it
    tagged: on its own training data, so a check that the logits sit on the right words, not a score."""
    predicted = np.array(labels)[logits.argmax(axis=1)]
    return round(float((predicted == np.array(gold))[has_token].mean()), 4)


def read_cache(path: Path, words: int) -> tuple[np.ndarray, np.ndarray, list[str]] | None:
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "np") as fh:
            labels = json.loads(fh.metadata()["labels"])
            logits, has_token = fh.get_tensor("logits"), fh.get_tensor("has_token").astype(bool)
    except Exception as exc:  # a damaged file is recomputed, whatever the damage
        tqdm.write(f"ignoring the teacher cache {path}: {exc} (recomputing)", file=sys.stderr)
        return None
    return (logits, has_token, labels) if logits.shape[0] == words else None


def write_cache(path: Path, logits: np.ndarray, has_token: np.ndarray, labels: list[str]) -> None:
    from safetensors.numpy import save_file

    write_cache_file(path, lambda tmp: save_file({"logits": logits, "has_token": has_token.astype(np.uint8)}, tmp,
                                                 metadata={"labels": json.dumps(labels)}))


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
