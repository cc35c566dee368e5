"""Loaded modules: a verified artifact turned into a head on this backbone."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from modules_store import Manifest, ModuleStore
from server.heads import Head, build_head


@dataclass(frozen=True)
class LoadedModule:
    task: str
    version: str
    manifest: Manifest
    head: Head


def load_module(store: ModuleStore, task: str, version: str | None, backbone, device="cpu") -> LoadedModule:
    """Checksum, backbone fingerprint, head config and tensor shapes are all checked here;
    any failure raises ArtifactError and nothing is returned."""
    stored = store.load(task, version, expected_backbone=backbone.fingerprint)
    head = build_head(stored.manifest, stored.weights, backbone)
    head.to(device)
    for param in head.parameters():
        param.requires_grad_(False)
    return LoadedModule(task=task, version=stored.manifest.version, manifest=stored.manifest, head=head)


def count_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def save_module(store: ModuleStore, task: str, version: str, head: Head, backbone, *,
                training: dict | None = None, metrics: dict | None = None, description: str = "",
                overwrite: bool = False):
    """Write a head as an artifact for `backbone` (the inverse of load_module)."""
    manifest = Manifest(
        task=task, version=version, backbone=backbone.fingerprint,
        training=training or {}, metrics=metrics or {}, description=description,
        weights_sha256="", **head.manifest_fields(),
    )
    return store.save(manifest, head.artifact_weights(), overwrite=overwrite)
