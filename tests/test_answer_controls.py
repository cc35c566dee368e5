"""Per-request answer controls, multi-label answers and the OIP v2 classification extension, on a real
server over the shipped modules (modules_store/), each checked against a hand computation from the
head's own logits (Engine.logits on the same backbone, fp32). Also: the default answers of every
shipped single-label task equal those recorded before the controls existed (tests/default_answers.py)."""
from __future__ import annotations

import json
import math
import os

import httpx
import numpy as np
import pytest
import torch

from modules_store import DEFAULT_STORE, ModuleStore, TaskType
from server.api.app import create_app
from server.config import Settings
from server.engine import Engine
from server.heads.decode import AnswerOptions, decode
from server.modules import load_module
from tests import default_answers
from tests.bio_reference import reference_tags
from tests.helpers import LiveServer, start_tmod_serve
from training.metrics import entities as entity_spans

NER_TEXTS = ["Schwarzenegger flew from Kraków to Wellington with Microsoft's Satya Nadella.",
             "The Bundesbank and Gazprom met in Vladivostok on Tuesday."]
EMOTION_TEXTS = ["Thank you so much, this made my day!", "I can't believe they did that, it's disgusting.",
                 "Wow, I did not expect that at all. Is it true?", "I miss him so much, it hurts."]
SENTIMENT_TEXTS = ["A gorgeous, witty, seductive movie.", "The plot is thin and the acting is worse."]


@pytest.fixture(scope="module")
def live(minilm):
    # every shipped task, the opt-in entailment/1 of MiniLM included (the pair-truncation test names it)
    settings = Settings(store=DEFAULT_STORE, precision="fp32", head_precision="fp32", max_inputs=16,
                        tasks=",".join(ModuleStore(DEFAULT_STORE).tasks()))
    with LiveServer(create_app(settings, backbone=minilm)) as server:
        yield server


class ShippedModules(dict):
    """The shipped modules on the real MiniLM backbone, loaded on first use."""

    def __init__(self, backbone):
        super().__init__()
        self.backbone, self.store = backbone, ModuleStore(DEFAULT_STORE)

    def __missing__(self, task):
        self[task] = load_module(self.store, task, None, self.backbone)
        return self[task]


@pytest.fixture(scope="module")
def modules(minilm):
    return ShippedModules(minilm)


def infer(live, tasks: str, inputs, **controls) -> httpx.Response:
    return httpx.post(live.url + "/v1/infer", params={"tasks": tasks}, json={"inputs": inputs, **controls}, timeout=120)


def answers(live, tasks: str, inputs, **controls) -> list[dict]:
    response = infer(live, tasks, inputs, **controls)
    assert response.status_code == 200, response.text
    return [row[tasks] for row in response.json()["results"]]


def head_logits(minilm, module, texts) -> np.ndarray:
    """The head's logits for `texts`, each text in a batch of its own (no padding)."""
    engine = Engine(minilm)
    out = [engine.logits(minilm.tokenize([t]), {module.task: module})[module.task][0].float().numpy() for t in texts]
    return out


# ---- sequence tasks: raw_scores, top_k --------------------------------------------------------------
def test_raw_scores_are_the_heads_logits(live, minilm, modules):
    labels = modules["sentiment"].head.labels
    default = answers(live, "sentiment", SENTIMENT_TEXTS)
    raw = answers(live, "sentiment", SENTIMENT_TEXTS, raw_scores=True)
    for text, logits, d, r in zip(SENTIMENT_TEXTS, head_logits(minilm, modules["sentiment"], SENTIMENT_TEXTS), default, raw):
        assert [r["scores"][l] for l in labels] == pytest.approx(logits.tolist(), abs=1e-4)
        assert r["label"] == d["label"] and r["score"] == pytest.approx(float(logits.max()), abs=1e-4)
        # and the default probabilities are their softmax
        probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        assert [d["scores"][l] for l in labels] == pytest.approx(probs.tolist(), abs=1e-5)


