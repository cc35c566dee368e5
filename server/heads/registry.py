"""Head kinds by name, so a manifest's `kind` picks the class that serves it."""
from __future__ import annotations

from modules_store import ArtifactError, Manifest
from server.heads.base import Head

HEAD_KINDS: dict[str, type[Head]] = {}


def register_head(kind: str, cls: type[Head]) -> None:
    if kind in HEAD_KINDS and HEAD_KINDS[kind] is not cls:
        raise ValueError(f"head kind {kind!r} registered twice")
    cls.kind = kind
    HEAD_KINDS[kind] = cls


def build_head(manifest: Manifest, weights=None, backbone=None) -> Head:
    """A head for this manifest, with weights loaded (and checked) when given. Kinds that start
    from backbone weights (MTB, LoRA-MTB) read them from `backbone`."""
    cls = HEAD_KINDS.get(manifest.kind)
    if cls is None:
        raise ArtifactError(
            "unknown_kind", f"{manifest.task}/{manifest.version}: unknown head kind {manifest.kind!r}; "
            f"this server knows {sorted(HEAD_KINDS)}",
        )
    try:
        head = cls.from_manifest(manifest, backbone)
    except (ValueError, TypeError) as exc:
        raise ArtifactError("bad_manifest", f"{manifest.task}/{manifest.version}: bad head config: {exc}") from exc
    if weights is not None:
        head.load_weights(weights, where=f"{manifest.task}/{manifest.version}")
    return head.eval()
