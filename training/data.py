"""Labelled data for training and scoring heads: table (TSV, CSV, JSON/JSONL) and CoNLL readers,
dataset presets, and the mapping of word-level tags onto sub-word tokens and back. Token tasks come
from CoNLL files, from JSONL word lists with their tags (a Hugging Face dataset's rows), or from texts
with their entities as character spans (annotation tools' exports), split into words as BERT's
pre-tokenizer splits them (`word_spans`).

Token tasks build their text by joining the words with single spaces and keep each word's
character span, so training tokenizes exactly as the server does (`Backbone.tokenize` on a plain
string) and a word's tag can be found again from token offsets.
"""
from __future__ import annotations

import bisect
import csv
import gzip
import json
import os
import random
import re
import sys
import unicodedata
import zlib
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from modules_store import TaskType

if TYPE_CHECKING:  # annotations only: importing the tokens module imports torch (~2 s), and tmod-train's
    from server.backbone.tokens import EncodedInput  # --help and usage errors need none of it

REPO_ROOT = Path(__file__).resolve().parents[1]
IGNORE_INDEX = -100  # label of tokens the loss skips (torch's cross_entropy default)
CONLL_TAGS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]
FORMATS = ("tsv", "csv", "jsonl", "conll")


ENCODING = "utf-8-sig"  # UTF-8, with or without the byte-order mark spreadsheets write first
WORKBOOK_MAGIC = (b"PK\x03\x04", b"\xd0\xcf\x11\xe0")  # .xlsx / .ods (zip), .xls (OLE)
WORKBOOK_SUFFIXES = ("xlsx", "xlsm", "xls", "ods")
GZIP_MAGIC = b"\x1f\x8b"


def folder_error(path: Path) -> "UsageError":
    """A folder given for a file; a Hugging Face dataset's `save_to_disk` folder said as such."""
    if any((path / name).is_file() for name in ("state.json", "dataset_info.json", "dataset_dict.json")):
        return UsageError(f"{path}: a Hugging Face dataset saved with save_to_disk, which is not read; write it as "
                          f"JSONL first, e.g. datasets.load_from_disk('{path.name}').to_json('train.jsonl') (a "
                          "DatasetDict: each split's)")
    return UsageError(f"{path}: a folder; give a file (TSV, CSV, JSONL or CoNLL)")


def workbook_error(path: Path) -> "UsageError":
    return UsageError(f"{path}: a spreadsheet workbook is not read; save the sheet as CSV first (Excel: File > Save "
                      "As > CSV UTF-8; LibreOffice: Save As > Text CSV), or as tab-separated text")


def open_text(path: Path, newline: str | None = None):
    """The file as text: UTF-8 (ENCODING), or UTF-16 where it starts with its byte-order mark (Excel's
    "Unicode text", a TSV); gzip-compressed (`train.tsv.gz`, as datasets are often published) or not.
    A workbook (a zip or OLE file) is refused: read as text it is a few garbled rows."""
    with open(path, "rb") as fh:
        start = fh.read(4)
    compressed = start.startswith(GZIP_MAGIC)
    if compressed:  # what the file holds starts after its compression
        with gzip.open(path, "rb") as fh:
            start = fh.read(4)
    if start.startswith(WORKBOOK_MAGIC):
        raise workbook_error(path)
    encoding = "utf-16" if start[:2] in (b"\xff\xfe", b"\xfe\xff") else ENCODING
    return (gzip.open if compressed else open)(path, "rt", encoding=encoding, newline=newline)


class UsageError(ValueError):
    """A mistake in the user's data or options (a missing file, an unknown column, an empty label...):
    `tmod-train` answers it with one line naming the file and line, and exit status 2."""


class EmptyCell(UsageError):
    """A row whose text or label is empty: a file's such rows are named together (`refuse_empty`), so
    a spreadsheet with a few unlabelled rows is mended in one go, not one error at a time."""


def refuse_empty(path: Path, empty: list[EmptyCell]) -> None:
    if not empty:
        return
    if len(empty) == 1:
        raise empty[0]
    shown = "; ".join(str(exc).removeprefix(f"{path}:").strip() for exc in empty[:6])
    more = f"; {len(empty) - 6} more" if len(empty) > 6 else ""
    raise UsageError(f"{path}: {len(empty)} rows with an empty text or label ({shown}{more}): fill them in or remove "
                     "them")


def default_data_dir() -> Path:
    """$TMOD_DATA_DIR, else ../shared/data relative to the repository root."""
    env = os.environ.get("TMOD_DATA_DIR")
    return Path(env) if env else (REPO_ROOT / ".." / "shared" / "data").resolve()


# ---- examples ---------------------------------------------------------------------------------
@dataclass
class SequenceExample:
    text: str
    label: str | tuple[str, ...]  # a tuple of names for multi-label data (any number, none included)
    text_pair: str | None = None


@dataclass
class TokenExample:
    words: list[str]
    tags: list[str]
    # where `words` start among all the words of the CoNLL file read (they are a run of its words, in
    # order): how a document window finds its words' teacher logits (training/distill.py)
    file_offset: int | None = field(default=None, compare=False)
    # which of the file's -DOCSTART- documents it is in (0 in a file without them): --split keeps a
    # document's sentences in one part (training/splits.py carve)
    document: int | None = field(default=None, compare=False)

    @property
    def text(self) -> str:
        return " ".join(self.words)

    @property
    def spans(self) -> list[tuple[int, int]]:
        """(start, end) of each word in `text`."""
        out, start = [], 0
        for word in self.words:
            out.append((start, start + len(word)))
            start += len(word) + 1
        return out


def begin_entities_with_b(tags: Sequence[str]) -> tuple[list[str], int]:
    """`tags` with each entity that begins with I- begun with B- instead, and how many were: IOB1 tags
    (B- only where an entity directly follows one of its type, as CoNLL-2003's original release writes
    them) or slips in BIO. The entities are the same (training/metrics.py reads them so); the head
    learns the BIO order the server decodes tags in (an I- only after a B- or I- of its type). Read
    without torch (server/heads/decode.py's split_tag reads tags alike: a bare `PER` continues as an I-)."""
    out, begun, before = [], 0, "O"
    for tag in tags:
        kind = tag[2:]
        if tag.startswith("I-") and before not in ("B-" + kind, "I-" + kind, kind):
            tag, begun = "B-" + kind, begun + 1
        out.append(tag)
        before = tag
    return out, begun


