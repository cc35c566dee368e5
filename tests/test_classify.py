"""vLLM's classification API (`POST /classify`, SGLang's `/v1/classify`) over a real server on
loopback: the body vLLM's own example client sends, answered with the same labels and
probabilities as /v1/infer, errors in OpenAI's shape."""
from __future__ import annotations

import httpx
import pytest

from server.api.app import create_app
from server.config import Settings
from tests.helpers import LiveServer

TEXTS = ["A wonderful, moving film.", "Peter flew to Brussels.", "bad"]


@pytest.fixture(scope="module")
def live(tiny_store, tiny_backbone):
    settings = Settings(store=tiny_store.root, head_precision="fp32")  # compared with /v1/infer: fp32 heads
    with LiveServer(create_app(settings, backbone=tiny_backbone)) as server:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            yield client


@pytest.mark.parametrize("path", ["/classify", "/v1/classify"])
def test_answers_as_v1_infer_does_in_vllms_shape(live, path):
    answer = live.post(path, json={"model": "sentiment", "input": TEXTS})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "list" and body["model"] == "sentiment" and body["id"].startswith("classify-")
    assert isinstance(body["created"], int) and body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    labels = live.get("/v1/tasks/sentiment").json()["labels"]
    expected = live.post("/v1/infer?tasks=sentiment", json={"inputs": TEXTS}).json()["results"]
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    for data, result in zip(body["data"], expected):
        assert data["label"] == result["sentiment"]["label"] and data["num_classes"] == len(labels)
        assert data["probs"] == pytest.approx([result["sentiment"]["scores"][label] for label in labels], abs=1e-5)
        assert sum(data["probs"]) == pytest.approx(1.0, abs=1e-5)
    one = live.post(path, json={"model": "acceptability", "input": TEXTS[0], "user": "someone"}).json()
    assert len(one["data"]) == 1 and one["model"] == "acceptability"


def test_what_it_does_not_answer_is_refused_in_openais_shape(live):
    def refused(body, status, code):
        answer = live.post("/classify", json=body)
        assert answer.status_code == status, answer.text
        error = answer.json()["error"]
        assert error["code"] == code and error["type"] == "invalid_request_error"
        return error

    error = refused({"model": "ner", "input": TEXTS}, 400, "unsupported_model")
    assert "'ner' is a token task" in error["message"] and "/v1/infer?tasks=ner" in error["message"]
    assert error["param"] == "model"
    assert "acceptability" in refused({"model": "nope", "input": TEXTS}, 404, "model_not_found")["message"]
    error = refused({"input": TEXTS}, 400, "invalid_request")  # two classifiers loaded: name one
    assert "'model': one of ['acceptability', 'sentiment']" in error["message"]
    refused({"model": "sentiment", "input": [[101, 2054]]}, 400, "invalid_request")  # token arrays
    refused({"model": "sentiment", "inputs": TEXTS}, 400, "invalid_request")  # /v1/infer's field name
    assert live.get("/classify").status_code == 405


