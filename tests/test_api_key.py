"""`TMOD_API_KEY`: every route but health, metrics, the schema, /admin and Triton's repository load /
unload asks for `Authorization: Bearer <key>`, refused 401 in each protocol's shape; the clients of
each protocol pass the key their own way. One real `tmod-serve --workers 2` (the key is checked in the worker processes)."""
from __future__ import annotations

import json
import os
import socket

import httpx
import numpy as np
import pytest

from bench.live_server import read_http_response
from server.heads.embedding import EmbeddingHead
from server.modules import save_module
from tests.helpers import populate_store, start_tmod_serve

KEY, ADMIN, OLD_KEY = "k3y-for-tests", "admin-for-tests", "older-k3y"
TEXTS = ["A fine film.", "Peter flew to Brussels."]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_backbone, tiny_backbone_dir):
    store = populate_store(tmp_path_factory.mktemp("store"), tiny_backbone)
    save_module(store, "embedding", "1", EmbeddingHead.from_backbone(tiny_backbone, tiny_backbone_dir), tiny_backbone)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMOD_API_KEY": f"{KEY}, {OLD_KEY}", "TMOD_ADMIN_TOKEN": ADMIN}
    url, process = start_tmod_serve(["--workers", "2", "--backbone", str(tiny_backbone_dir), "--store", str(store.root),
                                     "--precision", "fp32", "--log-level", "warning"], env)
    yield url
    process.terminate()
    process.wait(timeout=60)


def bearer(token: str) -> dict:
    return {"authorization": f"Bearer {token}"}


@pytest.mark.parametrize("path, body, shape", [
    ("/v1/infer?tasks=sentiment", {"inputs": TEXTS}, "tmod"),
    ("/v1/embeddings", {"input": TEXTS, "model": "embedding"}, "openai"),
    ("/embed", {"inputs": TEXTS}, "tei"),
    ("/v1/tokenize", {"inputs": TEXTS}, "tmod"),
    ("/v2/models/sentiment/infer", {"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": TEXTS}]},
     "oip"),
])
def test_inference_routes_need_the_key_in_their_protocols_shape(served, path, body, shape):
    for headers in ({}, bearer("wrong"), {"authorization": KEY}, bearer(ADMIN)):  # none, wrong, no scheme, admin's
        refused = httpx.post(served + path, json=body, headers=headers)
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer", refused.text
        error = refused.json()
        message = {"tmod": lambda: error["error"]["message"], "openai": lambda: error["error"]["message"],
                   "tei": lambda: error["error"], "oip": lambda: error["error"]}[shape]()
        assert message == "this server needs 'Authorization: Bearer <API key>'"
        if shape == "tei":
            assert error["error_type"] == "Unauthorized"
        if shape == "openai":
            assert error["error"]["code"] == "unauthorized"
    assert httpx.post(served + path, json=body, headers=bearer(KEY)).status_code == 200
    assert httpx.post(served + path, json=body, headers={"authorization": f"bearer  {KEY}"}).status_code == 200


@pytest.mark.parametrize("path", ["/v1/tasks", "/v1/tasks/sentiment", "/v1/models", "/v2", "/v2/models/sentiment",
                                  "/v2/models/sentiment/ready", "/nowhere"])
def test_listings_and_metadata_need_it_too(served, path):
    assert httpx.get(served + path).status_code == 401
    assert httpx.get(served + path, headers=bearer(KEY)).status_code == (404 if path == "/nowhere" else 200)


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/health", "/v2/health/live", "/v2/health/ready",
                                  "/metrics", "/openapi.json", "/docs"])
def test_probes_scrapers_and_the_schema_stay_open(served, path):
    assert httpx.get(served + path).status_code == 200


def test_every_listed_key_is_accepted_as_a_key_rotation_needs(served):
    """TMOD_API_KEY="new, old" accepts either (a rotation: serve both, move the clients, drop the old),
    never the list itself or a part of a key."""
    for key, status in ((KEY, 200), (OLD_KEY, 200), (f"{KEY}, {OLD_KEY}", 401), (f"{KEY},{OLD_KEY}", 401),
                        (KEY[:-1], 401), (",", 401)):
        answer = httpx.post(served + "/v1/infer", json={"inputs": TEXTS}, headers=bearer(key))
        assert answer.status_code == status, (key, answer.text)


def test_a_key_list_of_only_commas_is_refused():
    from server.config import Settings

    with pytest.raises(ValueError, match="--api-key / TMOD_API_KEY names no key"):
        Settings(api_key=" , ")
    assert Settings(api_key="").api_keys() == [] and Settings(api_key="a, b").api_keys() == ["a", "b"]


