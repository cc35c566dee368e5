"""tmod-train --multi-label: reading, the loss, threshold choice, a tiny end-to-end run, served answers."""
from __future__ import annotations

import contextlib
import io
import json
import random
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from modules_store import ModuleStore, TaskType
from server.engine import Engine
from server.modules import load_module
from training.cli import main
from training.data.presets import GOEMOTIONS_LABELS, PRESETS, preset_spec
from training.data.tables import read_table
from training.metrics import choose_thresholds, label_f1_by_threshold, multilabel_scores
from training.report import per_label_table
from training.trainer import task_loss

COLOURS = {"red": "warm", "orange": "warm", "blue": "cold", "ice": "cold", "loud": "noisy", "drum": "noisy"}
FILLER = ["the", "thing", "was", "very", "a", "quite", "some", "object"]


def write_multilabel(path, n, seed):
    """Texts whose labels are the kinds of the cue words in them (0 to 3 labels per text)."""
    rng = random.Random(seed)
    lines = ["text\tlabels"]
    for _ in range(n):
        cues = rng.sample(sorted(COLOURS), rng.randint(0, 3))
        words = rng.sample(FILLER, 4) + cues
        rng.shuffle(words)
        lines.append(" ".join(words) + "\t" + ",".join(sorted({COLOURS[c] for c in cues})))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_goemotions_preset_reads_label_sets(tmp_path):
    labels_file = preset_spec(PRESETS["goemotions"], "train").path.parent / "labels.txt"
    if not labels_file.is_file():
        pytest.skip("the shared GoEmotions data is not here")
    assert list(GOEMOTIONS_LABELS) == labels_file.read_text(encoding="utf-8").split("\n")
    data = preset_spec(PRESETS["goemotions"], "validation").read()
    assert data.task_type == TaskType.multi_label_classification and len(data) == 5426
    assert sum(len(ex.label) >= 2 for ex in data.examples) == 878  # the dataset README's count
    first = (tmp_path / "x.tsv")
    first.write_text("I love it and laugh\t18,1\tid1\n")
    ex = read_table(first, text_column=0, label_column=1, header=False, multi_label=True,
                    label_map={str(i): n for i, n in enumerate(GOEMOTIONS_LABELS)}).examples[0]
    assert ex.label == ("love", "amusement")


def test_a_table_cell_that_spells_a_list_is_that_list_of_labels(tmp_path):
    """pandas' to_csv writes a column of lists as "['fear', 'joy']" (a Hugging Face dataset's label lists
    through `to_pandas`): split on commas it was the labels "['fear'" and " 'joy']" (12 labels for 4).
    As a single label, such a cell is refused as JSONL's lists are."""
    from training.data.files import UsageError

    pandas = pytest.importorskip("pandas")
    rows = [{"text": f"text number {i}", "labels": labels}
            for i, labels in enumerate([["fear", "joy"], ["anger"], [], ["love", "joy", "fear"]] * 3)]
    listed = tmp_path / "listed.csv"
    pandas.DataFrame(rows).to_csv(listed, index=False)
    assert "\"['fear', 'joy']\"" in listed.read_text()
    data = read_table(listed, text_column=None, label_column="labels", multi_label=True)
    assert [ex.label for ex in data.examples] == [tuple(row["labels"]) for row in rows]
    as_json = tmp_path / "as_json.tsv"
    as_json.write_text("text\tlabels\n" + "".join(f"text {i}\t{json.dumps(row['labels'])}\n" for i, row in enumerate(rows)))
    assert [ex.label for ex in read_table(as_json, text_column=None, label_column="labels", multi_label=True).examples] \
        == [tuple(row["labels"]) for row in rows]
    numpy_repr = tmp_path / "numpy_repr.csv"  # a Hugging Face dataset's lists reach pandas as numpy arrays
    numpy_repr.write_text("text,labels\n" + "".join(f"text {i},\"[{' '.join(repr(x) for x in row['labels'])}]\"\n"
                                                     for i, row in enumerate(rows)))
    assert "\"['fear' 'joy']\"" in numpy_repr.read_text()
    assert [ex.label for ex in read_table(numpy_repr, text_column=None, label_column="labels", multi_label=True).examples] \
        == [tuple(row["labels"]) for row in rows]
    with pytest.raises(UsageError, match=r'listed.csv:2: the label is a list \(\["fear", "joy"\]\): give --multi-label'):
        read_table(listed, text_column=None, label_column="labels")
    names = tmp_path / "names.tsv"  # a bracketed label that is no list stays a label
    names.write_text("text\tlabel\n" + "".join(f"text {i}\t{'[NAME]' if i % 2 else 'other'}\n" for i in range(6)))
    assert {ex.label for ex in read_table(names, text_column=None, label_column=None).examples} == {"[NAME]", "other"}


