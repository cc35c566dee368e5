"""Loaded modules: a verified artifact turned into a head on this backbone.

This is the only bridge between an artifact (modules_store/) and a head (`load_module`,
`save_module`). One store holds the modules of several backbones side by side, as versions of one
task (`sentiment/1` on MiniLM, `sentiment/mpnet-1` on MPNet); without a version asked for,
`servable_version` picks the latest trained on the server's backbone (else the latest a loaded
bridge leads to). The probe pass (server/probe.py) runs the engine, a layer above this one: the
loader that has an engine at hand hands it in (`load_module(..., probe=probe_module)`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from modules_store import ArtifactError, Manifest, ModuleStore, TaskType
from modules_store.store import _version_key
from server.backbone.sources import named_for
from server.errors import NO_VERSION_HERE
from server.heads import Head, build_head


@dataclass(frozen=True)
class LoadedModule:
    task: str
    version: str
    manifest: Manifest
    head: Head
    bridge: str | None = None  # name of the loaded bridge it is served through (a foreign module)
    # its bridge reads the text again with the other backbone's tokenizer: its logits lie on those tokens
    # (a transformer bridge), not on this backbone's (an alignment bridge keeps them)
    retokenized: bool = False


def load_module(store: ModuleStore, task: str, version: str | None, backbone, device="cpu",
                bridges: dict | None = None, probe: Callable | None = None) -> LoadedModule:
    """Checksum, backbone fingerprint, head config and tensor shapes are all checked here;
    any failure raises ArtifactError and nothing is returned. `probe(module, backbone, bridges)`, when
    given, must pass too: the probe pass (server/probe.py) runs the engine, which lies above this
    layer, so whoever loads with an engine at hand (the runtime, training) hands it in.

    A module trained on another backbone (a foreign module) is served through one of `bridges`
    (name -> LoadedBridge, all running on `backbone`): `find_bridge` says which. Without `version`,
    the version this backbone serves (`servable_version`)."""
    version = version or servable_version(store, task, backbone, bridges)
    manifest = store.read_manifest(task, version)
    bridge = None
    if manifest.backbone.identity() != backbone.fingerprint.identity():
        bridge = find_bridge(manifest, bridges or {}, backbone)
    expected = bridge.manifest.target if bridge else backbone.fingerprint
    stored = store.load(task, version, expected_backbone=expected, manifest=manifest)
    if bridge is not None and manifest.kind == "lora-mtb":
        raise ArtifactError("fingerprint_mismatch", f"{task}/{version}: a LoRA-MTB module is rebuilt from its own "
                            "backbone's blocks, which a bridge does not provide")
    head = build_head(stored.manifest, stored.weights, backbone if bridge is None else None)
    if bridge is not None:
        missing = sorted(set(head.layers_read()) - set(bridge.bridge.states_out()))
        if missing:
            raise ArtifactError("fingerprint_mismatch", f"{task}/{version}: reads states {missing} of "
                                f"{manifest.backbone.name or 'its backbone'}, which bridge {bridge.name} does not produce "
                                f"(it produces {bridge.bridge.states_out()})")
    head.to(device)
    for param in head.parameters():
        param.requires_grad_(False)
    module = LoadedModule(task=task, version=stored.manifest.version, manifest=stored.manifest, head=head,
                          bridge=bridge.name if bridge else None,
                          retokenized=bridge is not None and bridge.bridge.target_text is not None)
    if probe is not None:
        probe(module, backbone, bridges)
    return module


def load_servable(store: ModuleStore, task: str, backbone, device="cpu", bridges: dict | None = None,
                  probe: Callable | None = None) -> tuple[LoadedModule, list[ArtifactError]]:
    """The newest version of `task` this backbone serves that passes every check, and the refusals
    of the newer ones (a store serves the best artifact it has and says what it refused). Raises
    the newest version's error when none loads."""
    refused = []
    for version in servable_versions(store, task, backbone, bridges):
        try:
            return load_module(store, task, version, backbone, device, bridges, probe), refused
        except ArtifactError as exc:
            refused.append(exc)
    raise refused[0]


def servable_version(store: ModuleStore, task: str, backbone, bridges: dict | None = None) -> str:
    """The version of `task` a server on `backbone` serves, so one store can hold modules of several
    backbones (`sentiment/1` on MiniLM beside `sentiment/mpnet-1` on MPNet): the latest version
    trained on this backbone; else the latest one a loaded bridge leads to (a foreign module). Raises
    ArtifactError "other_backbone" when every version belongs to a backbone it cannot serve (a
    start-up over the whole store skips such a task quietly), or the store's own error (a broken
    manifest, no version) as before."""
    return servable_versions(store, task, backbone, bridges)[0]


