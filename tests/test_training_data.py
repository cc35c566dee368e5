"""training.data: readers, presets, and the word-tag <-> sub-token mapping (train/serve consistency)."""
from __future__ import annotations

import json

import pytest
import torch

from modules_store import TaskType
from server.heads.decode import decode
from training.data.conll import CONLL_TAGS, read_conll
from training.data.examples import TokenExample, label_order
from training.data.files import default_data_dir
from training.data.presets import PRESETS, preset_spec
from training.data.tables import read_table
from training.data.word_tags import IGNORE_INDEX, token_labels, word_label_ids_from_tokens

CONLL_TEXT = """-DOCSTART- -X- -X- O

EU NNP B-NP B-ORG
rejects VBZ B-VP O
U.S. NNP I-NP B-LOC
call NN I-NP O
to TO B-VP O
boycott VB I-VP O
British JJ B-NP B-MISC
lamb NN I-NP O
. . O O

Peter NNP B-NP B-PER
Blackburn NNP I-NP I-PER

-DOCSTART- -X- -X- O

New NNP B-NP B-LOC
York NNP I-NP I-LOC
"""


@pytest.fixture
def conll_file(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text(CONLL_TEXT)
    return path


def test_read_conll_skips_docstart_and_splits_on_blank_lines(conll_file):
    data = read_conll(conll_file)
    assert data.task_type == TaskType.token_classification
    assert [ex.words for ex in data.examples] == [
        ["EU", "rejects", "U.S.", "call", "to", "boycott", "British", "lamb", "."],
        ["Peter", "Blackburn"],
        ["New", "York"],  # no blank line at the end of the file: still a sentence
    ]
    assert data.examples[0].tags[:3] == ["B-ORG", "O", "B-LOC"]
    assert data.examples[2].tags == ["B-LOC", "I-LOC"]
    assert label_order(data) == ["O", "B-LOC", "I-LOC", "B-MISC", "I-MISC", "B-ORG", "I-ORG", "B-PER", "I-PER"]


def test_token_example_text_and_spans():
    ex = TokenExample(words=["New", "York", "."], tags=["B-LOC", "I-LOC", "O"])
    assert ex.text == "New York ."
    assert [ex.text[s:e] for s, e in ex.spans] == ex.words


def _align(backbone, example, labels=CONLL_TAGS):
    index = {t: i for i, t in enumerate(labels)}
    ids = [index[t] for t in example.tags]
    encoded = backbone.encode([example.text], truncate=True)[0]
    return encoded, ids, token_labels(encoded, example.spans, ids, labels)


def test_word_tags_round_trip_through_sub_tokens(train_backbone, conll_file):
    for example in read_conll(conll_file).examples:
        encoded, ids, targets = _align(train_backbone, example)
        assert targets[0] == IGNORE_INDEX and targets[-1] == IGNORE_INDEX  # [CLS] ... [SEP]
        assert word_label_ids_from_tokens(encoded, example.spans, targets) == ids


def test_split_words_label_every_piece_the_server_decodes_by(train_backbone, conll_file):
    """'U.S.' is one CoNLL word but four tokenizer words; each gets a label (B- then I-), so the
    server's decoder (first sub-token of each tokenizer word) rebuilds the whole entity."""
    example = read_conll(conll_file).examples[0]
    encoded, ids, targets = _align(train_backbone, example)
    pieces = [(encoded.offsets[t], CONLL_TAGS[y]) for t, y in enumerate(targets) if y != IGNORE_INDEX]
    us_start = example.text.index("U.S.")
    in_us = [tag for (start, _), tag in pieces if us_start <= start < us_start + 4]
    assert in_us == ["B-LOC", "I-LOC", "I-LOC", "I-LOC"]
    # non-initial sub-tokens of one tokenizer word stay unlabelled
    labelled_words = {encoded.word_ids[t] for t, y in enumerate(targets) if y != IGNORE_INDEX}
    assert len(labelled_words) == sum(y != IGNORE_INDEX for y in targets)

    batch = train_backbone.collate([encoded])
    logits = torch.full((1, batch.seq_len, len(CONLL_TAGS)), -5.0)
    for t, y in enumerate(targets):
        logits[0, t, y if y != IGNORE_INDEX else 0] = 5.0
    served = decode(TaskType.token_classification, CONLL_TAGS, logits[0:1], batch)[0]["entities"]
    assert [(e["label"], e["text"], e["start"], e["end"]) for e in served] == [
        ("ORG", "EU", 0, 2),
        ("LOC", "U.S.", us_start, us_start + 4),
        ("MISC", "British", example.text.index("British"), example.text.index("British") + 7),
    ]


def test_truncated_words_come_back_as_outside(train_backbone):
    example = TokenExample(words=["Paris"] * 300, tags=["B-LOC"] * 300)
    encoded, ids, targets = _align(train_backbone, example)
    assert encoded.truncated
    back = word_label_ids_from_tokens(encoded, example.spans, targets, outside=0)
    kept = len(encoded) - 2
    assert back[:kept] == ids[:kept] and set(back[kept:]) == {0}


def test_read_table_formats(tmp_path):
    tsv = tmp_path / "a.tsv"
    tsv.write_text('sentence\tlabel\nhe said "hi" \t1\nno\t0\n')
    data = read_table(tsv, text_column="sentence", label_column="label", label_map={"0": "neg", "1": "pos"})
    assert [(ex.text, ex.label) for ex in data.examples] == [('he said "hi"', "pos"), ("no", "neg")]

    cola_like = tmp_path / "cola.tsv"
    cola_like.write_text("gj04\t1\t\tGood one.\ngj04\t0\t*\tBad one the.\n")
    data = read_table(cola_like, text_column=3, label_column="1", header=False)
    assert [(ex.text, ex.label) for ex in data.examples] == [("Good one.", "1"), ("Bad one the.", "0")]

    csv_file = tmp_path / "a.csv"
    csv_file.write_text('text,hypothesis,label\n"a, b",c,yes\nd,"e ""f""",no\n')
    data = read_table(csv_file, text_column="text", pair_column="hypothesis", label_column="label")
    assert data.has_pairs and data.text_pairs() == ["c", 'e "f"'] and data.texts() == ["a, b", "d"]

    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join(json.dumps({"t": t, "y": y}) for t, y in [("x", 0), ("z", 1)]) + "\n")
    data = read_table(jsonl, text_column="t", label_column="y")
    assert [(ex.text, ex.label) for ex in data.examples] == [("x", "0"), ("z", "1")]
    # JSON's booleans keep their spelling (a label map keyed "true" finds them), in lists too
    jsonl.write_text("\n".join(json.dumps({"t": t, "y": y}) for t, y in [("x", False), ("z", True)]) + "\n")
    data = read_table(jsonl, text_column="t", label_column="y")
    assert [(ex.text, ex.label) for ex in data.examples] == [("x", "false"), ("z", "true")]
    data = read_table(jsonl, text_column="t", label_column="y", label_map={"false": "no", "true": "yes"})
    assert [ex.label for ex in data.examples] == ["no", "yes"]
    jsonl.write_text(json.dumps({"t": "x", "y": [True, "spam"]}) + "\n")
    data = read_table(jsonl, text_column="t", label_column="y", multi_label=True)
    assert data.examples[0].label == ("true", "spam")