def test_loss_is_binary_cross_entropy_per_label():
    logits = torch.tensor([[2.0, -1.0, 0.5], [0.0, 3.0, -2.0]])
    targets = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    by_hand = -(targets * torch.log(torch.sigmoid(logits)) + (1 - targets) * torch.log(1 - torch.sigmoid(logits))).mean()
    assert task_loss(logits, targets).item() == pytest.approx(by_hand.item(), rel=1e-6)
    assert task_loss(logits, torch.tensor([0, 1])).item() == pytest.approx(F.cross_entropy(logits, torch.tensor([0, 1])).item())


def test_scores_and_threshold_choice_by_hand():
    gold = np.array([[1, 0], [1, 1], [0, 1], [0, 0]], dtype=bool)
    probs = np.array([[0.9, 0.2], [0.6, 0.35], [0.1, 0.3], [0.2, 0.1]])
    pred = probs >= 0.5
    scores = multilabel_scores(gold, pred, ["a", "b"])
    # a: tp 2, fp 0, fn 0 -> F1 1; b: tp 0, fp 0, fn 2 -> F1 0; micro: tp 2, fp 0, fn 2 -> 2/3
    assert scores["per_label"]["a"]["f1"] == 1.0 and scores["per_label"]["b"]["f1"] == 0.0
    assert scores["f1_macro"] == 0.5 and scores["f1_micro"] == pytest.approx(2 / 3)
    grid = (0.25, 0.5)
    table = label_f1_by_threshold(gold, probs, grid)
    # a at 0.25: tp 2, fp 0 -> 1; b at 0.25: tp 2, fp 0 (0.1 < 0.25) -> 1; b at 0.5: 0
    assert table.tolist() == [[1.0, 1.0], [1.0, 0.0]]
    chosen = choose_thresholds(gold, probs, ["a", "b"], grid)
    assert chosen["rule"] == "global" and chosen["thresholds"] == {"a": 0.25, "b": 0.25}  # ties: the simpler rule
    probs[3, 0] = 0.3  # now a needs 0.5 and b needs 0.25: only per-label thresholds reach macro F1 1
    chosen = choose_thresholds(gold, probs, ["a", "b"], grid)
    assert chosen["rule"] == "per_label" and chosen["thresholds"] == {"a": 0.5, "b": 0.25}
    assert chosen["per_label_f1_macro"] == 1.0 > chosen["global_f1_macro"]


def test_a_label_without_validation_evidence_takes_the_global_threshold():
    # c has no positive row in this split: its F1 is 0 at every threshold, so nothing chose a threshold
    # for it; the grid's lowest (0.02 in training) would answer it on nearly every text
    gold = np.array([[1, 0, 0], [1, 1, 0], [0, 1, 0], [0, 0, 0]], dtype=bool)
    probs = np.array([[0.9, 0.2, 0.3], [0.6, 0.35, 0.3], [0.1, 0.3, 0.3], [0.3, 0.1, 0.3]])
    chosen = choose_thresholds(gold, probs, ["a", "b", "c"], (0.1, 0.25, 0.5, 0.75))
    # macro F1 at 0.1, 0.25, 0.5: 0.44, 0.6, 0.33 (c adds 0 to each); a is best at 0.5, b at 0.25
    assert chosen["rule"] == "per_label" and chosen["global_threshold"] == 0.25
    assert chosen["thresholds"] == {"a": 0.5, "b": 0.25, "c": 0.25}
    assert chosen["threshold_rule"].endswith("take the global one: c")
    # the per-label table says c's F1 0 is the split's, not the head's
    scores = multilabel_scores(gold, probs >= 0.25, ["a", "b", "c"])
    table = per_label_table(scores, chosen["thresholds"])
    assert "No row of the validation split carries c (support 0)" in table
    assert "carries a" not in table and "carries b" not in table


@pytest.fixture(scope="module")
def multilabel_run(tmp_path_factory, train_backbone_dir):
    root = tmp_path_factory.mktemp("multilabel")
    train_file, validation_file = write_multilabel(root / "train.tsv", 96, 0), write_multilabel(root / "val.tsv", 48, 1)
    argv = ["layermix", "--multi-label", "--train", str(train_file), "--validation", str(validation_file),
            "--text-column", "text", "--label-column", "labels", "--backbone", str(train_backbone_dir),
            "--task", "kinds", "--store", str(root / "store"), "--report-dir", str(root / "report"),
            "--epochs", "12", "--lr", "0.01", "--alpha", "2", "--batch-size", "8", "--project-dim", "16",
            "--patience", "12", "--no-progress"]
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        assert main(argv) == 0
    (root / "stderr.txt").write_text(said.getvalue())
    return root


