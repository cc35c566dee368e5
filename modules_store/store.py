"""Save, list and load module artifacts. Only safetensors is ever read: nothing is unpickled.

An artifact is read once into memory and everything is done with the bytes read: the sha256 is taken
of them and the tensors are parsed from them. Nothing is memory-mapped and no file is opened twice,
so a file rewritten in place while it is read (a truncation under a memory map ends the process
with SIGBUS) or replaced between the check and the load (other bytes served under the checked
sha256) can only be refused, never served or crash the server."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError
from safetensors import SafetensorError

from modules_store.manifest import (FORMAT_VERSION, NAME_PATTERN, ArtifactError, BackboneFingerprint, Manifest, check_name,
                                    sha256_file)

if TYPE_CHECKING:  # torch is imported where tensors are read or written: listing a store, and the start-up
    import torch  # checks that do (tmod-serve --tasks, tmod-train eval --task), stay free of its seconds of import

MANIFEST_FILE = "manifest.json"
WEIGHTS_FILE = "weights.safetensors"


@dataclass
class StoredModule:
    manifest: Manifest
    weights: dict[str, torch.Tensor]
    path: Path


def _version_key(version: str):
    # numeric versions sort numerically, others after them alphabetically
    return (0, int(version), "") if version.isdigit() else (1, 0, version)


def written_by_newer(path: Path, text: bytes) -> None:
    """A manifest of a format newer than this tmod reads is refused as that, whatever else it holds:
    read as this format, its new fields were 'Extra inputs are not permitted', or, with none, it was
    served as if this tmod understood it."""
    try:
        written = json.loads(text).get("format_version", FORMAT_VERSION)
    except (ValueError, AttributeError):
        return  # not a JSON object: the schema's check says what is wrong
    if isinstance(written, int) and written > FORMAT_VERSION:
        raise ArtifactError("newer_format", f"manifest {path} is of format {written}, written by a newer tmod; this "
                            f"one reads format {FORMAT_VERSION}: upgrade tmod to serve it")


def validation_text(exc: ValidationError) -> str:
    """A manifest's schema errors on one line: `field: what is wrong` for each (pydantic's own text
    spans lines and ends with a web address)."""
    return "; ".join(f"{'.'.join(str(part) for part in error['loc']) or 'the file'}: {error['msg']}"
                     for error in exc.errors())

class ModuleStore:
    """A directory of `<task>/<version>/{manifest.json,weights.safetensors}`.

    The same layout holds bridges (`BridgeManifest`, named instead of tasked): pass
    `manifest_cls`; a manifest's `task` names its folder and its `backbone` is the fingerprint the
    artifact must be served on.
    """

    def __init__(self, root: str | os.PathLike, manifest_cls: type = Manifest):
        self.root = Path(root)
        self.manifest_cls = manifest_cls

    # ---- listing -------------------------------------------------------------------------
    def tasks(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(
            p.name for p in self.root.iterdir()
            if p.is_dir() and NAME_PATTERN.match(p.name) and self.versions(p.name)
        )

    def misnamed(self) -> list[str]:
        """Folders holding module versions under a name that is no task's (capitals, spaces: 'Sentiment',
        'my task'), so never served: a copy under such a name was left out without a word. Hidden and
        '_' folders (`.incoming/`, `_bridges/`) are the operator's and the bridges'."""
        def holds_modules(folder: Path) -> bool:
            try:
                return any((v / MANIFEST_FILE).is_file() for v in folder.iterdir() if v.is_dir())
            except OSError:  # unreadable: not the store's to judge, and no reason to stop a start
                return False

        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir()
                      if p.is_dir() and not p.name.startswith((".", "_")) and not NAME_PATTERN.match(p.name)
                      and holds_modules(p))

    def versions(self, task: str) -> list[str]:
        check_name(task)
        task_dir = self.root / task
        if not task_dir.is_dir():
            return []
        found = [p.name for p in task_dir.iterdir() if (p / MANIFEST_FILE).is_file()]
        return sorted(found, key=_version_key)

    def latest(self, task: str) -> str:
        versions = self.versions(task)
        if not versions:
            raise ArtifactError("not_found", f"no module '{task}' in store {self.root}{self.gone_note()}")
        return versions[-1]

    def next_version(self, task: str) -> str:
        """One more than the highest whole-number version of `task` ("1" for a new task)."""
        return str(1 + max((int(v) for v in self.versions(task) if v.isdigit()), default=0))

    def path(self, task: str, version: str) -> Path:
        for name in (task, version):
            check_name(name)
        return self.root / task / version

    def gone_note(self) -> str:
        """' (that folder is not there ...)' where the store itself is missing (a volume unmounted, the
        folder moved while a server runs), else ''."""
        return "" if self.root.is_dir() else " (that folder is not there: moved, deleted or not mounted)"

    # ---- reading ---------------------------------------------------------------------------
    def read_manifest(self, task: str, version: str | None = None) -> Manifest:
        version = version or self.latest(task)
        path = self.path(task, version) / MANIFEST_FILE
        if not path.is_file():
            if not path.parent.is_dir():  # a version that was never written: which ones were
                there = ", ".join(self.versions(task)) or "none"
                raise ArtifactError("not_found", f"no version {version!r} of {task} in the store {self.root}; its "
                                                 f"versions: {there}{self.gone_note()}")
            raise ArtifactError("not_found", f"no manifest at {path}")
        try:
            text = path.read_bytes()
        except OSError as exc:
            raise ArtifactError("unreadable", f"cannot read manifest {path}: {exc}") from exc
        written_by_newer(path, text)
        try:
            manifest = self.manifest_cls.model_validate_json(text)
        except ValidationError as exc:
            raise ArtifactError("bad_manifest", f"invalid manifest {path}: {validation_text(exc)}") from exc
        if (manifest.task, manifest.version) != (task, version):
            raise ArtifactError(
                "bad_manifest",
                f"manifest {path} says task={manifest.task!r} version={manifest.version!r}, "
                f"but it is stored as {task}/{version}",
            )
        return manifest

    def load(
        self,
        task: str,
        version: str | None = None,
        expected_backbone: BackboneFingerprint | None = None,
        manifest: Manifest | None = None,
    ) -> StoredModule:
        """Read and verify an artifact: manifest schema, sha256 of the weights, backbone. The weights
        file is read once: its sha256 is checked and its tensors parsed from the same bytes.
        `manifest`: the one the caller already read and acted on (read once, not read again)."""
        version = version or self.latest(task)
        manifest = manifest or self.read_manifest(task, version)
        folder = self.path(task, version)
        weights_path = folder / WEIGHTS_FILE
        if not weights_path.is_file():
            raise ArtifactError("missing_weights", f"{task}/{version}: no {WEIGHTS_FILE} in {folder}")
        try:
            data = weights_path.read_bytes()
        except OSError as exc:
            raise ArtifactError("unreadable", f"{task}/{version}: cannot read {weights_path}: {exc}") from exc
        actual = hashlib.sha256(data).hexdigest()
        if actual != manifest.weights_sha256:
            raise ArtifactError(
                "checksum_mismatch",
                f"{task}/{version}: checksum mismatch for {weights_path}: manifest says "
                f"{manifest.weights_sha256}, file has {actual}",
            )
        if expected_backbone is not None:
            diffs = manifest.backbone.differences(expected_backbone)
            if diffs:
                raise ArtifactError(
                    "fingerprint_mismatch",
                    f"{task}/{version}: backbone fingerprint mismatch ({'; '.join(diffs)})",
                )
        import torch
        from safetensors.torch import load as load_tensors

        try:
            weights = load_tensors(data)  # the checked bytes, parsed in memory (no mmap, no second open)
        except (SafetensorError, ValueError) as exc:
            raise ArtifactError("bad_weights", f"{task}/{version}: cannot read {weights_path}: {exc}") from exc
        del data
        for name, tensor in weights.items():  # a NaN or inf weight answers nonsense, or poisons its batch
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                bad = int((~torch.isfinite(tensor)).sum())
                raise ArtifactError("non_finite", f"{task}/{version}: tensor {name!r} has {bad} non-finite "
                                    f"value(s) (NaN or inf) of {tensor.numel()}")
        return StoredModule(manifest=manifest, weights=weights, path=folder)

    # ---- writing ---------------------------------------------------------------------------
    def save(self, manifest: Manifest, weights: dict[str, torch.Tensor], overwrite: bool = False,
             extra_files: dict[str, bytes] | None = None) -> Path:
        """Write weights then manifest (with the weights' sha256) atomically into the store.
        `extra_files` (name -> bytes, e.g. a bridge's target tokenizer) are written beside them; a
        manifest that must vouch for them records their sha256 itself."""
        from safetensors.torch import save_file

        folder = self.path(manifest.task, manifest.version)
        if folder.exists() and not overwrite:
            raise ArtifactError("exists", f"{manifest.task}/{manifest.version} already exists in {self.root}")
        new_task = not folder.parent.exists()  # made here, and removed again if nothing lands in it
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{manifest.version}-", dir=folder.parent))
        staging.chmod(0o755)  # mkdtemp makes 0700: a server running as another user must read it
        try:
            tensors = {name: t.detach().to("cpu").contiguous() for name, t in weights.items()}
            save_file(tensors, str(staging / WEIGHTS_FILE))
            for name, data in (extra_files or {}).items():
                (staging / name).parent.mkdir(mode=0o755, parents=True, exist_ok=True)
                (staging / name).write_bytes(data)
                (staging / name).chmod(0o644)
            manifest = manifest.model_copy(update={"weights_sha256": sha256_file(staging / WEIGHTS_FILE)})
            (staging / MANIFEST_FILE).write_text(json.dumps(manifest.model_dump(mode="json"), indent=2) + "\n")
            for written in (staging / WEIGHTS_FILE, staging / MANIFEST_FILE):
                written.chmod(0o644)
            if overwrite and folder.exists():
                shutil.rmtree(folder)
            try:
                staging.rename(folder)  # fails onto a folder another writer filled meanwhile: never removed
            except OSError:
                if not folder.exists():
                    raise
                raise ArtifactError("exists", f"{manifest.task}/{manifest.version} was written meanwhile in "
                                    f"{self.root}") from None
        finally:
            if staging.exists():
                shutil.rmtree(staging)
            if new_task and not folder.exists():  # a failed write leaves no empty task folder (a task with no version)
                with contextlib.suppress(OSError):
                    folder.parent.rmdir()
        return folder