@pytest.mark.parametrize("name, body", [
    ("excel.csv", "text,label\r\nA fine day,yes\r\n\"A dull, grey day\",no\r\n"),
    ("excel.tsv", "text\tlabel\r\nA fine day\tyes\r\nA dull, grey day\tno\r\n"),
    ("excel.jsonl", '{"text": "A fine day", "label": "yes"}\r\n{"text": "A dull, grey day", "label": "no"}\r\n'),
])
def test_a_spreadsheets_byte_order_mark_and_crlf_lines_read_as_plain_utf8(tmp_path, name, body):
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())  # what Excel's "CSV UTF-8" writes first
    data = read_table(path, text_column="text", label_column="label")
    assert [(ex.text, ex.label) for ex in data.examples] == [("A fine day", "yes"), ("A dull, grey day", "no")]


def test_read_table_errors_name_the_problem(tmp_path):
    path = tmp_path / "a.tsv"
    path.write_text("sentence\tlabel\nonly-one-column\n")
    with pytest.raises(ValueError, match="no column 'text'"):
        read_table(path, text_column="text", label_column="label")
    with pytest.raises(ValueError, match=r"a.tsv:2: 1 column\(s\), column 1"):
        read_table(path, text_column="sentence", label_column="label")
    path.write_text("sentence\tlabel\nfine\t7\n")
    with pytest.raises(ValueError, match="not in the label map"):
        read_table(path, text_column=0, label_column=1, label_map={"0": "a"})