def servable_versions(store: ModuleStore, task: str, backbone, bridges: dict | None = None) -> list[str]:
    """Every version `servable_version` could pick, best first: this backbone's, newest first, then
    those a loaded bridge leads to. A version whose manifest cannot be read is listed where its
    folder sorts (loading it reports why); errors as `servable_version`'s when none is servable."""
    versions = store.versions(task) or [store.latest(task)]  # latest() raises "no module" when there is none
    manifests, unreadable = [], []
    for version in reversed(versions):  # newest first
        try:
            manifests.append(store.read_manifest(task, version))
        except ArtifactError as exc:
            unreadable.append((version, exc))
    mine = backbone.fingerprint.identity()
    targets = {bridge.manifest.target.identity() for bridge in (bridges or {}).values()}
    native = [m.version for m in manifests if m.backbone.identity() == mine]
    foreign = [m.version for m in manifests if m.backbone.identity() in targets]
    if unreadable and (not manifests or _newer(unreadable[0][0], (native or foreign or [None])[0])):
        if not (native or foreign):
            raise unreadable[0][1]  # nothing else to serve: the broken manifest is the answer
        return [unreadable[0][0], *native, *foreign]  # the newest is broken: tried (and refused) first
    if native or foreign:
        return native + foreign
    owners = ", ".join(f"{m.version} ({m.backbone.name or m.backbone.short})" for m in manifests)
    raise ArtifactError("other_backbone", f"{task}: {NO_VERSION_HERE} {backbone.name} and no loaded bridge "
                        f"to the backbone of one; its versions are {owners}")


def _newer(version: str, than: str | None) -> bool:
    return than is None or _version_key(version) > _version_key(than)


def compares_pairs(manifest: Manifest | None) -> bool:
    """Whether a module classifies a text together with a text pair (a layer-mix head with pair
    pooling): single texts mean nothing to it."""
    return manifest is not None and (manifest.config or {}).get("pooling") == "pair"


def reads_single_texts(manifest: Manifest | None) -> bool:
    """Whether a module reads single texts only (an embedding: a sentence vector of one text)."""
    return manifest is not None and manifest.task_type == TaskType.embedding


def token_limit(modules: dict, limit: int | None) -> int | None:
    """The token limit of a request for `modules` (LoadedModule or a worker's view of one): the
    server's `limit`, lowered to the trained length an embedding module records (its vectors equal
    the reference only within it; past it the request is refused, or cut with truncation)."""
    for module in modules.values():
        trained = (module.manifest.config or {}).get("max_tokens") if reads_single_texts(module.manifest) else None
        if trained:
            limit = min(limit, trained) if limit else trained
    return limit


def token_classes_read(modules: dict[str, LoadedModule]) -> set[str]:
    """The per-token classes the native heads of these modules read (casing, segment): made at
    collate time, and static inputs of a captured pass."""
    return {name for m in modules.values() if m.bridge is None for name in m.head.token_classes_read()}


def native_part(modules: dict[str, LoadedModule]) -> dict[str, LoadedModule]:
    """The modules that read this backbone's states themselves (not through a bridge)."""
    return {task: m for task, m in modules.items() if m.bridge is None}


def served_task_sets(modules: dict[str, LoadedModule]) -> list[dict[str, LoadedModule]]:
    """The task sets requests that name no tasks run (server/api/serving.py, `fit_to_inputs`): single texts
    get every task but the pair tasks, text pairs every task. Distinct and non-empty, pairs first."""
    single = {task: m for task, m in modules.items() if not compares_pairs(m.manifest)}
    return [s for s in ([modules, single] if len(single) < len(modules) else [modules]) if s]


def servable_tasks(store: ModuleStore, backbone, bridges: dict | None = None) -> list[str]:
    """The store's tasks that have a version `backbone` serves (see `servable_version`)."""
    out = []
    for task in store.tasks():
        try:
            servable_version(store, task, backbone, bridges)
        except ArtifactError as exc:
            if exc.reason != "other_backbone":
                raise
            continue
        out.append(task)
    return out