@dataclass
class LabelledData:
    """One split: its examples, the task type they imply and where they came from."""

    task_type: TaskType
    examples: list
    source: str
    has_pairs: bool = False

    def __len__(self) -> int:
        return len(self.examples)

    def labels_seen(self) -> list[str]:
        return sorted({label for ex in self.examples for label in self.labels_of(ex)})

    def labels_of(self, example) -> set[str]:
        """One example's labels: its tags (token tasks), its labels (multi-label), or its label."""
        if self.task_type == TaskType.token_classification:
            return set(example.tags)
        if self.task_type == TaskType.multi_label_classification:
            return set(example.label)
        return {example.label}

    def texts(self) -> list[str]:
        return [ex.text for ex in self.examples]

    def text_pairs(self) -> list[str] | None:
        return [ex.text_pair for ex in self.examples] if self.has_pairs else None

    def subset(self, n: int | None, seed: int) -> "LabelledData":
        """A seeded random subset of n examples, kept in file order (for quick runs)."""
        if not n or n >= len(self.examples):
            return self
        return LabelledData(self.task_type, seeded_subset(self.examples, n, seed), self.source, self.has_pairs)

    def with_entities_begun_with_b(self) -> tuple["LabelledData", int]:
        """Token data with every entity begun with B- (`begin_entities_with_b`), and how many were not."""
        if self.task_type != TaskType.token_classification:
            return self, 0
        examples, begun = [], 0
        for ex in self.examples:
            tags, n = begin_entities_with_b(ex.tags)
            examples.append(replace(ex, tags=tags) if n else ex)
            begun += n
        return (LabelledData(self.task_type, examples, self.source, self.has_pairs), begun) if begun else (self, 0)

    def named_by_position(self, names: Sequence[str]) -> "LabelledData":
        """Labels written as class ids (0, 1, ..., as a Hugging Face dataset's ClassLabel writes them)
        named by their place in `names`, where every label is such an id and none is a name itself
        (star ratings 1-5 named 1-5 stay as they are); else the data as it is."""
        seen = set(self.labels_seen())
        ids = {label: _whole(label) or label for label in seen}  # 1.0 as pandas writes an id: 1
        if not seen or seen <= set(names) or not all(i.isdigit() and int(i) < len(names) for i in ids.values()):
            return self
        named = {str(i): label for i, label in enumerate(names)}

        def name(label: str) -> str:
            return named[ids[label]]
        if self.task_type == TaskType.token_classification:
            examples = [replace(ex, tags=[name(tag) for tag in ex.tags]) for ex in self.examples]
        elif self.task_type == TaskType.multi_label_classification:
            examples = [replace(ex, label=tuple(name(label) for label in ex.label)) for ex in self.examples]
        else:
            examples = [replace(ex, label=name(ex.label)) for ex in self.examples]
        return LabelledData(self.task_type, examples, self.source, self.has_pairs)


# ---- readers ----------------------------------------------------------------------------------
Column = int | str


def _column_index(column: Column, header: list[str] | None, path: Path) -> int:
    if isinstance(column, int):
        return column
    if column.lstrip("-").isdigit():
        return int(column)
    if header is None:
        raise UsageError(f"{path}: column {column!r} is a name but the file has no header (--no-header); give its 0-based index")
    if column not in header:
        raise UsageError(f"{path}: no column {column!r}; the header line has {header}")
    return header.index(column)


def _by_default(column: Column | None, name: str, index: int, header: list[str] | None) -> Column:
    """A column not named by the user: the one the header calls `name`, else the `index`th."""
    if column is not None:
        return column
    return name if header and name in header else index


# a cell as CSV quotes it, holding a doubled quote: only a writer that quotes writes one
QUOTED_CELL = re.compile(r'"(?:[^"]|"")*""(?:[^"]|"")*"')


def _rows(path: Path, fmt: str) -> list[tuple[int, list[str]]]:
    """(line number, cells) of each non-blank row."""
    with open_text(path, newline="") as fh:
        if fmt == "csv":
            first = fh.readline()
            fh.seek(0)
            # a spreadsheet set to a comma-decimal locale writes "text;label": its first line says so
            reader = csv.reader(fh, delimiter=";" if ";" in first and "," not in first else ",")
            return [(reader.line_num, row) for row in reader if row]
        # TSV has no quoting (texts contain '"', and GLUE's start with one): split on tabs only ...
        rows = [(n, line.rstrip("\r\n").split("\t")) for n, line in enumerate(fh, 1) if line.strip()]
        if not any(QUOTED_CELL.fullmatch(cell) for _, row in rows for cell in row):
            return rows
        # ... unless its writer quoted as CSV does (pandas' to_csv(sep="\t"), a Hugging Face Dataset.to_csv):
        # a text holding a quote is then "...""...""...", and split on tabs it would be learnt so
        print(f'{path}: cells quoted as CSV quotes them ("...""..."): read as quoted', file=sys.stderr)
        fh.seek(0)
        reader = csv.reader(fh, delimiter="\t")
        return [(reader.line_num, row) for row in reader if row and any(cell.strip() for cell in row)]


def _lines(path: Path):
    """A file's lines, read as UTF-8; a missing or undecodable file is a UsageError."""
    if path.is_dir():
        raise folder_error(path)
    if not path.is_file():
        raise UsageError(f"no such file: {path}")
    try:
        with open_text(path) as fh:
            yield from enumerate(fh, 1)
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}) nor UTF-16 with "
                         f"its byte-order mark; convert it first, e.g. iconv -f latin1 -t utf-8") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:  # cut short in a download, say
        raise UsageError(f"{path}: a broken gzip file ({exc}); download it again, or check it with gzip -t") from None


