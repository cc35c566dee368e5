"""JSON and JSONL files as records (pandas' `to_json` tables, spaCy's training examples, Prodigy's
answers), and the keys that hold a record's text and label."""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from training.data.files import Column, UsageError, numbered_lines


def json_records(path: Path):
    """(where, record) of a JSONL file's lines; or of a JSON file holding one list of records (what
    pandas' `to_json(orient="records")` and `Dataset.to_json(lines=False)` write), by its index."""
    lines = list(numbered_lines(path))  # a missing or undecodable file: one clear line
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


def accepted_records(path: Path, records: list) -> list:
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


def json_keys(record: dict, text_column: Column | None, label_column: Column | None, multi_label: bool
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
