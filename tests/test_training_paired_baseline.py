"""The linear baseline row by row (training/baselines.py `tfidf_logreg_predictions`) and the paired test
bench/sst2_overlap.py decides sentiment's margin with."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from training.baselines import tfidf_logreg, tfidf_logreg_predictions
from training.data.files import default_data_dir
from training.data.presets import PRESETS, preset_spec

ROOT = Path(__file__).resolve().parents[1]


def overlap_module():
    """bench/sst2_overlap.py's functions, without running its main (it needs a backbone)."""
    spec = importlib.util.spec_from_file_location("sst2_overlap_under_test", ROOT / "bench" / "sst2_overlap.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("sst2_overlap_under_test", module)
    spec.loader.exec_module(module)
    return module


def test_row_predictions_are_the_model_tfidf_logreg_scores():
    preset = PRESETS["sst2"]
    if not preset_spec(preset, "validation").path.is_file():
        pytest.skip(f"shared data not found at {default_data_dir()}")
    train, evaluation = (preset_spec(preset, s).read().subset(n, seed=0).examples
                         for s, n in (("train", 2000), ("validation", 200)))
    texts, labels = [e.text for e in train], [e.label for e in train]
    predicted = tfidf_logreg_predictions(texts, labels, [e.text for e in evaluation])
    scored = tfidf_logreg(texts, labels, [e.text for e in evaluation], [e.label for e in evaluation],
                          labels=list(preset.labels))
    assert len(predicted) == len(evaluation) and set(predicted) <= set(preset.labels)
    right = sum(p == e.label for p, e in zip(predicted, evaluation))
    assert right / len(evaluation) == pytest.approx(scored["accuracy"])


def test_paired_counts_and_mcnemar():
    overlap = overlap_module()
    assert overlap.mcnemar_exact(0, 0) == 1.0
    assert overlap.mcnemar_exact(3, 1) == pytest.approx(0.625)  # 2 * P(X <= 1), X ~ Bin(4, 1/2) = 2 * 5/16
    assert overlap.mcnemar_exact(10, 0) == pytest.approx(2 / 1024)
    assert overlap.mcnemar_exact(0, 10) == overlap.mcnemar_exact(10, 0)
    gold = ["a", "a", "b", "b", "a"]
    out = overlap.paired(gold, module=["a", "a", "b", "a", "b"], baseline=["a", "b", "a", "b", "a"])
    assert (out["only_module_right"], out["only_baseline_right"]) == (2, 2)
    assert out["module_accuracy"] == pytest.approx(0.6) and out["tfidf_logreg_accuracy"] == pytest.approx(0.6)
    assert out["margin_points"] == 0.0 and out["mcnemar_exact_p"] == 1.0


def test_cached_run_keeps_a_baseline_result_per_key(tmp_path):
    """`baselines.cached_run`: the first run computes and keeps the result; the same key reads it back
    (equal, without running); another key, or no cache, runs."""
    from training.baselines import cached_run, window_tagger

    words = [["Angela", "Merkel", "visited", "Munich"], ["Peter", "flew", "to", "Paris", "."]]
    tags = [["B-PER", "I-PER", "O", "B-LOC"], ["B-PER", "O", "O", "B-LOC", "O"]]
    calls = []

    def run():
        calls.append(1)
        return window_tagger(words, tags, words, tags)

    key = {"baseline": "window_tagger", "train": [words, tags], "evaluate": [words, tags], "labels": {"B-PER", "O"}}
    first = cached_run(tmp_path, key, run)
    assert len(calls) == 1 and len(list(tmp_path.glob("*.json"))) == 1
    assert cached_run(tmp_path, key, lambda: pytest.fail("ran again")) == first
    assert first["f1"] == window_tagger(words, tags, words, tags)["f1"]
    cached_run(tmp_path, {**key, "seed": 1}, run)
    cached_run(None, key, run)
    assert len(calls) == 3 and len(list(tmp_path.glob("*.json"))) == 2
    next(tmp_path.glob("*.json")).write_text("{broken")  # a damaged file is recomputed
    cached_run(tmp_path, key, run)
    cached_run(tmp_path, {**key, "seed": 1}, run)
    assert len(calls) == 4
