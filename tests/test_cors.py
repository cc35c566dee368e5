"""`--cors-origins`: a browser page on an allowed origin can call tmod. Its preflight is answered
before the API key is asked for (a browser sends none with it), and every answer to it, refusals
included, names the origin, so the page can read the answer. Other origins get no CORS header, nor
does any origin on a server without the setting. One real `tmod-serve --workers 2` with an API key
(answers written straight into uvicorn's connection), one in-process server (answers through ASGI
messages)."""
from __future__ import annotations

import os

import httpx
import pytest

from server.api.app import create_app
from server.config import Settings
from tests.helpers import LiveServer, populate_store, start_tmod_serve

KEY = "cors-test-key"
APP, OTHER = "https://app.example", "https://elsewhere.example"
BODY = {"inputs": ["A fine film."]}


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_backbone, tiny_backbone_dir):
    store = populate_store(tmp_path_factory.mktemp("store"), tiny_backbone)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMOD_API_KEY": KEY}
    url, process = start_tmod_serve(["--workers", "2", "--backbone", str(tiny_backbone_dir), "--store", str(store.root),
                                     "--cors-origins", f"{APP}, http://localhost:3000", "--log-level", "warning"], env)
    yield url
    process.terminate()
    process.wait(timeout=60)


def preflight(url: str, path: str, origin: str, asked: str = "authorization, content-type") -> httpx.Response:
    return httpx.options(url + path, headers={"origin": origin, "access-control-request-method": "POST",
                                              "access-control-request-headers": asked})


@pytest.mark.parametrize("path", ["/v1/infer", "/v1/embeddings", "/v2/models/sentiment/infer", "/v1/tasks"])
def test_a_preflight_from_an_allowed_origin_is_answered_without_the_key(served, path):
    answer = preflight(served, path, APP)
    assert answer.status_code == 200 and answer.content == b""
    assert answer.headers["access-control-allow-origin"] == APP and answer.headers["vary"] == "origin"
    assert "POST" in answer.headers["access-control-allow-methods"]
    assert answer.headers["access-control-allow-headers"] == "authorization, content-type"
    assert int(answer.headers["access-control-max-age"]) > 0


def test_answers_to_an_allowed_origin_name_it_refusals_too(served):
    origin = {"origin": "http://localhost:3000"}
    answered = httpx.post(served + "/v1/infer?tasks=sentiment", json=BODY,
                          headers={**origin, "authorization": f"Bearer {KEY}"})
    assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "x-request-id" in answered.headers["access-control-expose-headers"]
    for refused in (httpx.post(served + "/v1/infer", json=BODY, headers=origin),  # no key: 401 the page can read
                    httpx.post(served + "/v1/infer?tasks=nope", json=BODY,
                               headers={**origin, "authorization": f"Bearer {KEY}"}),
                    httpx.get(served + "/v1/tasks", headers=origin)):  # a FastAPI route
        assert refused.status_code in (400, 401) and refused.headers["access-control-allow-origin"] == origin["origin"]
        assert len(refused.headers.get_list("access-control-allow-origin")) == 1


def test_other_origins_get_no_cors_headers(served):
    refused = preflight(served, "/v1/infer", OTHER)  # not answered as a preflight: the key is asked for
    assert refused.status_code == 401 and "access-control-allow-origin" not in refused.headers
    answered = httpx.post(served + "/v1/infer", json=BODY, headers={"origin": OTHER, "authorization": f"Bearer {KEY}"})
    assert answered.status_code == 200 and "access-control-allow-origin" not in answered.headers
    # header names a preflight asks for are echoed only when they are header names
    odd = preflight(served, "/v1/infer", APP, asked="content-type, <script>")
    assert odd.status_code == 200 and "access-control-allow-headers" not in odd.headers


def test_any_origin_and_no_setting(tiny_store, tiny_backbone):
    with LiveServer(create_app(Settings(store=tiny_store.root, cors_origins="*"), backbone=tiny_backbone)) as server:
        answer = preflight(server.url, "/v1/infer", OTHER)
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"
        assert "vary" not in answer.headers
        answered = httpx.post(server.url + "/v1/infer?tasks=sentiment", json=BODY, headers={"origin": OTHER})
        assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == "*"
    with LiveServer(create_app(Settings(store=tiny_store.root), backbone=tiny_backbone)) as server:
        assert preflight(server.url, "/v1/infer", APP).status_code == 405
        answered = httpx.post(server.url + "/v1/infer?tasks=sentiment", json=BODY, headers={"origin": APP})
        assert answered.status_code == 200 and "access-control-allow-origin" not in answered.headers


@pytest.mark.parametrize("value", ["https://app.example/", "app.example", "https://a.example,ftp://b.example"])
def test_a_value_that_is_not_an_origin_is_refused(value):
    with pytest.raises(ValueError, match="--cors-origins / TMOD_CORS_ORIGINS: .* is not an origin"):
        Settings(cors_origins=value)


def test_origins_match_whatever_their_case_and_nothing_else():
    from server.api.cors import Cors

    cors = Cors("https://App.example:8443, http://localhost:3000")
    assert cors.allowed_origin([(b"origin", b"https://app.example:8443")]) == b"https://app.example:8443"
    for other in (b"https://app.example", b"https://app.example:8443.evil", b"http://localhost:3001", b"null"):
        assert cors.allowed_origin([(b"origin", other)]) is None
    assert cors.allowed_origin([(b"host", b"x")]) is None  # no Origin: not a cross-origin call
