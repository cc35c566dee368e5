"""training.metrics against hand-computed values, against seqeval (conlleval-compatible mode), and
against the entities tmod-serve answers for the same tags."""
from __future__ import annotations

import math
import random

import pytest
import torch

from modules_store import TaskType
from server.backbone.tokens import TokenBatch
from server.heads.decode import decode
from training.metrics import (
    accuracy,
    classification_scores,
    entities,
    entity_scores,
    f1_binary,
    f1_macro,
    matthews,
    NOTHING_CHOSEN,
    rows_seen,
)
from training.settings import METRICS

GOLD = [1, 1, 1, 1, 0, 0, 0, 0, 0, 1]
PRED = [1, 1, 1, 0, 0, 0, 1, 1, 0, 1]
# by hand: TP=4 (rows 0,1,2,9), FN=1 (row 3), FP=2 (rows 6,7), TN=3 (rows 4,5,8)


def test_accuracy_and_binary_f1_by_hand():
    assert accuracy(GOLD, PRED) == pytest.approx(7 / 10)
    # precision 4/6, recall 4/5 -> F1 = 2*4 / (2*4 + 2 + 1) = 8/11
    assert f1_binary(GOLD, PRED, positive=1) == pytest.approx(8 / 11)
    # class 0: TP=3, FP=1, FN=2 -> F1 = 6/9
    assert f1_binary(GOLD, PRED, positive=0) == pytest.approx(6 / 9)
    assert f1_macro(GOLD, PRED) == pytest.approx((8 / 11 + 6 / 9) / 2)


def test_matthews_by_hand():
    tp, tn, fp, fn = 4, 3, 2, 1
    expected = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert matthews(GOLD, PRED) == pytest.approx(expected)
    assert matthews(GOLD, GOLD) == pytest.approx(1.0)
    assert matthews(GOLD, [1 - g for g in GOLD]) == pytest.approx(-1.0)
    assert matthews(GOLD, [1] * len(GOLD)) == 0.0  # constant prediction: defined as 0


def test_multiclass_matthews_matches_sklearn():
    sklearn = pytest.importorskip("sklearn.metrics")
    rng = random.Random(3)
    gold = [rng.choice("abc") for _ in range(200)]
    pred = [g if rng.random() < 0.6 else rng.choice("abc") for g in gold]
    assert matthews(gold, pred) == pytest.approx(sklearn.matthews_corrcoef(gold, pred))
    assert f1_macro(gold, pred) == pytest.approx(sklearn.f1_score(gold, pred, average="macro"))


def test_classification_scores_names_the_positive_label():
    scores = classification_scores(["neg", "pos", "pos"], ["neg", "neg", "pos"], ["neg", "pos"])
    assert scores["accuracy"] == pytest.approx(2 / 3)
    assert scores["f1"] == pytest.approx(2 / 3)  # pos: P=1, R=1/2
    assert scores["f1_positive_label"] == "pos"
    assert scores["examples"] == 3


def test_entities_follow_conlleval():
    assert entities(["B-PER", "I-PER", "O", "B-LOC"]) == [("PER", 0, 1), ("LOC", 3, 3)]
    assert entities(["I-ORG", "I-ORG", "O"]) == [("ORG", 0, 1)]  # IOB1: I- after O starts one
    assert entities(["B-PER", "B-PER"]) == [("PER", 0, 0), ("PER", 1, 1)]  # B- always starts one
    assert entities(["B-PER", "I-LOC", "I-LOC"]) == [("PER", 0, 0), ("LOC", 1, 2)]  # type change
    assert entities(["O", "O"]) == []
    assert entities(["B-MISC"]) == [("MISC", 0, 0)]


def test_entity_scores_by_hand():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O", "B-PER"]]
    pred = [["B-PER", "I-PER", "O", "B-ORG"], ["B-ORG", "I-ORG", "B-PER"]]
    # gold: PER(0-1), LOC(3), ORG(0), PER(2) -> 4; pred: PER(0-1), ORG(3), ORG(0-1), PER(2) -> 4
    # exact matches: PER(0-1), PER(2) -> 2 (ORG(0-1) is the wrong span)
    scores = entity_scores(gold, pred)
    assert scores["precision"] == pytest.approx(2 / 4)
    assert scores["recall"] == pytest.approx(2 / 4)
    assert scores["f1"] == pytest.approx(0.5)
    assert scores["per_type"]["PER"] == {"precision": 1.0, "recall": 1.0, "f1": 1.0, "support": 2}
    assert scores["per_type"]["LOC"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 1}
    assert scores["per_type"]["ORG"]["precision"] == 0.0 and scores["per_type"]["ORG"]["support"] == 1
    assert scores["entities"] == 4
    assert scores["word_accuracy"] == pytest.approx(5 / 7)


