"""Heads of one kind run as one grouped computation and answer exactly what each head alone answers."""
from __future__ import annotations

import pytest
import torch

from modules_store import ModuleStore
from server.engine import Engine, run_head
from server.heads.layermix.grouped import MixGroup, SequenceStack, TokenStack
from server.heads.mtb import MTBHead
from server.heads.mtb.grouped import BlockGroup
from server.modules import LoadedModule, load_module, save_module
from server.heads.layermix import LayerMixConfig, LayerMixHead
from tests.helpers import NER_LABELS, random_head

TEXTS = ["John Smith flew from Paris to New York on Monday.", "A fine, quiet film.", "ok", "IBM and NASA, 2024!"]
PAIRS = ["He travelled.", "It was good.", "fine", "Yes"]


def as_modules(**heads):
    return {task: LoadedModule(task, "1", None, head) for task, head in heads.items()}


def mix_head(backbone, task_type, labels, seed, **config) -> LayerMixHead:
    """tests.helpers.random_head, with every size open to change."""
    torch.manual_seed(seed)
    config = {"layers": list(range(backbone.num_layers + 1)), "project_dim": 16, "attention_heads": 2,
              "ffn_dim": 32, **config}
    head = LayerMixHead(LayerMixConfig(task_type=task_type, num_labels=len(labels),
                                       hidden_size=backbone.hidden_size, **config), labels)
    with torch.no_grad():  # spread the layer logits so the mix is not uniform
        head.layer_logits.copy_(torch.randn(len(config["layers"])) * 0.05)
    return head.eval()


def perturbed_mtb(backbone, task_type, labels, seed, **options):
    torch.manual_seed(seed)
    head = MTBHead.from_backbone(backbone, task_type, labels, **options).eval()
    with torch.no_grad():  # as if trained: each head's blocks differ from the backbone's and each other's
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return head


def layermix_heads(backbone) -> dict:
    """Sequence and token heads of one width with every option the classifiers have: label counts,
    attention heads, encoder depth, FFN width, casing, positions (one table shorter than the batch),
    a cutoff that leaves states unread; plus a second width that forms its own group."""
    seq, tok = "sequence_classification", "token_classification"
    return {
        "seq2": mix_head(backbone, seq, ["a", "b"], 1),
        "seq5": mix_head(backbone, seq, list("abcde"), 2, casing=True),
        "seq3_pos": mix_head(backbone, seq, list("abc"), 3, positional=True, max_positions=6),
        "seq_heads4": mix_head(backbone, seq, ["a", "b"], 4, attention_heads=4, positional=True),
        "seq_cut": mix_head(backbone, seq, ["a", "b", "c"], 5, cutoff=0.3, alpha=40.0),
        "ner": mix_head(backbone, tok, NER_LABELS, 6, casing=True),
        "tok4": mix_head(backbone, tok, list("wxyz"), 7),
        "tok_pos": mix_head(backbone, tok, NER_LABELS, 8, positional=True, max_positions=9, casing=True),
        "tok_deep": mix_head(backbone, tok, list("pq"), 9, encoder_layers=2),
        "tok_deep2": mix_head(backbone, tok, list("pqr"), 10, encoder_layers=2, cutoff=0.3, alpha=40.0),
        "k8_seq": mix_head(backbone, seq, ["a", "b"], 11, layers=[1, 2], project_dim=8),
        "k8_tok": mix_head(backbone, tok, NER_LABELS, 12, project_dim=8, positional=True),
        "pair2": mix_head(backbone, seq, ["a", "b"], 13, pooling="pair"),
        "pair3_casing": mix_head(backbone, seq, list("abc"), 14, pooling="pair", casing=True),
        "pair_plain": mix_head(backbone, seq, ["a", "b"], 15, pooling="pair", attention=False),
        "mean_plain": mix_head(backbone, seq, list("abc"), 16, attention=False, casing=True),
    }


