"""Hot module management over a real loopback server: load, reload, unload, refusals."""
from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from modules_store import ModuleStore
from server.api.app import create_app
from server.config import Settings
from server.modules import save_module
from tests.helpers import LiveServer, random_head

TOKEN = "s3cret-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
TEXTS = ["A fine film.", "Dreadful, long and loud.", "It rained in Paris on Monday."]


@pytest.fixture()
def store(tmp_path, tiny_backbone):
    store = ModuleStore(tmp_path / "store")
    for version, seed in (("1", 1), ("2", 2)):
        head = random_head(tiny_backbone, "sequence_classification", ["negative", "positive"], seed)
        save_module(store, "sentiment", version, head, tiny_backbone)
    return store


@pytest.fixture()
def live(store, tiny_backbone):
    settings = Settings(store=store.root, admin_token=TOKEN, tasks="sentiment")
    with LiveServer(create_app(settings, backbone=tiny_backbone)) as server:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            yield client


def admin(client, task, action, version=None, headers=AUTH):
    return client.post(f"/admin/modules/{task}/{action}", json={"version": version}, headers=headers)


def scores(client):
    body = client.post("/v1/infer", params={"tasks": "sentiment"}, json={"inputs": TEXTS}).json()
    return body["tasks"]["sentiment"], [r["sentiment"]["scores"]["positive"] for r in body["results"]]


def test_admin_needs_the_token(live, store, tiny_backbone):
    assert admin(live, "sentiment", "reload", headers={}).status_code == 401
    assert admin(live, "sentiment", "reload", headers={"authorization": "Bearer wrong"}).json()["error"]["type"] == "unauthorized"
    settings = Settings(store=store.root)  # no token configured: admin disabled
    with LiveServer(create_app(settings, backbone=tiny_backbone)) as server:
        response = httpx.post(server.url + "/admin/modules/sentiment/reload", headers=AUTH)
        assert response.status_code == 403 and response.json()["error"]["type"] == "admin_disabled"


def test_the_module_listing_says_where_modules_come_from(live, store, tiny_backbone):
    assert live.get("/admin/modules").status_code == 401
    listing = live.get("/admin/modules", headers=AUTH).json()
    fingerprint = tiny_backbone.fingerprint.short
    assert listing == {"store": str(store.root.resolve()), "tasks": {"sentiment": "2"},
                       "backbone": {"backbone": tiny_backbone.name, "fingerprint": fingerprint},
                       "modules_of": {fingerprint: tiny_backbone.name}, "api_key": False, "not_served": {}}
    admin(live, "sentiment", "unload")
    assert live.get("/admin/modules", headers=AUTH).json()["tasks"] == {}


def test_modules_under_a_name_that_is_no_task_s_are_said(store, tiny_backbone, tmp_path, caplog):
    """A module copied into the store as 'Sentiment/1' was never served and never mentioned; a store holding
    only such folders said it "holds no module"."""
    import shutil

    misnamed = tmp_path / "misnamed-store"
    shutil.copytree(store.root / "sentiment", misnamed / "Sentiment")
    (misnamed / ".incoming" / "2").mkdir(parents=True)  # the operator's own hidden folder: not a store folder
    shutil.copy(store.root / "sentiment" / "1" / "manifest.json", misnamed / ".incoming" / "2")
    with caplog.at_level(logging.WARNING, logger="tmod"):
        with LiveServer(create_app(Settings(store=misnamed), backbone=tiny_backbone),
                        ready_when=lambda r: r.status_code == 503 and r.json()["error"]["type"] == "no_modules") as server:
            message = httpx.get(server.url + "/readyz").json()["error"]["message"]
    assert message == (f"no task modules are loaded from the store {misnamed} (its folder(s) ['Sentiment'] hold modules "
                       "under names that are no task's: rename them, 1-64 of a-z, 0-9, '_' and '-'); load one through "
                       "/admin, which needs TMOD_ADMIN_TOKEN set at start")
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("store folder")]
    assert warned == ["store folder 'Sentiment' holds modules but is not a task name (1-64 of a-z, 0-9, '_' and '-', "
                      "starting with a letter or digit): not served; rename it"]