def test_data_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TMOD_DATA_DIR", str(tmp_path))
    assert default_data_dir() == tmp_path
    (tmp_path / "sst2").mkdir()
    (tmp_path / "sst2" / "train.tsv").write_text("sentence\tlabel\nfine\t1\n")
    assert preset_spec(PRESETS["sst2"], "train").path == tmp_path / "sst2" / "train.tsv"
    monkeypatch.delenv("TMOD_DATA_DIR")
    assert default_data_dir().parts[-2:] == ("shared", "data")


SHARED_COUNTS = {"sst2": (66477, 872), "cola": (7551, 1000), "rte": (2490, 277), "conll2003": (14041, 3250)}


@pytest.mark.parametrize("name", sorted(SHARED_COUNTS))
def test_presets_read_the_shared_data(name):
    preset = PRESETS[name]
    if not preset_spec(preset, "validation").path.is_file():
        pytest.skip(f"shared data not found at {default_data_dir()}")
    train, validation = (preset_spec(preset, split).read() for split in ("train", "validation"))
    assert (len(train), len(validation)) == SHARED_COUNTS[name]
    assert set(train.labels_seen()) == set(preset.labels)
    if name == "rte":
        assert train.has_pairs and all(ex.text_pair for ex in train.examples)


def test_offsets_leave_out_the_leading_space_of_byte_level_tokens():
    """Byte-level BPE (SmolLM2) puts a word's leading space into its token; offsets must not."""
    from server.backbone.tokens import trimmed_offsets

    text, pair = "to Paris", "in  May"
    raw = [(0, 2), (2, 8), (0, 2), (2, 7)]  # as a byte-level tokenizer reports them
    assert trimmed_offsets(raw, [0, 0, 1, 1], text, pair) == [(0, 2), (3, 8), (0, 2), (4, 7)]
    assert trimmed_offsets([(0, 0), (2, 3)], [None, 0], "a  b", None) == [(0, 0), (3, 3)]  # special; all-space token


def test_document_windows_read_documents_as_the_server_cuts_long_texts(tmp_path, train_backbone):
    """`--document-windows`: each document is one example if it fits a window, else overlapping
    windows of whole words, each within the window's word pieces, together covering the document."""
    from server.windows import default_stride
    from training.data.conll import document_windows, read_conll_documents
    from training.data.examples import begin_entities_with_b

    sentences = [[("Alice", "B-PER"), ("met", "O"), ("Bob", "B-PER"), ("Smith", "I-PER"), ("in", "O"),
                  (f"Paris{i}", "B-LOC"), (".", "O")] for i in range(30)]
    lines = ["-DOCSTART- -X- -X- O", ""]
    for sentence in sentences:
        lines += [f"{w} X X {t}" for w, t in sentence] + [""]
    lines += ["-DOCSTART- -X- -X- O", "", "New X X B-LOC", "York X X I-LOC", ""]
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(lines))
    long_doc, short_doc = read_conll_documents(path)
    words = [w for s in long_doc for w in s.words]
    tags = [t for s in long_doc for t in s.tags]

    window = 32
    examples = document_windows(path, train_backbone.text, [window])[window]
    assert examples[-1] == TokenExample(["New", "York"], ["B-LOC", "I-LOC"])  # fits: the document whole
    windows = examples[:-1]
    assert len(windows) > 5
    starts = []
    for ex in windows:
        start = next(i for i in range(len(words)) if words[i:i + len(ex.words)] == ex.words)
        # a contiguous stretch, tags kept, but an entity the window cuts begins where the window does
        assert ex.tags == begin_entities_with_b(tags[start:start + len(ex.words)])[0]
        assert len(train_backbone.text.encode([ex.text])[0]) <= window  # special tokens included
        starts.append((start, start + len(ex.words)))
    assert starts[0][0] == 0 and starts[-1][1] == len(words)
    assert any(ex.tags[0] == "B-PER" and ex.words[0] == "Smith" for ex in windows)  # a window cut Bob Smith
    for (a, b), (c, d) in zip(starts, starts[1:]):
        assert a < c < b < d  # each window starts inside the one before: neighbours overlap
    overlap = window - default_stride(window)
    assert all(b - c <= overlap for (a, b), (c, d) in zip(starts, starts[1:]))  # words shared: at most the overlap
