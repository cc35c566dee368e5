"""Backbone precision (server/backbone/backends/torch_backend.py, server/config.py).

bf16 on the torch backend against the fp32 reference: same labels, scores within a stated
tolerance, states still float32 and streamed one at a time, autocast never reaching the heads;
precision is one setting of a live server; every refused (backend, precision, device) combination
says why; the CUDA path's error when no GPU is there (the GPU itself is not exercised here).

Tolerance. bfloat16 keeps 8 significant bits: rounding an operand costs up to 2^-9 ~ 0.2% of it, and
every matrix product (Q/K/V, attention, output, FFN) of every layer rounds its inputs, so the error
grows with depth: on the real MiniLM a token's state differs from fp32 by up to 1.2% of its norm at
layer 6 (0.4% at layer 1; up to ~0.3 in a single coordinate, |h| up to ~10), the shipped heads'
logits by up to 0.16 and their softmax probabilities by up to 0.025 (measured on 256 SST-2
validation sentences and on SAMPLE). STATE_TOL = 0.03 (per-token relative error) and
SCORE_TOL = 0.05 (probabilities) are about twice those largest differences. (The tiny random test
encoders stay within 1e-4: their small random layers barely move the fp32 residual stream.) Labels must be identical wherever
the fp32 reference's top-1 / top-2 probability margin exceeds 2 * SCORE_TOL (a shift of at most
SCORE_TOL in each of the two probabilities cannot swap them there); closer calls are counted, not
asserted; the validation-set agreement is recorded in bench/results/backends-cpu.md.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from modules_store import ModuleStore
from server.api.app import create_app
from server.backbone import Backbone
from server.backbone.backends import make_backend
from server.config import Settings, auto_precision, cpu_has_native_bf16, device_problem, precision_problem
from server.engine import Engine
from server.modules import LoadedModule, compares_pairs, load_module, servable_tasks
from server.runner.precision import head_precision
from tests.helpers import NER_LABELS, make_tiny_backbone_dir, random_head, served_answer
from tests.test_backends import PAIRS, SAMPLE

STATE_TOL = 0.03
SCORE_TOL = 0.05
SURE_MARGIN = 2 * SCORE_TOL
SHIPPED = ModuleStore(Path(__file__).resolve().parents[1] / "modules_store")


def probabilities(logits: dict, batch) -> dict:
    """{task: (N, labels) softmax}: sequence tasks one row per input, token tasks one per real token."""
    mask = batch.attention_mask.bool()
    return {t: (x[mask] if x.dim() == 3 else x).float().softmax(-1) for t, x in logits.items()}


def token_relative_error(reference: torch.Tensor, other: torch.Tensor, mask: torch.Tensor) -> float:
    """Largest |other - reference| / |reference| over real tokens (norms over the hidden size)."""
    return ((other - reference)[mask].norm(dim=-1) / reference[mask].norm(dim=-1)).max().item()


def compare_to_fp32(reference: dict, other: dict) -> dict:
    """Assert the module docstring's rule; return {task: (rows, sure rows, sure rows that agree)}."""
    out = {}
    for task, ref in reference.items():
        got = other[task]
        assert got.shape == ref.shape and got.dtype == torch.float32
        diff = (got - ref).abs().max().item()
        assert diff <= SCORE_TOL, f"{task}: probabilities differ by {diff:.4f} > {SCORE_TOL}"
        top2 = ref.topk(2, dim=-1).values
        sure = (top2[:, 0] - top2[:, 1]) > SURE_MARGIN
        same = ref.argmax(-1) == got.argmax(-1)
        assert same[sure].all(), f"{task}: {(~same[sure]).sum().item()} confident labels changed"
        out[task] = (len(ref), int(sure.sum()), int(same.sum()))
    return out


def shipped_labelling_modules(minilm) -> dict:
    """The shipped modules MiniLM serves that label a single text: SAMPLE holds single texts, so a pair
    task (entailment) has no answer for them (bench/results/head-precision-cpu-mpnet-entailment.md has
    it in bf16 on its own validation pairs), nor has the embedding labels (its bf16 vectors are checked
    in tests/test_embeddings.py)."""
    modules = {t: load_module(SHIPPED, t, None, minilm) for t in servable_tasks(SHIPPED, minilm)}
    return {t: m for t, m in modules.items() if not compares_pairs(m.manifest) and m.manifest.labels}


