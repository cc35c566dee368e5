"""Foreign modules over HTTP: a module trained on another backbone serves through a bridge from the
bridge store, /v1/tasks shows the chain, and a broken bridge is refused without taking anything down."""
from __future__ import annotations

import shutil

import httpx
import pytest
import torch

from modules_store import ArtifactError, ModuleStore
from server.api.app import create_app
from server.bridges import bridge_store, save_bridge
from server.bridges.transformer import TransformerBridge
from server.config import Settings
from server.engine import Engine, run_head
from server.modules import save_module
from tests.helpers import NER_LABELS, LiveServer, populate_store, random_head

TEXTS = ["John Smith flew from Paris to New York on Monday.", "A fine, quiet film."]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_backbone, tiny_llama):
    """Store: the tiny BERT's own modules plus two modules trained on the tiny Llama; bridges: an
    (untrained, seeded) transformer bridge from the tiny BERT to the tiny Llama."""
    root = tmp_path_factory.mktemp("foreign")
    store = populate_store(root / "store", tiny_backbone)
    save_module(store, "llama-sentiment", "1",
                random_head(tiny_llama, "sequence_classification", ["negative", "positive"], 21), tiny_llama)
    save_module(store, "llama-ner", "1", random_head(tiny_llama, "token_classification", NER_LABELS, 22), tiny_llama)
    torch.manual_seed(0)
    bridge = TransformerBridge.for_backbones(tiny_backbone, tiny_llama, d_model=32, heads=2, ffn_dim=64,
                                             token_dim=16, encoder_layers=1, decoder_layers=1).eval()
    bridges = bridge_store(root / "bridges")
    save_bridge(bridges, "bert-to-llama", "1", bridge, tiny_backbone, tiny_llama,
                training={"objective": "mse"})
    return store, bridges, bridge


@pytest.fixture(scope="module")
def live(setup, tiny_backbone):
    store, bridges, _ = setup
    settings = Settings(store=store.root, bridges=bridges.root, head_precision="fp32",  # answers compared across
                        admin_token="admin")  # paths: fp32 heads (16-bit heads round differently when grouped)
    with LiveServer(create_app(settings, backbone=tiny_backbone)) as server:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            yield client


def test_tasks_show_the_chain(live):
    tasks = {t["task"]: t for t in live.get("/v1/tasks").json()["tasks"]}
    assert tasks["sentiment"]["served_through"] is None
    via = tasks["llama-sentiment"]["served_through"]
    assert via["bridge"] == "bert-to-llama" and via["kind"] == "transformer" and via["objective"] == "mse"
    assert len(via["chain"]) == 3 and via["chain"][1] == "bridge bert-to-llama/1"
    assert tasks["llama-ner"]["backbone"]["architecture"] == "LlamaModel"


def test_the_admin_listing_names_every_backbone_whose_modules_load_here(live, tiny_backbone, tiny_llama):
    """What `tmod-train --load-into` checks before training a head on a backbone: the server's own and
    the bridged one (tiny Llama) are listed."""
    listing = live.get("/admin/modules", headers={"authorization": "Bearer admin"}).json()
    assert listing["modules_of"] == {tiny_backbone.fingerprint.short: tiny_backbone.name,
                                     tiny_llama.fingerprint.short: tiny_llama.name}
    assert listing["tasks"]["llama-ner"] == "1"


def test_foreign_answers_equal_bridge_plus_module_by_hand(live, setup, tiny_backbone, tiny_llama):
    store, _, bridge = setup
    body = live.post("/v1/infer", params={"tasks": "llama-ner,llama-sentiment,sentiment"},
                     json={"inputs": TEXTS}).json()
    # by hand: the bridge on the tiny BERT's states, then the module on the bridged states
    batch = tiny_backbone.tokenize(TEXTS)
    head = ModuleStore(store.root).load("llama-sentiment")
    from server.heads import build_head

    sentiment = build_head(head.manifest, head.weights)
    with torch.inference_mode():
        target_batch, states = bridge.finish(_fold(bridge, tiny_backbone, batch), batch)
        probs = torch.softmax(run_head(sentiment, target_batch, states), -1)
    for row, result in enumerate(body["results"]):
        got = result["llama-sentiment"]
        label = int(probs[row].argmax())
        assert got["label"] == ["negative", "positive"][label]
        assert got["score"] == pytest.approx(float(probs[row, label]), abs=1e-5)
        for entity in result["llama-ner"]["entities"]:  # decoded on the Llama tokenization: offsets slice the text
            assert TEXTS[row][entity["start"]:entity["end"]] == entity["text"]
        assert "sentiment" in result


