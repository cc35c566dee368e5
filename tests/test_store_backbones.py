"""One store, two backbones, over real HTTP: a server started on either backbone from the same
store serves exactly its own backbone's modules (plus foreign ones a bridge leads to), starts
without refusals for the other backbone's modules, and /v1/tasks names each module's backbone."""
from __future__ import annotations

import json
import logging

import httpx
import pytest

from modules_store import ModuleStore
from server.api.app import create_app
from server.backbone import Backbone
from server.config import Settings
from server.modules import save_module
from tests.helpers import NER_LABELS, LiveServer, make_tiny_backbone_dir, random_head
from training.serving import served_at_start

SENTIMENT = ["negative", "positive"]
ENTAILMENT = ["entailment", "not_entailment"]


@pytest.fixture(scope="module")
def backbones(tmp_path_factory):
    root = tmp_path_factory.mktemp("two-backbones")
    return {family: Backbone.load(make_tiny_backbone_dir(root, family, layers=2), name=f"tiny-{family}")
            for family in ("bert", "mpnet")}


@pytest.fixture(scope="module")
def store(tmp_path_factory, backbones):
    """sentiment on both (1 on BERT; mpnet-1 on MPNet), ner on BERT only, entailment on MPNet only."""
    bert, mpnet = backbones["bert"], backbones["mpnet"]
    store = ModuleStore(tmp_path_factory.mktemp("store"))
    save_module(store, "sentiment", "1", random_head(bert, "sequence_classification", SENTIMENT, 1), bert)
    save_module(store, "ner", "1", random_head(bert, "token_classification", NER_LABELS, 2, casing=True), bert)
    save_module(store, "sentiment", "mpnet-1", random_head(mpnet, "sequence_classification", SENTIMENT, 3), mpnet)
    save_module(store, "entailment", "mpnet-1", random_head(mpnet, "sequence_classification", ENTAILMENT, 4,
                                                            pooling="pair"), mpnet)
    return store


@pytest.mark.parametrize("family, expected", [
    ("bert", {"sentiment": "1", "ner": "1"}),
    ("mpnet", {"sentiment": "mpnet-1", "entailment": "mpnet-1"}),
])
def test_each_backbone_serves_its_own_modules(backbones, store, family, expected):
    backbone = backbones[family]
    with LiveServer(create_app(Settings(store=store.root), backbone=backbone)) as server:
        ready = httpx.get(server.url + "/readyz").json()
        assert ready["tasks"] == sorted(expected) and ready["refused"] == {}
        listed = httpx.get(server.url + "/v1/tasks").json()["tasks"]
        assert {t["task"]: t["version"] for t in listed} == expected
        for task in listed:  # every module names the backbone it belongs to: this server's
            assert task["backbone"]["name"] == f"tiny-{family}"
            assert task["backbone"]["architecture"] == backbone.fingerprint.architecture
        inputs = [{"text": "A fine, quiet film.", "text_pair": "It was good."}]
        answer = httpx.post(server.url + "/v1/infer", params={"tasks": "sentiment"}, json={"inputs": inputs})
        assert answer.status_code == 200 and answer.json()["results"][0]["sentiment"]["label"] in SENTIMENT
        other = "entailment" if family == "bert" else "ner"
        refused = httpx.post(server.url + "/v1/infer", params={"tasks": other}, json={"inputs": ["x"]})
        assert refused.status_code == 400 and other in refused.json()["error"]["message"]


def test_asking_for_another_backbones_module_is_a_refusal_that_says_why(backbones, store):
    settings = Settings(store=store.root, tasks="sentiment,ner")
    with LiveServer(create_app(settings, backbone=backbones["mpnet"])) as server:
        ready = httpx.get(server.url + "/readyz").json()
        assert ready["tasks"] == ["sentiment"]
        assert "no version for backbone tiny-mpnet" in ready["refused"]["ner"]
        assert "1 (tiny-bert)" in ready["refused"]["ner"]


def test_a_pair_task_asks_for_pairs(backbones, store):
    """entailment compares a text with a text pair: /v1/tasks says so; named with single texts it is
    a 422 that says what to send; among all tasks a single-text request leaves it out; pairs get it."""
    with LiveServer(create_app(Settings(store=store.root), backbone=backbones["mpnet"])) as server:
        listed = {t["task"]: t["inputs"] for t in httpx.get(server.url + "/v1/tasks").json()["tasks"]}
        assert listed == {"sentiment": "text", "entailment": "text_pair"}
        refused = httpx.post(server.url + "/v1/infer", params={"tasks": "entailment,sentiment"}, json={"inputs": ["x"]})
        assert refused.status_code == 422 and refused.json()["error"]["type"] == "pair_task"
        assert "text_pair" in refused.json()["error"]["message"]
        single = httpx.post(server.url + "/v1/infer", json={"inputs": ["A fine film."]})
        assert single.status_code == 200 and set(single.json()["results"][0]) == {"sentiment"}
        pair = [{"text": "A man plays a guitar.", "text_pair": "Someone makes music."}]
        both = httpx.post(server.url + "/v1/infer", json={"inputs": pair})
        assert both.status_code == 200 and both.json()["results"][0]["entailment"]["label"] in ENTAILMENT
        oip = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["x"]}]}
        v2 = httpx.post(server.url + "/v2/models/entailment/infer", json=oip)
        assert v2.status_code == 422 and "text_pair" in v2.json()["error"]  # OIP errors are one string


