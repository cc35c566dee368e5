"""`tmod-train` answers a user's mistake in one line with exit status 2, before any backbone is
loaded (Backbone.load fails these tests if called), and carves --split as documented."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from modules_store import TaskType
from server.backbone import Backbone
from training.cli import main
from training.data.cells import word_spans
from training.data.conll import read_conll
from training.data.examples import LabelledData, SequenceExample
from training.data.files import UsageError
from training.data.presets import file_spec
from training.splits import carve


@pytest.fixture(autouse=True)
def no_backbone(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a backbone was loaded before the inputs were checked")

    monkeypatch.setattr(Backbone, "load", refuse)


def write(path, text: str):
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.fixture
def tables(tmp_path):
    train = write(tmp_path / "train.tsv", "text\tlabel\nwhere is it ?\tLOC\nwho was he ?\tHUM\nwhat is that ?\tDESC\n")
    validation = write(tmp_path / "validation.tsv", "text\tlabel\nwho is she ?\tHUM\n")
    return tmp_path, train, validation


def one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tmod-train {argv[0]}: error: "), captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    return lines[0]


def train_args(tmp_path, *extra: str) -> list[str]:
    return ["layermix", *extra, "--run-dir", str(tmp_path / "run")]


def test_missing_training_file(tmp_path, capsys, tables):
    _, _, validation = tables
    line = one_line_error(capsys, train_args(tmp_path, "--train", str(tmp_path / "nope.tsv"), "--validation", validation))
    assert line.endswith(f"no such file: {tmp_path / 'nope.tsv'}") and "--data-dir" not in line


def test_unknown_column(tmp_path, capsys, tables):
    _, train, validation = tables
    line = one_line_error(capsys, train_args(tmp_path, "--train", train, "--validation", validation,
                                             "--text-column", "sentence"))
    assert "no column 'sentence'" in line and "['text', 'label']" in line


def test_empty_label_names_its_line(tmp_path, capsys, tables):
    _, train, _ = tables
    bad = write(tmp_path / "bad.tsv", "text\tlabel\nfine\tHUM\nno label here\t \n")
    line = one_line_error(capsys, train_args(tmp_path, "--train", train, "--validation", bad))
    assert line.endswith(f"{bad}:3: empty label")


def test_a_label_column_of_text_is_refused(tmp_path, capsys):
    rows = "".join(f"{i}\tsentence number {i} here\tsentence {i} there\t{'yes' if i % 2 else 'no'}\n" for i in range(40))
    train = write(tmp_path / "pairs.tsv", "index\tfirst\tsecond\tgold\n" + rows)
    # a label column of sentences: every row is its own label
    line = one_line_error(capsys, train_args(tmp_path, "--train", train, "--split", "0.2", "--text-column", "first",
                                             "--label-column", "second"))
    assert "pairs.tsv: 40 different labels in 40 rows ('sentence 0 there'," in line
    assert "the label column ('second') looks like text" in line
    # none named, and no column repeats: column 1, refused as text, the default said
    two = write(tmp_path / "two.csv", "first,second\n" + "".join(f"sentence {i} here,sentence {i} there\n" for i in range(40)))
    line = one_line_error(capsys, train_args(tmp_path, "--train", two, "--split", "0.2"))
    assert ("the label column (the default: the header's 'label', else the column of fewest different values) looks "
            "like text; name the labels' column with --label-column") in line


def test_with_no_label_column_named_the_column_of_fewest_values_is_read_and_said(tmp_path, capsys):
    """A spreadsheet's `id,review,sentiment` (no column named label): column 1, the reviews, was read as
    the labels and the sentiments as the texts, and the first empty sentiment was refused as an "empty
    text". The column whose cells repeat most is the labels' (an id or a text does not repeat), said;
    column 1 where it is that column, unsaid, as before."""
    rows = [(i, f"a {'fine' if i % 2 else 'dull'} film, number {i}", "pos" if i % 2 else "neg") for i in range(12)]
    table = write(tmp_path / "reviews.csv", "id,review,sentiment\n" + "".join(f'{i},"{r}",{y}\n' for i, r, y in rows))
    data = file_spec(table).read()
    assert [(ex.text, ex.label) for ex in data.examples] == [(r, y) for _, r, y in rows]
    err = capsys.readouterr().err
    assert "labels read from column 'sentiment' (the fewest different values; no column is named 'label')" in err
    assert "texts read from column 'review' (the longest" in err
    plain = write(tmp_path / "plain.tsv", "".join(f"{i}\t{r}\t{y}\n" for i, r, y in rows))  # no header
    assert [(ex.text, ex.label) for ex in file_spec(plain, header=False).read().examples] == [(r, y) for _, r, y in rows]
    assert "labels read from column 2" in capsys.readouterr().err
    usual = write(tmp_path / "usual.tsv", "".join(f"{r}\t{y}\n" for _, r, y in rows))  # text, label: as before
    assert file_spec(usual, header=False).read().examples[0].label == "neg" and capsys.readouterr().err == ""
    # the same table as JSONL: was refused as "no key 'label' in ['id', 'review', 'sentiment']"
    lines = "".join(json.dumps({"id": i, "review": r, "sentiment": y}) + "\n" for i, r, y in rows)
    data = file_spec(write(tmp_path / "reviews.jsonl", lines)).read()
    assert [(ex.text, ex.label) for ex in data.examples] == [(r, y) for _, r, y in rows]
    assert "labels read from key 'sentiment' (the fewest different values; no key is named 'label')" in \
        capsys.readouterr().err
    named = file_spec(table, text_column="review", label_column="id").read()  # named columns are read as named
    assert named.examples[0].label == "0" and "labels read" not in capsys.readouterr().err


def test_rows_with_an_empty_text_or_label_are_named_together(tmp_path, capsys):
    """Only the first such row was named: a file with ten unlabelled rows took ten runs to mend."""
    rows = "".join(f"text {i},{'' if i in (2, 5) else i % 2}\n" for i in range(9)) + ",1\n"
    table = write(tmp_path / "gaps.csv", "text,label\n" + rows)
    line = one_line_error(capsys, ["layermix", "--train", str(table), "--split", "0.34", "--task", "t"])
    assert line.endswith(f"{table}: 3 rows with an empty text or label (4: empty label; 7: empty label; "
                         "11: empty text): fill them in or remove them")
    records = write(tmp_path / "gaps.jsonl", "".join(json.dumps({"text": f"t {i}", "label": "" if i == 1 else "a"}) + "\n"
                                                      for i in range(4)))
    assert one_line_error(capsys, ["layermix", "--train", str(records), "--split", "0.34", "--task", "t"]).endswith(
        f"{records}:2: empty label")


def test_a_training_file_with_one_label_is_refused(tmp_path, capsys):
    train = write(tmp_path / "one.csv", "text,label\n" + "".join(f"sentence {i},yes\n" for i in range(30)))
    line = one_line_error(capsys, train_args(tmp_path, "--train", train, "--split", "0.2"))
    assert line.endswith("one.csv: every row is labelled 'yes': a classifier learns to tell two or more labels apart "
                         "(is --label-column the right column?)")


def test_a_split_that_would_train_on_under_half_the_file_is_refused(tmp_path, capsys):
    """`--split 0.8` meant as the training share held out 80% and trained on a fifth, without a word."""
    train = write(tmp_path / "t.csv", "text,label\n" + "".join(f"sentence {i},{i % 2}\n" for i in range(30)))
    line = one_line_error(capsys, train_args(tmp_path, "--train", train, "--split", "0.8"))
    assert line == ("tmod-train layermix: error: --split: 0.8 holds out 80% of the file and trains on 20%: it gives the "
                    "held-out fractions, VALIDATION[,TEST] (e.g. 0.1 or 0.1,0.1); to train on fewer rows, --max-train N")
    line = one_line_error(capsys, train_args(tmp_path, "--train", train, "--split", "1.5"))
    assert line.endswith("--split: give one or two fractions between 0 and 1 that sum to under 1: VALIDATION[,TEST]")


def test_a_table_whose_header_names_text_and_label_needs_no_column_options(tmp_path):
    table = write(tmp_path / "t.csv", "id,label,text\n1,yes,a fine day\n2,no,a dull day\n")
    spec = file_spec(table)
    assert [(ex.text, ex.label) for ex in spec.read().examples] == [("a fine day", "yes"), ("a dull day", "no")]
    no_names = write(tmp_path / "u.csv", "sentence,gold\na fine day,yes\n")
    assert [(ex.text, ex.label) for ex in file_spec(no_names).read().examples] == [("a fine day", "yes")]


def test_a_json_list_of_labels_needs_multi_label(tmp_path, capsys):
    rows = [{"text": "what a day", "labels": ["joy", "surprise"]}, {"text": "fine", "labels": ["neutral"]}]
    train = write(tmp_path / "emo.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    # without --multi-label, "labels" where no "label" is: refused as a list, never trained as the label '["joy", ...]'
    for named in ((), ("--label-column", "labels")):
        line = one_line_error(capsys, train_args(tmp_path, "--train", train, "--split", "0.5", *named))
        assert line.endswith(f'{train}:1: the label is a list (["joy", "surprise"]): give --multi-label for a task '
                             "whose texts have any number of labels")


def hf_rows(path, rows) -> str:
    """A Hugging Face token-classification dataset as `Dataset.to_json` writes it."""
    return write(path, "".join(json.dumps({"id": str(i), "tokens": words, "ner_tags": tags}) + "\n"
                               for i, (words, tags) in enumerate(rows)))


def test_jsonl_word_lists_are_a_token_task_like_a_conll_file(tmp_path):
    """`tokens` + `ner_tags` (numbers named by --label-map, or names) read as the same CoNLL file reads."""
    conll = write(tmp_path / "t.conll", "Angela B-PER\nMerkel I-PER\nvisited O\nParis B-LOC\n\nOK O\n")
    numbered = hf_rows(tmp_path / "t.jsonl", [(["Angela", "Merkel", "visited", "Paris"], [1, 2, 0, 5]), (["OK"], [0])])
    named = write(tmp_path / "n.jsonl", json.dumps({"words": ["Angela", "Merkel", "visited", "Paris"],
                                                    "tags": ["B-PER", "I-PER", "O", "B-LOC"]}) + "\n")
    want = read_conll(conll)
    got = file_spec(numbered, label_map={"0": "O", "1": "B-PER", "2": "I-PER", "5": "B-LOC"}).read()
    assert got.task_type == TaskType.token_classification
    assert [(ex.words, ex.tags) for ex in got.examples] == [(ex.words, ex.tags) for ex in want.examples]
    assert got.texts() == want.texts() and got.examples[0].spans == want.examples[0].spans
    first = file_spec(named, text_column="words", label_column="tags").read().examples[0]
    assert (first.words, first.tags) == (want.examples[0].words, want.examples[0].tags)


@pytest.mark.parametrize("rows, extra, expected", [
    ([(["Paris", "is"], [5, 0]), (["Bob"], [1])], (), ": the tags are class ids (0, 1, 5): name them with --labels "
     "O,B-PER,I-PER,... in their order"),
    ([(["Paris", "is"], ["B-LOC"])], (), ":1: 2 words need a list of 2 tags, got [\"B-LOC\"]"),
    ([(["Paris", " "], ["B-LOC", "O"])], (), ':1: word 1 is " ": a word is a non-empty string without surrounding spaces'),
    ([(["Paris"], ["B-LOC"]), (["ok"], ["O"])], ("--document-windows", "128"),
     "--document-windows: only token tasks read from a CoNLL file"),
])
def test_jsonl_word_list_mistakes_are_one_line(tmp_path, capsys, rows, extra, expected):
    train = hf_rows(tmp_path / "t.jsonl", rows)
    line = one_line_error(capsys, train_args(tmp_path, "--train", train, "--validation", train, *extra))
    assert expected in line


def test_class_ids_are_named_by_their_place_in_labels(tmp_path, capsys):
    """A Hugging Face export's ids with the dataset's names in --labels: tags and labels named by
    position; labels that are themselves names (star ratings 1-5) are left as they are."""
    from training.splits import resolve_data
    from training.settings import TrainSettings

    tags = hf_rows(tmp_path / "t.jsonl", [row for i in range(3) for row in (  # distinct texts: --split keeps a text's rows together
        (["Angela", "Merkel", "in", f"Paris{i}"], [1, 2, 0, 5]), ([f"OK{i}"], [0]))])
    names = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC"]
    data = resolve_data(TrainSettings(train=tags, split=[0.34], labels=names))
    assert data.labels == names
    assert {tuple(ex.tags) for ex in data.train.examples + data.validation.examples} == {
        ("B-PER", "I-PER", "O", "B-LOC"), ("O",)}
    stars = write(tmp_path / "stars.tsv", "text\tlabel\n" + "".join(f"review {i}\t{1 + i % 5}\n" for i in range(20)))
    data = resolve_data(TrainSettings(train=stars, split=[0.25], labels=["1", "2", "3", "4", "5"]))
    assert {ex.label for ex in data.train.examples} == {"1", "2", "3", "4", "5"}
    sentiment = write(tmp_path / "s.jsonl", "".join(json.dumps({"text": f"text {i}", "label": i % 2}) + "\n"
                                                      for i in range(8)))
    data = resolve_data(TrainSettings(train=sentiment, split=[0.25], labels=["negative", "positive"]))
    assert {ex.label for ex in data.train.examples} == {"negative", "positive"}


def test_jsonl_mixing_texts_and_word_lists_is_one_line(tmp_path, capsys):
    train = write(tmp_path / "m.jsonl", json.dumps({"tokens": ["Paris"], "ner_tags": ["B-LOC"]}) + "\n"
                  + json.dumps({"text": "a text", "label": "x"}) + "\n")
    line = one_line_error(capsys, train_args(tmp_path, "--train", train, "--split", "0.5"))
    assert line.endswith(f"{train}:2: a labelled text where the first record had tagged words")


def test_entity_spans_of_annotation_tools_read_as_tagged_words(tmp_path):
    """doccano's [start, end, label] lists (and its start_offset / end_offset records), spaCy's and
    Prodigy's spans: a text's entities as characters become its words' BIO tags, the words split as
    the server's tokenizer splits them; a text without entities is all O."""
    text = "Angela Merkel visited Munich's U.S. office (New York)."
    at = {name: (text.index(name), text.index(name) + len(name)) for name in ("Angela Merkel", "Munich", "U.S.", "New York")}
    rows = [
        {"text": text, "label": [[*at["Angela Merkel"], "PER"], [*at["New York"], "LOC"], [*at["U.S."], "LOC"]]},
        {"id": 7, "text": text, "entities": [{"id": 1, "start_offset": at["U.S."][0], "end_offset": at["U.S."][1] + 1,
                                              "label": "LOC"}]},  # a trailing space inside the span: trimmed
        {"text": "Nothing here.", "spans": []},
        {"text": text, "label": [{"start": 0, "end": 13, "text": "Angela Merkel", "labels": ["PER"]}]},  # Label Studio
    ]
    path = write(tmp_path / "doccano.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    data = file_spec(path).read()
    assert data.task_type == TaskType.token_classification
    first, second, third, fourth = data.examples
    assert fourth.tags[:3] == ["B-PER", "I-PER", "O"] and set(fourth.tags[2:]) == {"O"}
    assert first.words == ["Angela", "Merkel", "visited", "Munich", "'", "s", "U", ".", "S", ".", "office", "(", "New",
                           "York", ")", "."]
    assert first.tags == ["B-PER", "I-PER", "O", "O", "O", "O", "B-LOC", "I-LOC", "I-LOC", "I-LOC", "O", "O", "B-LOC",
                          "I-LOC", "O", "O"]
    assert second.tags[6:10] == ["B-LOC", "I-LOC", "I-LOC", "I-LOC"] and second.tags.count("O") == len(second.tags) - 4
    assert (third.words, third.tags) == (["Nothing", "here", "."], ["O", "O", "O"])


def test_word_splitting_is_the_tokenizers(minilm_tokenizer_texts):
    """The words spans are tagged on start where MiniLM's tokenizer starts its words, on SST-2 and RTE
    texts and awkward ones (CJK, symbols, accents)."""
    tokenizer, texts = minilm_tokenizer_texts
    for text in texts:
        encoding = tokenizer.encode(text, add_special_tokens=False)
        starts = {}
        for word, (start, _) in zip(encoding.word_ids, encoding.offsets):
            starts.setdefault(word, start)
        assert [start for start, _ in word_spans(text)] == list(starts.values()), text


@pytest.fixture
def minilm_tokenizer_texts():
    import csv

    from transformers import AutoTokenizer

    from server.backbone.sources import default_backbone_path
    from training.data.files import default_data_dir

    tokenizer = AutoTokenizer.from_pretrained(default_backbone_path(), local_files_only=True)._tokenizer
    tokenizer.no_truncation()
    tokenizer.no_padding()
    with open(default_data_dir() / "sst2" / "validation.tsv", encoding="utf-8", newline="") as f:
        texts = [row[0] for row in list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]]
    with open(default_data_dir() / "rte" / "dev.tsv", encoding="utf-8") as f:
        texts += [line.split("\t")[1] for line in f.read().splitlines()[1:]]
    return tokenizer, texts + ["東京は日本の首都です。 北京 서울", "naïve café — 🙂 ok_go ~x $5 @home #tag ½ ©2020 x²",
                               "e\u0301te\u0301 à la carte", "tab\tsep  double  spaces"]


