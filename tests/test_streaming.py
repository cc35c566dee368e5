"""Streaming equals the reference computation; memory stays bounded; early exit cuts layers."""
from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F

from server.backbone import Backbone
from server.engine import Engine
from server.heads.layermix.layer import cutoff_weights
from server.modules import LoadedModule
from tests.helpers import NER_LABELS, make_tiny_backbone_dir, random_head

TEXTS = ["John Smith flew from Paris to New York on Monday.", "A fine, quiet film.", "ok"]
PAIRS = ["He travelled.", "It was good.", "fine"]


def reference_logits(head, backbone, batch):
    """The paper's computation as written: stack every hidden state, then mix them."""
    states = backbone.all_states(batch)
    cfg = head.config
    projected = torch.stack(
        [F.layer_norm(F.gelu(states[layer]) @ head.projections[slot].T, (cfg.project_dim,))
         for slot, layer in enumerate(cfg.layers)]
    )  # (n, B, T, k)
    weights = cutoff_weights(torch.softmax(cfg.alpha * head.layer_logits, 0), cfg.cutoff)
    mixed = F.gelu((weights[:, None, None, None] * projected).sum(0))
    if head.casing is not None:
        mixed = mixed + head.casing(batch.token_classes("casing"))
    if head.config.pooling == "pair":
        return head.classifier(mixed, batch.attention_mask, batch.token_classes("segment"))
    return head.classifier(mixed, batch.attention_mask)


def test_pair_pooling_pools_the_text_and_the_pair_apart(tiny_backbone):
    """u = mean over the text's tokens, v = over the pair's (special tokens, padding and filler rows
    in neither), features [u, v, |u - v|, u * v]; a row without a pair has v = 0."""
    from server.heads.layermix.layer import pool

    encoded = tiny_backbone.encode(TEXTS, PAIRS) + tiny_backbone.encode(["no pair here"])
    batch = tiny_backbone.text.collate(encoded, shape=(len(encoded) + 1, 40), classes=["segment"])
    segments = batch.token_classes("segment")
    assert (segments[-1] == 2).all()  # the filler row
    torch.manual_seed(0)
    attended = torch.randn(batch.size, batch.seq_len, 6)
    got = pool(attended, batch.attention_mask, segments)
    assert got.shape == (batch.size, 24)
    for row in range(batch.real_rows):
        ids = batch.sequence_ids[row]
        u = attended[row, [t for t, s in enumerate(ids) if s == 0]].mean(0)
        pair_tokens = [t for t, s in enumerate(ids) if s == 1]
        v = attended[row, pair_tokens].mean(0) if pair_tokens else torch.zeros(6)
        torch.testing.assert_close(got[row], torch.cat([u, v, (u - v).abs(), u * v]), atol=1e-6, rtol=0)
    assert not pair_tokens  # the last real row had no pair


def as_modules(**heads):
    return {task: LoadedModule(task, "1", None, head) for task, head in heads.items()}


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_stream_matches_hf_forward_for_encoder_families(tmp_path, family):
    backbone = Backbone.load(make_tiny_backbone_dir(tmp_path, family))
    batch = backbone.tokenize(TEXTS)
    reference = backbone.all_states(batch)
    streamed = [h for _, h in backbone.stream(batch)]
    assert len(streamed) == len(reference) == backbone.num_layers + 1
    for ref, got in zip(reference, streamed):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_stream_matches_hf_forward_for_a_llama_decoder(tmp_path):
    """Causal decoder: same states as the model's forward (HF applies the final RMSNorm to its last
    hidden state; tmod hands out the raw block output like every other state), padding on the right
    changes nothing for the real tokens."""
    backbone = Backbone.load(make_tiny_backbone_dir(tmp_path, "llama"))
    batch = backbone.tokenize(TEXTS)
    reference = backbone.all_states(batch)
    streamed = [h for _, h in backbone.stream(batch)]
    assert len(streamed) == len(reference) == backbone.num_layers + 1
    real = batch.attention_mask.bool()
    for ref, got in zip(reference[:-1], streamed[:-1]):
        torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(backbone.model.norm(streamed[-1])[real], reference[-1][real], atol=1e-5, rtol=0)
    for row, text in enumerate(TEXTS):  # each row alone (no padding) equals its padded row
        alone = [h for _, h in backbone.stream(backbone.tokenize([text]))]
        n = int(batch.attention_mask[row].sum())
        for together, single in zip(streamed, alone):
            torch.testing.assert_close(together[row, :n], single[0], atol=1e-5, rtol=0)
    head = random_head(backbone, "token_classification", NER_LABELS, seed=5)
    logits = Engine(backbone).logits(batch, as_modules(ner=head))["ner"]
    assert logits.shape == (len(TEXTS), batch.seq_len, len(NER_LABELS))