def mtb_heads(backbone) -> dict:
    seq, tok = "sequence_classification", "token_classification"
    return {
        "mtb_mean": perturbed_mtb(backbone, seq, ["a", "b"], 21),
        "mtb_cls": perturbed_mtb(backbone, seq, list("abc"), 22, pooling="cls"),
        "mtb_mean3": perturbed_mtb(backbone, seq, list("abcd"), 23),
        "mtb_tok": perturbed_mtb(backbone, tok, NER_LABELS, 24),
        "mtb_tok2": perturbed_mtb(backbone, tok, ["x", "y"], 25),
        "mtb_two_blocks": perturbed_mtb(backbone, seq, ["a", "b"], 26, num_blocks=2),
        "mtb_two_blocks_tok": perturbed_mtb(backbone, tok, NER_LABELS, 27, num_blocks=2),
    }


def alone(engine: Engine, batch, modules: dict) -> dict:
    """Each head run by itself (a plan of one head never groups)."""
    return {task: engine.logits(batch, {task: module})[task] for task, module in modules.items()}


def assert_equal(grouped: dict, expected: dict) -> None:
    assert set(grouped) == set(expected)
    for task in expected:
        assert grouped[task].shape == expected[task].shape, task
        torch.testing.assert_close(grouped[task], expected[task], atol=1e-5, rtol=0, msg=task)


def test_plan_groups_heads_by_kind_and_shape(tiny_backbone):
    modules = as_modules(**layermix_heads(tiny_backbone), **mtb_heads(tiny_backbone))
    plan = Engine(tiny_backbone).plan(modules)
    assert plan.single == []  # every head has a partner of its kind
    mixes = sorted((g for g in plan.groups if isinstance(g, MixGroup)), key=lambda g: g.k)
    assert [g.k for g in mixes] == [8, 16]
    stacks = {tuple(sorted(s.tasks)): type(s) for s in mixes[1].stacks}
    assert stacks == {
        ("seq2", "seq3_pos", "seq5", "seq_cut"): SequenceStack,  # 2 attention heads, labels 2..5
        ("seq_heads4",): SequenceStack,  # 4 attention heads: a shape of its own
        ("pair2", "pair3_casing"): SequenceStack,  # pair pooling: a shape of its own
        ("pair_plain",): SequenceStack,  # no attention layer
        ("mean_plain",): SequenceStack,
        ("ner", "tok4", "tok_pos"): TokenStack,
        ("tok_deep", "tok_deep2"): TokenStack,  # 2 encoder layers
    }
    blocks = [g for g in plan.groups if isinstance(g, BlockGroup)]
    assert sorted(sorted(g.tasks) for g in blocks) == [
        ["mtb_cls", "mtb_mean", "mtb_mean3", "mtb_tok", "mtb_tok2"],  # read state L-1
        ["mtb_two_blocks", "mtb_two_blocks_tok"],  # read state L-2
    ]
    assert Engine(tiny_backbone, fuse=False).plan(modules).groups == []


@pytest.mark.parametrize("pairs", [None, PAIRS], ids=["single texts", "text pairs"])
def test_grouped_equals_each_head_alone(tiny_backbone, pairs):
    modules = as_modules(**layermix_heads(tiny_backbone), **mtb_heads(tiny_backbone))
    engine = Engine(tiny_backbone)
    batch = tiny_backbone.tokenize(TEXTS, pairs)
    assert batch.seq_len > 9  # longer than the short position tables: their clamp is exercised
    grouped = engine.logits(batch, modules)
    assert_equal(grouped, alone(engine, batch, modules))
    assert_equal(grouped, Engine(tiny_backbone, fuse=False).logits(batch, modules))


