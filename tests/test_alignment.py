"""Paired states and the alignment bridge, on tiny random backbones (fast, deterministic)."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import BertModel, LlamaConfig, LlamaModel, PreTrainedTokenizerFast

from modules_store import ArtifactError
from server.backbone import Backbone
from server.bridges import BRIDGE_KINDS, bridge_store, load_bridge, save_bridge
from server.bridges.alignment import AlignmentBridge, AlignmentConfig
from tests.helpers import NER_LABELS, make_tiny_backbone_dir, random_head
from training.bridges.align import align, correlation, correlation_grid, layer_groups, match
from training.bridges.pairing import PairedStates

WORDS = ("the cat sat on a mat while unbelievably quiet dogs were playing football near Paris "
         "and nobody said anything about it , really ! Strange weather : 42 % rain").split()


def make_texts(n: int = 50, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 12)))) for _ in range(n)]


TEXTS = make_texts()


# ---- tiny backbones ---------------------------------------------------------------------------
def permute_bert(model: BertModel, perm: torch.Tensor) -> BertModel:
    """The same BERT with its hidden space permuted: every state of the result is the original's
    state with dims reordered, new[..., d] = old[..., perm[d]]."""
    out = copy.deepcopy(model)
    state = {}
    for name, t in model.state_dict().items():
        t = t.clone()
        if name.endswith("_embeddings.weight"):
            t = t[:, perm]  # (vocab/positions/types, H)
        elif "LayerNorm" in name:
            t = t[perm]
        elif any(f".{k}.weight" in name for k in ("query", "key", "value")) or "intermediate.dense.weight" in name:
            t = t[:, perm]  # reads the hidden state
        elif name.endswith("output.dense.weight"):  # attention.output.dense and output.dense write it
            t = t[perm, :]
        elif name.endswith("output.dense.bias"):
            t = t[perm]
        elif name == "pooler.dense.weight":
            t = t[perm][:, perm]
        elif name == "pooler.dense.bias":
            t = t[perm]
        state[name] = t
    out.load_state_dict(state)
    return out.eval()


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return make_tiny_backbone_dir(tmp_path_factory.mktemp("align"), "bert", layers=3, seed=4)


@pytest.fixture(scope="module")
def bert(bert_dir):
    return Backbone.load(bert_dir)


@pytest.fixture(scope="module")
def perm():
    return torch.randperm(32, generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def permuted(bert, perm):
    return Backbone(permute_bert(bert.model, perm), bert.tokenizer, name="tiny-bert-permuted")


@pytest.fixture(scope="module")
def char_llama(tmp_path_factory):
    """A tiny Llama with a character-level tokenizer (BOS special token): offsets unlike MiniLM's."""
    chars = sorted(set("".join(TEXTS + ["playing football!"])))
    vocab = {"<pad>": 0, "<s>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", pad_token="<pad>", unk_token="<unk>",
                                   model_max_length=128)
    torch.manual_seed(1)
    model = LlamaModel(LlamaConfig(vocab_size=len(vocab), hidden_size=24, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=48, max_position_embeddings=128,
                                   pad_token_id=0, architectures=["LlamaModel"]))
    path = tmp_path_factory.mktemp("charllama") / "tiny-char-llama"
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return Backbone.load(path)


@pytest.fixture(scope="module")
def paired(bert, permuted, tmp_path_factory):
    # source: the backbone the bridge serves on; target: the one the modules were trained on
    return PairedStates.build(TEXTS, bert, permuted, [0, 1, 2, 3], [0, 1, 2, 3],
                              cache_dir=tmp_path_factory.mktemp("cache"), progress=False)


def run_head(head, backbone, batch):
    layers = head.layers_read()
    state = head.start(batch)
    for i, hidden in backbone.stream(batch, upto=max(layers)):
        if i in layers:
            state = head.consume(state, i, hidden)
    return head.finish(state, batch)


def run_bridged(head, bridge, backbone, batch):
    state = bridge.start(batch)
    for i, hidden in backbone.stream(batch, upto=max(bridge.layers_read())):
        if i in bridge.layers_read():
            state = bridge.consume(state, i, hidden)
    target_batch, states = bridge.finish(state, batch)
    hs = head.start(target_batch)
    for i in head.layers_read():
        hs = head.consume(hs, i, states[i])
    return head.finish(hs, target_batch)


