"""The shipped modules' manifest metrics are what `tmod-train eval` measures on their validation
data through the served path (real backbone: slow)."""
from __future__ import annotations

import json

import pytest

from modules_store import DEFAULT_STORE, ModuleStore
from server.backbone.sources import resolve_backbone
from training.cli import main
from training.data.files import default_data_dir
from training.data.presets import PRESETS


def shipped_trained_modules() -> list[tuple[str, str, str, str, str]]:
    """(task, version, dataset preset, backbone, precision) for each shipped module version that
    tmod-train trained on a preset (both backbone tiers: one store holds them)."""
    store = ModuleStore(DEFAULT_STORE)
    found = []
    for task in store.tasks():
        for version in store.versions(task):
            settings = store.read_manifest(task, version).training.get("settings", {})
            if settings.get("dataset") in PRESETS:
                found.append((task, version, settings["dataset"], settings.get("backbone") or "minilm",
                              settings.get("precision") or "fp32"))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("task, version, dataset, backbone, precision", shipped_trained_modules() or [pytest.param(
    None, None, None, None, None, marks=pytest.mark.skip(reason="no shipped module trained by tmod-train yet"))])
def test_shipped_module_rescores_to_its_manifest_metrics(task, version, dataset, backbone, precision, tmp_path):
    if not (default_data_dir() / PRESETS[dataset].validation).is_file():
        pytest.skip(f"shared data not found at {default_data_dir()}")
    if backbone == "mpnet":
        try:
            resolve_backbone("mpnet")
        except FileNotFoundError as exc:
            pytest.skip(str(exc))
    out = tmp_path / "eval.json"
    argv = ["eval", "--task", task, "--version", version, "--dataset", dataset, "--backbone", backbone,
            "--precision", precision, "--output", str(out), "--no-progress"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    metric = result["manifest_metrics"]["metric"]
    assert result["metrics"]["examples" if "examples" in result["metrics"] else "sentences"] > 0
    assert result["metrics"][metric] == pytest.approx(result["manifest_metrics"][metric], abs=2e-3)


@pytest.mark.slow
def test_eval_predictions_of_a_token_task_are_each_sentences_words_and_tags(tmp_path, capsys):
    """--predictions of the shipped ner on the first sentences of CoNLL-2003 validation (the real
    backbone): each sentence's words and gold tags as the file has them, one predicted tag a word, and
    the entity F1 the metrics give is the one these lines give."""
    from training.metrics import entity_scores

    source = default_data_dir() / PRESETS["conll2003"].validation
    if not source.is_file():
        pytest.skip(f"shared data not found at {default_data_dir()}")
    sentences = source.read_text(encoding="utf-8").split("\n\n")[:40]
    small = tmp_path / "few.conll"
    small.write_text("\n\n".join(sentences) + "\n", encoding="utf-8")
    out = tmp_path / "rows.jsonl"
    assert main(["eval", "--task", "ner/3", "--file", str(small), "--format", "conll", "--no-progress",
                 "--predictions", str(out)]) == 0
    metrics = json.loads(capsys.readouterr().out)["metrics"]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    written = [[line.split() for line in s.splitlines() if line.strip() and not line.startswith("-DOCSTART-")]
               for s in sentences]
    written = [s for s in written if s]
    assert [r["words"] for r in rows] == [[w[0] for w in s] for s in written]
    assert [r["gold"] for r in rows] == [[w[-1] for w in s] for s in written]
    assert all(len(r["predicted"]) == len(r["words"]) for r in rows)
    assert entity_scores([r["gold"] for r in rows], [r["predicted"] for r in rows])["f1"] == pytest.approx(metrics["f1"])
