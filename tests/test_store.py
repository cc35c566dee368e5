"""Module store: round trip, and every refusal with a message that names the problem."""
from __future__ import annotations

import json
import pickle

import pytest
import torch
from safetensors.torch import save_file

from modules_store import ArtifactError, ModuleStore, sha256_file
from server.backbone import Backbone
from server.engine import Engine
from server.modules import load_module, save_module
from tests.helpers import make_tiny_backbone_dir, random_head


@pytest.fixture()
def store(tmp_path, tiny_backbone):
    store = ModuleStore(tmp_path / "store")
    save_module(store, "sentiment", "1", random_head(tiny_backbone, "sequence_classification", ["neg", "pos"], 1),
                tiny_backbone, metrics={"accuracy": 0.5}, training={"command": "test"})
    return store


def rewrite_manifest(store, task, version, **changes):
    path = store.path(task, version) / "manifest.json"
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key].update(value)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


@pytest.mark.smoke
def test_round_trip_gives_same_outputs(store, tiny_backbone):
    original = random_head(tiny_backbone, "sequence_classification", ["neg", "pos"], 1)
    loaded = load_module(store, "sentiment", None, tiny_backbone)
    assert loaded.version == "1" and loaded.manifest.metrics == {"accuracy": 0.5}
    assert loaded.manifest.labels == ["neg", "pos"]
    batch = tiny_backbone.tokenize(["one text", "another, longer text here"])
    engine = Engine(tiny_backbone)
    from server.modules import LoadedModule
    expected = engine.logits(batch, {"s": LoadedModule("s", "1", None, original)})["s"]
    got = engine.logits(batch, {"s": loaded})["s"]
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_listing_and_latest_version(store, tiny_backbone):
    save_module(store, "sentiment", "2", random_head(tiny_backbone, "sequence_classification", ["neg", "pos"], 2),
                tiny_backbone)
    save_module(store, "sentiment", "10", random_head(tiny_backbone, "sequence_classification", ["neg", "pos"], 3),
                tiny_backbone)
    assert store.tasks() == ["sentiment"]
    assert store.versions("sentiment") == ["1", "2", "10"]
    assert load_module(store, "sentiment", None, tiny_backbone).version == "10"
    assert load_module(store, "sentiment", "2", tiny_backbone).version == "2"


def test_refuses_existing_version_without_overwrite(store, tiny_backbone):
    with pytest.raises(ArtifactError, match="already exists"):
        save_module(store, "sentiment", "1", random_head(tiny_backbone, "sequence_classification", ["a", "b"], 9),
                    tiny_backbone)


def test_a_version_another_writer_saves_meanwhile_is_kept_not_replaced(store, tiny_backbone, monkeypatch):
    """Two writers of one new version (two training runs of a sweep): the second removed the first's
    artifact and put its own in its place, both told they had saved it."""
    import safetensors.torch  # where the store takes save_file from when it writes
    first = random_head(tiny_backbone, "sequence_classification", ["neg", "pos"], 4)
    write = safetensors.torch.save_file

    def meanwhile(tensors, path):  # the other writer finishes while this one writes its weights
        monkeypatch.setattr(safetensors.torch, "save_file", write)
        save_module(store, "sentiment", "7", first, tiny_backbone)
        write(tensors, path)
    monkeypatch.setattr(safetensors.torch, "save_file", meanwhile)
    with pytest.raises(ArtifactError, match="sentiment/7 was written meanwhile in"):
        save_module(store, "sentiment", "7", random_head(tiny_backbone, "sequence_classification", ["neg", "pos"], 5),
                    tiny_backbone)
    kept = load_module(store, "sentiment", "7", tiny_backbone)
    assert all(torch.equal(kept.head.state_dict()[k], v) for k, v in first.state_dict().items())
    assert [p.name for p in (store.root / "sentiment").iterdir() if p.name.startswith(".")] == []  # no staging left


@pytest.mark.smoke
def test_refuses_checksum_mismatch(store, tiny_backbone):
    weights = store.path("sentiment", "1") / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # flip bits in the last tensor byte
    weights.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="checksum mismatch") as info:
        load_module(store, "sentiment", None, tiny_backbone)
    assert info.value.reason == "checksum_mismatch"