# ---- (a) a permuted copy: alignment recovers the permutation -----------------------------------
@torch.inference_mode()
def test_permuted_model_states_are_permuted(bert, permuted, perm):
    batch = bert.tokenize(TEXTS[:8])
    original, moved = bert.all_states(batch), permuted.all_states(batch)
    assert len(original) == len(moved) == 4
    for a, b in zip(original, moved):
        assert torch.allclose(b, a[..., perm], atol=1e-5)
    assert bert.fingerprint.identity() != permuted.fingerprint.identity()


def test_alignment_recovers_the_permutation(paired, perm):
    bridge, diag = align(paired, mapping="skip")
    assert BRIDGE_KINDS["alignment"] is AlignmentBridge
    assert bridge.layers_read() == [0, 1, 2, 3] and bridge.states_out() == [0, 1, 2, 3]
    for k in range(4):
        assert torch.equal(bridge.index[k], perm)
        assert torch.equal(bridge.scale[k], torch.ones(32)) and torch.equal(bridge.shift[k], torch.zeros(32))
        assert diag["per_state"][k]["mean_matched_correlation"] > 0.999
        assert diag["per_state"][k]["source_states"] == [k]
    std, _ = align(paired, mapping="skip", standardize=True)
    assert torch.equal(std.index, bridge.index)
    assert torch.allclose(std.scale, torch.ones_like(std.scale), atol=1e-2)


@pytest.mark.parametrize("task", ["sequence", "token"])
@torch.inference_mode()
def test_foreign_module_through_the_bridge_matches_native(paired, bert, permuted, task):
    bridge, _ = align(paired, mapping="skip")
    if task == "sequence":
        head = random_head(permuted, "sequence_classification", ["negative", "positive"], seed=3)
    else:
        head = random_head(permuted, "token_classification", NER_LABELS, seed=5, casing=True)
    texts = make_texts(12, seed=9)  # not the texts the alignment was fitted on
    native = run_head(head, permuted, permuted.tokenize(texts))
    served = run_bridged(head, bridge, bert, bert.tokenize(texts))
    assert native.shape == served.shape
    assert torch.allclose(native, served, atol=1e-4)


def test_correlation_and_matching_against_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 5))
    y = np.concatenate([x[:, [3, 0]] * 2 + 1, rng.normal(size=(300, 4))], axis=1)
    c = correlation(torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32))
    want = np.corrcoef(x.T, y.T)[:5, 5:]
    assert c.shape == (5, 6) and np.allclose(c, want, atol=1e-5)
    rows, cols = match(c)
    assert len(rows) == 5 and dict(zip(cols.tolist(), rows.tolist()))[0] == 3
    assert dict(zip(cols.tolist(), rows.tolist()))[1] == 0
    const = correlation(torch.ones(10, 2), torch.randn(10, 3))
    assert np.all(const == 0)


def test_layer_groups():
    # a MiniLM (6) module served on SmolLM2 (30): groups of 5
    assert layer_groups(30, 6, range(7), "skip") == {0: [0], 1: [5], 2: [10], 3: [15], 4: [20], 5: [25], 6: [30]}
    avg = layer_groups(30, 6, range(7), "avg")
    assert avg[0] == [0] and avg[1] == [1, 2, 3, 4, 5] and avg[6] == [26, 27, 28, 29, 30]
    # a SmolLM2 module served on MiniLM: target j reads round(j * 6 / 30), both mappings alike
    want = {0: [0], 5: [1], 10: [2], 15: [3], 20: [4], 25: [5], 30: [6], 3: [1], 2: [0]}
    for mapping in ("skip", "avg"):
        assert layer_groups(6, 30, want, mapping) == want
    assert layer_groups(3, 3, [0, 1, 2, 3], "avg") == {0: [0], 1: [1], 2: [2], 3: [3]}
    with pytest.raises(ValueError):
        layer_groups(6, 30, [31])


