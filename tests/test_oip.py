"""Open Inference Protocol v2: the official tritonclient calls tmod tasks over loopback."""
from __future__ import annotations

import importlib.metadata
import json
import shutil

import httpx
import numpy as np
import pytest

from server.api.app import create_app
from server.config import Settings
from tests.helpers import LiveServer

tritonclient_http = pytest.importorskip("tritonclient.http")
TEXTS = ["Peter Blackburn met Angela Merkel in Brussels.", "A dull film."]


@pytest.fixture(scope="module")
def live(tiny_store, tiny_backbone):
    settings = Settings(store=tiny_store.root, max_inputs=8, head_precision="fp32")  # answers compared across paths: fp32 heads (16-bit heads round differently when grouped)
    with LiveServer(create_app(settings, backbone=tiny_backbone)) as server:
        yield server


@pytest.fixture(scope="module")
def v1_answers(live):
    body = httpx.post(live.url + "/v1/infer", params={"tasks": "sentiment,ner"}, json={"inputs": TEXTS}).json()
    return body["results"]


def texts_input(values, binary):
    tensor = tritonclient_http.InferInput("text", [len(values)], "BYTES")
    tensor.set_data_from_numpy(np.array([v.encode() for v in values], dtype=object), binary_data=binary)
    return tensor


@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_sequence_task(live, v1_answers, binary):
    client = tritonclient_http.InferenceServerClient(url=live.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("sentiment")
    metadata = client.get_model_metadata("sentiment")
    assert metadata["name"] == "sentiment" and metadata["inputs"][0]["datatype"] == "BYTES"
    labels = metadata["parameters"]["labels"]
    outputs = [tritonclient_http.InferRequestedOutput(name, binary_data=binary) for name in ("label", "score", "scores")]
    result = client.infer("sentiment", [texts_input(TEXTS, binary)], outputs=outputs)
    assert [l.decode() if isinstance(l, bytes) else l for l in result.as_numpy("label")] == \
           [r["sentiment"]["label"] for r in v1_answers]
    scores = result.as_numpy("scores")
    assert scores.shape == (2, len(labels))
    for row, answer in zip(scores, v1_answers):
        assert row.tolist() == pytest.approx([answer["sentiment"]["scores"][l] for l in labels], abs=1e-5)


@pytest.mark.smoke
def test_tritonclient_token_task_default_outputs(live, v1_answers):
    client = tritonclient_http.InferenceServerClient(url=live.url.removeprefix("http://"))
    result = client.infer("ner", [texts_input(TEXTS, True)])  # no outputs named: all, binary
    entities = [json.loads(item) for item in result.as_numpy("entities")]
    expected = [r["ner"]["entities"] for r in v1_answers]
    spans = lambda rows: [[(e["text"], e["label"], e["start"], e["end"]) for e in row] for row in rows]  # noqa: E731
    assert spans(entities) == spans(expected)
    for row, expected_row in zip(entities, expected):  # scores: same values up to float rounding
        assert [e["score"] for e in row] == pytest.approx([e["score"] for e in expected_row], abs=1e-5)


@pytest.mark.parametrize("binary", [True, False])
def test_texts_sent_as_a_row_come_back_as_a_row(live, v1_answers, binary):
    """Texts in a [1, N] tensor (as a client built for batched Triton models sends them) are read in
    order, and every output leads with [1, N], so that `as_numpy` gives each text's answer where its
    text was: labels [1, N], scores [1, N, C], the classification extension [1, N, k]."""
    client = tritonclient_http.InferenceServerClient(url=live.url.removeprefix("http://"))
    tensor = tritonclient_http.InferInput("text", [1, len(TEXTS)], "BYTES")
    tensor.set_data_from_numpy(np.array([[t.encode() for t in TEXTS]], dtype=object), binary_data=binary)
    outputs = [tritonclient_http.InferRequestedOutput("label", binary_data=binary),
               tritonclient_http.InferRequestedOutput("scores", binary_data=binary),
               tritonclient_http.InferRequestedOutput("scores", binary_data=binary, class_count=1)]
    result = client.infer("sentiment", [tensor], outputs=outputs[:2])
    labels = client.get_model_metadata("sentiment")["parameters"]["labels"]
    assert result.as_numpy("label").shape == (1, len(TEXTS))
    assert [l.decode() if isinstance(l, bytes) else l for l in result.as_numpy("label")[0]] == \
           [r["sentiment"]["label"] for r in v1_answers]
    assert result.as_numpy("scores").shape == (1, len(TEXTS), len(labels))
    top = client.infer("sentiment", [tensor], outputs=outputs[2:]).as_numpy("scores")
    assert top.shape == (1, len(TEXTS), 1)
    ner = client.infer("ner", [tensor]).as_numpy("entities")
    assert ner.shape == (1, len(TEXTS))


@pytest.mark.smoke
def test_v2_errors(live):
    client = tritonclient_http.InferenceServerClient(url=live.url.removeprefix("http://"))
    with pytest.raises(tritonclient_http.InferenceServerException, match="no model 'telepathy'"):
        client.infer("telepathy", [texts_input(["x"], False)])
    bad = [
        {"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": ["only one"]}]},
        {"inputs": [{"name": "image", "shape": [1], "datatype": "FP32", "data": [1.0]}]},
        {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [""]}]},
        {"inputs": [{"name": "text", "shape": [0], "datatype": "BYTES", "data": []}]},
        {"inputs": []},
    ]
    for body in bad:
        response = httpx.post(live.url + "/v2/models/sentiment/infer", json=body)
        assert response.status_code in (400, 422), body
        assert isinstance(response.json()["error"], str) and response.json()["type"] == "invalid_request"
    response = httpx.post(live.url + "/v2/models/sentiment/infer", content=b"{\"inputs\": [1]",
                          headers={"inference-header-content-length": "99999"})
    assert response.status_code == 400 and "inference-header-content-length" in response.json()["error"]
    assert httpx.get(live.url + "/v2/models/sentiment/versions/7").status_code == 404
    # a Triton user's slips: the input's name cased, a datatype named STRING or left out
    for tensor, expected in [
        ({"name": "TEXT", "datatype": "BYTES"}, "unknown input 'TEXT' (did you mean 'text' for 'TEXT'?); inputs are "
                                                "'text' and, for a pair task, 'text_pair' (GET /v2/models/<task>)"),
        ({"name": "text", "datatype": "STRING"}, "input 'text' must have datatype BYTES (got 'STRING'; BYTES is the "
                                                 "protocol's type for strings)"),
        ({"name": "text"}, "input 'text' must have datatype BYTES (none given; BYTES is the protocol's type for strings)"),
    ]:
        body = {"inputs": [{**tensor, "shape": [1], "data": ["A dull film."]}]}
        response = httpx.post(live.url + "/v2/models/sentiment/infer", json=body)
        assert response.status_code == 400 and response.json()["error"] == expected
    # a request parameter spelt near one tmod reads was ignored (every label answered for `topk`); one of
    # another server's (Triton's `priority`) is let pass
    text = {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["A dull film."]}
    response = httpx.post(live.url + "/v2/models/sentiment/infer", json={"inputs": [text], "parameters": {"topk": 1}})
    assert response.status_code == 400 and response.json()["error"].startswith(
        "unknown request parameter (did you mean 'top_k' for 'topk'?): the request parameters read are ["), response.text
    response = httpx.post(live.url + "/v2/models/sentiment/infer", json={"inputs": [text], "parameters": {"priority": 1}})
    assert response.status_code == 200, response.text


