"""training/baselines.py on small slices of the shared real data sets: each baseline beats the
majority answer by a clear margin and reports the same metrics (same functions) as the head's
evaluation; the tagger's entity F1 agrees with seqeval."""
from __future__ import annotations

from collections import Counter

import pytest

from training.baselines import (majority, tfidf_logreg, tfidf_logreg_scores, window_tagger, window_tagger_scores,
                                window_tags)
from training.data.files import default_data_dir
from training.data.presets import PRESETS, preset_spec
from training.metrics import classification_scores, optimistic, validation_role


def _splits(name: str, n_train: int, n_eval: int):
    preset = PRESETS[name]
    if not preset_spec(preset, "validation").path.is_file():
        pytest.skip(f"shared data not found at {default_data_dir()}")
    train, validation = (preset_spec(preset, split).read() for split in ("train", "validation"))
    return train.subset(n_train, seed=0).examples, validation.subset(n_eval, seed=0).examples, list(preset.labels)


def test_majority_answers_the_most_frequent_training_label():
    train, evaluation, labels = ["a", "a", "b"], ["a", "b", "b", "b"], ["a", "b"]
    scores = majority(train, evaluation, labels=labels)
    assert scores == {"baseline": "majority", **classification_scores(evaluation, ["a"] * 4, labels),
                      "answers": ["a"] * 4}
    assert scores["accuracy"] == pytest.approx(0.25) and scores["mcc"] == 0.0
    assert majority([("x",), ("x", "y"), ("x",)], [("x",), ("y",)], multi_label=True)["exact_match"] == 0.5
    assert majority([["O", "B-PER"], ["O"]], [["B-PER", "O"]])["f1"] == 0.0  # every word O: no entity


def test_tfidf_logreg_beats_majority_on_sst2():
    train, evaluation, labels = _splits("sst2", 3000, 400)
    args = ([e.label for e in train], [e.label for e in evaluation])
    base = majority(*args, labels=labels)
    linear = tfidf_logreg([e.text for e in train], args[0], [e.text for e in evaluation], args[1], labels=labels)
    assert set(linear) == set(base) and linear["baseline"] == "tfidf_logreg"
    assert linear["accuracy"] > base["accuracy"] + 0.1
    assert linear["mcc"] > 0.3 and linear["f1_positive_label"] == "positive"


def test_tfidf_logreg_reads_text_pairs():
    train, evaluation, labels = _splits("rte", 2490, 277)
    pairs = [(e.text, e.text_pair) for e in train]
    scores = tfidf_logreg(pairs, [e.label for e in train], [(e.text, e.text_pair) for e in evaluation],
                          [e.label for e in evaluation], labels=labels)
    assert scores["examples"] == 277 and 0.3 < scores["accuracy"] < 1.0  # RTE is hard for bags of words


def test_tfidf_logreg_multi_label():
    train, evaluation, labels = _splits("goemotions", 1200, 300)
    args = ([e.label for e in train], [e.label for e in evaluation])
    base = majority(*args, multi_label=True, labels=labels)
    linear = tfidf_logreg([e.text for e in train], args[0], [e.text for e in evaluation], args[1],
                          multi_label=True, labels=labels)
    assert set(linear["per_label"]) == set(labels)
    assert linear["f1_macro"] > base["f1_macro"] + 0.05  # majority answers "neutral" only


def test_one_fit_scores_each_split_as_a_fit_for_it_alone():
    """A run with a test split fits the linear baseline once and scores its test and validation rows
    (`*_scores`): each split's scores are those of the one-split function."""
    train, evaluation, labels = _splits("goemotions", 600, 200)
    texts, gold = [e.text for e in evaluation], [e.label for e in evaluation]
    sets = [(texts[:120], gold[:120]), (texts[120:], gold[120:])]
    both = tfidf_logreg_scores([e.text for e in train], [e.label for e in train], sets, multi_label=True, labels=labels)
    assert both == [tfidf_logreg([e.text for e in train], [e.label for e in train], *split, multi_label=True,
                                 labels=labels) for split in sets]
    train, evaluation, _ = _splits("conll2003", 400, 120)
    words, tags = [e.words for e in train], [e.tags for e in train]
    sets = [([e.words for e in evaluation[:70]], [e.tags for e in evaluation[:70]]),
            ([e.words for e in evaluation[70:]], [e.tags for e in evaluation[70:]])]
    assert window_tagger_scores(words, tags, sets) == [window_tagger(words, tags, *split) for split in sets]


