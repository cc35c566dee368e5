"""End to end on the real all-mpnet-base-v2 (slow; skipped when its five packages are not installed):
the named backbone loads from the parts, streams the Hugging Face forward's states, and the real
`tmod-serve --backbone mpnet` serves the shipped store's MPNet modules (and only those) over loopback."""
from __future__ import annotations

import os
import httpx
import pytest
import torch

from modules_store import DEFAULT_STORE, ModuleStore
from server.backbone import Backbone
from server.backbone.sources import mpnet_parts
from tests.helpers import start_tmod_serve

pytestmark = pytest.mark.slow

try:
    mpnet_parts()
    MISSING = None
except FileNotFoundError as exc:
    MISSING = str(exc)


@pytest.fixture(scope="module")
def mpnet():
    if MISSING:
        pytest.skip(MISSING)
    return Backbone.load("mpnet")


def mpnet_modules() -> dict[str, str]:
    """Shipped modules trained on all-mpnet-base-v2 that a start-up serves: task -> version (a task whose
    newest version is opt-in, docs/quality.md, is left out)."""
    store = ModuleStore(DEFAULT_STORE)
    found = {}
    for task in store.tasks():
        for version in store.versions(task):
            if store.read_manifest(task, version).backbone.name == "all-mpnet-base-v2":
                found[task] = version
    return {task: version for task, version in found.items() if not store.read_manifest(task, version).opt_in}


def test_real_mpnet_streams_the_hf_forward(mpnet):
    assert (mpnet.num_layers, mpnet.hidden_size, mpnet.fingerprint.architecture) == (12, 768, "MPNetForMaskedLM")
    batch = mpnet.tokenize(["Angela Merkel visited the Siemens plant in Munich.", "Great film!"],
                           ["She met the workers.", "I loved it."])
    reference = mpnet.all_states(batch)
    real = batch.attention_mask.bool()
    for ref, got in zip(reference, [h for _, h in mpnet.stream(batch)]):
        torch.testing.assert_close(got[real], ref[real], atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def served(mpnet):
    if not mpnet_modules():
        pytest.skip("no MPNet module in the shipped store")
    url, process = start_tmod_serve(["--backbone", "mpnet", "--log-level", "info"], {**os.environ, "HF_HUB_OFFLINE": "1"},
                                    ready_timeout=300)
    yield url
    process.terminate()
    process.wait(timeout=60)


def test_mpnet_server_serves_exactly_the_mpnet_tier(served, mpnet):
    ready = httpx.get(served + "/readyz", timeout=10).json()
    assert ready["refused"] == {} and ready["tasks"] == sorted(mpnet_modules())
    tasks = httpx.get(served + "/v1/tasks", timeout=10).json()["tasks"]
    assert {t["task"]: t["version"] for t in tasks} == mpnet_modules()
    assert all(t["backbone"]["name"] == "all-mpnet-base-v2" for t in tasks)
    text = "Angela Merkel visited the Siemens plant in Munich. What a wonderful, moving day."
    body = httpx.post(served + "/v1/infer", json={"inputs": [text]}, timeout=120).json()
    result = body["results"][0]
    assert body["model"]["backbone"] == "all-mpnet-base-v2"
    if "sentiment" in result:
        assert result["sentiment"]["label"] == "positive"
    if "ner" in result:
        found = {(e["text"], e["label"]) for e in result["ner"]["entities"]}
        assert ("Angela Merkel", "PER") in found and ("Munich", "LOC") in found
    if "entailment" in mpnet_modules():
        pair = {"text": "A man is playing a guitar on stage.", "text_pair": "A man is playing an instrument."}
        answer = httpx.post(served + "/v1/infer", params={"tasks": "entailment"}, json={"inputs": [pair]}, timeout=60)
        assert answer.status_code == 200 and answer.json()["results"][0]["entailment"]["label"] in (
            "entailment", "not_entailment")