def test_tritonclient_reads_model_configs_and_the_repository_index(live):
    """Triton's model configuration extension and repository index, as tritonclient (and tools built on
    it) ask for them: each was 404."""
    client = tritonclient_http.InferenceServerClient(url=live.url.removeprefix("http://"))
    metadata = client.get_server_metadata()
    assert "model_configuration" in metadata["extensions"]
    # the installed version (it was written twice: pyproject.toml and the app)
    assert metadata["version"] == importlib.metadata.version("tmod") == httpx.get(live.url + "/openapi.json").json()["info"]["version"]
    for task in ("sentiment", "ner"):
        metadata, config = client.get_model_metadata(task), client.get_model_config(task)
        assert config["name"] == task and config["max_batch_size"] == 0  # the batch is the tensors' own [-1]
        assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"] + config["output"]] == [
            (t["name"], {"BYTES": "TYPE_STRING", "FP32": "TYPE_FP32"}[t["datatype"]], t["shape"])
            for t in metadata["inputs"] + metadata["outputs"]]
        assert json.loads(config["parameters"]["labels"]["string_value"]) == metadata["parameters"]["labels"]
        assert client.get_model_config(task, metadata["versions"][0]) == config
    with pytest.raises(tritonclient_http.InferenceServerException, match="no model 'telepathy'"):
        client.get_model_config("telepathy")
    served = {task["task"]: task["version"] for task in httpx.get(live.url + "/v1/tasks").json()["tasks"]}
    index = client.get_model_repository_index()
    assert index == [{"name": name, "version": version, "state": "READY", "reason": ""}
                     for name, version in sorted(served.items())]
    response = httpx.post(live.url + "/v2/repository/index", json={"ready": "yes"})
    assert response.status_code == 422 and response.json()["type"] == "invalid_request"


def test_triton_statistics_are_refused_saying_where_the_counts_are(live):
    """tritonclient's get_inference_statistics (Triton's statistics extension, not served: per-model
    batch counts do not exist where one pass serves every task) is told where tmod's counts are, not a
    bare 404 or, for all models, "no model 'stats'"."""
    client = tritonclient_http.InferenceServerClient(url=live.url.removeprefix("http://"))
    assert "statistics" not in client.get_server_metadata()["extensions"]
    for model, version in (("", ""), ("sentiment", ""), ("sentiment", "1")):
        with pytest.raises(tritonclient_http.InferenceServerException,
                           match=r"statistics extension is not served .* GET /metrics \(tmod_task_requests_total"):
            client.get_inference_statistics(model, version)
    assert httpx.get(live.url + "/v2/models/sentiment").status_code == 200  # the model routes are as before


def test_the_repository_index_names_what_the_store_holds_but_does_not_serve(tmp_path, tiny_store, tiny_backbone):
    store = tmp_path / "store"
    shutil.copytree(tiny_store.root, store)
    weights = next((store / "ner").glob("*/weights.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-8])  # a broken artifact: refused at start-up, the others serve
    with LiveServer(create_app(Settings(store=store, tasks="sentiment,ner"), backbone=tiny_backbone)) as server:
        client = tritonclient_http.InferenceServerClient(url=server.url.removeprefix("http://"))
        index = {entry["name"]: entry for entry in client.get_model_repository_index()}
        assert set(index) == set(tiny_store.tasks())  # every task of the store, served or not
        assert index["sentiment"] == {"name": "sentiment", "version": "1", "state": "READY", "reason": ""}
        assert index["ner"]["state"] == "UNAVAILABLE" and "weights" in index["ner"]["reason"]  # refused at load
        assert index["acceptability"]["state"] == "UNAVAILABLE"  # not in --tasks
        assert index["acceptability"]["reason"].startswith("not loaded (not named in --tasks, ")
        assert httpx.post(server.url + "/v2/repository/index", json={"ready": True}).json() == [index["sentiment"]]
