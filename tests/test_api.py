"""The HTTP API over a real uvicorn server on loopback, driven with httpx."""
from __future__ import annotations

import pytest
import httpx

from server.api.app import create_app
from server.config import Settings
from tests.helpers import LiveServer, metric_sample

pytestmark = pytest.mark.smoke  # the quick tier: every test here

TEXT = "Peter Blackburn met Angela Merkel in Brussels on Monday."


@pytest.fixture(scope="module")
def live(tiny_store, tiny_backbone):
    settings = Settings(store=tiny_store.root, max_inputs=8, max_chars=500, max_body_bytes=4096, max_tokens=64,
                        head_precision="fp32")  # answers compared across paths: fp32 heads (16-bit heads round differently when grouped)
    with LiveServer(create_app(settings, backbone=tiny_backbone)) as server:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            yield client


def infer(client, inputs, tasks=None, **extra):
    params = {"tasks": tasks} if tasks is not None else {}
    return client.post("/v1/infer", params=params, json={"inputs": inputs, **extra})


def assert_error(response, status, type_):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and body["error"]["type"] == type_
    assert body["error"]["message"]
    return body["error"]


def test_two_tasks_in_one_request_equal_each_alone(live):
    texts = [TEXT, "A wonderful, moving film.", "bad"]
    both = infer(live, texts, "sentiment,ner")
    assert both.status_code == 200, both.text
    alone_s = infer(live, texts, "sentiment").json()["results"]
    alone_n = infer(live, texts, "ner").json()["results"]
    for row, result in enumerate(both.json()["results"]):
        assert set(result) == {"sentiment", "ner"}
        assert result["sentiment"]["label"] == alone_s[row]["sentiment"]["label"]
        for label, p in result["sentiment"]["scores"].items():
            assert p == pytest.approx(alone_s[row]["sentiment"]["scores"][label], abs=1e-5)
        assert [(e["label"], e["start"], e["end"]) for e in result["ner"]["entities"]] == \
               [(e["label"], e["start"], e["end"]) for e in alone_n[row]["ner"]["entities"]]


def test_sequence_result_shape(live):
    body = infer(live, ["fine"], "sentiment").json()
    out = body["results"][0]["sentiment"]
    assert set(out) == {"label", "score", "scores"}
    assert set(out["scores"]) == {"negative", "positive"}
    assert sum(out["scores"].values()) == pytest.approx(1.0, abs=1e-5)
    assert out["score"] == max(out["scores"].values()) and out["label"] == max(out["scores"], key=out["scores"].get)
    assert body["model"]["backbone"] == "tiny-bert" and body["tasks"] == {"sentiment": "1"}


def test_entity_offsets_slice_the_input(live):
    texts = [TEXT, "  Émile Zola wrote in Paris, France.", "IBM's CEO visited São Paulo."]
    results = infer(live, texts, "ner").json()["results"]
    total = 0
    for text, result in zip(texts, results):
        for entity in result["ner"]["entities"]:
            assert set(entity) == {"text", "label", "start", "end", "score"}
            assert text[entity["start"]:entity["end"]] == entity["text"]
            assert entity["label"] in {"PER", "ORG", "LOC", "MISC"}
            total += 1
    assert total > 0  # random weights label most words as some entity


def test_no_tasks_means_all_loaded_and_results_keep_input_order(live):
    texts = [f"text number {i}" for i in range(5)]
    body = infer(live, texts).json()
    assert set(body["tasks"]) == {"sentiment", "ner", "acceptability"}
    singles = [infer(live, [t], "sentiment").json()["results"][0]["sentiment"]["scores"] for t in texts]
    for result, single in zip(body["results"], singles):
        assert result["sentiment"]["scores"]["positive"] == pytest.approx(single["positive"], abs=1e-5)


def test_text_pairs(live):
    body = infer(live, [{"text": "Paris is big.", "text_pair": "London is bigger."}], "sentiment,ner").json()
    result = body["results"][0]
    assert "label" in result["sentiment"]
    for entity in result["ner"]["entities"]:
        source = "Paris is big." if entity["segment"] == 0 else "London is bigger."
        assert source[entity["start"]:entity["end"]] == entity["text"]


