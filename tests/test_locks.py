"""requirements/*.lock (made by scripts/lock): every package pinned with its hashes, every range of
pyproject.toml met, and the three sets at one version per package (torch and ONNX Runtime aside in
the GPU set). Whether a lock holds the whole dependency tree, pip itself checks when it installs it:
in hash-checking mode it refuses any package that is not in the file."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# one entry: `name==version \` (or `name[extra,...]==version \`) then `--hash=sha256:...` lines
ENTRY = re.compile(r"^([A-Za-z0-9._-]+)(?:\[[A-Za-z0-9._,-]+\])?==(\S+)((?:\s*\\\n\s+--hash=sha256:[0-9a-f]{64})*)",
                   re.M)


def lock(name: str) -> dict[str, tuple[str, int]]:
    """{package: (version, number of hashes)}"""
    text = (ROOT / "requirements" / f"{name}.lock").read_text()
    return {canonicalize_name(n): (v, hashes.count("--hash=")) for n, v, hashes in ENTRY.findall(text)}


def versions(name: str) -> dict[str, str]:
    return {n: v for n, (v, _) in lock(name).items()}


@pytest.mark.parametrize("name", ["serve", "test", "gpu"])
def test_every_locked_package_is_pinned_with_hashes(name):
    text = (ROOT / "requirements" / f"{name}.lock").read_text()
    requirement_lines = [line for line in text.splitlines() if line and not line.startswith((" ", "#"))]
    assert requirement_lines and all("==" in line for line in requirement_lines), requirement_lines
    entries = lock(name)
    assert len(entries) == len(requirement_lines)
    assert all(count >= 1 for _, count in entries.values())
    assert not re.search(r"^\s*(-e|--index-url|--extra-index-url|--find-links)\b", text, re.M)  # nothing machine-local


@pytest.mark.parametrize("name, extra", [("serve", None), ("test", "test"), ("gpu", "gpu")])
def test_the_lock_meets_every_range_in_pyproject(name, extra):
    locked = versions(name)
    requirements = [Requirement(r) for r in PYPROJECT["dependencies"] + PYPROJECT["optional-dependencies"].get(extra, [])]
    assert requirements
    for requirement in requirements:
        package = canonicalize_name(requirement.name)
        if requirement.marker and not requirement.marker.evaluate():
            continue
        if name == "gpu" and package == "onnxruntime":  # onnxruntime-gpu stands in for it
            assert package not in locked
            continue
        assert package in locked, f"{requirement} is not in {name}.lock"
        assert requirement.specifier.contains(locked[package], prereleases=True), (str(requirement), locked[package])


def test_the_locks_agree_on_every_version():
    test, serve, gpu = versions("test"), versions("serve"), versions("gpu")
    assert {n: test[n] for n in serve if n in test} == serve and set(serve) <= set(test)
    cpu_only = {"torch", "onnxruntime"}
    assert {n: v for n, v in gpu.items() if n in serve and n not in cpu_only} == \
           {n: v for n, v in serve.items() if n not in cpu_only}
    assert serve["torch"].endswith("+cpu") and serve["torch"].split("+")[0] == gpu["torch"]


def test_every_locked_package_runs_on_the_oldest_python_pyproject_admits():
    """pyproject said Python >= 3.10 while the locked numpy, scipy, transformers, FastAPI (and more) ask for
    3.11: on Python 3.10 (Ubuntu 22.04's) the README's install stopped in pip at the first of them. Each
    locked package installed here at its locked version says in its metadata which Pythons it runs on."""
    from importlib import metadata

    from packaging.specifiers import SpecifierSet

    floors = [spec.version for spec in SpecifierSet(PYPROJECT["requires-python"]) if spec.operator == ">="]
    assert len(floors) == 1, PYPROJECT["requires-python"]
    installed = {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions()}
    checked, refused = 0, {}
    for package, version in versions("test").items():
        dist = installed.get(package)
        if dist is None or dist.version != version:  # (a package of another platform, or installed otherwise)
            continue
        checked += 1
        needs = dist.metadata.get("Requires-Python")
        if needs and not SpecifierSet(needs).contains(floors[0]):
            refused[package] = needs
    assert checked > 50 and refused == {}, (PYPROJECT["requires-python"], refused)
