"""The vectorised decoder (server/heads/decode.py) answers exactly what the per-row, per-token
decoder it replaced answered. That decoder is kept below as the oracle, with one change since: word
tags follow the BIO rules (a per-sequence Viterbi in plain Python, `reference_tags`); answers are
compared as JSON text, so values, types and key order must all match, with the new decoder given
torch's probabilities (its numpy ones are compared in tests/test_decode_numpy.py). The constrained
decoding has its own property tests at the end."""
from __future__ import annotations

import itertools
import json
import random
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modules_store import DEFAULT_STORE, ModuleStore, TaskType
from server.backbone.tokens import TokenBatch
from server.engine import Engine
from server.heads.decode import bio_constraints, constrained_labels, decode, decode_rows, viterbi
from server.modules import load_module
from tests.bio_reference import allowed_after, reference_tags
from tests.test_decode_numpy import torch_probabilities
from training.data.conll import CONLL_TAGS, read_conll
from training.data.files import default_data_dir


# ---- the oracle: server/heads/decode.py as it was before vectorising (commit d01cb18) -------------
def reference_decode(task_type: TaskType, labels: list[str], logits: torch.Tensor, batch: TokenBatch) -> list[dict[str, Any]]:
    logits = logits.float().cpu()
    if task_type == TaskType.sequence_classification:
        return [_classification(labels, row) for row in logits]
    if task_type == TaskType.regression:
        return [{"value": float(row.reshape(-1)[0])} for row in logits]
    if task_type == TaskType.token_classification:
        return [_entities(labels, logits[r], batch, r) for r in range(batch.size)]
    raise ValueError(f"no decoder for task type {task_type}")


def _classification(labels: list[str], row: torch.Tensor) -> dict[str, Any]:
    probs = torch.softmax(row, dim=-1).tolist()
    best = max(range(len(probs)), key=probs.__getitem__)
    return {"label": labels[best], "score": probs[best], "scores": dict(zip(labels, probs))}


def _split_tag(tag: str) -> tuple[str, str]:
    if tag == "O":
        return "O", ""
    if len(tag) > 2 and tag[1] == "-" and tag[0] in "BIESLU":
        return {"L": "E", "U": "S"}.get(tag[0], tag[0]), tag[2:]
    return "I", tag


def word_predictions(labels: list[str], logits: torch.Tensor, batch: TokenBatch, row: int):
    probs = torch.softmax(logits, dim=-1)
    words: dict[tuple[int, int], list] = {}
    for t, (seq, word) in enumerate(zip(batch.sequence_ids[row], batch.word_ids[row])):
        if seq is None or word is None:
            continue
        start, end = batch.offsets[row][t]
        key = (seq, word)
        if key not in words:
            words[key] = [seq, start, end, probs[t].tolist()]
        else:
            words[key][2] = max(words[key][2], end)
    out = list(words.values())
    tags: list[int] = []
    for first in range(len(out)):  # runs of one segment: the words an entity can continue over
        if first == 0 or out[first][0] != out[first - 1][0]:
            last = first
            while last + 1 < len(out) and out[last + 1][0] == out[first][0]:
                last += 1
            tags += reference_tags(labels, [w[3] for w in out[first:last + 1]])
    return [[seq, start, end, labels[tag], probs[tag]] for (seq, start, end, probs), tag in zip(out, tags)]


def _entities(labels: list[str], logits: torch.Tensor, batch: TokenBatch, row: int) -> dict[str, Any]:
    entities: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    word_scores: list[float] = []

    def close():
        nonlocal current
        if current is not None:
            current["score"] = sum(word_scores) / len(word_scores)
            source = batch.texts[row] if current["segment"] == 0 else batch.text_pairs[row]
            current["text"] = source[current["start"]:current["end"]]
            entities.append(current)
        current = None

    left_open = False  # the word before was a B- or an I- (E- and S- close an entity)
    for seq, start, end, tag, score in word_predictions(labels, logits, batch, row):
        prefix, kind = _split_tag(tag)
        continues = current is not None and left_open and prefix in ("I", "E") and kind == current["label"] \
            and seq == current["segment"]
        left_open = prefix in ("B", "I")
        if continues:
            current["end"] = end
            word_scores.append(score)
            continue
        close()
        if prefix != "O":
            current = {"label": kind, "start": start, "end": end, "segment": seq}
            word_scores = [score]
    close()
    fields = ("text", "label", "start", "end", "score") + (("segment",) if batch.text_pairs is not None else ())
    return {"entities": [{k: e[k] for k in fields} for e in entities]}