def read_table(path: str | Path, *, text_column: Column | None, label_column: Column | None,
               pair_column: Column | None = None,
               fmt: str | None = None, header: bool = True, label_map: dict[str, str] | None = None,
               multi_label: bool = False) -> LabelledData:
    """Sequence examples from a TSV, CSV or JSONL file. Columns are names (header/JSON keys) or
    0-based indices (None in a table: the header's `text` / `label` column, else the longest column
    the others leave (`_text_column`) / the column of fewest different values (`_label_column`));
    `label_map` renames raw labels (e.g. {"0": "negative"}). `multi_label`: a label cell holds any
    number of labels, comma-separated (a JSON list in JSONL), or `label_column` names one 0/1 column per
    label ("toxic,obscene"). A JSONL record whose text is a list of words is a token example, its label
    the list of their tags (a Hugging Face dataset's rows as `to_json` writes them: `tokens` and
    `ner_tags`, the keys taken when `text` and `label` are absent); one whose label is a list of
    character spans (`label`, `entities` or `spans`) is a token example too (`_span_example`)."""
    path = Path(path)
    fmt = fmt or guess_format(path)
    examples, empty = [], []
    # --multi-label with --label-column a,b,c: one 0/1 column per label (Jigsaw's toxic, obscene, ...)
    flags = [c.strip() for c in label_column.split(",")] if multi_label and isinstance(label_column, str) \
        and "," in label_column else None
    if fmt == "jsonl":
        records = _answered(path, list(_json_records(path)))
        if text_column is None and records:
            text_column = _text_key(path, records[0][1], {label_column, pair_column, *(flags or ())})
        for where, record in records:
            try:
                text_key, label_key = _json_keys(record, text_column, flags[0] if flags else label_column, multi_label)
                text = record[text_key]
                label = [c for c in flags if _present(record[c], c, where)] if flags else _listed(record[label_key])
                pair = record[pair_column] if pair_column is not None else None
            except (KeyError, TypeError) as exc:
                if isinstance(record, dict) and {"data", "annotations"} <= set(record):
                    raise UsageError(f"{where}: a Label Studio export (JSON), which is not read; export as JSON-MIN "
                                     "(a record's text and labels: entity spans are read as they are, a choice under "
                                     "its control's name, e.g. --label-column sentiment)") from None
                if not isinstance(record, dict):
                    raise UsageError(f"{where}: a record is a JSON object ({{\"text\": ..., \"label\": ...}}), not "
                                     f"{json.dumps(record)[:80]}") from None
                raise UsageError(f"{where}: no key {exc} in {sorted(record)}; "
                                 f"name it with --text-column / --label-column / --pair-column") from None
            if isinstance(text, list):
                example = _token_example(text, label, label_map, where)
            elif isinstance(label, list) and not multi_label and all(map(_is_span, label)):
                example = _span_example(text, label, label_map, where)
            else:
                try:
                    example = _example(text, label, pair, label_map, multi_label, where)
                except EmptyCell as exc:
                    empty.append(exc)
                    continue
            _check_same_kind(examples, example, where, "record")
            examples.append(example)
        if pair_column is None and examples and isinstance(examples[0], SequenceExample):
            first = records[0][1]
            taken = set(_json_keys(first, text_column, flags[0] if flags else label_column, multi_label)) | set(flags or ())
            _say_unread_texts(path, {f"key {key!r}": [record.get(key) for _, record in records[:SAMPLE_ROWS]
                                                      if isinstance(record, dict)]
                                     for key in first if key not in taken})
    elif fmt in ("tsv", "csv"):
        list(_lines(path))  # missing file, bad encoding: one clear line
        rows = _rows(path, fmt)
        names = [name.strip() for name in rows.pop(0)[1]] if header and rows else None  # "text , label" names text
        pair_i = _column_index(pair_column, names, path) if pair_column is not None else None
        named = text_column is not None or (names and "text" in names)
        named_text_i = _column_index(_by_default(text_column, "text", 0, names), names, path) if named else None
        sample = [row for _, row in rows[:SAMPLE_ROWS]]  # what the columns left unnamed are chosen by
        if flags:
            label_is = [_column_index(c, names, path) for c in flags]
        elif label_column is not None or (names and "label" in names):
            label_is = [_column_index(_by_default(label_column, "label", 1, names), names, path)]
        else:
            label_is = [_label_column(path, sample, names, {named_text_i, pair_i})]
        text_i = named_text_i if named else _text_column(path, sample, names, {*label_is, pair_i})
        if pair_i is None:
            _say_unread_texts(path, {f"column {_column_name(i, names)}": [row[i] for row in sample if len(row) > i]
                                     for i in _free_columns(sample, {text_i, *label_is})})
        needed = max(i for i in (text_i, *label_is, pair_i) if i is not None)
        separator = label_separator([row[label_is[0]] for _, row in rows if len(row) > label_is[0]]) \
            if multi_label and not flags else ","
        for line_no, row in rows:
            where = f"{path}:{line_no}"
            if names and [cell.strip() for cell in row] == names:  # exports joined: "label" learnt as a label
                raise UsageError(f"{where}: the header line again (files joined with theirs?): remove it")
            if len(row) <= needed:
                hint = " (is it a CSV file? give --format csv)" if fmt == "tsv" and "," in row[0] else ""
                raise UsageError(f"{where}: {len(row)} column(s), column {needed} (0-based) is needed{hint}")
            label = [c for c, i in zip(flags, label_is) if _present(row[i], c, where)] if flags \
                else _listed(row[label_is[0]])
            plain = not (flags or multi_label or pair_i is not None)
            words = _listed(row[text_i]) if plain and isinstance(label, list) else None
            try:
                if isinstance(words, list):  # a token dataset through pandas' to_csv: words and their tags
                    example = _token_example(words, label, label_map, where)
                else:
                    example = _example(row[text_i], label, row[pair_i] if pair_i is not None else None, label_map,
                                       multi_label, where, separator)
            except EmptyCell as exc:
                empty.append(exc)
                continue
            _check_same_kind(examples, example, where, "row")
            examples.append(example)
    else:
        raise UsageError(f"{path}: read_table handles tsv/csv/jsonl, not {fmt!r}")
    refuse_empty(path, empty)
    if not examples:
        raise UsageError(f"{path}: no examples")
    if isinstance(examples[0], TokenExample):
        if multi_label or pair_column is not None:
            raise UsageError(f"{path}: word tags are one per word: no --multi-label or --pair-column")
        return LabelledData(TaskType.token_classification, examples, str(path))
    if not multi_label:
        _say_joined_labels(path, examples)
    task_type = TaskType.multi_label_classification if multi_label else TaskType.sequence_classification
    return LabelledData(task_type, examples, str(path), has_pairs=pair_column is not None)


def _say_joined_labels(path: Path, examples: list) -> None:
    """Labels that join others of the file ("4,27" beside "4" and "27", as GoEmotions' files write a
    text's several emotions): without --multi-label each is learnt as a class of its own. Said, not
    refused: a label may hold a comma."""
    labels = {example.label for example in examples}
    separator = label_separator(sorted(labels))
    joined = sorted(label for label in labels
                    if len(parts := [part.strip() for part in label.split(separator)]) > 1 and set(parts) <= labels)
    if joined:
        first = joined[0]
        parts = " and ".join(repr(part.strip()) for part in first.split(separator))
        print(f"{path}: {len(joined)} of the {len(labels)} labels join others ({first!r} is {parts}), learnt as "
              "classes of their own: if a text can have several labels, --multi-label reads each cell as its labels",
              file=sys.stderr)


def _check_same_kind(examples: list, example, where: str, unit: str) -> None:
    """One file is one task: tagged words (a token task) or labelled texts, not both."""
    if examples and isinstance(example, TokenExample) != isinstance(examples[0], TokenExample):
        kinds = ("a labelled text", "tagged words")
        raise UsageError(f"{where}: {kinds[isinstance(example, TokenExample)]} where the first {unit} had "
                         f"{kinds[isinstance(examples[0], TokenExample)]}")


def _text_key(path: Path, record, taken: set) -> str | None:
    """A JSONL file's texts' key where none is named and its first record has no `text` (nor `tokens`,
    a token task's words): the key of the longest string among those the labels and pairs do not take,
    said (a Hugging Face export's `{"idx", "sentence", "label"}`); None to read `text` as before."""
    if not isinstance(record, dict) or "text" in record or "tokens" in record:
        return None
    strings = {key: value for key, value in record.items()
               if isinstance(value, str) and key not in taken and key not in ("label", "labels")}
    if not strings:
        return None
    key = max(strings, key=lambda k: len(strings[k]))
    print(f"{path}: texts read from key {key!r} (the longest string; no key is named 'text'): --text-column names "
          "another", file=sys.stderr)
    return key