@pytest.mark.parametrize("pairs", [None, PAIRS], ids=["single texts", "text pairs"])
def test_the_gpu_attention_gives_each_head_s_answers(tiny_backbone, pairs, monkeypatch):
    """Stacked attention's GPU form (fused SDPA with a boolean padding mask), run here on the CPU in
    place of the CPU form: the grouped heads still equal each head alone (nn.MultiheadAttention)."""
    import server.heads.layermix.grouped as grouped

    calls = []

    def gpu_form(*args):
        calls.append(args[0].shape)
        return grouped.fused_attention(*args)

    modules = as_modules(**layermix_heads(tiny_backbone))
    engine = Engine(tiny_backbone)
    batch = tiny_backbone.tokenize(TEXTS, pairs)
    expected = alone(engine, batch, modules)
    monkeypatch.setattr(grouped, "small_attention", gpu_form)
    assert_equal(engine.logits(batch, modules), expected)
    assert calls  # the stacks' attention ran in its GPU form


def test_grouped_equals_alone_on_minilm(minilm):
    """The real backbone (12 attention heads, H=384) and the default head sizes (k=64, 4 heads)."""
    modules = as_modules(**layermix_heads(minilm), **mtb_heads(minilm))
    engine = Engine(minilm)
    batch = minilm.tokenize(TEXTS)
    assert_equal(engine.logits(batch, modules), alone(engine, batch, modules))


def test_grouped_mtb_on_a_decoder(tiny_llama):
    """Causal mask and rotary positions are built once for the group."""
    modules = as_modules(**mtb_heads(tiny_llama), **layermix_heads(tiny_llama))
    engine = Engine(tiny_llama)
    batch = tiny_llama.tokenize(TEXTS)
    assert_equal(engine.logits(batch, modules), alone(engine, batch, modules))


def test_a_subset_gets_only_its_tasks(tiny_backbone):
    modules = as_modules(**layermix_heads(tiny_backbone), **mtb_heads(tiny_backbone))
    engine = Engine(tiny_backbone)
    batch = tiny_backbone.tokenize(TEXTS)
    union = engine.logits(batch, modules)
    for subset in (["seq5", "ner"], ["tok_deep", "mtb_cls", "mtb_tok"], ["k8_tok", "seq_heads4", "mtb_two_blocks"]):
        got = engine.logits(batch, {t: modules[t] for t in subset})
        assert set(got) == set(subset)
        assert_equal(got, {t: union[t] for t in subset})


def test_merged_lora_mtbs_group_with_mtbs(tmp_path, tiny_backbone):
    from tests.test_mtb import trained_lora

    store = ModuleStore(tmp_path)
    for task, seed in (("lora1", 1), ("lora2", 2)):
        save_module(store, task, "1", trained_lora(tiny_backbone, seed=seed), tiny_backbone)
    modules = {task: load_module(store, task, None, tiny_backbone) for task in ("lora1", "lora2")}
    modules.update(as_modules(mtb=perturbed_mtb(tiny_backbone, "sequence_classification", ["a", "b"], 3)))
    engine = Engine(tiny_backbone)
    plan = engine.plan(modules)
    assert [sorted(g.tasks) for g in plan.groups] == [["lora1", "lora2", "mtb"]]
    batch = tiny_backbone.tokenize(TEXTS)
    assert_equal(engine.logits(batch, modules), alone(engine, batch, modules))
    # in training form (unmerged adapters) LoRA-MTBs have other weights: a group of their own
    unmerged = as_modules(a=trained_lora(tiny_backbone, seed=1), b=trained_lora(tiny_backbone, seed=2))
    everything = {**modules, **unmerged}
    assert sorted(sorted(g.tasks) for g in engine.plan(everything).groups) == [["a", "b"], ["lora1", "lora2", "mtb"]]
    assert_equal(engine.logits(batch, everything), alone(engine, batch, everything))


