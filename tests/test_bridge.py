"""The transformer bridge (server/bridges/transformer.py) and its training (training/bridges/transformer.py).

Tiny random backbones (the real MiniLM tokenizer), CPU, seeded: a rotation the MSE objective must
learn, distillation through a frozen foreign module, artifacts that round-trip (and refuse damage),
the streamed path equal to the training path, and a served foreign module through the Engine.
"""
from __future__ import annotations

import copy
import json
import random
import shutil

import pytest
import torch

from modules_store import ArtifactError, ModuleStore
from server.backbone import Backbone
from server.bridges import BRIDGE_KINDS, bridge_store, load_bridge, save_bridge
from server.bridges.transformer import TransformerBridge
from server.engine import Engine
from server.modules import load_module, save_module
from tests.helpers import NER_LABELS, make_tiny_backbone_dir, random_head
from training.bridges.pairing import PairedStates
from training.bridges.transformer import (BridgeSettings, bridge_verdict, ModuleProbe, evaluate, fit_bridge, state_statistics,
                                          train_bridge)

WORDS = ("the a cat dog house river green small quick slow runs sleeps eats over under near city music "
         "film good bad very not movie story plot actor great terrible boring fun long short red blue "
         "Paris London John Mary bank money water tree old new loud quiet happy sad").split()
SMALL = dict(d_model=64, heads=2, encoder_layers=1, decoder_layers=1, ffn_dim=128, token_dim=16, dropout=0.0)


def make_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))) for _ in range(n)]


def stream_states(backbone: Backbone, batch, layers) -> dict[int, torch.Tensor]:
    return {i: h.clone() for i, h in backbone.stream(batch) if i in layers}


def streamed(bridge, backbone: Backbone, batch):
    """What the server does: start, consume each state as the backbone streams it, finish."""
    state = bridge.start(batch)
    for index, hidden in backbone.stream(batch):
        if index in bridge.layers_read():
            state = bridge.consume(state, index, hidden)
    return bridge.finish(state, batch)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Small tensors: one thread is faster, and far faster when other jobs share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def source(tiny_backbone):
    return tiny_backbone  # BERT, 3 layers, 32 wide


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_backbone_dir(tmp_path_factory.mktemp("bridge_target"), "llama", layers=3, seed=1)


@pytest.fixture(scope="module")
def target(target_dir):
    return Backbone.load(target_dir)  # Llama decoder, 3 layers, 32 wide


def settings(**values) -> BridgeSettings:
    base = dict(lr=1e-3, batch_size=16, epochs=1000, patience=1000, warmup_steps=20, progress=False, **SMALL)
    return BridgeSettings(**{**base, **values})


def fresh_bridge(source, target, source_layers, target_layers, train_pairs=None, seed=0) -> TransformerBridge:
    torch.manual_seed(seed)
    bridge = TransformerBridge.for_backbones(source, target, source_layers, target_layers, **SMALL)
    if train_pairs is not None:
        bridge.set_standardisation(state_statistics(train_pairs, "source"), state_statistics(train_pairs, "target"))
    return bridge


# ---- (a) the MSE objective learns a known map ---------------------------------------------------
def test_mse_objective_learns_a_rotation_of_the_hidden_space(source, tmp_path):
    torch.manual_seed(123)
    rotation, _ = torch.linalg.qr(torch.randn(source.hidden_size, source.hidden_size))
    layers_in, layers_out = [0, 1, 2, 3], [2, 3]
    texts = make_texts(300)

    def rotated_pairs(chunk):
        pairs = PairedStates.build(chunk, source, source, layers_in, layers_out, progress=False, cache=False)
        for i in layers_out:  # the target: the same model in a rotated hidden space
            cache = pairs.target_cache.cache
            cache[i] = (cache[i].float() @ rotation).to(cache[i].dtype)
        return pairs

    train, val = rotated_pairs(texts[:240]), rotated_pairs(texts[240:])
    bridge = fresh_bridge(source, source, layers_in, layers_out, train)
    s = settings()
    fit = fit_bridge(bridge, train, val, s, probe=None, max_steps=300)
    after = evaluate(bridge, val, "validation", None, s, torch.device("cpu"))

    assert fit.initial["cosine"] < 0.6  # the untrained bridge is far off (the test can fail)
    assert after["log_mse"] < fit.initial["log_mse"] / 20
    assert after["cosine"] > 0.95
    # and directly: the bridged states are the rotated states of the source backbone
    batch = source.tokenize(texts[250:258])
    made_batch, made = streamed(bridge.eval(), source, batch)
    truth = stream_states(source, batch, layers_out)
    real = batch.attention_mask.bool()
    for i in layers_out:
        cos = torch.nn.functional.cosine_similarity(made[i], truth[i] @ rotation, dim=-1)[real]
        assert cos.mean() > 0.95 and cos.min() > 0.8