def _fold(bridge, backbone, batch):
    state = bridge.start(batch)
    with torch.inference_mode():
        for index, hidden in backbone.stream(batch, upto=max(bridge.layers_read())):
            if index in bridge.layers_read():
                state = bridge.consume(state, index, hidden)
    return state


def test_one_bridge_pass_serves_every_foreign_module(setup, tiny_backbone):
    """The plan reads the backbone once and runs the bridge once for both foreign modules."""
    from server.bridges import load_bridge
    from server.modules import load_module

    store, bridges, _ = setup
    loaded = {"bert-to-llama": load_bridge(bridges, "bert-to-llama", None, tiny_backbone)}
    modules = {t: load_module(store, t, None, tiny_backbone, bridges=loaded) for t in ("llama-ner", "llama-sentiment", "ner")}
    calls = []
    bridge = loaded["bert-to-llama"].bridge
    original = bridge.finish
    bridge.finish = lambda *a: calls.append(1) or original(*a)
    try:
        Engine(tiny_backbone, bridges=loaded).predict(tiny_backbone.tokenize(TEXTS), modules)
    finally:
        del bridge.finish
    assert calls == [1]


def test_a_module_is_served_through_the_bridge_made_for_it(setup, tiny_backbone, tiny_llama, tmp_path):
    """Several bridges lead to one backbone: a bridge distilled through this very module serves it,
    else one made for no module in particular, never one lacking a state it reads; by name within
    each. It was the first by name: here a bridge distilled through another module, for both."""
    from server.bridges import load_bridge
    from server.modules import load_module

    store = setup[0]
    mine = store.read_manifest("llama-sentiment").weights_sha256
    bridges = bridge_store(tmp_path / "bridges")
    made = {"a-for-another-module": ({"objective": "distill", "module": {"weights_sha256": "0" * 64}}, None),
            "b-two-states": ({"objective": "mse"}, [0, 1]),
            "c-for-llama-sentiment": ({"objective": "distill", "module": {"weights_sha256": mine}}, None),
            "d-mse": ({"objective": "mse"}, None)}
    for name, (training, target_layers) in made.items():
        torch.manual_seed(0)
        bridge = TransformerBridge.for_backbones(tiny_backbone, tiny_llama, target_layers=target_layers, d_model=32,
                                                 heads=2, ffn_dim=64, token_dim=16, encoder_layers=1, decoder_layers=1)
        save_bridge(bridges, name, "1", bridge.eval(), tiny_backbone, tiny_llama, training=training)
    loaded = {name: load_bridge(bridges, name, None, tiny_backbone) for name in made}
    assert load_module(store, "llama-sentiment", None, tiny_backbone, bridges=loaded).bridge == "c-for-llama-sentiment"
    assert load_module(store, "llama-ner", None, tiny_backbone, bridges=loaded).bridge == "d-mse"
    only = {name: loaded[name] for name in ("a-for-another-module", "b-two-states")}
    assert load_module(store, "llama-ner", None, tiny_backbone, bridges=only).bridge == "a-for-another-module"
    with pytest.raises(ArtifactError, match=r"reads states \[0, 1, 2, 3\] of .*, which no loaded bridge produces "
                                            r"\(b-two-states produces \[0, 1\]\)"):
        load_module(store, "llama-ner", None, tiny_backbone, bridges={"b-two-states": loaded["b-two-states"]})


