"""The manifest: everything needed to decide whether an artifact may be served, and how."""
from __future__ import annotations

import hashlib
import re
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_\-]{0,63}$")
FORMAT_VERSION = 1  # of the manifests this tmod writes and reads; a newer one is refused, named as such


def sha256_file(path: Path) -> str:
    """A file's sha256, read in 1 MiB chunks (weights, and the data files a training run records)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class ArtifactError(Exception):
    """An artifact that must not be served. `reason` is a short machine-readable cause. (Here, not in
    the store, which imports torch: a command can catch it before loading anything.)"""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


def check_name(name: str) -> None:
    """Task and version names become folder names: nothing but a plain name (no '..', no '/') may."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:80] + "..."
        raise ArtifactError("invalid_name", f"{shown} is not a valid task or version name: use 1-64 of a-z, 0-9, "
                            "'_' and '-', starting with a letter or digit")


class TaskType(str, Enum):
    sequence_classification = "sequence_classification"
    multi_label_classification = "multi_label_classification"  # independent labels: one sigmoid each
    token_classification = "token_classification"
    regression = "regression"
    embedding = "embedding"  # a sentence vector (server/heads/embedding/): no labels, nothing trained


class BackboneFingerprint(BaseModel):
    """Identifies a backbone exactly: a head only makes sense on the states it was trained on."""

    model_config = ConfigDict(frozen=True)

    architecture: str
    num_layers: int
    hidden_size: int
    vocab_hash: str
    weights_hash: str
    name: str = ""  # informational only; not part of the identity

    def identity(self) -> tuple:
        return (self.architecture, self.num_layers, self.hidden_size, self.vocab_hash, self.weights_hash)

    def differences(self, other: "BackboneFingerprint") -> list[str]:
        """Names of the identity fields that differ, with both values (for error messages)."""
        out = []
        for field in ("architecture", "num_layers", "hidden_size", "vocab_hash", "weights_hash"):
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                out.append(f"{field}: module has {mine!r}, backbone has {theirs!r}")
        return out

    @property
    def short(self) -> str:
        return self.weights_hash[:12]


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    format_version: int = FORMAT_VERSION
    task: str
    version: str
    kind: str = Field(description="head kind, e.g. 'layermix'; the runtime's registry maps it to a class")
    task_type: TaskType
    labels: list[str] = Field(default_factory=list)
    backbone: BackboneFingerprint
    layers: list[int] = Field(description="backbone layers the head reads (0 = embeddings)")
    config: dict[str, Any] = Field(default_factory=dict, description="head hyper-parameters")
    training: dict[str, Any] = Field(default_factory=dict, description="data, command, settings")
    metrics: dict[str, Any] = Field(default_factory=dict, description="validation metrics")
    decoding: dict[str, Any] = Field(
        default_factory=dict, description="answer defaults: multi-label 'thresholds' (label -> probability) and "
        "the 'threshold_rule' that chose them; token tasks' 'aggregation' (first, average, max, none)")
    weights_sha256: str
    description: str = ""
    opt_in: str | None = Field(
        None, description="why this module is served only when named (--tasks, the admin load route): a module that "
        "does not clearly beat a simple baseline on its task (docs/quality.md); None: served on a start-up over the "
        "whole store")

    @field_validator("task", "version")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        if not NAME_PATTERN.match(value):
            raise ValueError(
                f"{value!r} is not a valid name: use 1-64 of a-z, 0-9, '_' and '-', starting with a letter or digit"
            )
        return value

    @field_validator("labels")
    @classmethod
    def _unique_labels(cls, labels: list[str]) -> list[str]:
        if len(set(labels)) != len(labels):
            raise ValueError(f"labels must be unique, got {labels}")
        return labels


class BridgeManifest(BaseModel):
    """A bridge: it reads states of `source` (the backbone it is served on) and produces states of
    `target` (the backbone foreign modules were trained on), so those modules serve on `source`.
    Stored like a module, as `<bridges>/<name>/<version>/`, with the target tokenizer beside it
    (`tokenizer.json`, checked against `tokenizer_sha256`) when the bridge re-tokenizes."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    format_version: int = FORMAT_VERSION
    name: str
    version: str
    kind: str = Field(description="bridge kind, e.g. 'transformer' or 'alignment'; the registry maps it to a class")
    source: BackboneFingerprint
    target: BackboneFingerprint
    source_layers: list[int] = Field(description="source states the bridge reads (0 = embeddings)")
    target_layers: list[int] = Field(description="target states it produces")
    config: dict[str, Any] = Field(default_factory=dict)
    training: dict[str, Any] = Field(default_factory=dict, description="data, objective, command, settings")
    metrics: dict[str, Any] = Field(default_factory=dict)
    weights_sha256: str
    tokenizer_sha256: str | None = None
    description: str = ""

    _safe_name = field_validator("name", "version")(Manifest._safe_name.__func__)

    @property
    def task(self) -> str:  # the store's folder name
        return self.name

    @property
    def backbone(self) -> BackboneFingerprint:  # what the store checks against the running backbone
        return self.source
