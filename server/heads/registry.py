"""Head kinds by name, so a manifest's `kind` picks the class that serves it. Bridge kinds
(server/bridges/registry.py) use the same two functions, `register_kind` and `build_kind`."""
from __future__ import annotations

from typing import Callable

from modules_store import ArtifactError, Manifest
from server.heads.base import Head

HEAD_KINDS: dict[str, type[Head]] = {}


def register_kind(kinds: dict[str, type], kind: str, cls: type, what: str) -> None:
    """File `cls` under `kind` in a registry of `what`s (head, bridge); a name taken by another class is refused."""
    if kind in kinds and kinds[kind] is not cls:
        raise ValueError(f"{what} kind {kind!r} registered twice")
    cls.kind = kind
    kinds[kind] = cls


def build_kind(kinds: dict[str, type], kind: str, what: str, where: str, make: Callable, weights=None):
    """`make(cls)` for the class filed under `kind`, its weights loaded (and checked) when given, in eval
    mode. An unknown kind or a config the class refuses is an ArtifactError that says `where`."""
    cls = kinds.get(kind)
    if cls is None:
        raise ArtifactError("unknown_kind", f"{where}: unknown {what} kind {kind!r}; this server knows {sorted(kinds)}")
    try:
        built = make(cls)
    except (ValueError, TypeError) as exc:
        raise ArtifactError("bad_manifest", f"{where}: bad {what} config: {exc}") from exc
    if weights is not None:
        built.load_weights(weights, where=where)
    return built.eval()


def register_head(kind: str, cls: type[Head]) -> None:
    register_kind(HEAD_KINDS, kind, cls, "head")


def build_head(manifest: Manifest, weights=None, backbone=None) -> Head:
    """A head for this manifest, with weights loaded (and checked) when given. Kinds that start
    from backbone weights (MTB, LoRA-MTB) read them from `backbone`."""
    return build_kind(HEAD_KINDS, manifest.kind, "head", f"{manifest.task}/{manifest.version}",
                      lambda cls: cls.from_manifest(manifest, backbone), weights)
