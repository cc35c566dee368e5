"""The shipped modules' manifest metrics are what `tmod-train eval` measures on their validation
data through the served path (real backbone: slow)."""
from __future__ import annotations

import json

import pytest

from modules_store import DEFAULT_STORE, ModuleStore
from training.cli import main
from training.data import PRESETS, default_data_dir


def shipped_trained_modules() -> list[tuple[str, str]]:
    """(task, dataset preset) for each shipped module that tmod-train trained on a preset."""
    store = ModuleStore(DEFAULT_STORE)
    found = []
    for task in store.tasks():
        dataset = store.read_manifest(task).training.get("settings", {}).get("dataset")
        if dataset in PRESETS:
            found.append((task, dataset))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("task, dataset", shipped_trained_modules() or [pytest.param(None, None, marks=pytest.mark.skip(
    reason="no shipped module trained by tmod-train yet"))])
def test_shipped_module_rescores_to_its_manifest_metrics(task, dataset, tmp_path):
    if not (default_data_dir() / PRESETS[dataset].validation).is_file():
        pytest.skip(f"shared data not found at {default_data_dir()}")
    out = tmp_path / "eval.json"
    assert main(["eval", "--task", task, "--dataset", dataset, "--output", str(out), "--no-progress"]) == 0
    result = json.loads(out.read_text())
    metric = result["manifest_metrics"]["metric"]
    assert result["metrics"]["examples" if "examples" in result["metrics"] else "sentences"] > 0
    assert result["metrics"][metric] == pytest.approx(result["manifest_metrics"][metric], abs=2e-3)
