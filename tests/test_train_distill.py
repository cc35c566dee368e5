"""Knowledge distillation (training/distill.py): a stored module teaches a token head its word
tags, aligned by data word across two backbones' tokenizations, on tiny random backbones."""
from __future__ import annotations

import random
import re

import numpy as np
import pytest

from modules_store import ModuleStore
from server.backbone import Backbone
from server.engine import Engine
from server.modules import load_module
from training.cli import build_parser, main
from training.data.conll import read_conll
from training.data.word_tags import word_first_tokens
from training.distill import DistillTargets, teacher_words
from training.evaluate import score_module
from training.settings import TrainSettings
from training.states import Split
from training.trainer import add_document_windows, train
from tests.helpers import make_tiny_backbone_dir

PEOPLE, PLACES = ["Alice", "Bob", "Carol", "Dave"], ["Paris", "Berlin", "Rome", "Oslo"]
SWAP = {"B-PER": "B-LOC", "I-PER": "I-LOC", "B-LOC": "B-PER", "I-LOC": "I-PER"}


def write_conll(path, n, seed, swapped=False, documents=1):
    """n sentences in `documents` documents; `swapped`: people tagged as places and places as people
    (what a teacher that disagrees with the gold tags was trained on)."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        if i % max(1, n // documents) == 0:
            lines += ["-DOCSTART- -X- -X- O", ""]
        sentence = [(rng.choice(PEOPLE), "B-PER"), ("went", "O"), ("to", "O"), (rng.choice(PLACES), "B-LOC")]
        if rng.random() < 0.5:  # a word the tokenizer cuts into several pieces, then a two-word name
            sentence += [("via", "O"), ("U.S.", "B-MISC"), ("with", "O"), (rng.choice(PEOPLE), "B-PER"), ("Smith", "I-PER")]
        lines += [f"{w} X X {SWAP.get(t, t) if swapped else t}" for w, t in sentence + [(".", "O")]] + [""]
    path.write_text("\n".join(lines))
    return path


@pytest.fixture(scope="module")
def teacher_backbone_dir(tmp_path_factory):
    """The teacher's backbone: a tiny MPNet (its own token layout: <s> ... </s>), not the student's."""
    return make_tiny_backbone_dir(tmp_path_factory.mktemp("teacher_backbone"), "mpnet", layers=2, seed=1)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill_data")
    return {"train": write_conll(root / "train.txt", 60, 0, documents=3),
            "validation": write_conll(root / "validation.txt", 20, 1),
            "swapped_train": write_conll(root / "swapped_train.txt", 60, 0, swapped=True, documents=3),
            "swapped_validation": write_conll(root / "swapped_validation.txt", 20, 1, swapped=True)}


def tiny_settings(tmp_path, train_file, validation_file, backbone_dir, **extra) -> TrainSettings:
    return TrainSettings(train=str(train_file), validation=str(validation_file), backbone=str(backbone_dir),
                         task="ner", store=str(tmp_path / "store"), report_dir=str(tmp_path / "report"),
                         project_dim=16, ffn_dim=32, lr=0.01, batch_size=8, alpha=4, patience=20, progress=False, threads=1,
                         labels=["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-MISC", "I-MISC"], **extra)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, files, teacher_backbone_dir):
    """A teacher module on the tiny MPNet that learned the SWAPPED tags (people as places and back),
    so a student can only answer as it does by listening to it. Returns its version folder."""
    root = tmp_path_factory.mktemp("teacher")
    settings = tiny_settings(root, files["swapped_train"], files["swapped_validation"], teacher_backbone_dir,
                             epochs=8, casing=True)
    result = train(settings)
    assert result.metrics["f1"] > 0.9  # it learned what it teaches
    return root / "store" / "ner" / "1"


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TMOD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_teacher_logits_of_each_row_sit_on_the_students_first_piece_of_the_same_word(
        tmp_path, files, teacher, teacher_backbone_dir, train_backbone, cache_dir):
    words = teacher_words(str(teacher), files["train"], str(teacher_backbone_dir), progress=False)
    assert not words.about["from_cache"] and words.about["teacher"] == "ner/1"
    assert (cache_dir / "teacher").is_dir()
    again = teacher_words(str(teacher), files["train"], str(teacher_backbone_dir), progress=False)
    assert again.about["from_cache"] and np.array_equal(again.logits, words.logits)

    # the reference: the teacher module run on each training sentence alone, each word read at the
    # first of its pieces in the TEACHER's tokenization, found by character offsets
    teacher_backbone = Backbone.load(teacher_backbone_dir)
    module = load_module(ModuleStore(teacher.parent.parent), "ner", "1", teacher_backbone)
    reference = {}
    for sentence in read_conll(files["train"]).examples:
        encoded = teacher_backbone.encode([sentence.text])[0]
        logits = Engine(teacher_backbone).logits(teacher_backbone.collate([encoded]), {"ner": module})["ner"][0]
        starts = {encoded.offsets[t][0]: t for t in reversed(range(len(encoded))) if encoded.sequence_ids[t] == 0}
        for w, (start, _) in enumerate(sentence.spans):
            reference[sentence.file_offset + w] = logits[starts[start]].float().numpy()
    assert len(reference) == len(words.words)

    labels = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]
    data = read_conll(files["train"])
    data = add_document_windows(data, {"train_file": str(files["train"])}, train_backbone, [24])
    windows = [r for r, ex in enumerate(data.examples) if r >= 60]
    assert windows and any(data.examples[r].file_offset not in {ex.file_offset for ex in data.examples[:60]}
                           for r in windows)  # some windows start inside a sentence
    split = Split(data, labels, train_backbone)
    targets = DistillTargets(split, words, temperature=2.0, weight=0.5)
    order = [words.labels.index(label) for label in labels]
    rows = [0, 1, *windows[:6]]
    width = max(split.lengths[r] for r in rows)
    logits, mask = targets.batch(rows, width)
    for i, r in enumerate(rows):
        example = data.examples[r]
        first = word_first_tokens(split.encoded[r], example.spans)
        assert sorted(np.flatnonzero(mask[i].numpy())) == sorted(first)  # one position per word, its first piece
        for w, t in enumerate(first):
            np.testing.assert_allclose(logits[i, t].numpy(), reference[example.file_offset + w][order], atol=1e-4)

    shifted = read_conll(files["train"])
    shifted.examples[3].file_offset += 1  # a row that points at the wrong words is refused, not learned from
    with pytest.raises(ValueError, match="not a run of the training file's words"):
        DistillTargets(Split(shifted, labels, train_backbone), words, 2.0, 0.5)


def test_the_teacher_reads_only_the_sentences_a_run_trains_on_and_a_later_run_only_those_it_lacks(
        files, teacher, teacher_backbone_dir, cache_dir):
    """--max-train 800 of CoNLL's 14,041 sentences had the teacher tag all 14,041 (20 minutes on a CPU)."""
    data = read_conll(files["train"])
    spec, backbone = str(teacher), str(teacher_backbone_dir)
    first = teacher_words(spec, files["train"], backbone, progress=False, rows=data.examples[:20])
    assert (first.about["sentences"], first.about["sentences_tagged_now"]) == (20, 20)
    inside = np.zeros(len(first.words), dtype=bool)
    inside[:data.examples[20].file_offset] = True
    assert first.has_token[inside].all() and not first.has_token[~inside].any()

    whole = teacher_words(spec, files["train"], backbone, progress=False)  # every row: the other 40 only
    assert (whole.about["sentences"], whole.about["sentences_tagged_now"]) == (60, 40)
    assert not whole.about["from_cache"] and whole.has_token.all()
    np.testing.assert_array_equal(whole.logits[inside], first.logits[inside])
    fresh = teacher_words(spec, files["train"], backbone, progress=False, cache_dir=cache_dir / "elsewhere")
    np.testing.assert_allclose(whole.logits, fresh.logits, atol=1e-5)  # pieced together = read at once

    again = teacher_words(spec, files["train"], backbone, progress=False, rows=data.examples[10:30])
    assert again.about["from_cache"] and again.about["sentences_tagged_now"] == 0
    assert again.about["words"] == int(again.has_token.sum()) < len(again.words)