# ---- (b) distillation through a frozen foreign module --------------------------------------------
def test_distillation_moves_the_module_toward_its_outputs_on_real_states(source, target, tmp_path):
    store = ModuleStore(tmp_path / "store")
    save_module(store, "ner", "1", random_head(target, "token_classification", NER_LABELS, 6, casing=True), target)
    module = load_module(store, "ner", "1", target)  # on the TARGET backbone
    layers_in, layers_out = [0, 1, 2, 3], module.head.layers_read()
    texts = make_texts(300, seed=1)
    train = PairedStates.build(texts[:240], source, target, layers_in, layers_out, progress=False, cache=False)
    val = PairedStates.build(texts[240:], source, target, layers_in, layers_out, progress=False, cache=False)
    probe = ModuleProbe(module, {"train": train, "validation": val}, 64, torch.device("cpu"), progress=False)
    head_before = {k: v.clone() for k, v in module.head.state_dict().items()}

    bridge = fresh_bridge(source, target, layers_in, layers_out, train)
    s = settings(objective="distill", temperature=1.0)
    fit = fit_bridge(bridge, train, val, s, probe=probe, max_steps=300)
    best = fit.history[fit.best_epoch - 1]

    assert best["validation_kl"] < fit.initial["kl"] / 4
    assert best["validation_agreement"] > fit.initial["agreement"] + 0.05
    assert all(torch.equal(v, module.head.state_dict()[k]) for k, v in head_before.items())  # the head is frozen
    assert not any(p.requires_grad for p in module.head.parameters())
    # the validation numbers are those of the kept (best) weights
    again = evaluate(bridge, val, "validation", probe, s, torch.device("cpu"))
    assert again["kl"] == pytest.approx(best["validation_kl"], rel=1e-4, abs=1e-6)


# ---- (c) artifacts -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_bridge(tmp_path_factory, source, target):
    torch.manual_seed(0)
    bridge = TransformerBridge.for_backbones(source, target, [1, 2, 3], [0, 2, 3], **SMALL).eval()
    with torch.no_grad():  # non-trivial standardisation and mix, so a lost buffer would show
        bridge.source_mean.normal_()
        bridge.source_std.uniform_(0.5, 2.0)
        bridge.target_mean.normal_()
        bridge.target_std.uniform_(0.5, 2.0)
        bridge.mix_logits.normal_(std=0.05)
    bridge.requires_grad_(False)  # as load_bridge leaves it (frozen weights pick the same attention kernels)
    store = bridge_store(tmp_path_factory.mktemp("bridges"))
    folder = save_bridge(store, "tiny", "1", bridge, source, target, training={"objective": "mse"})
    return store, folder, bridge