# ---- helpers ----------------------------------------------------------------------------------------
def assert_same(task_type, labels, logits, batch) -> list[dict]:
    with torch_probabilities():  # the oracle's softmax bits (numpy's differ in the last ones: test_decode_numpy.py)
        new = decode(task_type, labels, logits, batch)
    old = reference_decode(task_type, labels, logits, batch)
    assert json.dumps(new) == json.dumps(old)  # numpy scalars would not serialise; key order counts
    return new


BIO = CONLL_TAGS
PLAIN = ["O", "PER", "LOC", "ORG"]  # no prefixes: every non-O tag reads as I-, so equal tags join
# E- ends an entity, S- is one of a word, "X" an I-X, "" is an I- of the type "" (which O has too)
ODD = ["O", "B-X", "I-X", "E-X", "S-X", "X", "I-Y", "B-", "I", ""]
BIOES = ["O", "B-PER", "I-PER", "E-PER", "S-PER", "B-LOC", "I-LOC", "E-LOC", "S-LOC"]
BILOU = ["O", "B-PER", "I-PER", "L-PER", "U-PER", "B-LOC", "I-LOC", "L-LOC", "U-LOC"]
LABEL_SETS = [BIO, PLAIN, ODD, BIOES, BILOU, ["O"], ["B-A", "I-A"]]

WORDS = ["Angela", "Merkel", "visited", "Schwarzenegger", "unbelievably", "U.S.", "New", "York", "EU", "'s",
         "naïve", "café", "—", "3.14", "e-mail", "a", "I", "ok", "Zürich", "東京", "🙂", ",", "(", ")",
         "rejects", "German", "call", "to", "boycott", "British", "lamb", "supercalifragilistic"]
SPACES = [" ", " ", " ", "  ", "\t", "\n", " \u00a0 "]


def random_text(rng: random.Random, max_words: int = 12) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(0, max_words))]
    text = "".join(w + rng.choice(SPACES) for w in words)
    return rng.choice(["", " ", "\n"]) + text  # leading and trailing whitespace


def random_batch(encoder, rng: random.Random) -> TokenBatch:
    """Rows from up to three 'requests' collated together: plain texts, text pairs, or a mix
    (a batch holds pairs as soon as one row has one); sometimes truncated, sometimes padded to a
    larger bucket with filler rows and decoded on its real rows, as the model runner does."""
    rows = []
    for _ in range(rng.randint(1, 3)):
        n = rng.randint(1, 5)
        texts = [random_text(rng) for _ in range(n)]
        pairs = [random_text(rng) for _ in range(n)] if rng.random() < 0.5 else None
        limit = rng.choice([None, None, 6, 9])
        rows += encoder.encode(texts, pairs, truncate=limit is not None, max_tokens=limit)
    if rng.random() < 0.3:
        width = max(len(row) for row in rows)
        return encoder.collate(rows, shape=(len(rows) + rng.randint(0, 3), width + rng.randint(0, 4))).real()
    return encoder.collate(rows)


