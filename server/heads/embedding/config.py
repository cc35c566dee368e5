"""Settings of an embedding head: how a backbone's sentence vector is made, as its
sentence-transformers configuration says (`modules.json`, `1_Pooling/config.json`, a `Normalize`
module, `sentence_bert_config.json`), or a stated default for a folder without one."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from modules_store import TaskType
from server.heads.pooling import POOLING_MODES

# what a backbone folder without a sentence-transformers configuration gets (recorded in the manifest)
DEFAULT_POOLING, DEFAULT_NORMALIZE = ("mean",), True
ST_TRANSFORMER, ST_POOLING, ST_NORMALIZE = (f"sentence_transformers.models.{name}"
                                            for name in ("Transformer", "Pooling", "Normalize"))
ST_POOLING_KEYS = {"cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens",
                   "mean": "pooling_mode_mean_tokens"}
ST_UNSUPPORTED_KEYS = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens",
                       "pooling_mode_lasttoken")


class EmbeddingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_type: Literal[TaskType.embedding] = TaskType.embedding
    hidden_size: int = Field(ge=1, description="backbone width H")
    source_layer: int = Field(ge=0, description="backbone state pooled (the last one for a sentence-transformers model)")
    pooling: list[Literal["cls", "max", "mean"]] = Field(
        min_length=1, description="pooling modes over the real tokens, concatenated in this order (the "
        "configuration's: its list, or for the older flags cls, max, mean)")
    normalize: bool = Field(description="vectors scaled to unit L2 norm")
    max_tokens: int | None = Field(None, ge=1, description="the model's trained length in tokens (the limit of "
                                                          "a request that asks for this task); None: the backbone's")
    shortened: list[int] = Field(default_factory=list, description="shorter sizes the vector may be cut to "
                                 "(a model trained for them, Matryoshka style); empty: none")
    settings_from: str = Field(description="where these settings come from")

    @property
    def num_labels(self) -> int:
        return 0

    @property
    def dimensions(self) -> int:
        return self.hidden_size * len(self.pooling)

    @model_validator(mode="after")
    def _check(self) -> "EmbeddingConfig":
        if len(set(self.pooling)) != len(self.pooling):
            raise ValueError(f"pooling modes must be unique, got {self.pooling}")
        if any(not 0 < n < self.dimensions for n in self.shortened):
            raise ValueError(f"shortened sizes must lie in 1..{self.dimensions - 1}, got {self.shortened}")
        return self


def vector_size(config: dict) -> int:
    """The size of the vectors a manifest's embedding config makes."""
    return EmbeddingConfig(**config).dimensions


def sentence_transformers_settings(folder: str | Path, name: str | None = None) -> dict:
    """The pooling, normalisation and length of the sentence-transformers model in `folder`, as
    EmbeddingConfig fields. A folder without `modules.json` gets the stated default (mean over real
    tokens, normalised). A pipeline this head cannot reproduce (a Dense layer, other pooling modes)
    raises ValueError naming what it found."""
    folder = Path(folder)
    name = name or folder.name
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return {"pooling": list(DEFAULT_POOLING), "normalize": DEFAULT_NORMALIZE, "max_tokens": None,
                "settings_from": f"default (no sentence-transformers configuration in {name}): "
                                 "mean over real tokens, normalised"}
    modules = json.loads(modules_file.read_text())
    types = [m.get("type") for m in modules]
    unknown = [t for t in types if t not in (ST_TRANSFORMER, ST_POOLING, ST_NORMALIZE)]
    if unknown or types[:1] != [ST_TRANSFORMER] or types.count(ST_POOLING) != 1:
        raise ValueError(f"{modules_file}: modules {types}; an embedding head reproduces Transformer, Pooling "
                         "and an optional Normalize only")
    pooling_path = folder / next(m for m in modules if m["type"] == ST_POOLING).get("path", "")
    pooling = json.loads((pooling_path / "config.json").read_text())
    odd = [key for key in ST_UNSUPPORTED_KEYS if pooling.get(key)]
    if odd:
        raise ValueError(f"{pooling_path}/config.json asks for {odd}; supported: {sorted(ST_POOLING_KEYS)}")
    named = pooling.get("pooling_mode")  # newer sentence-transformers write the modes by name
    named = [named] if isinstance(named, str) else list(named or [])
    modes = named or [mode for mode in POOLING_MODES if pooling.get(ST_POOLING_KEYS[mode])]
    if set(named) - set(POOLING_MODES):
        raise ValueError(f"{pooling_path}/config.json asks for {named}; supported: {list(POOLING_MODES)}")
    if not modes:
        raise ValueError(f"{pooling_path}/config.json names no pooling mode")
    bert_config = folder / "sentence_bert_config.json"
    max_tokens = json.loads(bert_config.read_text()).get("max_seq_length") if bert_config.is_file() else None
    normalize = ST_NORMALIZE in types
    return {"pooling": modes, "normalize": normalize, "max_tokens": max_tokens,
            "settings_from": f"sentence-transformers configuration of {name}: modules.json "
                             f"({', '.join(t.rsplit('.', 1)[-1] for t in types)}), "
                             f"{pooling_path.name}/config.json ({'+'.join(modes)})"
                             + (", sentence_bert_config.json" if bert_config.is_file() else "")}