def test_top_k_order_on_a_shipped_multi_label_module(live, minilm, modules):
    labels = modules["emotion"].head.labels
    got = answers(live, "emotion", EMOTION_TEXTS, top_k=5)
    for logits, answer in zip(head_logits(minilm, modules["emotion"], EMOTION_TEXTS), got):
        probs = 1 / (1 + np.exp(-logits.astype(np.float64)))
        expected = sorted(range(len(labels)), key=lambda i: -probs[i])[:5]
        assert list(answer["scores"]) == [labels[i] for i in expected]
        assert list(answer["scores"].values()) == pytest.approx([probs[i] for i in expected], abs=1e-5)
    one = answers(live, "sentiment", SENTIMENT_TEXTS, top_k=1)
    full = answers(live, "sentiment", SENTIMENT_TEXTS)
    assert [list(a["scores"]) for a in one] == [[a["label"]] for a in full]
    many = answers(live, "sentiment", SENTIMENT_TEXTS, top_k=50)  # more than the task has: all, best first
    assert [sorted(a["scores"].items(), key=lambda kv: -kv[1]) for a in full] == [list(a["scores"].items()) for a in many]


def test_top_k_ties_keep_label_order():
    """Equal scores (hand-made logits: a real head seldom ties exactly) come in label order."""
    labels = ["a", "b", "c", "d"]
    logits = torch.tensor([[1.0, 3.0, 1.0, 3.0], [0.0, 0.0, 0.0, 0.0]])
    batch = type("Rows", (), {"texts": ["x", "y"]})()
    seq = decode(TaskType.sequence_classification, labels, logits, batch, AnswerOptions(top_k=3))
    assert [list(a["scores"]) for a in seq] == [["b", "d", "a"], ["a", "b", "c"]]
    assert [a["label"] for a in seq] == ["b", "a"]  # the first of equal maxima, as without top_k
    multi = decode(TaskType.multi_label_classification, labels, logits, batch, AnswerOptions(top_k=2, threshold=0.5))
    assert [list(a["scores"]) for a in multi] == [["b", "d"], ["a", "b"]]
    assert [a["labels"] for a in multi] == [["a", "b", "c", "d"], ["a", "b", "c", "d"]]  # sigmoid(0) = 0.5 >= 0.5


# ---- multi-label -------------------------------------------------------------------------------------
def test_multi_label_answers_are_the_labels_over_the_threshold(live, minilm, modules):
    module = modules["emotion"]
    labels, shipped = module.head.labels, module.manifest.decoding["thresholds"]
    assert module.manifest.task_type == TaskType.multi_label_classification and set(shipped) == set(labels)
    logits = head_logits(minilm, module, EMOTION_TEXTS)
    for threshold in (None, 0.05, 0.3):
        controls = {} if threshold is None else {"threshold": threshold}
        for text_logits, answer in zip(logits, answers(live, "emotion", EMOTION_TEXTS, **controls)):
            assert set(answer) == {"labels", "scores"} and list(answer["scores"]) == labels
            probs = 1 / (1 + np.exp(-text_logits.astype(np.float64)))
            assert [answer["scores"][l] for l in labels] == pytest.approx(probs.tolist(), abs=1e-5)
            cut = {l: shipped[l] if threshold is None else threshold for l in labels}
            assert answer["labels"] == [l for l in labels if answer["scores"][l] >= cut[l]]
    low = answers(live, "emotion", EMOTION_TEXTS, threshold=0.05)
    high = answers(live, "emotion", EMOTION_TEXTS, threshold=0.3)
    assert sum(map(len, (a["labels"] for a in low))) > sum(map(len, (a["labels"] for a in high)))
    raw = answers(live, "emotion", EMOTION_TEXTS, raw_scores=True)
    for text_logits, r, d in zip(logits, raw, answers(live, "emotion", EMOTION_TEXTS)):
        assert [r["scores"][l] for l in labels] == pytest.approx(text_logits.tolist(), abs=1e-4)
        assert r["labels"] == d["labels"]