def test_an_opt_in_module_is_served_only_when_named(backbones, tmp_path):
    """A module whose manifest says why it is opt-in (one that does not clearly beat its baseline,
    docs/quality.md) is left out of a start-up over the whole store, quietly, and served when named;
    another backbone's opt-in version does not hide this backbone's."""
    bert, mpnet = backbones["bert"], backbones["mpnet"]
    store = ModuleStore(tmp_path / "store")
    save_module(store, "sentiment", "1", random_head(bert, "sequence_classification", SENTIMENT, 1), bert)
    save_module(store, "entailment", "1", random_head(bert, "sequence_classification", ENTAILMENT, 4,
                                                      pooling="pair"), bert)
    save_module(store, "entailment", "mpnet-1", random_head(mpnet, "sequence_classification", ENTAILMENT, 4,
                                                            pooling="pair"), mpnet)
    path = store.path("entailment", "1") / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "opt_in": "58.1% on RTE, TF-IDF 57.0%"}))
    with LiveServer(create_app(Settings(store=store.root, admin_token="t"), backbone=bert)) as server:
        ready = httpx.get(server.url + "/readyz").json()
        assert ready["tasks"] == ["sentiment"] and ready["refused"] == {}
        # asked for, it says why it is not served, and suggests no other task for it (it once offered 'sentiment')
        pair = [{"text": "A man plays a guitar.", "text_pair": "Someone makes music."}]
        asked = httpx.post(server.url + "/v1/infer", params={"tasks": "entailment"}, json={"inputs": pair}).json()
        assert asked["error"]["message"] == (
            "unknown task(s) ['entailment'] (entailment is not served: entailment/1 is opt-in (58.1% on RTE, TF-IDF "
            "57.0%): name it in --tasks, or load it with POST /admin/modules/entailment/load); loaded tasks: ['sentiment']")
        oip = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["x"]}]}
        assert "entailment is not served: entailment/1 is opt-in" in httpx.post(
            server.url + "/v2/models/entailment/infer", json=oip).json()["error"]
        assert "entailment is not served: entailment/1 is opt-in" in httpx.get(
            server.url + "/v1/tasks/entailment").json()["error"]["message"]
        assert "entailment is not served: entailment/1 is opt-in" in httpx.post(
            server.url + "/classify", json={"model": "entailment", "input": "x"}).json()["error"]["message"]
        unload = httpx.post(server.url + "/admin/modules/entailment/unload", headers={"authorization": "Bearer t"})
        assert unload.status_code == 404 and unload.json()["error"]["message"].startswith(
            "no task 'entailment' (entailment is not served: entailment/1 is opt-in (58.1% on RTE, TF-IDF 57.0%)")
        admin = httpx.get(server.url + "/admin/modules", headers={"authorization": "Bearer t"}).json()
        assert admin["tasks"] == {"sentiment": "1"} and list(admin["not_served"]) == ["entailment"]
        assert admin["not_served"]["entailment"].startswith("entailment/1 is opt-in (58.1% on RTE, TF-IDF 57.0%)")
    with LiveServer(create_app(Settings(store=store.root, tasks="sentiment,entailment"), backbone=bert)) as server:
        assert httpx.get(server.url + "/readyz").json()["tasks"] == ["entailment", "sentiment"]
    with LiveServer(create_app(Settings(store=store.root), backbone=mpnet)) as server:
        assert httpx.get(server.url + "/readyz").json()["tasks"] == ["entailment"]
    # tmod-train's example request (no --load-into) names the tasks such a server answers, no others
    assert served_at_start(store, bert) == ["sentiment"] and served_at_start(store, mpnet) == ["entailment"]


@pytest.mark.parametrize("head, interval, level", [(0.5, None, "WARNING"), (0.62, None, "INFO"),
                                                   (0.62, [-0.01, 0.25], "WARNING"), (0.62, [0.02, 0.22], "INFO")])