def test_a_start_with_no_module_says_so(store, tiny_backbone, tmp_path, caplog):
    empty = tmp_path / "empty-store"
    empty.mkdir()
    def loaded_nothing(response):  # /readyz: not_ready while loading, then no_modules
        return response.status_code == 503 and response.json()["error"]["type"] == "no_modules"

    with caplog.at_level(logging.WARNING, logger="tmod"):
        with LiveServer(create_app(Settings(store=empty, admin_token=TOKEN), backbone=tiny_backbone),
                        ready_when=loaded_nothing) as server:
            assert httpx.get(server.url + "/admin/modules", headers=AUTH).json()["tasks"] == {}
            # an inference request says what readiness says: the store, and how to load a module
            ready = httpx.get(server.url + "/readyz").json()["error"]
            infer = httpx.post(server.url + "/v1/infer", json={"inputs": ["x"]})
            assert infer.status_code == 503 and infer.json()["error"]["type"] == "no_modules"
            assert infer.json()["error"]["message"] == ready["message"] == (
                f"no task modules are loaded from the store {empty} (it holds no module: train one into it, "
                "tmod-train layermix ... --store STORE); load one through /admin")
            empty.rmdir()  # the volume unmounted under the running server: not an empty store any more
            assert httpx.get(server.url + "/readyz").json()["error"]["message"] == (
                f"no task modules are loaded from the store {empty} (that folder is not there: moved, deleted or not "
                "mounted); load one through /admin")
    assert f"{ready['message']} (/readyz answers 503 no_modules until then)" in caplog.text


def test_load_switch_and_unload(live):
    version, v2_scores = scores(live)
    assert version == "2"  # latest at start
    response = admin(live, "sentiment", "load", "1")
    assert response.status_code == 200 and response.json() == {
        "task": "sentiment", "action": "load", "version": "1", "previous_version": "2"}
    version, v1_scores = scores(live)
    assert version == "1" and v1_scores != v2_scores
    # a numbered version may come as a JSON number (it was 422 'Input should be a valid string'); true is no version
    assert admin(live, "sentiment", "load", 2).json()["version"] == "2"
    assert admin(live, "sentiment", "load", True).status_code == 422
    assert admin(live, "sentiment", "load", 1).json() == {"task": "sentiment", "action": "load", "version": "1",
                                                           "previous_version": "2"}
    assert admin(live, "sentiment", "unload").json()["version"] == "1"
    asked = live.post("/v1/infer", params={"tasks": "sentiment"}, json={"inputs": ["x"]})
    # an unloaded task says why it is not served (it was a bare "unknown task(s) ['sentiment']"), in
    # every place that lists what is not served
    unloaded = "sentiment/1 was unloaded through the admin API: POST /admin/modules/sentiment/load serves it again"
    assert asked.status_code == 400 and f"(sentiment is not served: {unloaded})" in asked.json()["error"]["message"]
    assert f"(sentiment is not served: {unloaded})" in live.get("/readyz").json()["error"]["message"]
    asked = live.post("/predict", params={"tasks": "sentiment"}, json={"inputs": "x"})  # TEI's route: its shape
    assert asked.status_code == 400 and f"(sentiment is not served: {unloaded})" in asked.json()["error"]
    assert live.post("/v2/repository/index", json={}).json() == [
        {"name": "sentiment", "state": "UNAVAILABLE", "reason": unloaded}]
    # every module unloaded: out of service (readiness says so) but still managed through /admin
    for probe in ("/readyz", "/v2/health/ready", "/health", "/"):
        assert live.get(probe).status_code == 503
    assert live.get("/readyz").json()["error"]["type"] == "no_modules"
    assert live.get("/health").json()["error_type"] == "Unhealthy"  # TEI's shape
    assert live.get("/healthz").status_code == 200 and live.get("/v1/tasks").json()["tasks"] == []
    assert admin(live, "sentiment", "unload").status_code == 404
    assert admin(live, "sentiment", "load").json()["version"] == "2"
    assert live.get("/readyz").status_code == 200 and live.get("/v2/health/ready").status_code == 200
    assert live.get("/health").status_code == 200
    assert scores(live) == ("2", v2_scores)
    assert admin(live, "nope", "load").json()["error"]["type"] == "artifact_not_found"
    assert admin(live, "sentiment", "explode").status_code == 404