# ---- bf16 against fp32 ---------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_bf16_states_stay_float32_and_close_for_encoder_families(tmp_path, family):
    backbone = Backbone.load(make_tiny_backbone_dir(tmp_path, family))
    bf16 = backbone.use_backend("torch", "bf16")
    assert (bf16.backend.name, bf16.backend.precision) == ("torch", "bf16")
    assert backbone.backend.precision == "fp32"  # the original is untouched, and so are its weights
    assert all(p.dtype == torch.float32 for p in backbone.model.parameters())
    linears = [m for m in bf16.backend.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.dtype == torch.bfloat16 for m in linears)
    for texts, pairs in [(SAMPLE, None), (SAMPLE[:4], PAIRS[:4]), (["ok"], None)]:
        batch = backbone.tokenize(texts, pairs)
        ref = [h for _, h in backbone.stream(batch)]
        got = [h for _, h in bf16.stream(batch)]
        assert len(got) == len(ref) == backbone.num_layers + 1
        torch.testing.assert_close(got[0], ref[0], atol=0, rtol=0)  # embeddings run in fp32: exact
        for index, (r, g) in enumerate(zip(ref, got)):
            assert g.dtype == torch.float32 and g.shape == r.shape, index
            mask = batch.attention_mask.bool()
            # per token: the error is a few bf16 roundings of the state's own size, not an absolute
            assert token_relative_error(r, g, mask) < STATE_TOL, (family, index)


def test_bf16_minilm_shipped_modules_same_labels(minilm):
    """The real backbone and the shipped modules (or random heads where the store lacks one)."""
    bf16 = minilm.use_backend("torch", "bf16")
    modules = shipped_labelling_modules(minilm)
    if "ner" not in modules:
        modules["ner"] = LoadedModule("ner", "1", None, random_head(minilm, "token_classification", NER_LABELS, 12))
    if "sentiment" not in modules:
        modules["sentiment"] = LoadedModule("sentiment", "1", None,
                                            random_head(minilm, "sequence_classification", ["a", "b"], 11))
    batch = minilm.tokenize(SAMPLE)
    mask = batch.attention_mask.bool()
    errors = [token_relative_error(r, g, mask) for (_, r), (_, g) in zip(minilm.stream(batch), bf16.stream(batch))]
    assert errors[0] == 0 and max(errors) < STATE_TOL, errors
    counts = compare_to_fp32(probabilities(Engine(minilm).logits(batch, modules), batch),
                             probabilities(Engine(bf16).logits(batch, modules), batch))
    print(f"\nbf16 vs fp32 on SAMPLE (rows, rows with margin > {SURE_MARGIN}, rows with the same label): {counts}")
    for task, (rows, sure, same) in counts.items():
        assert sure >= 0.9 * rows, (task, counts)  # the rule above is not vacuous on this sample
        assert same >= rows - 2, (task, counts)  # at most two close calls flip on the sample
    # served outputs: the same sequence labels and entity spans
    reference = Engine(minilm).predict(batch, modules)
    other = Engine(bf16).predict(batch, modules)
    for task in reference:
        for r, o in zip(reference[task], other[task]):
            if "label" in r:
                assert o["label"] == r["label"], (task, r, o)


def answer_numbers(answer: dict) -> tuple[list, list]:
    """(labels and entity spans, every score) of one decoded answer, in a fixed order."""
    if "entities" in answer:
        entities = answer["entities"]
        return [(e["label"], e["start"], e["end"]) for e in entities], [e["score"] for e in entities]
    scores = answer["scores"]
    return [answer.get("label", answer.get("labels")), list(scores)], list(scores.values())


@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-4), ("bf16", SCORE_TOL)])
def test_a_texts_answer_alone_and_in_a_padded_batch(minilm, precision, tolerance):
    """A text answered alone and in one padded pass with texts of other lengths (as the server batches
    concurrent requests): in fp32 the same answer, scores within 1e-4; in bf16 its scores move, within the
    bf16 tolerance (docs/serving.md, repeatable answers: the served measurement)."""
    backbone = minilm if precision == "fp32" else minilm.use_backend("torch", "bf16")
    modules = shipped_labelling_modules(minilm)
    assert {"ner", "emotion", "acceptability"} <= set(modules)  # token, multi-label and sequence answers
    engine = Engine(backbone)
    together = engine.predict(backbone.tokenize(SAMPLE), modules)
    compared = 0
    for i, text in enumerate(SAMPLE):
        alone = engine.predict(backbone.tokenize([text]), modules)
        for task in modules:
            (labels, scores), (labels_in_batch, scores_in_batch) = (answer_numbers(alone[task][0]),
                                                                     answer_numbers(together[task][i]))
            if precision == "fp32":
                assert labels_in_batch == labels, (task, text)
            if labels_in_batch == labels:  # a bf16 close call may go the other way: then other entities' scores
                assert scores_in_batch == pytest.approx(scores, abs=tolerance), (task, text)
                compared += 1
    assert compared >= 0.9 * len(SAMPLE) * len(modules)  # the bf16 bound is not vacuous either


