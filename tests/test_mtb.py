"""MTB and LoRA-MTB heads: initialisation, merged LoRA, sharing the backbone pass."""
from __future__ import annotations

import pytest
import torch

from modules_store import ArtifactError, ModuleStore
from server.backbone import Backbone
from server.engine import Engine
from server.heads.mtb import MTBHead
from server.modules import LoadedModule, load_module, save_module
from tests.helpers import NER_LABELS, random_head
from training.lora import TrainableLoraMTB

TEXTS = ["John Smith flew from Paris to New York on Monday.", "A fine, quiet film.", "ok"]


def as_modules(**heads):
    return {task: LoadedModule(task, "1", None, head) for task, head in heads.items()}


@pytest.mark.parametrize("backbone_name", ["tiny_backbone", "minilm"])
def test_mtb_from_last_block_reproduces_it(request, backbone_name):
    backbone = request.getfixturevalue(backbone_name)
    head = MTBHead.from_backbone(backbone, "sequence_classification", ["a", "b"]).eval()
    assert head.layers_read() == [backbone.num_layers - 1]
    batch = backbone.tokenize(TEXTS)
    states = backbone.all_states(batch)
    with torch.inference_mode():
        state = head.consume(head.start(batch), backbone.num_layers - 1, states[-2])
    torch.testing.assert_close(state["hidden"], states[-1], atol=1e-5, rtol=0)


def test_mtb_on_a_decoder_reproduces_its_last_block(tmp_path):
    """A Llama-style block (causal mask, rotary positions) copied into an MTB head, rebuilt from the
    manifest's config alone, gives the backbone's own last state."""
    from server.backbone import Backbone
    from tests.helpers import make_tiny_backbone_dir

    backbone = Backbone.load(make_tiny_backbone_dir(tmp_path, "llama"))
    head = MTBHead.from_backbone(backbone, "token_classification", NER_LABELS).eval()
    store = ModuleStore(tmp_path / "store")
    save_module(store, "ner", "1", head, backbone)
    loaded = load_module(store, "ner", "1", backbone).head
    batch = backbone.tokenize(TEXTS)
    states = [h for _, h in backbone.stream(batch)]
    real = batch.attention_mask.bool()
    for mtb in (head, loaded):
        with torch.inference_mode():
            state = mtb.consume(mtb.start(batch), backbone.num_layers - 1, states[-2])
        torch.testing.assert_close(state["hidden"][real], states[-1][real], atol=1e-5, rtol=0)


def test_mtb_round_trip_through_the_store(tmp_path, tiny_backbone):
    head = MTBHead.from_backbone(tiny_backbone, "token_classification", NER_LABELS, num_blocks=2).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # as if trained: differ from the backbone's blocks
    store = ModuleStore(tmp_path)
    save_module(store, "ner", "1", head, tiny_backbone)
    loaded = load_module(store, "ner", None, tiny_backbone)
    assert loaded.manifest.kind == "mtb" and loaded.manifest.config["copied_from"] == [1, 2]
    batch = tiny_backbone.tokenize(TEXTS)
    engine = Engine(tiny_backbone)
    torch.testing.assert_close(engine.logits(batch, {"ner": loaded})["ner"],
                               engine.logits(batch, as_modules(ner=head))["ner"], atol=1e-6, rtol=0)


def trained_lora(backbone, seed=0):
    torch.manual_seed(seed)
    head = TrainableLoraMTB.from_backbone(backbone, "sequence_classification", ["neg", "pos"], rank=4,
                                          lora_alpha=8.0).eval()
    with torch.no_grad():  # as if trained: B starts at zero in LoRA, give it values
        for name, p in head.named_parameters():
            if "lora_" in name or "task_layer" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    return head


@pytest.mark.parametrize("backbone_name", ["tiny_backbone", "tiny_llama", "minilm"])
def test_merged_lora_equals_unmerged_training_model(request, tmp_path, backbone_name):
    backbone = request.getfixturevalue(backbone_name)
    head = trained_lora(backbone)
    store = ModuleStore(tmp_path)
    save_module(store, "sentiment", "1", head, backbone)
    stored = set(store.load("sentiment").weights)
    assert all(k.startswith(("lora.", "task_layer.")) for k in stored)  # factors + task layer only
    loaded = load_module(store, "sentiment", None, backbone)
    assert type(loaded.head).__name__ == "LoraMTBHead"
    assert loaded.manifest.config["targets"] == [n for n, m in backbone.adapter.layers[-1].named_modules()
                                                 if isinstance(m, torch.nn.Linear)]  # every linear of the block
    assert not any("lora" in name for name, _ in loaded.head.named_modules())  # merged: plain linears
    batch = backbone.tokenize(TEXTS)
    engine = Engine(backbone)
    served = engine.logits(batch, {"s": loaded})["s"]
    training = engine.logits(batch, as_modules(s=head))["s"]
    torch.testing.assert_close(served, training, atol=1e-5, rtol=0)
    untouched = MTBHead.from_backbone(backbone, "sequence_classification", ["neg", "pos"]).eval()
    untouched.task_layer.load_state_dict(head.task_layer.state_dict())
    assert (engine.logits(batch, as_modules(s=untouched))["s"] - served).abs().max() > 1e-4  # LoRA mattered