@pytest.mark.parametrize("bridged, level, said", [
    (0.5, "WARNING", "accuracy 0.500 through it, 0.900 on its own backbone, 0.550 for the majority answer: no better "
                     "than it)"),
    (0.8, "INFO", "accuracy 0.800 through it, 0.900 on its own backbone, 0.550 for the majority answer)")])
def test_a_bridged_module_s_load_line_says_what_its_bridge_measured_of_it(setup, tiny_backbone, tiny_llama, tmp_path,
                                                                         caplog, bridged, level, said):
    """A foreign module's load line named the bridge only: one made through this very module says what its
    training measured of it (a warning where that is no better than the majority answer); one made for no
    module in particular says its accuracy is unmeasured and what measures it."""
    import logging

    store = setup[0]
    bridges = bridge_store(tmp_path / "bridges")
    mine = store.read_manifest("llama-sentiment").weights_sha256
    made = {"distilled": ({"objective": "distill", "module": {"weights_sha256": mine}, "data": {"validation_texts": 40}},
                          {"accuracy": bridged, "teacher_accuracy": 0.9, "majority_accuracy": 0.55}),
            "plain": ({"objective": "mse"}, {"cosine": 0.5})}
    for name, (training, metrics) in made.items():
        torch.manual_seed(0)
        bridge = TransformerBridge.for_backbones(tiny_backbone, tiny_llama, d_model=32, heads=2, ffn_dim=64,
                                                 token_dim=16, encoder_layers=1, decoder_layers=1)
        save_bridge(bridges, name, "1", bridge.eval(), tiny_backbone, tiny_llama, training=training, metrics=metrics)
    with caplog.at_level(logging.INFO, logger="tmod"):
        with LiveServer(create_app(Settings(store=store.root, bridges=bridges.root), backbone=tiny_backbone)) as server:
            described = httpx.get(server.url + "/v1/tasks/llama-sentiment").json()
    # /v1/tasks says it too, beside the module's own metrics (measured on its own backbone)
    assert described["served_through"]["measured"] == f"on the bridge's 40 validation texts: {said}".removesuffix(")")
    lines = {r.getMessage().split(" loaded")[0]: r for r in caplog.records if " loaded through bridge " in r.getMessage()}
    sentiment, ner = lines["module llama-sentiment/1"], lines["module llama-ner/1"]
    assert sentiment.levelname == level and sentiment.getMessage() == (
        f"module llama-sentiment/1 loaded through bridge distilled (on the bridge's 40 validation texts: {said}")
    assert ner.levelname == "INFO" and ner.getMessage() == (
        "module llama-ner/1 loaded through bridge plain (its accuracy through the bridge is unmeasured: tmod-train "
        "eval --bridges measures it)")


def test_broken_bridge_is_refused_and_the_rest_serves(setup, tiny_backbone, tmp_path):
    store, bridges, _ = setup
    broken = bridge_store(tmp_path / "bridges")
    shutil.copytree(bridges.root / "bert-to-llama", broken.root / "bert-to-llama")
    weights = broken.root / "bert-to-llama" / "1" / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    settings = Settings(store=store.root, bridges=broken.root)
    with LiveServer(create_app(settings, backbone=tiny_backbone)) as server:
        ready = httpx.get(server.url + "/readyz").json()
        assert "checksum" in str(ready).lower()
        assert "llama-sentiment" not in ready["tasks"] and "sentiment" in ready["tasks"]
        refused = httpx.post(server.url + "/v1/infer", params={"tasks": "llama-sentiment"}, json={"inputs": ["x y"]})
        assert refused.status_code == 400 and "llama-sentiment" in refused.text
        assert httpx.post(server.url + "/v1/infer", params={"tasks": "sentiment"}, json={"inputs": ["x y"]}).status_code == 200