# ---- token tasks: aggregation ----------------------------------------------------------------------
def hand_entities(minilm, module, text: str, strategy: str) -> list[dict]:
    """Entities by Hugging Face's definitions of first/average/max, from the head's logits, tagged
    under the BIO rules."""
    labels = module.head.labels
    encoded = minilm.encode([text])[0]
    logits = head_logits(minilm, module, [text])[0][:len(encoded)].astype(np.float64)
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    words: dict[int, list[int]] = {}
    for t, (seq, word) in enumerate(zip(encoded.sequence_ids, encoded.word_ids)):
        if seq == 0 and word is not None:
            words.setdefault(word, []).append(t)
    vectors, spans = [], []
    for pieces in words.values():
        if strategy == "first":
            vector = probs[pieces[0]]
        elif strategy == "average":
            vector = probs[pieces].mean(0)
        else:  # max: the piece whose best probability is highest
            vector = probs[max(pieces, key=lambda t: probs[t].max())]
        vectors.append(vector)
        spans.append((encoded.offsets[pieces[0]][0], max(encoded.offsets[t][1] for t in pieces)))
    chosen = reference_tags(labels, [v.tolist() for v in vectors])  # the BIO rules: no I-X after O
    tags = [labels[c] for c in chosen]
    scores = [float(v[c]) for v, c in zip(vectors, chosen)]
    return [{"text": text[spans[a][0]:spans[b][1]], "label": kind, "start": spans[a][0], "end": spans[b][1],
             "score": sum(scores[a:b + 1]) / (b + 1 - a)} for kind, a, b in entity_spans(tags)]


def test_aggregation_strategies_match_hand_computation(live, minilm, modules):
    encoded = minilm.encode(NER_TEXTS)
    pieces_per_word = [np.bincount([w for s, w in zip(e.sequence_ids, e.word_ids) if s == 0]) for e in encoded]
    assert max(int(c.max()) for c in pieces_per_word) >= 3  # words split into several pieces are in the sample
    differs = False
    for strategy in ("first", "average", "max"):
        got = answers(live, "ner", NER_TEXTS, aggregation=strategy)
        for text, answer in zip(NER_TEXTS, got):
            expected = hand_entities(minilm, modules["ner"], text, strategy)
            assert [(e["text"], e["label"], e["start"], e["end"]) for e in answer["entities"]] == \
                   [(e["text"], e["label"], e["start"], e["end"]) for e in expected]
            assert [e["score"] for e in answer["entities"]] == pytest.approx([e["score"] for e in expected], abs=1e-5)
            if strategy != "first":
                differs |= expected != hand_entities(minilm, modules["ner"], text, "first")
    assert differs  # the sample tells the strategies apart
    assert answers(live, "ner", NER_TEXTS) == answers(live, "ner", NER_TEXTS, aggregation="first")


def test_aggregation_none_lists_every_piece(live, minilm, modules):
    labels = modules["ner"].head.labels
    got = answers(live, "ner", NER_TEXTS, aggregation="none")
    for text, enc, logits, answer in zip(NER_TEXTS, minilm.encode(NER_TEXTS), head_logits(minilm, modules["ner"], NER_TEXTS),
                                         got):
        real = [t for t, s in enumerate(enc.sequence_ids) if s == 0]
        assert set(answer) == {"tokens"} and len(answer["tokens"]) == len(real)
        for t, piece in zip(real, answer["tokens"]):
            start, end = enc.offsets[t]
            row = logits[t].astype(np.float64)
            probs = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
            assert (piece["start"], piece["end"], piece["text"]) == (start, end, text[start:end])
            assert piece["label"] == labels[int(probs.argmax())]
            assert piece["score"] == pytest.approx(float(probs.max()), abs=1e-5)