def test_bf16_heads_never_run_under_autocast(tiny_backbone):
    """Autocast is entered around each layer call only: between two states (where the engine runs
    the heads) it is off, so heads compute in float32 as with fp32."""
    bf16 = tiny_backbone.use_backend("torch", "bf16")
    batch = tiny_backbone.tokenize(SAMPLE[:3])
    seen = []
    for index, hidden in bf16.stream(batch):
        seen.append((index, torch.is_autocast_enabled("cpu"), hidden.dtype))
    assert seen == [(i, False, torch.float32) for i in range(tiny_backbone.num_layers + 1)]


def test_bf16_early_exit_runs_only_needed_layers(tiny_backbone):
    bf16 = tiny_backbone.use_backend("torch", "bf16")
    calls = {"bf16": [], "fp32": []}
    hooks = [layer.register_forward_hook(lambda m, i, o, n=n: calls["bf16"].append(n))
             for n, layer in enumerate(bf16.backend.layers)]
    hooks += [layer.register_forward_hook(lambda m, i, o: calls["fp32"].append(1)) for layer in tiny_backbone.adapter.layers]
    try:
        shallow = random_head(bf16, "sequence_classification", ["a", "b"], seed=1, layers=[0, 1])
        Engine(bf16).logits(tiny_backbone.tokenize(SAMPLE[:2]), {"s": LoadedModule("s", "1", None, shallow)})
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == {"bf16": [0], "fp32": []}


# ---- one setting ---------------------------------------------------------------------------------
def test_precision_is_one_setting(monkeypatch, tiny_store, tiny_backbone):
    monkeypatch.setenv("TMOD_PRECISION", "bf16")
    assert (Settings().backend, Settings().precision) == ("torch", "bf16")
    texts = SAMPLE[:6]
    answers = {}
    for precision in ("fp32", "bf16"):
        monkeypatch.setenv("TMOD_PRECISION", precision)
        app = create_app(Settings(store=tiny_store.root), backbone=tiny_backbone)
        answers[precision] = served_answer(app, texts)["results"]
        backend = app.state.runtime.backbone.backend
        assert (backend.name, backend.precision) == ("torch", precision)
    assert tiny_backbone.backend.precision == "fp32"  # the backbone handed in is left as it was
    for r, o in zip(answers["fp32"], answers["bf16"]):
        assert r.keys() == o.keys()
        for task in r:
            if "scores" in r[task]:
                for label, p in r[task]["scores"].items():
                    assert o[task]["scores"][label] == pytest.approx(p, abs=SCORE_TOL), (task, label)


# ---- refused combinations: one precise sentence each -------------------------------------------------
REFUSED = [
    (dict(precision="int8"), "precision int8 needs backend onnx"),
    (dict(precision="fp16"), "precision fp16 needs a cuda device"),
    (dict(backend="onnx", precision="bf16"), "precision bf16 needs backend torch"),
    (dict(backend="onnx", precision="fp16"), "precision fp16 needs backend torch"),
    (dict(backend="onnx", precision="int8", device="cuda"), "precision int8 runs on the CPU only"),
    (dict(device="tpu"), "device 'tpu' is not supported"),
    (dict(device="cuda:first"), "the cuda index must be a number"),
]


@pytest.mark.parametrize("values, message", REFUSED)
def test_refused_combinations_say_why(values, message):
    with pytest.raises(ValueError, match=message):
        Settings(**values)


@pytest.mark.parametrize("values", [dict(), dict(precision="bf16"), dict(precision="fp32"), dict(backend="onnx"),
                                    dict(backend="onnx", precision="int8")])
def test_cpu_combinations_are_accepted(values, monkeypatch):
    monkeypatch.delenv("TMOD_PRECISION", raising=False)
    settings = Settings(**values)
    assert settings.precision != "auto"  # resolved when the settings are built
    assert precision_problem(settings.backend, settings.precision, settings.device) is None


def test_auto_precision_is_16_bit_only_where_it_was_measured(monkeypatch, tiny_backbone):
    monkeypatch.delenv("TMOD_PRECISION", raising=False)
    native = "bf16" if cpu_has_native_bf16() else "fp32"
    assert Settings().precision == auto_precision("torch", "cpu") == native
    assert Settings(backend="onnx").precision == "fp32"
    assert Settings(precision="fp32").precision == "fp32"  # fp32 stays one setting away
    # on cuda: fp16 (within the accuracy rule on every shipped module), heads with it; onnx stays fp32
    for device in ("cuda", "cuda:1"):
        assert auto_precision("torch", device) == "fp16"
        cuda = Settings(device=device)  # resolved without a GPU: the settings of a GPU deployment parse anywhere
        assert (cuda.precision, head_precision(cuda)) == ("fp16", "fp16")
    assert Settings(device="cuda", backend="onnx").precision == "fp32"
    assert make_backend(tiny_backbone, "torch", precision="auto").precision == native


