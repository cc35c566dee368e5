"""Bridge artifacts: save a bridge with its target tokenizer, load and verify one for a backbone."""
from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

from modules_store import ArtifactError, BridgeManifest, ModuleStore
from server.backbone.tokens import TextEncoder
from server.bridges.base import Bridge
from server.bridges.registry import build_bridge

TOKENIZER_DIR = "target_tokenizer"


def bridge_store(root: str | Path) -> ModuleStore:
    """`<root>/<name>/<version>/{manifest.json, weights.safetensors, target_tokenizer/}`."""
    return ModuleStore(root, manifest_cls=BridgeManifest)


@dataclass(frozen=True)
class LoadedBridge:
    name: str
    version: str
    manifest: BridgeManifest
    bridge: Bridge


def tokenizer_files(backbone) -> dict[str, bytes]:
    """The target backbone's tokenizer as files (name -> bytes) under TOKENIZER_DIR."""
    with tempfile.TemporaryDirectory() as tmp:
        backbone.tokenizer.save_pretrained(tmp)
        return {f"{TOKENIZER_DIR}/{p.name}": p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}


def files_sha256(files: dict[str, bytes]) -> str:
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return digest.hexdigest()


def save_bridge(store: ModuleStore, name: str, version: str, bridge: Bridge, source, target, *,
                training: dict | None = None, metrics: dict | None = None, description: str = "",
                overwrite: bool = False) -> Path:
    """Write a bridge from backbone `source` to backbone `target` (with the target tokenizer when
    the bridge re-tokenizes, i.e. has a `target_text`)."""
    files = tokenizer_files(target) if bridge.target_text is not None else {}
    fields = bridge.manifest_fields()
    fields["config"] = {**fields["config"], "target_max_tokens": target.max_tokens,
                        "target_uses_token_types": target.adapter.uses_token_types}
    manifest = BridgeManifest(
        name=name, version=version, source=source.fingerprint, target=target.fingerprint,
        training=training or {}, metrics=metrics or {}, description=description, weights_sha256="",
        tokenizer_sha256=files_sha256(files) if files else None, **fields,
    )
    return store.save(manifest, bridge.state_dict(), overwrite=overwrite, extra_files=files)


def load_target_text(manifest: BridgeManifest, folder: Path, device) -> TextEncoder | None:
    """The bridge's target tokenizer, built from the bytes whose sha256 was checked: they are read
    once and written to a private folder the tokenizer loads from, never read again from the store
    (a file replaced meanwhile cannot slip in)."""
    if manifest.tokenizer_sha256 is None:
        return None
    where = f"bridge {manifest.name}/{manifest.version}"
    tok_dir = folder / TOKENIZER_DIR
    try:
        files = {f"{TOKENIZER_DIR}/{p.name}": p.read_bytes() for p in sorted(tok_dir.iterdir()) if p.is_file()}
    except OSError as exc:
        raise ArtifactError("unreadable", f"{where}: cannot read its target tokenizer in {tok_dir}: {exc}") from exc
    if files_sha256(files) != manifest.tokenizer_sha256:
        raise ArtifactError("checksum_mismatch", f"{where}: the target tokenizer files in {tok_dir} do not match "
                                                 "the manifest's tokenizer_sha256")
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as private:
        for name, data in files.items():
            (Path(private) / Path(name).name).write_bytes(data)
        try:
            tokenizer = AutoTokenizer.from_pretrained(private, local_files_only=True, use_fast=True)
        except Exception as exc:  # a tokenizer that does not load is a broken artifact, whatever the cause
            raise ArtifactError("bad_tokenizer", f"{where}: cannot load its target tokenizer: {exc}") from exc
    config = manifest.config
    return TextEncoder(tokenizer, int(config["target_max_tokens"]), bool(config["target_uses_token_types"]), device)


def load_bridge(store: ModuleStore, name: str, version: str | None, backbone, device="cpu",
                manifest: BridgeManifest | None = None) -> LoadedBridge:
    """Checksums, the source fingerprint (must be `backbone`), config and tensor shapes are all
    checked; any failure raises ArtifactError. `manifest`: the one the caller already read."""
    stored = store.load(name, version or (manifest.version if manifest else None),
                        expected_backbone=backbone.fingerprint, manifest=manifest)
    target_text = load_target_text(stored.manifest, stored.path, device)
    bridge = build_bridge(stored.manifest, stored.weights, target_text).to(device)
    for param in bridge.parameters():
        param.requires_grad_(False)
    return LoadedBridge(name=name, version=stored.manifest.version, manifest=stored.manifest, bridge=bridge)


def bridge_version_on(store: ModuleStore, name: str, source) -> BridgeManifest:
    """The manifest of `name`'s newest version from backbone `source` (a fingerprint): a bridge name may
    hold versions of several sources, as a task holds modules of several backbones; where none is from
    `source`, the newest version's (its source says why the bridge is skipped). Raises the store's error
    where the newest cannot be read."""
    newest = store.read_manifest(name)
    if newest.source.identity() == source.identity():
        return newest
    for version in reversed(store.versions(name)[:-1]):  # the older ones, newest first (the newest is read above)
        try:
            manifest = store.read_manifest(name, version)
        except ArtifactError:
            continue
        if manifest.source.identity() == source.identity():
            return manifest
    return newest


def load_bridges_on(store: ModuleStore, backbone, device="cpu", known=()) -> tuple[dict, dict, dict]:
    """(loaded: name -> LoadedBridge, skipped: name -> the backbone it runs on, refused: name ->
    ArtifactError) of every bridge in `store` but those named in `known`, the newest version of each from
    `backbone` (`bridge_version_on`), as the server and `tmod-train eval --bridges` both take them."""
    loaded, skipped, refused = {}, {}, {}
    for name in store.tasks():
        if name in known:
            continue
        try:
            manifest = bridge_version_on(store, name, backbone.fingerprint)
            if manifest.source.identity() != backbone.fingerprint.identity():
                skipped[name] = manifest.source.name or manifest.source.short
                continue
            loaded[name] = load_bridge(store, name, None, backbone, device, manifest)
        except ArtifactError as exc:
            refused[name] = exc
    return loaded, skipped, refused
