"""LoRA-MTB head: the artifact stores only low-rank factors and the head's own layers (task layer, casing
embedding); at load the factors are merged into copies of the backbone blocks named in the manifest, so
serving costs exactly what an MTB costs."""
from __future__ import annotations

import copy

import torch

from modules_store import ArtifactError, Manifest
from server.backbone.architectures import copy_positions
from server.heads.lora_mtb.config import LoraMTBConfig
from server.heads.lora_mtb.layer import merge_factors
from server.heads.mtb.model import MTBHead


# what a LoRA-MTB artifact stores beside its factors: the head's own layers (the blocks come from the backbone)
OWN_LAYERS = ("task_layer.", "casing.")


class LoraMTBHead(MTBHead):
    config_class = LoraMTBConfig

    @classmethod
    def from_manifest(cls, manifest: Manifest, backbone=None) -> "LoraMTBHead":
        config = cls.config_class(**manifest.config)
        cls._check_manifest(config, manifest)
        if backbone is None:
            raise ValueError("a LoRA-MTB module is rebuilt from its backbone's blocks: load it with the backbone")
        blocks = [copy.deepcopy(backbone.adapter.layers[i]) for i in config.copied_from]
        head = cls(config, manifest.labels or None, blocks)
        head.hf_config._attn_implementation = backbone.config._attn_implementation
        copy_positions(head.positions, backbone.adapter)
        return head

    def load_weights(self, weights: dict[str, torch.Tensor], where: str = "module") -> None:
        factors = {k: v for k, v in weights.items() if k.startswith("lora.")}
        rest = {k: v for k, v in weights.items() if not k.startswith("lora.")}
        expected = {f"lora.{b}.{t}.{ab}" for b in range(self.config.num_blocks) for t in self.config.targets
                    for ab in "AB"}
        unexpected = sorted(set(factors) - expected)
        if unexpected:
            raise ArtifactError("shape_mismatch", f"{where}: unexpected tensors {unexpected}")
        try:
            for index, block in enumerate(self.blocks):
                merge_factors(block, index, self.config.targets, factors, self.config.rank, self.config.scale, where)
        except ValueError as exc:
            raise ArtifactError("shape_mismatch", str(exc)) from exc
        own = {k for k in self.state_dict() if k.startswith(OWN_LAYERS)}
        stray = sorted(set(rest) - own)
        if stray:
            raise ArtifactError("shape_mismatch", f"{where}: unexpected tensors {stray}")
        missing = sorted(own - set(rest))
        if missing:
            raise ArtifactError("shape_mismatch", f"{where}: missing tensors {missing}")
        try:
            self.load_state_dict(rest, strict=False)  # the blocks were rebuilt and merged above
        except RuntimeError as exc:
            raise ArtifactError("shape_mismatch", f"{where}: weights disagree: {exc}") from exc