def test_saved_bridge_loads_with_identical_outputs_and_target_tokenizer(saved_bridge, source, target):
    store, folder, bridge = saved_bridge
    assert BRIDGE_KINDS["transformer"] is TransformerBridge
    loaded = load_bridge(store, "tiny", "1", source)
    assert loaded.manifest.kind == "transformer"
    assert loaded.manifest.target_layers == [0, 2, 3] and loaded.manifest.source_layers == [1, 2, 3]
    assert loaded.manifest.target.identity() == target.fingerprint.identity()
    assert not loaded.bridge.training

    texts = ["John lives in Paris .", "a very good movie", "bad"]
    pairs = ["it is fine", "Mary agrees", "the end"]
    for args in ((texts, None), (texts, pairs)):
        mine, theirs = loaded.bridge.target_text.tokenize(*args), target.tokenize(*args)
        assert torch.equal(mine.input_ids, theirs.input_ids)
        assert torch.equal(mine.attention_mask, theirs.attention_mask)
        assert mine.offsets == theirs.offsets and mine.sequence_ids == theirs.sequence_ids
    assert loaded.bridge.target_text.max_tokens == target.max_tokens

    batch = source.tokenize(texts)
    with torch.no_grad():
        batch_a, out_a = streamed(bridge, source, batch)
        batch_b, out_b = streamed(loaded.bridge, source, batch)
    assert torch.equal(batch_a.input_ids, batch_b.input_ids)
    assert sorted(out_b) == [0, 2, 3]
    for i in out_a:
        assert torch.equal(out_a[i], out_b[i])


def test_damaged_bridge_artifacts_are_refused(saved_bridge, source, tmp_path):
    store, folder, _ = saved_bridge
    for damage in ("weights", "tokenizer"):
        copy_root = tmp_path / damage
        shutil.copytree(store.root, copy_root)
        copy = copy_root / "tiny" / "1"
        if damage == "weights":
            path = copy / "weights.safetensors"
            data = bytearray(path.read_bytes())
            data[-5] ^= 0xFF
            path.write_bytes(bytes(data))
        else:
            path = copy / "target_tokenizer" / "tokenizer.json"
            path.write_bytes(path.read_bytes() + b" ")  # still a valid tokenizer, but not the one vouched for
        with pytest.raises(ArtifactError) as caught:
            load_bridge(bridge_store(copy_root), "tiny", "1", source)
        assert caught.value.reason == "checksum_mismatch"


def test_bridge_for_another_source_is_refused(saved_bridge, target):
    store, _, _ = saved_bridge
    with pytest.raises(ArtifactError) as caught:
        load_bridge(store, "tiny", "1", target)  # served on the target instead of the source
    assert caught.value.reason == "fingerprint_mismatch"


def test_each_backbone_loads_the_newest_version_of_a_bridge_name_from_itself(saved_bridge, source, target, tmp_path,
                                                                             capsys):
    """A bridge name holding versions of two sources (tiny/1 from the source, tiny/2 back from the target):
    a server on the source skipped `tiny` ("it runs on" the target's backbone) for its newest version,
    as a task is not skipped for a module of another backbone; each backbone now loads its own newest."""
    from server.bridges import load_bridges_on
    from training.runs import say_if_bridge_outranked

    store, _, _ = saved_bridge
    store = bridge_store(shutil.copytree(store.root, tmp_path / "bridges"))
    back = TransformerBridge.for_backbones(target, source, [1, 2, 3], [0, 2, 3], **SMALL).eval()
    save_bridge(store, "tiny", "2", back, target, source, training={"objective": "mse"})
    for backbone, version in ((source, "1"), (target, "2")):
        loaded, skipped, refused = load_bridges_on(store, backbone)
        assert (loaded["tiny"].version, skipped, refused) == (version, {}, {})
    say_if_bridge_outranked(store, "tiny", "1")  # the one a server on its source loads: nothing to say
    assert capsys.readouterr().err == ""