def test_window_tagger_on_conll_agrees_with_seqeval():
    seqeval = pytest.importorskip("seqeval.metrics")
    train, evaluation, _ = _splits("conll2003", 1500, 300)
    gold = [e.tags for e in evaluation]
    scores = window_tagger([e.words for e in train], [e.tags for e in train], [e.words for e in evaluation], gold)
    assert scores["baseline"] == "window_tagger" and scores["f1"] > 0.5
    assert set(scores["per_type"]) == {"PER", "ORG", "LOC", "MISC"}
    assert scores["entities"] == sum(Counter(t[:2] == "B-" for t in tags)[True] for tags in gold)
    # the same words re-tagged by seqeval's default (conlleval) mode give the same F1
    predicted = window_tags([e.words for e in train], [e.tags for e in train], [e.words for e in evaluation])
    assert scores["f1"] == pytest.approx(seqeval.f1_score(gold, predicted), abs=1e-9)


def test_tfidf_logreg_more_than_two_classes():
    """Three GoEmotions labels, rows carrying exactly one of them: a single-label 3-class task."""
    train, evaluation, _ = _splits("goemotions", 20000, 3000)
    keep = {"gratitude", "amusement", "anger"}

    def single(examples):
        return [e for e in examples if len(e.label) == 1 and e.label[0] in keep]

    train, evaluation = single(train), single(evaluation)
    args = ([e.label[0] for e in train], [e.label[0] for e in evaluation])
    linear = tfidf_logreg([e.text for e in train], args[0], [e.text for e in evaluation], args[1])
    assert linear["examples"] == len(evaluation) > 50 and "f1" not in linear  # no binary F1 for 3 labels
    assert linear["accuracy"] > majority(*args)["accuracy"] + 0.2


@pytest.mark.parametrize("head, majority_score, linear_score, expected", [
    (0.653, 0.66, 0.60, "no better than the majority answer on the test split (accuracy 0.6530 against 0.6600)"),
    (0.70, 0.66, 0.72, "no better than the linear model (tfidf_logreg)"),
    (0.80, 0.66, 0.72, "above both baselines on the test split: accuracy +0.1400 over the majority answer, "
                       "+0.0800 over the linear model (tfidf_logreg)"),
])
def test_the_verdict_names_the_first_baseline_the_head_fails_to_beat(head, majority_score, linear_score, expected):
    from modules_store import TaskType
    from training.assess import verdict
    baselines = {"split": "test", "metric": "accuracy", "head": head, "majority": {"accuracy": majority_score},
                 "tfidf_logreg": {"accuracy": linear_score}}
    line = verdict(baselines, TaskType.sequence_classification)
    assert expected in line
    assert ("imbalanced" in line) == (head <= majority_score)  # the majority class alone scores 0.66 in accuracy
    weigh = ", and --class-weights balanced trains on every class alike"
    assert (weigh in line) == (head <= majority_score)  # the remedy not used yet
    assert weigh not in verdict({**baselines, "class_weights": "balanced"}, TaskType.sequence_classification)
    assert "chose the epoch" not in line  # the test split chose nothing
    on_validation = verdict({**baselines, "split": "validation"}, TaskType.sequence_classification)
    # --split VAL,TEST is refused with a preset's --dataset: the advice says where it applies
    assert on_validation.endswith("; the validation split also chose the epoch: a test split (--test FILE; --split "
                                  "VAL,TEST of a --train file) gives one that chose nothing")


def test_a_verdict_on_a_handful_of_rows_says_they_are_too_few():
    """Two validation rows read 'above both baselines: accuracy +0.5000', as if it were a finding."""
    from modules_store import TaskType
    from training.assess import verdict
    def on(rows):
        return {"split": "test", "metric": "accuracy", "head": 1.0, "majority": {"accuracy": 0.5, "examples": rows},
                "tfidf_logreg": {"accuracy": 0.5, "examples": rows}}
    few = verdict(on(2), TaskType.sequence_classification)
    assert few.endswith("; scored on 2 rows only, each 50% of them: too few for these numbers to rank the head "
                        "against the baselines")
    assert "too few" not in verdict(on(200), TaskType.sequence_classification)
    sentences = {"split": "test", "metric": "f1", "head": 0.6, "majority": {"f1": 0.0, "sentences": 20},
                 "window_tagger": {"f1": 0.4, "sentences": 20}}
    assert "scored on 20 rows only, each 5% of them" in verdict(sentences, TaskType.token_classification)


