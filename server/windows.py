"""Long texts read in overlapping windows of word pieces, and answered as one text.

A text whose word pieces do not fit in one window is cut (`split`) into windows: each window is a
row of its own, holding the text's special tokens, a stretch of its word pieces and the whole text
pair if there is one, so the batcher batches, buckets and counts windows like any other row, and a
request's windows may run in several passes. Consecutive windows share `window - stride` word
pieces; a window ends at a word boundary where one is in reach.

After the passes, the windows of a text are answered as one (`Reading.answers`), by a rule per task
type (`RULES`, named in /v1/tasks):
- token tasks: each word piece takes its logits from the window where it lies furthest from a cut
  (the text's own start and end are not cuts); the text is then decoded once, whole, so entities are
  rebuilt over the whole text, an entity across a cut comes back once, and offsets index the text;
- sequence tasks and regression: the windows' logits, averaged with each window weighted by the
  number of the text's word pieces it holds;
- embeddings: the windows' vectors averaged with the same weights, then scaled to length 1.

A text that fits in one window is one row, exactly as before: its answer is unchanged.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from server.backbone.tokens import EncodedInput, TextEncoder, WindowRow
from server.batcher import Job
from server.errors import ApiError
from server.heads.decode import decode_rows

MIN_WINDOW = 16  # word pieces; below this a window holds little more than its special tokens
# a request is tokenized in runs of inputs of about this many characters, its word pieces counted
# after each: one over its token budget is refused after at most one run past the budget, never
# tokenized whole (64 inputs of 20,000 characters took 5-9 s of CPU before their 413)
READ_RUN_CHARS = 20_000


# ---- settings -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WindowSettings:
    window: int  # word pieces per row, special tokens and the text pair included
    stride: int  # how far each window starts after the one before: neighbours share window - stride pieces
    limit: int  # the longest window a request may ask for (the backbone's token limit, or max_tokens)

    @property
    def overlap(self) -> int:
        return self.window - self.stride

    def describe(self) -> dict:
        return {"window": self.window, "stride": self.stride, "overlap": self.overlap, "max_window": self.limit,
                "rules": {kind: rule.name for kind, rule in RULES.items()}}


@functools.cache
def trained_length(model_dir: str) -> int | None:
    """The length a sentence-transformers model was trained at (its sentence_bert_config.json's
    max_seq_length: 256 for all-MiniLM-L6-v2, 384 for all-mpnet-base-v2); None without one."""
    path = Path(model_dir) / "sentence_bert_config.json"
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("max_seq_length")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def default_stride(window: int) -> int:
    """Three quarters of the window: neighbours share a quarter, so a word piece near a cut is read
    with at least an eighth of a window of context on that side, at 4/3 the cost of no overlap."""
    return max(1, window - window // 4)


# The default window per backbone and task type where a measurement chose it: documents read at several
# windows against the same text read sentence by sentence, through a real tmod-serve
# (bench/long_documents.py, CoNLL-2003 validation, 216 documents; docs/windows.md has the table).
# Task types with no entry (no long-document data measured) read at the backbone's trained length.
MEASURED_WINDOWS = {
    # entity F1 of documents, BIO-constrained tags: ner/3 (served since 2026-11-27) 89.07 at 128, 88.34
    # at 64, 86.74 at 256, sentence by sentence 89.28; ner/2 (2026-11-25) 88.42 at 128, 88.70 at 64
    ("all-MiniLM-L6-v2", "token_classification"): 128,
    # ner/mpnet-2 (BIO-constrained tags, 2026-11-25): 93.56 at 256, 93.54 at 384 (the trained
    # length), 93.44 at 128; sentence by sentence 93.53 (the three windows within 0.12 of each other)
    ("all-mpnet-base-v2", "token_classification"): 256,
}


def measured_window(backbone: str, task_types) -> int | None:
    """The measured default window of a request's `task_types` (TaskType or its value) on `backbone`
    (its fingerprint's name), where every one of them has one (the shortest of theirs); None otherwise.
    A request's tasks share its rows, so a request that mixes in a task type with no measured window
    (a sequence task, an embedding) reads at the backbone's default: those answers never depend on
    which other tasks were asked beside them."""
    found = [MEASURED_WINDOWS.get((backbone, getattr(kind, "value", kind))) for kind in task_types]
    return min(found) if found and all(found) else None


def settings_for(text: TextEncoder, max_tokens: int | None, window: int | None = None, stride: int | None = None,
                 server_window: int | None = None, server_stride: int | None = None,
                 task_window: int | None = None) -> WindowSettings:
    """The windows a request is read in: its own `window` / `stride` where it names them (422 outside
    the limits), else the server's settings (`window_tokens`, `window_stride`), else the measured
    default of the request's tasks (`task_window`: `measured_window`), else the backbone's default:
    its trained length where it states one, else its token limit; `default_stride`."""
    limit = text.row_limit(max_tokens)
    if window is None:
        window = min(server_window or task_window or trained_length(str(getattr(text.tokenizer, "name_or_path", "")))
                     or limit, limit)
        stride = stride if stride is not None else server_stride
    stride = stride if stride is not None else default_stride(window)
    problem = window_problem(window, stride, limit)
    if problem:
        raise ApiError(422, "invalid_request", problem)
    return WindowSettings(window, stride, limit)


def window_problem(window: int, stride: int, limit: int, names=("window", "stride")) -> str | None:
    """Why a window and stride cannot read text on a backbone whose rows hold at most `limit` word
    pieces (each named as `names` says: a request's fields, or the server's flags); None where they can."""
    if not MIN_WINDOW <= window <= limit:
        return f"{names[0]}={window}: a window holds {MIN_WINDOW} to {limit} word pieces on this backbone"
    if not max(1, window // 8) <= stride <= window:
        return f"{names[1]}={stride}: with {names[0]}={window} the stride is {max(1, window // 8)} to {window} word pieces"
    return None


def server_window_problem(text: TextEncoder, max_tokens: int | None, window_tokens: int | None,
                          window_stride: int | None) -> str | None:
    """A server's `window_tokens` / `window_stride` checked against its backbone at start-up: a window
    over its limit was quietly cut to it, and a stride that did not fit a request's window made every
    such request 422 for a setting the client never sent. A --max-tokens over the backbone's limit was
    cut to it too, without a word."""
    if max_tokens is not None and max_tokens > text.max_tokens:
        return f"--max-tokens={max_tokens}: a row holds at most {text.max_tokens} word pieces on this backbone"
    if window_tokens is None:
        return None
    limit = text.row_limit(max_tokens)
    stride = window_stride if window_stride is not None else default_stride(window_tokens)
    problem = window_problem(window_tokens, stride, limit, names=("--window-tokens", "--window-stride"))
    return f"{problem} with --max-tokens {max_tokens}" if problem and limit < text.max_tokens else problem


def whole_number(parameters: dict, name: str) -> int | None:
    """A window setting from a protocol's free-form parameters (OIP v2): a whole number or absent (422 else)."""
    value = parameters.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(422, "invalid_request", f"parameter {name!r} must be a whole number of word pieces, not {value!r}")
    return value


# ---- cutting a text into windows ------------------------------------------------------------------
class PairTooLong(ValueError):
    pass


class TooManyTokens(ValueError):
    def __init__(self, tokens: int, windows: int, inputs_read: int, inputs: int, budget: int):
        part = "" if inputs_read == inputs else f" (counted in its first {inputs_read} of {inputs} inputs)"
        super().__init__(f"the request is {tokens} word pieces in {windows} windows{part}; at most {budget} per "
                         "request (send fewer or shorter texts)")
        self.tokens, self.budget = tokens, budget


def word_boundary(words, at: int, low: int) -> int | None:
    """The last word start in (low, at]: `at` moved back to the start of the word it falls in;
    None if that word began at or before `low` (a word longer than the room: cut inside it)."""
    while at > low and words[at] is not None and words[at] == words[at - 1]:
        at -= 1
    return at if at > low else None


def cut(words: list, room: int, overlap: int) -> list[tuple[int, int]]:
    """Spans [start, end) over a text's word pieces (`words`: each piece's word id), each at most
    `room` long, each starting `overlap` pieces before the end of the one before, ends and starts
    moved back to word boundaries where one is inside the span."""
    n = len(words)
    spans, start = [], 0
    while True:
        end = min(start + room, n)
        if end < n:
            end = word_boundary(words, end, start) or end
        spans.append((start, end))
        if end >= n:
            return spans
        nxt = max(end - overlap, start + 1)
        start = word_boundary(words, nxt, start) or nxt


@dataclass
class TextWindows:
    """One input: the text tokenized whole, and the rows it is read in."""

    whole: EncodedInput
    first: int  # position of the text's first word piece in `whole` (after its leading special tokens)
    count: int  # the text's word pieces
    spans: list[tuple[int, int]]  # per window, its stretch of the text's word pieces [start, end)
    rows: list[EncodedInput]  # one per window; [whole] when it fits in one

    @property
    def windowed(self) -> bool:
        return len(self.rows) > 1


def split(whole: EncodedInput, settings: WindowSettings, index: int = 0) -> TextWindows:
    """`whole` as one row if it fits in a window, else as overlapping windows (module docstring).
    PairTooLong when the special tokens and text pair leave a window no more room than the overlap."""
    text_positions = [i for i, s in enumerate(whole.sequence_ids) if s == 0]
    first, count = (text_positions[0], len(text_positions)) if text_positions else (0, 0)
    if len(whole) <= settings.window:
        return TextWindows(whole, first, count, [(0, count)], [whole])
    others = len(whole) - count  # special tokens and the text pair: in every window
    room = settings.window - others
    if room <= settings.overlap or count == 0:
        pair = "" if whole.text_pair is None else " and its text pair"
        raise PairTooLong(
            f"input {index}: its special tokens{pair} take {others} of a window's {settings.window} word pieces, "
            f"leaving {max(room, 0)} for the text, no more than the {settings.overlap} neighbouring windows share; "
            "send a shorter text_pair, a larger window or stride, or ask for truncate")
    spans = cut(whole.word_ids[first:first + count], room, settings.overlap)
    rows = [window_row(whole, first, count, start, end, part) for part, (start, end) in enumerate(spans)]
    return TextWindows(whole, first, count, spans, rows)


def window_row(whole: EncodedInput, first: int, count: int, start: int, end: int, part: int) -> WindowRow:
    """The positions of `whole` one window reads: the leading special tokens, the text's pieces
    start..end, and everything after the text (special tokens, the text pair), in order."""
    positions = [*range(first), *range(first + start, first + end), *range(first + count, len(whole))]

    return WindowRow(text=whole.text, text_pair=whole.text_pair, tokens=whole.tokens[positions], truncated=False,
                     part=part)


# ---- combining the windows' answers -----------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    name: str  # as /v1/tasks names it
    combine: Callable[[TextWindows, list[np.ndarray]], np.ndarray]


def span_weights(text: TextWindows) -> np.ndarray:
    """Each window's weight: the number of the text's word pieces it holds."""
    return np.array([end - start for start, end in text.spans], dtype=np.float64)


def mean_by_tokens(text: TextWindows, outputs: list[np.ndarray]) -> np.ndarray:
    """Sequence logits (or regression values) of the windows, averaged weighted by `span_weights`."""
    weights = span_weights(text)
    stacked = np.stack([np.asarray(o, dtype=np.float64) for o in outputs])
    return (np.tensordot(weights, stacked, axes=1) / weights.sum()).astype(np.float32)


def mean_of_pooled_vectors(text: TextWindows, outputs: list[np.ndarray]) -> np.ndarray:
    """Embeddings: each window's output is its vector and, last, the norm the pooled vector had before
    any normalisation (server/heads/embedding/layer.py, `with_norm`). The windows' pooled vectors are
    averaged weighted by `span_weights`, then given back in the same form: normalised when the
    windows' vectors were (unit length), with the mean's own norm last."""
    stacked = np.stack([np.asarray(o, dtype=np.float64) for o in outputs])
    vectors, norms = stacked[:, :-1], stacked[:, -1]
    lengths = np.linalg.norm(vectors, axis=1)
    pooled = vectors * (norms / np.maximum(lengths, 1e-12))[:, None]  # exact for both forms
    weights = span_weights(text)
    mean = np.tensordot(weights, pooled, axes=1) / weights.sum()
    norm = np.linalg.norm(mean)
    normalised = bool(np.all(np.abs(lengths - 1.0) < 1e-3))
    vector = mean / max(norm, 1e-12) if normalised else mean
    return np.append(vector, norm).astype(np.float32)


def furthest_from_edge(text: TextWindows, outputs: list[np.ndarray]) -> np.ndarray:
    """Token logits over the whole text's positions: each of the text's word pieces from the window
    where it is furthest from a cut (the text's own ends are no cut; on a tie the earlier window);
    the positions every window holds (special tokens, the text pair) averaged over the windows."""
    first, count, n = text.first, text.count, len(text.whole)
    merged = np.zeros((n, outputs[0].shape[-1]), dtype=np.float64)
    best = np.full(count, -1.0)
    for (start, end), logits in zip(text.spans, outputs):
        piece = np.arange(start, end)
        left = piece - start if start > 0 else np.full(len(piece), np.inf)
        right = end - 1 - piece if end < count else np.full(len(piece), np.inf)
        distance = np.minimum(left, right)
        better = distance > best[piece]
        merged[first + piece[better]] = logits[first + (piece[better] - start)]
        best[piece[better]] = distance[better]
        merged[:first] += logits[:first]
        merged[first + count:] += logits[first + (end - start):]
    merged[:first] /= len(outputs)
    merged[first + count:] /= len(outputs)
    return merged.astype(np.float32)


# How the windows of one text become its answer, per task type (a TaskType value).
RULES: dict[str, Rule] = {
    "token_classification": Rule("token_logits_from_the_window_furthest_from_an_edge", furthest_from_edge),
    "sequence_classification": Rule("mean_of_logits_weighted_by_tokens", mean_by_tokens),
    "multi_label_classification": Rule("mean_of_logits_weighted_by_tokens", mean_by_tokens),
    "regression": Rule("mean_of_values_weighted_by_tokens", mean_by_tokens),
    "embedding": Rule("mean_of_pooled_vectors_weighted_by_tokens_then_normalised", mean_of_pooled_vectors),
}


def rule_for(task_type) -> Rule | None:
    return RULES.get(getattr(task_type, "value", task_type))


def window_rule(module) -> Rule | None:
    """How a module's answers on a long text's windows become one, or None where it reads one window
    only: a task type without a rule, or a bridge that re-tokenizes (its logits lie on other tokens)."""
    return None if module.retokenized else rule_for(module.manifest.task_type)


@dataclass
class Reading:
    """A request's inputs as rows: each text whole, or in windows."""

    texts: list[TextWindows]

    @property
    def rows(self) -> list[EncodedInput]:
        return [row for text in self.texts for row in text.rows]

    @property
    def tokens(self) -> int:
        return sum(len(row) for text in self.texts for row in text.rows)

    @property
    def windows(self) -> list[int]:
        return [len(text.rows) for text in self.texts]

    @property
    def windowed(self) -> bool:
        return any(text.windowed for text in self.texts)

    def answers(self, modules: dict, row_answers: list[dict], encoder: TextEncoder) -> list[dict[str, Any]]:
        """Per input, answers by task: a text read whole keeps its row's answer; a text read in
        windows gets its windows' outputs combined by the task type's rule, decoded once over the
        whole text (all such texts of the request in one decode per task)."""
        out, start = [], 0
        for text in self.texts:
            out.append(row_answers[start] if not text.windowed else {})
            start += len(text.rows)
        windowed = [i for i, text in enumerate(self.texts) if text.windowed]
        if not windowed:
            return out
        batch = encoder.collate([self.texts[i].whole for i in windowed], device="cpu")
        firsts = np.cumsum([0] + self.windows)
        for task, module in modules.items():
            rule = rule_for(module.manifest.task_type)
            merged = []
            for i in windowed:
                outputs = [row_answers[r][task] for r in range(firsts[i], firsts[i + 1])]
                merged.append(rule.combine(self.texts[i], [np.asarray(o) for o in outputs]))
            token_task = merged[0].ndim == 2  # (tokens, labels) per text: packed one after the other
            packed = np.concatenate(merged) if token_task else np.stack(merged)
            decoded = decode_rows(module.manifest.task_type, module.manifest.labels, packed, batch,
                                  [self.texts[i].whole.answer for i in windowed], module.manifest.decoding)
            for i, answer in zip(windowed, decoded):
                out[i][task] = answer
        return out


def read(encoder: TextEncoder, texts: list[str], text_pairs: list[str] | None, settings: WindowSettings,
         truncate: bool | str, budget: int | None = None) -> Reading:
    """Tokenize a request's inputs and cut each into the rows it is read in. With `truncate` each
    input is one row cut at the window's length (the first window), as `truncate` always meant;
    "left" keeps the last window's worth instead (TextEncoder.encode). TooManyTokens when its rows
    hold more than `budget` word pieces, found before the rest of the request is tokenized
    (`READ_RUN_CHARS`)."""
    if truncate:
        rows = encoder.encode(texts, text_pairs, truncate=truncate, max_tokens=settings.window)
        reading = Reading([TextWindows(row, 0, 0, [(0, 0)], [row]) for row in rows])
        if budget is not None and reading.tokens > budget:
            raise TooManyTokens(reading.tokens, len(reading.rows), len(texts), len(texts), budget)
        return reading
    read_texts: list[TextWindows] = []
    tokens = rows = 0  # running counts: the budget is checked after each run
    for run in runs(texts, text_pairs):
        wholes = encoder.encode(texts[run], text_pairs[run] if text_pairs else None, whole=True)
        for i, whole in enumerate(wholes):
            text = split(whole, settings, run.start + i)
            read_texts.append(text)
            tokens += sum(len(row) for row in text.rows)
            rows += len(text.rows)
        if budget is not None and tokens > budget:
            raise TooManyTokens(tokens, rows, run.stop, len(texts), budget)
    return Reading(read_texts)


def runs(texts: list[str], text_pairs: list[str] | None) -> list[slice]:
    """Consecutive inputs of about READ_RUN_CHARS characters each (at least one input per run)."""
    out, start, chars = [], 0, 0
    for i, text in enumerate(texts):
        chars += len(text) + (len(text_pairs[i]) if text_pairs else 0)
        if chars >= READ_RUN_CHARS:
            out.append(slice(start, i + 1))
            start, chars = i + 1, 0
    if start < len(texts) or not out:
        out.append(slice(start, len(texts)))
    return out


def check_windowable(reading: Reading, modules: dict) -> None:
    """Tasks a text read in windows cannot be answered for: those served through a bridge that
    re-tokenizes (their logits lie on another tokenization) and task types without a rule. 413,
    naming them."""
    if not reading.windowed:
        return
    refused = sorted(t for t, m in modules.items() if window_rule(m) is None)
    if refused:
        longest = max(len(t.whole) for t in reading.texts)
        raise ApiError(413, "input_too_long",
                       f"task(s) {refused} read one window only (served through a bridge that reads the text with "
                       f"another tokenizer, or a task type without a window rule), and an input has {longest} word "
                       f"pieces, over the window of "
                       f"{max(len(r) for r in reading.rows)}; ask for truncate, or send shorter texts",
                       tasks=refused)


def parts(rows: list[EncodedInput], max_rows: int, max_tokens: int) -> list[slice]:
    """Consecutive slices of a request's rows, each within one batch's row limit and token budget
    (rows x longest): submitted one after another, each to the back of the queue, so a request of
    many windows takes turns with other requests instead of holding the compute thread."""
    out, start, longest = [], 0, 0
    for i, row in enumerate(rows):
        count = i - start + 1
        if i > start and (count > max_rows or count * max(longest, len(row)) > max_tokens):
            out.append(slice(start, i))
            start, longest = i, len(row)
        else:
            longest = max(longest, len(row))
    out.append(slice(start, len(rows)))
    return out


@dataclass
class AnsweredJob(Job):
    """A whole request after its parts were answered: one row per input (the text whole, or as cut
    by truncate), the module versions that answered, and per input how many windows it was read in."""

    windows: list[int] = field(default_factory=list)
