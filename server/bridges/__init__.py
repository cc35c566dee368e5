"""Bridges: serve modules trained on another backbone. One file per kind, registered by name.

Importing this package registers every kind, so `build_bridge(manifest)` can find it.

Kinds: `transformer` (an encoder over a learned mix of the source's states and a non-autoregressive
decoder whose queries are the target's positions and tokens, linear outputs per target state;
trained by `tmod-train bridge` with log(1+MSE) or by distillation through the frozen foreign
module) and `alignment` (a per-state permutation from Pearson correlations, SKIP / AVG layer
groups; `tmod-train align`). `load_module` serves a module whose fingerprint is not the backbone's
through a loaded bridge whose target it is; the plan lets each bridge read the pass once for all
its modules. Bridge artifacts live in their own store (`--bridges`, default `<store>/_bridges`),
each with a `BridgeManifest` naming source and target fingerprints and the target tokenizer.
"""
from server.bridges.base import Bridge
from server.bridges.loading import (LoadedBridge, bridge_store, bridge_version_on, load_bridge, load_bridges_on,
                                    save_bridge)
from server.bridges.registry import BRIDGE_KINDS, build_bridge, register_bridge
from server.bridges import transformer  # noqa: F401  (registers kind "transformer")
from server.bridges import alignment  # noqa: F401  (registers kind "alignment")

__all__ = ["BRIDGE_KINDS", "Bridge", "LoadedBridge", "bridge_store", "bridge_version_on", "build_bridge",
           "load_bridge", "load_bridges_on", "register_bridge", "save_bridge"]