SAMPLE_ROWS = 500  # the first rows of a file, which choose the columns not named


def _free_columns(sample: list, taken: set) -> list[int]:
    """The columns of the rows `sample` that `taken` leaves, in order."""
    return [i for i in range(max((len(row) for row in sample), default=0)) if i not in taken]


def _column_name(i: int, names: list[str] | None) -> str:
    """A column as a message names it: its header name, else its index."""
    return repr(names[i]) if names and i < len(names) else str(i)


def _label_column(path: Path, sample: list, names: list[str] | None, taken: set) -> int:
    """The labels' column where none is named (no --label-column, no header column `label`): of the
    columns the texts and pairs do not take, the one whose cells repeat most (fewest different values
    over the first rows, `sample`: a label repeats, an id or a text does not; a column of one value only where
    nothing else repeats), said where it is not column 1. A spreadsheet's `id,review,sentiment` read
    its reviews as the labels and the sentiments as the texts."""
    free = _free_columns(sample, taken)
    if not free:
        return 1

    def rank(i: int) -> tuple:
        cells = [row[i].strip() for row in sample if len(row) > i]
        different = len(set(cells))
        return different == len(cells), different < 2, different, i != 1  # of equals, column 1 as before

    chosen = min(free, key=rank)
    if chosen != 1:
        print(f"{path}: labels read from column {_column_name(chosen, names)} (the fewest different values; no "
              "column is named 'label'): --label-column names another", file=sys.stderr)
    return chosen


def _text_column(path: Path, sample: list, names: list[str] | None, taken: set) -> int:
    """The texts' column where none is named (no --text-column, no header column `text`): of the columns
    the labels and text pairs do not take, the one of longest cells (over the first rows, `sample`), said where
    it is not the first column: a Hugging Face export's `idx,sentence,label` puts row numbers first, and
    a head learnt on them answers nothing (refused where every such column holds numbers)."""
    free = _free_columns(sample, taken)  # no rows: "no examples", said below
    if not free:
        return 0
    lengths = {i: sum(len(row[i]) for row in sample if len(row) > i) for i in free}
    chosen = max(free, key=lambda i: (lengths[i], -i))  # the longest; of equal ones, the first
    name = _column_name(chosen, names)
    if all(is_number(row[chosen]) for row in sample if len(row) > chosen):
        raise UsageError(f"{path}: no column holds texts: column {name}, the longest, holds numbers; name the "
                         "texts' column with --text-column")
    if chosen != 0:
        print(f"{path}: texts read from column {name} (the longest; no column is named 'text'): --text-column names "
              "another", file=sys.stderr)
    return chosen


def _say_unread_texts(path: Path, columns: dict[str, list]) -> None:
    """Where no pair column is named: say a column (`columns`: name -> its first cells) that holds texts
    too, left unread. A pair file (RTE's `sentence1, sentence2`) read without --pair-column trained on
    its first texts alone, blind to the second, and nothing said so. Texts: mostly different cells of
    several words each, none a number (not a label, an id, a score)."""
    for name, cells in columns.items():
        cells = [cell for cell in cells if isinstance(cell, str)]
        if (len(cells) >= 2 and len(set(cells)) > len(cells) / 2 and not any(is_number(cell) for cell in cells)
                and sum(len(cell.split()) > 2 for cell in cells) > len(cells) / 2):
            print(f"{path}: {name} holds texts too and is not read: for a task on text pairs (entailment, "
                  "paraphrase) name it with --pair-column", file=sys.stderr)
            return


def is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _present(value, column: str, where: str) -> bool:
    """A 0/1 label column's cell: is its label present?"""
    text = str(value).strip().lower()
    if text in ("1", "1.0", "true", "yes"):
        return True
    if text in ("0", "0.0", "false", "no", ""):
        return False
    raise UsageError(f"{where}: column {column!r} holds {str(value)[:40]!r}; each of several --label-column columns "
                     "says whether its label is present: 0 or 1")


def _json_records(path: Path):
    """(where, record) of a JSONL file's lines; or of a JSON file holding one list of records (what
    pandas' `to_json(orient="records")` and `Dataset.to_json(lines=False)` write), by its index."""
    lines = list(_lines(path))  # a missing or undecodable file: one clear line
    first = next((line.lstrip()[:1] for _, line in lines if line.strip()), "")
    if first == "{":  # one object in the whole file: pandas' DataFrame.to_json (its default orient, "columns")?
        try:
            value = json.loads("".join(line for _, line in lines))
        except json.JSONDecodeError:  # several lines of records (JSONL): read below
            value = None
        found = _pandas_records(value) if isinstance(value, dict) else None
        if found is not None:
            orient, records = found
            print(f"{path}: one JSON object, read as pandas' DataFrame.to_json writes it (orient={orient!r})",
                  file=sys.stderr)
            yield from ((f"{path}: record {i}", record) for i, record in enumerate(records))
            return
    if first == "[":
        try:
            records = json.loads("".join(line for _, line in lines))
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}:{exc.lineno}: not JSON ({exc.msg})") from None
        if records and all(map(_is_spacy_example, records)):
            print(f"{path}: spaCy's training examples ([text, {{\"entities\" or \"cats\": ...}}]): read as their "
                  "text and entity spans or categories", file=sys.stderr)
            records = [_spacy_record(*example) for example in records]
        yield from ((f"{path}: record {i}", record) for i, record in enumerate(records))
        return
    for line_no, line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}:{line_no}: not a JSON record ({exc.msg})") from None
        yield f"{path}:{line_no}", record


def _answered(path: Path, records: list) -> list:
    """Prodigy's `db-out` records carry the annotator's `answer`: `accept` is an annotation, `ignore` and
    `reject` are not (a rejected example's entities were learnt as if accepted): skipped, said. A binary
    answer, `reject` of one `label`, means "not that label", which the label cannot say: refused."""
    answers = Counter(str(record["answer"]) for _, record in records if isinstance(record, dict) and "answer" in record)
    if set(answers) <= {"accept"} or not set(answers) <= {"accept", "reject", "ignore"}:  # another file's "answer"
        return records
    for where, record in records:
        if isinstance(record, dict) and record.get("answer") == "reject" and isinstance(record.get("label"), str):
            raise UsageError(f"{where}: a Prodigy binary answer (reject of the label {record['label']!r}): read as "
                             "that label it would be learnt backwards; annotate with a manual or choice recipe "
                             "(textcat.manual), whose accepted labels are read")
    kept = [(where, record) for where, record in records
            if not (isinstance(record, dict) and record.get("answer") in ("reject", "ignore"))]
    counts = ", ".join(f"{answers[answer]} {answer}" for answer in ("reject", "ignore") if answers[answer])
    print(f"{path}: {len(records) - len(kept)} Prodigy records not accepted ({counts}): skipped, not annotations",
          file=sys.stderr)
    return kept


