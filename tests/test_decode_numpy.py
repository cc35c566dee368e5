"""The numpy decoder (server/heads/decode.py, issue 37) answers what the torch decoder it replaced
answered (tests/decode_reference.py, a frozen copy of it), for every task type and answer control:

- its logic exactly: given the probabilities torch computes (`torch_probabilities`), every answer is
  the same JSON text (values, types, key order), on random logits of every style, ties included;
- its numbers: numpy's float32 softmax and sigmoid differ from torch's in the last bits (each
  library's vectorised exp, as torch's own differ between AVX2 and AVX-512). Largest score
  difference measured on this AMD EPYC (AVX-512), random and real logits: 4.2e-7 (probabilities),
  entity scores the same. SCORE_TOLERANCE is 2e-6, about 5x that; labels, texts and offsets exactly.
  Where two answers are equally probable to within those bits (a BIO path tied with another, two
  pieces of a word both at probability 1.0 for `max`), which one wins was already decided by the
  rounding (and differed between CPUs): those logits are compared through `torch_probabilities` only;
- on the shipped modules' real outputs (MiniLM, real SST-2, CoNLL-2003, CoLA, GoEmotions and RTE
  validation texts): labels exactly, scores within SCORE_TOLERANCE, through `decode` (the one
  process) and `decode_rows` (a worker, from its rows or its collated batch).
"""
from __future__ import annotations

import contextlib
import csv
import json
import math
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import server.heads.decode as decoder
import tests.decode_reference as reference
from modules_store import DEFAULT_STORE, ModuleStore, TaskType
from server.engine import Engine
from server.heads.decode import AnswerOptions, decode, decode_rows
from server.modules import load_module
from training.data.conll import read_conll
from training.data.files import default_data_dir

SCORE_TOLERANCE = 2e-6
BIO = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]
LABEL_SETS = [BIO, ["O", "PER", "LOC", "ORG"], ["O", "B-X", "I-X", "E-X", "S-X", "X", "I-Y", "B-", "I", ""], ["O"],
              ["B-A", "I-A"], ["O", "B-PER", "I-PER", "E-PER", "S-PER", "B-LOC", "I-LOC", "E-LOC", "S-LOC"],
              ["O", "B-PER", "I-PER", "L-PER", "U-PER"]]
WORDS = ["Angela", "Merkel", "visited", "Schwarzenegger", "unbelievably", "U.S.", "New", "York", "EU", "'s", "naïve",
         "café", "—", "3.14", "e-mail", "a", "I", "Zürich", "東京", "🙂", ",", "(", "supercalifragilistic"]


@contextlib.contextmanager
def torch_probabilities():
    """The numpy decoder with torch's softmax and sigmoid (the bits the torch decoder decided on)."""
    softmax, sigmoid = decoder.softmax, decoder.sigmoid
    decoder.softmax = lambda x: torch.softmax(torch.from_numpy(np.ascontiguousarray(x)), dim=-1).numpy()
    decoder.sigmoid = lambda x: torch.sigmoid(torch.from_numpy(np.ascontiguousarray(x))).numpy()
    try:
        yield
    finally:
        decoder.softmax, decoder.sigmoid = softmax, sigmoid


def close_answers(old, new, where: str = "answer") -> float:
    """Equal structure, key order, labels, texts, offsets and types; floats within SCORE_TOLERANCE.
    Returns the largest float difference."""
    if isinstance(old, float) or isinstance(new, float):
        assert type(old) is type(new), f"{where}: {old!r} vs {new!r}"
        assert math.isclose(old, new, rel_tol=0, abs_tol=SCORE_TOLERANCE), f"{where}: {old} != {new}"
        return abs(old - new)
    assert type(old) is type(new), f"{where}: {old!r} vs {new!r}"
    if isinstance(old, dict):
        assert list(old) == list(new), f"{where}: keys {list(old)} != {list(new)}"
        return max([close_answers(old[k], new[k], f"{where}.{k}") for k in old], default=0.0)
    if isinstance(old, list):
        assert len(old) == len(new), f"{where}: {len(old)} items != {len(new)}"
        return max([close_answers(a, b, f"{where}[{i}]") for i, (a, b) in enumerate(zip(old, new))], default=0.0)
    assert old == new, f"{where}: {old!r} != {new!r}"
    return 0.0


def reference_answers(task_type, labels, logits, batch, options, decoding):
    try:
        return reference.decode(task_type, labels, logits, batch, options, decoding)
    except IndexError:  # the torch decoder's `max` failed on a batch without a word; the numpy one answers none
        return None


# ---- random logits ----------------------------------------------------------------------------------
def random_text(rng: random.Random) -> str:
    return rng.choice(["", " "]) + "".join(rng.choice(WORDS) + rng.choice([" ", "  ", "\t", "\n"])
                                           for _ in range(rng.randint(0, 10)))