def test_a_module_its_training_found_no_better_than_the_majority_answer_is_warned_at_load(backbones, tmp_path, caplog,
                                                                                         head, interval, level):
    """tmod-train said a head answers no better than the majority answer, but a server started over the store
    loaded it without a word: its load line now says it (a warning), as a bridged module's does; so too
    where its margin over the majority answer was within the noise of the rows scored."""
    bert = backbones["bert"]
    store = ModuleStore(tmp_path / "store")
    baselines = {"split": "validation", "metric": "accuracy", "head": head, "majority": {"accuracy": 0.5},
                 "tfidf_logreg": {"accuracy": 0.6}, **({"margin_over_majority_interval": interval} if interval else {})}
    save_module(store, "sentiment", "1", random_head(bert, "sequence_classification", SENTIMENT, 1), bert,
                metrics={"accuracy": head, "baselines": baselines})
    with caplog.at_level(logging.INFO, logger="tmod"):
        with LiveServer(create_app(Settings(store=store.root), backbone=bert)) as server:
            assert httpx.get(server.url + "/readyz").json()["tasks"] == ["sentiment"]
    [line] = [r for r in caplog.records if r.getMessage().startswith("module sentiment/1 loaded")]
    noise = ", but its training could not tell it from the majority answer on the validation split (accuracy 0.6200 " \
            "against 0.5000; the margin's 95% paired bootstrap interval -0.0100 to +0.2500 holds 0)"
    assert line.levelname == level and line.getMessage() == (
        "module sentiment/1 loaded" + (", but its training scored it no better than the majority answer on the "
                                       "validation split (accuracy 0.5000 against 0.5000)" if head == 0.5 else
                                       noise if level == "WARNING" else ""))


def test_a_store_of_another_backbones_modules_says_what_would_serve_one(backbones, tmp_path):
    """Every module of the store on another backbone (a new backbone folder started on the shipped store):
    the answer ended 'load one through /admin', which refuses them for the same reason."""
    bert, mpnet = backbones["bert"], backbones["mpnet"]
    store = ModuleStore(tmp_path / "store")
    save_module(store, "sentiment", "mpnet-1", random_head(mpnet, "sequence_classification", SENTIMENT, 3), mpnet)

    def serves_nothing(response):
        return response.status_code == 503 and response.json()["error"]["type"] == "no_modules"

    with LiveServer(create_app(Settings(store=store.root), backbone=bert), ready_when=serves_nothing) as server:
        message = httpx.get(server.url + "/readyz").json()["error"]["message"]
    assert message == (
        f"no task modules are loaded from the store {store.root} (sentiment is not served: no version for backbone "
        "tiny-bert and no loaded bridge to the backbone of one; its versions are mpnet-1 (tiny-mpnet)); serve the store "
        "on a backbone its modules run on (--backbone), train a module on this one into it (tmod-train layermix "
        "--backbone ... --store ...), or give --bridges a bridge from this backbone to theirs")


def test_a_store_with_nothing_to_serve_here_says_why_at_readiness(backbones, tmp_path, caplog):
    """Every task of the store left out at start (one opt-in, one another backbone's): /readyz and the
    start-up warning say why for each, not only that nothing is loaded, and that /admin needs its token."""
    bert, mpnet = backbones["bert"], backbones["mpnet"]
    store = ModuleStore(tmp_path / "store")
    save_module(store, "entailment", "1", random_head(bert, "sequence_classification", ENTAILMENT, 4,
                                                      pooling="pair"), bert)
    path = store.path("entailment", "1") / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "opt_in": "58.1% on RTE, TF-IDF 57.0%"}))
    save_module(store, "sentiment", "mpnet-1", random_head(mpnet, "sequence_classification", SENTIMENT, 3), mpnet)

    def serves_nothing(response):
        return response.status_code == 503 and response.json()["error"]["type"] == "no_modules"

    with caplog.at_level(logging.WARNING, logger="tmod"):
        with LiveServer(create_app(Settings(store=store.root), backbone=bert), ready_when=serves_nothing) as server:
            error = httpx.get(server.url + "/readyz").json()["error"]
    assert error["message"] == (
        f"no task modules are loaded from the store {store.root} (entailment is not served: entailment/1 is opt-in "
        "(58.1% on RTE, TF-IDF 57.0%): name it in --tasks, or load it with POST /admin/modules/entailment/load; "
        "sentiment is not served: no version for backbone tiny-bert and no loaded bridge to the backbone of one; "
        "its versions are mpnet-1 (tiny-mpnet)); load one through /admin, which needs TMOD_ADMIN_TOKEN set at start")
    assert list(error["not_served"]) == ["entailment", "sentiment"] and error["refused"] == {}
    assert f"{error['message']} (/readyz answers 503 no_modules until then)" in caplog.text
