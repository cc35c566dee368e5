"""tmod-train layermix / eval end to end on a tiny random backbone and tiny data files."""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from modules_store import ModuleStore
import server
from server.engine import Engine
from server.heads.layermix import LayerMixConfig, LayerMixHead
from server.heads.layermix.layer import cutoff_weights
from server.modules import load_module, save_module
from training import report as report_module
from training.cli import build_parser, main, settings_from_args
from training.data.files import UsageError
from training.data.tables import read_table
from training.metrics import entity_scores
from training.settings import TrainSettings, parse_label_map, parse_layers
from training.states import CachedStates, RecomputedStates, Split
from training.splits import resolve_data
from training.trainer import add_document_windows, train

POSITIVE = ["good", "great", "lovely", "fine", "superb"]
NEGATIVE = ["bad", "awful", "dull", "poor", "boring"]
FILLER = ["the", "film", "was", "really", "a", "plot", "and", "acting", "quite", "story"]


def write_sentiment(path, n, seed):
    rng = random.Random(seed)
    lines = ["sentence\tlabel"]
    for i in range(n):
        label = i % 2
        words = rng.sample(FILLER, 4) + [rng.choice(POSITIVE if label else NEGATIVE)]
        rng.shuffle(words)
        lines.append(" ".join(words) + ' "quoted"\t' + str(label))  # quotes: TSV has no quoting
    path.write_text("\n".join(lines) + "\n")
    return path


PEOPLE, PLACES = ["Alice", "Bob", "Carol", "Dave"], ["Paris", "Berlin", "Rome", "Oslo"]


def write_conll(path, n, seed):
    rng = random.Random(seed)
    lines = ["-DOCSTART- -X- -X- O", ""]
    for _ in range(n):
        sentence = [(rng.choice(PEOPLE), "B-PER"), ("went", "O"), ("to", "O"), (rng.choice(PLACES), "B-LOC")]
        if rng.random() < 0.5:
            sentence += [("with", "O"), (rng.choice(PEOPLE), "B-PER"), ("Smith", "I-PER")]
        lines += [f"{w} X X {t}" for w, t in sentence + [(".", "O")]] + [""]
    path.write_text("\n".join(lines))
    return path


@pytest.fixture(scope="module")
def sentiment_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("sentiment")
    return write_sentiment(root / "train.tsv", 48, 0), write_sentiment(root / "validation.tsv", 24, 1)


@pytest.fixture(scope="module")
def sentiment_run(tmp_path_factory, sentiment_files, train_backbone_dir):
    """One CLI training run, shared by the tests that inspect its outputs."""
    run = tmp_path_factory.mktemp("sentiment_run")
    config = run / "config.yaml"
    config.write_text("epochs: 6\nlr: 0.01\nalpha: 4\nbatch_size: 8\nproject_dim: 16\n")
    train_file, validation_file = sentiment_files
    argv = ["layermix", "--config", str(config), "--train", str(train_file), "--validation", str(validation_file),
            "--text-column", "sentence", "--label-column", "label", "--label-map", "0=negative,1=positive",
            "--labels", "negative,positive", "--backbone", str(train_backbone_dir), "--task", "sentiment",
            "--store", str(run / "store"), "--report-dir", str(run / "report"), "--alpha", "2",
            "--patience", "10", "--no-progress"]
    assert main(argv) == 0
    return run, argv


