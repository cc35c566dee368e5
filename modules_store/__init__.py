"""The module artifact format: `<task>/<version>/manifest.json` + `weights.safetensors`.

This package knows nothing about heads or backbones beyond the fingerprint record; the runtime
(`server`) turns an artifact into a head. The task folders next to this file are the default
modules that ship with the server.
"""
from pathlib import Path

from modules_store.manifest import ArtifactError, BackboneFingerprint, BridgeManifest, Manifest, TaskType, sha256_file

DEFAULT_STORE = Path(__file__).resolve().parent
STORE_NAMES = {"ModuleStore", "StoredModule"}


def misplaced_store(root: Path) -> str | None:
    """Where `root`, given as a store, is one task's or one module's folder (the store is above it):
    served, it would serve nothing; trained into, the module would land where no store finds it."""
    if (root / "manifest.json").is_file():
        return (f"{root} is one module's folder (it holds manifest.json), not a store of tasks; give the store "
                f"two folders up: {root.parent.parent}")
    if root.is_dir() and (versions := sorted(child.name for child in root.iterdir()
                                             if (child / "manifest.json").is_file())):
        return (f"{root} is one task's folder (versions {', '.join(versions)}), not a store of tasks; give the "
                f"store it is in: {root.parent}")
    return None


def __getattr__(name: str):
    """The store's names, imported when first asked for: the store reads tensors and imports torch,
    which the settings (`DEFAULT_STORE`) and `tmod-serve --help` do not need."""
    if name in STORE_NAMES:
        from modules_store import store

        return getattr(store, name)
    raise AttributeError(f"module 'modules_store' has no attribute {name!r}")

__all__ = [
    "ArtifactError",
    "BackboneFingerprint",
    "BridgeManifest",
    "DEFAULT_STORE",
    "Manifest",
    "ModuleStore",
    "StoredModule",
    "TaskType",
    "misplaced_store",
    "sha256_file",
]
