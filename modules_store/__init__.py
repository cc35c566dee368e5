"""The module artifact format: `<task>/<version>/manifest.json` + `weights.safetensors`.

This package knows nothing about heads or backbones beyond the fingerprint record; the runtime
(`server`) turns an artifact into a head. The task folders next to this file are the default
modules that ship with the server.
"""
from pathlib import Path

from modules_store.manifest import BackboneFingerprint, BridgeManifest, Manifest, TaskType
from modules_store.store import (
    ArtifactError,
    ModuleStore,
    StoredModule,
    sha256_file,
)

DEFAULT_STORE = Path(__file__).resolve().parent

__all__ = [
    "ArtifactError",
    "BackboneFingerprint",
    "BridgeManifest",
    "DEFAULT_STORE",
    "Manifest",
    "ModuleStore",
    "StoredModule",
    "TaskType",
    "sha256_file",
]