# Flags as /proc/cpuinfo lists them (the vector ones): AVX-512 without bf16 (Cascade Lake, Ice Lake: the
# common cloud CPUs), with avx512_bf16 and AMX (Sapphire Rapids), AVX2 alone (AMD EPYC Rome / Milan)
CASCADE_LAKE = ["avx", "avx2", "avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl", "avx512_vnni"]
SAPPHIRE_RAPIDS = [*CASCADE_LAKE, "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"]
AVX2_ONLY = ["avx", "avx2", "fma"]


@pytest.mark.parametrize("flags, native", [(CASCADE_LAKE, False), (SAPPHIRE_RAPIDS, True), (AVX2_ONLY, False),
                                           (["avx512f", "avx512bw", "avx512_bf16"], True)])
def test_auto_precision_is_bf16_only_on_a_cpu_with_bfloat16_instructions(monkeypatch, flags, native):
    """torch's bf16 check (oneDNN's) says yes to any AVX-512 CPU: auto chose bf16 on a Cascade Lake or
    Ice Lake, which emulates it (with oneDNN capped at their ISA, MiniLM's bf16 passes ran 0.31x fp32's
    rate at batch 32). Native means avx512_bf16 or AMX in the CPU's flags."""
    import server.config

    monkeypatch.delenv("TMOD_PRECISION", raising=False)
    monkeypatch.setattr(server.config, "cpu_flags", lambda: flags)
    assert cpu_has_native_bf16() is native
    assert auto_precision("torch", "cpu") == Settings().precision == ("bf16" if native else "fp32")


def test_make_backend_refuses_like_settings(tiny_backbone):
    with pytest.raises(ValueError, match="precision fp16 needs a cuda device"):
        make_backend(tiny_backbone, "torch", precision="fp16")
    with pytest.raises(ValueError, match="precision bf16 needs backend torch"):
        make_backend(tiny_backbone, "onnx", precision="bf16")
    with pytest.raises(ValueError, match="unknown backend"):
        make_backend(tiny_backbone, "tensorrt", precision="bf16")


# ---- the CUDA path when there is no GPU ------------------------------------------------------------
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")


@pytest.mark.parametrize("values", [dict(device="cuda"), dict(device="cuda:0", precision="fp16"),
                                    dict(device="cuda", precision="bf16"), dict(device="cuda", backend="onnx")])
def test_gpu_settings_parse_anywhere(values):
    """A GPU deployment's settings are checked on CPU machines too (tests/test_deploy.py): only the
    combination is checked when Settings are built; the device itself at start-up."""
    settings = Settings(**values)
    auto = "fp16" if values.get("backend", "torch") == "torch" else "fp32"  # auto on cuda: fp16 for torch
    assert settings.precision == values.get("precision", auto)


@no_gpu
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_a_gpu_stops_tmod_serve_with_the_reason(device):
    from server.cli import main

    assert "torch sees no CUDA device" in device_problem(device)
    with pytest.raises(SystemExit, match="tmod-serve: device cuda.* asked but torch sees no CUDA device"):
        main(["--device", device, "--precision", "fp16", "--port", "0"])


@no_gpu
@pytest.mark.parametrize("backend, precision", [("torch", "fp32"), ("torch", "fp16"), ("onnx", "fp32")])
def test_cuda_without_a_gpu_is_refused_by_make_backend(tiny_backbone, backend, precision):
    on_gpu = copy.copy(tiny_backbone)
    on_gpu.device = torch.device("cuda")  # as Backbone.load(device="cuda") would record it
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        make_backend(on_gpu, backend, precision=precision)


def test_onnx_on_cuda_needs_the_cuda_execution_provider():
    ort = pytest.importorskip("onnxruntime")
    from server.backbone.backends.onnx_backend import execution_providers

    assert execution_providers(torch.device("cpu"), "int8") == ["CPUExecutionProvider"]
    with pytest.raises(ValueError, match="runs fp32 only"):
        execution_providers(torch.device("cuda"), "int8")
    if "CUDAExecutionProvider" in ort.get_available_providers():
        providers = execution_providers(torch.device("cuda:1"), "fp32")
        assert providers[0] == ("CUDAExecutionProvider", {"device_id": 1})
    else:
        with pytest.raises(ValueError, match="needs ONNX Runtime's CUDAExecutionProvider"):
            execution_providers(torch.device("cuda:1"), "fp32")