@torch.inference_mode()
def test_avg_bridge_streams_and_averages(tmp_path):
    deep = Backbone.load(make_tiny_backbone_dir(tmp_path, "bert", layers=4, seed=2))
    shallow_dir = make_tiny_backbone_dir(tmp_path / "s", "roberta", layers=2, seed=3)
    shallow = Backbone.load(shallow_dir)
    paired = PairedStates.build(TEXTS[:30], deep, shallow, list(range(5)), [0, 1, 2], cache=False, progress=False)
    bridge, diag = align(paired, mapping="avg")
    assert bridge.config.groups == {0: [0], 1: [1, 2], 2: [3, 4]}
    assert diag["per_state"][2]["source_states"] == [3, 4]
    batch = deep.tokenize(TEXTS[:5])
    states = dict(enumerate(deep.all_states(batch)))
    seen = []
    state = bridge.start(batch)
    for i, hidden in deep.stream(batch):
        state = bridge.consume(state, i, hidden)
        seen.append(sorted(state["sums"]))
    assert seen == [[], [1], [], [2], []]  # a running sum lives only while its group streams
    out_batch, out = bridge.finish(state, batch)
    assert out_batch is batch and sorted(out) == [0, 1, 2]
    for k, (j, group) in enumerate(bridge.config.groups.items()):
        mean = torch.stack([states[i] for i in group]).mean(0)
        assert torch.allclose(out[j], mean[..., bridge.index[k]], atol=1e-5)
    assert torch.allclose(bridge({i: states[i] for i in range(5)})[2], out[2])


def test_unmatched_target_dims_get_their_mean(bert, char_llama):
    # 32-wide source, 24-wide target and back: the wider target keeps 8 constant dims
    paired = PairedStates.build(TEXTS, char_llama, bert, [0, 1, 2], [0, 3], cache=False, progress=False)
    bridge, diag = align(paired, mapping="skip")
    assert bridge.config.groups == {0: [0], 3: [2]}
    for j in (0, 3):
        matched = bridge.matched(j)
        assert int(matched.sum()) == 24 and diag["per_state"][j]["matched"] == 24
        _, y = paired.token_pairs(bridge.config.groups[j], j)
        k = bridge.states_out().index(j)
        assert torch.allclose(bridge.shift[k][~matched], y.mean(0)[~matched], atol=1e-4)
    out = bridge({0: torch.randn(2, 5, 24), 2: torch.randn(2, 5, 24)})
    assert out[3].shape == (2, 5, 32)


# ---- (b) rows aligned by character offsets ----------------------------------------------------
def _spans(encoded):
    out = []
    for (a, b), seq in zip(encoded.offsets, encoded.sequence_ids):
        text = encoded.text
        while a < b and text[a].isspace():
            a += 1
        while b > a and text[b - 1].isspace():
            b -= 1
        out.append((a, b) if seq is not None and b > a else None)
    return out


def test_token_pairs_align_by_characters(bert, char_llama):
    texts = ["playing football!", *TEXTS[:20]]
    paired = PairedStates.build(texts, bert, char_llama, [0], [0], cache=False, progress=False)
    assert paired.target_encoded[0].sequence_ids[0] is None  # the BOS token is special
    # hand-made: MiniLM keeps "playing" and "football" whole; the target spells them out
    src, tgt = paired.source_encoded[0], paired.target_encoded[0]
    assert [src.offsets[t] for t in range(1, 4)] == [(0, 7), (8, 16), (16, 17)]
    assert tgt.offsets[1:4] == [(0, 1), (1, 2), (2, 3)]
    # make every state say where it came from: dim 0 = flat row number
    for cache in (paired.source_cache, paired.target_cache):
        flat = cache.cache[0]
        flat.zero_()
        flat[:cache.total, 0] = torch.arange(cache.total, dtype=torch.float16)
    x, y = paired.token_pairs(0, 0)
    s0, t0 = paired.source_cache.starts[0], paired.target_cache.starts[0]
    # rows 0..6 are the characters of "playing" (the BOS is skipped): all read source token 1
    assert y[:7, 0].tolist() == [t0 + t for t in range(1, 8)]
    assert x[:7, 0].tolist() == [s0 + 1] * 7
    assert y[7, 0].item() == t0 + 8 and x[7, 0].item() == s0 + 2  # "f" of football (the space is no token)
    # every row against a brute-force search
    expected = []
    for r in range(len(texts)):
        s_sp, t_sp = _spans(paired.source_encoded[r]), _spans(paired.target_encoded[r])
        for t, ts in enumerate(t_sp):
            if ts is None:
                continue
            hits = [u for u, ss in enumerate(s_sp) if ss is not None and ss[0] < ts[1] and ts[0] < ss[1]]
            if hits:
                expected.append((paired.target_cache.starts[r] + t,
                                 np.mean([paired.source_cache.starts[r] + u for u in hits])))
    assert y.shape[0] == len(expected) == x.shape[0]
    assert np.allclose(y[:, 0].numpy(), [e[0] for e in expected])
    assert np.allclose(x[:, 0].numpy(), [e[1] for e in expected], atol=0.5)  # fp16 row numbers
    # word pooling: one row per whitespace word, each side the mean of its tokens in the word
    xw, yw = paired.token_pairs(0, 0, pool="word")
    assert xw.shape[0] == sum(len(t.split()) for t in texts)
    assert xw[0, 0].item() == s0 + 1 and yw[0, 0].item() == pytest.approx(t0 + 4)  # "playing": target 1..7
    assert xw[1, 0].item() == pytest.approx(s0 + 2.5)  # "football!": source "football", "!"