def test_training_lowers_the_loss_and_writes_a_loadable_artifact(sentiment_run, train_backbone):
    run, _ = sentiment_run
    module = load_module(ModuleStore(run / "store"), "sentiment", "1", train_backbone)
    manifest = module.manifest
    history = manifest.training["history"]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert manifest.labels == ["negative", "positive"]
    assert manifest.metrics["split"] == "validation" and manifest.metrics["examples"] == 24
    assert manifest.metrics["metric"] == "accuracy"
    assert manifest.training["data"]["train_examples"] == 48
    assert manifest.description.endswith("trained on train.tsv")  # served by /v1/tasks: no path of this machine
    report = run / "report"
    summary = json.loads((report / "metrics.json").read_text())
    assert summary["validation"]["accuracy"] == manifest.metrics["accuracy"]
    for png in ("layer_weights.png", "curves.png"):
        assert (report / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(history[0]["layer_weights"]) == len(summary["layer_weights"])  # learnt, epoch by epoch
    assert "how much of each it learnt: layer_weights.png" in (report / "report.md").read_text()


def test_manifest_records_command_and_settings_with_cli_over_config(sentiment_run, train_backbone):
    run, argv = sentiment_run
    training = ModuleStore(run / "store").read_manifest("sentiment").training
    assert training["command"].startswith("tmod-train layermix --config ")
    assert training["config_file"].endswith("config.yaml")
    settings = training["settings"]
    assert settings["alpha"] == 2.0  # command line beats the config file's 4
    assert settings["epochs"] == 6 and settings["lr"] == 0.01 and settings["project_dim"] == 16  # from the file
    assert settings["cutoff"] == 5e-3  # task-type default for an unset knob
    assert settings["label_map"] == {"0": "negative", "1": "positive"}


def test_eval_rescores_the_stored_module_through_the_engine(sentiment_run, sentiment_files, train_backbone_dir,
                                                             tmp_path, capsys):
    run, _ = sentiment_run
    out = tmp_path / "eval.json"
    assert main(["eval", "--store", str(run / "store"), "--task", "sentiment", "--file", str(sentiment_files[1]),
                 "--text-column", "sentence", "--label-column", "label", "--label-map", "0=negative,1=positive",
                 "--backbone", str(train_backbone_dir), "--output", str(out), "--no-progress"]) == 0
    result = json.loads(out.read_text())
    manifest = ModuleStore(run / "store").read_manifest("sentiment")
    for key in ("accuracy", "f1", "mcc", "examples"):
        assert result["metrics"][key] == pytest.approx(manifest.metrics[key])
    # no decision threshold was chosen for this module: the role does not say one was
    assert result["file_role"] == "validation: this file chose the epoch, so this number is optimistic"
    err = capsys.readouterr().err
    assert f"{sentiment_files[1]}: validation: " in err
    # beside the simplest answer on the same rows: the file's most frequent label for every row
    labels = [line.rsplit("\t", 1)[1] for line in sentiment_files[1].read_text().splitlines()[1:]]
    share = max(labels.count("0"), labels.count("1")) / len(labels)
    baseline = result["baseline"]
    assert baseline["metric"] == manifest.metrics["metric"] == "accuracy" and baseline["head"] == result["metrics"]["accuracy"]
    assert baseline["majority_in_file"] == pytest.approx(share) and baseline["margin"] == pytest.approx(
        result["metrics"]["accuracy"] - share, abs=1e-6)  # to 6 places
    # TASK/VERSION, as tmod-serve --tasks names a module: it was "no task 'sentiment/1' in the store"
    by_name = tmp_path / "by_name.json"
    assert main(["eval", "--store", str(run / "store"), "--task", f"sentiment/{manifest.version}", "--file",
                 str(sentiment_files[1]), "--text-column", "sentence", "--label-column", "label", "--label-map",
                 "0=negative,1=positive", "--backbone", str(train_backbone_dir), "--output", str(by_name),
                 "--no-progress"]) == 0
    assert json.loads(by_name.read_text())["metrics"] == result["metrics"]
    capsys.readouterr()
    assert f"accuracy {result['metrics']['accuracy']:.4f} against {share:.4f} for every row answered with the file's " \
        "most frequent label" in err
    # and the linear model trained on the module's training rows, scored on the same rows
    from training.baselines import tfidf_logreg
    named = {"0": "negative", "1": "positive"}
    rows = [[line.rsplit("\t", 1) for line in f.read_text().splitlines()[1:]] for f in sentiment_files]
    alone = tfidf_logreg([t for t, _ in rows[0]], [named[y] for _, y in rows[0]], [t for t, _ in rows[1]],
                         [named[y] for _, y in rows[1]])
    interval = baseline["linear"].pop("margin_interval")  # paired bootstrap over the file's rows
    assert baseline["linear"] == {"model": "tfidf_logreg", "accuracy": pytest.approx(alone["accuracy"]),
                                  "margin": pytest.approx(result["metrics"]["accuracy"] - alone["accuracy"], abs=1e-6),
                                  "trained_on": f"the module's {len(rows[0])} training rows"}
    assert f", and {alone['accuracy']:.4f} for tfidf_logreg trained on its training rows" in err
    assert interval[0] <= baseline["linear"]["margin"] <= interval[1]
    assert baseline["margin_interval"][0] <= baseline["margin"] <= baseline["margin_interval"][1]
    assert f"95% paired bootstrap interval {interval[0]:+.4f} to {interval[1]:+.4f}" in err
    # 24 rows can hardly tell a tiny head from a bag of words; an interval wholly below 0 can
    assert (f"{interval[1]:+.4f}: within the noise of these 24 rows" in err) == (interval[0] <= 0 <= interval[1])
    # 24 rows: each 4% of them, too few to rank the head against the baseline, said in the JSON and on stderr
    few = "scored on 24 rows only, each 4% of them: too few for these numbers to rank the head against the baselines"
    assert baseline["too_few_rows"] == few and f"; {few}" in err
    # the training file: said to be no held-out score, in the JSON and on stderr
    assert main(["eval", "--store", str(run / "store"), "--task", "sentiment", "--file", str(sentiment_files[0]),
                 "--text-column", "sentence", "--label-column", "label", "--label-map", "0=negative,1=positive",
                 "--backbone", str(train_backbone_dir), "--no-progress"]) == 0
    printed = capsys.readouterr()
    assert json.loads(printed.out)["file_role"].startswith("training: the head was trained on this file")
    assert "not held out" in printed.err
    # without --label-map: the file's class ids are named as the training run named its own (they were
    # refused: "class ids need their names: --label-map 0=NAME,1=NAME,...")
    assert main(["eval", "--store", str(run / "store"), "--task", "sentiment", "--file", str(sentiment_files[1]),
                 "--text-column", "sentence", "--label-column", "label", "--backbone", str(train_backbone_dir),
                 "--no-progress"]) == 0
    printed = capsys.readouterr()
    assert json.loads(printed.out)["metrics"]["accuracy"] == pytest.approx(manifest.metrics["accuracy"])
    assert f"{sentiment_files[1]}: class ids named by the --label-map of sentiment's training run" in printed.err
    # labels spelt otherwise than the head's: refused, with the --label-map that names them as it does
    lines = sentiment_files[1].read_text().splitlines()
    spelt = tmp_path / "spelt.tsv"
    spelt.write_text("\n".join([lines[0], *(line[:-1] + ("pos" if line.endswith("1") else "neg") for line in lines[1:])]))
    args = ["eval", "--store", str(run / "store"), "--task", "sentiment", "--file", str(spelt), "--text-column",
            "sentence", "--label-column", "label", "--backbone", str(train_backbone_dir), "--no-progress"]
    assert main(args) == 2
    assert capsys.readouterr().err.strip().endswith(
        "label(s) ['neg', 'pos'] are not among sentiment's labels ['negative', 'positive']; name them as the head "
        "does with --label-map neg=negative,pos=positive")
    assert main([*args, "--label-map", "neg=negative,pos=positive"]) == 0
    assert json.loads(capsys.readouterr().out)["metrics"]["accuracy"] == pytest.approx(manifest.metrics["accuracy"])


def test_a_label_map_is_guessed_only_where_each_label_has_one_match():
    from training.eval_command import label_map_guess

    assert label_map_guess(["NEG", "positive"], ["negative", "positive"]) == "NEG=negative,positive=positive"
    assert label_map_guess(["p", "negative"], ["pos", "pro", "negative"]) == "FILE_LABEL=HEAD_LABEL,..."
    assert label_map_guess(["joy"], ["anger", "sadness"]) == "FILE_LABEL=HEAD_LABEL,..."


def test_a_state_cache_over_the_free_memory_is_one_line_not_a_killed_run(sentiment_files, train_backbone_dir, tmp_path,
                                                                        capsys, monkeypatch):
    """A big file's states (a 500,000-review file: ~270 GB in fp16 on MiniLM) were allocated anyway, and
    the kernel killed the run with no word; --states recompute trains without the cache."""
    import training.trainer

    monkeypatch.setattr(training.trainer, "free_memory", lambda: 100_000)  # 100 kB free
    train_file, validation_file = sentiment_files
    argv = ["layermix", "--train", str(train_file), "--validation", str(validation_file), "--text-column", "sentence",
            "--label-column", "label", "--label-map", "0=negative,1=positive", "--backbone", str(train_backbone_dir),
            "--store", str(tmp_path / "store"), "--run-dir", str(tmp_path / "run"), "--epochs", "1", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("tmod-train layermix: error: the backbone states of 48 training and 24 validation examples (")
    assert err.endswith("GB of memory and 0.0 GB is free: give --states recompute (no cache: the backbone reads the "
                        "data every epoch), --layers with fewer states, or --max-train N")
    assert not (tmp_path / "store").exists()
    assert main([*argv, "--states", "recompute"]) == 0


def test_ctrl_c_in_a_later_epoch_keeps_the_best_so_far_and_finishes(sentiment_files, train_backbone_dir, tmp_path,
                                                                     capsys, monkeypatch):
    """Ctrl-C in epoch 3 of a long run: epochs 1-2 were a result; it was a traceback and nothing saved.
    Ctrl-C before any epoch is kept: one line, exit status 130."""
    import training.trainer

    epochs_run = []
    real_run_epoch = training.trainer.run_epoch

    def interrupted_in_epoch_3(*args, **kwargs):
        epochs_run.append(kwargs["desc"])
        if len(epochs_run) == 3:
            raise KeyboardInterrupt
        return real_run_epoch(*args, **kwargs)

    monkeypatch.setattr(training.trainer, "run_epoch", interrupted_in_epoch_3)
    train_file, validation_file = sentiment_files
    argv = ["layermix", "--train", str(train_file), "--validation", str(validation_file), "--text-column", "sentence",
            "--label-column", "label", "--label-map", "0=negative,1=positive", "--backbone", str(train_backbone_dir),
            "--store", str(tmp_path / "store"), "--run-dir", str(tmp_path / "run"), "--epochs", "30", "--lr", "0.01",
            "--task", "sentiment", "--no-progress"]
    assert main(argv) == 0
    manifest = ModuleStore(tmp_path / "store").read_manifest("sentiment")
    history = manifest.training["history"]
    assert [h["epoch"] for h in history] == [1, 2] and history[-1]["stopped_by"] == "interrupt"
    assert manifest.training["best_epoch"] in (1, 2)
    assert "interrupted in epoch 3/30: keeping epoch " in capsys.readouterr().err
    assert "of 2 run; the run was stopped by Ctrl-C in epoch 3" in (tmp_path / "run" / "report" / "report.md").read_text()
    epochs_run.clear()
    epochs_run.extend(["", ""])  # the next call is the third: Ctrl-C in the first epoch
    assert main([*argv, "--version", "2"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "tmod-train layermix: interrupted before the run finished"
    assert ModuleStore(tmp_path / "store").versions("sentiment") == ["1"]


def test_an_early_stop_by_patience_is_said_and_reported(sentiment_files, train_backbone_dir, tmp_path, capsys,
                                                       monkeypatch):
    """--epochs 10 with validation worse after epoch 1 ran 3 epochs (--patience 2) and said nothing of why:
    the report's 'kept epoch 1 of 3 run' left a user wondering where the other 7 went."""
    import training.trainer

    real_validate = training.trainer.validate
    epochs = []

    def worse_after_the_first(*args, **kwargs):
        loss, metrics = real_validate(*args, **kwargs)
        epochs.append(len(epochs) + 1)
        return 1.0 + len(epochs), {**metrics, "accuracy": 1.0 / (1 + len(epochs))}

    monkeypatch.setattr(training.trainer, "validate", worse_after_the_first)
    train_file, validation_file = sentiment_files
    argv = ["layermix", "--train", str(train_file), "--validation", str(validation_file), "--text-column", "sentence",
            "--label-column", "label", "--label-map", "0=negative,1=positive", "--backbone", str(train_backbone_dir),
            "--store", str(tmp_path / "store"), "--run-dir", str(tmp_path / "run"), "--epochs", "10",
            "--patience", "2", "--task", "sentiment", "--no-progress"]
    assert main(argv) == 0
    history = ModuleStore(tmp_path / "store").read_manifest("sentiment").training["history"]
    assert [h.get("stopped_by") for h in history] == [None, None, "patience"]
    assert ("stopping after epoch 3/10: 2 epochs in a row without a better validation result (--patience 2); "
            "keeping epoch 1") in capsys.readouterr().err
    assert ("kept epoch 1 of 3 run; the run stopped early: 2 epochs in a row without a better validation accuracy "
            "(--patience 2)") in (tmp_path / "run" / "report" / "report.md").read_text()


def test_eval_writes_the_answer_to_every_row_it_scored(sentiment_run, sentiment_files, train_backbone_dir, tmp_path,
                                                       capsys):
    """eval gave one number per file: which rows a module gets wrong (the first thing a user asks of a
    score) needed a client of one's own. --predictions writes every scored row's answer, the same
    answers the metrics counted."""
    run, _ = sentiment_run
    argv = ["eval", "--store", str(run / "store"), "--task", "sentiment", "--file", str(sentiment_files[1]),
            "--text-column", "sentence", "--label-column", "label", "--label-map", "0=negative,1=positive",
            "--backbone", str(train_backbone_dir), "--no-progress"]
    assert main([*argv, "--predictions", str(tmp_path / "out" / "rows.jsonl")]) == 0
    accuracy = json.loads(capsys.readouterr().out)["metrics"]["accuracy"]
    rows = [json.loads(line) for line in (tmp_path / "out" / "rows.jsonl").read_text().splitlines()]
    file_rows = [line.rsplit("\t", 1) for line in sentiment_files[1].read_text().splitlines()[1:]]
    assert [(r["text"], r["gold"]) for r in rows] == [(t, {"0": "negative", "1": "positive"}[l]) for t, l in file_rows]
    for r in rows:
        assert set(r["probabilities"]) == {"negative", "positive"}
        assert sum(r["probabilities"].values()) == pytest.approx(1.0, abs=1e-5)
        assert r["predicted"] == max(r["probabilities"], key=r["probabilities"].get)
    assert sum(r["predicted"] == r["gold"] for r in rows) / len(rows) == pytest.approx(accuracy)
    assert main([*argv, "--predictions", str(tmp_path)]) == 2  # a folder: said before the scoring
    assert capsys.readouterr().err.strip() == (f"tmod-train eval: error: --predictions {tmp_path}: a folder; give a "
                                               f"file's name, e.g. {tmp_path / 'predictions.jsonl'}")


def test_eval_split_scores_the_part_the_run_carved_from_the_file(sentiment_run, sentiment_files, train_backbone_dir,
                                                                 tmp_path, capsys):
    """A head trained on one file carved by --split could be scored on that file only whole ("not held out"):
    --split test scores the rows the run held out again (its manifest's test numbers), --split validation
    the rows that chose the epoch; a file the run did not carve is refused in one line."""
    train_file, validation_file = sentiment_files
    store = tmp_path / "store"
    assert main(["layermix", "--train", str(train_file), "--split", "0.25,0.25", "--label-column", "label",
                 "--text-column", "sentence", "--backbone", str(train_backbone_dir), "--task", "s", "--epochs", "2",
                 "--store", str(store), "--run-dir", str(tmp_path / "run"), "--no-progress"]) == 0
    manifest = ModuleStore(store).read_manifest("s")
    summary = json.loads(capsys.readouterr().out)  # each split's number beside the baselines on its own rows
    assert summary["baselines"]["split"] == "test" and summary["validation_baselines"]["split"] == "validation"
    assert "verdict" not in summary["validation_baselines"]  # the test split's is the verdict
    assert summary["validation_baselines"]["tfidf_logreg"] == manifest.metrics["validation_baselines"]["tfidf_logreg"][
        "accuracy"]
    scored = {}
    for part in ("test", "validation"):
        assert main(["eval", "--store", str(store), "--task", "s", "--file", str(train_file), "--split", part,
                     "--backbone", str(train_backbone_dir), "--no-progress"]) == 0
        scored[part] = json.loads(capsys.readouterr().out)
    assert main(["eval", "--store", str(store), "--task", "s", "--file", str(train_file), "--backbone",
                 str(train_backbone_dir), "--no-progress"]) == 0  # the whole file: says how to score its test rows
    assert json.loads(capsys.readouterr().out)["file_role"].endswith(
        "not held out (--split test scores its test rows)")
    test, validation = manifest.metrics["test"], manifest.metrics
    assert (scored["test"]["metrics"]["examples"], scored["validation"]["metrics"]["examples"]) == (
        test["examples"], validation["examples"])
    assert scored["test"]["metrics"]["accuracy"] == pytest.approx(test["accuracy"], abs=1e-6)
    assert scored["validation"]["metrics"]["accuracy"] == pytest.approx(validation["accuracy"], abs=1e-6)
    assert scored["test"]["file_role"].startswith("test: the part of this file the run carved for test")
    assert scored["validation"]["file_role"] == ("validation: the part of this file the run carved for validation; it "
                                                 "chose the epoch, so this number is optimistic")
    assert main(["eval", "--store", str(store), "--task", "s", "--file", str(validation_file), "--split", "test",
                 "--backbone", str(train_backbone_dir), "--no-progress"]) == 2
    assert f"s/1's run carved its parts from {train_file}, not from {validation_file}" in capsys.readouterr().err
    run, _ = sentiment_run  # trained with --validation FILE: nothing carved
    assert main(["eval", "--store", str(run / "store"), "--task", "sentiment", "--file", str(train_file), "--split",
                 "test", "--backbone", str(train_backbone_dir), "--no-progress"]) == 2
    assert "sentiment/1's run carved none (it was given --validation): leave out --split" in capsys.readouterr().err
    assert main(["eval", "--store", str(run / "store"), "--task", "sentiment", "--dataset", "sst2", "--split",
                 "test"]) == 2
    assert "--split test: the sst2 preset has train and validation splits" in capsys.readouterr().err


def test_eval_reads_a_file_as_the_training_run_did_and_refuses_a_pair_mismatch(sentiment_run, sentiment_files,
                                                                                 train_backbone_dir, capsys):
    """No column options: the training run's (sentence, label) are taken, and said. A pair task given
    single texts, or a single-text task given pairs, is refused: the pair task was scored on single
    texts without a word (RTE: 0.505 against 0.689 read as pairs)."""
    run, _ = sentiment_run
    assert main(["eval", "--store", str(run / "store"), "--task", "sentiment", "--file", str(sentiment_files[1]),
                 "--backbone", str(train_backbone_dir), "--no-progress"]) == 0
    printed = capsys.readouterr()
    manifest = ModuleStore(run / "store").read_manifest("sentiment")
    assert json.loads(printed.out)["metrics"]["accuracy"] == pytest.approx(manifest.metrics["accuracy"])
    assert (f"{sentiment_files[1]}: read as sentiment's training run read its files: --text-column sentence "
            "--label-column label") in printed.err
    assert main(["eval", "--store", str(run / "store"), "--task", "sentiment", "--file", str(sentiment_files[1]),
                 "--pair-column", "sentence", "--backbone", str(train_backbone_dir), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().endswith(f"{sentiment_files[1]}: sentiment reads single texts; leave out "
                                                    "--pair-column")
    # a layout the file's name does not say (a table named .txt, trained with --format tsv): the format too
    import argparse

    from training.eval_command import columns_as_in_training

    txt_run = manifest.model_copy(update={"training": {"settings": {"train": "reviews.txt", "format": "tsv"}}})
    args = argparse.Namespace(file="new.txt", format=None, text_column=None, pair_column=None, label_column=None,
                              header=None)
    columns_as_in_training(args, txt_run)
    assert args.format == "tsv" and "--format tsv" in capsys.readouterr().err
    args.file, args.format = "new.csv", None  # another kind of name: its own format
    columns_as_in_training(args, txt_run)
    assert args.format is None
    # the shipped entailment module (RTE, pair pooling) on single texts
    assert main(["eval", "--task", "entailment", "--version", "1", "--file", str(sentiment_files[1]), "--text-column",
                 "sentence", "--label-column", "label", "--label-map", "0=entailment,1=not_entailment",
                 "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().endswith("entailment compares a text with a text pair; give --pair-column")


def test_eval_names_class_ids_by_their_place_in_the_training_labels(sentiment_run, sentiment_files):
    from training.eval_command import named_as_in_training
    from training.data.presets import file_spec

    run, _ = sentiment_run
    manifest = ModuleStore(run / "store").read_manifest("sentiment")
    spec = file_spec(sentiment_files[1], None, "sentence", "label")
    ids = spec.read()
    assert set(ids.labels_seen()) == {"0", "1"}
    by_place = manifest.model_copy(update={"training": {"settings": {"labels": ["positive", "negative"]}}})
    _, named = named_as_in_training(spec, ids, by_place)
    assert [ex.label for ex in named.examples] == [["positive", "negative"][int(ex.label)] for ex in ids.examples]
    untold = manifest.model_copy(update={"training": {"settings": {}}})  # the module's label order alone: not used
    assert named_as_in_training(spec, ids, untold)[1] is ids
    on_a_preset = manifest.model_copy(update={"training": {"settings": {"dataset": "sst2"}}})  # its 0=negative,1=positive
    _, named = named_as_in_training(spec, ids, on_a_preset)
    assert [ex.label for ex in named.examples] == [["negative", "positive"][int(ex.label)] for ex in ids.examples]


def test_token_task_with_casing_trains_and_loads(tmp_path, train_backbone, train_backbone_dir):
    train_file, validation_file = write_conll(tmp_path / "train.txt", 40, 0), write_conll(tmp_path / "val.txt", 12, 1)
    settings = TrainSettings(train=str(train_file), validation=str(validation_file), backbone=str(train_backbone_dir),
                             task="ner", store=str(tmp_path / "store"), report_dir=str(tmp_path / "report"),
                             casing=True, project_dim=16, ffn_dim=32, epochs=5, lr=0.01, batch_size=8,
                             alpha=4, patience=10, progress=False)
    result = train(settings, backbone=train_backbone)
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]
    module = load_module(ModuleStore(tmp_path / "store"), "ner", "1", train_backbone)
    assert module.head.config.casing
    assert module.manifest.labels == ["O", "B-LOC", "I-LOC", "B-PER", "I-PER"]
    assert {"precision", "recall", "f1", "per_type"} <= set(module.manifest.metrics)
    assert module.manifest.training["settings"]["lambda_entropy"] == 1e-3  # token-task default
    # where it fails, sentence by sentence (a sequence task's report lists its most confidently wrong rows)
    worst = result.assessment["worst_sentences"]  # the head's tags reached the assessment (they did not)
    assert all(row["missed"] or row["wrong"] for row in worst)
    counts = [len(row["missed"]) + len(row["wrong"]) for row in worst]
    assert counts == sorted(counts, reverse=True)
    section = "## Sentences with the most mistakes (validation split)" in (tmp_path / "report" / "report.md").read_text()
    assert section == bool(worst)
    # the margins' intervals draw sentences, each scored with the head's tags and the baseline's
    baselines = module.manifest.metrics["baselines"]
    for name in ("majority", "window_tagger"):
        low, high = baselines[f"margin_over_{name}_interval"]
        assert low <= baselines[f"margin_over_{name}"] <= high, name
    assert "1000 draws of these 12 sentences" in baselines["intervals"]
    # eval --predictions: each validation sentence's words, gold tags and one predicted tag a word, which
    # give the entity F1 the metrics give
    out = tmp_path / "rows.jsonl"
    assert main(["eval", "--store", str(tmp_path / "store"), "--task", "ner", "--file", str(validation_file),
                 "--backbone", str(train_backbone_dir), "--no-progress", "--predictions", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    written = [[line.split() for line in block.splitlines() if not line.startswith("-DOCSTART-")]
               for block in validation_file.read_text().split("\n\n")]
    written = [sentence for sentence in written if sentence]
    assert [(r["words"], r["gold"]) for r in rows] == [([w[0] for w in s], [w[-1] for w in s]) for s in written]
    assert all(len(r["predicted"]) == len(r["words"]) for r in rows)
    assert entity_scores([r["gold"] for r in rows], [r["predicted"] for r in rows])["f1"] == pytest.approx(
        module.manifest.metrics["f1"])


def test_worst_sentences_name_missed_and_wrong_entities_or_words():
    from training.assess import worst_sentences
    from training.data.examples import TokenExample

    examples = [TokenExample(["Peter", "Blackburn", "in", "Paris"], ["B-PER", "I-PER", "O", "B-LOC"]),
                TokenExample(["all", "right"], ["O", "O"]),
                TokenExample(["EU", "rejects"], ["B-ORG", "O"])]
    predicted = [["B-PER", "B-PER", "O", "B-LOC"], ["O", "O"], ["B-LOC", "O"]]
    assert worst_sentences(examples, predicted) == [
        {"text": "Peter Blackburn in Paris", "missed": ["PER Peter Blackburn"], "wrong": ["PER Peter", "PER Blackburn"]},
        {"text": "EU rejects", "missed": ["ORG EU"], "wrong": ["LOC EU"]}]
    pos = [TokenExample(["the", "dog", "runs"], ["DET", "NOUN", "VERB"])]
    assert worst_sentences(pos, [["DET", "VERB", "VERB"]], by_word=True) == [
        {"text": "the dog runs", "wrong": ["dog: NOUN -> VERB"]}]


def test_document_windows_add_the_training_documents_in_windows(tmp_path, train_backbone, train_backbone_dir):
    train_file, validation_file = write_conll(tmp_path / "train.txt", 40, 0), write_conll(tmp_path / "val.txt", 12, 1)
    settings = TrainSettings(train=str(train_file), validation=str(validation_file), backbone=str(train_backbone_dir),
                             task="ner", store=str(tmp_path / "store"), report_dir=str(tmp_path / "report"),
                             casing=True, project_dim=16, ffn_dim=32, epochs=1, batch_size=8, progress=False,
                             document_windows="64,24")
    result = train(settings, backbone=train_backbone)
    data = result.training["data"]
    added = data["document_window_examples"]
    assert added["64"] >= 4 and added["24"] > added["64"]  # one 40-sentence document, cut smaller by 24
    assert data["train_examples"] == 40 + added["64"] + added["24"]
    assert data["validation_examples"] == 12  # validation stays sentence by sentence
    table = write_sentiment(tmp_path / "s.tsv", 8, 0)
    with pytest.raises(ValueError, match="only token tasks"):
        train(TrainSettings(train=str(table), validation=str(table), text_column="sentence", label_column="label",
                            backbone=str(train_backbone_dir), document_windows=[64], progress=False,
                            store=str(tmp_path / "store2")), backbone=train_backbone)


def document_lines(documents: int, sentences: int) -> list[str]:
    """A CoNLL file's lines: `documents` documents of `sentences` four-word sentences each."""
    lines = []
    for d in range(documents):
        lines += ["-DOCSTART- -X- -X- O", ""]
        for k in range(sentences):
            lines += [f"Alice{d} X X B-PER", f"met{k} X X O", "Bob X X B-PER", ". X X O", ""]
    return lines


def test_max_train_with_document_windows_draws_whole_documents_so_windows_exist(tmp_path, train_backbone, capsys):
    """--max-train 800 of CoNLL-2003 drew 800 sentences scattered over its 946 documents, and a window holds
    training sentences only: --document-windows 128 added 2 windows, unsaid."""
    lines = document_lines(10, 6)
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(lines))
    settings = TrainSettings(train=str(path), split="0.2", max_train=20, document_windows=[64], progress=False)
    data = resolve_data(settings)
    documents = [ex.document for ex in data.train.examples]
    assert len(documents) == 20 and len(set(documents)) == 4  # three documents whole and 2 sentences of a fourth
    assert sorted(documents.count(d) for d in set(documents)) == [2, 6, 6, 6]
    assert [ex.file_offset for ex in data.train.examples] == sorted(ex.file_offset for ex in data.train.examples)
    assert resolve_data(settings).train.examples == data.train.examples  # seeded
    widened = add_document_windows(data.train, dict(data.provenance), train_backbone, [64])
    assert len(widened.examples) - 20 == 3  # each whole document in one window; the cut one's would hold others
    assert "--document-windows: 3 windows of 64 word pieces of the training documents, beside their 20 sentences" in \
        capsys.readouterr().err
    scattered = resolve_data(settings.model_copy(update={"document_windows": None})).train  # without windows: any rows
    assert len(scattered) == 20 and len({ex.document for ex in scattered.examples}) > 4


def test_split_keeps_a_conll_document_in_one_part_and_its_windows_hold_training_words_only(tmp_path, train_backbone,
                                                                                           capsys):
    """--split carved a CoNLL file sentence by sentence: a document's sentences (its names again and again)
    sat in training and validation, and --document-windows read the whole training file in windows,
    validation's sentences included, so validation scored what the head had learnt."""
    lines = document_lines(8, 5)
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(lines))
    settings = TrainSettings(train=str(path), split="0.25", progress=False)
    data = resolve_data(settings)
    assert {ex.document for ex in data.train.examples}.isdisjoint({ex.document for ex in data.validation.examples})
    assert len({ex.document for ex in data.validation.examples}) == 2 and len(data.validation) == 10
    assert data.provenance["split"]["units"] == "documents"
    widened = add_document_windows(data.train, dict(data.provenance), train_backbone, [64])
    windows = widened.examples[len(data.train):]
    held_out = {ex.file_offset + w for ex in data.validation.examples for w in range(len(ex.words))}
    assert len(windows) == 6  # each training document whole in one window; none of validation's
    assert not any(ex.file_offset + w in held_out for ex in windows for w in range(len(ex.words)))
    two = tmp_path / "two.txt"  # 2 documents: --split 0.1 gives validation none of them
    two.write_text("\n".join(lines[:54]))
    data = resolve_data(settings.model_copy(update={"train": str(two), "split": [0.1]}))
    assert data.provenance["split"]["units"] == "texts"
    assert f"{two}: its 2 documents are too few to give each part of --split 0.1 one" in capsys.readouterr().err


@pytest.mark.parametrize("pooling", ["mean", "pair"])
def test_single_layer_baseline_on_a_pair_task_recomputing_states(tmp_path, train_backbone, train_backbone_dir, pooling,
                                                                 capsys):
    rows = ["index\tsentence1\tsentence2\tlabel"] + [
        f"{i}\tthe cat sat on the mat {i}\t{'a cat sat' if i % 2 else 'no dog ran'}\t"
        f"{'entailment' if i % 2 else 'not_entailment'}" for i in range(24)
    ]
    path = tmp_path / "pairs.tsv"
    path.write_text("\n".join(rows) + "\n")
    settings = TrainSettings(train=str(path), validation=str(path), text_column="sentence1", pair_column="sentence2",
                             label_column="label", layers="2", backbone=str(train_backbone_dir), task="rte",
                             run_dir=str(tmp_path / "run"), project_dim=16, epochs=2, states="recompute",
                             pooling=pooling, progress=False)
    train(settings, backbone=train_backbone)
    manifest = ModuleStore(tmp_path / "run" / "store").read_manifest("rte")
    assert manifest.layers == [2] and manifest.config["layers"] == [2]
    assert manifest.config["pooling"] == pooling
    hint = "a pair task with its two texts pooled together: on RTE, held out, --pooling pair --no-attention"
    assert (hint in capsys.readouterr().err) == (pooling != "pair")  # the recipe measured on pairs, pointed at


def test_select_last_trains_every_epoch_and_keeps_the_last(tmp_path, train_backbone, train_backbone_dir):
    """--select last: no early stop (patience 1 would stop a flat run), no learning-rate cut, the
    last epoch's weights: validation decides nothing."""
    rows = ["index\tsentence1\tsentence2\tlabel"] + [
        f"{i}\tthe cat sat {i}\t{'a cat' if i % 2 else 'no dog'}\t{'entailment' if i % 2 else 'not_entailment'}"
        for i in range(16)]
    path = tmp_path / "pairs.tsv"
    path.write_text("\n".join(rows) + "\n")
    settings = TrainSettings(train=str(path), validation=str(path), text_column="sentence1", pair_column="sentence2",
                             label_column="label", layers="2", backbone=str(train_backbone_dir), task="rte",
                             run_dir=str(tmp_path / "run"), project_dim=16, epochs=4, patience=1, lr=1e-3,
                             lr_patience=0, select="last", states="recompute", progress=False)
    result = train(settings, backbone=train_backbone)
    assert len(result.history) == 4 and result.training["best_epoch"] == 4
    assert {h["lr"] for h in result.history} == {1e-3}
    assert result.layer_weights == {2: 1.0}
    assert (tmp_path / "run" / "report" / "metrics.json").is_file()


@pytest.mark.parametrize("select, epochs, none_below, role", [
    ("last", 2, None, "chose nothing (the run kept its last epoch)"),
    ("best", 1, None, "chose nothing (the run kept its last epoch)"),
    ("last", 2, 0.5, "chose nothing (the run kept its last epoch)"),
    ("best", 2, 0.5, "chose the epoch"),
    ("best", 1, "auto", "chose the none-of-these threshold"),
    ("best", 2, "auto", "chose the epoch and the none-of-these threshold")])
def test_what_validation_chose_is_said_as_it_was(sentiment_files, train_backbone, train_backbone_dir, tmp_path,
                                                capsys, select, epochs, none_below, role):
    """A run's validation number says what that split chose, one way in the manifest, report.md, the
    verdict and `eval` on that file: --select last or a single epoch chose no epoch, a --none-below P the
    user set chose no threshold (each was said as chosen: "optimistic" over a number that chose nothing),
    auto did."""
    train_file, validation_file = sentiment_files
    settings = TrainSettings(train=str(train_file), validation=str(validation_file), text_column="sentence",
                             label_column="label", backbone=str(train_backbone_dir), task="mood", layers="2",
                             run_dir=str(tmp_path / "run"), project_dim=16, epochs=epochs, select=select,
                             none_below=none_below, states="recompute", progress=False)
    result = train(settings, backbone=train_backbone)
    assert result.metrics["role"] == role
    optimistic = role != "chose nothing (the run kept its last epoch)"
    report = (tmp_path / "run" / "report" / "report.md").read_text()
    assert f"this split {role}{', so this number is optimistic' if optimistic else ''}; majority " in report
    verdict = result.metrics["baselines"]["verdict"]
    assert ("the validation split also " + role in verdict) == optimistic, verdict
    capsys.readouterr()
    assert main(["eval", "--store", str(tmp_path / "run" / "store"), "--task", "mood", "--file", str(validation_file),
                 "--text-column", "sentence", "--label-column", "label", "--backbone", str(train_backbone_dir),
                 "--no-progress"]) == 0
    said = json.loads(capsys.readouterr().out)["file_role"]
    assert said == f"validation: this file {role}{', so this number is optimistic' if optimistic else ''}"


@pytest.mark.parametrize("epochs", [2, 1])
def test_validation_rows_whose_text_was_trained_on_and_texts_labelled_two_ways_are_said(tmp_path, train_backbone, train_backbone_dir,
                                                                         capsys, epochs):
    """A validation (or test) file sharing texts with the training file scores the head on what it
    learnt, and a text labelled two ways in training teaches both: each said on stderr, in the
    manifest's data and in report.md, never silent. Test rows shared with validation matter only where
    validation chose something (not in a one-epoch run)."""
    train_file = write_sentiment(tmp_path / "train.tsv", 24, 0)
    rows = train_file.read_text().splitlines()
    validation_file = write_sentiment(tmp_path / "validation.tsv", 8, 1)
    validation_file.write_text(validation_file.read_text() + "\n".join(rows[1:4]) + "\n")  # 3 training rows again
    text, label = rows[5].rsplit("\t", 1)
    train_file.write_text(train_file.read_text() + f"{text}\t{1 - int(label)}\n")  # one text taught both labels
    rows = train_file.read_text().splitlines()
    test_file = write_sentiment(tmp_path / "test.tsv", 6, 2)
    test_file.write_text(test_file.read_text() + "\n".join(validation_file.read_text().splitlines()[1:3]) + "\n")
    settings = TrainSettings(train=str(train_file), validation=str(validation_file), test=str(test_file),
                             text_column="sentence", label_column="label", layers="2", backbone=str(train_backbone_dir),
                             task="sentiment", run_dir=str(tmp_path / "run"), project_dim=16, epochs=epochs,
                             patience=5, states="recompute", progress=False)
    result = train(settings, backbone=train_backbone)
    assert result.training["data"]["validation_rows_also_in_training"] == 3
    assert result.training["data"]["test_rows_also_in_validation"] == 2
    assert result.training["data"]["train_texts_labelled_two_ways"] == 1
    err = capsys.readouterr().err
    assert ("the validation split is not wholly unseen: 3 of its 11 rows hold a text the training rows hold too, "
            "which flatters the head; drop those rows" in err)
    assert "training texts labelled more than one way (the same text, different labels): 1; check them" in err
    shared = ("the test split is not wholly unseen: 2 of its 8 rows hold a text the validation rows hold too, and "
              "validation chose the epoch on them")
    assert (shared in err) == (epochs > 1)
    report = (tmp_path / "run" / "report" / "report.md").read_text()
    assert ("- the validation split is not wholly unseen: 3 of its 11 rows hold a text the training rows hold too, "
            "which flatters the head" in report)
    assert "- training texts labelled more than one way (the same text, different labels): 1" in report
    # the test number is read with what its rows are, wherever it is read: beside it, in the verdict, in eval
    seen = ("2 of its 8 rows hold a text the validation rows hold too, and validation chose the epoch on them, so "
            "this number is optimistic")
    test_line = next(line for line in report.splitlines() if line.startswith("- test accuracy"))
    assert (f"examples; never used to choose anything; not wholly unseen: {seen})" in test_line) == (epochs > 1)
    assert result.metrics["test"].get("rows_seen") == (seen if epochs > 1 else None)
    assert (f"the test split is not wholly unseen: {seen}" in result.metrics["baselines"]["verdict"]) == (epochs > 1)
    capsys.readouterr()
    assert main(["eval", "--store", str(tmp_path / "run" / "store"), "--task", "sentiment", "--file", str(test_file),
                 "--text-column", "sentence", "--label-column", "label", "--backbone", str(train_backbone_dir),
                 "--no-progress"]) == 0
    said = json.loads(capsys.readouterr().out)["file_role"]
    assert said == "test: scored once at the end of training; it chose nothing" + (f"; not wholly unseen: {seen}"
                                                                                  if epochs > 1 else "")


def test_a_test_file_sharing_training_texts_is_not_called_unseen(tmp_path, train_backbone, train_backbone_dir, capsys,
                                                                  monkeypatch):
    """Test rows the head was trained on flatter its test number: said beside it in report.md and in the
    verdict, not only on stderr before training. The linear baseline is fitted once for the test and the
    validation rows."""
    from training import baselines
    fits = []
    fit_on_tfidf = baselines.fit_on_tfidf
    monkeypatch.setattr(baselines, "fit_on_tfidf", lambda *args: fits.append(1) or fit_on_tfidf(*args))
    train_file = write_sentiment(tmp_path / "train.tsv", 24, 0)
    test_file = write_sentiment(tmp_path / "test.tsv", 6, 2)
    test_file.write_text(test_file.read_text() + "\n".join(train_file.read_text().splitlines()[1:4]) + "\n")
    settings = TrainSettings(train=str(train_file), validation=str(write_sentiment(tmp_path / "validation.tsv", 8, 1)),
                             test=str(test_file), text_column="sentence", label_column="label", layers="2",
                             backbone=str(train_backbone_dir), task="sentiment", run_dir=str(tmp_path / "run"),
                             project_dim=16, epochs=1, states="recompute", progress=False)
    result = train(settings, backbone=train_backbone)
    seen = "3 of its 9 rows hold a text the training rows hold too, which flatters the head"
    assert f"the test split is not wholly unseen: {seen}; drop those rows" in capsys.readouterr().err
    assert result.metrics["test"]["rows_seen"] == seen
    assert result.metrics["baselines"]["verdict"].endswith(f"; the test split is not wholly unseen: {seen}")
    report = (tmp_path / "run" / "report" / "report.md").read_text()
    assert f"not wholly unseen: {seen})" in report
    # the verdict is on test; the validation number is still set beside the baselines on its own rows
    beside = result.metrics["validation_baselines"]
    assert beside["split"] == "validation" and beside["head"] == result.metrics["accuracy"]
    assert report_module.validation_baselines(result.metrics) is beside  # what the curves plot draws
    assert len(fits) == 1
    rows = [line.split("\t") for line in Path(settings.validation).read_text().splitlines()[1:]]
    train_rows = [line.split("\t") for line in train_file.read_text().splitlines()[1:]]
    alone = baselines.tfidf_logreg([r[0] for r in train_rows], [r[1] for r in train_rows], [r[0] for r in rows],
                                   [r[1] for r in rows])  # the same rows, fitted for them alone
    assert beside["tfidf_logreg"]["accuracy"] == pytest.approx(alone["accuracy"])
    assert beside["majority"]["examples"] == 8 and "accuracy" in beside["tfidf_logreg"]
    for name in ("majority", "tfidf_logreg"):  # the head's validation answers beside theirs, as on test
        low, high = beside[f"margin_over_{name}_interval"]
        assert low <= beside[f"margin_over_{name}"] <= high
    assert "1000 draws of these 8 rows" in beside["intervals"] and "verdict" not in beside
    validation_line = next(line for line in report.splitlines() if line.startswith("- validation accuracy"))
    assert validation_line.endswith(f"; majority {beside['majority']['accuracy']:.4f}, tfidf_logreg "
                                    f"{beside['tfidf_logreg']['accuracy']:.4f} on the same rows)")


def test_eval_on_a_file_of_no_part_of_the_run_counts_the_rows_it_learnt(tmp_path, train_backbone, train_backbone_dir,
                                                                      capsys, monkeypatch):
    """`eval` on a file the run did not use said 'held out, unless it shares rows with the training file':
    it now reads the run's training rows again (as its manifest records them, the same file by sha256) and
    says how many of the file's rows hold a text among them, or why it cannot tell."""
    monkeypatch.chdir(tmp_path)  # the run records its files as given: relative paths, read again from here
    train_file = write_sentiment(Path("train.tsv"), 24, 0)
    settings = TrainSettings(train="train.tsv", split=[0.25], text_column="sentence", label_column="label",
                             layers="2", backbone=str(train_backbone_dir), task="mood", run_dir="run", project_dim=16,
                             epochs=2, states="recompute", progress=False)
    train(settings, backbone=train_backbone)
    other = write_sentiment(Path("other.tsv"), 6, 3)
    mixed = Path("mixed.tsv")
    mixed.write_text(other.read_text() + "\n".join(train_file.read_text().splitlines()[1:]) + "\n")

    def role(path: Path) -> str:
        capsys.readouterr()
        assert main(["eval", "--store", "run/store", "--task", "mood", "--file", str(path), "--backbone",
                     str(train_backbone_dir), "--no-progress"]) == 0
        said = capsys.readouterr()
        role, linear = json.loads(said.out)["file_role"], json.loads(said.out)["baseline"]["linear"]
        assert (f"tmod-train eval: {path}: {role}" in said.err) == ("not wholly unseen" in role)  # on the terminal too
        # the linear model is trained on the same rows the role counts against, or not, for the same reason
        assert linear["model"] == "tfidf_logreg"
        assert (linear.get("trained_on") == "the module's 18 training rows") == ("unless" not in role)
        assert "unless" not in role or role.endswith(f"({linear['not_fitted']})")
        return role

    assert role(other) == "not a file of the training run: held out: none of its 6 rows holds a text the training rows hold"
    # every row of the training file: the 18 the run carved for training are learnt, the 6 of validation chose
    # the epoch (a file of no part of the run was checked against the training rows alone)
    assert role(mixed) == ("not a file of the training run: not wholly unseen: 18 of its 30 rows hold a text the "
                           "training rows hold too, which flatters the head; 6 of its 30 rows hold a text the "
                           "validation rows hold too, and validation chose the epoch on them, so this number is "
                           "optimistic")
    train_file.rename("moved.tsv")
    assert role(other) == ("not a file of the training run: held out, unless it shares rows with the training file "
                           "(its training data cannot be read here: no such file: train.tsv)")
    manifest = Path("run/store/mood/1/manifest.json")  # as an older tmod-train might have recorded its settings
    recorded = json.loads(manifest.read_text())
    recorded["training"]["settings"]["learning_rate"] = 0.01
    manifest.write_text(json.dumps(recorded))
    assert role(other).endswith("(its recorded settings are not this tmod-train's: learning_rate: Extra inputs are not "
                                "permitted)")


def test_texts_longer_than_the_backbone_reads_are_counted_and_said(tmp_path, train_backbone, train_backbone_dir, capsys):
    """Training cuts a text at the backbone's limit (the server would read it in windows): said on
    stderr and recorded in the manifest, never silent; and in report.md, which said nothing of it, with
    the test split's count, which was not taken."""
    limit = train_backbone.text.max_tokens
    rows = ["sentence\tlabel"] + [f"{'the cat sat ' * (limit if i % 3 == 0 else 2)}{i}\t{'a' if i % 2 else 'b'}"
                                    for i in range(12)]
    path = tmp_path / "long.tsv"
    path.write_text("\n".join(rows) + "\n")
    settings = TrainSettings(train=str(path), validation=str(path), test=str(path), text_column="sentence",
                             label_column="label", backbone=str(train_backbone_dir), task="long",
                             run_dir=str(tmp_path / "run"), project_dim=16, epochs=1, progress=False)
    result = train(settings, backbone=train_backbone)
    data = result.training["data"]
    assert data["training_examples_cut"] == data["validation_examples_cut"] == data["test_examples_cut"] == 4
    err = capsys.readouterr().err
    assert f"4 of 12 training examples are longer than the backbone reads at once ({limit} word pieces): learnt on " \
        f"their first {limit}" in err and "4 of 12 validation examples" in err and "4 of 12 test examples" in err
    assert f"4 of 12 test examples are longer than the backbone reads at once ({limit} word pieces): scored as the " \
        "server answers them, in windows" in err  # tests/test_train_to_serve.py: as a real tmod-serve answers
    assert (f"- examples longer than the backbone reads at once ({limit} word pieces): 4 of 12 training, 4 of 12 "
            f"validation, 4 of 12 test; learnt on their first {limit}; scored (validation, test and `tmod-train eval`) "
            "as the server answers them, read in windows") in report_module.report_text(result)


@pytest.mark.parametrize("budget,epochs_run", [(1e-6, 1), (600.0, 3)])
def test_max_minutes_starts_no_epoch_past_the_budget(tmp_path, sentiment_files, train_backbone, train_backbone_dir,
                                                     budget, epochs_run):
    """--max-minutes: after an epoch, no next epoch that would end past the budget at that pace (a budget
    of a few microseconds stops after the first; a generous one changes nothing); the stop is recorded."""
    settings = TrainSettings(train=str(sentiment_files[0]), validation=str(sentiment_files[1]), task="s",
                             backbone=str(train_backbone_dir), run_dir=str(tmp_path / "run"), project_dim=16,
                             epochs=3, patience=10, max_minutes=budget, progress=False)
    result = train(settings, backbone=train_backbone)
    assert len(result.history) == epochs_run
    assert [h.get("stopped_by") for h in result.history] == [None] * (epochs_run - 1) + [
        "max_minutes" if epochs_run < 3 else None]
    assert ModuleStore(tmp_path / "run" / "store").read_manifest("s").training["epochs_run"] == epochs_run


def test_seeded_runs_are_reproducible(tmp_path, sentiment_files, train_backbone, train_backbone_dir):
    hashes = []
    for run in ("a", "b"):
        settings = TrainSettings(train=str(sentiment_files[0]), validation=str(sentiment_files[1]), task="s",
                                 backbone=str(train_backbone_dir), run_dir=str(tmp_path / run), project_dim=16,
                                 epochs=1, seed=7, progress=False)
        train(settings, backbone=train_backbone)
        hashes.append(ModuleStore(tmp_path / run / "store").read_manifest("s").weights_sha256)
    assert hashes[0] == hashes[1]


def test_cutoff_zeroes_small_weights_and_renormalises(tmp_path, train_backbone):
    weights = torch.tensor([0.5, 0.3, 0.004, 0.196])
    cut = cutoff_weights(weights, 0.01)
    assert cut[2] == 0 and cut.sum().item() == pytest.approx(1.0)
    assert cut[0].item() == pytest.approx(0.5 / 0.996)
    assert torch.equal(cutoff_weights(weights, 0.0), weights)
    assert cutoff_weights(weights, 0.9).tolist() == [1.0, 0.0, 0.0, 0.0]  # the largest always survives

    head = LayerMixHead(LayerMixConfig(task_type="sequence_classification", num_labels=2, hidden_size=32,
                                       layers=[0, 1, 2], project_dim=8, attention_heads=2, alpha=10.0, cutoff=0.05))
    with torch.no_grad():
        head.layer_logits.copy_(torch.tensor([0.0, 0.5, 0.6]))  # softmax(10p): state 0 gets ~0.004
    mix = head.mix_weights()
    assert mix[0] == 0 and mix.sum().item() == pytest.approx(1.0)
    assert head.layers_read() == [1, 2]
    # gradients through the cutoff are finite, and the cut state gets none from the task loss
    batch = train_backbone.tokenize(["a short input"])
    states = [(i, h.clone()) for i, h in train_backbone.stream(batch)]
    from training.trainer import head_forward, layer_entropy
    loss = head_forward(head, batch, states).sum() + 0.1 * layer_entropy(head)
    loss.backward()
    assert torch.isfinite(head.layer_logits.grad).all()
    assert head.projections.grad[0].abs().sum() == 0
    # the artifact says the cut state is not read, and the served plan skips it
    store = ModuleStore(tmp_path / "store")
    save_module(store, "cut", "1", head, train_backbone)
    module = load_module(store, "cut", "1", train_backbone)
    assert module.manifest.layers == [1, 2]
    assert Engine(train_backbone).plan({"cut": module}).layers == [1, 2]


def test_cached_states_match_recomputed_states(sentiment_files, train_backbone):
    data = read_table(sentiment_files[1], text_column="sentence", label_column="label")
    split = Split(data, ["0", "1"], train_backbone)
    cached, fresh = CachedStates(split, [0, 2], batch_size=5, progress=False), RecomputedStates(split, [0, 2])
    rows = [3, 0, 7]
    batch = split.token_batch(rows)
    got, want = list(cached.states(rows, batch)), list(fresh.states(rows, batch))
    assert [i for i, _ in got] == [i for i, _ in want] == [0, 2]
    mask = batch.attention_mask.bool()
    for (_, a), (_, b) in zip(got, want):
        assert a.shape == b.shape and a.dtype == torch.float32
        assert torch.allclose(a[mask], b[mask], atol=2e-2, rtol=1e-2)  # fp16 storage
        assert a[~mask].abs().sum() == 0
    assert cached.nbytes() == 2 * (sum(split.lengths) + 1) * 32 * 2


def test_settings_parsing_and_config_errors(tmp_path):
    assert parse_layers("all") is None and parse_layers("6") == [6]
    assert parse_layers("0-2,5") == [0, 1, 2, 5] and parse_layers([3, 1]) == [1, 3]
    for bad in ("a-b", "2-x", "1,,3", "-1"):
        with pytest.raises(UsageError, match="^--layers: .* is not a state number or range: give 6, 0-6 or 1,3,5"):
            parse_layers(bad, "--layers")
    with pytest.raises(UsageError, match="^--layers: '3-1' runs downwards: give the range low to high, 1-3$"):
        parse_layers("3-1", "--layers")  # it was pydantic's 'List should have at least 1 item after validation'
    assert parse_label_map("0=neg, 1=pos") == {"0": "neg", "1": "pos"}
    assert parse_label_map("0=neg,1=neg") == {"0": "neg", "1": "neg"}  # raw labels merged: allowed
    with pytest.raises(ValueError, match="'0' is mapped twice \\('neg' and 'pos'\\)"):
        parse_label_map("0=neg,0=pos")  # it kept 'pos' and then refused label '1' as missing from the map
    # what a value was expected to be, not Python's "could not convert string to float: 'maybe'"
    for field, value, said in (("none_below", "maybe", "a probability between 0 and 1, or auto (got 'maybe')"),
                               ("split", "0.1,x", "one or two fractions, VALIDATION[,TEST]: 0.1 or 0.1,0.1 (got 'x')"),
                               ("document_windows", "256,x", "word pieces a window, comma-separated: 256,128 (got 'x')"),
                               ("labels", ["neg", "neg"], "names ['neg'] more than once: each label once")):
        with pytest.raises(ValueError, match=re.escape(said)):
            TrainSettings(dataset="sst2", **{field: value})
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"epochs": 2, "no_such_knob": 1}))
    args = build_parser().parse_args(["layermix", "--config", str(config), "--dataset", "sst2"])
    with pytest.raises(ValueError, match="no_such_knob"):
        settings_from_args(args)
    numbers = tmp_path / "c.yaml"
    numbers.write_text("version: 7\ntask: 2024\ntext_column: 3\n")  # YAML's numbers: names, or an index
    settings = settings_from_args(build_parser().parse_args(["layermix", "--config", str(numbers), "--dataset", "sst2"]))
    assert (settings.version, settings.task, settings.text_column) == ("7", "2024", 3)
    config.write_text(json.dumps({"epochs": 2, "lambda-entropy": 0.5}))
    args = build_parser().parse_args(["layermix", "--config", str(config), "--lambda", "0.25", "--k", "32"])
    settings = settings_from_args(args)
    assert (settings.epochs, settings.lambda_entropy, settings.project_dim) == (2, 0.25, 32)


def test_an_existing_version_is_refused_before_training_and_none_named_is_the_next(sentiment_run, sentiment_files,
                                                                                    train_backbone_dir, tmp_path):
    run, _ = sentiment_run
    store = shutil.copytree(run / "store", tmp_path / "store")
    settings = TrainSettings(train=str(sentiment_files[0]), validation=str(sentiment_files[1]), task="sentiment",
                             store=str(store), backbone=str(train_backbone_dir), epochs=1, progress=False,
                             run_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match=r"sentiment/1 already exists in .*; pick another --version \(the next free "
                                         r"number: --version 2, or leave --version out\) or --overwrite"):
        train(settings.model_copy(update={"version": "1"}))
    assert train(settings).version == "2"  # the run repeated adds a version
    assert ModuleStore(store).versions("sentiment") == ["1", "2"]


def test_a_version_of_another_kind_than_the_task_is_refused_before_training(sentiment_run, train_backbone_dir,
                                                                             tmp_path, capsys):
    """A tagger trained as `sentiment` (a classifier in the store), or a classifier as the store's `embedding`,
    became the version every client of that task got, answers of another shape and all: refused before
    any training or writing, with the reason."""
    run, _ = sentiment_run
    store = shutil.copytree(run / "store", tmp_path / "store")
    conll = write_conll(tmp_path / "tags.conll", 12, 0)
    assert main(["layermix", "--train", str(conll), "--split", "0.25", "--task", "sentiment", "--store", str(store),
                 "--backbone", str(train_backbone_dir), "--run-dir", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        f"tmod-train layermix: error: --task sentiment: sentiment/1 in {store} is a sequence classification module, "
        "this one would be a token classification: every client of sentiment would get answers of another shape; "
        "pick another --task") and "epoch" not in err
    assert ModuleStore(store).versions("sentiment") == ["1"] and not (tmp_path / "run").exists()
    assert main(["embedding", "--backbone", str(train_backbone_dir), "--task", "sentiment", "--store", str(store),
                 "--check", "0"]) == 2
    assert "sentiment/1 in" in capsys.readouterr().err and ModuleStore(store).versions("sentiment") == ["1"]


def test_a_number_taken_by_a_run_beside_this_one_is_not_lost(sentiment_run, sentiment_files, train_backbone_dir,
                                                               tmp_path, monkeypatch, capsys):
    """Two runs of a sweep into one store both chose version 2 when they started; the second, saving,
    met "sentiment/2 already exists" and lost its training."""
    from training import trainer
    run, _ = sentiment_run
    store = shutil.copytree(run / "store", tmp_path / "store")
    assess = trainer.assess

    def beside(*args, **kwargs):  # while this run trains, another saves the number it chose
        shutil.copytree(store / "sentiment" / "1", store / "sentiment" / "2")
        return assess(*args, **kwargs)
    monkeypatch.setattr(trainer, "assess", beside)
    settings = TrainSettings(train=str(sentiment_files[0]), validation=str(sentiment_files[1]), task="sentiment",
                             store=str(store), backbone=str(train_backbone_dir), epochs=1, progress=False,
                             run_dir=str(tmp_path / "run"))
    assert train(settings).version == "3"
    assert ModuleStore(store).read_manifest("sentiment", "3").training["settings"]["version"] == "3"
    assert "sentiment/2 was written meanwhile by another run: this one is sentiment/3" in capsys.readouterr().err


def test_states_on_disk_are_reused_and_keyed_by_backbone_precision_and_data(sentiment_files, train_backbone, tmp_path):
    """--state-cache: a second split of the same data on the same backbone and precision loads its
    states from disk without running a layer, computing only states not stored yet; another
    precision or other rows are another key."""
    data = read_table(sentiment_files[1], text_column="sentence", label_column="label")
    split = Split(data, ["0", "1"], train_backbone)
    first = CachedStates(split, [0, 2], batch_size=5, progress=False, disk=tmp_path)
    assert sorted(p.name.split(".")[1] for p in tmp_path.glob("*.safetensors")) == ["state0", "state2"]
    calls = []
    hooks = [layer.register_forward_hook(lambda m, i, o: calls.append(1)) for layer in train_backbone.adapter.layers]
    try:
        again = CachedStates(Split(data, ["0", "1"], train_backbone), [2], batch_size=5, progress=False, disk=tmp_path)
        assert calls == []  # every state read from disk
        assert torch.equal(again.cache[2], first.cache[2])
        CachedStates(split, [1, 2], batch_size=5, progress=False, disk=tmp_path)
        assert calls  # state 1 was missing: the backbone ran (up to it) and it was stored
        assert len(list(tmp_path.glob("*.state1.safetensors"))) == 1
    finally:
        for hook in hooks:
            hook.remove()
    from training.states import split_states_key

    fewer = Split(data.subset(10, seed=0), ["0", "1"], train_backbone)
    bf16 = Split(data, ["0", "1"], train_backbone.use_backend("torch", "bf16"))
    assert len({split_states_key(s) for s in (split, fewer, bf16)}) == 3


def test_precision_setting_trains_on_the_states_served_at_that_precision(tmp_path, sentiment_files, train_backbone,
                                                                         train_backbone_dir):
    settings = TrainSettings(train=str(sentiment_files[0]), validation=str(sentiment_files[1]), task="s",
                             backbone=str(train_backbone_dir), run_dir=str(tmp_path / "run"), project_dim=16,
                             epochs=1, precision="bf16", progress=False)
    result = train(settings, backbone=train_backbone)
    assert result.training["environment"]["tmod"] == server.__version__  # which tmod trained it
    environment = result.training["environment"]["backbone_backend"]
    assert environment["backend"] == "torch" and environment["precision"] == "bf16"
    assert result.training["settings"]["precision"] == "bf16"
    assert train_backbone.backend.precision == "fp32"  # the caller's backbone is left as it was
    # the report says so (on a CPU with native bfloat16 `auto` picks bf16 too: the numbers were bf16's, unsaid)
    report = (tmp_path / "run" / "report" / "report.md").read_text()
    assert "- learnt and scored on backbone states read at bf16, as a server at that precision reads them" in report


@pytest.mark.parametrize("command", [["layermix", "--dataset", "sst2", "--task", "x"], ["embedding"]])
def test_a_backbone_that_is_not_there_is_one_line(tmp_path, capsys, command):
    (tmp_path / "empty").mkdir()
    assert main([*command, "--backbone", str(tmp_path / "empty"), "--store", str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"tmod-train {command[0]}: error: no Hugging Face model at {tmp_path / 'empty'} " \
                      "(config.json missing)", err
    for typo in ["MiniLM", "sentence-transformers/all-MiniLM-L6-v2"]:  # a name tmod does not know, a hub name
        assert main([*command, "--backbone", typo, "--store", str(tmp_path / "store")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1] == f"tmod-train {command[0]}: error: no backbone {typo!r}: name one of minilm, smollm2, " \
                          "mpnet, or a local Hugging Face model folder (nothing is downloaded from a model hub)", err
        assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize("command", [["layermix", "--dataset", "sst2", "--task", "x"], ["embedding"],
                                     ["eval", "--task", "sentiment", "--version", "1"],
                                     ["align", "--source", "minilm", "--target", "mpnet"]])
def test_a_preset_whose_files_are_not_there_is_one_line_naming_the_setting(tmp_path, capsys, command):
    """Training said which setting points at the presets; eval, the embedding check, align and bridge
    said only 'no such file' (one check, in the preset's spec, now serves each)."""
    missing = tmp_path / "no-data"
    store = [] if command[0] == "eval" else ["--store", str(tmp_path / "store")]
    assert main([*command, "--data-dir", str(missing), *store]) == 2
    part = "train" if command[0] in ("layermix", "align") else "validation"
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"tmod-train {command[0]}: error: no such file: {missing / 'sst2' / f'{part}.tsv'} (the sst2 preset; set "
        "--data-dir or TMOD_DATA_DIR)")
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("failure", [ValueError("This solver needs samples of at least 2 classes"),
                                     MemoryError("the TF-IDF matrix of a big file")])
def test_a_linear_baseline_the_rows_cannot_fit_keeps_the_trained_head(tmp_path, train_backbone, train_backbone_dir,
                                                                        monkeypatch, failure):
    """scikit-learn refusing the rows (the linear tagger on one class, TF-IDF with no term left: the cases
    found are refused or fixed before training), or the baseline failing otherwise (out of memory on a
    big file, which was not caught), lost the trained head to a traceback; now the head is saved and
    the verdict and report say the linear model could not be trained."""
    from training import assess

    def refuse(*args, **kwargs):
        raise failure

    monkeypatch.setattr(assess, "window_tagger_scores", refuse)
    train_file, validation_file = write_conll(tmp_path / "train.txt", 40, 0), write_conll(tmp_path / "val.txt", 12, 1)
    settings = TrainSettings(train=str(train_file), validation=str(validation_file), backbone=str(train_backbone_dir),
                             task="ner", store=str(tmp_path / "store"), report_dir=str(tmp_path / "report"),
                             project_dim=16, ffn_dim=32, epochs=1, batch_size=8, progress=False)
    result = train(settings, backbone=train_backbone)
    baselines = load_module(ModuleStore(tmp_path / "store"), "ner", "1", train_backbone).manifest.metrics["baselines"]
    said = f"{type(failure).__name__}: {failure}"
    assert baselines["window_tagger"] == {"baseline": "window_tagger", "error": said}
    assert "the linear model (window_tagger) could not be trained" in baselines["verdict"]
    assert "margin_over_majority" in baselines and "margin_over_window_tagger" not in baselines
    assert f"| window_tagger | not trained: {type(failure).__name__}" in (result.report_dir / "report.md").read_text()


def test_long_steps_write_plain_progress_lines_where_there_are_no_bars(sentiment_files, train_backbone_dir, tmp_path,
                                                                       capsys, monkeypatch):
    """In a log (no terminal, or --no-progress) a step's progress is a plain line every LOG_EVERY_S (here 0:
    every step), not the silence of a disabled bar: a large file's states take minutes."""
    from training import progress
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    train_file, validation_file = sentiment_files
    assert main(["layermix", "--train", str(train_file), "--validation", str(validation_file), "--label-column", "label",
                 "--backbone", str(train_backbone_dir), "--task", "s", "--store", str(tmp_path / "store"),
                 "--run-dir", str(tmp_path / "run"), "--epochs", "1", "--batch-size", "16", "--no-progress"]) == 0
    lines = capsys.readouterr().err.splitlines()
    said = "\n".join(lines)
    assert re.search(r"^caching train states: (\d+)/\1 tok \(100%\) in \d+ s, ~0 s left$", said, re.M)  # its last line
    assert re.search(r"^epoch 1/1: 3/3 batch \(100%\) in \d+ s, ~0 s left  loss \d\.\d{4}$", said, re.M)
    assert "scoring against simple baselines: the majority answer, and tfidf_logreg fitted on the 48 training rows" in said
    assert not [line for line in lines if "\r" in line or "\x1b" in line]  # no terminal codes in a log


def test_a_pass_in_length_order_counts_its_progress_in_padded_word_pieces(train_backbone, capsys, monkeypatch):
    """Rows go to the backbone shortest first, so counting rows (or batches) said "~350 s left" of a
    teacher's pass for seven minutes and it ended 17 minutes later; padded word pieces keep pace."""
    from training import progress
    from training.states import TokenStateCache
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    texts = [" ".join(["word"] * n) for n in (40, 2, 3, 30, 2, 5)]
    encoded = train_backbone.encode(texts)
    TokenStateCache(train_backbone, encoded, [1], batch_size=2, progress=False, desc="caching")
    counts = [tuple(map(int, m)) for m in re.findall(r"^caching: (\d+)/(\d+) tok", capsys.readouterr().err, re.M)]
    lengths = sorted(len(e) for e in encoded)  # batches of two, shortest first, each padded to its longer
    done = [2 * lengths[1], 2 * lengths[1] + 2 * lengths[3], 2 * (lengths[1] + lengths[3] + lengths[5])]
    assert counts == [(n, done[-1]) for n in done]


def test_word_pieces_the_vocabulary_lacks_are_counted_and_said(tmp_path, train_backbone, train_backbone_dir, capsys):
    """A file in a script the backbone's vocabulary lacks (Thai: [UNK] pieces) trained unsaid; GoEmotions'
    emoji (0.13% of its pieces) stay under the line."""
    rows = ["text\tlabel"] + [f"{'ผมชอบหนัง' if i % 2 else 'แย่มาก'} film {i}\t{i % 2}" for i in range(24)]
    path = tmp_path / "thai.tsv"
    path.write_text("\n".join(rows) + "\n")
    settings = TrainSettings(train=str(path), validation=str(path), backbone=str(train_backbone_dir), task="thai",
                             run_dir=str(tmp_path / "run"), project_dim=16, epochs=1, progress=False)
    train(settings, backbone=train_backbone)
    said = capsys.readouterr().err
    assert re.search(r"^24 of the \d+ training word pieces \(\d+\.\d%, in 24 of 24 texts, e\.g\. '.*'\) are \[UNK\]: "
                     r"\S+'s vocabulary lacks them", said, re.M)
    assert ModuleStore(tmp_path / "run" / "store").read_manifest("thai").training["data"][
        "training_word_pieces_unknown"] == 24
    assert re.search(r"^- 24 of the \d+ training word pieces \(\d+\.\d\d%\) are unknown to the backbone's vocabulary",
                     (tmp_path / "run" / "report" / "report.md").read_text(), re.M)
    english = tmp_path / "english.tsv"  # an emoji in 24 of 400 texts of ~12 pieces: 0.5% of the pieces
    english.write_text("\n".join(["text\tlabel"] + [f"a fine film with a long and winding plot {i} 😀\t{i % 2}"
                                                     for i in range(24)]
                                 + [f"a dull film with a long and winding plot {i}\t{i % 2}" for i in range(24, 400)])
                       + "\n")
    train(settings.model_copy(update={"train": str(english), "validation": str(english), "task": "english"}),
          backbone=train_backbone)
    assert "[UNK]" not in capsys.readouterr().err


def test_runs_started_in_the_same_second_get_a_run_folder_each(tmp_path):
    """A sweep launched at once: runs/<task>-<version>-<second> was one folder for all, each report written
    over the last."""
    from training.runs import new_run_dir
    base = tmp_path / "runs" / "s-2-20261130-072000"
    assert [new_run_dir(base) for _ in range(3)] == [base, base.with_name(base.name + "-2"),
                                                     base.with_name(base.name + "-3")]
    assert all(path.is_dir() for path in base.parent.iterdir())


def test_word_tags_without_entities_are_chosen_on_word_accuracy(tmp_path, capsys):
    """Part-of-speech tags (no O, no B-/I-) were selected on entity F1, which reads a run of like tags
    ("New York City" NNP NNP NNP) as one entity."""
    lines = []
    for i in range(20):
        lines += ["The DT", f"dog{i} NN", "runs VBZ", ". .", ""]
    pos = tmp_path / "pos.txt"
    pos.write_text("\n".join(lines))
    data = resolve_data(TrainSettings(train=str(pos), split="0.2", progress=False))
    assert data.metric == "word_accuracy"
    assert "no tag is O nor begins with B-/I- (one tag a word, as part-of-speech tags are)" in capsys.readouterr().err
    assert resolve_data(TrainSettings(train=str(pos), split="0.2", metric="f1", progress=False)).metric == "f1"
    ner = write_conll(tmp_path / "ner.txt", 20, 0)
    assert resolve_data(TrainSettings(train=str(ner), split="0.2", progress=False)).metric == "f1"
    assert "word accuracy" not in capsys.readouterr().err


def test_a_run_folder_that_cannot_be_made_is_one_line_before_training(sentiment_files, train_backbone_dir, tmp_path,
                                                                       capsys, monkeypatch):
    """--run-dir under a file (or tmod-train run where the default runs/ cannot be made) failed after the
    training, with a bare '[Errno 2] No such file or directory'."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    train_file, validation_file = sentiment_files
    argv = ["layermix", "--train", str(train_file), "--validation", str(validation_file), "--label-column", "label",
            "--backbone", str(train_backbone_dir), "--task", "s", "--epochs", "1", "--no-progress"]
    assert main([*argv, "--run-dir", str(blocker / "run")]) == 2
    err = capsys.readouterr().err
    assert f"cannot make {blocker / 'run' / 'store'}: {blocker} is a file; give --run-dir (or --store and " \
        "--report-dir) in a folder you can write" in err and "epoch 1/1" not in err
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("")  # where the default run folder goes
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot make runs/s-1-" in err and ": runs is a file;" in err and "epoch 1/1" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "runs"]  # a refused run leaves nothing
    if os.path.isdir("/proc/self"):  # Linux: root passes /proc's permission bits, yet no folder can be made there
        assert main([*argv, "--run-dir", "/proc/tmod-run"]) == 2
        err = capsys.readouterr().err
        assert "cannot make /proc/tmod-run/store: " in err and "epoch 1/1" not in err, err


def test_a_module_the_disk_cannot_take_is_one_line_and_leaves_nothing_half_written(sentiment_files, train_backbone_dir,
                                                                                     tmp_path, capsys, monkeypatch):
    """A full disk when the trained head is written ended the run in a safetensors traceback: one line now,
    naming the module and the store, and the store holds no half-written folder. Where the report is what
    the disk cannot take, the line says where the saved module is."""
    from safetensors import SafetensorError

    import safetensors.torch  # where the store takes save_file from when it writes

    def full_disk(tensors, path, *args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                              'left on device" })')

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    train_file, validation_file = sentiment_files
    store = tmp_path / "store"
    assert main(["layermix", "--train", str(train_file), "--validation", str(validation_file), "--label-column",
                 "label", "--backbone", str(train_backbone_dir), "--task", "s", "--epochs", "1", "--no-progress",
                 "--store", str(store), "--report-dir", str(tmp_path / "report")]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"tmod-train layermix: error: cannot write s/1 into {store} (Error while serializing: ")
    assert last.endswith("No space left on device\" })): nothing was saved") and "Traceback" not in err
    assert list(store.rglob("*")) == []  # no staging folder, no task folder without a version
    monkeypatch.chdir(tmp_path)  # the default run folder, runs/s-1-TIME, made for the save: removed with it
    assert main(["layermix", "--train", str(train_file), "--validation", str(validation_file), "--label-column",
                 "label", "--backbone", str(train_backbone_dir), "--task", "s", "--epochs", "1", "--no-progress"]) == 2
    assert "cannot write s/1 into runs/s-1-" in capsys.readouterr().err and list((tmp_path / "runs").iterdir()) == []
    monkeypatch.undo()
    import training.trainer

    def full_disk_at_the_report(report_dir, outcome):
        raise OSError(28, "No space left on device", str(report_dir / "report.md"))

    monkeypatch.setattr(training.trainer, "write_report", full_disk_at_the_report)  # the module is saved by then
    assert main(["layermix", "--train", str(train_file), "--validation", str(validation_file), "--label-column",
                 "label", "--backbone", str(train_backbone_dir), "--task", "s", "--epochs", "1", "--no-progress",
                 "--store", str(store), "--report-dir", str(tmp_path / "report")]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        f"tmod-train layermix: error: the report cannot be written (No space left on device: "
        f"{tmp_path / 'report' / 'report.md'}); the module is saved in {store / 's' / '1'}") and "Traceback" not in err
    import training.cli

    def read_only(args, argv):  # any other write the machine refuses: one line, not a traceback
        raise OSError(30, "Read-only file system", "runs/s-1")

    monkeypatch.setattr(training.cli, "run_command", read_only)
    assert main(["layermix", "--train", str(train_file), "--task", "s"]) == 1
    assert capsys.readouterr().err == "tmod-train layermix: error: Read-only file system: runs/s-1\n"


@pytest.mark.parametrize("interval, said", [((-0.13, -0.005), False), ((-0.1, 0.02), True), ((0.01, 0.2), False)])
def test_eval_calls_a_margin_within_the_noise_only_where_its_interval_holds_0(
        sentiment_run, sentiment_files, train_backbone_dir, capsys, monkeypatch, interval, said):
    """eval said a margin of -0.0685 (interval -0.1315 to -0.0054, wholly below 0) was 'within the noise'."""
    from training import metrics
    monkeypatch.setattr(metrics, "margin_interval", lambda *args, **kwargs: interval)
    run, _ = sentiment_run
    assert main(["eval", "--store", str(run / "store"), "--task", "sentiment", "--file", str(sentiment_files[1]),
                 "--text-column", "sentence", "--label-column", "label", "--label-map", "0=negative,1=positive",
                 "--backbone", str(train_backbone_dir), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert err.count(f"95% paired bootstrap interval {interval[0]:+.4f} to {interval[1]:+.4f}") == 2
    assert ("within the noise of these 24 rows" in err) == said


def test_a_state_or_version_the_model_lacks_is_one_line(sentiment_run, sentiment_files, train_backbone_dir, tmp_path,
                                                        capsys):
    """--layers 0,99 ended in a traceback (a ValueError after the data was read); so did eval --version
    9 ('no manifest at ...')."""
    run, argv = sentiment_run
    store = run / "store"
    assert main([*argv[:argv.index("--store")], "--store", str(tmp_path / "s"), "--report-dir", str(tmp_path / "r"),
                 "--layers", "0,99", "--no-progress"]) == 2
    assert capsys.readouterr().err.endswith("error: --layers [99]: tiny-bert has states 0..2 (0 = the embeddings)\n")
    assert main(["eval", "--store", str(store), "--task", "sentiment", "--version", "9", "--file",
                 str(sentiment_files[1]), "--backbone", str(train_backbone_dir)]) == 2  # the user's mistake
    assert capsys.readouterr().err == (f"tmod-train eval: error: no version '9' of sentiment in the store {store}; "
                                       "its versions: 1\n")


def test_a_task_name_the_store_spells_otherwise_is_said(sentiment_run, tmp_path, capsys):
    """--task 'My Reviews' became my-reviews in the store and the URLs, said nowhere but in the JSON."""
    _, argv = sentiment_run
    at = argv.index("--store")
    renamed = [*argv[:at], "--store", str(tmp_path / "s"), "--report-dir", str(tmp_path / "r"), "--epochs", "1"]
    renamed[renamed.index("--task") + 1] = "My Reviews"
    assert main(renamed) == 0
    err = capsys.readouterr().err
    assert "--task 'My Reviews' is stored and served as 'my-reviews' (task names are a-z, 0-9, '_' and '-')" in err
    assert ModuleStore(tmp_path / "s").tasks() == ["my-reviews"]


@pytest.mark.parametrize("epochs, best, said", [(2, 0.9, True), (2, 1.0, False), (1, 0.9, False)])
def test_train_longer_is_not_said_of_a_perfect_validation_score(sentiment_run, tmp_path, capsys, monkeypatch, epochs,
                                                               best, said):
    """'validation accuracy was still improving; train longer' was said of a head at 1.0000 (a toy
    part-of-speech file): a perfect score has nowhere left to go; nor of a one-epoch run: one epoch shows
    no trend."""
    import training.trainer

    real = training.trainer.train_epochs

    def kept_last_at(*args, **kwargs):
        history, _, _ = real(*args, **kwargs)
        return history, len(history), best

    monkeypatch.setattr(training.trainer, "train_epochs", kept_last_at)
    _, argv = sentiment_run
    at = argv.index("--store")
    assert main([*argv[:at], "--store", str(tmp_path / "s"), "--report-dir", str(tmp_path / "r"), "--epochs", str(epochs)]) == 0
    assert ("validation accuracy was still improving; train longer" in capsys.readouterr().err) == said
    assert ModuleStore(tmp_path / "s").read_manifest("sentiment").training["still_improving"] == said


def test_no_run_folder_is_made_where_store_and_report_go_elsewhere(sentiment_run, tmp_path, monkeypatch):
    """With --store and --report-dir, an empty runs/TASK-VERSION-TIME folder was made in the working folder."""
    _, argv = sentiment_run
    monkeypatch.chdir(tmp_path)
    at = argv.index("--store")
    assert main([*argv[:at], "--store", str(tmp_path / "s"), "--report-dir", str(tmp_path / "r"), "--epochs", "1"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r", "s"]


def test_the_curves_show_the_simple_baselines_where_they_were_measured_on_validation(tmp_path, monkeypatch):
    """The validation curve alone did not say how the head compares with the simple baselines the report's
    table names; drawn beside it where they were scored on the same split (not where a test split scored them)."""
    from training import report

    drawn = []
    monkeypatch.setattr(report.plt, "close", drawn.append)
    history = [{"epoch": e, "train_loss": 0.7 - e / 10, "validation_loss": 0.6 - e / 20, "accuracy": 0.6 + e / 10}
               for e in (1, 2)]
    baselines = {"split": "validation", "metric": "accuracy", "head": 0.8, "verdict": "above both",
                 "majority": {"baseline": "majority", "accuracy": 0.5}, "margin_over_majority": 0.3,
                 "tfidf_logreg": {"baseline": "tfidf_logreg", "accuracy": 0.675}, "margin_over_tfidf_logreg": 0.125}

    def curve_labels(baselines) -> list[str]:
        report.plot_curves(history, [], "accuracy", tmp_path / "curves.png", "t", 2, baselines)
        return [line.get_label() for line in drawn[-1].axes[1].get_lines() if not line.get_label().startswith("_")]

    assert curve_labels(baselines) == ["head", "majority (0.500)", "tfidf_logreg (0.675)"]
    assert curve_labels({**baselines, "split": "test"}) == ["head"]
    assert curve_labels(None) == ["head"]


def test_a_cache_that_cannot_be_written_is_said_and_the_run_goes_on(tmp_path, capsys):
    """Every training cache (states, paired states, teacher logits, baselines) is written through one
    function; one that cannot be written (a full disk, a folder under a file) failed the whole run after
    its work was done."""
    from training.baselines import cached_run
    from training.runs import write_cache_file

    (tmp_path / "a-file").write_text("")
    assert write_cache_file(tmp_path / "c" / "x.json", lambda tmp: Path(tmp).write_text("{}")) is True
    assert (tmp_path / "c" / "x.json").read_text() == "{}"
    assert list((tmp_path / "c").iterdir()) == [tmp_path / "c" / "x.json"]
    assert write_cache_file(tmp_path / "a-file" / "x.json", lambda tmp: Path(tmp).write_text("{}")) is False
    assert capsys.readouterr().err.startswith(f"not cached: cannot write {tmp_path / 'a-file' / 'x.json'} (")

    def failing(tmp):
        Path(tmp).write_text("half")
        raise OSError(28, "No space left on device")

    assert write_cache_file(tmp_path / "c" / "y.json", failing) is False  # nothing half-written is left
    assert "(No space left on device); the run goes on" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["x.json"]
    assert cached_run(tmp_path / "a-file", {"k": 1}, lambda: {"accuracy": 0.5}) == {"accuracy": 0.5}


def test_eval_on_a_backbone_scores_the_version_it_serves_and_defaults_to_the_trained_preset(
        sentiment_run, sentiment_files, train_backbone_dir, tmp_path, capsys):
    """`eval --backbone B` without --version scored the version a server on B answers with, but read the
    data, labels and roles with the store's latest manifest, another backbone's: a later version with
    other labels refused the file. Without --dataset or --file, eval scores the preset the module was
    trained on (it was refused: "give exactly one of ..."), or says which files it was trained on."""
    from tests.helpers import make_tiny_backbone_dir

    run, argv = sentiment_run
    store = tmp_path / "store"
    shutil.copytree(run / "store", store)
    other_backbone = make_tiny_backbone_dir(tmp_path / "other", "bert", layers=2, seed=1)
    at = argv.index("--store")
    other = [*argv[:at], "--store", str(store), "--report-dir", str(tmp_path / "r1"), "--epochs", "1",
             "--version", "other-1"]
    other[other.index("--backbone") + 1] = str(other_backbone)
    other[other.index("--label-map") + 1], other[other.index("--labels") + 1] = "0=neg,1=pos", "neg,pos"
    assert main(other) == 0  # the store's latest version ("other-1" sorts after "1"), on another backbone
    out = tmp_path / "eval.json"
    assert main(["eval", "--store", str(store), "--task", "sentiment", "--file", str(sentiment_files[1]),
                 "--text-column", "sentence", "--label-column", "label", "--label-map", "0=negative,1=positive",
                 "--backbone", str(train_backbone_dir), "--output", str(out), "--no-progress"]) == 0
    assert json.loads(out.read_text())["version"] == "1"
    only_other = tmp_path / "only-other"
    shutil.copytree(store / "sentiment" / "other-1", only_other / "sentiment" / "other-1")
    capsys.readouterr()
    assert main(["eval", "--store", str(only_other), "--task", "sentiment", "--file", str(sentiment_files[1]),
                 "--backbone", str(train_backbone_dir)]) == 2
    assert "error: no version of sentiment runs on tiny-bert (the latest, other-1, runs on" in capsys.readouterr().err

    assert main(["eval", "--store", str(store), "--task", "sentiment", "--backbone", str(train_backbone_dir)]) == 2
    assert capsys.readouterr().err == (f"tmod-train eval: error: give --dataset NAME or --file FILE to score on: "
                                       f"sentiment/1 was trained on files of its own (validation {sentiment_files[1]})\n")

    preset = [*argv[:argv.index("--train")], "--dataset", "sst2", "--max-train", "40", "--max-validation", "40",
              "--backbone", str(train_backbone_dir), "--task", "sst", "--store", str(store), "--report-dir",
              str(tmp_path / "r2"), "--epochs", "1", "--no-progress"]
    assert main(preset) == 0
    capsys.readouterr()
    assert main(["eval", "--store", str(store), "--task", "sst", "--version", "1", "--max-examples", "20",
                 "--backbone", str(train_backbone_dir), "--output", str(out), "--no-progress"]) == 0
    assert "tmod-train eval: sst/1 scored on sst2, the preset it was trained on" in capsys.readouterr().err
    scored = json.loads(out.read_text())
    assert scored["file"].endswith("validation.tsv") and scored["split"] == "validation"
    assert scored["metrics"]["examples"] == 20


def test_eval_output_that_cannot_be_written_is_refused_before_scoring(sentiment_run, sentiment_files, tmp_path,
                                                                     capsys, monkeypatch):
    """`eval --output` naming a folder, or a place whose folder cannot be made, failed after the whole
    scoring (an OSError's raw text); now one line first."""
    import training.eval_command

    run, _ = sentiment_run
    monkeypatch.setattr(training.eval_command, "eval_module", lambda *a: pytest.fail("scored before --output was checked"))
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for output, said in ((tmp_path, f"--output {tmp_path}: a folder; give a file's name, e.g. {tmp_path / 'eval.json'}"),
                         (blocker / "eval.json", f"--output {blocker / 'eval.json'}: {blocker} is a file")):
        assert main(["eval", "--store", str(run / "store"), "--task", "sentiment", "--file", str(sentiment_files[1]),
                     "--output", str(output)]) == 2
        assert capsys.readouterr().err.startswith(f"tmod-train eval: error: {said}")


def write_imbalanced(path, positive, negative, seed):
    """A sentiment TSV of `positive` rows labelled pos and `negative` labelled neg, shuffled."""
    rng = random.Random(seed)
    rows = [(" ".join(rng.sample(FILLER, 4) + [rng.choice(words)]), label)
            for words, label, n in ((POSITIVE, "pos", positive), (NEGATIVE, "neg", negative)) for _ in range(n)]
    rng.shuffle(rows)
    path.write_text("sentence\tlabel\n" + "".join(f"{text}\t{label}\n" for text, label in rows))
    return path


def test_imbalanced_labels_are_said_and_class_weights_balance_the_loss(tmp_path, train_backbone_dir, capsys,
                                                                        monkeypatch):
    """A 90/10 file chose its epoch on accuracy without a word, which a head mostly answering the frequent
    label wins; now that is said with the remedies, and --class-weights balanced weighs each class's
    loss by the inverse of its share (scikit-learn's 'balanced'), in training and validation alike."""
    from training import trainer

    train_file = write_imbalanced(tmp_path / "train.tsv", 45, 5, 0)
    validation_file = write_imbalanced(tmp_path / "validation.tsv", 18, 2, 1)
    argv = ["layermix", "--train", str(train_file), "--validation", str(validation_file), "--task", "s",
            "--backbone", str(train_backbone_dir), "--epochs", "1", "--no-progress"]
    assert main([*argv, "--run-dir", str(tmp_path / "plain")]) == 0
    said = ("the labels are imbalanced ('pos' holds 45 of the 50 training rows, 90%; 'neg' 5): accuracy, which "
            "chooses the epoch, rewards answering the frequent label; --metric mcc (or f1_macro) chooses it on every "
            "class, and --class-weights balanced trains on every class alike")
    assert f"{train_file}: {said}" in capsys.readouterr().err
    assert main([*argv, "--run-dir", str(tmp_path / "mcc"), "--metric", "mcc"]) == 0
    assert "the labels are imbalanced" not in capsys.readouterr().err  # a metric chosen: its choice
    losses, learners = [], []
    task_loss = trainer.task_loss
    monkeypatch.setattr(trainer, "task_loss", lambda logits, targets, weights=None: losses.append(weights) or
                        task_loss(logits, targets, weights))
    from training import baselines
    fit_on_tfidf = baselines.fit_on_tfidf
    monkeypatch.setattr(baselines, "fit_on_tfidf", lambda learner, *args: learners.append(learner) or
                        fit_on_tfidf(learner, *args))
    assert main([*argv, "--run-dir", str(tmp_path / "balanced"), "--class-weights", "balanced"]) == 0
    assert [learner.class_weight for learner in learners] == ["balanced"]  # the linear baseline weighed alike
    assert "the labels are imbalanced" not in capsys.readouterr().err
    labels = ModuleStore(tmp_path / "balanced" / "store").read_manifest("s").labels
    expected = {"pos": 50 / (2 * 45), "neg": 50 / (2 * 5)}
    assert losses and all(w is not None and w.tolist() == pytest.approx([expected[label] for label in labels])
                          for w in losses)
    assert "- trained with balanced class weights" in (tmp_path / "balanced" / "report" / "report.md").read_text()
    assert ModuleStore(tmp_path / "balanced" / "store").read_manifest("s").metrics["baselines"]["class_weights"] == \
        "balanced"
    conll = write_conll(tmp_path / "ner.txt", 20, 0)
    assert main(["layermix", "--train", str(conll), "--split", "0.25", "--task", "n", "--class-weights", "balanced",
                 "--backbone", str(train_backbone_dir), "--run-dir", str(tmp_path / "ner")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "tmod-train layermix: error: --class-weights balanced: only single-label sequence tasks (multi-label tasks "
        "choose each label's threshold on validation; token tasks are scored on their entities)")


def test_class_weights_count_the_training_rows_of_each_class():
    from training.trainer import class_weights

    split = type("S", (), {"label_ids": [0] * 9 + [2] * 3, "labels": ["a", "b", "c"]})()
    weights = class_weights(split, TrainSettings(class_weights="balanced"), "cpu")
    assert weights.tolist() == pytest.approx([12 / (2 * 9), 1.0, 12 / (2 * 3)])  # b: no row, weight 1
    assert class_weights(split, TrainSettings(), "cpu") is None