# ---- (d) the streamed path is the training path ------------------------------------------------
def test_start_consume_finish_equals_forward_train(saved_bridge, source, target):
    _, _, bridge = saved_bridge
    texts = ["John lives in Paris .", "a very good movie indeed , said Mary", "bad"]
    for pairs in (None, ["it is fine", "Mary agrees", "the end of it all"]):
        batch = source.tokenize(texts, pairs)
        with torch.no_grad():
            made_batch, served = streamed(bridge, source, batch)
            trained = bridge.forward_train(stream_states(source, batch, bridge.layers_read()), batch,
                                           target.tokenize(texts, pairs))
        assert torch.equal(made_batch.input_ids, target.tokenize(texts, pairs).input_ids)
        assert made_batch.texts == texts and made_batch.text_pairs == pairs
        for i in bridge.states_out():
            assert served[i].shape == (len(texts), made_batch.seq_len, target.hidden_size)
            assert torch.allclose(served[i], trained[i], atol=1e-5, rtol=0)
    # as in training: trainable weights, gradients on (other attention kernels), still the same numbers
    trainable = copy.deepcopy(bridge).requires_grad_(True)
    batch = source.tokenize(texts)
    with torch.no_grad():
        _, served = streamed(bridge, source, batch)
    trained = trainable.forward_train(stream_states(source, batch, bridge.layers_read()), batch, target.tokenize(texts))
    for i in bridge.states_out():
        assert torch.allclose(served[i], trained[i], atol=1e-5, rtol=0)
    trained[3].pow(2).mean().backward()
    assert trainable.adapt_in.weight.grad is not None and trainable.mix_logits.grad is not None


def test_a_foreign_module_serves_through_the_bridge_in_the_engine(saved_bridge, source, target, tmp_path):
    store_b, _, bridge = saved_bridge
    loaded = load_bridge(store_b, "tiny", "1", source)
    modules = ModuleStore(tmp_path / "modules")
    head = random_head(target, "sequence_classification", ["negative", "positive"], 4, layers=[0, 2, 3])
    save_module(modules, "sentiment", "1", head, target)
    foreign = load_module(modules, "sentiment", "1", source, bridges={"tiny": loaded})
    assert foreign.bridge == "tiny"
    texts = ["a very good movie", "bad", "John lives in Paris ."]
    batch = source.tokenize(texts)
    logits, batches = Engine(source, bridges={"tiny": loaded}).run(batch, {"sentiment": foreign})
    with torch.no_grad():
        target_batch = target.tokenize(texts)
        states = bridge.forward_train(stream_states(source, batch, bridge.layers_read()), batch, target_batch)
        state = head.start(target_batch)
        for i in head.layers_read():
            state = head.consume(state, i, states[i])
        expected = head.finish(state, target_batch)
    assert torch.equal(batches["sentiment"].input_ids, target_batch.input_ids)
    assert torch.allclose(logits["sentiment"], expected, atol=1e-5)