def test_teis_predict_answers_one_classifier_best_first(live):
    """Text Embeddings Inference's /predict, as a TEI client sends it: one text, a [text, text_pair]
    pair or a batch of lists; the labels best first with /v1/infer's probabilities (or logits with
    raw_scores); the task named with ?tasks= where several read such inputs; errors in TEI's shape."""
    expected = live.post("/v1/infer?tasks=sentiment", json={"inputs": TEXTS}).json()["results"]

    def ranked(result):
        return sorted(result["sentiment"]["scores"].items(), key=lambda item: -item[1])

    one = live.post("/predict?tasks=sentiment", json={"inputs": TEXTS[0]})
    assert one.status_code == 200, one.text
    assert [p["label"] for p in one.json()] == [label for label, _ in ranked(expected[0])]
    assert [p["score"] for p in one.json()] == pytest.approx([p for _, p in ranked(expected[0])], abs=1e-5)
    batch = live.post("/predict?tasks=sentiment", json={"inputs": [[text] for text in TEXTS]}).json()
    assert [[p["label"] for p in row] for row in batch] == [[label for label, _ in ranked(e)] for e in expected]
    raw = live.post("/predict?tasks=sentiment", json={"inputs": TEXTS[0], "raw_scores": True}).json()
    assert [p["label"] for p in raw] == [p["label"] for p in one.json()]  # logits order labels as probabilities do
    assert sum(p["score"] for p in raw) != pytest.approx(1.0, abs=1e-3)
    cut = live.post("/predict?tasks=sentiment", json={"inputs": TEXTS[0], "truncate": True,
                                                       "truncation_direction": "Left"})  # TEI's field, TEI's spelling
    assert cut.status_code == 200, cut.text  # a short text: nothing cut
    assert [(p["label"], pytest.approx(p["score"], abs=1e-5)) for p in one.json()] == \
        [(p["label"], p["score"]) for p in cut.json()]

    def refused(path, body, said):
        answer = live.post(path, json=body)
        assert answer.status_code in (400, 422) and set(answer.json()) == {"error", "error_type"}, answer.text
        assert said in answer.json()["error"], answer.text

    refused("/predict", {"inputs": TEXTS[0]}, "2 are loaded (['acceptability', 'sentiment']): name one, "
                                              "/predict?tasks=acceptability")
    refused("/predict?task=sentiment", {"inputs": TEXTS[0]}, "did you mean 'tasks'")
    refused("/predict", {"inputs": ["a text", "its pair"]}, "on text pairs, and none is loaded")
    refused("/predict?tasks=sentiment", {"inputs": ["a", "b", "c"]}, "a list of strings is one pair")
    refused("/predict?tasks=sentiment", {"inputs": [["a"], ["b", "c"]]}, "a batch of texts and text pairs")
    refused("/predict?tasks=sentiment", {"inputs": []}, "inputs is empty")
    assert live.get("/predict").status_code == 405


def test_hugging_faces_inference_client_classifies_through_teis_predict(live, monkeypatch):
    """`huggingface_hub.InferenceClient.text_classification` posts to /predict with Hugging Face's
    `parameters` (which TEI ignores, and which were refused here as an unknown field): read here, and
    answered in Hugging Face's shape so that the client returns every label, best first."""
    import huggingface_hub
    from huggingface_hub import InferenceClient

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # (set for every test) this one is local
    client = InferenceClient(model=str(live.base_url) + "/predict?tasks=sentiment")
    expected = live.post("/v1/infer?tasks=sentiment", json={"inputs": TEXTS[:1]}).json()["results"][0]["sentiment"]
    labels = client.text_classification(TEXTS[0])
    assert [p.label for p in labels] == sorted(expected["scores"], key=lambda label: -expected["scores"][label])
    assert [p.score for p in labels] == pytest.approx(sorted(expected["scores"].values(), reverse=True), abs=1e-5)
    assert [p.label for p in client.text_classification(TEXTS[0], top_k=1)] == [expected["label"]]
    assert client.text_classification(TEXTS[0], function_to_apply="softmax") == labels
    logits = live.post("/predict?tasks=sentiment", json={"inputs": TEXTS[0], "raw_scores": True}).json()
    assert [(p.label, p.score) for p in client.text_classification(TEXTS[0], function_to_apply="none")] == \
        [(p["label"], pytest.approx(p["score"], abs=1e-4)) for p in logits]
    with pytest.raises(huggingface_hub.errors.HfHubHTTPError, match="'sentiment' is a single-label task and answers "
                                                                    "softmax probabilities; 'none' gives its logits"):
        client.text_classification(TEXTS[0], function_to_apply="sigmoid")
    for parameters, said in [({"top_k": 0}, "parameters.top_k"), ({"topk": 1}, "unknown field `topk`"),
                             ({"function_to_apply": "softmax"}, None)]:
        answer = live.post("/predict?tasks=sentiment", json={"inputs": TEXTS[0], "raw_scores": True,
                                                              "parameters": parameters})
        assert answer.status_code == 422 and set(answer.json()) == {"error", "error_type"}, answer.text
        assert said is None or said in answer.json()["error"]