def test_every_shipped_number_says_what_chose_it_and_what_a_simple_model_scores():
    """Each shipped module's validation numbers (what /v1/tasks and OIP metadata show) say what that
    split chose and carry the baselines tmod-train writes: the majority answer and the linear model on
    the same data, the head's margin over each (its own number minus theirs) and the verdict. Modules
    trained on a preset's whole training file agree with bench/results/baselines.json."""
    import json
    from pathlib import Path

    from modules_store import TaskType
    from training.assess import verdict

    repo = Path(__file__).resolve().parents[1]
    recorded = json.loads((repo / "bench/results/baselines.json").read_text())["tasks"]
    checked = 0
    for path in sorted((repo / "modules_store").glob("*/*/manifest.json")):
        manifest = json.loads(path.read_text())
        metrics = manifest["metrics"]
        if metrics.get("split") != "validation":
            continue  # an embedding module: nothing trained, nothing chosen
        name, metric = f"{manifest['task']}/{manifest['version']}", metrics["metric"]
        thresholds = bool((manifest.get("decoding") or {}).get("thresholds"))
        trained = manifest["training"]  # --select last (entailment) and one-epoch runs chose no epoch
        epoch_chosen = trained["settings"].get("select", "best") == "best" and trained["epochs_run"] > 1
        assert metrics["role"] == validation_role(epoch_chosen, thresholds, False), name
        baselines = metrics["baselines"]
        assert (baselines["split"], baselines["metric"], baselines["head"]) == ("validation", metric, metrics[metric]), name
        linear = "window_tagger" if manifest["task_type"] == "token_classification" else "tfidf_logreg"
        for run in ("majority", linear):
            assert baselines[run]["baseline"] == run, name
            assert baselines[f"margin_over_{run}"] == pytest.approx(metrics[metric] - baselines[run][metric], abs=1e-6)
        assert baselines["verdict"].startswith(("above", "no better"))
        assert baselines["verdict"] == verdict(baselines, TaskType(manifest["task_type"])), name  # as written today
        caveat = f"the validation split also {metrics['role']}:" in baselines["verdict"]
        assert baselines["role"] == metrics["role"] and caveat == bool(optimistic(metrics["role"])), name
        data = manifest["training"]["data"]
        row = recorded.get(manifest["task"])
        whole_file = data["train_examples_in_file"] == data["train_examples"] - sum(data.get("document_window_examples", {}).values())
        if row and whole_file and manifest["training"]["settings"].get("seed", 0) == 0:  # baselines.json's seed
            assert (baselines["majority"][metric], baselines[linear][metric]) == pytest.approx(
                (row["majority"], row["linear"]), abs=1e-9), name
        checked += 1
    assert checked >= 15  # every trained module of both tiers