# ---- the whole run: tmod-train bridge ----------------------------------------------------------
@pytest.fixture(scope="module")
def sst2_dir(tmp_path_factory):
    """A tiny stand-in for the sst2 preset's files (label 1 when the text says good/great/fun)."""
    root = tmp_path_factory.mktemp("data")
    (root / "sst2").mkdir()
    for split, n, seed in (("train", 120, 0), ("validation", 40, 1)):
        lines = ["sentence\tlabel"]
        for text in make_texts(n, seed):
            lines.append(f"{text}\t{int(any(w in text.split() for w in ('good', 'great', 'fun')))}")
        (root / "sst2" / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    return root


def test_train_bridge_distill_writes_a_loadable_artifact_and_report(sst2_dir, source, target, tmp_path):
    modules = ModuleStore(tmp_path / "modules")
    save_module(modules, "sentiment", "1",
                random_head(target, "sequence_classification", ["negative", "positive"], 4, layers=[0, 2, 3]), target)
    s = settings(objective="distill", module=str(modules.root / "sentiment" / "1"), dataset="sst2",
                 data_dir=str(sst2_dir), epochs=2, ce_weight=0.5, mse_weight=0.1,
                 bridge_store=str(tmp_path / "bridges"), report_dir=str(tmp_path / "report"),
                 cache_dir=str(tmp_path / "cache"), name="tiny-distill", threads=1)
    result = train_bridge(s, source=source, target=target, command="tmod-train bridge ...")

    loaded = load_bridge(bridge_store(tmp_path / "bridges"), "tiny-distill", "1", source)
    manifest = loaded.manifest
    assert manifest.target_layers == [0, 2, 3]  # the module's states, by default
    assert manifest.training["objective"] == "distill"
    assert manifest.training["module"]["task"] == "sentiment"
    assert manifest.training["settings"]["ce_weight"] == 0.5
    assert manifest.training["data"]["train_texts"] == 120 and manifest.training["data"]["validation_texts"] == 40
    assert 1 <= len(manifest.training["history"]) <= 2
    for key in ("kl", "agreement", "accuracy", "teacher_accuracy", "cosine"):
        assert key in result.metrics and key in result.metrics["served"]
    # measured through start/consume/finish of the loaded artifact: the same numbers as in training
    assert result.metrics["served"]["kl"] == pytest.approx(result.metrics["kl"], rel=1e-4, abs=1e-6)
    assert result.metrics["served"]["agreement"] == pytest.approx(result.metrics["agreement"])
    assert (tmp_path / "report" / "metrics.json").is_file() and (tmp_path / "report" / "curves.png").stat().st_size
    # the baseline beside the module's accuracy: the validation texts' most frequent label, on them
    labels = [line.split("\t")[1] for line in (sst2_dir / "sst2" / "validation.tsv").read_text().splitlines()[1:]]
    assert result.metrics["majority_accuracy"] == pytest.approx(max(map(labels.count, set(labels))) / len(labels))
    report = (tmp_path / "report" / "report.md").read_text()
    assert "chose the epoch, so the numbers are optimistic" in report
    assert f"the majority answer {result.metrics['majority_accuracy']:.4f}" in report
    assert f"untrained bridge {result.metrics['untrained']['accuracy']:.4f}" in report
    verdict = next(line for line in report.splitlines() if line.startswith("- verdict: "))
    assert verdict == f"- {bridge_verdict(result.metrics, 40)}" and "scored on 40 rows only" in verdict
    assert f"--bridges {tmp_path / 'bridges'}` scores a module of " in report  # the command that measures one
    assert list((tmp_path / "cache" / "paired").glob("*.safetensors"))  # paired states cached for the next run


@pytest.mark.parametrize("bridged, said", [
    (0.52, "verdict: through this bridge the module answers no better than the majority answer (0.5200 against "
           "0.5800): not worth serving this way; pair more texts (--max-texts, --texts) or train longer (--epochs)"),
    (0.90, "verdict: through this bridge the module is +0.3200 over the majority answer and -0.0400 against itself "
           "on its own backbone")])
def test_a_bridged_module_gets_a_verdict_against_the_majority_answer(bridged, said):
    """A distilled bridge's report gave the bridged accuracy beside the majority answer's and left the
    reading to the user: a bridge that made the module worse than a constant answer read as a result."""
    metrics = {"accuracy": bridged, "majority_accuracy": 0.58, "teacher_accuracy": 0.94}
    assert bridge_verdict(metrics, 872) == said


def test_ctrl_c_keeps_the_best_epoch_so_far_and_finishes_the_run(sst2_dir, source, target, tmp_path, monkeypatch):
    """A long bridge run interrupted in epoch 3 was lost whole (KeyboardInterrupt out of the command);
    now epochs 1-2's best is saved, loads and is reported as interrupted, as a head's run does."""
    import training.bridges.transformer

    real = training.bridges.transformer.run_bridge_epoch

    def interrupted_in_epoch_3(*args):
        if args[8] == 3:  # epoch
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(training.bridges.transformer, "run_bridge_epoch", interrupted_in_epoch_3)
    s = settings(dataset="sst2", data_dir=str(sst2_dir), epochs=10, bridge_store=str(tmp_path / "bridges"),
                 report_dir=str(tmp_path / "report"), cache_dir=str(tmp_path / "cache"), name="cut", threads=1)
    result = train_bridge(s, source=source, target=target)
    assert [h["epoch"] for h in result.history] == [1, 2] and result.history[-1]["stopped_by"] == "interrupt"
    assert load_bridge(bridge_store(tmp_path / "bridges"), "cut", "1", source).manifest.training["epochs_run"] == 2
    assert "interrupted (Ctrl-C) after epoch 2: kept epoch " in (tmp_path / "report" / "report.md").read_text()
    monkeypatch.setattr(training.bridges.transformer, "run_bridge_epoch",
                        lambda *args: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):  # nothing kept yet: the command says it was interrupted
        train_bridge(s.model_copy(update={"name": "none"}), source=source, target=target)


def test_an_early_stop_by_patience_is_reported(sst2_dir, source, target, tmp_path, monkeypatch, capsys):
    """A bridge whose validation loss stops falling stopped after --patience epochs without a word of why."""
    import training.bridges.transformer

    real = training.bridges.transformer.run_bridge_epoch

    def worse_after_the_first(*args):
        entry, val, step = real(*args)
        return entry, {**val, "loss": float(args[8])}, step  # args[8]: the epoch; the loss grows with it

    monkeypatch.setattr(training.bridges.transformer, "run_bridge_epoch", worse_after_the_first)
    s = settings(dataset="sst2", data_dir=str(sst2_dir), epochs=6, patience=2, bridge_store=str(tmp_path / "bridges"),
                 report_dir=str(tmp_path / "report"), cache_dir=str(tmp_path / "cache"), name="stale", threads=1)
    result = train_bridge(s, source=source, target=target)
    assert [h.get("stopped_by") for h in result.history] == [None, None, "patience"]
    assert "stopping after epoch 3/6: 2 epochs in a row without a better validation result" in capsys.readouterr().err
    assert ("stopped early (2 epochs in a row without a lower validation loss, --patience) after epoch 3: kept epoch 1"
            in (tmp_path / "report" / "report.md").read_text())


@pytest.mark.parametrize("budget, epochs_run", [(1e-6, 1), (600.0, 3)])
def test_max_minutes_starts_no_bridge_epoch_past_the_budget(sst2_dir, source, target, tmp_path, budget, epochs_run):
    """--max-minutes, as a head's run takes it (a bridge on a large backbone trains for hours on a CPU):
    a budget of microseconds stops after the first epoch, said in the report; a generous one changes nothing."""
    s = settings(dataset="sst2", data_dir=str(sst2_dir), epochs=3, max_minutes=budget, threads=1,
                 bridge_store=str(tmp_path / "bridges"), report_dir=str(tmp_path / "report"),
                 cache_dir=str(tmp_path / "cache"), name="timed")
    result = train_bridge(s, source=source, target=target)
    assert [h.get("stopped_by") for h in result.history] == [None] * (epochs_run - 1) + [
        "max_minutes" if epochs_run < 3 else None]
    said = "stopped by --max-minutes after epoch 1: kept epoch 1, the best so far"
    assert (said in (tmp_path / "report" / "report.md").read_text()) == (epochs_run == 1)


def test_cli_bridge_mse(sst2_dir, tiny_backbone_dir, target_dir, tmp_path, capsys):
    from training.cli import main

    code = main(["bridge", "--source", str(tiny_backbone_dir), "--target", str(target_dir), "--target-layers", "1,3",
                 "--objective", "mse", "--dataset", "sst2", "--data-dir", str(sst2_dir), "--max-texts", "60",
                 "--epochs", "1", "--d-model", "32", "--heads", "2", "--encoder-layers", "1", "--decoder-layers", "1",
                 "--ffn-dim", "64", "--token-dim", "8", "--bridge-store", str(tmp_path / "bridges"),
                 "--report-dir", str(tmp_path / "report"), "--cache-dir", str(tmp_path / "cache"),
                 "--threads", "1", "--no-progress"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["validation"]["objective"] == "mse"
    store = bridge_store(tmp_path / "bridges")
    [name] = store.tasks()
    manifest = store.read_manifest(name, "1")
    assert manifest.target_layers == [1, 3] and manifest.source_layers == [0, 1, 2, 3]
    assert manifest.training["command"].startswith("tmod-train bridge --source")
    assert manifest.training["settings"]["d_model"] == 32
    assert manifest.training["data"]["train_texts"] == 60
    assert manifest.tokenizer_sha256


def test_cli_bridge_numbers_its_versions_and_says_what_its_numbers_are(sst2_dir, tiny_backbone_dir, target_dir,
                                                                       tmp_path, capsys, monkeypatch):
    """Without --version a second run is version 2 (it was refused: 'pick another --version'); stdout
    is the summary alone (the epoch lines went there with bars on), the findings on stderr name the
    validation texts as having chosen the epoch; a version that exists is refused in one line."""
    from training.cli import main

    monkeypatch.chdir(tmp_path)  # the default run folders
    argv = ["bridge", "--source", str(tiny_backbone_dir), "--target", str(target_dir), "--target-layers", "1,3",
            "--dataset", "sst2", "--data-dir", str(sst2_dir), "--max-texts", "30", "--max-validation", "10",
            "--epochs", "1", "--d-model", "32", "--heads", "2", "--encoder-layers", "1", "--decoder-layers", "1",
            "--ffn-dim", "64", "--token-dim", "8", "--bridge-store", str(tmp_path / "bridges"),
            "--cache-dir", str(tmp_path / "cache"), "--threads", "1", "--name", "b"]
    for version in ("1", "2"):
        assert main([*argv, "--progress"]) == 0
        said = capsys.readouterr()
        printed = json.loads(said.out)
        assert printed["version"] == version and "cosine" in printed["untrained"]
        # one epoch: validation chose nothing
        assert "they chose nothing (the run kept its last epoch)" in said.err and "epoch 1/1: " in said.err
    assert bridge_store(tmp_path / "bridges").versions("b") == ["1", "2"]
    reports = sorted((tmp_path / "runs").glob("bridge-b-*/report/report.md"))
    assert len(reports) == 2 and "(untrained bridge " in reports[0].read_text()
    assert main([*argv, "--version", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tmod-train bridge: error: bridge b/2 already exists") and "--version 3" in err
    assert err.count("\n") == 1


def test_distill_needs_a_module_and_the_modules_states(sst2_dir, source, target, tmp_path):
    with pytest.raises(ValueError, match="needs --module"):
        train_bridge(settings(objective="distill", data_dir=str(sst2_dir)), source=source, target=target)
    modules = ModuleStore(tmp_path / "modules")
    save_module(modules, "sentiment", "1",
                random_head(target, "sequence_classification", ["negative", "positive"], 4, layers=[0, 2, 3]), target)
    with pytest.raises(ValueError, match="leaves out"):
        train_bridge(settings(objective="distill", module=str(modules.root / "sentiment"), target_layers="3",
                              data_dir=str(sst2_dir)), source=source, target=target)
    with pytest.raises(ArtifactError):  # a module of the source backbone is not a target module
        save_module(modules, "native", "1", random_head(source, "sequence_classification", ["a", "b"], 4), source)
        train_bridge(settings(objective="distill", module=str(modules.root / "native"), data_dir=str(sst2_dir)),
                     source=source, target=target)


def test_module_is_named_as_distill_from_names_a_teacher(tmp_path):
    """`--module` takes what `--distill-from` takes (one resolver): TASK/VERSION of the shipped store
    (it took only folders), a STORE/TASK/VERSION folder, or a STORE/TASK folder (its newest version)."""
    from modules_store import DEFAULT_STORE
    from training.data.files import UsageError
    from training.splits import module_folder

    assert module_folder("sentiment/1", "--module") == (DEFAULT_STORE, "sentiment", "1")
    for version in ("1", "2", "10"):
        (tmp_path / "store" / "mine" / version).mkdir(parents=True)
        (tmp_path / "store" / "mine" / version / "manifest.json").write_text("{}")
    assert module_folder(str(tmp_path / "store" / "mine"), "--module") == (tmp_path / "store", "mine", "10")
    assert module_folder(str(tmp_path / "store" / "mine" / "2")) == (tmp_path / "store", "mine", "2")
    with pytest.raises(UsageError, match="^--module 'mine/3': no such module"):
        module_folder("mine/3", "--module")


def test_cli_bridge_reads_a_config_file_the_command_line_wins(sst2_dir, tiny_backbone_dir, target_dir, tmp_path,
                                                             capsys):
    """BridgeSettings read a config's `version: 2` as a name, yet `tmod-train bridge` took no --config."""
    from training.cli import main

    config = tmp_path / "bridge.yaml"
    config.write_text(f"source: {tiny_backbone_dir}\ntarget: {target_dir}\ntarget-layers: '1,3'\ndataset: sst2\n"
                      f"data_dir: {sst2_dir}\nmax_texts: 30\nmax_validation: 10\nepochs: 3\nd_model: 32\nheads: 2\n"
                      "encoder_layers: 1\ndecoder_layers: 1\nffn_dim: 64\ntoken_dim: 8\nversion: 7\nthreads: 1\n")
    argv = ["bridge", "--config", str(config), "--epochs", "1", "--bridge-store", str(tmp_path / "bridges"),
            "--report-dir", str(tmp_path / "report"), "--cache-dir", str(tmp_path / "cache"), "--no-progress",
            "--name", "c"]
    assert main(argv) == 0
    manifest = bridge_store(tmp_path / "bridges").read_manifest("c", "7")
    assert manifest.training["settings"]["epochs"] == 1 and manifest.training["settings"]["d_model"] == 32
    assert manifest.target_layers == [1, 3]
    capsys.readouterr()
    config.write_text(config.read_text().replace("d_model", "d_modle"))
    assert main(argv) == 2
    assert capsys.readouterr().err == (f"tmod-train bridge: error: --config {config}: 'd_modle' is not a setting "
                                       "(did you mean 'd_model' for 'd_modle'?)\n")


def test_cli_bridge_on_a_file_of_the_users_texts(tiny_backbone_dir, target_dir, tmp_path, capsys):
    """--texts FILE (one a line, the domain the bridge will serve) is paired instead of a preset: a
    seeded tenth held out for validation, each text once; a missing file is one line before any
    backbone loads."""
    from training.cli import main

    texts = make_texts(60, seed=3)
    (tmp_path / "domain.txt").write_text("\n".join(texts + ["", texts[0]]) + "\n")
    argv = ["bridge", "--source", str(tiny_backbone_dir), "--target", str(target_dir), "--target-layers", "1,3",
            "--epochs", "1", "--d-model", "32", "--heads", "2", "--encoder-layers", "1", "--decoder-layers", "1",
            "--ffn-dim", "64", "--token-dim", "8", "--bridge-store", str(tmp_path / "bridges"), "--name", "mine",
            "--report-dir", str(tmp_path / "report"), "--cache-dir", str(tmp_path / "cache"), "--no-progress"]
    assert main([*argv, "--texts", str(tmp_path / "domain.txt")]) == 0
    data = bridge_store(tmp_path / "bridges").read_manifest("mine", "1").training["data"]
    unique = len(set(texts))
    assert (data["train_texts"], data["validation_texts"]) == (unique - round(unique / 10), round(unique / 10))
    assert data["texts_file"] == str((tmp_path / "domain.txt").resolve()) and "dataset" not in data
    assert "texts, a held-out tenth of domain.txt; they chose nothing (the run kept its last epoch)" in \
        capsys.readouterr().err
    assert main([*argv, "--texts", str(tmp_path / "none.txt")]) == 2
    assert capsys.readouterr().err == f"tmod-train bridge: error: --texts {tmp_path / 'none.txt'}: No such file or directory\n"
    assert main([*argv, "--texts", str(tmp_path / "none.txt"), "--source", "/no/such/backbone"]) == 2  # named first
    assert capsys.readouterr().err.startswith("tmod-train bridge: error: no backbone '/no/such/backbone': name one of")