def random_requests(encoder, rng: random.Random) -> list[list]:
    """Up to three requests of one signature (texts or pairs), sometimes truncated."""
    pairs = rng.random() < 0.4
    out = []
    for _ in range(rng.randint(1, 3)):
        n = rng.randint(1, 4)
        limit = rng.choice([None, None, 7])
        out.append(encoder.encode([random_text(rng) for _ in range(n)], [random_text(rng) for _ in range(n)] if pairs else None,
                                  truncate=limit is not None, max_tokens=limit))
    return out


def random_logits(rng: random.Random, shape, style: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    if style == "ties":  # small integers: equal maxima, equally probable paths
        return torch.randint(-1, 2, shape, generator=gen).float()
    if style == "wide":  # probabilities of 1.0 and of 0 (float32 underflow)
        return torch.randn(shape, generator=gen) * 40.0
    if style == "peaked":
        logits = torch.randn(shape, generator=gen)
        return logits.scatter(-1, torch.randint(0, shape[-1], shape[:-1], generator=gen).unsqueeze(-1), 6.0)
    return torch.randn(shape, generator=gen) * rng.choice([0.5, 2.0])


def random_options(rng: random.Random, rows: int, labels: int) -> tuple[list, dict]:
    def one():
        if rng.random() < 0.3:
            return None
        return AnswerOptions(top_k=rng.choice([None, 1, labels, labels + 2]), raw_scores=rng.random() < 0.3,
                             threshold=rng.choice([None, 0.0, 0.3, 0.9]),
                             aggregation=rng.choice([None, "first", "average", "max", "none"]))
    per_row = [one() for _ in range(rows)] if rng.random() < 0.7 else one()
    decoding = rng.choice([{}, {"threshold": 0.6}, {"aggregation": rng.choice(["first", "average", "max", "none"])},
                           {"thresholds": {"l0": 0.2, "l1": 0.9}}])
    return per_row, decoding


def check_case(minilm, rng: random.Random, style: str, exact: bool) -> float:
    """One random batch of every task type through `decode` and each request through `decode_rows`
    (from its rows and from its collated batch), against the torch decoder on the whole batch."""
    requests = random_requests(minilm.text, rng)
    rows = [row for request in requests for row in request]
    batch = minilm.text.collate(rows)
    lengths = [len(row) for row in rows]
    worst = 0.0
    for task_type in (TaskType.token_classification, TaskType.sequence_classification,
                      TaskType.multi_label_classification, TaskType.regression, TaskType.embedding):
        labels = rng.choice(LABEL_SETS) if task_type == TaskType.token_classification else \
            [f"l{i}" for i in range(rng.randint(1, 5))]
        width = len(labels) if task_type != TaskType.regression else 1
        shape = (batch.size, batch.seq_len, width) if task_type == TaskType.token_classification else (batch.size, width)
        logits = random_logits(rng, shape, style)
        if rng.random() < 0.2:
            logits = logits.half()  # what a 16-bit head hands back
        options, decoding = random_options(rng, len(rows), width)
        old = reference_answers(task_type, labels, logits, batch, options, decoding)
        new = decode(task_type, labels, logits, batch, options, decoding)
        per_request, start = [], 0
        for request in requests:
            mine = options[start:start + len(request)] if isinstance(options, list) else options
            if task_type == TaskType.token_classification:
                packed = np.concatenate([logits[r, :lengths[r]].float().numpy() for r in range(start, start + len(request))])
            else:
                packed = logits[start:start + len(request)].float().numpy()
            from_rows = decode_rows(task_type, labels, packed, request, mine, decoding)
            from_batch = decode_rows(task_type, labels, packed, minilm.text.collate(request, device="cpu"), mine, decoding)
            assert json.dumps(from_rows) == json.dumps(from_batch)
            per_request += from_rows
            start += len(request)
        if not exact:  # numpy's float32 functions give a row the same bits in any batch (torch's vectorised tails do not)
            assert json.dumps(per_request) == json.dumps(new)  # a worker's answers are the one process's, to the bit
            packed = np.concatenate([logits[r, :lengths[r]].float().numpy() for r in range(len(rows))]) \
                if task_type == TaskType.token_classification else logits.float().numpy()
            frame = decode_rows(task_type, labels, packed, rows, options, decoding)  # every request of a frame at once
            assert json.dumps(frame) == json.dumps(new)
        if old is None:  # some row had no word: the reference decodes each row alone, a wordless one answers none
            for r, row in enumerate(rows):
                mine = [options[r]] if isinstance(options, list) else options
                alone = reference_answers(task_type, labels, logits[r:r + 1, :len(row)],
                                          minilm.text.collate([row]), mine, decoding)
                if alone is None:
                    assert new[r] == {"entities": []}
                elif exact:
                    assert json.dumps(new[r]) == json.dumps(alone[0])
                else:
                    worst = max(worst, close_answers(alone[0], new[r]))
        elif exact:
            assert json.dumps(new) == json.dumps(old)
        else:
            worst = max(worst, close_answers(old, new))
    return worst


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), style=st.sampled_from(["ties", "wide", "peaked", "gauss"]))
def test_the_decoding_logic_is_the_torch_decoders_to_the_bit(minilm, seed, style):
    with torch_probabilities():
        check_case(minilm, random.Random(seed), style, exact=True)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), style=st.sampled_from(["peaked", "gauss"]))