def _is_spacy_example(item) -> bool:
    """spaCy's (v2, and its tutorials') training example: [text, {"entities": [[start, end, label], ...]}]
    or [text, {"cats": {label: 1.0 or 0.0, ...}}]."""
    return isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], dict) \
        and bool({"entities", "cats"} & set(item[1]))


def _spacy_record(text: str, annotations: dict) -> dict:
    """A spaCy example as the record it means: its entity spans, or the categories scored 0.5 or more
    (one for a single-label task, any number with --multi-label)."""
    if "entities" in annotations:
        return {"text": text, "entities": annotations["entities"]}
    cats = annotations["cats"]
    return {"text": text, "labels": [label for label, score in cats.items() if isinstance(score, (int, float))
                                     and not isinstance(score, bool) and score >= 0.5]}


def _pandas_records(value: dict) -> tuple[str, list] | None:
    """(orient, records) of a JSON object as pandas' DataFrame.to_json writes a table: orient "columns"
    (its default: column -> {row: cell}), "index" (row -> record), "split" (columns, index, data) or
    "table" (schema, data); None for anything else (a one-line JSONL file's record). Read as records it
    was one record whose text and label were whole columns."""
    if set(value) in ({"columns", "index", "data"}, {"columns", "data"}) and isinstance(value["data"], list):
        return "split", [dict(zip(value["columns"], row)) for row in value["data"]]
    if set(value) == {"schema", "data"} and isinstance(value["data"], list):
        return "table", value["data"]
    if value and all(isinstance(cells, dict) for cells in value.values()):
        if all(key.lstrip("-").isdigit() for key in value):  # rows by their index
            return "index", list(value.values())
        rows = list(next(iter(value.values())))
        return "columns", [{column: cells.get(row) for column, cells in value.items()} for row in rows]
    return None


def _json_keys(record: dict, text_column: Column | None, label_column: Column | None, multi_label: bool
               ) -> tuple[Column, Column]:
    """A JSONL record's text and label keys: as named, else `text` (or `tokens`) and `label` (`labels`
    with --multi-label; or `ner_tags`, then `tags`, beside `tokens`)."""
    text = text_column if text_column is not None else "tokens" if "text" not in record and "tokens" in record \
        else "text"
    if label_column is not None:
        return text, label_column
    names = ("labels", "label") if multi_label else ("label", "labels")  # a list of one is that label
    label = next((name for name in names if name in record), names[0])
    if label not in record:  # a token dataset's tags, or an annotation tool's entity spans
        others = ("ner_tags", "tags") if text == "tokens" else ("entities", "spans", "accept")  # Prodigy's choices
        label = next((key for key in others if key in record), label)
    return text, label


def _is_span(item) -> bool:
    """An entity span as annotation tools write them: doccano's [start, end, label], or a record
    with start / end (doccano's start_offset / end_offset; spaCy's, Prodigy's and Label Studio's start /
    end) and a label (Label Studio's JSON-MIN: a list of one label, `labels`)."""
    if isinstance(item, list):
        return len(item) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in item[:2]) \
            and isinstance(item[2], str)
    return isinstance(item, dict) and ("label" in item or (isinstance(item.get("labels"), list)
                                                           and len(item["labels"]) == 1)) \
        and (("start" in item and "end" in item) or ("start_offset" in item and "end_offset" in item))


def _span_bounds(item) -> tuple:
    if isinstance(item, list):
        return tuple(item)
    label = item["label"] if "label" in item else item["labels"][0]
    return item.get("start", item.get("start_offset")), item.get("end", item.get("end_offset")), label


# CJK ideographs, each a word of its own to BERT's pre-tokenizer (its `handle_chinese_chars`)
_CJK = ((0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0x20000, 0x2A6DF), (0x2A700, 0x2CEAF),
        (0x2F800, 0x2FA1F))


def _own_word(char: str) -> bool:
    """A character BERT's pre-tokenizer makes a word of its own: punctuation (ASCII's symbols too) or CJK."""
    code = ord(char)
    return (33 <= code <= 47 or 58 <= code <= 64 or 91 <= code <= 96 or 123 <= code <= 126
            or unicodedata.category(char).startswith("P") or any(a <= code <= b for a, b in _CJK))


def word_spans(text: str) -> list[tuple[int, int]]:
    """The words of a text as BERT's pre-tokenizer splits them (at white space; every punctuation
    character and CJK ideograph a word of its own), so that tags given to them line up with the words
    the server tags."""
    spans = []
    for chunk in re.finditer(r"\S+", text):
        start = chunk.start()
        for i in range(chunk.start(), chunk.end()):
            if _own_word(text[i]):
                if start < i:
                    spans.append((start, i))
                spans.append((i, i + 1))
                start = i + 1
        if start < chunk.end():
            spans.append((start, chunk.end()))
    return spans


def _span_example(text, spans: list, label_map: dict[str, str] | None, where: str) -> TokenExample:
    """A text and its entities as character spans (an annotation tool's export) -> its words tagged
    BIO. A span is trimmed of surrounding white space and must start and end at word boundaries."""
    if not isinstance(text, str) or not text.strip():
        raise UsageError(f"{where}: empty text")
    words = word_spans(text)
    starts, ends = [a for a, _ in words], [b for _, b in words]
    tags = ["O"] * len(words)
    for item in sorted(spans, key=lambda item: _span_bounds(item)[0]):
        start, end, label = _span_bounds(item)
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= len(text)):
            raise UsageError(f"{where}: entity {json.dumps(item)[:80]} is not a span of the text "
                             f"({len(text)} characters)")
        piece = text[start:end]
        start, end = start + len(piece) - len(piece.lstrip()), end - len(piece) + len(piece.rstrip())
        first, last = bisect.bisect_left(starts, start), bisect.bisect_left(ends, end)
        if first >= len(words) or last >= len(words) or starts[first] != start or ends[last] != end:
            word = next((text[a:b] for a, b in words if a < end and b > start and (a < start or b > end)), text[start:end])
            raise UsageError(f"{where}: entity {json.dumps(item)[:80]} ({text[start:end]!r}) starts or ends inside "
                             f"the word {word!r}; the words are split at white space and punctuation")
        if any(tag != "O" for tag in tags[first:last + 1]):
            raise UsageError(f"{where}: entity {json.dumps(item)[:80]} overlaps another; BIO tags hold one entity a word")
        kind = _label_name(_label_text(label).strip(), label_map, where)
        if not kind:
            raise UsageError(f"{where}: entity {json.dumps(item)[:80]} has an empty label")
        tags[first:last + 1] = [f"B-{kind}"] + [f"I-{kind}"] * (last - first)
    return TokenExample(words=[text[a:b] for a, b in words], tags=tags)


