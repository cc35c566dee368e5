"""The contract every bridge kind follows.

A bridge lets modules trained on another backbone (the *target*) serve on this one (the
*source*). In the pass it behaves like a head: it declares the source states it reads and keeps a
running state while they stream past. At the end, instead of logits, it hands back the inputs
the foreign modules expect: a batch in the target's tokenization (or the source batch itself, for
a bridge that keeps tokens) and the target states those modules read. It runs once per batch for
every foreign module that shares it.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from modules_store import BridgeManifest
from server.backbone.tokens import TextEncoder, TokenBatch


class Bridge(nn.Module):
    kind: ClassVar[str]

    def __init__(self, config, target_text: TextEncoder | None = None):
        """`config` is the kind's pydantic config; `target_text` tokenizes for the target backbone
        (None for kinds that keep the source tokens)."""
        super().__init__()
        self.config = config
        self.target_text = target_text

    def layers_read(self) -> list[int]:
        """Source states (0 = embeddings) this bridge needs, ascending."""
        raise NotImplementedError

    def states_out(self) -> list[int]:
        """Target states this bridge produces, ascending."""
        raise NotImplementedError

    def start(self, batch: TokenBatch) -> Any:
        raise NotImplementedError

    def consume(self, state: Any, index: int, hidden: torch.Tensor) -> Any:
        """Fold source state `index` (B, T_s, H_s) into the running state and return it."""
        raise NotImplementedError

    def finish(self, state: Any, batch: TokenBatch) -> tuple[TokenBatch, dict[int, torch.Tensor]]:
        """(target batch, {target state index: (B, T_t, H_t)}) for the foreign heads."""
        raise NotImplementedError

    # ---- artifacts ---------------------------------------------------------------------------
    @classmethod
    def from_manifest(cls, manifest: BridgeManifest, target_text: TextEncoder | None = None) -> "Bridge":
        raise NotImplementedError

    def manifest_fields(self) -> dict[str, Any]:
        """kind, source_layers, target_layers, config: what a BridgeManifest needs from the bridge."""
        raise NotImplementedError

    def load_weights(self, weights: dict[str, torch.Tensor], where: str = "bridge") -> None:
        from server.heads.base import Head

        Head.load_weights(self, weights, where)  # the same strict, named-problem load as heads
