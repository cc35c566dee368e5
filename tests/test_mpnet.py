"""MPNet (all-mpnet-base-v2's architecture) in the backbone: its layers take a relative position bias
computed once per batch. A tiny randomly initialised MPNet with an MPNet-style tokenizer stands in for
the real one (tests/test_mpnet_real.py, slow, runs the real model when its packages are installed)."""
from __future__ import annotations

import pytest
import torch

from server.backbone import Backbone
from server.engine import Engine
from tests.helpers import NER_LABELS, make_tiny_backbone_dir, random_head
from tests.test_streaming import PAIRS, TEXTS, as_modules, check_layermix_equals_reference


@pytest.fixture(scope="module")
def tiny_mpnet(tmp_path_factory):
    return Backbone.load(make_tiny_backbone_dir(tmp_path_factory.mktemp("mpnet"), "mpnet", layers=3))


def assert_states_equal(backbone, batch, streamed, atol=1e-5):
    """Every streamed state equals the Hugging Face forward's on every real token."""
    reference = backbone.all_states(batch)
    assert len(streamed) == len(reference) == backbone.num_layers + 1
    real = batch.attention_mask.bool()
    for ref, got in zip(reference, streamed):
        torch.testing.assert_close(got[real], ref[real], atol=atol, rtol=0)


def test_layout_and_tokens(tiny_mpnet):
    assert tiny_mpnet.fingerprint.architecture == "MPNetModel"
    assert tiny_mpnet.max_tokens == 128  # 130 positions less the two MPNet reserves for padding
    assert not tiny_mpnet.adapter.uses_token_types
    batch = tiny_mpnet.tokenize(TEXTS, PAIRS)
    assert batch.token_type_ids is None
    ids = batch.input_ids[2, :int(batch.attention_mask[2].sum())].tolist()
    assert ids[0] == 0 and ids[-1] == 2 and ids.count(2) == 3  # <s> ok </s></s> fine </s>
    assert batch.input_ids[2, -1].item() == 1  # padded with <pad> = 1, as MPNet's positions expect


@pytest.mark.parametrize("pairs", [None, PAIRS], ids=["texts", "pairs"])
def test_stream_matches_hf_forward(tiny_mpnet, pairs):
    batch = tiny_mpnet.tokenize(TEXTS, pairs)
    assert batch.attention_mask.sum(1).min() < batch.seq_len  # rows are padded
    assert_states_equal(tiny_mpnet, batch, [h for _, h in tiny_mpnet.stream(batch)])


def test_padding_changes_no_real_token(tiny_mpnet):
    batch = tiny_mpnet.tokenize(TEXTS, PAIRS)
    together = [h for _, h in tiny_mpnet.stream(batch)]
    for row, (text, pair) in enumerate(zip(TEXTS, PAIRS)):
        alone = [h for _, h in tiny_mpnet.stream(tiny_mpnet.tokenize([text], [pair]))]
        n = int(batch.attention_mask[row].sum())
        for padded, single in zip(together, alone):
            torch.testing.assert_close(padded[row, :n], single[0], atol=1e-5, rtol=0)


def test_position_bias_is_computed_once_per_batch(tiny_mpnet):
    """One bias lookup per batch (not per layer), from bucket ids made once per length: the same
    (T, T) tensor serves the next batch of that length (a captured graph holds no host copy)."""
    table = tiny_mpnet.model.encoder.relative_attention_bias
    calls = []
    hook = table.register_forward_hook(lambda m, i, o: calls.append(i[0]))
    try:
        list(tiny_mpnet.stream(tiny_mpnet.tokenize(TEXTS)))
        list(tiny_mpnet.stream(tiny_mpnet.tokenize(TEXTS)))
    finally:
        hook.remove()
    assert len(calls) == 2 and calls[0] is calls[1]


def test_early_exit_runs_only_needed_layers(tiny_mpnet):
    calls = []
    hooks = [layer.register_forward_hook(lambda m, i, o, n=n: calls.append(n))
             for n, layer in enumerate(tiny_mpnet.adapter.layers)]
    try:
        batch = tiny_mpnet.tokenize(TEXTS, PAIRS)
        shallow = random_head(tiny_mpnet, "sequence_classification", ["a", "b"], seed=1, layers=[0, 1])
        engine = Engine(tiny_mpnet)
        engine.logits(batch, as_modules(shallow=shallow))
        assert calls == [0]
        states = [h for _, h in tiny_mpnet.stream(batch, upto=2)]
        assert len(states) == 3
        assert_states_equal_prefix(tiny_mpnet, batch, states)
    finally:
        for hook in hooks:
            hook.remove()


def assert_states_equal_prefix(backbone, batch, states):
    reference = backbone.all_states(batch)[:len(states)]
    real = batch.attention_mask.bool()
    for ref, got in zip(reference, states):
        torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=0)


def test_layermix_heads_equal_the_reference(tiny_mpnet):
    check_layermix_equals_reference(tiny_mpnet, TEXTS)
    check_layermix_equals_reference(tiny_mpnet, TEXTS, PAIRS)