def _token_example(words: list, tags, label_map: dict[str, str] | None, where: str) -> TokenExample:
    """One JSONL record's words and their tags (names, or numbers named by `label_map`)."""
    if not isinstance(tags, list) or len(tags) != len(words):
        raise UsageError(f"{where}: {len(words)} words need a list of {len(words)} tags, got {json.dumps(tags)[:80]}")
    if not words:
        raise UsageError(f"{where}: no words")
    for i, word in enumerate(words):
        if not isinstance(word, str) or not word.strip() or word != word.strip():
            raise UsageError(f"{where}: word {i} is {json.dumps(word)[:40]}: a word is a non-empty string without "
                             "surrounding spaces")
    if not all(isinstance(tag, (str, int)) and not isinstance(tag, bool) for tag in tags):
        raise UsageError(f"{where}: tags are names or class ids, got {json.dumps(tags)[:60]}")
    names = [_label_name(str(tag).strip(), label_map, where) for tag in tags]  # ids: named by --labels later
    if not all(names):
        raise UsageError(f"{where}: empty tag")
    return TokenExample(words=list(words), tags=names)


def label_separator(cells: list[str]) -> str:
    """What separates a multi-label cell's labels: a comma, or where no cell holds one, the `|` or `;`
    that some do (MovieLens writes genres "Action|Comedy")."""
    if any("," in cell for cell in cells):
        return ","
    return next((sep for sep in "|;" if any(sep in cell for cell in cells)), ",")


def _example(text, label, pair, label_map, multi_label: bool = False, where: str = "", separator: str = ","
             ) -> SequenceExample:
    if text is None or not str(text).strip():
        raise EmptyCell(f"{where}: empty text")
    if multi_label:  # an empty cell is an example with no label
        raw = label if isinstance(label, list) else _label_text(label).split(separator)
        names = [_label_text(item).strip() for item in raw]
        label = tuple(_label_name(name, label_map, where) for name in names if name)
    else:
        if isinstance(label, list) and len(label) <= 1:  # doccano's export of a one-label task: ["pos"]
            label = label[0] if label else None
        if isinstance(label, list):  # str() of it would train on labels such as "['joy']"
            raise UsageError(f"{where}: the label is a list ({json.dumps(label)[:80]}): give --multi-label for a "
                             "task whose texts have any number of labels")
        if label is None or not str(label).strip():
            raise EmptyCell(f"{where}: empty label")
        label = _label_name(_label_text(label).strip(), label_map, where)
    return SequenceExample(text=str(text).strip(), label=label, text_pair=str(pair).strip() if pair is not None else None)


# a cell spelling a list: of quoted names or of whole numbers, comma- or space-separated (a Python
# list's repr, JSON, or a numpy array's repr, which has no commas: "['fear' 'joy']")
LISTED_NAMES = re.compile(r"""\[\s*(?:(?:'[^']*'|"[^"]*")(?:\s*,?\s*(?:'[^']*'|"[^"]*"))*)?\s*,?\s*\]""")
LISTED_NUMBERS = re.compile(r"\[\s*-?\d+(?:\s*,?\s*-?\d+)*\s*,?\s*\]")
QUOTED = re.compile(r"'([^']*)'|\"([^\"]*)\"")


def _listed(cell):
    """A table's cell that spells a list, as pandas' to_csv writes a column of lists ("['joy', 'love']";
    a Hugging Face dataset's, numpy arrays, "['joy' 'love']") or JSON does: that list (a label cell's
    labels, or a token row's words and tags). Split on commas it was the labels "['joy'" and " 'love']".
    Anything else as it is; Label Studio's JSON-MIN writes several choices as {"choices": [...]}: that list."""
    if isinstance(cell, dict) and set(cell) == {"choices"} and isinstance(cell["choices"], list):
        return cell["choices"]
    if not isinstance(cell, str):
        return cell
    text = cell.strip()
    if LISTED_NAMES.fullmatch(text):
        return [single or double for single, double in QUOTED.findall(text)]
    if LISTED_NUMBERS.fullmatch(text):
        return re.findall(r"-?\d+", text)
    return cell


def _label_text(value) -> str:
    """A label as the file spells it: JSON's true and false stay so (str() would say True and False)."""
    return json.dumps(value) if isinstance(value, bool) else str(value)


def _label_name(label: str, label_map: dict[str, str] | None, where: str = "") -> str:
    if label_map:
        if label not in label_map and (whole := _whole(label)) in label_map:
            label = whole  # pandas writes an int column holding a NaN as floats: 1.0 is class id 1
        if label not in label_map:
            raise UsageError(f"{where}: label {label!r} is not in the label map {label_map}")
        label = label_map[label]
    return label


def _whole(label: str) -> str | None:
    """'1.0' -> '1': a class id written as a float; None for anything else."""
    return label[:-2] if label.endswith(".0") and label[:-2].lstrip("-").isdigit() else None


CONLLU_TOKEN = re.compile(r"\d+\t[^\t]+(\t[^\t]*){8}\n?")  # ID FORM LEMMA UPOS XPOS FEATS HEAD DEPREL DEPS MISC
COMMENT = re.compile(r"#\s+(\S+\s*=|id\s)")  # UD's "# sent_id = 1", MultiCoNER's "# id 5c1e... domain=en"


def read_text_lines(path: str | Path, option: str = "--texts") -> list[str]:
    """A UTF-8 file of unlabelled texts, one a line: each text once, in file order, blank lines skipped
    (what a bridge or an alignment pairs: no labels needed)."""
    try:
        lines = Path(path).read_text(encoding=ENCODING).splitlines()
    except OSError as exc:
        raise UsageError(f"{option} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{option} {path}: not UTF-8 text") from None
    texts = list(dict.fromkeys(line.strip() for line in lines if line.strip()))
    if len(texts) < 2:
        raise UsageError(f"{option} {path}: {len(texts)} different text(s); at least 2 (one a line): some are held out")
    return texts


def seeded_subset(items: Sequence, n: int | None, seed: int) -> list:
    """A seeded random `n` of `items` (None or 0: all), in their order."""
    if not n or n >= len(items):
        return list(items)
    return [items[i] for i in sorted(random.Random(seed).sample(range(len(items)), n))]


def hold_out(texts: list[str], share: float, limit: int | None, seed: int) -> tuple[list[str], list[str]]:
    """(kept, held out): a seeded `share` of `texts` (at least one, at most `limit`) held out, both in
    file order."""
    held = max(1, round(len(texts) * share))
    if limit:
        held = min(held, limit)
    chosen = set(seeded_subset(range(len(texts)), held, seed))
    return [t for i, t in enumerate(texts) if i not in chosen], [t for i, t in enumerate(texts) if i in chosen]


