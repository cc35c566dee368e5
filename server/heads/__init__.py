"""Head kinds, one folder each (config / layer / model), registered by name.

Importing this package registers every kind, so `build_head(manifest)` can find it.
"""
from server.heads import embedding, layermix, lora_mtb, mtb  # noqa: F401  (each registers its kind)
from server.heads.base import Head
from server.heads.registry import HEAD_KINDS, build_head, register_head

__all__ = ["HEAD_KINDS", "Head", "build_head", "register_head"]