def test_admin_keeps_its_own_token(served):
    assert httpx.get(served + "/admin/modules", headers=bearer(ADMIN)).status_code == 200
    assert httpx.get(served + "/admin/modules", headers=bearer(KEY)).status_code == 401


def test_tritons_repository_load_and_unload_take_the_admin_token(served):
    """tritonclient's unload_model / load_model (Triton's repository API) are /admin's unload and load,
    with its token in tritonclient's headers (the API key does not change modules); in the worker
    processes, as every route here. A configuration or files sent with a load are refused, changing nothing."""
    import tritonclient.http as tritonclient_http

    client = tritonclient_http.InferenceServerClient(url=served.removeprefix("http://"))
    assert "model_repository" in client.get_server_metadata(headers=bearer(KEY))["extensions"]
    state = lambda: {e["name"]: e["state"] for e in client.get_model_repository_index(headers=bearer(KEY))}  # noqa: E731
    for token, said in ((KEY, "admin endpoints need"), (None, "admin endpoints need")):
        with pytest.raises(tritonclient_http.InferenceServerException, match=said):
            client.unload_model("sentiment", headers=bearer(token) if token else None)
    assert state()["sentiment"] == "READY"
    client.unload_model("sentiment", headers=bearer(ADMIN))
    assert state()["sentiment"] == "UNAVAILABLE"
    with pytest.raises(tritonclient_http.InferenceServerException, match="tmod loads the store's artifacts"):
        client.load_model("sentiment", headers=bearer(ADMIN), config=json.dumps({"backend": "python"}))
    assert state()["sentiment"] == "UNAVAILABLE"
    client.load_model("sentiment", headers=bearer(ADMIN))
    assert state()["sentiment"] == "READY"
    answered = httpx.post(served + "/v1/infer?tasks=sentiment", json={"inputs": TEXTS}, headers=bearer(KEY))
    assert answered.status_code == 200
    with pytest.raises(tritonclient_http.InferenceServerException, match="no module|not in the store|telepathy"):
        client.load_model("telepathy", headers=bearer(ADMIN))


def test_each_protocols_client_passes_the_key(served, monkeypatch):
    import huggingface_hub
    import openai
    import tritonclient.http as triton

    client = openai.OpenAI(base_url=served + "/v1", api_key=KEY, max_retries=0)
    assert len(client.embeddings.create(model="embedding", input=TEXTS).data) == 2
    assert [m.id for m in client.models.list().data][0] == "embedding"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served + "/v1", api_key="wrong", max_retries=0).embeddings.create(
            model="embedding", input=TEXTS)

    host = served.removeprefix("http://")
    text = triton.InferInput("text", [2], "BYTES")
    text.set_data_from_numpy(np.array(TEXTS, dtype=object))
    answer = triton.InferenceServerClient(host).infer("sentiment", [text], headers=bearer(KEY))
    assert answer.as_numpy("label").shape == (2,)
    with pytest.raises(Exception, match="401"):
        triton.InferenceServerClient(host).infer("sentiment", [text])
    assert triton.InferenceServerClient(host).is_server_ready()  # the health route: no key

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # (set for every test) this one is local
    assert huggingface_hub.InferenceClient(model=served + "/embed", token=KEY).feature_extraction(TEXTS).shape[0] == 2
    with pytest.raises(huggingface_hub.errors.HfHubHTTPError, match="401"):
        huggingface_hub.InferenceClient(model=served + "/embed", token="wrong").feature_extraction(TEXTS)
    assert huggingface_hub.InferenceClient(model=served, token=KEY).feature_extraction(TEXTS).shape[0] == 2  # "/"
    assert huggingface_hub.InferenceClient(model=served, provider="hf-inference").health_check()  # /health: no key


def test_a_refused_requests_unread_body_is_not_read_as_the_next_request(served):
    """Refused before its body is read, a request's body must not be taken for the next request on the
    connection: the next one (pipelined, and sent later) is answered as itself."""
    body = json.dumps({"inputs": TEXTS * 20}).encode()

    def post(headers: str) -> bytes:
        return (f"POST /v1/infer?tasks=sentiment HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n{headers}\r\n").encode() + body

    host, port = served.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        stream = sock.makefile("rb")
        sock.sendall(post("") + post(f"authorization: Bearer {KEY}\r\n"))
        assert read_http_response(stream)[0] == 401
        status, _, answer = read_http_response(stream)
        assert status == 200 and len(json.loads(answer)["results"]) == 40
        sock.sendall(post(f"authorization: Bearer {KEY}\r\n"))
        assert read_http_response(stream)[0] == 200