def find_bridge(manifest: Manifest, bridges: dict, backbone):
    """The loaded bridge that serves a module of another backbone, or ArtifactError saying why none
    fits. Among the bridges to its backbone that produce every state it reads: one distilled through
    this very module first (trained for it), then one made for no module in particular (MSE,
    alignment), then any other; by name within each."""
    wanted = manifest.backbone.identity()
    leading = [bridges[name] for name in sorted(bridges) if bridges[name].manifest.target.identity() == wanted]
    if not leading:
        theirs = manifest.backbone.name
        if theirs and theirs != backbone.name:  # another model: its hashes say nothing more
            named = named_for(theirs)
            raise ArtifactError(
                "fingerprint_mismatch",
                f"{manifest.task}/{manifest.version} was trained on {theirs}, not on this server's {backbone.name}, "
                f"and no loaded bridge leads there: serve it with --backbone {named or 'a folder of ' + theirs}, or "
                f"give --bridges a store with a bridge from {backbone.name} to {theirs}")
        diffs = "; ".join(manifest.backbone.differences(backbone.fingerprint))
        raise ArtifactError(
            "fingerprint_mismatch",
            f"{manifest.task}/{manifest.version}: backbone fingerprint mismatch ({diffs}), and no loaded bridge "
            f"leads from {backbone.name} to {theirs or manifest.backbone.short}",
        )
    serving = [b for b in leading if set(manifest.layers) <= set(b.bridge.states_out())]
    if not serving:
        made = "; ".join(f"{b.name} produces {b.bridge.states_out()}" for b in leading)
        raise ArtifactError("fingerprint_mismatch", f"{manifest.task}/{manifest.version}: reads states "
                            f"{manifest.layers} of {manifest.backbone.name or 'its backbone'}, which no loaded bridge "
                            f"produces ({made})")

    def rank(bridge) -> int:
        if (bridge.manifest.training or {}).get("objective") != "distill":
            return 1
        return 0 if distilled_through(bridge.manifest, manifest) else 2

    return min(serving, key=rank)  # the first by name among the best


def distilled_through(bridge_manifest, manifest: Manifest) -> bool:
    """Whether a bridge was distilled through this very module (its weights): the bridge's validation
    figures are then this module's, served through it."""
    training = bridge_manifest.training or {}
    return (training.get("objective") == "distill"
            and (training.get("module") or {}).get("weights_sha256") == manifest.weights_sha256)


def measured_through(bridge_manifest, manifest: Manifest) -> tuple[str, bool]:
    """(what the bridge's training measured of this module served through it, whether that is no better
    than the majority answer): said where the module is loaded, so a bridged answer's cost is known."""
    m = bridge_manifest.metrics or {}
    if not distilled_through(bridge_manifest, manifest) or "accuracy" not in m:
        return "its accuracy through the bridge is unmeasured: tmod-train eval --bridges measures it", False
    texts = (bridge_manifest.training.get("data") or {}).get("validation_texts", "?")
    said = (f"on the bridge's {texts} validation texts: accuracy {m['accuracy']:.3f} through it, "
            f"{m['teacher_accuracy']:.3f} on its own backbone")
    poor = "majority_accuracy" in m and m["accuracy"] <= m["majority_accuracy"]
    if "majority_accuracy" in m:
        said += f", {m['majority_accuracy']:.3f} for the majority answer" + (": no better than it" if poor else "")
    return said, poor


def no_better_than_majority(manifest: Manifest) -> str | None:
    """What its training run measured where a module answers no better than the majority answer, or
    better by a margin within the noise of the rows scored (its paired bootstrap interval holds 0), as
    the manifest's `metrics.baselines` records them, said where it is loaded; None where it does
    better or is unmeasured."""
    b = (manifest.metrics or {}).get("baselines") or {}
    majority = (b.get("majority") or {}).get(b.get("metric"))
    if majority is None or b.get("head") is None:
        return None
    scores = f"({b['metric']} {b['head']:.4f} against {majority:.4f}"
    if b["head"] <= majority:
        return f"its training scored it no better than the majority answer on the {b['split']} split {scores})"
    interval = b.get("margin_over_majority_interval")
    if interval and interval[0] <= 0:
        return (f"its training could not tell it from the majority answer on the {b['split']} split {scores}; the "
                f"margin's 95% paired bootstrap interval {interval[0]:+.4f} to {interval[1]:+.4f} holds 0)")
    return None


def count_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def save_module(store: ModuleStore, task: str, version: str, head: Head, backbone, *,
                training: dict | None = None, metrics: dict | None = None, description: str = "",
                overwrite: bool = False, decoding: dict | None = None):
    """Write a head as an artifact for `backbone` (the inverse of load_module)."""
    manifest = Manifest(
        task=task, version=version, backbone=backbone.fingerprint,
        training=training or {}, metrics=metrics or {}, description=description, decoding=decoding or {},
        weights_sha256="", **head.manifest_fields(),
    )
    return store.save(manifest, head.artifact_weights(), overwrite=overwrite)