def test_a_teacher_stopped_midway_keeps_what_it_read_and_a_rerun_reads_only_the_rest(
        files, teacher, teacher_backbone_dir, cache_dir, monkeypatch, capsys):
    """Ctrl-C in a teacher's pass (CoNLL-2003 in bf16: 15 minutes) threw its logits away."""
    from training import distill
    whole = teacher_words(str(teacher), files["train"], str(teacher_backbone_dir), progress=False,
                          cache_dir=cache_dir / "whole")
    passes = distill.served_logits

    def stopped(*args, **kwargs):  # the second batch never comes: Ctrl-C
        batches = passes(*args, **kwargs)
        yield next(batches)
        raise KeyboardInterrupt

    monkeypatch.setattr(distill, "served_logits", stopped)
    with pytest.raises(KeyboardInterrupt):
        teacher_words(str(teacher), files["train"], str(teacher_backbone_dir), progress=False, batch_size=16)
    assert "teacher: stopped after 16 of 60 sentences; those are kept in " in capsys.readouterr().err
    monkeypatch.setattr(distill, "served_logits", passes)
    rerun = teacher_words(str(teacher), files["train"], str(teacher_backbone_dir), progress=False, batch_size=16)
    assert rerun.about["sentences_tagged_now"] == 44 and rerun.has_token.all()
    np.testing.assert_allclose(rerun.logits, whole.logits, atol=1e-5)