def test_conllu_files_and_comment_lines_are_read_as_words_and_their_tags(tmp_path, capsys):
    """Universal Dependencies' CoNLL-U (the ID first, the tag the last column's MISC) and MultiCoNER's
    "# id ..." lines were read as words "1", "2", ... tagged "_", and a word "#" tagged "domain=en"."""
    ud = write(tmp_path / "en_ewt-ud-train.conllu", "# sent_id = 1\n# text = The dogs run.\n"
               "1\tThe\tthe\tDET\tDT\t_\t2\tdet\t_\t_\n2\tdogs\tdog\tNOUN\tNNS\t_\t3\tnsubj\t_\t_\n"
               "3\trun\trun\tVERB\tVBP\t_\t0\troot\t_\tSpaceAfter=No\n4\t.\t.\tPUNCT\t.\t_\t3\tpunct\t_\t_\n\n"
               "# sent_id = 2\n1-2\tdon't\t_\t_\t_\t_\t_\t_\t_\t_\n1\tdo\tdo\tAUX\tVBP\t_\t3\taux\t_\t_\n"
               "2\tn't\tnot\tPART\tRB\t_\t3\tadvmod\t_\t_\n3\tgo\tgo\tVERB\tVB\t_\t0\troot\t_\t_\n"
               "3.1\tgo\tgo\tVERB\tVB\t_\t_\t_\t_\t_\n")
    data = file_spec(ud).read()
    assert [(ex.words, ex.tags) for ex in data.examples] == [
        (["The", "dogs", "run", "."], ["DET", "NOUN", "VERB", "PUNCT"]), (["do", "n't", "go"], ["AUX", "PART", "VERB"])]
    assert "CoNLL-U (ten columns): each word (FORM) tagged with its part of speech (UPOS)" in capsys.readouterr().err
    multiconer = write(tmp_path / "en_train.conll", "# id 5c1e4f domain=en\nthe _ _ O\nsoho _ _ B-LOC\n# _ _ O\n\n")
    assert [(ex.words, ex.tags) for ex in file_spec(multiconer).read().examples] == [
        (["the", "soho", "#"], ["O", "B-LOC", "O"])]  # a word "#" stays a word


def test_a_tag_column_holding_words_is_one_line(tmp_path, capsys):
    """WikiNER's sentence a line of word|POS|tag tokens, read as CoNLL: each line one "word" tagged with its
    last token, hundreds of tags seen once, trained on silently."""
    wikiner = write(tmp_path / "aij-wikiner-en-wp2.txt", "".join(f"The|DT|O city|NN|O of|IN|O Paris{i}|NNP|I-LOC "
                                                                 f"is|VBZ|O big{i}|JJ|O\n" for i in range(150)))
    line = one_line_error(capsys, train_args(tmp_path, "--train", wikiner, "--split", "0.2"))
    assert "150 different tags, 150 of them on one word only ('big0|JJ|O', 'big1|JJ|O', 'big2|JJ|O', ...): words, " \
        "not tags" in line
    assert line.endswith("sed -E 's/ +/\\n/g; s/\\|[^|]*\\|/ /g; s/$/\\n/' FILE > FILE.conll)")