def random_logits(rng: random.Random, shape: tuple[int, ...]) -> torch.Tensor:
    """Gaussian, or small integers (equal maxima: the first wins), or peaked on random labels
    (long runs of one tag, entities across many words)."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    style = rng.choice(["gauss", "ties", "peaked"])
    if style == "gauss":
        return torch.randn(shape, generator=gen) * rng.choice([0.5, 3.0, 20.0])
    if style == "ties":
        return torch.randint(-1, 2, shape, generator=gen).float()
    logits = torch.randn(shape, generator=gen)
    best = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    return logits.scatter(-1, best.unsqueeze(-1), 6.0)


# ---- tests -------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_token_classification_equals_the_old_decoder_on_random_batches(minilm, seed):
    rng = random.Random(seed)
    batch = random_batch(minilm.text, rng)
    labels = rng.choice(LABEL_SETS)
    logits = random_logits(rng, (batch.size, batch.seq_len, len(labels)))
    if rng.random() < 0.3:
        logits = logits.half()  # what a 16-bit head hands back
    assert_same(TaskType.token_classification, labels, logits, batch)


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(0, 9), width=st.integers(1, 6))
def test_sequence_classification_and_regression_equal_the_old_decoder(seed, rows, width):
    rng = random.Random(seed)
    labels = [f"label{i}" for i in range(width)]
    assert_same(TaskType.sequence_classification, labels, random_logits(rng, (rows, width)), None)
    assert_same(TaskType.regression, labels, random_logits(rng, (rows, width)), None)


def scrambled_batch(rng: random.Random) -> TokenBatch:
    """Token lists no tokenizer here makes: word ids out of order, a word's sub-tokens apart, words
    of the pair before the text's, random spans. Words still come out in first-token order."""
    rows, width = rng.randint(1, 6), rng.randint(1, 14)
    texts = ["".join(rng.choice("ab ") for _ in range(30)) for _ in range(rows)]
    pairs = ["".join(rng.choice("cd ") for _ in range(30)) for _ in range(rows)]
    segments = [[rng.choice([None, 0, 1]) for _ in range(width)] for _ in range(rows)]
    words = [[None if s is None else rng.choice([None, 0, 1, 2, 3]) for s in row] for row in segments]
    offsets = []
    for _ in range(rows):
        starts = [rng.randint(0, 25) for _ in range(width)]
        offsets.append([(a, a + rng.randint(0, 5)) for a in starts])
    ids = torch.zeros((rows, width), dtype=torch.long)
    return TokenBatch(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=None, offsets=offsets,
                      sequence_ids=segments, word_ids=words, texts=texts, text_pairs=pairs, truncated=[False] * rows)


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_token_classification_equals_the_old_decoder_on_scrambled_token_lists(seed):
    rng = random.Random(seed)
    batch = scrambled_batch(rng)
    labels = rng.choice(LABEL_SETS)
    assert_same(TaskType.token_classification, labels,
                random_logits(rng, (batch.size, batch.seq_len, len(labels))), batch)


def test_entities_span_words_across_sub_tokens_segments_and_rows(minilm):
    """A hand-built case, so the property test's oracle is not the only judge: tags on first
    sub-tokens, spans to the last sub-token, entities closed at a segment's end (the pair's first
    word, I-LOC at best, cannot continue the text's last: it opens its own entity as B-LOC)."""
    text, pair = "Angela Schwarzenegger visited  Zürich", "Zürich rejects"
    batch = minilm.text.tokenize([text, "ok"], [pair, "New York"])
    logits = torch.full((batch.size, batch.seq_len, len(BIO)), -5.0)
    wanted = {(0, 0, 0): "B-PER", (0, 0, 1): "I-PER", (0, 0, 3): "B-LOC", (0, 1, 0): "I-LOC",
              (1, 1, 0): "B-LOC", (1, 1, 1): "I-LOC"}
    for r in range(batch.size):
        for t, (seq, word) in enumerate(zip(batch.sequence_ids[r], batch.word_ids[r])):
            logits[r, t, BIO.index(wanted.get((r, seq, word), "O"))] = 5.0
            if (r, seq, word) == (0, 1, 0):
                logits[r, t, BIO.index("B-LOC")] = 4.0
    answers = assert_same(TaskType.token_classification, BIO, logits, batch)
    assert [[(e["text"], e["label"], e["segment"]) for e in a["entities"]] for a in answers] == [
        [("Angela Schwarzenegger", "PER", 0), ("Zürich", "LOC", 0), ("Zürich", "LOC", 1)],
        [("New York", "LOC", 1)],
    ]
    assert len(minilm.text.encode(["Schwarzenegger"])[0]) > 3  # the name is several sub-tokens


@pytest.fixture(scope="module")
def conll_validation():
    path = default_data_dir() / "conll2003" / "validation.txt"
    if not path.is_file():
        pytest.skip(f"shared data not found at {path}")
    return read_conll(path)