def test_lora_mtb_refuses_wrong_rank(tmp_path, tiny_backbone):
    store = ModuleStore(tmp_path)
    save_module(store, "sentiment", "1", trained_lora(tiny_backbone), tiny_backbone)
    import json
    path = store.path("sentiment", "1") / "manifest.json"
    data = json.loads(path.read_text())
    data["config"]["rank"] = 8
    path.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="do not fit .* at rank 8"):
        load_module(store, "sentiment", None, tiny_backbone)


def test_mtb_and_layermix_in_one_pass_equal_each_alone(tiny_backbone):
    mtb = MTBHead.from_backbone(tiny_backbone, "sequence_classification", ["a", "b"]).eval()
    lora = trained_lora(tiny_backbone, seed=3)
    mix = random_head(tiny_backbone, "token_classification", NER_LABELS, seed=4)
    batch = tiny_backbone.tokenize(TEXTS)
    engine = Engine(tiny_backbone)
    together = engine.logits(batch, as_modules(mtb=mtb, lora=lora, mix=mix))
    for task, head in (("mtb", mtb), ("lora", lora), ("mix", mix)):
        alone = engine.logits(batch, as_modules(**{task: head}))[task]
        torch.testing.assert_close(together[task], alone, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind, extra", [
    ("mtb", ["--lr", "0.003"]),
    ("lora-mtb", ["--lr", "0.01", "--rank", "4", "--targets", "attention.self.query,attention.self.value"]),
])
def test_tmod_train_mtb_kinds_learn_and_ship_loadable_artifacts(tmp_path, train_backbone_dir, train_backbone, kind, extra):
    from tests.test_training_trainer import write_sentiment
    from training.cli import main

    train_file = write_sentiment(tmp_path / "train.tsv", 48, 0)
    validation_file = write_sentiment(tmp_path / "validation.tsv", 24, 1)
    argv = [kind, "--train", str(train_file), "--validation", str(validation_file), "--text-column", "sentence",
            "--label-column", "label", "--label-map", "0=negative,1=positive", "--labels", "negative,positive",
            "--backbone", str(train_backbone_dir), "--task", "sentiment", "--store", str(tmp_path / "store"),
            "--report-dir", str(tmp_path / "report"), "--epochs", "5", "--patience", "10", "--batch-size", "8",
            "--no-progress", *extra]
    assert main(argv) == 0
    module = load_module(ModuleStore(tmp_path / "store"), "sentiment", "1", train_backbone)
    manifest = module.manifest
    assert manifest.kind == kind and manifest.layers == [train_backbone.num_layers - 1]
    history = manifest.training["history"]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    # it reads one fixed state: no "learned layer distribution" plot of a single bar at 1.00
    report = tmp_path / "report"
    assert (report / "curves.png").is_file() and not (report / "layer_weights.png").exists()
    assert "layer_weights" not in history[0]
    assert f"reads backbone state L{train_backbone.num_layers - 1} (the input of its copied blocks: fixed, not learnt)" \
        in (report / "report.md").read_text()
    training = manifest.training
    if kind == "lora-mtb":
        # only factors and the task layer are trained and stored; serving merges them into full blocks
        assert training["trainable_parameters"] == training["artifact_parameters"] < training["parameters"]
        assert manifest.config["targets"] == ["attention.self.query", "attention.self.value"]
    else:
        assert training["trainable_parameters"] == training["parameters"]