def test_a_version_in_the_query_string_is_refused_not_ignored(live):
    """`POST /admin/modules/sentiment/load?version=1` loaded version 2 (the latest), answering 200: the
    query was never read. Now 400 saying where the version goes, and nothing changes."""
    assert scores(live)[0] == "2"
    response = live.post("/admin/modules/sentiment/load", params={"version": "1"}, headers=AUTH)
    assert response.status_code == 400 and response.json()["error"]["message"] == (
        "unknown query parameter(s) ['version']: /admin/modules/sentiment/load takes none; a version goes in the "
        'JSON body: {"version": "2"}')
    response = live.post("/v2/repository/models/sentiment/load", params={"version": "1"}, headers=AUTH)
    assert response.status_code == 400 and '{"parameters": {"version": "2"}}' in response.json()["error"]  # OIP's shape
    assert live.post("/admin/modules/sentiment/load", params={"version": "1"}).status_code == 401  # the token first
    assert scores(live)[0] == "2"


def test_tritons_repository_load_takes_a_numbered_version_as_a_number_too(live):
    """{"parameters": {"version": 1}} was 400 'is a string'; as /admin's body, a number names that version."""
    loaded = live.post("/v2/repository/models/sentiment/load", json={"parameters": {"version": 1}}, headers=AUTH)
    assert loaded.status_code == 200 and scores(live)[0] == "1"
    refused = live.post("/v2/repository/models/sentiment/load", json={"parameters": {"version": True}}, headers=AUTH)
    assert refused.status_code == 400 and refused.json()["error"] == (
        "parameter 'version' is a version's name, e.g. \"2\" (or 2)")
    assert admin(live, "sentiment", "load", "2").status_code == 200 and scores(live)[0] == "2"


def test_reloads_during_traffic_fail_no_request(live):
    admin(live, "sentiment", "load", "1")
    expected = {"1": scores(live)[1]}
    admin(live, "sentiment", "load", "2")
    expected["2"] = scores(live)[1]

    async def traffic_with_swaps():
        async with httpx.AsyncClient(base_url=str(live.base_url), timeout=60) as client:
            async def one_request():
                return await client.post("/v1/infer", params={"tasks": "sentiment"}, json={"inputs": TEXTS})

            async def swap(version):
                response = await client.post("/admin/modules/sentiment/load", json={"version": version}, headers=AUTH)
                assert response.status_code == 200

            responses = []
            for version in ("1", "2", "1", "2", "1", "2"):  # each swap lands amid a wave of requests
                wave = await asyncio.gather(one_request(), one_request(), swap(version),
                                            *(one_request() for _ in range(6)))
                responses += [r for r in wave if r is not None]
            return responses

    responses = asyncio.run(traffic_with_swaps())
    seen = set()
    for response in responses:
        assert response.status_code == 200, response.text
        body = response.json()
        version = body["tasks"]["sentiment"]
        seen.add(version)
        # every answer is wholly one version's answer: requests finish on the version they started with
        got = [r["sentiment"]["scores"]["positive"] for r in body["results"]]
        assert got == pytest.approx(expected[version], abs=1e-5)
    assert seen == {"1", "2"}  # the swaps really happened while requests were in flight


def test_corrupted_artifact_is_refused_and_old_version_keeps_serving(live, store, tiny_backbone):
    before = scores(live)
    save_module(store, "sentiment", "3", random_head(tiny_backbone, "sequence_classification", ["negative", "positive"], 3),
                tiny_backbone)
    weights = store.path("sentiment", "3") / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x55
    weights.write_bytes(bytes(data))
    response = admin(live, "sentiment", "load", "3")
    assert response.status_code == 409
    assert response.json()["error"]["type"] == "artifact_checksum_mismatch"
    assert "checksum mismatch" in response.json()["error"]["message"]
    assert scores(live) == before
    assert live.get("/readyz").status_code == 200