@pytest.mark.parametrize("trained_at, device, native_bf16, reads_at", [
    ("bf16", "cpu", False, "fp32"),  # emulated: 7.7x fp32's time on an AVX2 CPU, and served in fp32 there
    ("bf16", "cpu", True, "bf16"), ("fp16", "cpu", True, "fp32"), ("fp32", "cpu", True, "fp32"),
    ("bf16", "cuda", False, "bf16"), ("fp16", "cuda", False, "fp16"),
    ("auto", "cpu", False, "fp32"), ("auto", "cpu", True, "bf16"), ("auto", "cuda", False, "fp16")])
def test_the_teacher_reads_at_its_training_precision_where_the_device_has_it_natively(
        trained_at, device, native_bf16, reads_at, monkeypatch):
    from training import distill
    from server import config
    monkeypatch.setattr(distill, "cpu_has_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: native_bf16)
    assert distill.teacher_precision(trained_at, device) == reads_at


def test_the_student_learns_the_teachers_tags_with_the_kl_term_and_the_gold_tags_without_it(
        tmp_path, files, teacher, teacher_backbone_dir, train_backbone, train_backbone_dir, cache_dir):
    """The teacher says people are places; with weight 1 (KL only) the student answers as the teacher
    does, with weight 0 as the gold tags do. Dropping the KL term, or reading another word's teacher
    logits, fails the first half."""
    scores = {}
    for weight in (1.0, 0.0):
        run = tmp_path / f"w{weight}"
        settings = tiny_settings(run, files["train"], files["validation"], train_backbone_dir, epochs=8, casing=True,
                                 distill_from=str(teacher), distill_backbone=str(teacher_backbone_dir),
                                 distill_weight=weight, document_windows=[24],
                                 select="last")  # validation holds the gold tags: it must not choose the epoch
        result = train(settings, backbone=train_backbone)
        assert result.training["distillation"]["weight"] == weight
        # against the student's gold tags: the teacher's swapped people and places are wrong, the rest right
        assert 0.4 < result.training["distillation"]["teacher_train_word_accuracy"] < 0.8
        assert re.search(rf"^- distilled from ner/1 \(\S+, fp32; KL weight {weight}, temperature 2.0\): its most likely "
                         r"tag is the gold one for \d+\.\d% of the \d+ training words",
                         (run / "report" / "report.md").read_text(), re.M)
        module = load_module(ModuleStore(run / "store"), "ner", "1", train_backbone)
        swapped = Split(read_conll(files["swapped_validation"]), module.head.labels, train_backbone)
        scores[weight] = (result.metrics["f1"], score_module(swapped, module, progress=False)["f1"])
    gold_f1, teacher_f1 = scores[1.0]
    assert teacher_f1 > 0.85 and gold_f1 < 0.6, scores
    gold_f1, teacher_f1 = scores[0.0]
    assert gold_f1 > 0.85 and teacher_f1 < 0.6, scores


def test_distill_options_and_their_mistakes(tmp_path, files, train_backbone_dir, cache_dir, capsys):
    args = build_parser().parse_args(["layermix", "--distill-from", "ner/mpnet-2", "--distill-temperature", "3",
                                      "--distill-weight", "0.7"])
    assert (args.distill_from, args.distill_temperature, args.distill_weight) == ("ner/mpnet-2", 3.0, 0.7)
    help_text = build_parser()._subparsers._group_actions[0].choices["layermix"].format_help()
    assert "--distill-from" in help_text and "--distill-weight" in help_text
    common = ["layermix", "--train", str(files["train"]), "--validation", str(files["validation"]),
              "--backbone", str(train_backbone_dir), "--store", str(tmp_path / "store"), "--no-progress"]
    assert main([*common, "--distill-from", "ner/no-such-version"]) == 2
    assert "--distill-from 'ner/no-such-version': no such module" in capsys.readouterr().err
    assert main([*common, "--distill-from", "ner/mpnet-2", "--distill-weight", "1.5"]) == 2
    assert "--distill-weight" in capsys.readouterr().err
    table = tmp_path / "t.tsv"
    table.write_text("text\tlabel\na b\tx\nc d\ty\n")
    assert main(["layermix", "--train", str(table), "--validation", str(table), "--backbone", str(train_backbone_dir),
                 "--store", str(tmp_path / "store"), "--no-progress", "--distill-from", "ner/mpnet-2"]) == 2
    assert "only token tasks read from a CoNLL file" in capsys.readouterr().err