def test_block_heads_refuse_blocks_and_targets_the_backbone_lacks_in_one_line(tmp_path, train_backbone_dir, capsys):
    """--source-layer past the last block and --targets naming no linear were tracebacks (a ValueError,
    peft's NoMatchingPeftModuleError); --blocks past the backbone was '--source-layer: Input should be
    greater than or equal to 0'. A target's last parts ('query') name the full linear, as peft reads
    them (the artifact stored it under the short name and failed: 'BertLayer has no attribute query')."""
    from tests.test_training_trainer import write_sentiment
    from training.cli import main

    files = write_sentiment(tmp_path / "train.tsv", 24, 0), write_sentiment(tmp_path / "validation.tsv", 12, 1)
    argv = ["--train", str(files[0]), "--validation", str(files[1]), "--text-column", "sentence", "--label-column",
            "label", "--labels", "negative,positive", "--label-map", "0=negative,1=positive", "--backbone",
            str(train_backbone_dir), "--store", str(tmp_path / "store"), "--no-progress"]
    for kind, extra, said in (
            ("mtb", ["--blocks", "9"], "--blocks 9: tiny-bert has 2 blocks (state N is the input of block N + 1), so "
                                       "at most --blocks 2"),
            ("mtb", ["--source-layer", "2"], "--blocks 1 from --source-layer 2: tiny-bert has 2 blocks (state N is the "
                                             "input of block N + 1), so at most --source-layer 1"),
            ("lora-mtb", ["--targets", "bogus,query"], "--targets bogus: not a linear layer of tiny-bert's blocks; "
                                                       "they are attention.self.query, ")):
        assert main([kind, *argv, *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"tmod-train {kind}: error: {said}") and err.count("\n") == 1, err
    head = TrainableLoraMTB.from_backbone(Backbone.load(train_backbone_dir), "sequence_classification", ["a", "b"],
                                          targets=["query", "output.dense"])
    assert head.config.targets == ["attention.self.query", "attention.output.dense", "output.dense"]


def with_casing(head):
    """`head` (an MTB or a LoRA-MTB in training form) given a casing embedding with values, as if trained."""
    head.casing = torch.nn.Embedding(5, head.config.hidden_size)
    head.config = head.config.model_copy(update={"casing": True})
    with torch.no_grad():
        head.casing.weight.copy_(torch.randn_like(head.casing.weight))
    return head.eval()


@pytest.mark.parametrize("kind", ["mtb", "lora-mtb"])
def test_casing_is_read_from_the_raw_text_and_survives_the_store(tmp_path, tiny_backbone, kind):
    """The tokenizer lowercases: only the casing embedding tells 'Paris' from 'paris'. A fresh one is zero (the
    blocks start as the backbone's); a trained one is stored (LoRA-MTB: beside its factors) and served as trained,
    alone or grouped with an MTB without casing."""
    fresh = MTBHead.from_backbone(tiny_backbone, "token_classification", NER_LABELS, casing=True).eval()
    assert fresh.token_classes_read() == {"casing"}
    batch = tiny_backbone.tokenize(TEXTS)
    states = tiny_backbone.all_states(batch)
    with torch.inference_mode():
        state = fresh.consume(fresh.start(batch), tiny_backbone.num_layers - 1, states[-2])
    torch.testing.assert_close(state["hidden"], states[-1], atol=1e-5, rtol=0)

    torch.manual_seed(1)
    if kind == "mtb":
        head = with_casing(MTBHead.from_backbone(tiny_backbone, "token_classification", NER_LABELS))
    else:
        head = TrainableLoraMTB.from_backbone(tiny_backbone, "token_classification", NER_LABELS, rank=4, casing=True)
        with torch.no_grad():
            for name, p in head.named_parameters():
                if "lora_" in name or "task_layer" in name or "casing" in name:
                    p.copy_(torch.randn_like(p) * 0.05)
        head.eval()
    engine = Engine(tiny_backbone)
    cased, lowered = (tiny_backbone.tokenize([text]) for text in ("Alice met Bob in Paris.", "alice met bob in paris."))
    assert torch.equal(cased.input_ids, lowered.input_ids)
    assert (engine.logits(cased, as_modules(ner=head))["ner"] - engine.logits(lowered, as_modules(ner=head))["ner"]
            ).abs().max() > 1e-3
    store = ModuleStore(tmp_path)
    save_module(store, "ner", "1", head, tiny_backbone)
    if kind == "lora-mtb":
        assert "casing.weight" in store.load("ner").weights
    loaded = load_module(store, "ner", None, tiny_backbone)
    assert loaded.manifest.kind == kind and loaded.head.config.casing
    other = MTBHead.from_backbone(tiny_backbone, "token_classification", NER_LABELS).eval()
    together = engine.logits(batch, {"ner": loaded, **as_modules(other=other)})
    torch.testing.assert_close(together["ner"], engine.logits(batch, as_modules(ner=head))["ner"], atol=1e-5, rtol=0)
    torch.testing.assert_close(together["other"], engine.logits(batch, as_modules(other=other))["other"],
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["mtb", "lora-mtb"])
def test_tmod_train_mtb_kinds_on_a_token_task_read_casing_by_default(tmp_path, train_backbone_dir, train_backbone,
                                                                      kind):
    from tests.test_training_trainer import write_conll
    from training.cli import main

    train_file, validation_file = write_conll(tmp_path / "train.txt", 40, 0), write_conll(tmp_path / "val.txt", 12, 1)
    argv = [kind, "--train", str(train_file), "--validation", str(validation_file), "--backbone",
            str(train_backbone_dir), "--task", "ner", "--store", str(tmp_path / "store"), "--report-dir",
            str(tmp_path / "report"), "--epochs", "3", "--patience", "10", "--batch-size", "8", "--lr", "0.003",
            "--document-windows", "64", "--no-progress"]
    assert main(argv) == 0
    module = load_module(ModuleStore(tmp_path / "store"), "ner", "1", train_backbone)
    manifest = module.manifest
    assert manifest.kind == kind and manifest.config["casing"] and module.head.token_classes_read() == {"casing"}
    assert manifest.training["history"][-1]["train_loss"] < manifest.training["history"][0]["train_loss"]
    assert manifest.training["data"]["document_window_examples"]["64"] >= 1
    assert {"precision", "recall", "f1"} <= set(manifest.metrics)
    assert main([*argv, "--version", "2", "--no-casing", "--epochs", "1"]) == 0
    assert not load_module(ModuleStore(tmp_path / "store"), "ner", "2", train_backbone).head.config.casing