def test_reload_never_serves_stale_stacks(tmp_path, tiny_backbone):
    """A module replaced in a running server (new version, hot) answers with its new weights at once,
    though the plan with the old stacked weights had been built and cached."""
    from server.config import Settings
    from server.runtime import Runtime

    store = ModuleStore(tmp_path / "store")
    seq = "sequence_classification"
    save_module(store, "sentiment", "1", random_head(tiny_backbone, seq, ["neg", "pos"], 1), tiny_backbone)
    save_module(store, "sentiment", "2", random_head(tiny_backbone, seq, ["neg", "pos"], 2), tiny_backbone)
    save_module(store, "topic", "1", random_head(tiny_backbone, seq, list("abc"), 3), tiny_backbone)
    save_module(store, "mtb", "1", perturbed_mtb(tiny_backbone, seq, ["a", "b"], 4), tiny_backbone)
    save_module(store, "mtb", "2", perturbed_mtb(tiny_backbone, seq, ["a", "b"], 5), tiny_backbone)
    save_module(store, "mtb2", "1", perturbed_mtb(tiny_backbone, seq, ["a", "b"], 6), tiny_backbone)
    runtime = Runtime(Settings(store=store.root), backbone=tiny_backbone)
    runtime.start()
    runtime.load_task("sentiment", "1")
    runtime.load_task("mtb", "1")
    batch = tiny_backbone.tokenize(TEXTS)
    engine = runtime.engine
    before = engine.logits(batch, runtime.modules)
    assert len(engine.plan(runtime.modules).groups) == 2  # cached, with v1's stacked weights
    runtime.load_task("sentiment", "2")
    runtime.load_task("mtb", "2")
    after = engine.logits(batch, runtime.modules)
    expected = alone(Engine(runtime.backbone), batch, runtime.modules)
    assert_equal(after, expected)
    for task in ("sentiment", "mtb"):
        assert (after[task] - before[task]).abs().max() > 1e-3  # the new version answers
    torch.testing.assert_close(after["topic"], before["topic"], atol=1e-6, rtol=0)
    runtime.unload_task("topic")
    assert set(engine.logits(batch, runtime.modules)) == {"sentiment", "mtb", "mtb2"}
    runtime.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_grouped_heads_on_cuda_match_and_capture_as_a_graph(tiny_backbone, request):
    """On a GPU the grouped pass equals each head's own computation and captures as one CUDA graph
    (no host syncs, no tensors made from Python values). The reference is PyTorch's exact path for
    its encoder layers: their CUDA fast path alone drifts by ~1e-4 (measured on an H100)."""
    # exact fp32 matmuls for the comparison (set and restored by hand: these flags are properties
    # that monkeypatch cannot delete-and-restore on torch 2.11)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    request.addfinalizer(lambda: (setattr(torch.backends.cuda.matmul, "allow_tf32", saved[0]),
                                  setattr(torch.backends.cudnn, "allow_tf32", saved[1])))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    heads = {task: head.cuda() for task, head in layermix_heads(tiny_backbone).items()}
    batch = tiny_backbone.tokenize(TEXTS, PAIRS).to("cuda")
    # the token classes the heads read are made from the raw text (host work) and kept on the batch:
    # made here, before the graph, as the model runner does before a capture
    batch.token_classes("casing")
    batch.token_classes("segment")
    plan = Engine(tiny_backbone).plan(as_modules(**heads))
    assert plan.single == []
    states = [torch.randn(batch.size, batch.seq_len, tiny_backbone.hidden_size, device="cuda")
              for _ in range(tiny_backbone.num_layers + 1)]

    def grouped() -> dict:
        out = {}
        for group in plan.groups:
            state = group.start(batch)
            for index in group.layers:
                state = group.consume(state, index, states[index])
            out.update(group.finish(state, batch))
        return out

    def each_alone() -> dict:
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            return {task: run_head(head, batch, states) for task, head in heads.items()}
        finally:
            torch.backends.mha.set_fastpath_enabled(True)

    with torch.inference_mode():
        assert_equal(grouped(), each_alone())
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                grouped()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = grouped()
        for state in states:
            state.copy_(torch.randn_like(state))
        graph.replay()
        assert_equal(captured, each_alone())