# ---- truncation direction ----------------------------------------------------------------------------
def test_left_truncation_keeps_the_end_of_the_text(live, minilm):
    text = " ".join(f"word{i}" for i in range(400)) + " Angela Merkel visited Paris."
    full = minilm.text.tokenizer(text, return_offsets_mapping=True)  # the whole text, by the tokenizer itself
    assert len(full["input_ids"]) > minilm.max_tokens
    body = {"inputs": [text], "truncate": True, "aggregation": "none"}
    left = httpx.post(live.url + "/v1/infer", params={"tasks": "ner"}, json={**body, "truncation_direction": "left"},
                      timeout=120).json()
    right = httpx.post(live.url + "/v1/infer", params={"tasks": "ner"}, json=body, timeout=120).json()
    assert left["truncated"] == right["truncated"] == [0]
    real = [t for t, s in enumerate(full.sequence_ids()) if s == 0]
    offsets = lambda answer: [(p["start"], p["end"]) for p in answer["results"][0]["ner"]["tokens"]]  # noqa: E731
    kept = len(offsets(right))  # the text's pieces in one window (the server's window, less [CLS] and [SEP])
    assert 100 <= kept < len(real)
    assert offsets(left) == [tuple(full["offset_mapping"][t]) for t in real[-kept:]]
    assert offsets(left)[-1][1] == len(text)
    assert offsets(right) == [tuple(full["offset_mapping"][t]) for t in real[:kept]]
    found = {direction: {e["text"] for e in httpx.post(
        live.url + "/v1/infer", params={"tasks": "ner"}, timeout=120,
        json={"inputs": [text], "truncate": True, "truncation_direction": direction}).json()["results"][0]["ner"]["entities"]}
        for direction in ("left", "right")}
    assert "Paris" in found["left"] and "Paris" not in found["right"]  # the end of the text is read only from the left


# ---- validation --------------------------------------------------------------------------------------
@pytest.mark.parametrize("controls", [
    {"top_k": 0}, {"top_k": -2}, {"top_k": "3"}, {"top_k": 2.5}, {"threshold": 1.5}, {"threshold": -0.1},
    {"threshold": "high"}, {"aggregation": "mean"}, {"truncation_direction": "up"}, {"raw_scores": "yes"},
])
def test_invalid_controls_answer_422(live, controls):
    response = infer(live, "sentiment", SENTIMENT_TEXTS, **controls)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["type"] == "invalid_request" and next(iter(controls)) in error["message"]
    oip = httpx.post(live.url + "/v2/models/sentiment/infer", timeout=60, json={
        "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": SENTIMENT_TEXTS[:1]}],
        "parameters": controls})
    assert oip.status_code == 422 and next(iter(controls)) in oip.json()["error"]  # OIP: the message in "error"


# ---- OIP v2: parameters and the classification extension ----------------------------------------------
def test_server_metadata_lists_classification(live):
    assert "classification" in httpx.get(live.url + "/v2").json()["extensions"]


def parse_classes(values) -> list[tuple[float, int, str]]:
    out = []
    for item in values:
        score, index, label = (item.decode() if isinstance(item, bytes) else item).split(":", 2)
        out.append((float(score), int(index), label))
    return out


@pytest.mark.parametrize("task,k", [("sentiment", 2), ("emotion", 3)])
def test_tritonclient_class_count(live, task, k):
    tritonclient_http = pytest.importorskip("tritonclient.http")
    texts = SENTIMENT_TEXTS if task == "sentiment" else EMOTION_TEXTS
    client = tritonclient_http.InferenceServerClient(url=live.url.removeprefix("http://"))
    tensor = tritonclient_http.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    labels = client.get_model_metadata(task)["parameters"]["labels"]
    result = client.infer(task, [tensor], outputs=[tritonclient_http.InferRequestedOutput("scores", class_count=k)])
    classes = result.as_numpy("scores")
    assert classes.shape == (len(texts), k)
    for row, answer in zip(classes, answers(live, task, texts)):
        expected = sorted(range(len(labels)), key=lambda i: -answer["scores"][labels[i]])[:k]
        got = parse_classes(row)
        assert [(i, label) for _, i, label in got] == [(i, labels[i]) for i in expected]
        assert [s for s, _, _ in got] == pytest.approx([answer["scores"][labels[i]] for i in expected], abs=1e-6)