def test_unknown_task_lists_loaded_ones(live):
    error = assert_error(infer(live, ["x"], "sentiment,telepathy"), 400, "unknown_task")
    assert "telepathy" in error["message"]
    assert error["loaded_tasks"] == ["acceptability", "ner", "sentiment"]
    assert_error(infer(live, ["x"], "ner,ner"), 400, "duplicate_tasks")
    assert_error(infer(live, ["x"], "ner,"), 400, "invalid_tasks")


@pytest.mark.parametrize("payload", [
    b"", b"{", b"[]", b'{"inputs": []}', b'{"inputs": "just a string"}', b'{"inputs": [1, 2]}',
    b'{"inputs": [""]}', b'{"inputs": ["   "]}', b'{"inputs": ["a", {"text": "b", "text_pair": "c"}]}',
    b'{"inputs": ["a"], "unexpected": 1}', b'{"inputs": [{"text": "only one side"}]}', b'{"inputs": [null]}',
])
def test_malformed_bodies_are_422(live, payload):
    response = live.post("/v1/infer", content=payload, headers={"content-type": "application/json"})
    assert_error(response, 422, "invalid_request")


def test_a_newcomers_first_mistakes_say_what_to_send(live):
    """A single string for `inputs`, the tasks in the body: each 422 says what to send instead."""
    error = assert_error(live.post("/v1/infer", json={"inputs": "Peter flew."}), 422, "invalid_request")
    assert error["message"] == 'request is malformed: inputs: Expected `array`, got `str` (send a list, even of one ' \
                               'text: {"inputs": ["..."]})'
    error = assert_error(live.post("/v1/infer", json={"inputs": ["Peter flew."], "tasks": ["ner"]}), 422, "invalid_request")
    assert error["message"].endswith("unknown field `tasks` (tasks are named in the query string: "
                                     "/v1/infer?tasks=ner,emotion)")
    error = assert_error(live.post("/v1/infer", json={"inputs": ["Peter flew."], "taks": 1}), 422, "invalid_request")
    assert error["message"] == "request is malformed: body: Object contains unknown field `taks`"  # no hint to give
    # OpenAI's `input`, a bare `text`, a bare list, no `inputs`, a text as an object: each said what to send
    send = 'send {"inputs": ["...", ...]}'
    for body, location, expected in [
        ({"input": ["Peter flew."]}, "body", "Object contains unknown field `input` (/v1/infer reads `inputs`, not "
                                            f"`input` (that is /v1/embeddings'): {send})"),
        ({"text": "Peter flew."}, "body", f"Object contains unknown field `text` ({send})"),
        (["Peter flew."], "body", f"Expected `object`, got `array` (the list goes under `inputs`: {send})"),
        ({}, "body", f"Object missing required field `inputs` ({send})"),
        ({"inputs": ["a", {"text": "Peter flew."}]}, "inputs.1", 'Object missing required field `text_pair` (a text '
         'alone is a string, "inputs": ["..."]; an object is a pair: {"text": "...", "text_pair": "..."})'),
    ]:
        error = assert_error(live.post("/v1/infer", json=body), 422, "invalid_request")
        assert error["message"] == f"request is malformed: {location}: {expected}", body
    # a field's name misspelt, at any depth: the likely one (an answer control's, a pair's)
    for body, location, name, meant in [({"inputs": ["x"], "topk": 2}, "body", "topk", "top_k"),
                                        ({"inputs": ["x"], "raw_score": True}, "body", "raw_score", "raw_scores"),
                                        ({"inputs": [{"text": "a", "textpair": "b"}]}, "inputs.0", "textpair", "text_pair")]:
        error = assert_error(live.post("/v1/infer", json=body), 422, "invalid_request")
        assert error["message"] == (f"request is malformed: {location}: Object contains unknown field `{name}` "
                                    f"(did you mean {meant!r} for {name!r}?)")