def test_hugging_faces_inference_client_classifies_at_teis_root(live, monkeypatch):
    """Given the server's URL as its model, `InferenceClient.text_classification` posts to TEI's root
    with Hugging Face's `parameters`: that body is a classification request (it was embedded, and refused
    for the unknown field), answered as /predict answers it; ?tasks= names the task there too."""
    import huggingface_hub
    from huggingface_hub import InferenceClient

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # (set for every test) this one is local
    client = InferenceClient(model=str(live.base_url) + "/?tasks=sentiment")
    assert client.text_classification(TEXTS[0]) == \
        InferenceClient(model=str(live.base_url) + "/predict?tasks=sentiment").text_classification(TEXTS[0])
    with pytest.raises(huggingface_hub.errors.HfHubHTTPError, match="2 are loaded"):  # acceptability, sentiment
        InferenceClient(model=str(live.base_url)).text_classification(TEXTS[0])
    answer = live.post("/", json={"inputs": TEXTS[0], "parameters": {"top_k": 0}})
    assert answer.status_code == 422 and "parameters.top_k" in answer.json()["error"], answer.text
    assert len(live.post("/", json={"inputs": TEXTS[:2]}).json()) == 2  # no parameters: embedded, as before


def test_hugging_faces_inference_client_tags_tokens_through_teis_predict(live, monkeypatch):
    """`InferenceClient.token_classification`, given the server's URL with ?tasks=<token task>, posts to
    TEI's root with Hugging Face's token-classification parameters (refused before: /predict named only
    classifiers): answered in Hugging Face's shape from the same entities and word pieces as /v1/infer's,
    aggregation_strategy read as tmod's aggregation, ignore_labels honoured; what does not apply refused."""
    import huggingface_hub
    from huggingface_hub import InferenceClient

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # (set for every test) this one is local
    client = InferenceClient(model=str(live.base_url) + "/?tasks=ner")

    def infer(aggregation=None):
        body = {"inputs": TEXTS, **({"aggregation": aggregation} if aggregation else {})}
        return [r["ner"] for r in live.post("/v1/infer?tasks=ner", json=body).json()["results"]]

    for strategy, aggregation in ((None, None), ("simple", None), ("first", "first"), ("max", "max")):
        for text, expected in zip(TEXTS, infer(aggregation)):
            found = client.token_classification(text, aggregation_strategy=strategy)
            assert [(e.entity_group, e.word, e.start, e.end) for e in found] == \
                [(e["label"], e["text"], e["start"], e["end"]) for e in expected["entities"]]
            assert [e.score for e in found] == pytest.approx([e["score"] for e in expected["entities"]], abs=1e-5)
    pieces = infer("none")
    for text, expected in zip(TEXTS, pieces):
        found = client.token_classification(text, aggregation_strategy="none", ignore_labels=[])
        assert [(p.entity, p.word, p.start, p.end) for p in found] == \
            [(p["label"], p["text"], p["start"], p["end"]) for p in expected["tokens"]]
        kept = client.token_classification(text, aggregation_strategy="none")  # Hugging Face's default: without O
        assert [p.entity for p in kept] == [p["label"] for p in expected["tokens"] if p["label"] != "O"]
    assert sum(len(p["tokens"]) for p in pieces) > 0
    batch = live.post("/predict?tasks=ner", json={"inputs": [[t] for t in TEXTS]}).json()  # TEI's body: the same
    assert [[e["entity_group"] for e in found] for found in batch] == \
        [[e["label"] for e in expected["entities"]] for expected in infer()]
    for body, said in [({"inputs": "a", "parameters": {"stride": 16}}, "leave stride out"),
                       ({"inputs": "a", "parameters": {"top_k": 1}}, "parameters.top_k is text classification's"),
                       ({"inputs": "a", "raw_scores": True}, "raw_scores is text classification's"),
                       ({"inputs": ["a", "b"]}, "'ner' is no classification task on text pairs")]:
        answer = live.post("/predict?tasks=ner", json=body)
        assert answer.status_code in (400, 422) and said in answer.json()["error"], answer.text
    # and the other way round: token classification's parameters to a classifier
    answer = live.post("/?tasks=sentiment", json={"inputs": "a", "parameters": {"aggregation_strategy": "max"}})
    assert answer.status_code == 422 and "parameters.aggregation_strategy is token classification's: " \
        "'sentiment' classifies whole texts" in answer.json()["error"], answer.text
