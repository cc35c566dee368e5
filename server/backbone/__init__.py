"""The frozen backbone: `Backbone` (load, tokenize, stream per-layer states), its token batches, and
where a named backbone comes from (`sources`). The names below are imported on first use (PEP 562), so
that `server.backbone.sources`, which the start-up checks read (is --backbone a backbone?), comes
without the seconds torch and transformers take to import: a typo is said at once."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server.backbone.backbone import Backbone
    from server.backbone.sources import default_backbone_path
    from server.backbone.tokens import EncodedInput, InputTooLong, TokenBatch

__all__ = ["Backbone", "InputTooLong", "EncodedInput", "TokenBatch", "default_backbone_path"]
_MODULE_OF = {"Backbone": "backbone", "default_backbone_path": "sources", "EncodedInput": "tokens",
              "InputTooLong": "tokens", "TokenBatch": "tokens"}


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
