"""Bridge kinds by name, so a bridge manifest's `kind` picks the class that serves it."""
from __future__ import annotations

from modules_store import BridgeManifest
from server.backbone.tokens import TextEncoder
from server.bridges.base import Bridge
from server.heads.registry import build_kind, register_kind

BRIDGE_KINDS: dict[str, type[Bridge]] = {}


def register_bridge(kind: str, cls: type[Bridge]) -> None:
    register_kind(BRIDGE_KINDS, kind, cls, "bridge")


def build_bridge(manifest: BridgeManifest, weights=None, target_text: TextEncoder | None = None) -> Bridge:
    return build_kind(BRIDGE_KINDS, manifest.kind, "bridge", f"bridge {manifest.name}/{manifest.version}",
                      lambda cls: cls.from_manifest(manifest, target_text), weights)