@pytest.mark.smoke
def test_refuses_other_backbone(store, tmp_path):
    other = Backbone.load(make_tiny_backbone_dir(tmp_path / "other", "bert", layers=3, seed=99))
    with pytest.raises(ArtifactError, match="fingerprint mismatch.*weights_hash") as info:
        load_module(store, "sentiment", "1", other)
    assert info.value.reason == "fingerprint_mismatch"
    assert "vocab_hash" not in info.value.message  # same tokenizer: only the weights differ
    with pytest.raises(ArtifactError, match=r"no version for backbone .*its versions are 1 \(") as info:
        load_module(store, "sentiment", None, other)  # no version asked: none of them is for this backbone
    assert info.value.reason == "other_backbone"
    # another model altogether (as a pinned ner/mpnet-2 on MiniLM): named, with what serves it, not its hashes
    renamed = Backbone.load(make_tiny_backbone_dir(tmp_path / "renamed", "bert", layers=3, seed=99), name="tiny-other")
    with pytest.raises(ArtifactError) as info:
        load_module(store, "sentiment", "1", renamed)
    mine = store.read_manifest("sentiment", "1").backbone.name
    assert info.value.reason == "fingerprint_mismatch" and info.value.message == (
        f"sentiment/1 was trained on {mine}, not on this server's tiny-other, and no loaded bridge leads there: "
        f"serve it with --backbone a folder of {mine}, or give --bridges a store with a bridge from tiny-other to "
        f"{mine}")


def test_without_a_version_each_backbone_gets_its_own_latest(store, tiny_backbone, tmp_path):
    """One store, two backbones: versions of one task trained on different backbones live side by
    side; each backbone loads the latest of its own, whatever the others' version names."""
    other = Backbone.load(make_tiny_backbone_dir(tmp_path / "other", "bert", layers=2, seed=7))
    for version in ("other-1", "other-2"):
        save_module(store, "sentiment", version, random_head(other, "sequence_classification", ["neg", "pos"], 2), other)
    save_module(store, "sentiment", "0", random_head(tiny_backbone, "sequence_classification", ["neg", "pos"], 3),
                tiny_backbone)
    assert store.latest("sentiment") == "other-2"  # the store's order knows nothing of backbones
    assert load_module(store, "sentiment", None, tiny_backbone).version == "1"
    assert load_module(store, "sentiment", None, other).version == "other-2"
    assert load_module(store, "sentiment", "0", tiny_backbone).version == "0"


def test_refuses_shapes_that_disagree_with_manifest(store, tiny_backbone):
    # a manifest claiming k=32 over weights trained with k=16: the checksum is fine, the shapes are not
    rewrite_manifest(store, "sentiment", "1", config={"project_dim": 32})
    with pytest.raises(ArtifactError, match=r"tensor 'projections' has shape \(4, 16, 32\).*\(4, 32, 32\)") as info:
        load_module(store, "sentiment", None, tiny_backbone)
    assert info.value.reason == "shape_mismatch"


def test_refuses_missing_tensor(store, tiny_backbone):
    path = store.path("sentiment", "1") / "weights.safetensors"
    from safetensors.torch import load_file
    tensors = load_file(str(path))
    del tensors["layer_logits"]
    save_file(tensors, str(path))
    rewrite_manifest(store, "sentiment", "1", weights_sha256=sha256_file(path))
    with pytest.raises(ArtifactError, match=r"missing tensors \['layer_logits'\]"):
        load_module(store, "sentiment", None, tiny_backbone)


def test_refuses_unknown_kind_and_bad_manifest(store, tiny_backbone):
    rewrite_manifest(store, "sentiment", "1", kind="telepathy")
    with pytest.raises(ArtifactError, match="unknown head kind 'telepathy'"):
        load_module(store, "sentiment", None, tiny_backbone)
    (store.path("sentiment", "1") / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="invalid manifest") as info:
        load_module(store, "sentiment", None, tiny_backbone)
    assert info.value.reason == "bad_manifest"