def test_batches_and_padding(paired):
    rows = [3, 0, 7]
    batch, states = paired.target_batch(rows)
    assert batch.texts == [TEXTS[r] for r in rows] and sorted(states) == paired.target_layers
    src_batch, src_states = paired.source_batch(rows)
    mask = batch.attention_mask.bool()
    for h in states.values():
        assert h.dtype == torch.float32 and h.shape[:2] == batch.input_ids.shape and h[~mask].abs().sum() == 0
    assert torch.equal(src_batch.input_ids, batch.input_ids)  # same tokenizer here
    got = sorted(r for b in paired.batches(8, shuffle=True) for r in b)
    assert got == list(range(len(paired)))
    assert len(paired) == len(TEXTS) and paired.source_hidden == paired.target_hidden == 32


# ---- (c) the paired cache ---------------------------------------------------------------------
def test_paired_cache_round_trips(bert, permuted, tmp_path, monkeypatch, caplog):
    first = PairedStates.build(TEXTS[:20], bert, permuted, [0, 2], [1], cache_dir=tmp_path, progress=False)
    assert first.path is not None and first.path.parent == tmp_path / "paired" and first.path.is_file()
    meta = json.loads(first.path.with_suffix(".json").read_text())
    assert meta["source"]["layers"] == [0, 2] and meta["target"]["layers"] == [1] and meta["count"] == 20

    def boom(*args, **kwargs):
        raise AssertionError("the backbone ran although the states are cached")

    monkeypatch.setattr(bert, "stream", boom)
    monkeypatch.setattr(permuted, "stream", boom)
    again = PairedStates.build(TEXTS[:20], bert, permuted, [2, 0], [1], cache_dir=tmp_path, progress=False)
    assert again.path == first.path
    for i in (0, 2):
        assert torch.equal(again.source_cache.cache[i], first.source_cache.cache[i])
    assert torch.equal(again.target_cache.cache[1], first.target_cache.cache[1])
    x1, y1 = first.token_pairs([0, 2], 1)
    x2, y2 = again.token_pairs([0, 2], 1)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    # other texts or layers: another key
    with pytest.raises(AssertionError, match="backbone ran"):
        PairedStates.build(TEXTS[:19], bert, permuted, [0, 2], [1], cache_dir=tmp_path, progress=False)
    monkeypatch.undo()
    # a damaged cache is recomputed
    first.path.write_bytes(b"not safetensors")
    fixed = PairedStates.build(TEXTS[:20], bert, permuted, [0, 2], [1], cache_dir=tmp_path, progress=False)
    assert torch.equal(fixed.source_cache.cache[2], first.source_cache.cache[2])
    assert "recomputing" in caplog.text


