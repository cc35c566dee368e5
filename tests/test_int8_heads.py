"""head_precision int8: layer-mix projections as int8 products (server/heads/layermix/grouped.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modules_store import ModuleStore
from server.config import Settings
from server.engine import Engine
from server.heads.layermix.grouped import WEIGHT_LEVELS, Int8Projection, MixGroup
from server.modules import load_module, servable_tasks
from server.runner.model_runner import ModelRunner
from tests.test_grouped_heads import PAIRS, TEXTS, alone, as_modules, assert_equal, layermix_heads, mtb_heads


def test_int8_projection_is_the_quantised_product():
    """The int8 path computes exactly s * (q W_q^T * row scales + (128 + lo / s) * row sums), with q
    each token quantised onto its own [lo, hi] range and W_q each row onto [-64, 64], and that is
    close to the float product; a constant token (all zeros here) comes out exactly."""
    torch.manual_seed(0)
    x, weight = torch.nn.functional.gelu(torch.randn(3, 5, 48) * 2), torch.randn(40, 48) * 0.1
    x[0, 0] = 0.0
    projection = Int8Projection(weight)
    product, token_scale = projection(x)
    assert product.shape == (3, 5, 40) and token_scale.shape == (3, 5, 1)
    assert projection.weight.dtype == torch.int8 and projection.weight.abs().max() == WEIGHT_LEVELS == 64
    tokens = x.reshape(15, 48).double()
    low, high = tokens.amin(-1, keepdim=True), tokens.amax(-1, keepdim=True)
    scale = ((high - low) / 255).clamp(min=1e-12)
    q = torch.round((tokens - low) / scale) - 128
    assert q.min() >= -128 and q.max() <= 127
    row_scale = (weight.abs().amax(1) / 64).double()
    w_q = torch.round(weight.double() / row_scale[:, None])
    exact = (q @ w_q.T) * row_scale + (128 + low / scale) * (w_q.sum(1) * row_scale)
    product, token_scale = product.reshape(15, 40), token_scale.reshape(15, 1)
    torch.testing.assert_close(token_scale.double(), scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(product.double(), exact, rtol=1e-5, atol=1e-3)
    assert torch.equal(product[0], torch.zeros(40))
    approx, float_product = product * token_scale, tokens.float() @ weight.T
    assert ((approx - float_product).norm() / float_product.norm()) < 0.02  # measured 0.0093


def test_int8_product_cannot_saturate_on_a_cpu_without_vnni():
    """The worst case for a CPU without VNNI (AVX2; forced here with ONEDNN_MAX_CPU_ISA=AVX2): every
    activation code at its top (uint8 255 once oneDNN shifts it) against rows of one sign at the
    weight limit. With weights on [-127, 127] each pair of products summed to 64,770 and saturated
    int16 there (products of 383 came out up to 189 off); on [-64, 64] it is exact on every x86 CPU. The
    integer bound itself is checked too, so this fails on a VNNI CPU as well if the range grows."""
    assert 2 * 255 * WEIGHT_LEVELS <= torch.iinfo(torch.int16).max
    hidden = 384
    x = torch.ones(32, hidden)
    x[:, 0] = 0.0  # the token's minimum: every other code is 127 (uint8 255)
    signs = torch.randint(0, 2, (16, hidden), generator=torch.Generator().manual_seed(0)) * 2.0 - 1
    weight = torch.cat([torch.ones(8, hidden), -torch.ones(8, hidden), signs])  # each row exact at scale 1/64
    product, token_scale = Int8Projection(weight)(x)
    torch.testing.assert_close((product * token_scale).double(), x.double() @ weight.double().T, rtol=0, atol=1e-3)


def test_int8_groups_every_layermix_head_and_grouped_equals_alone(tiny_backbone):
    """With int8 a lone layer-mix head forms a group of one (only MixGroup computes int8); integer
    products are exact, so a head answers the same whichever heads share its pass. MTB heads keep
    fp32 and their usual grouping. The bound on int8 vs fp32 logits: largest difference measured 0.023
    (tok4), the same on AVX-512 VNNI and on the forced AVX2 paths (ATEN_CPU_CAPABILITY=avx2
    ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2), where 8-bit weights gave 0.13."""
    modules = as_modules(**layermix_heads(tiny_backbone), **mtb_heads(tiny_backbone))
    engine = Engine(tiny_backbone, int8=True)
    assert [type(g) for g in engine.plan({"seq2": modules["seq2"]}).groups] == [MixGroup]
    assert engine.plan({"mtb_mean": modules["mtb_mean"]}).groups == []
    unfused = Engine(tiny_backbone, fuse=False, int8=True)
    assert sorted(len(g.tasks) for g in unfused.plan(modules).groups) == [1] * len(layermix_heads(tiny_backbone))
    for pairs in (None, PAIRS):
        batch = tiny_backbone.tokenize(TEXTS, pairs)
        int8 = engine.logits(batch, modules)
        assert_equal(int8, alone(engine, batch, modules))
        assert_equal(int8, unfused.logits(batch, modules))
        fp32 = Engine(tiny_backbone).logits(batch, modules)
        for task in modules:
            assert (int8[task] - fp32[task]).abs().max() < 0.05, task
            if task.startswith("mtb"):
                torch.testing.assert_close(int8[task], fp32[task], atol=1e-5, rtol=0)
        assert any((int8[t] - fp32[t]).abs().max() > 1e-4 for t in modules)  # the int8 path did run


def test_int8_head_precision_settings_and_autocast(tiny_backbone):
    assert Settings(head_precision="int8").head_precision == "int8"
    assert Settings(head_precision="int8", precision="bf16").head_precision == "int8"
    with pytest.raises(ValueError, match="head_precision int8 runs on the CPU only"):
        Settings(head_precision="int8", device="cuda", precision="fp16")
    for precision, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        runner = ModelRunner(Engine(tiny_backbone, int8=True), Settings(head_precision="int8", precision=precision))
        assert runner.head_precision == "int8"
        with runner.precision():
            assert torch.is_autocast_enabled("cpu") == (dtype is not None)
            if dtype is not None:
                assert torch.get_autocast_dtype("cpu") == dtype


def test_a_server_with_int8_heads_answers_as_fp32_on_the_real_backbone(minilm):
    """The runtime builds an int8 engine for head_precision int8, and the shipped modules' answers on
    real sentences match fp32 heads' (its accuracy on their validation sets: docs/gpu.md, int8 heads).
    Largest differences measured, the same on AVX-512 VNNI and the forced AVX2 paths: class scores
    0.0046 (acceptability), entity scores 0.00015."""
    from server.runtime import Runtime

    store = Path(__file__).resolve().parents[1] / "modules_store"
    runtime = Runtime(Settings(store=store, head_precision="int8", precision="fp32"), backbone=minilm)
    runtime.start()
    try:
        assert runtime.engine.int8 and runtime.runner.head_precision == "int8"
        modules = {t: load_module(ModuleStore(store), t, None, minilm) for t in servable_tasks(ModuleStore(store), minilm)}
        assert {"sentiment", "ner"} <= set(modules)
        texts = ["John Smith flew from Paris to New York on Monday.", "A gorgeous, witty, seductive movie.",
                 "The plot is a mess and the acting is worse.", "Angela Merkel met Emmanuel Macron in Berlin."]
        batch = minilm.tokenize(texts)
        int8 = runtime.engine.predict(batch, modules)
        fp32 = Engine(minilm).predict(batch, modules)
        assert sum(len(r["entities"]) for r in fp32["ner"]) >= 6  # the sample has entities to find
        for task in modules:
            for got, want in zip(int8[task], fp32[task]):
                if task == "ner":
                    spans = [[(e["text"], e["label"], e["start"], e["end"]) for e in r["entities"]] for r in (got, want)]
                    assert spans[0] == spans[1]
                    assert all(abs(a["score"] - b["score"]) < 0.02 for a, b in zip(got["entities"], want["entities"]))
                elif "embedding" in want:  # no projection to quantise: the same fp32 vector
                    assert max(abs(a - b) for a, b in zip(got["embedding"], want["embedding"])) < 1e-6, task
                else:
                    assert max(abs(got["scores"][c] - want["scores"][c]) for c in want["scores"]) < 0.02, task
    finally:
        runtime.close()


def test_int8_heads_beside_a_bf16_backbone(tiny_backbone):
    """bf16 states are quantised from their own values (cast to float first), and the rest of the heads
    run under the backbone's bf16 autocast, as ModelRunner runs them."""
    from server.runner.precision import heads_autocast

    modules = as_modules(**layermix_heads(tiny_backbone))
    bf16 = tiny_backbone.use_backend("torch", "bf16")
    batch = tiny_backbone.tokenize(TEXTS, PAIRS)
    with heads_autocast("int8", "cpu", "bf16"):
        got = Engine(bf16, int8=True).logits(batch, modules)
    want = Engine(tiny_backbone).logits(batch, modules)
    for task in modules:
        assert got[task].shape == want[task].shape and torch.isfinite(got[task]).all(), task
        assert got[task].dtype == torch.bfloat16, task  # the classifiers ran under bf16 autocast
        # measured 0.024 (tok4) on AVX-512 VNNI and the forced AVX2 paths alike (bf16 heads: 0.014)
        assert (got[task].float() - want[task]).abs().max() < 0.05, task


