"""Bridges: serve modules trained on another backbone. One file per kind, registered by name.

Importing this package registers every kind, so `build_bridge(manifest)` can find it.
"""
from server.bridges.base import Bridge
from server.bridges.loading import LoadedBridge, bridge_store, load_bridge, save_bridge
from server.bridges.registry import BRIDGE_KINDS, build_bridge, register_bridge
from server.bridges import transformer  # noqa: F401  (registers kind "transformer")
from server.bridges import alignment  # noqa: F401  (registers kind "alignment")

__all__ = ["BRIDGE_KINDS", "Bridge", "LoadedBridge", "bridge_store", "build_bridge", "load_bridge",
           "register_bridge", "save_bridge"]