def check_conll_batches(minilm, texts: list[str]) -> int:
    """`texts` in 128-row batches through the real tokenizer, decoded from the shipped NER module's logits
    (real predictions) and from random logits, against the oracle. Returns the entities found."""
    ner = load_module(ModuleStore(DEFAULT_STORE), "ner", None, minilm)
    engine = Engine(minilm)
    entities = 0
    with torch.inference_mode():
        for first in range(0, len(texts), 128):
            batch = minilm.text.tokenize(texts[first:first + 128], truncate=True)
            logits, _ = engine.run(batch, {"ner": ner})
            answers = assert_same(TaskType.token_classification, ner.head.labels, logits["ner"], batch)
            entities += sum(len(a["entities"]) for a in answers)
            random_ = random_logits(random.Random(first), (batch.size, batch.seq_len, len(BIO)))
            assert_same(TaskType.token_classification, BIO, random_, batch)
    return entities


def test_conll_validation_batches_decode_as_before(minilm, conll_validation):
    """The fast tier: two 128-row batches of CoNLL validation sentences, the first and one from the
    middle (articles of other topics), with every length and entity kind the set has (the whole set:
    the slow test below; both fail on any answer that differs from the oracle's)."""
    texts = conll_validation.texts()
    middle = len(texts) // 2
    assert check_conll_batches(minilm, texts[:128] + texts[middle:middle + 128]) > 400  # not empty lists: 580 found


@pytest.mark.slow
def test_conll_validation_decodes_as_before_whole_set(minilm, conll_validation):
    """Every CoNLL validation sentence (3,250), as the fast test's two batches."""
    texts = conll_validation.texts()
    assert len(texts) > 3000
    assert check_conll_batches(minilm, texts) > 3000


def test_conll_pairs_decode_as_before(minilm, conll_validation):
    texts = conll_validation.texts()[:256]
    batch = minilm.text.tokenize(texts[:128], texts[128:], truncate=True)
    logits = random_logits(random.Random(7), (batch.size, batch.seq_len, len(BIO)))
    answers = assert_same(TaskType.token_classification, BIO, logits, batch)
    assert {e["segment"] for a in answers for e in a["entities"]} == {0, 1}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_a_worker_decoding_its_rows_answers_as_the_batch_decoder(minilm, seed):
    """With --workers the engine hands each request back its rows' logits cut to their lengths
    (`row_logits`), packed into one array per task (the answer frame), and the worker decodes them over
    its own rows (`decode_rows`): the answers are those of decoding the whole batch in the engine."""
    rng = random.Random(seed)
    requests = []
    with_pairs = rng.random() < 0.5  # a batch holds requests of one signature (the batcher's rule)
    for _ in range(rng.randint(1, 3)):
        n = rng.randint(1, 4)
        pairs = [random_text(rng) for _ in range(n)] if with_pairs else None
        requests.append(minilm.text.encode([random_text(rng) for _ in range(n)], pairs))
    rows = [row for request in requests for row in request]
    batch = minilm.text.collate(rows)
    for task_type, labels in ((TaskType.token_classification, rng.choice(LABEL_SETS)),
                              (TaskType.sequence_classification, ["a", "b", "c"])):
        shape = (batch.size, batch.seq_len, len(labels)) if task_type == TaskType.token_classification \
            else (batch.size, len(labels))
        logits = random_logits(rng, shape)
        whole = decode(task_type, labels, logits, batch)
        per_row = [logits[r, :len(row)].numpy() if logits.dim() == 3 else logits[r].numpy() for r, row in enumerate(rows)]
        answered, start = [], 0
        for request in requests:
            mine = per_row[start:start + len(request)]
            packed = np.concatenate(mine) if task_type == TaskType.token_classification else np.stack(mine)
            answered += decode_rows(task_type, labels, packed, minilm.text.collate(request, device="cpu"))
            start += len(request)
        assert answered == whole


