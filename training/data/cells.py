"""A row's or a record's cells as one example: its text and label or labels (lists as pandas and JSON
spell them, names through --label-map), its tagged words, or its entity spans on words split as BERT's
pre-tokenizer splits them (`word_spans`)."""
from __future__ import annotations

import bisect
import json
import re
import unicodedata

from training.data.examples import SequenceExample, TokenExample, whole_number
from training.data.files import EmptyCell, UsageError


def sequence_example(text, label, pair, label_map, multi_label: bool = False, where: str = "", separator: str = ","
                     ) -> SequenceExample:
    """A labelled text (and its pair): its label named through `label_map`; with `multi_label`, its
    labels (a list, or a cell's names split at `separator`; none is an example with no label)."""
    if text is None or not str(text).strip():
        raise EmptyCell(f"{where}: empty text")
    if multi_label:  # an empty cell is an example with no label
        raw = label if isinstance(label, list) else label_text(label).split(separator)
        names = [label_text(item).strip() for item in raw]
        label = tuple(label_name(name, label_map, where) for name in names if name)
    else:
        if isinstance(label, list) and len(label) <= 1:  # doccano's export of a one-label task: ["pos"]
            label = label[0] if label else None
        if isinstance(label, list):  # str() of it would train on labels such as "['joy']"
            raise UsageError(f"{where}: the label is a list ({json.dumps(label)[:80]}): give --multi-label for a "
                             "task whose texts have any number of labels")
        if label is None or not str(label).strip():
            raise EmptyCell(f"{where}: empty label")
        label = label_name(label_text(label).strip(), label_map, where)
    return SequenceExample(text=str(text).strip(), label=label, text_pair=str(pair).strip() if pair is not None else None)


def token_example(words: list, tags, label_map: dict[str, str] | None, where: str) -> TokenExample:
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
    names = [label_name(str(tag).strip(), label_map, where) for tag in tags]  # ids: named by --labels later
    if not all(names):
        raise UsageError(f"{where}: empty tag")
    return TokenExample(words=list(words), tags=names)


def span_example(text, spans: list, label_map: dict[str, str] | None, where: str) -> TokenExample:
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
        kind = label_name(label_text(label).strip(), label_map, where)
        if not kind:
            raise UsageError(f"{where}: entity {json.dumps(item)[:80]} has an empty label")
        tags[first:last + 1] = [f"B-{kind}"] + [f"I-{kind}"] * (last - first)
    return TokenExample(words=[text[a:b] for a, b in words], tags=tags)


def is_span(item) -> bool:
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


def label_separator(cells: list[str]) -> str:
    """What separates a multi-label cell's labels: a comma, or where no cell holds one, the `|` or `;`
    that some do (MovieLens writes genres "Action|Comedy")."""
    if any("," in cell for cell in cells):
        return ","
    return next((sep for sep in "|;" if any(sep in cell for cell in cells)), ",")


# a cell spelling a list: of quoted names or of whole numbers, comma- or space-separated (a Python
# list's repr, JSON, or a numpy array's repr, which has no commas: "['fear' 'joy']")
LISTED_NAMES = re.compile(r"""\[\s*(?:(?:'[^']*'|"[^"]*")(?:\s*,?\s*(?:'[^']*'|"[^"]*"))*)?\s*,?\s*\]""")
LISTED_NUMBERS = re.compile(r"\[\s*-?\d+(?:\s*,?\s*-?\d+)*\s*,?\s*\]")
QUOTED = re.compile(r"'([^']*)'|\"([^\"]*)\"")


def listed(cell):
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


def label_present(value, column: str, where: str) -> bool:
    """A 0/1 label column's cell: is its label present?"""
    text = str(value).strip().lower()
    if text in ("1", "1.0", "true", "yes"):
        return True
    if text in ("0", "0.0", "false", "no", ""):
        return False
    raise UsageError(f"{where}: column {column!r} holds {str(value)[:40]!r}; each of several --label-column columns "
                     "says whether its label is present: 0 or 1")


def label_text(value) -> str:
    """A label as the file spells it: JSON's true and false stay so (str() would say True and False)."""
    return json.dumps(value) if isinstance(value, bool) else str(value)


def label_name(label: str, label_map: dict[str, str] | None, where: str = "") -> str:
    if label_map:
        if label not in label_map and (whole := whole_number(label)) in label_map:
            label = whole  # pandas writes an int column holding a NaN as floats: 1.0 is class id 1
        if label not in label_map:
            raise UsageError(f"{where}: label {label!r} is not in the label map {label_map}")
        label = label_map[label]
    return label