def test_spacy_training_examples_are_read_as_their_spans_or_categories(tmp_path, capsys):
    """spaCy's [text, {"entities": ...}] / [text, {"cats": ...}] list, as its v2 docs and tutorials save
    TRAIN_DATA: read was the line "no key list indices must be integers or slices, not str in [...]"."""
    text = "Angela Merkel visited Munich."
    entities = write(tmp_path / "ner.json", json.dumps([[text, {"entities": [[0, 13, "PER"], [22, 28, "LOC"]]}],
                                                        ["Nothing here.", {"entities": []}]]))
    data = file_spec(entities).read()
    assert [(ex.words, ex.tags) for ex in data.examples] == [
        (["Angela", "Merkel", "visited", "Munich", "."], ["B-PER", "I-PER", "O", "B-LOC", "O"]),
        (["Nothing", "here", "."], ["O", "O", "O"])]
    assert "spaCy's training examples" in capsys.readouterr().err
    cats = [["I loved it", {"cats": {"POS": 1.0, "NEG": 0.0}}], ["I hated it", {"cats": {"POS": 0.0, "NEG": 1.0}}],
            ["so-so", {"cats": {"POS": 1.0, "NEG": 1.0}}]]
    categories = write(tmp_path / "cats.json", json.dumps(cats[:2]))
    assert [(ex.text, ex.label) for ex in file_spec(categories).read().examples] == [("I loved it", "POS"),
                                                                                     ("I hated it", "NEG")]
    both = write(tmp_path / "both.json", json.dumps(cats))
    assert [ex.label for ex in file_spec(both, multi_label=True).read().examples] == [("POS",), ("NEG",), ("POS", "NEG")]
    with pytest.raises(UsageError, match=r"record 2: the label is a list \(\["):  # several, without --multi-label
        file_spec(both).read()
    capsys.readouterr()
    docbin = write(tmp_path / "train.spacy", "\x83")  # spaCy v3's binary DocBin: the command that converts it
    line = one_line_error(capsys, train_args(tmp_path, "--train", docbin, "--split", "0.5"))
    assert "a spaCy DocBin is not read; write its docs as JSONL first: python -c \"import json, spacy; " in line
    assert "DocBin().from_disk('train.spacy')" in line and line.endswith("--label-column entities (a token task) or "
                                                                        "labels (its categories)")
    records = write(tmp_path / "pairs.json", json.dumps([[1, 2], [3, 4]]))
    line = one_line_error(capsys, train_args(tmp_path, "--train", records, "--split", "0.5"))
    assert line.endswith(f'{records}: record 0: a record is a JSON object ({{"text": ..., "label": ...}}), not [1, 2]')