def test_oip_parameters(live, minilm, modules):
    def oip(task, texts, parameters, outputs=None):
        body = {"inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": texts}],
                "parameters": parameters, **({"outputs": outputs} if outputs else {})}
        response = httpx.post(live.url + f"/v2/models/{task}/infer", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return {o["name"]: o for o in response.json()["outputs"]}

    labels = modules["sentiment"].head.labels
    raw = oip("sentiment", SENTIMENT_TEXTS, {"raw_scores": True})
    logits = head_logits(minilm, modules["sentiment"], SENTIMENT_TEXTS)
    assert raw["scores"]["data"] == pytest.approx(np.concatenate(logits).tolist(), abs=1e-4)
    top = oip("sentiment", SENTIMENT_TEXTS, {"top_k": 1})  # top_k: `scores` in the classification form
    assert top["scores"]["datatype"] == "BYTES" and top["scores"]["shape"] == [2, 1]
    assert [parse_classes([v])[0][2] for v in top["scores"]["data"]] == [labels[int(np.argmax(l))] for l in logits]
    emotion = oip("emotion", EMOTION_TEXTS, {"threshold": 0.1})
    v1 = answers(live, "emotion", EMOTION_TEXTS, threshold=0.1)
    assert [json.loads(v) for v in emotion["labels"]["data"]] == [a["labels"] for a in v1]
    ner = oip("ner", NER_TEXTS[:1], {"aggregation": "max"})
    assert json.loads(ner["entities"]["data"][0]) == answers(live, "ner", NER_TEXTS[:1], aggregation="max")[0]["entities"]
    bad = httpx.post(live.url + "/v2/models/sentiment/infer", timeout=60, json={
        "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": SENTIMENT_TEXTS[:1]}],
        "outputs": [{"name": "label", "parameters": {"classification": 2}}]})
    assert bad.status_code == 400 and "classification" in bad.json()["error"]
    zero = httpx.post(live.url + "/v2/models/sentiment/infer", timeout=60, json={
        "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": SENTIMENT_TEXTS[:1]}],
        "outputs": [{"name": "scores", "parameters": {"classification": 0}}]})
    assert zero.status_code == 400


# ---- defaults unchanged ------------------------------------------------------------------------------
# The fixture was recorded on another CPU (an Intel Xeon, AVX-512). Largest score difference measured
# against it, fp32 (`SERVER_ARGS`), MiniLM tier: 1.73e-6 on an AMD EPYC through its AVX-512 kernels,
# 1.01e-6 on the same EPYC sent down the AVX2 paths (ATEN_CPU_CAPABILITY=avx2,
# ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2), 1.13e-6 between those two runs
# (docs/hardening.md#tolerances-across-cpus). Scores within 1e-5, about 6x the largest; labels, texts
# and offsets exactly.
SCORE_TOLERANCE = 1e-5