def test_a_misspelt_task_or_query_parameter_is_refused_with_the_likely_one(live):
    """`?task=ner` was ignored and every task answered; `?tasks=NER` named no task. Each is a 400 that
    names what was probably meant; answer controls in the query are sent to the body."""
    error = assert_error(live.post("/v1/infer?task=ner", json={"inputs": ["x"]}), 400, "invalid_request")
    assert error["message"] == ("unknown query parameter(s) ['task'] (did you mean 'tasks' for 'task'?): /v1/infer takes "
                                "only ?tasks=a,b (truncate, window and the answer controls go in the JSON body)")
    error = assert_error(live.post("/v1/infer?tasks=ner&top_k=2&truncate", json={"inputs": ["x"]}), 400, "invalid_request")
    assert error["message"].startswith("unknown query parameter(s) ['top_k', 'truncate']: ")
    error = assert_error(infer(live, ["x"], "NER"), 400, "unknown_task")
    assert "(did you mean 'ner' for 'NER'?)" in error["message"]
    assert "did you mean" not in assert_error(infer(live, ["x"], "telepathy"), 400, "unknown_task")["message"]
    for joined in ("ner;sentiment", "ner+sentiment", "ner|sentiment"):  # '+' is a space in a query string
        error = assert_error(live.post(f"/v1/infer?tasks={joined}", json={"inputs": ["x"]}), 400, "unknown_task")
        assert "(tasks are separated by commas: ner,sentiment)" in error["message"], error
    assert live.post("/v1/infer?tasks=ner&tasks=sentiment", json={"inputs": ["x"]}).status_code == 200
    assert live.post("/v1/infer?tasks=n%65r", json={"inputs": ["x"]}).json()["tasks"] == {"ner": "1"}


def test_limits_are_413(live):
    error = assert_error(infer(live, ["x"] * 9), 413, "too_many_inputs")
    assert "at most 8" in error["message"]
    error = assert_error(infer(live, ["y" * 501]), 413, "input_too_long")
    assert "501 characters" in error["message"]
    assert_error(live.post("/v1/infer", content=b'{"inputs": ["' + b"z " * 3000 + b'"]}',
                           headers={"content-type": "application/json"}), 413, "payload_too_large")


def test_over_the_token_limit_reads_windows_or_truncates(live):
    long_text = " ".join(["word"] * 100)  # 102 tokens > max_tokens=64: two windows (tests/test_windows.py)
    body = infer(live, ["short", long_text], "sentiment")
    assert body.status_code == 200 and body.json()["windows"] == [1, 2] and body.json()["truncated"] == []
    body = infer(live, ["short", long_text], "sentiment", truncate=True)
    assert body.status_code == 200 and body.json()["truncated"] == [1] and body.json()["windows"] == [1, 1]


def test_server_survives_errors_and_counts_them(live):
    for _ in range(3):
        infer(live, [], "sentiment")
    assert infer(live, ["still alive"]).status_code == 200
    metrics = live.get("/metrics").text
    assert 'tmod_request_errors_total{type="invalid_request"}' in metrics
    assert 'tmod_requests_total{outcome="success"}' in metrics
    assert "tmod_request_duration_seconds_bucket" in metrics and "tmod_modules_loaded 3.0" in metrics


def test_only_inference_requests_count_as_failed_inference_requests(live):
    """tmod_requests_total{outcome} counts inference requests (its successes are answers): a refusal
    on another route (a scanner's 404, a 401 on /admin) is counted by type only; it once counted as a
    failed inference request too."""
    def samples():  # (failed inference requests, refusals of every type)
        page = live.get("/metrics").text
        refusals = sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                       if line.startswith("tmod_request_errors_total{"))
        return metric_sample(page, 'tmod_requests_total{outcome="error"}'), refusals
    errors, refusals = samples()
    for path in ("/wp-login.php", "/v1/tasks/nothing", "/v2/models/nothing"):
        assert live.get(path).status_code == 404
    assert live.post("/admin/modules/ner/reload").status_code in (401, 403)
    assert samples() == (errors, refusals + 4)
    assert infer(live, ["a"], "nothing").status_code == 400  # an inference request refused
    assert live.post("/v2/models/nothing/infer", json={"inputs": []}).status_code == 404
    assert samples() == (errors + 2, refusals + 6)


