"""What a split holds: labelled texts (`SequenceExample`) or tagged words (`TokenExample`), gathered
in a `LabelledData`; seeded subsets; the head's label order."""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Sequence

from modules_store import TaskType


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
        ids = {label: whole_number(label) or label for label in seen}  # 1.0 as pandas writes an id: 1
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


def whole_number(label: str) -> str | None:
    """'1.0' -> '1': a class id written as a float; None for anything else."""
    return label[:-2] if label.endswith(".0") and label[:-2].lstrip("-").isdigit() else None


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
