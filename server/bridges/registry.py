"""Bridge kinds by name, so a bridge manifest's `kind` picks the class that serves it."""
from __future__ import annotations

from modules_store import ArtifactError, BridgeManifest
from server.backbone.tokens import TextEncoder
from server.bridges.base import Bridge

BRIDGE_KINDS: dict[str, type[Bridge]] = {}


def register_bridge(kind: str, cls: type[Bridge]) -> None:
    if kind in BRIDGE_KINDS and BRIDGE_KINDS[kind] is not cls:
        raise ValueError(f"bridge kind {kind!r} registered twice")
    cls.kind = kind
    BRIDGE_KINDS[kind] = cls


def build_bridge(manifest: BridgeManifest, weights=None, target_text: TextEncoder | None = None) -> Bridge:
    cls = BRIDGE_KINDS.get(manifest.kind)
    where = f"bridge {manifest.name}/{manifest.version}"
    if cls is None:
        raise ArtifactError("unknown_kind", f"{where}: unknown bridge kind {manifest.kind!r}; "
                                            f"this server knows {sorted(BRIDGE_KINDS)}")
    try:
        bridge = cls.from_manifest(manifest, target_text)
    except (ValueError, TypeError) as exc:
        raise ArtifactError("bad_manifest", f"{where}: bad bridge config: {exc}") from exc
    if weights is not None:
        bridge.load_weights(weights, where=where)
    return bridge.eval()