# ---- (d) the artifact -------------------------------------------------------------------------
@torch.inference_mode()
def test_artifact_round_trip_and_corruption(paired, bert, permuted, tmp_path):
    bridge, diag = align(paired, mapping="skip", standardize=True)
    store = bridge_store(tmp_path / "bridges")
    folder = save_bridge(store, "align-tiny", "1", bridge, bert, permuted, metrics={"mean": diag["mean_matched_correlation"]})
    assert not (folder / "target_tokenizer").exists()  # keeps the source tokens
    loaded = load_bridge(store, "align-tiny", "1", bert)
    assert isinstance(loaded.bridge, AlignmentBridge) and loaded.manifest.kind == "alignment"
    assert loaded.manifest.source_layers == [0, 1, 2, 3] and loaded.bridge.target_text is None
    assert loaded.bridge.config.groups == bridge.config.groups
    batch = bert.tokenize(TEXTS[:6])
    states = dict(enumerate(bert.all_states(batch)))
    a, b = bridge(states), loaded.bridge(states)
    assert all(torch.equal(a[j], b[j]) for j in a)
    with pytest.raises(ArtifactError) as err:  # served on the wrong backbone
        load_bridge(store, "align-tiny", "1", permuted)
    assert err.value.reason == "fingerprint_mismatch"
    weights = folder / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ArtifactError) as err:
        load_bridge(store, "align-tiny", "1", bert)
    assert err.value.reason == "checksum_mismatch"


def test_config_is_checked():
    with pytest.raises(ValueError):
        AlignmentConfig(mapping="skip", source_hidden_size=4, target_hidden_size=4, groups={1: [1, 2]})
    with pytest.raises(ValueError):
        AlignmentConfig(mapping="avg", source_hidden_size=4, target_hidden_size=4, groups={1: [2, 1]})
    config = AlignmentConfig(mapping="avg", source_hidden_size=4, target_hidden_size=4, groups={"2": [3, 4], "0": [0]})
    assert list(config.groups) == [0, 2]


def test_correlation_grid(paired):
    grid = correlation_grid(paired, [0, 3], [0, 3])
    g = np.array(grid["mean_matched_correlation"])
    # random tiny layers barely move the residual stream, so off-diagonal pairs correlate highly too
    assert g.shape == (2, 2) and g[0, 0] > 0.999 and g[1, 1] > 0.999 and g[0, 1] <= g[0, 0]


# ---- the command -----------------------------------------------------------------------------
def align_data(tmp_path, bert, permuted):
    """A preset folder (train and validation texts) and the two backbones saved as folders."""
    data = tmp_path / "data" / "sst2"
    data.mkdir(parents=True)
    (data / "train.tsv").write_text("sentence\tlabel\n" + "".join(f"{t}\t{i % 2}\n" for i, t in enumerate(TEXTS)))
    held_out = make_texts(20, seed=1)
    (data / "validation.tsv").write_text("sentence\tlabel\n" + "".join(f"{t}\t{i % 2}\n" for i, t in enumerate(held_out)))
    src_dir, tgt_dir = tmp_path / "src", tmp_path / "tgt"
    for model, folder in ((bert, src_dir), (permuted, tgt_dir)):
        model.model.save_pretrained(folder)
        model.tokenizer.save_pretrained(folder)
    return ["--source", str(src_dir), "--target", str(tgt_dir), "--dataset", "sst2", "--data-dir", str(tmp_path / "data"),
            "--store", str(tmp_path / "bridges"), "--cache-dir", str(tmp_path / "cache"), "--no-progress"]


def test_align_command(tmp_path, bert, permuted, capsys):
    from training.cli import main

    common = align_data(tmp_path, bert, permuted)
    report = tmp_path / "report"
    rc = main(["align", *common, "--max-texts", "40", "--mapping", "avg", "--name", "perm",
               "--report-dir", str(report)])
    assert rc == 0
    metrics = json.loads((report / "metrics.json").read_text())
    assert metrics["texts"] == 40 and metrics["metrics"]["mean_matched_correlation"] > 0.999
    # measured where the matching was not chosen: the validation texts, none of them a training text
    assert metrics["held_out_texts"] == len(set(make_texts(20, seed=1)) - set(TEXTS)) > 0
    assert metrics["metrics"]["held_out_mean_matched_correlation"] > 0.999
    for state in metrics["metrics"]["per_state"].values():
        assert abs(state["held_out"]["pairs_shuffled"]) < 0.5 < state["held_out"]["mean_matched_correlation"]
    assert np.array(metrics["layer_grid"]["mean_matched_correlation"]).shape == (4, 4)
    assert (report / "correlation.png").stat().st_size > 0
    said = capsys.readouterr()
    assert "optimistic" in said.err and "held out: " in said.err and "never used to fit" in said.err
    assert json.loads(said.out)["version"] == "1"  # stdout is the summary alone
    assert "held out: " in (report / "report.md").read_text()
    loaded = load_bridge(bridge_store(tmp_path / "bridges"), "perm", "1", Backbone.load(tmp_path / "src"))
    assert loaded.manifest.training["mapping"] == "avg"


