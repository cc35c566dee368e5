"""LoRA-MTB heads: an artifact stores only low-rank factors and the head's own layers (task layer, casing
embedding); at load the factors are merged into copies of the backbone blocks its manifest names
(`build_head(manifest, weights, backbone)`), so it serves at exactly an MTB's cost.
"""
from server.heads.lora_mtb.config import DEFAULT_TARGETS, LoraMTBConfig
from server.heads.lora_mtb.model import LoraMTBHead
from server.heads.registry import register_head

register_head("lora-mtb", LoraMTBHead)

__all__ = ["DEFAULT_TARGETS", "LoraMTBConfig", "LoraMTBHead"]