def read_conll(path: str | Path, word_column: int = 0, tag_column: int = -1) -> LabelledData:
    """CoNLL column file: one `word ... tag` line per token, blank lines between sentences,
    -DOCSTART- lines and comment lines (`# key = value`, `# id ...`) skipped. A CoNLL-U file
    (Universal Dependencies: ten tab-separated columns, an ID first) gives each word (FORM) its
    part of speech (UPOS); its multiword-token and empty-node lines (IDs 1-2, 1.1) are skipped."""
    path = Path(path)
    first = next((line for _, line in _lines(path) if line.strip() and not line.startswith("#")), "")
    conllu = bool(CONLLU_TOKEN.fullmatch(first))
    if conllu:
        word_column, tag_column = 1, 3
        print(f"{path}: CoNLL-U (ten columns): each word (FORM) tagged with its part of speech (UPOS)", file=sys.stderr)
    examples, words, tags = [], [], []
    seen = 0  # words of the file before the current sentence
    document = 0  # -DOCSTART- lines read before it (the first one opens document 0)
    spaced = []  # the lines whose text before a tab holds a space: a table's rows, not a word and its tag

    def end_sentence():
        nonlocal seen
        if words:
            examples.append(TokenExample(words=list(words), tags=list(tags), file_offset=seen,
                                         document=max(document - 1, 0)))
            seen += len(words)
        words.clear()
        tags.clear()

    for line_no, line in _lines(path):
        if (conllu and line.startswith("#")) or COMMENT.match(line):
            continue
        if conllu and line.strip() and not line.split("\t", 1)[0].isdigit():  # a multiword token or an empty node
            continue
        if "\t" in line and " " in (cell := line.split("\t")[0].strip()):
            spaced.append(cell)
        parts = line.rstrip("\r\n").split("\t") if conllu else line.split()  # a CoNLL-U FORM may hold a space
        if not any(part.strip() for part in parts):
            end_sentence()
            continue
        if parts[0] == "-DOCSTART-":
            end_sentence()
            document += 1
            continue
        if len(parts) < 2:
            raise UsageError(f"{path}:{line_no}: a CoNLL line needs a word and a tag (whitespace-separated), "
                             f"got {line.strip()!r}")
        try:
            words.append(parts[word_column])
            tags.append(parts[tag_column])
        except IndexError:
            raise UsageError(f"{path}:{line_no}: expected word and tag columns, got {line.strip()!r}") from None
    end_sentence()
    if not examples:
        raise UsageError(f"{path}: no sentences")
    if len(spaced) > seen / 2:  # "good film<TAB>pos" lines: a table read as words and tags (seen: all words)
        raise UsageError(f"{path}: most lines hold a text with spaces before a tab ({spaced[0][:40]!r}): a table "
                         "(text, tab, label), not a CoNLL file (one word a line); give --format tsv")
    return LabelledData(TaskType.token_classification, examples, str(path))


def read_conll_documents(path: str | Path, word_column: int = 0, tag_column: int = -1) -> list[list[TokenExample]]:
    """A CoNLL file's documents (the sentences between -DOCSTART- lines), each a list of sentences."""
    documents: dict[int, list[TokenExample]] = {}
    for example in read_conll(path, word_column, tag_column).examples:
        documents.setdefault(example.document, []).append(example)
    return list(documents.values())


def document_windows(path: str | Path, encoder, windows: Sequence[int]) -> dict[int, list[TokenExample]]:
    """A CoNLL file's documents read as the server reads a long text, for each window length in
    `windows`: each document's words joined with spaces, tokenized once, and cut by
    server/windows.py into windows of that many word pieces (its default stride), each window an
    example of the words wholly inside it; a document that fits in one window is one example.
    `encoder`: the backbone's TextEncoder. A window the server would refuse raises ValueError."""
    from server.errors import ApiError
    from server.windows import settings_for, split

    try:
        settings = {window: settings_for(encoder, None, window) for window in windows}
    except ApiError as exc:
        raise ValueError(f"--document-windows: {exc.message}") from None
    out: dict[int, list[TokenExample]] = {window: [] for window in windows}
    for document in read_conll_documents(path):
        whole = TokenExample([w for s in document for w in s.words],
                             begin_entities_with_b([t for s in document for t in s.tags])[0],
                             file_offset=document[0].file_offset)
        encoded = encoder.encode([whole.text], whole=True)[0]
        offsets, spans = encoded.offsets, whole.spans
        for window, setting in settings.items():
            reading = split(encoded, setting)
            if not reading.windowed:
                out[window].append(whole)
                continue
            for start, end in reading.spans:
                low, high = offsets[reading.first + start][0], offsets[reading.first + end - 1][1]
                keep = [i for i, (a, b) in enumerate(spans) if a >= low and b <= high]
                if keep:  # a run of the document's words (spans are in order); an entity the window cuts begins
                    tags = begin_entities_with_b([whole.tags[i] for i in keep])[0]  # where the window does
                    out[window].append(TokenExample([whole.words[i] for i in keep], tags,
                                                    file_offset=whole.file_offset + keep[0]))
    return out


def guess_format(path: Path) -> str:
    if path.is_dir():
        raise folder_error(path)
    if path.suffix.lower() == ".gz":  # train.tsv.gz: the name inside says what it is (read through gzip)
        path = path.with_suffix("")
    suffix = path.suffix.lower().lstrip(".")
    if suffix in ("tsv", "csv", "jsonl"):
        return suffix
    if suffix == "json":
        return "jsonl"
    if suffix in ("txt", "conll", "bio", "iob", "conllu"):
        return "conll"
    if suffix in WORKBOOK_SUFFIXES:
        raise workbook_error(path)
    if suffix in ("parquet", "arrow"):  # a Hugging Face dataset's files
        raise UsageError(f"{path}: {suffix} is not read; write it as JSONL first, e.g. "
                         f"datasets.load_dataset('{suffix}', data_files='{path.name}')['train'].to_json('train.jsonl')")
    if suffix == "spacy":  # spaCy v3's DocBin: binary, read only through spaCy
        raise UsageError(
            f"{path}: a spaCy DocBin is not read; write its docs as JSONL first: python -c \"import json, spacy; "
            f"from spacy.tokens import DocBin; docs = DocBin().from_disk('{path.name}').get_docs(spacy.blank('en').vocab); "
            "print(*(json.dumps({'text': d.text, 'entities': [[e.start_char, e.end_char, e.label_] for e in d.ents], "
            "'labels': [c for c, p in d.cats.items() if p >= 0.5]}) for d in docs), sep='\\n')\" > train.jsonl; "
            "then --label-column entities (a token task) or labels (its categories)")
    raise UsageError(f"{path}: cannot tell the format from the extension; give --format ({'/'.join(FORMATS)})")


