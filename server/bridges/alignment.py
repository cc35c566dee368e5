"""The alignment bridge: parameter-free transfer by matching hidden dimensions (Klimaszewski et al.).

Fitted by `training.bridges.align.align` on paired states: for every target state j it reads one source
state (SKIP) or the mean of a consecutive group of source states (AVG), and each target dimension
d takes the source dimension matched to it by a linear assignment on the Pearson correlations
between source and target dimensions:

    y_j[..., d] = x_j[..., index_j[d]] * scale_j[d] + shift_j[d]

    matched d, plain (the paper):  scale = 1,              shift = 0
    matched d, --standardize:      scale = sd_t / sd_s,    shift = mu_t - mu_s * scale
    unmatched d (H_t > H_s):       scale = 0,              shift = mean of target dim d on the pairs

Feeding a module y_j is the same as permuting (selecting) the columns of its input weights: a
layer-mix head computes W_j GELU(y_j), GELU acts per dimension, so W_j GELU(x_j[index_j]) equals
W'_j GELU(x_j) with W'_j the columns of W_j moved to the source dimensions they were matched with
(unmatched dimensions become a constant bias, W_j[:, d] GELU(fill_d)). The bridge does it on the
states instead, so one bridge serves every foreign module unchanged, whatever its kind.

The bridge keeps the source tokens: `target_text` is None and `finish` hands the source batch
itself to the foreign modules. It streams: each source state is folded in as it arrives (running
sums for AVG groups, dropped once their group's last state has been seen) and no state it does
not need is kept.
"""
from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from modules_store import BridgeManifest
from server.backbone.tokens import TextEncoder, TokenBatch
from server.bridges.base import Bridge
from server.bridges.registry import register_bridge


class AlignmentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mapping: Literal["skip", "avg"] = Field(description="deeper source: a group's last state, or the mean of the group")
    standardize: bool = Field(False, description="per-dimension affine match of mean and spread (off: plain permutation)")
    source_hidden_size: int = Field(ge=1)
    target_hidden_size: int = Field(ge=1)
    groups: dict[int, list[int]] = Field(description="target state -> the source states averaged into it")
    pool: Literal["token", "word"] = Field("token", description="how the paired rows were aligned when fitting")
    # added by save_bridge (the bridge keeps the source tokens and needs neither)
    target_max_tokens: int | None = None
    target_uses_token_types: bool | None = None

    @field_validator("groups")
    @classmethod
    def _check_groups(cls, groups: dict[int, list[int]]) -> dict[int, list[int]]:
        if not groups:
            raise ValueError("no target states")
        for j, sources in groups.items():
            if j < 0 or not sources or min(sources) < 0 or sorted(set(sources)) != sources:
                raise ValueError(f"target state {j}: source states {sources} must be ascending, unique and >= 0")
        return dict(sorted(groups.items()))

    @model_validator(mode="after")
    def _check(self) -> "AlignmentConfig":
        if self.mapping == "skip" and any(len(s) != 1 for s in self.groups.values()):
            raise ValueError("mapping 'skip' reads one source state per target state")
        return self