def test_a_manifest_of_a_newer_format_is_refused_as_that_and_a_bad_one_in_one_line(store, tiny_backbone):
    """A newer tmod's manifest (format 2, a new field) was refused as pydantic's several lines ending in
    a web address ('Extra inputs are not permitted'); one with no new field was served as if understood."""
    from modules_store.manifest import FORMAT_VERSION
    path = store.path("sentiment", "1") / "manifest.json"
    good = path.read_text()
    for changes in ({"format_version": FORMAT_VERSION + 1}, {"format_version": FORMAT_VERSION + 1, "calibration": 1.3}):
        rewrite_manifest(store, "sentiment", "1", **changes)
        with pytest.raises(ArtifactError) as info:
            load_module(store, "sentiment", None, tiny_backbone)
        assert info.value.reason == "newer_format"
        assert info.value.message == (f"manifest {path} is of format {FORMAT_VERSION + 1}, written by a newer tmod; "
                                      f"this one reads format {FORMAT_VERSION}: upgrade tmod to serve it")
        path.write_text(good)
    rewrite_manifest(store, "sentiment", "1", calibration=1.3, layers="all")
    with pytest.raises(ArtifactError) as info:
        load_module(store, "sentiment", None, tiny_backbone)
    assert info.value.reason == "bad_manifest" and "\n" not in info.value.message and "http" not in info.value.message
    assert info.value.message == (f"invalid manifest {path}: layers: Input should be a valid array; "
                                  "calibration: Extra inputs are not permitted")
    path.write_text(good)
    assert load_module(store, "sentiment", None, tiny_backbone).version == "1"


@pytest.mark.smoke
def test_never_unpickles(store, tiny_backbone, tmp_path):
    """A pickle in place of the safetensors file is refused as unreadable, never executed."""
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (marker.write_text, ("ran",))

    path = store.path("sentiment", "1") / "weights.safetensors"
    path.write_bytes(pickle.dumps(Exploit()))
    rewrite_manifest(store, "sentiment", "1", weights_sha256=sha256_file(path))
    with pytest.raises(ArtifactError, match="cannot read") as info:
        load_module(store, "sentiment", None, tiny_backbone)
    assert info.value.reason == "bad_weights"
    assert not marker.exists()


def test_refuses_missing_weights_and_unknown_task(store, tiny_backbone):
    with pytest.raises(ArtifactError, match="no module 'nope'"):
        load_module(store, "nope", None, tiny_backbone)
    (store.path("sentiment", "1") / "weights.safetensors").unlink()
    with pytest.raises(ArtifactError, match="no weights.safetensors"):
        load_module(store, "sentiment", None, tiny_backbone)


def test_a_store_folder_gone_under_a_running_server_is_said(store, tiny_backbone):
    """A store moved, deleted or unmounted while a server runs: an admin load or reload said only 'no module'
    or 'it has []', as if the task were misspelt."""
    assert "folder is not there" not in str(pytest.raises(ArtifactError, store.read_manifest, "nope").value)
    gone = ModuleStore(store.root.parent / "unmounted")
    with pytest.raises(ArtifactError, match=r"no module 'sentiment' in store .*unmounted \(that folder is not there: "
                                            r"moved, deleted or not mounted\)"):
        load_module(gone, "sentiment", None, tiny_backbone)
    with pytest.raises(ArtifactError, match=r"no version '1' of sentiment in the store .*unmounted; its versions: none "
                                            r"\(that folder is not there"):
        load_module(gone, "sentiment", "1", tiny_backbone)


def test_saved_artifacts_are_readable_by_other_users(store):
    folder = store.path("sentiment", "1")
    assert folder.stat().st_mode & 0o755 == 0o755
    for name in ("manifest.json", "weights.safetensors"):
        assert (folder / name).stat().st_mode & 0o644 == 0o644


def test_unreadable_artifact_is_refused_not_crashed(store, tiny_backbone, monkeypatch):
    from pathlib import Path

    read_bytes = Path.read_bytes

    def denied(path):  # the tests run as root, for whom chmod 000 denies nothing
        if path.name == "weights.safetensors":
            raise PermissionError(13, "Permission denied", str(path))
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(ArtifactError, match="cannot read") as info:
        load_module(store, "sentiment", None, tiny_backbone)
    assert info.value.reason == "unreadable"


def test_servable_tasks_lists_the_tasks_a_backbone_has_a_version_of(store, tiny_backbone, tmp_path):
    from server.modules import servable_tasks

    other = Backbone.load(make_tiny_backbone_dir(tmp_path / "other", "bert", layers=2, seed=7))
    save_module(store, "topic", "other-1", random_head(other, "sequence_classification", ["a", "b"], 4), other)
    assert servable_tasks(store, tiny_backbone) == ["sentiment"]
    assert servable_tasks(store, other) == ["topic"]