def test_task_listing_and_details(live):
    listing = live.get("/v1/tasks").json()
    assert [t["task"] for t in listing["tasks"]] == ["acceptability", "ner", "sentiment"]
    acceptability = next(t for t in listing["tasks"] if t["task"] == "acceptability")
    assert acceptability["layers"] == [0, 1] and acceptability["parameters"] > 0
    detail = live.get("/v1/tasks/ner").json()
    assert detail["task_type"] == "token_classification" and detail["manifest"]["kind"] == "layermix"
    assert_error(live.get("/v1/tasks/nope"), 404, "unknown_task")
    # one 404 for a task not loaded, wherever it is named: the near miss, and what is loaded
    assert live.get("/v1/tasks/NER").json()["error"]["message"] == (
        "no task 'NER' (did you mean 'ner' for 'NER'?); loaded tasks: ['acceptability', 'ner', 'sentiment']")
    assert live.post("/v2/models/sentimnt/infer", json={"inputs": [
        {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}).json()["error"] == (
        "no model 'sentimnt' (did you mean 'sentiment' for 'sentimnt'?); "
        "loaded models: ['acceptability', 'ner', 'sentiment']")


def test_health_and_timing_headers(live):
    assert live.get("/healthz").json() == {"status": "ok"}
    assert live.get("/readyz").json()["status"] == "ready"
    response = infer(live, ["timed"], "sentiment")
    for header in ("x-queue-time", "x-tokenization-time", "x-backbone-time", "x-heads-time",
                   "x-inference-time", "x-total-time"):
        assert float(response.headers[header]) >= 0
    assert_error(live.get("/no/such/path"), 404, "not_found")


@pytest.mark.parametrize("text, fragment", [
    ("nul\u0000byte", "U+0000 at position 3"),
    ("bell\u0007", "U+0007 at position 4"),
    ("lone \ud800 surrogate", "lone surrogate at position 5"),
])
def test_control_characters_and_bad_unicode_are_422(live, text, fragment):
    import json as _json
    body = _json.dumps({"inputs": ["fine", text]})  # ensure_ascii escapes keep the JSON itself valid
    response = live.post("/v1/infer", content=body, headers={"content-type": "application/json"})
    error = assert_error(response, 422, "invalid_request")
    assert "input 1" in error["message"] and fragment in error["message"]


@pytest.mark.parametrize("pair, fragment", [
    ("   ", "input 1's text_pair is empty or only whitespace"),
    ("tab\u0000nul", "input 1's text_pair has control character U+0000 at position 3"),
])
def test_a_refused_text_pair_is_named_as_the_pair(live, pair, fragment):
    inputs = [{"text": "fine", "text_pair": "fine"}, {"text": "fine", "text_pair": pair}]
    error = assert_error(live.post("/v1/infer", json={"inputs": inputs}), 422, "invalid_request")
    assert fragment in error["message"]


@pytest.mark.parametrize("body, location, choices", [
    ({"inputs": ["x"], "aggregation": "simple"}, "aggregation", "'average', 'first', 'max', 'none'"),
    ({"inputs": ["x"], "truncate": True, "truncation_direction": "up"}, "truncation_direction", "'left', 'right'"),
])
def test_a_value_outside_a_fields_choices_is_answered_with_the_choices(live, body, location, choices):
    error = assert_error(live.post("/v1/infer", json=body), 422, "invalid_request")
    assert error["message"].endswith(f"(expected one of {choices})")
    assert error["problems"][0]["location"] == location


def test_invalid_utf8_body_is_422(live):
    response = live.post("/v1/infer", content=b'{"inputs": ["caf\xe9"]}', headers={"content-type": "application/json"})
    assert_error(response, 422, "invalid_request")


def test_tabs_and_newlines_are_fine(live):
    assert infer(live, ["line one\n\tline two\r\n"], "ner").status_code == 200
