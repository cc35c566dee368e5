"""`read_table`: labelled texts (or tagged words) from a TSV, CSV or JSON(L) file; the columns the user
does not name chosen from the first rows, and said."""
from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path

from modules_store import TaskType

from training.data.cells import (
    is_span,
    label_present,
    label_separator,
    listed,
    sequence_example,
    span_example,
    token_example,
)
from training.data.examples import LabelledData, SequenceExample, TokenExample
from training.data.files import Column, EmptyCell, UsageError, guess_format, numbered_lines, open_text, refuse_empty
from training.data.records import accepted_records, json_keys, json_records


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
    character spans (`label`, `entities` or `spans`) is a token example too (`span_example`)."""
    path = Path(path)
    fmt = fmt or guess_format(path)
    # --multi-label with --label-column a,b,c: one 0/1 column per label (Jigsaw's toxic, obscene, ...)
    flags = [c.strip() for c in label_column.split(",")] if multi_label and isinstance(label_column, str) \
        and "," in label_column else None
    if fmt == "jsonl":
        examples, empty = _record_examples(path, text_column, label_column, pair_column, flags, label_map, multi_label)
    elif fmt in ("tsv", "csv"):
        examples, empty = _row_examples(path, fmt, header, text_column, label_column, pair_column, flags, label_map,
                                        multi_label)
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


def _record_examples(path: Path, text_column: Column | None, label_column: Column | None,
                     pair_column: Column | None, flags: list[str] | None,
                     label_map: dict[str, str] | None, multi_label: bool) -> tuple[list, list[EmptyCell]]:
    """A JSON(L) file's examples, and its records with an empty text or label (`read_table`'s options)."""
    examples, empty = [], []
    records = accepted_records(path, list(json_records(path)))
    if text_column is None and records:
        text_column = _text_key(path, records[0][1], {label_column, pair_column, *(flags or ())})
    if label_column is None and not flags and records and isinstance(records[0][1], dict):
        text_key, label_key = json_keys(records[0][1], text_column, None, multi_label)
        if label_key not in records[0][1] and isinstance(records[0][1].get(text_key), str):
            label_column = _label_key(path, records, {text_key, pair_column})
    for where, record in records:
        try:
            text_key, label_key = json_keys(record, text_column, flags[0] if flags else label_column, multi_label)
            text = record[text_key]
            label = [c for c in flags if label_present(record[c], c, where)] if flags else listed(record[label_key])
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
            example = token_example(text, label, label_map, where)
        elif isinstance(label, list) and not multi_label and all(map(is_span, label)):
            example = span_example(text, label, label_map, where)
        else:
            try:
                example = sequence_example(text, label, pair, label_map, multi_label, where)
            except EmptyCell as exc:
                empty.append(exc)
                continue
        _check_same_kind(examples, example, where, "record")
        examples.append(example)
    if pair_column is None and examples and isinstance(examples[0], SequenceExample):
        first = records[0][1]
        taken = set(json_keys(first, text_column, flags[0] if flags else label_column, multi_label)) | set(flags or ())
        _say_unread_texts(path, {f"key {key!r}": [record.get(key) for _, record in records[:SAMPLE_ROWS]
                                                  if isinstance(record, dict)]
                                 for key in first if key not in taken})
    return examples, empty


def _row_examples(path: Path, fmt: str, header: bool, text_column: Column | None, label_column: Column | None,
                  pair_column: Column | None, flags: list[str] | None, label_map: dict[str, str] | None,
                  multi_label: bool) -> tuple[list, list[EmptyCell]]:
    """A TSV or CSV file's examples, and its rows with an empty text or label (`read_table`'s options)."""
    examples, empty = [], []
    list(numbered_lines(path))  # missing file, bad encoding: one clear line
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
        label = [c for c, i in zip(flags, label_is) if label_present(row[i], c, where)] if flags \
            else listed(row[label_is[0]])
        plain = not (flags or multi_label or pair_i is not None)
        words = listed(row[text_i]) if plain and isinstance(label, list) else None
        try:
            if isinstance(words, list):  # a token dataset through pandas' to_csv: words and their tags
                example = token_example(words, label, label_map, where)
            else:
                example = sequence_example(row[text_i], label, row[pair_i] if pair_i is not None else None,
                                           label_map, multi_label, where, separator)
        except EmptyCell as exc:
            empty.append(exc)
            continue
        _check_same_kind(examples, example, where, "row")
        examples.append(example)
    return examples, empty


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


def unlike_labels(values: list[str]) -> tuple:
    """How little a column's (or key's) first `values` look like labels, lowest first: a label repeats,
    an id or a text does not; a column of one value only where nothing else repeats; then the fewest
    different values (`min` keeps the first of equals)."""
    different = len(set(values))
    return different == len(values), different < 2, different


def _label_key(path: Path, records: list, taken: set) -> str | None:
    """A JSONL file's labels' key where none is named and its first record has no `label` (nor `labels`):
    of the keys the texts and pairs do not take, the one whose values repeat most over the first records,
    as `_label_column` chooses a CSV's, said (`{"review", "stars"}` was refused as "no key 'label'" where
    the same table as a CSV trained); None where no key is left, for that refusal."""
    sample = [record for _, record in records[:SAMPLE_ROWS] if isinstance(record, dict)]
    free = [key for key in sample[0] if key not in taken]
    if not free:
        return None
    key = min(free, key=lambda key: unlike_labels([json.dumps(r.get(key), sort_keys=True) for r in sample]))
    print(f"{path}: labels read from key {key!r} (the fewest different values; no key is named 'label'): "
          "--label-column names another", file=sys.stderr)
    return key


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

    chosen = min(free, key=lambda i: (*unlike_labels([row[i].strip() for row in sample if len(row) > i]),
                                      i != 1))  # of equals, column 1 as before
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
