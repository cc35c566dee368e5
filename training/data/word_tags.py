"""Word-level tags onto sub-word tokens (the loss's targets) and back (a word is read at its first piece)."""
from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # annotations only: importing the tokens module imports torch (~2 s), and tmod-train's
    from server.backbone.tokens import EncodedInput  # --help and usage errors need none of it


IGNORE_INDEX = -100  # label of tokens the loss skips (torch's cross_entropy default)


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