# B-/I-/O tags, bare types, BIOES and BILOU, E- and S- prefixes, an empty type: every way a label set can read
LABEL_SETS = [["O", "B-PER", "I-PER", "B-LOC", "I-LOC"], ["O", "PER", "LOC"],
              ["O", "B-PER", "I-PER", "E-PER", "S-PER", "B-LOC", "I-LOC", "E-LOC", "S-LOC"],
              ["O", "B-PER", "I-PER", "L-PER", "U-PER", "B-LOC", "I-LOC", "L-LOC", "U-LOC"],
              ["O", "B-X", "I-X", "E-X", "S-X", "X", "I-Y", "B-", "I", ""]]


def served_entities(labels: list[str], tags: list[str]) -> list[tuple[str, int, int]]:
    """What tmod-serve answers for one text of one-token words tagged `tags`, as (type, first, last) words."""
    text = " ".join(["w"] * len(tags))  # word i is text[2i]
    ids = torch.zeros((1, len(tags)), dtype=torch.long)
    batch = TokenBatch(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=None,
                       offsets=[[(2 * i, 2 * i + 1) for i in range(len(tags))]], sequence_ids=[[0] * len(tags)],
                       word_ids=[list(range(len(tags)))], texts=[text], text_pairs=None, truncated=[False])
    logits = torch.nn.functional.one_hot(torch.tensor([[labels.index(t) for t in tags]]), len(labels)).float() * 9
    answer = decode(TaskType.token_classification, labels, logits, batch)[0]["entities"]
    return [(e["label"], e["start"] // 2, (e["end"] - 1) // 2) for e in answer]


def within_the_rules(labels: list[str], tags: list[str]) -> list[str]:
    """`tags` with every I-X or E-X / L-X that follows neither B-X nor I-X made B-X, where the labels
    have a B-X: what the server and tmod-train both decode to never breaks those rules
    (server.heads.decode.word_tags)."""
    out = []
    for tag in tags:
        kind = tag[2:]
        if tag[:2] in ("I-", "E-", "L-") and "B-" + kind in labels and (not out or out[-1] not in ("I-" + kind, "B-" + kind)):
            tag = "B-" + kind
        out.append(tag)
    return out


@pytest.mark.parametrize("tags, found", [
    ("B-PER I-PER E-PER S-LOC O", [("PER", 0, 2), ("LOC", 3, 3)]),
    ("B-PER E-PER B-PER E-PER", [("PER", 0, 1), ("PER", 2, 3)]),  # two names side by side
    ("S-PER S-PER E-PER", [("PER", 0, 0), ("PER", 1, 1), ("PER", 2, 2)]),  # S- and E- close; a stray E- is one
    ("B-PER L-PER U-LOC B-LOC I-LOC L-LOC", [("PER", 0, 1), ("LOC", 2, 2), ("LOC", 3, 5)]),  # BILOU
    ("B-PER I-PER O B-LOC", [("PER", 0, 1), ("LOC", 3, 3)]),  # BIO as before
])
def test_bioes_and_bilou_entities(tags, found):
    """A BIOES / BILOU file's entities: "B-PER E-PER" is one name, not two (as an E- opening an entity read it)."""
    assert entities(tags.split()) == found


def test_reported_f1_counts_the_entities_the_server_answers():
    """One reading of a tag sequence: a module's entity F1 (tmod-train) scores the spans that
    tmod-serve answers for the same tags, for every kind of label set (ill-formed sequences where
    the labels leave them possible)."""
    rng = random.Random(0)
    for _ in range(500):
        labels = rng.choice(LABEL_SETS)
        tags = within_the_rules(labels, [rng.choice(labels) for _ in range(rng.randint(1, 10))])
        assert entities(tags) == served_entities(labels, tags), tags


def _random_tags(rng: random.Random, n: int) -> list[str]:
    tags = ["O", "O", "O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]
    return [rng.choice(tags) for _ in range(n)]


def test_entity_scores_match_seqeval_on_random_and_ill_formed_tags():
    seqeval = pytest.importorskip("seqeval.metrics")
    rng = random.Random(0)
    gold = [_random_tags(rng, rng.randint(1, 12)) for _ in range(300)]
    # predictions: mostly copies with random corruption, so there are hits, misses and partial spans
    pred = [[t if rng.random() < 0.7 else _random_tags(rng, 1)[0] for t in sent] for sent in gold]
    ours = entity_scores(gold, pred)
    assert ours["precision"] == pytest.approx(seqeval.precision_score(gold, pred))
    assert ours["recall"] == pytest.approx(seqeval.recall_score(gold, pred))
    assert ours["f1"] == pytest.approx(seqeval.f1_score(gold, pred))
    report = seqeval.classification_report(gold, pred, output_dict=True, zero_division=0)
    for kind, theirs in ((k, v) for k, v in report.items() if k in ("PER", "LOC", "MISC")):
        mine = ours["per_type"][kind]
        assert mine["precision"] == pytest.approx(theirs["precision"])
        assert mine["recall"] == pytest.approx(theirs["recall"])
        assert mine["f1"] == pytest.approx(theirs["f1-score"])
        assert mine["support"] == theirs["support"]


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError):
        accuracy([1, 2], [1])
    with pytest.raises(ValueError, match="sentence 0"):
        entity_scores([["O", "O"]], [["O"]])


def test_entities_begun_with_i_are_begun_with_b_and_stay_the_same_entities():
    """IOB1 (CoNLL-2003's original release) and BIO slips: every entity that begins with I- is begun
    with B- (training/data/examples.py begin_entities_with_b), the entities unchanged, BIOES left as it is."""
    from server.heads.decode import split_tag
    from training.data.examples import begin_entities_with_b

    iob1 = ["I-PER", "I-PER", "O", "I-LOC", "B-LOC", "I-LOC", "I-ORG", "PER", "I-PER"]
    assert begin_entities_with_b(iob1) == (["B-PER", "I-PER", "O", "B-LOC", "B-LOC", "I-LOC", "B-ORG", "PER", "I-PER"], 3)
    bioes = ["B-PER", "E-PER", "S-LOC", "O", "B-ORG", "I-ORG", "E-ORG"]
    assert begin_entities_with_b(bioes) == (bioes, 0)
    rng = random.Random(1)
    alphabet = ["O", "B-PER", "I-PER", "E-PER", "S-PER", "I-LOC", "B-LOC", "L-LOC", "U-LOC", "MISC"]
    for _ in range(2000):
        tags = [rng.choice(alphabet) for _ in range(rng.randint(1, 10))]
        begun, n = begin_entities_with_b(tags)
        assert entities(begun) == entities(tags)
        assert n == sum(a != b for a, b in zip(tags, begun))
        for before, tag in zip(["O"] + begun, begun):  # an I- only where the entity before it is open, of its type
            assert not tag.startswith("I-") or split_tag(before) in (("B", tag[2:]), ("I", tag[2:]))


def test_a_confusion_matrix_of_many_labels_shows_the_most_confused(tmp_path):
    """115 labels (GoEmotions' label sets read as classes) were drawn 7,177 pixels wide, each unreadable;
    over 20, the 20 in the most errors are drawn."""
    import struct

    from training.report import confused_labels, plot_confusion
    n = 30
    counts = [[10 if i == j else 0 for j in range(n)] for i in range(n)]
    counts[3][7], counts[12][3], counts[29][0] = 5, 2, 1  # errors: 3 (7 as gold and predicted), 7, 12, 29, 0
    assert confused_labels(counts, most=5) == [0, 3, 7, 12, 29]
    assert confused_labels(counts[:4], most=5) == [0, 1, 2, 3]  # few labels: all of them
    plot_confusion({"labels": [f"L{i}" for i in range(n)], "counts": counts}, tmp_path / "c.png", "t")
    width, height = struct.unpack(">II", (tmp_path / "c.png").read_bytes()[16:24])
    assert width < 2000 and height < 2000  # 20 labels, not 30


def test_a_long_task_name_stays_inside_the_confusion_plot(tmp_path, monkeypatch):
    """The title ran past a two-label matrix's edge ('mysent: confusion on the validation split' lost its
    last word): it is wrapped to the figure's width."""
    from training import report

    figures = []
    monkeypatch.setattr(report.plt, "close", figures.append)  # keep the figure to measure it
    report.plot_confusion({"labels": ["negative", "positive"], "counts": [[75, 16], [16, 93]]}, tmp_path / "c.png",
                          "customer-support-intents: confusion on the validation split")
    figure = figures[0]
    title = figure.axes[0].title.get_window_extent(figure.canvas.get_renderer())
    assert 0 <= title.x0 and title.x1 <= figure.bbox.width
    monkeypatch.undo()
    report.plt.close(figure)


def test_rows_seen_says_what_a_split_shares_and_only_what_matters():
    """A split's rows that are not unseen, said in one wording wherever its number is read: test rows that
    validation holds count only where validation chose something; one row is one row ('holds')."""
    data = {"validation_examples": 10, "validation_rows_also_in_training": 1, "test_examples": 8,
            "test_rows_also_in_training": 0, "test_rows_also_in_validation": 2}
    assert rows_seen(data, "validation") == ("1 of its 10 rows holds a text the training rows hold too, which flatters "
                                             "the head")
    assert rows_seen(data, "test", "chose the epoch") == ("2 of its 8 rows hold a text the validation rows hold too, "
                                                          "and validation chose the epoch on them, so this number is "
                                                          "optimistic")
    assert rows_seen(data, "test", NOTHING_CHOSEN) == ""
    assert rows_seen({}, "test", "chose the epoch") == ""


def _random_rows(kind, rng, n):
    """(gold, pred, labels) of `n` random rows of a task type, pred right on about 60% of them."""
    if kind == TaskType.token_classification:
        labels = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
        gold = [[rng.choice(labels) for _ in range(rng.randint(1, 12))] for _ in range(n)]
        return gold, [[t if rng.random() < 0.6 else rng.choice(labels) for t in tags] for tags in gold], labels
    labels = ["a", "b", "c"]
    if kind == TaskType.multi_label_classification:
        gold = [[label for label in labels if rng.random() < 0.3] for _ in range(n)]
        return gold, [g if rng.random() < 0.6 else [label for label in labels if rng.random() < 0.3]
                      for g in gold], labels
    gold = [rng.choice(labels) for _ in range(n)]
    return gold, [g if rng.random() < 0.6 else rng.choice(labels) for g in gold], labels


@pytest.mark.parametrize("kind", list(METRICS))
def test_the_bootstraps_counts_score_every_metric_as_the_metrics_do(kind):
    """`margin_interval` scores its draws from summed per-row counts: on all the rows, those give each
    selection metric exactly as the metric functions give it (two labels for binary F1 too)."""
    import numpy as np

    from training.metrics import multi_hot, multilabel_scores, row_counts, scores_of_counts

    rng = random.Random(7)
    gold, pred, labels = _random_rows(kind, rng, 300)
    cases = [(gold, pred, labels)]
    if kind == TaskType.sequence_classification:  # binary F1 exists for two labels only
        cases.append(([g if g != "c" else "a" for g in gold], [p if p != "c" else "b" for p in pred], ["a", "b"]))
    for gold, pred, labels in cases:
        counted = scores_of_counts(kind, np.asarray(row_counts(kind, gold, pred, labels).sum(0)), labels)
        if kind == TaskType.token_classification:
            expected = entity_scores(gold, pred)
        elif kind == TaskType.multi_label_classification:
            expected = multilabel_scores(multi_hot(gold, labels), multi_hot(pred, labels), labels)
        else:
            expected = classification_scores(gold, pred, labels)
        for metric in METRICS[kind]:
            if metric in expected:
                assert counted[metric][0] == pytest.approx(expected[metric], abs=1e-12), metric
        assert set(counted) >= {m for m in METRICS[kind] if m in expected}


def test_the_margin_interval_is_a_paired_bootstrap():
    """The interval is of the margin, row by row: the same answers give [0, 0]; for accuracy its width
    is the paired difference's normal interval (1.96 standard errors of the mean per-row difference)
    within 15%; a seed gives the same interval again."""
    import numpy as np

    from training.metrics import margin_interval

    rng = random.Random(11)
    gold, head, labels = _random_rows(TaskType.sequence_classification, rng, 2000)
    other = [h if rng.random() < 0.8 else rng.choice(labels) for h in head]  # mostly the same answers: paired
    kind = TaskType.sequence_classification
    assert margin_interval(kind, "accuracy", gold, head, head, labels) == (0.0, 0.0)
    low, high = margin_interval(kind, "accuracy", gold, head, other, labels, seed=3)
    assert (low, high) == margin_interval(kind, "accuracy", gold, head, other, labels, seed=3)
    differences = np.array([(h == g) - (o == g) for g, h, o in zip(gold, head, other)], dtype=float)
    mean, error = differences.mean(), differences.std() / np.sqrt(len(differences))
    assert low < mean < high
    assert (high - low) == pytest.approx(2 * 1.96 * error, rel=0.15)
    # unpaired, the two accuracies' own noise would make it about 3x wider: the pairing is what is measured
    assert high - low < 0.5 * 2 * 1.96 * np.sqrt(2 * 0.24 / len(gold))