def test_align_again_takes_the_next_version_and_a_mistake_is_one_line(tmp_path, bert, permuted, capsys,
                                                                        monkeypatch):
    """A second run is version 2 (it crashed with a traceback after all the work: 'skip' existed);
    a version that exists and an unknown preset are refused in one line before any state is paired."""
    from training.cli import main

    monkeypatch.chdir(tmp_path)  # the default run folders
    common = align_data(tmp_path, bert, permuted)
    for _ in range(2):
        assert main(["align", *common, "--max-texts", "20", "--no-heatmap", "--name", "perm"]) == 0
    assert bridge_store(tmp_path / "bridges").versions("perm") == ["1", "2"]
    assert len(list((tmp_path / "runs").glob("perm-*/report/report.md"))) == 2
    capsys.readouterr()
    cached = sorted((tmp_path / "cache").rglob("*"))
    assert main(["align", *common, "--max-texts", "30", "--name", "perm", "--version", "2"]) == 2
    assert sorted((tmp_path / "cache").rglob("*")) == cached  # refused before pairing 30 texts' states
    err = capsys.readouterr().err
    assert err.startswith("tmod-train align: error: bridge perm/2 already exists") and "--version 3" in err
    assert err.count("\n") == 1
    bad = [*common[:5], "sst9", *common[6:]]
    assert main(["align", *bad, "--name", "other"]) == 2
    assert capsys.readouterr().err.startswith("tmod-train align: error: unknown dataset 'sst9'")
    assert bridge_store(tmp_path / "bridges").versions("other") == []
    # a --cache-dir where no folder can be made: one line before pairing (it was '[Errno 20] Not a directory'
    # after the states were paired)
    (tmp_path / "a-file").write_text("")
    at = common.index("--cache-dir")
    unmakeable = [*common[:at], "--cache-dir", str(tmp_path / "a-file" / "cache"), *common[at + 2:]]
    assert main(["align", *unmakeable, "--name", "other"]) == 2
    assert capsys.readouterr().err == (f"tmod-train align: error: --cache-dir {tmp_path / 'a-file' / 'cache'}: cannot "
                                       f"make it: {tmp_path / 'a-file'} is a file\n")
    assert bridge_store(tmp_path / "bridges").versions("other") == []
    # a numbered version saved beside a named one is not what tmod-serve --bridges loads: said
    assert main(["align", *common, "--max-texts", "20", "--no-heatmap", "--name", "perm", "--version", "wide"]) == 0
    assert "tmod-serve --bridges" not in capsys.readouterr().err
    assert main(["align", *common, "--max-texts", "20", "--no-heatmap", "--name", "perm"]) == 0
    err = capsys.readouterr().err
    assert f"tmod-serve --bridges {tmp_path / 'bridges'} on " in err
    assert ("loads bridge perm/wide, not this perm/3: it takes the newest version of each bridge from its backbone"
            in err)


def test_align_on_a_file_of_the_users_texts(tmp_path, bert, permuted, capsys):
    """--texts FILE instead of a preset: fitted on all but a seeded tenth, measured on that tenth."""
    from training.cli import main

    common = align_data(tmp_path, bert, permuted)
    (tmp_path / "domain.txt").write_text("\n".join(TEXTS) + "\n")
    without_preset = [a for a in common if a not in ("--dataset", "sst2")]
    # a name no store takes is stored as a name it takes, and said (as a trained bridge's is): it was a
    # refusal after both backbones had loaded
    assert main(["align", *without_preset, "--texts", str(tmp_path / "domain.txt"), "--no-heatmap", "--name",
                 "../My Domain", "--report-dir", str(tmp_path / "report")]) == 0
    metrics = json.loads((tmp_path / "report" / "metrics.json").read_text())
    assert (metrics["texts"], metrics["held_out_texts"], metrics["datasets"]) == (45, 5, None)
    assert metrics["metrics"]["held_out_mean_matched_correlation"] > 0.999
    err = capsys.readouterr().err
    assert "held out: 5 texts, a held-out tenth of domain.txt, never used to fit" in err
    assert "--name '../My Domain' is stored as 'my-domain' (bridge names are a-z, 0-9, '_' and '-')" in err
    assert bridge_store(tmp_path / "bridges").versions("my-domain") == ["1"]