def test_numpy_probabilities_give_the_same_labels_and_scores_within_the_tolerance(minilm, seed, style):
    check_case(minilm, random.Random(seed), style, exact=False)


def test_bio_constraints_are_made_once_per_label_set():
    first = decoder.bio_constraints(list(BIO))
    assert decoder.bio_constraints(tuple(BIO)) is first and not first.flags.writeable
    np.testing.assert_array_equal(first, reference.bio_constraints(BIO))


# ---- the shipped modules' real outputs ---------------------------------------------------------------
def _tsv(path, column: int) -> list[str]:
    with open(path, encoding="utf-8", newline="") as f:
        return [row[column] for row in list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]]


def validation_texts(sst2: int, conll: int, cola: int, goemotions: int, rte: int):
    """The first texts of each validation set: (texts, RTE premises, RTE hypotheses)."""
    data = default_data_dir()
    if not (data / "sst2" / "validation.tsv").is_file():
        pytest.skip(f"shared data not found at {data}")
    texts = (_tsv(data / "sst2" / "validation.tsv", 0)[:sst2] + read_conll(data / "conll2003" / "validation.txt").texts()[:conll]
             + _tsv(data / "cola" / "validation.tsv", 0)[:cola] + _tsv(data / "goemotions" / "validation.tsv", 0)[:goemotions])
    return texts, _tsv(data / "rte" / "dev.tsv", 1)[:rte], _tsv(data / "rte" / "dev.tsv", 2)[:rte]


def check_shipped_modules(minilm, texts, premises, hypotheses) -> tuple[float, int]:
    """The six shipped modules on `texts` in batches of 32 (and 6 RTE pairs per batch for entailment),
    the torch decoder against `decode` and a worker's `decode_rows`. Returns (largest score
    difference, entities found)."""
    store = ModuleStore(DEFAULT_STORE)
    modules = {task: load_module(store, task, None, minilm)
               for task in ("sentiment", "ner", "acceptability", "emotion", "embedding", "entailment")}
    engine = Engine(minilm)
    worst, entities = 0.0, 0
    options = [None, AnswerOptions(aggregation="average"), AnswerOptions(aggregation="max"),
               AnswerOptions(aggregation="none", top_k=1), AnswerOptions(threshold=0.2, top_k=3, raw_scores=True)]
    for first in range(0, len(texts), 32):
        for chunk, pairs, tasks in ((texts[first:first + 32], None, [t for t in modules if t != "entailment"]),
                                    (premises[first // 32 * 6:first // 32 * 6 + 6], hypotheses[first // 32 * 6:first // 32 * 6 + 6],
                                     ["entailment"])):
            rows = minilm.text.encode(chunk, pairs, truncate=True)
            batch = minilm.text.collate(rows)
            with torch.inference_mode():
                logits, _ = engine.run(batch, {task: modules[task] for task in tasks})
            for task in tasks:
                module = modules[task]
                args = (module.head.task_type, module.head.labels, logits[task], batch)
                per_row = [options[(first + r) % len(options)] for r in range(len(rows))]
                for asked in (None, per_row):
                    old = reference.decode(*args, asked, module.manifest.decoding)
                    new = decode(*args, asked, module.manifest.decoding)
                    worst = max(worst, close_answers(old, new, task))
                    entities += sum(len(a.get("entities", [])) for a in new)
                host = logits[task].float().numpy()
                packed = np.concatenate([host[r, :len(row)] for r, row in enumerate(rows)]) if host.ndim == 3 else host
                worker = decode_rows(module.head.task_type, module.head.labels, packed, rows, per_row, module.manifest.decoding)
                assert json.dumps(worker) == json.dumps(decode(*args, per_row, module.manifest.decoding))
    return worst, entities


def test_shipped_modules_answer_as_before_on_real_texts(minilm):
    """The fast tier: 32 SST-2, 32 CoNLL-2003, 16 CoLA and 16 GoEmotions validation texts and 18 RTE
    pairs (every module, every answer control, entities found); the slow test below runs the larger
    sample this test ran before (256 texts, 48 pairs). Both fail on a label or a score past the tolerance."""
    worst, entities = check_shipped_modules(minilm, *validation_texts(sst2=32, conll=32, cola=16, goemotions=16, rte=18))
    assert entities > 150  # the NER module finds entities (206): the comparison is not between empty lists
    assert worst < SCORE_TOLERANCE


@pytest.mark.slow
def test_shipped_modules_answer_as_before_on_more_real_texts(minilm):
    worst, entities = check_shipped_modules(minilm, *validation_texts(sst2=96, conll=96, cola=32, goemotions=32, rte=48))
    assert entities > 200
    assert worst < SCORE_TOLERANCE