class AlignmentBridge(Bridge):
    def __init__(self, config: AlignmentConfig, target_text: TextEncoder | None = None):
        super().__init__(config, None)
        self.targets = list(config.groups)
        n, h_t = len(self.targets), config.target_hidden_size
        # per target state (row k = self.targets[k]): source dim read, and the affine on it
        self.register_buffer("index", torch.zeros(n, h_t, dtype=torch.long))
        self.register_buffer("scale", torch.ones(n, h_t))
        self.register_buffer("shift", torch.zeros(n, h_t))
        self._row = {j: k for k, j in enumerate(self.targets)}
        self._last = {j: max(s) for j, s in config.groups.items()}
        self._readers: dict[int, list[int]] = {}  # source state -> target states it feeds
        for j, sources in config.groups.items():
            for i in sources:
                self._readers.setdefault(i, []).append(j)

    def set_alignment(self, j: int, index: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> None:
        k = self._row[j]
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.config.source_hidden_size):
            raise ValueError(f"target state {j}: source dims outside 0..{self.config.source_hidden_size - 1}")
        with torch.no_grad():
            self.index[k].copy_(index)
            self.scale[k].copy_(scale)
            self.shift[k].copy_(shift)

    def matched(self, j: int) -> torch.Tensor:
        """(H_t,) bool: target dims of state j that read a source dim (the rest are constants)."""
        return self.scale[self._row[j]] != 0

    def layers_read(self) -> list[int]:
        return sorted(self._readers)

    def states_out(self) -> list[int]:
        return list(self.targets)

    # ---- streaming ---------------------------------------------------------------------------
    def start(self, batch: TokenBatch) -> dict[str, Any]:
        return {"sums": {}, "out": {}}

    def project(self, j: int, x: torch.Tensor) -> torch.Tensor:
        """Target state j from its (averaged) source state x (B, T, H_s)."""
        k = self._row[j]
        return x.index_select(-1, self.index[k]) * self.scale[k] + self.shift[k]

    def consume(self, state: dict[str, Any], index: int, hidden: torch.Tensor) -> dict[str, Any]:
        for j in self._readers.get(index, ()):
            group = self.config.groups[j]
            if len(group) == 1:
                state["out"][j] = self.project(j, hidden)
                continue
            running = state["sums"].get(j)
            running = hidden.float().clone() if running is None else running.add_(hidden)
            if index == self._last[j]:
                state["out"][j] = self.project(j, running / len(group))
                state["sums"].pop(j, None)
            else:
                state["sums"][j] = running
        return state

    def finish(self, state: dict[str, Any], batch: TokenBatch) -> tuple[TokenBatch, dict[int, torch.Tensor]]:
        missing = [j for j in self.targets if j not in state["out"]]
        if missing:
            raise RuntimeError(f"alignment bridge: target states {missing} not complete (source states streamed "
                               f"must include {self.layers_read()})")
        return batch, state["out"]

    def forward(self, states: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """All target states from a dict of source states (the streaming path, in one call)."""
        state = self.start(None)
        for i in self.layers_read():
            state = self.consume(state, i, states[i])
        return state["out"]

    # ---- artifacts ---------------------------------------------------------------------------
    @classmethod
    def from_manifest(cls, manifest: BridgeManifest, target_text: TextEncoder | None = None) -> "AlignmentBridge":
        config = AlignmentConfig(**manifest.config)
        if config.source_hidden_size != manifest.source.hidden_size:
            raise ValueError(f"config source_hidden_size {config.source_hidden_size} != source backbone "
                             f"{manifest.source.hidden_size}")
        if config.target_hidden_size != manifest.target.hidden_size:
            raise ValueError(f"config target_hidden_size {config.target_hidden_size} != target backbone "
                             f"{manifest.target.hidden_size}")
        bridge = cls(config)
        if bridge.layers_read() != list(manifest.source_layers) or bridge.states_out() != list(manifest.target_layers):
            raise ValueError(f"manifest layers (source {manifest.source_layers}, target {manifest.target_layers}) "
                             f"disagree with the config's groups {config.groups}")
        if max(bridge.layers_read()) > manifest.source.num_layers or max(bridge.targets) > manifest.target.num_layers:
            raise ValueError("groups name states beyond the backbones' layers")
        return bridge

    def manifest_fields(self) -> dict[str, Any]:
        return {"kind": self.kind, "source_layers": self.layers_read(), "target_layers": self.states_out(),
                "config": self.config.model_dump(mode="json")}

    def load_weights(self, weights: dict[str, torch.Tensor], where: str = "bridge") -> None:
        super().load_weights(weights, where)
        bad = (self.index < 0) | (self.index >= self.config.source_hidden_size)
        if bool(bad.any()):
            from modules_store import ArtifactError

            raise ArtifactError("bad_weights", f"{where}: index names source dims outside "
                                               f"0..{self.config.source_hidden_size - 1}")


register_bridge("alignment", AlignmentBridge)