def test_bf16_states_stay_close_to_fp32(tiny_mpnet):
    batch = tiny_mpnet.tokenize(TEXTS, PAIRS)
    fp32 = [h for _, h in tiny_mpnet.stream(batch)]
    bf16 = [h for _, h in tiny_mpnet.use_backend("torch", "bf16").stream(batch)]
    assert all(h.dtype == torch.float32 for h in bf16)
    real = batch.attention_mask.bool()
    torch.testing.assert_close(bf16[0], fp32[0])  # the embeddings are not touched
    for a, b in zip(bf16[1:], fp32[1:]):
        assert not torch.equal(a, b)  # it did run in 16 bits
        torch.testing.assert_close(a[real], b[real], atol=0.1, rtol=0.05)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_cuda_precisions_match_the_cpu_forward(tiny_mpnet, tmp_path, precision):
    on_gpu = Backbone.load(make_tiny_backbone_dir(tmp_path, "mpnet", layers=3), device="cuda")
    batch = tiny_mpnet.tokenize(TEXTS, PAIRS)
    expected = [h for _, h in tiny_mpnet.stream(batch)]
    got = [h.cpu() for _, h in on_gpu.use_backend("torch", precision).stream(on_gpu.tokenize(TEXTS, PAIRS))]
    real = batch.attention_mask.bool()
    tolerance = 1e-4 if precision == "fp32" else 0.1
    for a, b in zip(got, expected):
        torch.testing.assert_close(a[real], b[real], atol=tolerance, rtol=0.05)


def test_fp16_on_the_cpu_is_refused(tiny_mpnet):
    with pytest.raises(ValueError, match="precision fp16 needs a cuda device"):
        tiny_mpnet.use_backend("torch", "fp16")


def test_mtb_and_lora_mtb_heads_reproduce_the_last_block(tiny_mpnet, tmp_path):
    """MTB heads on MPNet hold a frozen copy of the encoder's relative position table: copied from
    the last block they give the backbone's last state (pairs, padding), also after a round trip
    through the store (MTB stores the table; LoRA-MTB copies it from the backbone at load), and two
    of them grouped in one plan answer as each alone."""
    from modules_store import ModuleStore, TaskType
    from server.heads.mtb import MTBHead
    from server.modules import load_module, save_module
    from training.lora import TrainableLoraMTB

    mtb = MTBHead.from_backbone(tiny_mpnet, TaskType.sequence_classification, ["a", "b"]).eval()
    lora = TrainableLoraMTB.from_backbone(tiny_mpnet, TaskType.token_classification, NER_LABELS, rank=4).eval()
    table = tiny_mpnet.model.encoder.relative_attention_bias.weight
    for head in (mtb, lora):
        assert not any(p.requires_grad for p in head.positions.parameters())  # never trained
        torch.testing.assert_close(head.positions.table.weight, table, atol=0, rtol=0)
    store = ModuleStore(tmp_path)
    save_module(store, "mood", "1", mtb, tiny_mpnet)
    save_module(store, "ner", "1", lora, tiny_mpnet)
    loaded = {task: load_module(store, task, "1", tiny_mpnet) for task in ("mood", "ner")}

    batch = tiny_mpnet.tokenize(TEXTS, PAIRS)
    states = tiny_mpnet.all_states(batch)
    real = batch.attention_mask.bool()
    last = tiny_mpnet.num_layers - 1
    for head in (mtb, lora, loaded["mood"].head, loaded["ner"].head):
        assert head.layers_read() == [last]
        with torch.inference_mode():
            state = head.consume(head.start(batch), last, states[-2])
        torch.testing.assert_close(state["hidden"][real], states[-1][real], atol=1e-5, rtol=0)

    engine = Engine(tiny_mpnet)
    together = engine.logits(batch, loaded)
    for task, module in loaded.items():
        alone = engine.logits(batch, {task: module})[task]
        torch.testing.assert_close(together[task], alone, atol=1e-5, rtol=0)


def test_token_head_answers_in_input_coordinates(tiny_mpnet):
    """A token head on MPNet decodes entities whose offsets slice the input text (pairs too)."""
    from server.heads.decode import decode

    head = random_head(tiny_mpnet, "token_classification", NER_LABELS, seed=4, casing=True)
    batch = tiny_mpnet.tokenize(TEXTS, PAIRS)
    logits = Engine(tiny_mpnet).logits(batch, as_modules(ner=head))["ner"]
    assert logits.shape == (len(TEXTS), batch.seq_len, len(NER_LABELS))
    for row, output in enumerate(decode(head.task_type, head.labels, logits, batch)):
        for entity in output["entities"]:
            source = TEXTS[row] if entity.get("segment", 0) == 0 else PAIRS[row]
            assert source[entity["start"]:entity["end"]] == entity["text"]


def test_onnx_backend_exports_mpnet_per_layer(tiny_mpnet, tmp_path):
    """The per-layer export holds: each layer graph takes the state and the bias (position bias with
    the padding mask folded in, (B, heads, T, T), symbolic in batch and length); fp32 equals the HF
    forward, early exit runs only the needed graphs, int8 stays close."""
    onnx = tiny_mpnet.use_backend("onnx", "fp32", cache_dir=tmp_path)
    for texts, pairs in ((TEXTS, None), (TEXTS, PAIRS), (["a b c", "d"], ["x y z w v u t s r q", "e"])):
        batch = tiny_mpnet.tokenize(texts, pairs)
        assert_states_equal(tiny_mpnet, batch, [h for _, h in onnx.stream(batch)])
    before = list(onnx.backend.runs)
    head = random_head(tiny_mpnet, "sequence_classification", ["a", "b"], seed=1, layers=[0, 1])
    Engine(onnx).logits(tiny_mpnet.tokenize(TEXTS), as_modules(shallow=head))
    assert [a - b for a, b in zip(onnx.backend.runs, before)] == [1, 1, 0, 0]
    batch = tiny_mpnet.tokenize(TEXTS, PAIRS)
    int8 = [h for _, h in tiny_mpnet.use_backend("onnx", "int8", cache_dir=tmp_path).stream(batch)]
    assert_states_equal(tiny_mpnet, batch, int8, atol=0.05)