@pytest.mark.parametrize("flags, warned", [({"avx2", "fma"}, True), ({"avx2", "avx512f", "avx512_vnni"}, False),
                                          (None, False)])
def test_int8_heads_on_a_cpu_without_vnni_are_said_to_be_slow(tiny_backbone, monkeypatch, caplog, flags, warned):
    """head_precision int8 on an AVX2 CPU: torch's int8 product is far slower there (36x fp32's time on the
    projection's shape; 4 heads served 0.36x the backbone alone against 0.85x for fp32 heads), and the
    server said nothing; now its start-up says so, as it says an emulated bf16 backbone will be slow.
    A CPU whose flags cannot be read (not Linux) gets no guess."""
    import logging

    import server.runner.precision
    from server.runtime import Runtime

    monkeypatch.setattr(server.runner.precision, "cpu_flags", lambda: flags)
    runtime = Runtime(Settings(store=Path(__file__).resolve().parent / "no-store", head_precision="int8"),
                      backbone=tiny_backbone)
    with caplog.at_level(logging.WARNING, logger="tmod"):
        runtime.start()
    try:
        said = [r.getMessage() for r in caplog.records if "without AVX-512 VNNI" in r.getMessage()]
        assert bool(said) == warned
        assert not said or said[0].startswith("head_precision int8 on a CPU without AVX-512 VNNI (avx512_vnni)")
    finally:
        runtime.close()
    assert server.runner.precision.int8_heads_warning(Settings(head_precision="fp32")) is None