def test_prodigy_answers_other_than_accept_are_skipped_and_its_choices_read(tmp_path, capsys):
    """Prodigy's db-out: a rejected or ignored example was learnt as if accepted; a choice recipe's
    labels are under "accept"; a binary answer (reject of one label) cannot be a label: refused."""
    text = "Angela Merkel visited Munich."
    spans = [{"start": 0, "end": 13, "label": "PER", "token_start": 0, "token_end": 1}, {"start": 22, "end": 28, "label": "LOC"}]
    rows = [{"text": text, "spans": spans, "answer": "accept", "_view_id": "ner_manual"},
            {"text": "Olaf Scholz saw Rome.", "spans": [{"start": 0, "end": 4, "label": "LOC"}], "answer": "reject"},
            {"text": "Nobody here.", "spans": [], "answer": "ignore"}]
    ner = write(tmp_path / "ner.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    assert [ex.tags for ex in file_spec(ner).read().examples] == [["B-PER", "I-PER", "O", "B-LOC", "O"]]
    assert capsys.readouterr().err == (f"{ner}: 2 Prodigy records not accepted (1 reject, 1 ignore): skipped, not "
                                       "annotations\n")
    options = [{"id": "POS", "text": "positive"}, {"id": "NEG", "text": "negative"}]
    rows = [{"text": "I loved it", "options": options, "accept": ["POS"], "answer": "accept"},
            {"text": "I hated it", "options": options, "accept": ["NEG"], "answer": "accept"}]
    choices = write(tmp_path / "cat.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    assert [(ex.text, ex.label) for ex in file_spec(choices).read().examples] == [("I loved it", "POS"),
                                                                                  ("I hated it", "NEG")]
    rows = [{"text": "I loved it", "label": "POS", "answer": "accept"}, {"text": "dull", "label": "POS", "answer": "reject"}]
    binary = write(tmp_path / "bin.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(UsageError, match=r"bin.jsonl:2: a Prodigy binary answer \(reject of the label 'POS'\)"):
        file_spec(binary).read()
    rows = [{"text": "is it?", "label": "q", "answer": {"text": "yes"}}, {"text": "no.", "label": "a", "answer": "reject"}]
    other = write(tmp_path / "qa.jsonl", "".join(json.dumps(row) + "\n" for row in rows))  # "answer" of another kind
    assert [ex.label for ex in file_spec(other).read().examples] == ["q", "a"]
    mixed = write(tmp_path / "mixed.json", json.dumps([{"text": "ok", "label": "a", "answer": "ignore"}, ["no", "b"]]))
    with pytest.raises(UsageError, match=r"record 1: a record is a JSON object"):  # not a traceback
        file_spec(mixed).read()


@pytest.mark.parametrize("spans, expected", [
    ([[7, 11, "PER"]], "entity [7, 11, \"PER\"] ('Merk') starts or ends inside the word 'Merkel'"),
    ([[0, 13, "PER"], [7, 21, "X"]], "overlaps another"),
    ([[0, 99, "PER"]], "is not a span of the text (28 characters)"),
])
def test_entity_span_mistakes_are_one_line(tmp_path, capsys, spans, expected):
    row = {"text": "Angela Merkel visited Paris.", "label": spans}
    train = write(tmp_path / "d.jsonl", json.dumps(row) + "\n")
    line = one_line_error(capsys, train_args(tmp_path, "--train", train, "--validation", train))
    assert f"{train}:1: " in line and expected in line


def test_a_conll_file_named_tsv_is_not_trained_as_one_word_sentences(tmp_path, capsys):
    """BioBERT's NER sets ship as train.tsv in CoNLL's layout: read as a table, each word would be a
    text and its tag a class."""
    train = write(tmp_path / "train.tsv", "".join(f"Famil{i}\tO\nadenomatous\tB-Disease\npolyposis\tI-Disease\ncoli\tI-Disease\n\n"
                                                  f"In\tO\nthe\tO\ngene{i}\tO\n.\tO\n\n" for i in range(3)))
    line = one_line_error(capsys, train_args(tmp_path, "--train", train, "--split", "0.3"))
    assert "one word a row with BIO tags ('B-Disease', 'I-Disease', 'O', ...): a CoNLL file" in line
    assert line.endswith("give --format conll to train a token task")
    with pytest.raises(AssertionError, match="a backbone was loaded"):  # as CoNLL, its checks pass
        main(train_args(tmp_path, "--train", train, "--split", "0.5", "--format", "conll"))


def test_a_csv_file_separated_by_semicolons_reads_as_with_commas(tmp_path):
    """What a spreadsheet in a comma-decimal locale (German, French) saves as CSV."""
    commas = write(tmp_path / "c.csv", 'text,label\n"a fine day, really",yes\na dull day,no\n')
    semicolons = write(tmp_path / "s.csv", 'text;label\n"a fine day; really";yes\na fine day, really;yes\na dull day;no\n')
    assert [(ex.text, ex.label) for ex in file_spec(semicolons).read().examples] == [
        ("a fine day; really", "yes"), ("a fine day, really", "yes"), ("a dull day", "no")]
    assert [ex.text for ex in file_spec(commas).read().examples] == ["a fine day, really", "a dull day"]


def test_multi_label_cells_separated_by_bars_or_semicolons(tmp_path):
    """MovieLens's genres ("Action|Comedy"): where no cell holds a comma, `|` (or `;`) separates labels."""
    bars = write(tmp_path / "m.tsv", "text\tlabel\nToy Story\tAdventure|Animation|Comedy\nHeat\tAction\nNone\t\n")
    assert [ex.label for ex in file_spec(bars, multi_label=True).read().examples] == [
        ("Adventure", "Animation", "Comedy"), ("Action",), ()]
    mixed = write(tmp_path / "c.tsv", "text\tlabel\na\tjoy,love\nb\tRock|Pop\n")  # a comma somewhere: commas
    assert [ex.label for ex in file_spec(mixed, multi_label=True).read().examples] == [("joy", "love"), ("Rock|Pop",)]


def test_labels_joining_others_are_said_to_be_perhaps_multi_label(tmp_path, capsys):
    """GoEmotions' files without --multi-label: "4,27" was learnt as a class of its own, unsaid."""
    ids = write(tmp_path / "g.tsv", "ok then\t27\nyou know\t4,27\nso sad\t25\nsad, really\t25\n")
    assert [ex.label for ex in file_spec(ids, header=False).read().examples] == ["27", "4,27", "25", "25"]
    said = capsys.readouterr().err
    assert f"{ids}: 1 of the 3 labels join others ('4,27' is '4' and '27')" not in said  # '4' is no label here
    genres = write(tmp_path / "m.tsv", "text\tlabel\nToy Story\tAnimation|Comedy\nHeat\tAction\nCars\tComedy\n"
                                       "Up\tAnimation\nWall-E\tAnimation|Comedy\n")
    file_spec(genres).read()
    assert capsys.readouterr().err == (f"{genres}: 1 of the 4 labels join others ('Animation|Comedy' is 'Animation' "
                                       "and 'Comedy'), learnt as classes of their own: if a text can have several "
                                       "labels, --multi-label reads each cell as its labels\n")
    file_spec(genres, multi_label=True).read()
    sentences = write(tmp_path / "s.tsv", "text\tlabel\na\tyes\nb\tno\nc\tyes, no\n")  # 'yes, no' joins 2 labels
    file_spec(sentences).read()
    assert "1 of the 3 labels join others ('yes, no' is 'yes' and 'no')" in capsys.readouterr().err
    plain = write(tmp_path / "p.tsv", "text\tlabel\na\tyes\nb\tno, thanks\n")
    file_spec(plain).read()
    assert capsys.readouterr().err == ""


def test_multi_label_from_one_0_1_column_per_label(tmp_path, capsys):
    """Jigsaw's layout: the labels of a row are the names of its columns holding 1."""
    table = write(tmp_path / "toxic.csv", "id,comment_text,toxic,obscene,insult\n1,you fool,1,0,1\n2,nice work,0,0,0\n"
                                          "3,\"what, a mess\",1,1,0\n")
    data = file_spec(table, text_column="comment_text", label_column="toxic,obscene,insult", multi_label=True).read()
    assert data.task_type == TaskType.multi_label_classification
    assert [(ex.text, ex.label) for ex in data.examples] == [("you fool", ("toxic", "insult")), ("nice work", ()),
                                                            ("what, a mess", ("toxic", "obscene"))]
    rows = [{"text": "you fool", "toxic": True, "insult": 1}, {"text": "ok", "toxic": False, "insult": 0}]
    lines = write(tmp_path / "toxic.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    assert [ex.label for ex in file_spec(lines, label_column="toxic,insult", multi_label=True).read().examples] == [
        ("toxic", "insult"), ()]
    bad = write(tmp_path / "bad.csv", "text,toxic,insult\nyou fool,1,maybe\n")
    line = one_line_error(capsys, train_args(tmp_path, "--train", bad, "--split", "0.5", "--multi-label",
                                             "--label-column", "toxic,insult"))
    assert line.endswith(f"{bad}:2: column 'insult' holds 'maybe'; each of several --label-column columns says "
                         "whether its label is present: 0 or 1")


def test_a_score_column_is_refused_as_a_score_not_as_text(tmp_path, capsys):
    """STS-B's similarities: many different numbers are a regression target, which no head is."""
    rows = "".join(f"sentence number {i}\t{i * 0.173:.3f}\n" for i in range(30))
    train = write(tmp_path / "sts.tsv", "text\tlabel\n" + rows)
    line = one_line_error(capsys, train_args(tmp_path, "--train", train, "--split", "0.2"))
    assert "30 different numbers in 30 rows ('0.000', '0.173', '0.346', ...): a score to predict" in line


def test_a_table_named_txt_is_not_trained_as_one_long_sentence(tmp_path, capsys):
    """.txt means CoNLL: a text<TAB>label table would be read as words tagged with their line's label."""
    table = write(tmp_path / "reviews.txt", "a fine film\tpos\nnot good at all\tneg\n" * 4)
    line = one_line_error(capsys, train_args(tmp_path, "--train", table, "--validation", table))
    assert line.endswith("most lines hold a text with spaces before a tab ('a fine film'): a table (text, tab, label), "
                         "not a CoNLL file (one word a line); give --format tsv")


def test_a_json_file_holding_a_list_of_records_reads_as_its_lines_would(tmp_path, capsys):
    """pandas' to_json(orient="records"), indented or not: the same examples as the JSONL file."""
    rows = [{"text": "a fine day", "label": "yes"}, {"text": "a dull day", "label": "no"}]
    lines = file_spec(write(tmp_path / "r.jsonl", "".join(json.dumps(row) + "\n" for row in rows))).read()
    for indent in (None, 2):
        listed = file_spec(write(tmp_path / f"r{indent}.json", json.dumps(rows, indent=indent))).read()
        assert listed.examples == lines.examples
    broken = write(tmp_path / "b.json", '[{"text": "a", "label": "x"},\n {"text": "b" "label": "y"}]')
    line = one_line_error(capsys, train_args(tmp_path, "--train", broken, "--split", "0.5"))
    assert line.endswith(f"{broken}:2: not JSON (Expecting ',' delimiter)")


def test_labels_that_are_numbers_are_pointed_at_label_map(tmp_path, capsys):
    """A Hugging Face export's class ids ("label": 1) would be served as "1": said before training."""
    rows = [{"sentence": f"text {i}", "label": i % 12} for i in range(24)]
    train = write(tmp_path / "sst.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(AssertionError, match="a backbone was loaded"):  # the notice comes before the backbone
        main(train_args(tmp_path, "--train", train, "--validation", train, "--text-column", "sentence"))
    assert "the labels are numbers (0, 1, 2, 3, 4, ...): the server will answer them as they are; --labels " \
        "NAME,NAME,... (class 0's name first, then 1's, ...) or --label-map 0=...,1=...,2=...,... names them" \
        in capsys.readouterr().err  # in the ids' order, not the head's (0, 1, 10, 11, ...)
    write(tmp_path / "labels.txt", "".join(f"name{i}\n" for i in range(12)))  # as GoEmotions ships its ids' names
    with pytest.raises(AssertionError, match="a backbone was loaded"):
        main(train_args(tmp_path, "--train", train, "--validation", train, "--text-column", "sentence"))
    assert f'(the labels.txt beside the file lists them: --labels "$(paste -sd, {tmp_path / "labels.txt"})")' \
        in capsys.readouterr().err
    write(tmp_path / "labels.txt", "".join(f"name{i}\n" for i in range(11)))  # too few for id 11: not pointed at
    with pytest.raises(AssertionError, match="a backbone was loaded"):
        main(train_args(tmp_path, "--train", train, "--validation", train, "--text-column", "sentence"))
    assert "beside the file" not in capsys.readouterr().err


@pytest.mark.parametrize("given, above", [("store/greeting", "store"), ("store/greeting/1", "store")])
def test_a_store_that_is_a_task_or_module_folder_is_one_line(tmp_path, capsys, tables, given, above):
    # the new module would have landed in store/greeting/greeting/2, where no store finds it
    _, train, validation = tables
    module = tmp_path / "store" / "greeting" / "1"
    module.mkdir(parents=True)
    (module / "manifest.json").write_text("{}")
    line = one_line_error(capsys, train_args(tmp_path, "--train", train, "--validation", validation,
                                             "--store", str(tmp_path / given), "--task", "greeting"))
    assert line.endswith(f"not a store of tasks; give the store {'it is in' if given.count('/') == 1 else 'two folders up'}"
                         f": {tmp_path / above}"), line
    assert not (tmp_path / given / "greeting").exists()


@pytest.mark.parametrize("name", ["reviews.xlsx", "reviews.csv"])
def test_a_spreadsheet_workbook_is_refused_with_how_to_save_it_as_csv(tmp_path, capsys, tables, name):
    """An Excel workbook, by its name or (renamed .csv) by its bytes: it was 'cannot tell the format' or
    'not UTF-8 ... iconv', and read as text it is a few garbled rows."""
    import zipfile

    _, _, validation = tables
    with zipfile.ZipFile(tmp_path / name, "w") as book:  # an .xlsx is a zip of XML parts
        book.writestr("xl/worksheets/sheet1.xml", "<worksheet>" + "<row><c t='s'><v>0</v></c></row>" * 50 + "</worksheet>")
    line = one_line_error(capsys, train_args(tmp_path, "--train", str(tmp_path / name), "--validation", validation))
    assert line.endswith(f"{tmp_path / name}: a spreadsheet workbook is not read; save the sheet as CSV first (Excel: "
                         "File > Save As > CSV UTF-8; LibreOffice: Save As > Text CSV), or as tab-separated text")


def test_gzip_compressed_files_read_as_their_plain_text(tmp_path, capsys, tables):
    """train.tsv.gz, dev.conll.gz: read through gzip, the format from the name inside (it was 'cannot
    tell the format', and with --format 'not UTF-8 ... iconv')."""
    import gzip

    _, train, _ = tables
    packed = tmp_path / "train.tsv.gz"
    packed.write_bytes(gzip.compress(Path(train).read_bytes()))
    assert file_spec(packed).read().examples == file_spec(train).read().examples
    conll = "EU B-ORG\nrejects O\n\nPeter B-PER\nBlackburn I-PER\n"
    (tmp_path / "dev.conll.gz").write_bytes(gzip.compress(conll.encode()))
    assert file_spec(tmp_path / "dev.conll.gz").read().examples == read_conll(write(tmp_path / "dev.conll", conll)).examples
    (tmp_path / "cut.tsv.gz").write_bytes(packed.read_bytes()[:30])  # a download cut short
    line = one_line_error(capsys, train_args(tmp_path, "--train", str(tmp_path / "cut.tsv.gz"), "--split", "0.3"))
    assert f"{tmp_path / 'cut.tsv.gz'}: a broken gzip file (" in line and line.endswith("check it with gzip -t")


def test_validation_label_never_seen_in_training(tmp_path, capsys, tables):
    _, train, _ = tables
    validation = write(tmp_path / "v.tsv", "text\tlabel\nhow many ?\tNUM\n")
    line = one_line_error(capsys, train_args(tmp_path, "--train", train, "--validation", validation))
    assert "['NUM'] never seen in training" in line


def test_test_label_never_seen_in_training(tmp_path, capsys, tables):
    _, train, validation = tables
    test = write(tmp_path / "t.tsv", "text\tlabel\nhow many ?\tNUM\n")
    line = one_line_error(capsys, train_args(tmp_path, "--train", train, "--validation", validation, "--test", test))
    assert str(test) in line and "never seen in training" in line
    named = line.split("name every label: --labels ")[1].rstrip(")")  # the option that scores them as misses
    assert named.split(",")[-1] == "NUM"
    with pytest.raises(AssertionError, match="a backbone was loaded"):  # its checks pass: training would start
        main(train_args(tmp_path, "--train", train, "--validation", validation, "--test", test, "--labels", named))
    assert "label(s) ['NUM'] of --labels have no training row: the head will not learn to answer them" \
        in capsys.readouterr().err


def test_conll_line_without_a_tag(tmp_path, capsys):
    good = write(tmp_path / "train.conll", "Paris B-LOC\nis O\n\nBob B-PER\n")
    bad = write(tmp_path / "dev.conll", "Paris B-LOC\nis\n")
    line = one_line_error(capsys, train_args(tmp_path, "--train", good, "--validation", bad, "--format", "conll"))
    assert line.endswith(f"{bad}:2: a CoNLL line needs a word and a tag (whitespace-separated), got 'is'")


def test_file_not_utf8(tmp_path, capsys, tables):
    _, _, validation = tables
    latin = tmp_path / "latin.tsv"
    latin.write_bytes("text\tlabel\nsister\xf0city ?\tLOC\n".encode("latin-1"))
    line = one_line_error(capsys, train_args(tmp_path, "--train", str(latin), "--validation", validation))
    assert "not UTF-8" in line and "iconv" in line


def test_excel_unicode_text_utf16_reads_as_utf8_would(tmp_path):
    """Excel's "Unicode text" export: a TSV in UTF-16 with its byte-order mark and Windows line ends."""
    content = "text\tlabel\r\nZürich café naïve\tyes\r\n東京\tno\r\n"
    utf8, utf16 = tmp_path / "a.tsv", tmp_path / "b.tsv"
    utf8.write_bytes(content.encode("utf-8"))
    utf16.write_bytes(content.encode("utf-16"))  # little-endian, with the mark
    assert utf16.read_bytes()[:2] == b"\xff\xfe"
    assert file_spec(utf16).read().examples == file_spec(utf8).read().examples
    conll = tmp_path / "c.conll"
    conll.write_bytes("Zürich B-LOC\r\nis O\r\n".encode("utf-16"))
    assert read_conll(conll).examples[0].words == ["Zürich", "is"]


def test_format_not_guessable(tmp_path, capsys, tables):
    _, train, _ = tables
    odd = write(tmp_path / "dev.annotated", "Paris B-LOC\n")
    line = one_line_error(capsys, train_args(tmp_path, "--train", train, "--validation", odd))
    assert "give --format" in line
    shard = write(tmp_path / "train-00000.parquet", "PAR1")  # a Hugging Face dataset's file
    line = one_line_error(capsys, train_args(tmp_path, "--train", shard, "--validation", train))
    assert "parquet is not read; write it as JSONL first, e.g. datasets.load_dataset('parquet', " in line


@pytest.mark.parametrize("extra, expected", [
    (["--split", "0.1"], "one of --validation FILE or --split"),  # both
    (["--split", "0.7,0.6"], "--split: "),  # fractions over 1
    (["--none-below", "1.5"], "--none-below: "),
    (["--load-into", "http://127.0.0.1:9"], "TMOD_ADMIN_TOKEN"),
])
def test_option_mistakes(tmp_path, capsys, tables, monkeypatch, extra, expected):
    monkeypatch.delenv("TMOD_ADMIN_TOKEN", raising=False)
    _, train, validation = tables
    assert expected in one_line_error(capsys, train_args(tmp_path, "--train", train, "--validation", validation, *extra))


def test_load_into_a_url_where_no_server_answers(tmp_path, capsys, tables, monkeypatch):
    monkeypatch.setenv("TMOD_ADMIN_TOKEN", "t")
    _, train, validation = tables
    line = one_line_error(capsys, train_args(tmp_path, "--train", train, "--validation", validation,
                                             "--store", str(tmp_path / "store"), "--load-into", "http://127.0.0.1:9"))
    assert "no tmod-serve answers there" in line


def test_none_below_on_a_token_task(tmp_path, capsys):
    conll = write(tmp_path / "train.conll", "Paris B-LOC\nis O\n")
    line = one_line_error(capsys, train_args(tmp_path, "--train", conll, "--validation", conll, "--none-below", "auto"))
    assert "only single-label classifiers" in line


def test_distillation_on_a_sentence_task(tmp_path, capsys, tables):
    _, train, validation = tables
    line = one_line_error(capsys, train_args(tmp_path, "--train", train, "--validation", validation,
                                             "--distill-from", "ner/mpnet-2"))
    assert "--distill-from: only token tasks read from a CoNLL file" in line


def test_distillation_from_a_teacher_not_in_the_store(tmp_path, capsys):
    conll = write(tmp_path / "train.conll", "Paris B-LOC\nis O\n")
    line = one_line_error(capsys, train_args(tmp_path, "--train", conll, "--validation", conll,
                                             "--distill-from", "ner/nope"))
    assert "--distill-from 'ner/nope': no such module" in line


def test_eval_mistakes(tmp_path, capsys, tables):
    _, _, validation = tables
    assert "no such file" in one_line_error(capsys, ["eval", "--task", "sentiment", "--file", str(tmp_path / "x.tsv")])
    assert "no task 'nope'" in one_line_error(capsys, ["eval", "--task", "nope", "--file", validation])
    # the store's tasks as names, and the one a mistyped name meant
    from modules_store import DEFAULT_STORE, ModuleStore

    line = one_line_error(capsys, ["eval", "--task", "Ner", "--file", validation])
    assert line.endswith(f"; its tasks: {', '.join(ModuleStore(DEFAULT_STORE).tasks())} (did you mean 'ner' for 'Ner'?)")
    assert one_line_error(capsys, ["eval", "--task", "sentiment/1", "--version", "2", "--file", validation]).endswith(
        "--task sentiment/1 names version 1, --version 2: give one")
    assert "--task sentiment/..: '..' is not a valid task or version name" in one_line_error(
        capsys, ["eval", "--task", "sentiment/..", "--file", validation])
    assert "no version '99' of sentiment" in one_line_error(capsys, ["eval", "--task", "sentiment/99", "--file", validation])
    assert "not among sentiment's labels" in one_line_error(capsys, ["eval", "--task", "sentiment", "--file", validation])
    # a token task scored on a table (a CoNLL file named .tsv): it was a traceback from the scorer
    conll_like = write(tmp_path / "dev.tsv", "EU\tB-ORG\nrejects\tO\n\nPeter\tB-PER\nBlackburn\tI-PER\n")
    line = one_line_error(capsys, ["eval", "--task", "ner", "--file", conll_like])
    assert line.endswith("holds sequence_classification data and ner is a token_classification task "
                         "(a CoNLL file under another name? give --format conll)")


@pytest.mark.parametrize("argv, said", [
    (["eval", "--task", "sentiment", "--dataset", "sst2", "--max-examples", "0"], "argument --max-examples: 0 is under 1"),
    (["align", "--max-texts", "-1"], "argument --max-texts: -1 is under 0"),
    (["align", "--batch-size", "0"], "argument --batch-size: 0 is under 1"),
    (["align", "--threads", "-1"], "argument --threads: -1 is under 0"),
    (["embedding", "--check", "-1"], "argument --check: -1 is under 0"),
])
def test_a_count_out_of_range_is_argparses_line(argv, said, capsys):
    """Each ended in a traceback after the backbones loaded (IndexError, 'Sample larger than
    population', 'range() arg 3 must not be zero', 'set_num_threads expects a positive integer')."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"tmod-train {argv[0]}: error: {said}; "
                                                    f"see tmod-train {argv[0]} --help"]


NOT_A_NAME = ("'../x' is not a valid task or version name: use 1-64 of a-z, 0-9, '_' and '-', starting with a letter "
              "or digit")


@pytest.mark.parametrize("command", [["layermix"], ["mtb"], ["lora-mtb"], ["bridge"], ["align"], ["embedding"],
                                     ["eval", "--task", "sentiment"]])
def test_a_version_no_store_takes_is_argparses_line_in_every_command(command, capsys):
    """`--version ../x` was refused by the store only once the backbone had loaded (exit 1); now in one
    line before anything loads, exit 2, in every command that takes a version."""
    with pytest.raises(SystemExit) as stopped:
        main([*command, "--version", "../x"])
    assert stopped.value.code == 2
    said = f"tmod-train {command[0]}: error: argument --version: {NOT_A_NAME}; see tmod-train {command[0]} --help"
    assert capsys.readouterr().err.splitlines() == [said]


@pytest.mark.parametrize("command", ["layermix", "bridge"])
def test_a_configs_version_no_store_takes_is_one_line(command, tmp_path, tables, capsys):
    _, train, validation = tables
    config = write(tmp_path / "run.yaml", 'version: "../x"\nepochs: 1\n')
    data = ["--train", train, "--validation", validation] if command == "layermix" else ["--texts", train]
    line = one_line_error(capsys, [command, *data, "--config", config])
    assert line == f"tmod-train {command}: error: --version: {NOT_A_NAME}"


def test_the_console_script_answers_in_one_line(tmp_path, tables):
    """The real process: no traceback, exit status 2, one line on stderr."""
    _, _, validation = tables
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "training.cli", "layermix", "--train", str(tmp_path / "missing.tsv"),
                           "--validation", validation], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"tmod-train layermix: error: no such file: {tmp_path / 'missing.tsv'}"], done.stderr


def test_read_conll_is_a_usage_error_subclass_of_value_error(tmp_path):
    with pytest.raises(UsageError):
        read_conll(write(tmp_path / "a.conll", "\n\n"))
    assert issubclass(UsageError, ValueError)


def test_split_is_stratified_seeded_and_disjoint():
    examples = [SequenceExample(f"text {i}", label) for i, label in enumerate(["a"] * 80 + ["b"] * 20)]
    data = LabelledData(TaskType.sequence_classification, examples, "mem")
    train, validation, test = carve(data, [0.1, 0.2], seed=3)
    assert (len(train), len(validation), len(test)) == (70, 10, 20)
    assert Counter(e.label for e in validation.examples) == {"a": 8, "b": 2}
    assert Counter(e.label for e in test.examples) == {"a": 16, "b": 4}
    texts = [{e.text for e in part.examples} for part in (train, validation, test)]
    assert not (texts[0] & texts[1] or texts[0] & texts[2] or texts[1] & texts[2])
    again = carve(data, [0.1, 0.2], seed=3)
    assert [e.text for e in again[1].examples] == [e.text for e in validation.examples]
    assert [e.text for e in carve(data, [0.1, 0.2], seed=4)[1].examples] != [e.text for e in validation.examples]
    assert carve(data, [0.1], seed=0)[2] is None


def test_an_empty_carved_part_says_when_repeated_texts_are_why():
    """200 rows of 3 texts: every text's rows stay in one part, so validation had none; the line said only
    'would be empty'."""
    examples = [SequenceExample(f"text {i % 3}", "ab"[i % 2]) for i in range(200)]
    with pytest.raises(UsageError, match=r"the validation part of mem would be empty: its 200 rows hold 3 different "
                                         r"texts, and the rows of one stay in one part"):
        carve(LabelledData(TaskType.sequence_classification, examples, "mem"), [0.1], seed=0)


@pytest.mark.parametrize("seed", range(5))
def test_a_rare_label_is_never_carved_away_from_training(seed):
    """A carved row whose label no training row has goes back to training (else the run ends on 'never
    seen in training'); every part stays disjoint."""
    rows = [SequenceExample(f"text {i}", ("common",)) for i in range(60)]
    rows += [SequenceExample("the only proud one", ("common", "pride")), SequenceExample("rare too", ("rare",))]
    data = LabelledData(TaskType.multi_label_classification, rows, "mem")
    train, validation, test = carve(data, [0.5, 0.4], seed=seed)
    assert set(train.labels_seen()) == {"common", "pride", "rare"}
    assert set(validation.labels_seen()) | set(test.labels_seen()) <= set(train.labels_seen())
    texts = [{e.text for e in part.examples} for part in (train, validation, test)]
    assert sum(map(len, texts)) == len(rows) and not (texts[0] & texts[1] or texts[0] & texts[2] or texts[1] & texts[2])
    assert len(validation) >= 29 and len(test) >= 23  # only the two rare rows moved (31 and 25 carved)


@pytest.mark.parametrize("seed", range(3))
def test_multi_label_rows_are_carved_stratified_by_label(seed):
    """Each label's share of validation and test is near the fractions asked (iterative stratification):
    a random cut of GoEmotions' first 1,000 rows left labels of 10 or more rows out of a part in 5 of 6."""
    import random

    rng = random.Random(seed)
    labels = [f"label{k}" for k in range(12)]
    weights = [1 / (k + 1) for k in range(12)]  # from 1 in 3 rows down to 1 in 40
    rows = [SequenceExample(f"text {i}", tuple(sorted(set(rng.choices(labels, weights, k=rng.randint(0, 3))))))
            for i in range(600)]
    data = LabelledData(TaskType.multi_label_classification, rows, "mem")
    parts = carve(data, [0.1, 0.1], seed=seed)
    total = Counter(label for ex in rows for label in ex.label)
    for part in parts[1:]:
        held = Counter(label for ex in part.examples for label in ex.label)
        assert all(abs(held[label] - 0.1 * total[label]) <= 1.5 for label in labels), (held, total)
        assert abs(len(part) - 60) <= 6
    assert sum(map(len, parts)) == len(rows)


@pytest.mark.parametrize("seed", range(5))
def test_a_repeated_text_is_carved_into_one_part(seed):
    """A file that holds a text several times (SST-2's training file: 361 texts twice) must not put
    one copy in training and another in validation or test: the head would be scored on what it learnt."""
    rows = [SequenceExample(f"text {i}", "a" if i % 4 else "b") for i in range(80)]
    rows += [SequenceExample(f"text {i}", "a" if i % 4 else "b") for i in range(0, 80, 3)]  # 27 texts twice
    rows += [SequenceExample("a pair", "a", "its second text"), SequenceExample("a pair", "b", "another one")]
    data = LabelledData(TaskType.sequence_classification, rows, "mem", has_pairs=True)
    parts = carve(data, [0.2, 0.2], seed=seed)
    keys = [{(e.text, e.text_pair) for e in part.examples} for part in parts]
    assert not (keys[0] & keys[1] or keys[0] & keys[2] or keys[1] & keys[2])
    assert sum(map(len, parts)) == len(rows) and min(len(parts[1]), len(parts[2])) >= 15
    once = LabelledData(TaskType.sequence_classification, rows[:80], "mem")  # no text repeated: as before
    assert [e.text for e in carve(once, [0.2, 0.2], seed=seed)[1].examples] == [
        f"text {i}" for i in sorted(old_carve_rows(once, seed))]


def test_rows_shared_across_given_files_are_counted(tmp_path):
    """--validation and --test given as files may share texts with training, or with each other."""
    from training.settings import TrainSettings
    from training.splits import resolve_data

    train = write(tmp_path / "train.tsv", "text\tlabel\n" + "".join(f"train {i}\t{'ab'[i % 2]}\n" for i in range(20)))
    validation = write(tmp_path / "validation.tsv", "text\tlabel\nval 0\ta\nval 1\tb\ntrain 3\tb\n")
    test = write(tmp_path / "test.tsv", "text\tlabel\ntest 0\ta\nval 0\ta\nval 1\tb\ntrain 4\ta\ntrain 5\tb\n")
    data = resolve_data(TrainSettings(train=train, validation=validation, test=test))
    counts = {k: v for k, v in data.provenance.items() if k.endswith(("_in_training", "_in_validation"))}
    assert counts == {"validation_rows_also_in_training": 1, "test_rows_also_in_training": 2,
                      "test_rows_also_in_validation": 2}


def old_carve_rows(data, seed):
    """The validation rows carve chose row by row before it kept a text's rows together."""
    import random

    rng, chosen = random.Random(seed), []
    groups: dict = {}
    for i, ex in enumerate(data.examples):
        groups.setdefault(ex.label, []).append(i)
    for key in sorted(groups):
        rows = groups[key]
        rng.shuffle(rows)
        chosen += rows[:round(len(rows) * 0.2)]
    return chosen


def test_epoch_selection_needs_a_real_improvement():
    from training.settings import TrainSettings
    from training.trainer import better_epoch

    s = TrainSettings(min_delta=0.002, min_loss_delta=0.01)
    assert better_epoch(0.95, 0.30, -float("inf"), float("inf"), s)  # the first epoch
    assert better_epoch(0.953, 0.40, 0.95, 0.30, s)  # clearly higher metric, whatever the loss
    assert not better_epoch(0.951, 0.35, 0.95, 0.30, s)  # a blip while the loss rises: noise
    assert better_epoch(0.949, 0.25, 0.95, 0.30, s)  # level metric, clearly lower loss: better fitted
    assert not better_epoch(0.949, 0.299, 0.95, 0.30, s)  # level metric, loss level too
    assert not better_epoch(0.90, 0.10, 0.95, 0.30, s)  # a lower metric is never better


def test_none_threshold_leaves_out_rows_more_often_wrong_than_right():
    import numpy as np

    from training.metrics import answered_scores, choose_none_threshold

    labels = ["a", "b"]
    # confident rows right, rows at p 0.55 wrong 3 times out of 4
    probs = np.array([[0.95, 0.05]] * 6 + [[0.55, 0.45]] * 4)
    gold = ["a"] * 6 + ["b", "b", "b", "a"]
    chosen = choose_none_threshold(gold, probs, labels)
    assert 0.55 < chosen["threshold"] <= 0.95
    assert chosen["answered"] == 6 and chosen["accuracy_answered"] == 1.0 and chosen["coverage"] == 0.6
    assert answered_scores(gold, probs, labels, 0.0) == {"threshold": 0.0, "coverage": 1.0,
                                                          "accuracy_answered": 0.7, "answered": 10}


def test_a_mistake_in_the_data_options_is_answered_before_torch_is_imported(tmp_path):
    """tmod-train checks the user's files and split options first: a missing file is one line and exit 2
    with neither torch nor transformers imported (importing them took 2-5 s before that line)."""
    code = ("import sys\nfrom training.cli import main\n"
            "rc = main(['layermix', '--task', 't', '--train', sys.argv[1], '--split', '0.1', '--no-progress'])\n"
            "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "missing.tsv")], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert done.stdout.split() == ["2", "False", "False"], done.stdout + done.stderr
    assert done.stderr.strip() == f"tmod-train layermix: error: no such file: {tmp_path / 'missing.tsv'}"


def test_a_missing_distillation_teacher_is_answered_before_torch_is_imported(tmp_path):
    conll = write(tmp_path / "train.conll", "Paris B-LOC\nis O\n")
    code = ("import sys\nfrom training.cli import main\n"
            "rc = main(['layermix', '--train', sys.argv[1], '--validation', sys.argv[1], '--distill-from', 'ner/nope',"
            " '--no-progress'])\n"
            "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, conll], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert done.stdout.split() == ["2", "False", "False"], done.stdout + done.stderr
    assert "--distill-from 'ner/nope': no such module" in done.stderr


@pytest.mark.parametrize("name, content, expected", [
    ("missing.yaml", None, "--config {path}: No such file or directory"),
    ("bad.yaml", "epochs: [3\n", "--config {path}:2: not valid YAML (expected ',' or ']'"),
    ("bad.json", '{"epochs": 3,}', "--config {path}:1: not valid JSON (Expecting property name"),
    ("list.yaml", "- 1\n", "--config {path}: a config file must hold a mapping of settings, got list"),
    ("zero.yaml", "epochs: 0\n", "--epochs: Input should be greater than or equal to 1"),
    # a setting's name misspelt, or as transformers' Trainer names it: was "--epoch: Extra inputs are not permitted"
    ("typo.yaml", "epoch: 3\n", "--config {path}: 'epoch' is not a setting (did you mean 'epochs' for 'epoch'?)"),
    ("hf.yaml", "learning_rate: 0.01\n", "--config {path}: 'learning_rate' is not a setting (tmod-train calls it 'lr')"),
])
def test_config_file_mistakes(tmp_path, capsys, tables, name, content, expected):
    _, train, validation = tables
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    line = one_line_error(capsys, train_args(tmp_path, "--train", train, "--validation", validation, "--config", str(path)))
    assert expected.format(path=path) in line


@pytest.mark.parametrize("written, read", [
    # a list option written in a config file as YAML types a value: one number was a traceback (split) or
    # 'Input should be a valid list' (document_windows, labels given as the command line gives them)
    ("split: 0.2\n", {"split": [0.2]}),
    ("split: [0.1, 0.1]\n", {"split": [0.1, 0.1]}),
    ("split: '0.1,0.1'\n", {"split": [0.1, 0.1]}),
    ("document_windows: 128\n", {"document_windows": [128]}),
    ("document_windows: '256, 128'\n", {"document_windows": [256, 128]}),
    ("labels: neg, pos\n", {"labels": ["neg", "pos"]}),
    ("labels: [neg, pos]\n", {"labels": ["neg", "pos"]}),
    ("labels: [0, 1]\n", {"labels": ["0", "1"]}),
    ("targets: query\n", {"targets": ["query"]}),
])
def test_a_list_setting_reads_alike_from_a_config_file_and_the_command_line(tmp_path, written, read):
    from training.cli import build_parser, settings_from_args

    config = tmp_path / "run.yaml"
    config.write_text(written)
    settings = settings_from_args(build_parser().parse_args(["lora-mtb", "--train", "t.tsv", "--config", str(config)]))
    assert {name: getattr(settings, name) for name in read} == read
    (name, value), = read.items()
    option = ",".join(map(str, value))
    given = settings_from_args(build_parser().parse_args(["lora-mtb", "--train", "t.tsv", f"--{name.replace('_', '-')}",
                                                          option]))
    assert getattr(given, name) == value


def test_a_list_setting_of_the_wrong_kind_in_a_config_file_is_one_line(tmp_path, capsys, tables):
    _, train, validation = tables
    path = tmp_path / "run.yaml"
    path.write_text("document_windows: [128, many]\n")
    line = one_line_error(capsys, train_args(tmp_path, "--train", train, "--validation", validation, "--config", str(path)))
    assert line.endswith("--document-windows: word pieces a window, comma-separated: 256,128 (got 'many')")


@pytest.mark.parametrize("command", ["layermix", "eval"])
def test_a_device_torch_cannot_use_is_one_line(tmp_path, capsys, tables, command):
    _, train, validation = tables
    if command == "layermix":
        argv = train_args(tmp_path, "--train", train, "--validation", validation, "--device", "cuda:99")
    else:  # a module to score first: eval checks the device before loading a backbone
        argv = ["eval", "--task", "sentiment", "--dataset", "sst2", "--device", "cuda:99"]
    line = one_line_error(capsys, argv)
    assert line.startswith(f"tmod-train {command}: error: --device cuda:99: ") and "cuda" in line


def test_a_distillation_bridge_without_its_module_is_one_line(tmp_path, capsys):
    line = one_line_error(capsys, ["bridge", "--objective", "distill", "--source", "minilm", "--target", "minilm",
                                   "--bridge-store", str(tmp_path / "bridges")])
    assert line == "tmod-train bridge: error: --objective distill needs --module (a module of the target backbone: " \
                   "TASK/VERSION of the shipped store, or a STORE/TASK[/VERSION] folder)"


def test_iob1_tags_are_learnt_as_bio_and_counted(tmp_path):
    """CoNLL-2003's original release writes IOB1 (an entity begins with I-): the server decodes tags in
    BIO order (an I- only after a B- or I-), so a head that learnt IOB1 lost most entities (entity F1
    0.33, 0.71 once read as BIO, after two epochs on 1,500 sentences). The tags are read as BIO and
    counted in the provenance (tmod-train says so, and the report)."""
    from training.settings import TrainSettings
    from training.splits import resolve_data

    sentences = [[("Peter", "I-PER"), ("Blackburn", "I-PER"), ("flew", "O"), ("to", "O"), (f"Paris{i}", "I-LOC")]
                 for i in range(6)] + [[("Germany", "I-LOC"), ("France", "B-LOC")]]
    iob1 = write(tmp_path / "iob1.conll", "\n\n".join("\n".join(f"{w} {t}" for w, t in s) for s in sentences) + "\n")
    data = resolve_data(TrainSettings(train=iob1, split=[0.3]))
    tags = {tuple(ex.tags) for ex in data.train.examples + data.validation.examples}
    assert tags == {("B-PER", "I-PER", "O", "O", "B-LOC"), ("B-LOC", "B-LOC")}
    assert data.provenance["entities_begun_with_i"] == {"train": 13}
    assert set(data.labels) == {"O", "B-PER", "I-PER", "B-LOC", "I-LOC"}


def test_with_no_text_column_named_the_longest_column_is_read_and_said(tmp_path, capsys):
    """A Hugging Face export (`Dataset.to_csv`: `idx,sentence,label`, or pandas' unnamed index column
    first) named no `text` column, and column 0, the row numbers, was read as the texts: a head learnt
    on numbers (its JSONL, `to_json`, was one line naming the keys). The longest column (or string) is
    read, and said; a file whose only candidate holds numbers is refused."""
    rows = [(i, f"a {'fine' if i % 2 else 'dull'} film number {i}", i % 2) for i in range(12)]
    for first in ("idx", ""):
        path = write(tmp_path / f"export{first}.csv", f"{first},sentence,label\n" + "".join(f"{i},{s},{y}\n" for i, s, y in rows))
        data = file_spec(path).read()
        assert [ex.text for ex in data.examples] == [s for _, s, _ in rows]
        assert [ex.label for ex in data.examples] == [str(y) for _, _, y in rows]
        assert "texts read from column 'sentence' (the longest; no column is named 'text')" in capsys.readouterr().err
    records = write(tmp_path / "export.jsonl", "".join(json.dumps({"idx": i, "sentence": s, "label": y}) + "\n"
                                                        for i, s, y in rows))  # Dataset.to_json: the same keys
    assert [ex.text for ex in file_spec(records).read().examples] == [s for _, s, _ in rows]
    assert "texts read from key 'sentence' (the longest string; no key is named 'text')" in capsys.readouterr().err
    plain = write(tmp_path / "plain.tsv", "".join(f"{s}\t{y}\n" for _, s, y in rows))  # no header: column 0, unsaid
    assert file_spec(plain, header=False).read().examples[0].text == rows[0][1] and capsys.readouterr().err == ""
    header_only = write(tmp_path / "header_only.csv", "idx,sentence,label\n")
    assert "header_only.csv: no examples" in one_line_error(capsys, ["layermix", "--train", str(header_only), "--split",
                                                                     "0.25", "--task", "t"])
    numbers = write(tmp_path / "numbers.csv", "id,label\n" + "".join(f"{i},{i % 2}\n" for i in range(12)))
    assert "no column holds texts" in one_line_error(capsys, ["layermix", "--train", str(numbers), "--split", "0.25",
                                                              "--task", "t"])


def test_a_token_file_whose_words_are_all_tagged_alike_is_refused(tmp_path, capsys):
    """Every word O: a head trained on nothing, then a traceback from the linear tagger (one class);
    now one line before anything is trained."""
    conll = write(tmp_path / "all_o.conll", "".join(f"Word{i} O\nmore O\n\n" for i in range(9)))
    line = one_line_error(capsys, ["layermix", "--train", str(conll), "--split", "0.34", "--task", "t"])
    assert "all_o.conll: every word is tagged 'O': no entity to learn" in line


def test_a_multi_label_file_with_one_label_set_on_every_row_is_refused(tmp_path, capsys):
    """Every row labelled joy: nothing to tell apart (it trained, then the linear baseline raised an
    IndexError); one line before training, as for a single-label file."""
    table = write(tmp_path / "joy.csv", "text,label\n" + "".join(f"text number {i},joy\n" for i in range(9)))
    line = one_line_error(capsys, ["layermix", "--train", str(table), "--multi-label", "--split", "0.34", "--task", "t"])
    assert "joy.csv: every row is labelled joy: a classifier learns to tell labels apart" in line


def test_a_tsv_file_quoted_as_csv_is_read_as_quoted(tmp_path, capsys):
    """pandas' `to_csv(sep="\\t")` (and a Hugging Face `Dataset.to_csv`) quotes a text holding a quote:
    `"He said ""hi"" and left"`. Split on tabs only, the head learnt the quotes doubled and wrapped, which no
    served text has (GoEmotions' files are written so: 1,097 training rows). Such a file is read as
    quoted, said; a GLUE file, whose texts hold and even begin with quotes unquoted, as before."""
    pandas = pytest.importorskip("pandas")
    texts = ['He said "hi" and left', "plain text, no quote", '"Quoted" start', 'a "b" c "d"', "tab\tinside"]
    path = tmp_path / "exported.tsv"
    pandas.DataFrame({"text": texts, "label": ["a", "b", "a", "b", "a"]}).to_csv(path, sep="\t", index=False)
    assert '"He said ""hi"" and left"' in path.read_text()  # the writer quoted
    data = file_spec(path).read()
    assert [ex.text for ex in data.examples] == texts and [ex.label for ex in data.examples] == ["a", "b", "a", "b", "a"]
    assert 'cells quoted as CSV quotes them ("...""..."): read as quoted' in capsys.readouterr().err
    glue = write(tmp_path / "glue.tsv", 'text\tlabel\n"USA Today" is a subsidiary of "The Observer."\t1\n'
                                        'it \'s a "fine" film \t0\n')  # RTE's and SST-2's quotes: as written
    assert [ex.text for ex in file_spec(glue).read().examples] == ['"USA Today" is a subsidiary of "The Observer."',
                                                                    'it \'s a "fine" film']
    assert capsys.readouterr().err == ""


def test_a_second_text_column_left_unread_is_said(tmp_path, capsys):
    """A pair file (RTE's `index, sentence1, sentence2, label`) trained without --pair-column learnt
    from the first texts alone, blind to the second, and nothing said so. A column (or JSON key) that
    holds texts too is named with the option that reads it; ids, labels and numbers are not texts."""
    rows = [(i, f"premise number {i} says a thing", f"hypothesis {i} says {'it' if i % 2 else 'not it'}",
             "entailment" if i % 2 else "not_entailment", f"id{i:04x}") for i in range(12)]
    table = write(tmp_path / "pairs.tsv", "index\tsentence1\tsentence2\tlabel\tsource\n"
                  + "".join("\t".join(map(str, row)) + "\n" for row in rows))
    assert [ex.text for ex in file_spec(table).read().examples] == [row[1] for row in rows]
    assert ("pairs.tsv: column 'sentence2' holds texts too and is not read: for a task on text pairs (entailment, "
            "paraphrase) name it with --pair-column") in capsys.readouterr().err
    paired = file_spec(table, pair_column="sentence2").read()
    assert paired.examples[0].text_pair == rows[0][2] and "holds texts too" not in capsys.readouterr().err
    records = write(tmp_path / "pairs.jsonl", "".join(json.dumps({"idx": r[0], "premise": r[1], "hypothesis": r[2],
                                                                   "label": r[3]}) + "\n" for r in rows))
    file_spec(records).read()
    assert "pairs.jsonl: key 'hypothesis' holds texts too and is not read" in capsys.readouterr().err
    single = write(tmp_path / "single.tsv", "idx\ttext\tlabel\tsource\n" + "".join(f"{r[0]}\t{r[1]}\t{r[3]}\t{r[4]}\n"
                                                                                   for r in rows))
    file_spec(single).read()
    assert "holds texts too" not in capsys.readouterr().err


def test_labels_that_differ_only_in_case_are_said_with_the_map_that_merges_them(tmp_path, capsys):
    """A spreadsheet's `Pos` beside `pos` was learnt as two classes, each with a share of the rows, and
    nothing said so."""
    from training.settings import TrainSettings
    from training.splits import resolve_data

    labels = ["pos", "neg", "Pos", "pos", "neg", "NEG", "pos", "neg"] * 3
    table = write(tmp_path / "cased.csv", "text,label\n" + "".join(f"text number {i},{y}\n" for i, y in enumerate(labels)))
    resolve_data(TrainSettings(train=table, split=[0.25]))
    assert (f"{table}: labels 'pos' (9) and 'Pos' (3), 'neg' (9) and 'NEG' (3) differ only in case: they are learnt as "
            "different labels; --label-map NEG=neg,Pos=pos,neg=neg,pos=pos merges them") in capsys.readouterr().err
    merged = resolve_data(TrainSettings(train=table, split=[0.25], label_map={"NEG": "neg", "Pos": "pos", "neg": "neg",
                                                                               "pos": "pos"}))
    assert set(merged.labels) == {"neg", "pos"} and "differ only in case" not in capsys.readouterr().err


def test_a_token_dataset_written_by_pandas_is_read_as_tagged_words(tmp_path, capsys):
    """A Hugging Face token dataset through pandas' to_csv (`tokens` and `ner_tags` cells spelling lists,
    with commas, or as numpy arrays without): its tag lists were refused as lists of labels ("give
    --multi-label"), and its word lists were texts. Such a row is its words and their tags, as the
    dataset's JSONL is; class ids are named by --labels as there."""
    pandas = pytest.importorskip("pandas")
    numpy = pytest.importorskip("numpy")
    sentences = [(["Peter", "flew", "to", "Paris", "."], ["B-PER", "O", "O", "B-LOC", "O"]),
                 (["The", "EU", "said", "no"], ["O", "B-ORG", "O", "O"])] * 3
    lists = tmp_path / "lists.csv"
    pandas.DataFrame([{"id": i, "tokens": w, "ner_tags": t} for i, (w, t) in enumerate(sentences)]).to_csv(lists, index=False)
    data = file_spec(lists, text_column="tokens", label_column="ner_tags").read()
    assert data.task_type == TaskType.token_classification
    assert [(ex.words, ex.tags) for ex in data.examples] == [(w, t) for w, t in sentences]
    ids = {"O": 0, "B-PER": 1, "B-ORG": 3, "B-LOC": 5}
    arrays = tmp_path / "arrays.csv"
    pandas.DataFrame([{"tokens": numpy.array(w), "ner_tags": numpy.array([ids[x] for x in t])}
                      for w, t in sentences]).to_csv(arrays, index=False)
    assert "['Peter' 'flew' 'to' 'Paris' '.'],[1 0 0 5 0]" in arrays.read_text()
    data = file_spec(arrays, label_column="ner_tags").read()
    assert [ex.tags for ex in data.examples][:2] == [["1", "0", "0", "5", "0"], ["0", "3", "0", "0"]]
    mixed = write(tmp_path / "mixed.csv", "text,label\n\"['a', 'b']\",\"['O', 'O']\"\nplain text,O\n")
    with pytest.raises(UsageError, match="mixed.csv:3: a labelled text where the first row had tagged words"):
        file_spec(mixed).read()


def test_a_header_line_repeated_inside_a_table_is_refused(tmp_path, capsys):
    """Two exports joined with `cat` keep the second's header: its `label` cell was learnt as a label."""
    part = "text,label\n" + "".join(f"text number {i},{'pos' if i % 2 else 'neg'}\n" for i in range(6))
    joined = write(tmp_path / "joined.csv", part + part)
    line = one_line_error(capsys, ["layermix", "--train", str(joined), "--split", "0.34", "--task", "t"])
    assert line.endswith(f"{joined}:8: the header line again (files joined with theirs?): remove it")


def test_class_ids_written_as_floats_are_read_through_the_label_map(tmp_path, capsys):
    """pandas writes an int label column that held a NaN as floats (1.0, 0.0): `--label-map
    0=negative,1=positive` refused "label '1.0' is not in the label map"."""
    table = write(tmp_path / "floats.csv", "text,label\n" + "".join(f"text {i},{i % 2}.0\n" for i in range(8)))
    data = file_spec(table, label_map={"0": "negative", "1": "positive"}).read()
    assert [ex.label for ex in data.examples][:2] == ["negative", "positive"]
    named = file_spec(table).read().named_by_position(["negative", "positive"])  # --labels negative,positive
    assert [ex.label for ex in named.examples][:2] == ["negative", "positive"]
    odd = write(tmp_path / "odd.csv", "text,label\ntext a,1.5\ntext b,0\n")
    with pytest.raises(UsageError, match=r"odd.csv:2: label '1.5' is not in the label map"):
        file_spec(odd, label_map={"0": "negative", "1": "positive"}).read()


@pytest.mark.parametrize("orient", [None, "index", "split", "table"])
def test_a_json_object_as_pandas_writes_a_table_is_read_as_its_rows(tmp_path, capsys, orient):
    """pandas' `df.to_json("train.json")` writes one object, column -> {row: cell} (orient "columns", its
    default): read as one record, its text and label were whole columns ("every row is labelled
    {'0': 'a', ...}"). Each of pandas' table orients is read as its rows, said."""
    pandas = pytest.importorskip("pandas")
    frame = pandas.DataFrame({"text": [f"text number {i} here" for i in range(6)], "label": ["a", "b"] * 3})
    path = tmp_path / "frame.json"
    frame.to_json(path, **({"orient": orient} if orient else {}), **({"indent": 2} if orient is None else {}))
    data = file_spec(path).read()
    assert [(ex.text, ex.label) for ex in data.examples] == list(zip(frame.text, frame.label))
    assert f"one JSON object, read as pandas' DataFrame.to_json writes it (orient={orient or 'columns'!r})" \
        in capsys.readouterr().err
    one = write(tmp_path / "one.jsonl", json.dumps({"text": "just one record", "label": "a"}) + "\n")
    assert file_spec(one).read().examples[0].text == "just one record" and "pandas" not in capsys.readouterr().err


def test_a_folder_given_for_a_file_is_said_to_be_one(tmp_path, capsys):
    """A folder was "cannot tell the format from the extension" (or, with --format, "no such file"); a
    Hugging Face dataset's `save_to_disk` folder gets the line that writes it as JSONL."""
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "state.json").write_text("{}")
    line = one_line_error(capsys, ["layermix", "--train", str(saved), "--split", "0.2", "--task", "t"])
    assert line.endswith(f"{saved}: a Hugging Face dataset saved with save_to_disk, which is not read; write it as JSONL "
                         "first, e.g. datasets.load_from_disk('saved').to_json('train.jsonl') (a DatasetDict: each "
                         "split's)")
    for extra in ([], ["--format", "conll"]):
        line = one_line_error(capsys, ["layermix", "--train", str(tmp_path), "--split", "0.2", "--task", "t", *extra])
        assert line.endswith(f"{tmp_path}: a folder; give a file (TSV, CSV, JSONL or CoNLL)"), line


def test_header_names_are_read_without_their_spaces(tmp_path):
    """`text , label` (a hand-written header): --text-column text was "no column 'text'; the header
    line has ['text ', ' label']", and the default columns were not found by name."""
    table = write(tmp_path / "spaced.csv", "text , label\nnice film , pos\nawful film , neg\n")
    for columns in ({}, {"text_column": "text", "label_column": "label"}):
        assert [(ex.text, ex.label) for ex in file_spec(table, **columns).read().examples] == [("nice film", "pos"),
                                                                                              ("awful film", "neg")]


def test_a_label_studio_export_is_said_and_its_json_min_export_is_read(tmp_path, capsys):
    """Label Studio's JSON export (records of `data` and `annotations`) was "no key 'text' in
    ['annotations', 'data', 'id']"; its JSON-MIN export (text, and labels under the control's name) reads."""
    full = write(tmp_path / "export.json", json.dumps([{"id": i, "data": {"text": f"review {i}"}, "annotations": [
        {"result": [{"value": {"choices": ["pos"]}, "from_name": "sentiment", "type": "choices"}]}]} for i in range(4)]))
    line = one_line_error(capsys, ["layermix", "--train", str(full), "--split", "0.25", "--task", "t"])
    assert line.endswith(f"{full}: record 0: a Label Studio export (JSON), which is not read; export as JSON-MIN (a "
                         "record's text and labels: entity spans are read as they are, a choice under its control's "
                         "name, e.g. --label-column sentiment)")
    spans = [{"start": 0, "end": 5, "text": "Peter", "labels": ["PER"]}, {"start": 14, "end": 19, "text": "Paris",
                                                                         "labels": ["LOC"]}]
    minimal = write(tmp_path / "min.json", json.dumps([{"id": 1, "text": "Peter flew to Paris.", "label": spans,
                                                        "annotator": 1}]))
    assert file_spec(minimal).read().examples[0].tags == ["B-PER", "O", "O", "B-LOC", "O"]
    choices = write(tmp_path / "choices.json", json.dumps([{"id": 1, "text": "a fine review", "sentiment": "pos"}]))
    assert file_spec(choices, label_column="sentiment").read().examples[0].label == "pos"
    several = write(tmp_path / "several.json", json.dumps([{"id": 1, "text": "a fine, sad film",
                                                            "mood": {"choices": ["joy", "sadness"]}}]))  # JSON-MIN's
    assert file_spec(several, label_column="mood", multi_label=True).read().examples[0].label == ("joy", "sadness")


def test_one_item_label_lists_are_single_labels(tmp_path, capsys):
    """doccano exports a one-label classification project as `"label": ["pos"]`: refused as a list ("give
    --multi-label", which would train another kind of task). A list of one is its label; of more, refused."""
    records = write(tmp_path / "doccano.jsonl", "".join(json.dumps({"id": i, "text": f"review {i}", "label": [y]}) + "\n"
                                                       for i, y in enumerate(["pos", "neg"] * 3)))
    data = file_spec(records).read()
    assert data.task_type == TaskType.sequence_classification and [ex.label for ex in data.examples][:2] == ["pos", "neg"]
    two = write(tmp_path / "two.jsonl", json.dumps({"text": "review", "label": ["pos", "neg"]}) + "\n")
    with pytest.raises(UsageError, match=r'two.jsonl:1: the label is a list \(\["pos", "neg"\]\): give --multi-label'):
        file_spec(two).read()