def test_eval_scores_a_foreign_module_through_a_bridge_store(tmp_path, bert, permuted, paired, capsys):
    """`tmod-train eval --backbone A --bridges STORE` scores B's module as `tmod-serve --bridges`
    serves it (the alignment bridge undoes the permutation: the native score); without a bridge, or
    on a backbone with no name, one line (it was a traceback: 'fingerprint mismatch')."""
    from modules_store import ModuleStore
    from server.modules import save_module
    from training.cli import main

    align_data(tmp_path, bert, permuted)
    store = ModuleStore(tmp_path / "modules")
    save_module(store, "sentiment", "1", random_head(permuted, "sequence_classification", ["negative", "positive"], 4,
                                                     layers=[0, 2, 3]), permuted)
    bridge, _ = align(paired, mapping="skip")
    save_bridge(bridge_store(tmp_path / "bridges"), "perm", "1", bridge, bert, permuted)
    rows = tmp_path / "rows.tsv"
    rows.write_text("text\tlabel\n" + "".join(f"{t}\t{['negative', 'positive'][i % 2]}\n" for i, t in enumerate(TEXTS)))
    argv = ["eval", "--store", str(store.root), "--task", "sentiment", "--file", str(rows), "--no-progress"]
    assert main([*argv, "--backbone", str(tmp_path / "tgt")]) == 0
    native = json.loads(capsys.readouterr().out)
    assert native["bridge"] is None
    assert main([*argv, "--backbone", str(tmp_path / "src"), "--bridges", str(tmp_path / "bridges")]) == 0
    said = capsys.readouterr()
    bridged = json.loads(said.out)
    assert bridged["bridge"] == "perm/1" and "through bridge perm/1" in said.err
    assert bridged["metrics"]["accuracy"] == native["metrics"]["accuracy"]
    assert bridged["metrics"]["examples"] == len(TEXTS)
    assert main([*argv, "--backbone", str(tmp_path / "src")]) == 2
    assert "and no --bridges store was given to lead there" in capsys.readouterr().err
    assert main(argv) == 2  # the module's backbone is a folder of this test: no name to load it by
    assert "which has no name here; give its folder with --backbone" in capsys.readouterr().err
    assert main([*argv, "--bridges", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.endswith(f"--bridges {tmp_path / 'nowhere'}: no such folder (a bridge store, as "
                                            "tmod-serve --bridges takes)\n")
    # a broken bridge is said, not taken for an absent one
    weights = tmp_path / "bridges" / "perm" / "1" / "weights.safetensors"
    weights.write_bytes(weights.read_bytes() + b"x")
    assert main([*argv, "--backbone", str(tmp_path / "src"), "--bridges", str(tmp_path / "bridges")]) == 2
    err = capsys.readouterr().err
    assert "tmod-train eval: bridge perm refused: perm/1: checksum mismatch" in err and "no bridge in" in err


# ---- served: the engine runs a foreign module through a loaded alignment bridge ---------------
def test_a_foreign_module_serves_through_the_alignment_bridge_in_the_engine(paired, bert, permuted, tmp_path):
    from modules_store import ModuleStore
    from server.engine import Engine
    from server.modules import load_module, save_module

    bridge, _ = align(paired, mapping="skip")
    store = bridge_store(tmp_path / "bridges")
    save_bridge(store, "perm", "1", bridge, bert, permuted)
    loaded = load_bridge(store, "perm", "1", bert)
    modules = ModuleStore(tmp_path / "modules")
    head = random_head(permuted, "token_classification", NER_LABELS, 6, layers=[0, 2, 3])
    save_module(modules, "ner", "1", head, permuted)
    foreign = load_module(modules, "ner", "1", bert, bridges={"perm": loaded})
    native = load_module(modules, "ner", "1", permuted)
    assert foreign.bridge == "perm"
    texts = ["John lives in Paris .", "the cat sat on a mat", "unbelievably quiet dogs"]
    batch = bert.tokenize(texts)
    engine = Engine(bert, bridges={"perm": loaded})
    logits, batches = engine.run(batch, {"ner": foreign})
    assert batches["ner"] is batch  # the alignment bridge keeps the source tokens
    want, _ = Engine(permuted).run(permuted.tokenize(texts), {"ner": native})
    assert torch.allclose(logits["ner"], want["ner"], atol=1e-4)
    got = engine.predict(batch, {"ner": foreign})["ner"]
    expected = Engine(permuted).predict(permuted.tokenize(texts), {"ner": native})["ner"]
    strip = (lambda rows: [[{k: v for k, v in e.items() if k != "score"} for e in r["entities"]] for r in rows])
    assert strip(got) == strip(expected) and any(r["entities"] for r in got)
    scores = (lambda rows: [e.get("score", 0.0) for r in rows for e in r["entities"]])
    assert scores(got) == pytest.approx(scores(expected), abs=1e-5)


def test_a_long_text_reads_in_windows_through_the_alignment_bridge_as_on_its_own_backbone(paired, bert, bert_dir,
                                                                                           permuted, tmp_path):
    """An alignment bridge keeps this backbone's tokens, so its modules' logits lie on them: a text over
    one window is read in windows and answered as one, as the module answers on its own backbone (it
    was refused, 413, as for a bridge that reads the text with another tokenizer); with worker
    processes, which now decode such a module's logits, the same answers."""
    import os

    import httpx

    from modules_store import ModuleStore
    from server.api.app import create_app
    from server.config import Settings
    from server.modules import save_module
    from tests.helpers import LiveServer, start_tmod_serve

    bridge, _ = align(paired, mapping="skip")
    bridges = bridge_store(tmp_path / "bridges")
    save_bridge(bridges, "perm", "1", bridge, bert, permuted)
    modules = ModuleStore(tmp_path / "modules")
    save_module(modules, "ner", "1", random_head(permuted, "token_classification", NER_LABELS, 6, layers=[0, 2, 3]),
                permuted)
    save_module(modules, "mood", "1", random_head(permuted, "sequence_classification", ["low", "high"], 7), permuted)
    text = " ".join(["John lives in Paris and the cat sat on a mat while unbelievably quiet dogs were playing"] * 3)
    answers = {}
    for backbone in (bert, permuted):  # through the bridge, then on the modules' own backbone
        settings = Settings(store=modules.root, bridges=bridges.root, head_precision="fp32", window_tokens=16,
                            window_stride=12)
        with LiveServer(create_app(settings, backbone=backbone)) as server:
            got = httpx.post(server.url + "/v1/infer", json={"inputs": [text]}, timeout=60)
            assert got.status_code == 200, got.text
            answers[backbone.name] = got.json()
    url, process = start_tmod_serve(["--workers", "2", "--backbone", str(bert_dir), "--store", str(modules.root),
                                     "--bridges", str(bridges.root), "--head-precision", "fp32", "--window-tokens",
                                     "16", "--window-stride", "12"], {**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        workers = httpx.post(url + "/v1/infer", json={"inputs": [text]}, timeout=60).json()
    finally:
        process.kill()
        process.wait()
    strip = (lambda result: [{k: v for k, v in e.items() if k != "score"} for e in result["ner"]["entities"]])
    scores = (lambda result: [e["score"] for e in result["ner"]["entities"]])
    bridged = answers[bert.name]
    assert bridged["windows"][0] > 2
    for other in (answers[permuted.name], workers):  # the module on its own backbone; tmod-serve --workers 2
        assert other["windows"] == bridged["windows"]
        mine, theirs = bridged["results"][0], other["results"][0]
        assert strip(mine) == strip(theirs) != [] and scores(mine) == pytest.approx(scores(theirs), abs=1e-4)
        assert mine["mood"]["label"] == theirs["mood"]["label"]
        assert mine["mood"]["scores"] == pytest.approx(theirs["mood"]["scores"], abs=1e-4)


def test_null_baseline_is_below_the_real_matching(paired):
    _, diag = align(paired, mapping="skip")
    for j, v in diag["per_state"].items():
        assert v["null_matched_correlation"] < 0.5 < v["mean_matched_correlation"]