def check_layermix_equals_reference(backbone, texts, pairs=None):
    heads = {
        "seq": random_head(backbone, "sequence_classification", ["a", "b", "c"], seed=11),
        "tok": random_head(backbone, "token_classification", NER_LABELS, seed=12, casing=True),
        "cut": random_head(backbone, "sequence_classification", ["x", "y"], seed=13, cutoff=0.2, alpha=40.0),
    }
    batch = backbone.tokenize(texts, pairs)
    for fuse in (True, False):
        streamed = Engine(backbone, fuse=fuse).logits(batch, as_modules(**heads))
        for task, head in heads.items():
            with torch.inference_mode():
                expected = reference_logits(head, backbone, batch)
            torch.testing.assert_close(streamed[task], expected, atol=1e-5, rtol=0)


@pytest.mark.smoke
def test_layermix_stream_equals_reference_tiny_bert(tiny_backbone):
    check_layermix_equals_reference(tiny_backbone, TEXTS)
    check_layermix_equals_reference(tiny_backbone, TEXTS, PAIRS)


def test_layermix_stream_equals_reference_minilm(minilm):
    check_layermix_equals_reference(minilm, TEXTS)


def test_cutoff_layers_are_never_projected(tiny_backbone):
    head = random_head(tiny_backbone, "sequence_classification", ["a", "b"], seed=5, cutoff=0.3)
    with torch.no_grad():
        head.layer_logits.copy_(torch.tensor([0.0, 0.1, -0.1, 0.05]))  # alpha 64: layer 1 dominates
    read = head.layers_read()
    assert 0 < len(read) < 4
    seen = []
    original = head.consume
    head.consume = lambda state, index, hidden: (seen.append(index), original(state, index, hidden))[1]
    Engine(tiny_backbone).logits(tiny_backbone.tokenize(TEXTS), as_modules(only=head))
    assert seen == read


@pytest.mark.smoke
def test_at_most_two_layer_outputs_alive(tiny_backbone):
    batch = tiny_backbone.tokenize(TEXTS)
    refs, most_alive = [], 0
    for _, hidden in tiny_backbone.stream(batch):
        refs.append(weakref.ref(hidden))
        del hidden
        most_alive = max(most_alive, sum(r() is not None for r in refs))
    # the state being handed out, and at most the one it was computed from
    assert most_alive <= 2
    assert len(refs) == tiny_backbone.num_layers + 1


def test_stacking_path_keeps_everything_alive(tiny_backbone):
    """Control for the test above: the reference path does keep every state, so the check can fail."""
    states = tiny_backbone.all_states(tiny_backbone.tokenize(TEXTS))
    refs = [weakref.ref(s) for s in states]
    assert sum(r() is not None for r in refs) == tiny_backbone.num_layers + 1


@pytest.mark.smoke
def test_early_exit_runs_only_needed_layers(tiny_backbone):
    calls = []
    hooks = [layer.register_forward_hook(lambda m, i, o, n=n: calls.append(n))
             for n, layer in enumerate(tiny_backbone.adapter.layers)]
    try:
        shallow = random_head(tiny_backbone, "sequence_classification", ["a", "b"], seed=1, layers=[0, 1])
        engine = Engine(tiny_backbone)
        batch = tiny_backbone.tokenize(TEXTS)
        engine.logits(batch, as_modules(shallow=shallow))
        assert calls == [0]  # state 1 is the output of layer 0; layers 1 and 2 never run
        calls.clear()
        deep = random_head(tiny_backbone, "sequence_classification", ["a", "b"], seed=2, layers=[2, 3])
        engine.logits(batch, as_modules(shallow=shallow, deep=deep))
        assert calls == [0, 1, 2]
        assert engine.plan(as_modules(shallow=shallow)).deepest == 1
    finally:
        for hook in hooks:
            hook.remove()


def test_batch_rows_do_not_depend_on_padding(tiny_backbone):
    head = random_head(tiny_backbone, "sequence_classification", ["a", "b"], seed=3)
    engine = Engine(tiny_backbone)
    together = engine.logits(tiny_backbone.tokenize(TEXTS), as_modules(s=head))["s"]
    for row, text in enumerate(TEXTS):
        alone = engine.logits(tiny_backbone.tokenize([text]), as_modules(s=head))["s"]
        torch.testing.assert_close(together[row], alone[0], atol=1e-5, rtol=0)