# ---- presets ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class DatasetPreset:
    """How to read one of the datasets in the shared data folder."""

    name: str
    format: str
    train: str  # relative to the data dir
    validation: str
    metric: str  # the validation metric to select on
    labels: tuple[str, ...]  # label order of the head
    text_column: Column = 0
    label_column: Column = 1
    pair_column: Column | None = None
    header: bool = True
    label_map: dict[str, str] = field(default_factory=dict)
    multi_label: bool = False


GOEMOTIONS_LABELS = (  # goemotions/labels.txt, in its order (the label ids of the data files index it)
    "admiration", "amusement", "anger", "annoyance", "approval", "caring", "confusion", "curiosity", "desire",
    "disappointment", "disapproval", "disgust", "embarrassment", "excitement", "fear", "gratitude", "grief", "joy",
    "love", "nervousness", "optimism", "pride", "realization", "relief", "remorse", "sadness", "surprise", "neutral",
)

PRESETS = {
    "sst2": DatasetPreset(
        "sst2", "tsv", "sst2/train.tsv", "sst2/validation.tsv", metric="accuracy",
        labels=("negative", "positive"), text_column="sentence", label_column="label",
        label_map={"0": "negative", "1": "positive"},
    ),
    "cola": DatasetPreset(
        "cola", "tsv", "cola/train.tsv", "cola/validation.tsv", metric="mcc",
        labels=("unacceptable", "acceptable"), text_column=3, label_column=1, header=False,
        label_map={"0": "unacceptable", "1": "acceptable"},
    ),
    "rte": DatasetPreset(
        "rte", "tsv", "rte/train.tsv", "rte/dev.tsv", metric="accuracy",
        labels=("entailment", "not_entailment"), text_column="sentence1", pair_column="sentence2",
        label_column="label",
    ),
    "conll2003": DatasetPreset(
        "conll2003", "conll", "conll2003/train.txt", "conll2003/validation.txt", metric="f1",
        labels=tuple(CONLL_TAGS),
    ),
    "goemotions": DatasetPreset(
        "goemotions", "tsv", "goemotions/train.tsv", "goemotions/validation.tsv", metric="f1_macro",
        labels=GOEMOTIONS_LABELS, text_column=0, label_column=1, header=False,
        label_map={str(i): name for i, name in enumerate(GOEMOTIONS_LABELS)}, multi_label=True,
    ),
}


@dataclass
class DataSpec:
    """Where a split comes from and how to read it (a preset fills these in)."""

    path: Path
    format: str
    text_column: Column | None = None  # None: the table's column named text, else 0 (JSONL: key text or tokens)
    label_column: Column | None = None  # None: the column named label, else the one of fewest values (JSONL: label, ...)
    pair_column: Column | None = None
    header: bool = True
    label_map: dict[str, str] | None = None
    multi_label: bool = False

    def read(self) -> LabelledData:
        """The split's examples; a missing or unreadable file, or a bad row, is a UsageError."""
        if self.format == "conll":
            return read_conll(self.path)
        return read_table(self.path, text_column=self.text_column, label_column=self.label_column,
                          pair_column=self.pair_column, fmt=self.format, header=self.header, label_map=self.label_map,
                          multi_label=self.multi_label)


def file_spec(path: str | Path, fmt: str | None = None, text_column: Column | None = None,
              label_column: Column | None = None, pair_column: Column | None = None, header: bool = True,
              label_map: dict[str, str] | None = None, multi_label: bool = False) -> DataSpec:
    """A user's file, read as the options say (tmod-train's training and eval files alike)."""
    path = Path(path)
    fmt = fmt or guess_format(path)
    return DataSpec(path, fmt, text_column, label_column, pair_column, header, label_map, multi_label)


def preset_spec(preset: DatasetPreset, split: str, data_dir: Path | None = None) -> DataSpec:
    data_dir = Path(data_dir) if data_dir else default_data_dir()
    relative = {"train": preset.train, "validation": preset.validation}[split]
    return DataSpec(data_dir / relative, preset.format, preset.text_column, preset.label_column,
                    preset.pair_column, preset.header, dict(preset.label_map) or None, preset.multi_label)


def label_order(data: LabelledData, given: Sequence[str] | None = None) -> list[str]:
    """The head's labels: `given` if any, else BIO tags as O then B-/I- per type, else sorted."""
    if given:
        return list(given)
    seen = data.labels_seen()
    if data.task_type != TaskType.token_classification:
        return seen
    types = sorted({tag[2:] for tag in seen if tag[:2] in ("B-", "I-")})
    bio = ["O"] + [f"{p}-{t}" for t in types for p in ("B", "I")]
    return bio + sorted(set(seen) - set(bio))


# ---- word tags <-> sub-word tokens -----------------------------------------------------------
def _inside_of(labels: list[str]) -> list[int]:
    """For each label id, the id a word's later pieces get: I-X for B-X/I-X, itself otherwise."""
    index = {label: i for i, label in enumerate(labels)}
    return [index.get("I-" + label[2:], i) if label.startswith("B-") else i for i, label in enumerate(labels)]


def token_labels(encoded: EncodedInput, spans: list[tuple[int, int]], word_label_ids: list[int],
                 labels: list[str]) -> list[int]:
    """Per-token targets of one encoded input: a label on the first sub-token of each word,
    -100 elsewhere.

    "Word" here is the tokenizer's pre-tokenized word (what the server decodes by, see
    server.heads.decode.word_predictions). Where the tokenizer splits a data word further
    ("U.S." -> "U", ".", "S", "."), the first piece gets the word's tag and the later pieces the
    matching I- tag, so served entities cover the whole word.
    """
    inside = _inside_of(labels)
    starts = [start for start, _ in spans]
    out = [IGNORE_INDEX] * len(encoded)
    seen_words = set()
    for t, (seq, word) in enumerate(zip(encoded.sequence_ids, encoded.word_ids)):
        if seq != 0 or word is None or word in seen_words:
            continue
        seen_words.add(word)
        start = encoded.offsets[t][0]
        w = bisect.bisect_right(starts, start) - 1  # the data word whose span holds this token
        if w < 0 or start >= spans[w][1]:
            continue
        tag = word_label_ids[w]
        out[t] = tag if start == spans[w][0] else inside[tag]
    return out


def word_first_tokens(encoded: EncodedInput, spans: list[tuple[int, int]]) -> list[int]:
    """The index of each data word's first sub-token (the token a word is read at), -1 for a word
    with no token (cut by truncation)."""
    first_token = {}
    for t, seq in enumerate(encoded.sequence_ids):
        if seq == 0:
            first_token.setdefault(encoded.offsets[t][0], t)
    return [first_token.get(start, -1) for start, _ in spans]


def word_label_ids_from_tokens(encoded: EncodedInput, spans: list[tuple[int, int]], token_ids: Sequence[int],
                               outside: int = 0) -> list[int]:
    """The inverse: each data word takes the token label at its first sub-token. Words with no
    token (cut by truncation) get `outside`."""
    return [int(token_ids[t]) if t >= 0 else outside for t in word_first_tokens(encoded, spans)]