def test_a_plan_with_foreign_modules_replays_its_native_part(setup, tiny_backbone):
    """With graphs (the CPU's stand-in capture), warm-up captures the native part of a module set
    with foreign modules; a batch asking for all of them replays it for the native tasks and runs
    the bridge eager on the unpadded rows: the answers of one eager pass."""
    from server.bridges import load_bridge
    from server.modules import load_module
    from server.runner.model_runner import ModelRunner
    from tests.test_runner import assert_same_answers, record_eager, sorted_rows

    store, bridges, _ = setup
    loaded = {"bert-to-llama": load_bridge(bridges, "bert-to-llama", None, tiny_backbone)}
    modules = {t: load_module(store, t, None, tiny_backbone, bridges=loaded)
               for t in ("ner", "sentiment", "llama-ner", "llama-sentiment")}
    engine, ref = Engine(tiny_backbone, bridges=loaded), []
    capture, made = record_eager(engine, ref)
    runner = ModelRunner(engine, Settings(batch_shapes="buckets", graph_batch_sizes="4", graph_seq_lens="32,64",
                                          head_precision="fp32"), capture=capture)
    ref.append(runner)
    runner.warm_up(modules)
    assert made and {frozenset(heads) for heads in made} == {frozenset({"ner", "sentiment"})}
    rows = sorted_rows(tiny_backbone, TEXTS)
    got = runner.run(rows, modules)
    assert runner.graphs.replays == 1
    want = Engine(tiny_backbone, bridges=loaded).predict(tiny_backbone.collate(rows), modules)
    assert_same_answers(got, want)


def test_a_bridge_written_into_the_store_while_serving_serves_from_the_next_load(setup, tiny_backbone, tiny_llama,
                                                                                 tmp_path):
    """An operator adds a bridge to a running server's bridge store: the admin load of a module it
    serves finds it, no restart; until then the load says no bridge leads there. A bridge refused at
    start (broken) and mended in the store is tried again the same way."""
    store, bridges, _ = setup
    added = bridge_store(tmp_path / "bridges")
    added.root.mkdir(parents=True)
    admin = {"authorization": "Bearer admin"}
    settings = Settings(store=store.root, bridges=added.root, admin_token="admin")
    with LiveServer(create_app(settings, backbone=tiny_backbone)) as server:
        assert "llama-sentiment" not in httpx.get(server.url + "/readyz").json()["tasks"]
        before = httpx.post(server.url + "/admin/modules/llama-sentiment/load", headers=admin)
        assert before.status_code == 409 and "no loaded bridge" in before.json()["error"]["message"]

        shutil.copytree(bridges.root / "bert-to-llama", added.root / "bert-to-llama")
        loaded = httpx.post(server.url + "/admin/modules/llama-sentiment/load", headers=admin)
        assert loaded.status_code == 200, loaded.text
        answer = httpx.post(server.url + "/v1/infer", params={"tasks": "llama-sentiment,sentiment"},
                            json={"inputs": TEXTS})
        assert answer.status_code == 200 and answer.json()["tasks"]["llama-sentiment"] == "1"
        task = httpx.get(server.url + "/v1/tasks/llama-sentiment").json()
        assert task["served_through"]["bridge"] == "bert-to-llama"
        listing = httpx.get(server.url + "/admin/modules", headers=admin).json()
        assert tiny_llama.fingerprint.short in listing["modules_of"]


def test_a_bridge_refused_at_start_and_mended_serves_from_the_next_load(setup, tiny_backbone, tmp_path):
    store, bridges, _ = setup
    mended = bridge_store(tmp_path / "bridges")
    shutil.copytree(bridges.root / "bert-to-llama", mended.root / "bert-to-llama")
    weights = mended.root / "bert-to-llama" / "1" / "weights.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
    admin = {"authorization": "Bearer admin"}
    with LiveServer(create_app(Settings(store=store.root, bridges=mended.root, admin_token="admin"),
                               backbone=tiny_backbone)) as server:
        assert "bridge:bert-to-llama" in httpx.get(server.url + "/readyz").json()["refused"]
        weights.write_bytes(good)
        loaded = httpx.post(server.url + "/admin/modules/llama-ner/load", headers=admin)
        assert loaded.status_code == 200, loaded.text
        ready = httpx.get(server.url + "/readyz").json()
        assert "bridge:bert-to-llama" not in ready["refused"] and "llama-ner" in ready["tasks"]