def test_the_shipped_comparison_is_what_the_baselines_score_again(tmp_path, monkeypatch):
    """bench/quality.py's write_module_baselines, run afresh (empty cache) on a copy of a shipped module
    without its comparison, then write_margin_intervals (the module scored again on its validation
    rows), write the comparison the module ships with (RTE: seconds to train)."""
    import importlib.util
    import json
    import shutil
    from pathlib import Path

    if not preset_spec(PRESETS["rte"], "validation").path.is_file():
        pytest.skip(f"shared data not found at {default_data_dir()}")
    repo = Path(__file__).resolve().parents[1]
    shipped = json.loads((repo / "modules_store/entailment/1/manifest.json").read_text())
    shutil.copytree(repo / "modules_store/entailment/1", tmp_path / "store/entailment/1")
    bare = {**shipped, "metrics": {k: v for k, v in shipped["metrics"].items() if k not in ("role", "baselines")}}
    (tmp_path / "store/entailment/1/manifest.json").write_text(json.dumps(bare, indent=2) + "\n")
    monkeypatch.setenv("TMOD_CACHE_DIR", str(tmp_path / "cache"))
    spec = importlib.util.spec_from_file_location("bench_quality", repo / "bench/quality.py")
    quality = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quality)
    quality.write_module_baselines(tmp_path / "store")
    quality.write_margin_intervals(tmp_path / "store")
    written = json.loads((tmp_path / "store/entailment/1/manifest.json").read_text())
    assert {**written, "metrics": {}} == {**shipped, "metrics": {}}  # nothing but the metrics touched
    ours, theirs = written["metrics"]["baselines"], shipped["metrics"]["baselines"]
    # trained with --select last: its validation chose nothing, as the shipped manifest says
    assert written["metrics"]["role"] == shipped["metrics"]["role"] == "chose nothing (the run kept its last epoch)"
    assert ours.keys() == theirs.keys() and "the validation split also" not in ours["verdict"]
    for run in ("majority", "tfidf_logreg"):  # within one of 277 rows: another CPU's float sums may flip a tie
        assert ours[run]["accuracy"] == pytest.approx(theirs[run]["accuracy"], abs=1.01 / 277)
        # the same draws of the same rows: a flipped tie moves an end by a row or two
        assert ours[f"margin_over_{run}_interval"] == pytest.approx(theirs[f"margin_over_{run}_interval"], abs=2.01 / 277)
    assert any((tmp_path / "cache/baselines").iterdir())  # trained here, not read from an earlier run's cache


def test_intervals_are_not_written_beside_scores_that_cannot_be_measured_again(tmp_path, monkeypatch, capsys):
    """write_margin_intervals scores a shipped module and fits its baselines again for the answers the
    intervals draw: where its recorded linear score is not what it scores again (here moved by 0.01),
    the intervals would be of other answers than the recorded margin's, so the module is left as it is,
    and said; where it is, the recorded scores stay and only the intervals and the verdict are added."""
    import importlib.util
    import json
    import shutil
    from pathlib import Path

    if not preset_spec(PRESETS["rte"], "validation").path.is_file():
        pytest.skip(f"shared data not found at {default_data_dir()}")
    repo = Path(__file__).resolve().parents[1]
    shipped = json.loads((repo / "modules_store/entailment/1/manifest.json").read_text())
    earlier = {k: v for k, v in shipped["metrics"]["baselines"].items() if not k.startswith("interval")
               and not k.endswith("_interval")}
    moved = {**earlier, "tfidf_logreg": {**earlier["tfidf_logreg"], "accuracy": earlier["tfidf_logreg"]["accuracy"] + 0.01}}
    for version, baselines in (("1", moved), ("2", earlier)):
        shutil.copytree(repo / "modules_store/entailment/1", tmp_path / f"store/entailment/{version}")
        written = {**shipped, "version": version, "metrics": {**shipped["metrics"], "baselines": baselines}}
        (tmp_path / f"store/entailment/{version}/manifest.json").write_text(json.dumps(written, indent=2) + "\n")
    monkeypatch.setenv("TMOD_CACHE_DIR", str(tmp_path / "cache"))
    spec = importlib.util.spec_from_file_location("bench_quality", repo / "bench/quality.py")
    quality = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quality)
    quality.write_margin_intervals(tmp_path / "store")
    said = capsys.readouterr().out
    assert "entailment/1: left as it is: scored here (again, recorded)" in said
    assert json.loads((tmp_path / "store/entailment/1/manifest.json").read_text())["metrics"]["baselines"] == moved
    again = json.loads((tmp_path / "store/entailment/2/manifest.json").read_text())["metrics"]["baselines"]
    assert again["tfidf_logreg"] == earlier["tfidf_logreg"] and again["majority"] == earlier["majority"]
    assert again["margin_over_majority_interval"][0] <= 0  # 277 rows: within the noise, said in the verdict
    assert f"entailment/2: {again['verdict']}" in said and "within the noise of these 277 rows" in again["verdict"]


def test_tfidf_logreg_on_a_toy_file_whose_words_each_appear_once():
    """A user's first try, a dozen rows: no term is in two texts, so the usual features (terms in two
    texts or more) are none; every term is used instead (it was a traceback after the head trained)."""
    texts = ["love it", "hate that", "great film", "awful plot", "wonderful cast", "terrible acting",
             "superb music", "boring scenes"]
    labels = ["pos", "neg"] * 4
    scores = tfidf_logreg(texts, labels, ["lovely ending", "weak script"], ["pos", "neg"], labels=["neg", "pos"])
    assert scores["baseline"] == "tfidf_logreg" and scores["examples"] == 2
    multi = tfidf_logreg(texts, [(label,) for label in labels], ["lovely ending"], [("pos",)], multi_label=True)
    assert multi["examples"] == 1


