"""A store that changes under a running server (issue 38, items 1 and 2), against real `tmod-serve`
processes: reloads while a module's weights file is rewritten in place (as `cp` does: truncate, then
write) or replaced by rename, alternating between the checked weights and a copy with the classifier
rows swapped. Every reload answers 200 or 409, the server never dies, and every answer after a 200
reload is the checked weights' answer: a file is hashed and parsed from the same bytes, never
memory-mapped (a truncation under a memory map ends the process with SIGBUS). One server per
`--workers` value serves both ways of rewriting, one after the other."""
from __future__ import annotations

import os
import threading

import httpx
import pytest
import torch

from modules_store import ModuleStore
from modules_store.store import WEIGHTS_FILE
from server.modules import save_module
from bench.live_server import rewrite_until, rows_swapped
from tests.helpers import random_head, start_tmod_serve

TOKEN = "race-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
TEXTS = ["A fine film.", "Dreadful, long and loud."]
RELOADS = 25


def positive(client) -> list[float]:
    body = client.post("/v1/infer", params={"tasks": "sentiment"}, json={"inputs": TEXTS}).raise_for_status().json()
    return [r["sentiment"]["scores"]["positive"] for r in body["results"]]


@pytest.fixture(scope="module", params=[1, pytest.param(2, marks=pytest.mark.slow)])  # --workers 2: ~1 min a test
def race_server(request, tmp_path_factory, tiny_backbone_dir, tiny_backbone):
    """One `tmod-serve --workers N` for both ways of rewriting (each test leaves the checked weights
    loaded): its store's sentiment module, the weights file, and the two versions written over it."""
    store = ModuleStore(tmp_path_factory.mktemp("race-store"))
    # a 16 MB head (k=1024 attention): big enough that reading it takes as long as the writer's turn
    head = random_head(tiny_backbone, "sequence_classification", ["negative", "positive"], 1,
                       project_dim=1024, attention_heads=2)
    with torch.no_grad():  # answers far from 0.5, so a swapped classifier shows in every score
        head.classifier.classifier.weight.mul_(50)
    target = save_module(store, "sentiment", "1", head, tiny_backbone) / WEIGHTS_FILE
    checked = target.read_bytes()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMOD_ADMIN_TOKEN": TOKEN}
    url, process = start_tmod_serve(["--backbone", str(tiny_backbone_dir), "--store", str(store.root),
                                     "--tasks", "sentiment", "--workers", str(request.param),
                                     "--head-precision", "fp32"], env)
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            expected = positive(client)  # the checked weights' answers, before any rewrite
        assert all(abs(p - 0.5) > 0.05 for p in expected), expected
        yield url, process, target, [checked, rows_swapped(checked)], expected
    finally:
        process.terminate()
        process.wait(timeout=60)


@pytest.mark.parametrize("how", ["in_place", "rename"])
def test_reloads_while_the_weights_file_is_rewritten_never_crash_nor_serve_other_bytes(race_server, how):
    url, process, target, versions, expected = race_server
    checked = versions[0]
    stop = threading.Event()
    writer = threading.Thread(target=rewrite_until, args=(target, versions, how, stop, 3), daemon=True)
    statuses, wrong = [], []
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            assert positive(client) == pytest.approx(expected, abs=1e-4)  # the checked weights are loaded
            writer.start()
            for _ in range(RELOADS):
                try:
                    reload = client.post("/admin/modules/sentiment/reload", headers=AUTH)
                    statuses.append(reload.status_code)
                    if reload.status_code == 200:
                        got = positive(client)
                        if got != pytest.approx(expected, abs=1e-4):
                            wrong.append(got)
                    else:
                        assert reload.json()["error"]["type"].startswith("artifact_"), reload.text
                except httpx.TransportError as exc:
                    pytest.fail(f"the server went away after {len(statuses)} reloads ({exc!r}); exit status "
                                f"{process.wait(timeout=30)} (-7: SIGBUS)")
            stop.set()
            writer.join()
            target.write_bytes(checked)
            assert client.post("/admin/modules/sentiment/reload", headers=AUTH).status_code == 200
            assert positive(client) == pytest.approx(expected, abs=1e-4)
            assert client.get("/healthz").status_code == 200
    finally:  # the next test starts from the checked weights on disk
        stop.set()
        if writer.is_alive():
            writer.join(timeout=60)
        target.write_bytes(checked)
    assert set(statuses) <= {200, 409}, statuses
    assert statuses.count(200) > 0, statuses  # loads really ran while the file changed
    assert not wrong, f"{len(wrong)} of {statuses.count(200)} reloads served the swapped rows under the checked sha256"