def test_multilabel_training_writes_thresholds_and_reports(multilabel_run, train_backbone):
    module = load_module(ModuleStore(multilabel_run / "store"), "kinds", "1", train_backbone)
    manifest = module.manifest
    assert manifest.task_type == TaskType.multi_label_classification
    assert manifest.labels == ["cold", "noisy", "warm"]
    history = manifest.training["history"]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    thresholds = manifest.decoding["thresholds"]
    assert set(thresholds) == set(manifest.labels) and manifest.decoding["threshold_rule"].startswith(manifest.metrics["rule"])
    assert manifest.metrics["f1_macro"] == max(manifest.metrics["global_f1_macro"], manifest.metrics["per_label_f1_macro"])
    assert manifest.metrics["f1_macro"] > 0.5  # the cue words are easy to learn
    # each margin over a baseline with its paired bootstrap interval: the head's answers at its thresholds
    baselines = manifest.metrics["baselines"]
    for name in ("majority", "tfidf_logreg"):
        low, high = baselines[f"margin_over_{name}_interval"]
        assert low <= baselines[f"margin_over_{name}"] <= high, name
    report = multilabel_run / "report"
    table = (report / "per_label.md").read_text()
    assert all(f"| {label} | {thresholds[label]:.2f} |" in table for label in manifest.labels)
    assert (report / "per_label_f1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((report / "metrics.json").read_text())["decoding"]["thresholds"] == thresholds
    # an epoch's number is at one threshold for every label, the kept head's at its own per label: each says so
    epochs = [line for line in (multilabel_run / "stderr.txt").read_text().splitlines() if line.startswith("epoch ")]
    assert epochs and all(re.search(r"validation f1_macro [\d.]+ at threshold [\d.]+ for all labels", line)
                          for line in epochs), epochs
    assert (f"- validation f1_macro: **{manifest.metrics['f1_macro']:.4f}** (48 examples; this split chose the epoch "
            "and the decision thresholds, so this number is optimistic; majority ") in (report / "report.md").read_text()


def test_served_answers_use_the_shipped_thresholds(multilabel_run, train_backbone):
    """The served answer's labels are those whose sigmoid passes the manifest's thresholds, and
    re-scoring the served answers gives the manifest's macro F1."""
    from training.data.tables import read_table as read

    module = load_module(ModuleStore(multilabel_run / "store"), "kinds", "1", train_backbone)
    data = read(multilabel_run / "val.tsv", text_column="text", label_column="labels", multi_label=True)
    batch = train_backbone.tokenize(data.texts())
    answers = Engine(train_backbone).predict(batch, {"kinds": module})["kinds"]
    labels, thresholds = module.head.labels, module.manifest.decoding["thresholds"]
    gold = np.array([[label in ex.label for label in labels] for ex in data.examples])
    pred = np.array([[label in a["labels"] for label in labels] for a in answers])
    for answer in answers:
        assert answer["labels"] == [l for l in labels if answer["scores"][l] >= thresholds[l]]
    assert multilabel_scores(gold, pred, labels)["f1_macro"] == pytest.approx(module.manifest.metrics["f1_macro"], abs=0.03)


def test_scoring_the_validation_file_says_it_chose_the_thresholds_too(multilabel_run, train_backbone_dir, capsys):
    assert main(["eval", "--store", str(multilabel_run / "store"), "--task", "kinds", "--file",
                 str(multilabel_run / "val.tsv"), "--backbone", str(train_backbone_dir), "--no-progress"]) == 0
    role = json.loads(capsys.readouterr().out)["file_role"]
    assert role == "validation: this file chose the epoch and the decision thresholds, so this number is optimistic"


def test_eval_predictions_hold_each_rows_labels_at_the_thresholds(multilabel_run, train_backbone_dir, tmp_path, capsys):
    """--predictions of a multi-label module: each row's gold labels, the labels at or over their thresholds
    (what the metrics counted: the rows' exact matches are the metrics'), every label's probability."""
    out = tmp_path / "rows.jsonl"
    assert main(["eval", "--store", str(multilabel_run / "store"), "--task", "kinds", "--file",
                 str(multilabel_run / "val.tsv"), "--backbone", str(train_backbone_dir), "--no-progress",
                 "--predictions", str(out)]) == 0
    metrics = json.loads(capsys.readouterr().out)["metrics"]
    thresholds = ModuleStore(multilabel_run / "store").read_manifest("kinds").decoding["thresholds"]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == metrics["examples"]
    for row in rows:
        assert row["predicted"] == [l for l in thresholds if row["probabilities"][l] >= thresholds[l]]
    exact = sum(r["predicted"] == r["gold"] for r in rows) / len(rows)  # both in the head's label order
    assert exact == pytest.approx(metrics["exact_match"])