# ---- constrained (BIO) decoding ---------------------------------------------------------------------
def random_sequences(rng: random.Random, labels: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Word log-probabilities of a few sequences laid end to end, and where each starts; peaked on
    I- tags often, so that their best labels break the rules."""
    lengths = [rng.randint(1, 9) for _ in range(rng.randint(1, 6))]
    gen = np.random.default_rng(rng.randrange(2**32))
    logits = gen.normal(size=(sum(lengths), len(labels))) * rng.choice([0.5, 2.0, 8.0])
    inside = [j for j, tag in enumerate(labels) if tag.startswith("I-")]
    if inside:
        peaks = gen.random(len(logits)) < 0.4
        logits[peaks, gen.choice(inside, peaks.sum())] += 5.0
    log_probs = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    starts = np.zeros(len(logits), dtype=bool)
    starts[np.cumsum([0] + lengths[:-1])] = True
    return log_probs, starts


def sequences_of(starts: np.ndarray) -> list[slice]:
    begin = np.flatnonzero(starts).tolist() + [len(starts)]
    return [slice(a, b) for a, b in zip(begin[:-1], begin[1:])]


def follows_the_rules(labels: list[str], tags: list[int]) -> bool:
    return all(allowed_after(labels, tags[i - 1] if i else None, tags[i]) for i in range(len(tags)))


CONSTRAINED = [BIO, ["O", "B-A", "I-A"], ["B-A", "I-A", "I-B", "B-B", "O", "E-A", "I-C"], BIOES, BILOU]


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_constrained_tags_never_break_the_bio_rules_and_keep_valid_argmax(seed):
    rng = random.Random(seed)
    labels = rng.choice(CONSTRAINED)
    log_probs, starts = random_sequences(rng, labels)
    allowed = bio_constraints(labels)
    tags = constrained_labels(log_probs, starts, allowed)
    for seq in sequences_of(starts):
        best = log_probs[seq].argmax(1).tolist()
        # the search itself, not only the shortcut that keeps a valid argmax
        path = viterbi(log_probs[seq][None], np.array([seq.stop - seq.start]), allowed)[0].tolist()
        assert follows_the_rules(labels, tags[seq].tolist()) and follows_the_rules(labels, path)
        if follows_the_rules(labels, best):
            assert tags[seq].tolist() == path == best
        else:
            assert tags[seq].tolist() == path == reference_tags(labels, np.exp(log_probs[seq]).tolist())


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_constrained_tags_are_the_most_probable_allowed_sequence(seed):
    """Against every tag sequence of a short sentence: no allowed one scores higher."""
    rng = random.Random(seed)
    labels = rng.choice([["O", "B-A", "I-A"], ["O", "B-A", "I-A", "B-B", "I-B"]])
    log_probs, starts = random_sequences(rng, labels)
    log_probs, starts = log_probs[:5], starts[:5]
    starts[0] = True
    tags = constrained_labels(log_probs, starts, bio_constraints(labels))
    for seq in sequences_of(starts):
        words = log_probs[seq]
        best = max(sum(words[i, t] for i, t in enumerate(path))
                   for path in itertools.product(range(len(labels)), repeat=len(words))
                   if follows_the_rules(labels, list(path)))
        assert sum(words[i, t] for i, t in enumerate(tags[seq])) == pytest.approx(best, abs=1e-9)


def test_unconstrained_label_sets_decode_by_argmax():
    for labels in (PLAIN, ["O"], ["O", "I-A", "I-B"], ["O", "E-A", "S-A"]):
        assert bio_constraints(labels) is None


def test_an_inside_tag_after_outside_is_resolved_by_probability(minilm):
    """Served answers: `I-PER` on "Merkel" after an `O` "Angela" comes back as one entity or none,
    whichever the probabilities favour, never as an entity opened by an I- tag."""
    batch = minilm.text.tokenize(["Angela Merkel spoke"])
    logits = torch.full((1, batch.seq_len, len(BIO)), -5.0)
    words = {w: t for t, w in reversed(list(enumerate(batch.word_ids[0]))) if w is not None}
    logits[0, words[0], BIO.index("O")] = 3.0
    logits[0, words[0], BIO.index("B-PER")] = 2.0  # a close second: Angela joins the name
    logits[0, words[1], BIO.index("I-PER")] = 6.0
    logits[0, words[2], BIO.index("O")] = 6.0
    entities = decode(TaskType.token_classification, BIO, logits, batch)[0]["entities"]
    assert [(e["text"], e["label"]) for e in entities] == [("Angela Merkel", "PER")]
    logits[0, words[0], BIO.index("B-PER")] = -5.0  # Angela plainly outside: Merkel opens as B-PER or is O
    logits[0, words[1], BIO.index("B-PER")] = 1.0
    entities = decode(TaskType.token_classification, BIO, logits, batch)[0]["entities"]
    assert [(e["text"], e["label"]) for e in entities] == [("Merkel", "PER")]