def assert_same(recorded, now, where="answer"):
    """Equal structure, labels, texts and offsets; floats within SCORE_TOLERANCE. A string holding JSON
    (OIP's BYTES outputs: entities as a JSON list) is compared as what it holds."""
    if isinstance(recorded, float) or isinstance(now, float):
        assert math.isclose(recorded, now, rel_tol=0, abs_tol=SCORE_TOLERANCE), f"{where}: {recorded} != {now}"
    elif isinstance(recorded, dict):
        assert list(recorded) == list(now), f"{where}: keys {list(recorded)} != {list(now)}"
        for key in recorded:
            assert_same(recorded[key], now[key], f"{where}.{key}")
    elif isinstance(recorded, list):
        assert len(recorded) == len(now), f"{where}: {len(recorded)} items != {len(now)}"
        for i, (a, b) in enumerate(zip(recorded, now)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(recorded, str) and recorded.startswith(("[", "{")) and isinstance(now, str):
        assert_same(json.loads(recorded), json.loads(now), f"{where}(json)")
    else:
        assert recorded == now, f"{where}: {recorded!r} != {now!r}"


@pytest.mark.smoke
def test_assert_same_holds_labels_exactly_and_scores_within_the_tolerance():
    entity = {"text": "Kraków", "label": "LOC", "start": 25, "end": 31, "score": 0.9}
    assert_same([json.dumps([entity])], [json.dumps([{**entity, "score": 0.9 + SCORE_TOLERANCE / 2}])])
    for changed in ({"label": "ORG"}, {"end": 30}, {"score": 0.9 + SCORE_TOLERANCE * 2}):
        with pytest.raises(AssertionError):
            assert_same([json.dumps([entity])], [json.dumps([{**entity, **changed}])])


@pytest.mark.parametrize("tier", [pytest.param("minilm", marks=pytest.mark.smoke),
                                  pytest.param("mpnet", marks=pytest.mark.slow)])
def test_default_answers_unchanged(tier, tmp_path):
    recorded = json.loads(default_answers.FIXTURE.read_text())[tier]
    store = default_answers.recorded_store(tier, tmp_path / "store")
    url, process = start_tmod_serve([*default_answers.TIERS[tier], *default_answers.SERVER_ARGS, "--store", str(store)],
                                    {**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        now = default_answers.answers(url)
    finally:
        process.terminate()
        process.wait(timeout=60)
    for before, after in zip(recorded, now):
        assert before["path"] == after["path"]
        assert_same(before["answer"], after["answer"], before["path"])


# ---- worker processes --------------------------------------------------------------------------------
@pytest.mark.slow
def test_controls_in_worker_mode(minilm, modules):
    """With --workers 2 the workers decode: the same controls give the same answers as one process."""
    url, process = start_tmod_serve(["--workers", "2", "--precision", "fp32", "--head-precision", "fp32",
                                     "--tasks", "sentiment,ner,emotion"], {**os.environ, "HF_HUB_OFFLINE": "1"})
    server = type("Url", (), {"url": url})()
    try:
        labels = modules["sentiment"].head.labels
        raw = answers(server, "sentiment", SENTIMENT_TEXTS, raw_scores=True, top_k=1)
        for logits, answer in zip(head_logits(minilm, modules["sentiment"], SENTIMENT_TEXTS), raw):
            assert list(answer["scores"]) == [labels[int(np.argmax(logits))]]
            assert answer["score"] == pytest.approx(float(logits.max()), abs=1e-4)
        for strategy in ("average", "max"):
            for text, answer in zip(NER_TEXTS, answers(server, "ner", NER_TEXTS, aggregation=strategy)):
                expected = hand_entities(minilm, modules["ner"], text, strategy)
                assert [(e["text"], e["label"]) for e in answer["entities"]] == [(e["text"], e["label"]) for e in expected]
        for answer in answers(server, "emotion", EMOTION_TEXTS, threshold=0.2):
            assert answer["labels"] == [l for l in modules["emotion"].head.labels if answer["scores"][l] >= 0.2]
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_manifest_names_the_default_aggregation(minilm, modules):
    """A manifest's `decoding.aggregation` is the default; a request's own aggregation overrides it."""
    module = modules["ner"]
    batch = minilm.tokenize(NER_TEXTS)
    logits = Engine(minilm).logits(batch, {"ner": module})["ner"]
    labels = module.head.labels
    by_manifest = decode(TaskType.token_classification, labels, logits, batch, None, {"aggregation": "max"})
    assert by_manifest == decode(TaskType.token_classification, labels, logits, batch, AnswerOptions(aggregation="max"))
    per_row = decode(TaskType.token_classification, labels, logits, batch,
                     [AnswerOptions(aggregation="first"), None], {"aggregation": "max"})
    assert per_row == [decode(TaskType.token_classification, labels, logits, batch)[0], by_manifest[1]]


def test_left_truncation_of_pairs_answers_422(live):
    pair = {"text": "A cat sat on the mat.", "text_pair": "A cat was on a mat."}
    response = httpx.post(live.url + "/v1/infer", params={"tasks": "entailment"}, timeout=60,
                          json={"inputs": [pair], "truncate": True, "truncation_direction": "left"})
    assert response.status_code == 422 and "single texts" in response.json()["error"]["message"]