def test_a_text_answered_wrong_many_times_is_listed_once_with_its_count(train_backbone):
    """The most confidently wrong examples listed one text the split held six times six times (a file of
    repeated rows filled report.md's table with it); now once, with its count, and other texts after it."""
    import numpy as np

    from modules_store import TaskType
    from training.assess import assess
    from training.data.examples import LabelledData, SequenceExample
    from training.states import Split

    examples = [SequenceExample("the same words", "neg")] * 6 + [SequenceExample(f"other words {i}", "pos")
                                                                 for i in range(4)]
    train = LabelledData(TaskType.sequence_classification, examples * 2, "train")
    evaluated = Split(LabelledData(TaskType.sequence_classification, examples, "validation"), ["neg", "pos"],
                      train_backbone)
    probabilities = [np.array(p) for p in [[0.1, 0.9]] * 6 + [[0.8, 0.2], [0.7, 0.3], [0.6, 0.4], [0.3, 0.7]]]
    head = {"split": "validation", "accuracy": 0.0, "examples": 10}
    worst = assess(train, evaluated, probabilities, head, "accuracy")["worst"]
    assert [(w["text"], w["rows"]) for w in worst] == [("the same words", 6), ("other words 0", 1), ("other words 1", 1),
                                                       ("other words 2", 1)]  # "other words 3" answers pos, right
    assert worst[0]["score"] == 0.9 and worst[0]["predicted"] == "pos"


def test_a_margin_these_rows_cannot_tell_from_noise_is_not_called_a_win(train_backbone):
    """On RTE's 249 held-out rows a head 0.028 over the linear model (and 0.052 over the majority
    answer) read "above both baselines". Now each margin carries its paired bootstrap interval, and
    one that holds 0 is said to be within the noise; a head clearly better still reads above both,
    with its intervals. The manifest keeps the intervals, not the baselines' per-row answers."""
    import numpy as np

    from modules_store import TaskType
    from training.assess import assess
    from training.data.examples import LabelledData
    from training.states import Split

    train, evaluation, labels = _splits("sst2", 1500, 120)
    [linear] = tfidf_logreg_scores([e.text for e in train], [e.label for e in train],
                                   [([e.text for e in evaluation], [e.label for e in evaluation])], labels=labels)
    gold = [e.label for e in evaluation]
    wrong = [r for r, answer in enumerate(linear["answers"]) if answer != gold[r]]
    assert len(wrong) > 10

    def run(answers):
        probabilities = [np.eye(len(labels))[labels.index(a)] * 0.8 + 0.1 for a in answers]
        head = {"split": "test", "accuracy": sum(a == g for a, g in zip(answers, gold)) / len(gold)}
        evaluated = Split(LabelledData(TaskType.sequence_classification, evaluation, "test"), labels, train_backbone)
        return assess(LabelledData(TaskType.sequence_classification, train, "train"), evaluated, probabilities,
                      head, "accuracy")["baselines"]

    close = run([gold[r] if r in wrong[:2] else a for r, a in enumerate(linear["answers"])])  # 2 rows better
    assert close["margin_over_tfidf_logreg"] == pytest.approx(2 / len(gold), abs=1e-6)
    low, high = close["margin_over_tfidf_logreg_interval"]
    assert low <= 0 < close["margin_over_tfidf_logreg"] <= high
    assert "within the noise of these 120 rows" in close["verdict"] and "above both" not in close["verdict"]
    assert "not shown better than the linear model" in close["verdict"]
    clear = run(gold)  # right on every row
    assert clear["margin_over_tfidf_logreg_interval"][0] > 0 and clear["margin_over_majority_interval"][0] > 0
    assert clear["verdict"].startswith("above both baselines on the test split")
    assert "95% paired bootstrap intervals of the margins over these 120 rows" in clear["verdict"]
    assert clear["intervals"].startswith("95% paired bootstrap intervals of the margins: 1000 draws of these 120 rows")
    assert "answers" not in clear["tfidf_logreg"] and "answers" not in clear["majority"]
