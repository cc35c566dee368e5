"""Backbone backends (server/backbone/backends/): ONNX Runtime against the PyTorch reference.

Same hidden states, same task outputs through the Engine, early exit per layer graph, the export
cache reused, int8 loading, and the backend picked by one setting of a live server. Precision
(torch bf16, refused combinations, the CUDA path's errors) is in tests/test_precision.py.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
import weakref
from pathlib import Path

import pytest
import torch

from modules_store import ModuleStore
from server.api.app import create_app
from server.backbone import Backbone
from server.backbone.backends import make_backend
from server.backbone.backends import onnx_backend
from server.config import Settings
from server.engine import Engine
from server.modules import load_module
from tests.helpers import NER_LABELS, make_tiny_backbone_dir, random_head, served_answer

pytest.importorskip("onnxruntime")

# a fixed sample: short and long, entities, punctuation, casing, one-word inputs
SAMPLE = [
    "Peter Blackburn met Angela Merkel in Brussels on Monday.",
    "A wonderful, moving film.",
    "bad",
    "The European Commission said on Thursday it disagreed with German advice to consumers to shun "
    "British lamb until scientists determine whether mad cow disease can be transmitted to sheep.",
    "it's a charming and often affecting journey .",
    "unflinchingly bleak and desperate",
    "Japan 's Nikkei share average fell 1.2 percent in Tokyo on Friday.",
    "ok",
    "John Smith flew from Paris to New York on Monday.",
    "the acting, costumes, music, cinematography and sound are all astounding given the production 's austere locales .",
]
PAIRS = ["He travelled.", "It was good.", "fine", "Nothing else.", "yes", "no", "Markets.", "sure", "Then home.", "Sound."]


@pytest.fixture(scope="session")
def onnx_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("onnx-cache")


@pytest.fixture(scope="session")
def tiny_onnx(tiny_backbone, onnx_cache):
    return tiny_backbone.use_backend("onnx", cache_dir=onnx_cache)


@pytest.fixture(scope="session")
def minilm_onnx(minilm, onnx_cache):
    return minilm.use_backend("onnx", cache_dir=onnx_cache)


# ONNX Runtime and PyTorch run the same float32 graph in another operation order (fused kernels,
# other reduction blocking, chosen per CPU), so their states differ by round-off that scales with
# the values' magnitude and grows with depth: compared with a relative term plus a small absolute one.
# Measured (onnxruntime 1.32.0, torch 2.13.0+cpu, 1 and 2 threads, the batches of
# test_onnx_states_equal_torch_minilm; MiniLM states reach |h| = 10.5), per state 0..6:
#   max |diff|           1.4e-6 4.3e-6 2.1e-5 4.6e-5 9.2e-5 8.8e-5 5.5e-5
#   max |diff|/|h|, |h|>0.01  6.2e-6 9.1e-5 1.1e-4 1.5e-4 2.5e-4 4.0e-4 4.1e-4
#   every element within 1e-5 + r |h| for r = 0, 0, 3.2e-6, 1.5e-5, 3.5e-5, 4.2e-5, 3.2e-5
# Another CPU (issue 12) measured 1.03e-4 in state 3, 2.2x ours there: rtol 2e-4 is ~5x our worst
# r (4.2e-5), and atol covers values near zero: 1e-5 was exceeded on a CPU with AVX-512 and AMX
# (2026-11-23: 2 of 56,832 elements of state 6 outside 1e-5 + 2e-4 |h|, the largest difference
# 1.42e-5), so 3e-5.
# A real fault (a wrong layer, mask or weight) moves states by O(|h|), thousands of times this.
ORT_VS_TORCH = dict(atol=3e-5, rtol=2e-4)


def assert_states_close(reference: Backbone, other: Backbone, batch, atol: float, rtol: float = 0.0):
    ref = [h for _, h in reference.stream(batch)]
    got = [h for _, h in other.stream(batch)]
    assert len(got) == len(ref) == reference.num_layers + 1
    for index, (r, g) in enumerate(zip(ref, got)):
        assert g.dtype == torch.float32 and g.shape == r.shape, index
        torch.testing.assert_close(g, r, atol=atol, rtol=rtol, msg=lambda m: f"state {index}: {m}")


# ---- same hidden states --------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_onnx_states_equal_torch_for_encoder_families(tmp_path, onnx_cache, family):
    backbone = Backbone.load(make_tiny_backbone_dir(tmp_path, family))
    onnx = backbone.use_backend("onnx", cache_dir=onnx_cache)
    assert onnx.backend.name == "onnx" and backbone.backend.name == "torch"  # the original is untouched
    # 3 layers 32 wide, |h| < 4: measured max |diff| 9.5e-7 over the three families, so 1e-5 absolute
    # keeps a 10x margin and needs no relative term
    for texts, pairs in [(SAMPLE[:3], None), (SAMPLE[:1], None), (SAMPLE, PAIRS), (["ok"] * 5, None)]:
        assert_states_close(backbone, onnx, backbone.tokenize(texts, pairs), atol=1e-5)


def test_onnx_states_equal_torch_minilm(minilm, minilm_onnx):
    for texts, pairs in [(SAMPLE, None), (SAMPLE[:4], PAIRS[:4]), (SAMPLE[3:4], None)]:
        assert_states_close(minilm, minilm_onnx, minilm.tokenize(texts, pairs), **ORT_VS_TORCH)


# ---- same task outputs through the Engine ----------------------------------------------------------
def compare_predictions(reference: dict, other: dict):
    """Labels identical; scores within 1e-3 (fp32)."""
    assert reference.keys() == other.keys()
    for task in reference:
        for row, (r, o) in enumerate(zip(reference[task], other[task])):
            if "entities" in r:
                assert [(e["label"], e["start"], e["end"]) for e in o["entities"]] == \
                       [(e["label"], e["start"], e["end"]) for e in r["entities"]], (task, row)
                for er, eo in zip(r["entities"], o["entities"]):
                    assert eo["score"] == pytest.approx(er["score"], abs=1e-3)
            else:
                assert o["label"] == r["label"], (task, row)
                for label, p in r["scores"].items():
                    assert o["scores"][label] == pytest.approx(p, abs=1e-3), (task, row, label)


def test_onnx_task_outputs_equal_torch_tiny(tiny_backbone, tiny_onnx, tiny_store):
    torch_modules = {t: load_module(tiny_store, t, None, tiny_backbone) for t in tiny_store.tasks()}
    onnx_modules = {t: load_module(tiny_store, t, None, tiny_onnx) for t in tiny_store.tasks()}
    for pairs in (None, PAIRS):
        batch = tiny_backbone.tokenize(SAMPLE, pairs)
        reference = Engine(tiny_backbone).predict(batch, torch_modules)
        other = Engine(tiny_onnx).predict(batch, onnx_modules)
        compare_predictions(reference, other)
        logits_r = Engine(tiny_backbone).logits(batch, torch_modules)
        logits_o = Engine(tiny_onnx).logits(batch, onnx_modules)
        for task in logits_r:
            torch.testing.assert_close(logits_o[task], logits_r[task], atol=1e-4, rtol=0)


def test_onnx_task_outputs_equal_torch_minilm(minilm, minilm_onnx):
    """The real backbone, random layer-mix heads over every state and the shipped ner module."""
    heads = {
        "seq": random_head(minilm, "sequence_classification", ["a", "b", "c"], seed=11),
        "tok": random_head(minilm, "token_classification", NER_LABELS, seed=12, casing=True),
    }
    from server.modules import LoadedModule

    modules = {t: LoadedModule(t, "1", None, h) for t, h in heads.items()}
    store = ModuleStore(Path(__file__).resolve().parents[1] / "modules_store")
    if "ner" in store.tasks():
        modules["ner"] = load_module(store, "ner", None, minilm)
    batch = minilm.tokenize(SAMPLE)
    reference = Engine(minilm).predict(batch, modules)
    other = Engine(minilm_onnx).predict(batch, modules)
    compare_predictions(reference, other)
    if "ner" in modules:  # the sample has entities the shipped module finds
        assert sum(len(r["entities"]) for r in reference["ner"]) >= 5


# ---- streaming and early exit ---------------------------------------------------------------------
def test_onnx_early_exit_runs_only_needed_layer_graphs(tiny_onnx):
    backend = tiny_onnx.backend
    torch_calls = []
    hooks = [layer.register_forward_hook(lambda m, i, o: torch_calls.append(1)) for layer in tiny_onnx.adapter.layers]
    try:
        from server.modules import LoadedModule

        shallow = random_head(tiny_onnx, "sequence_classification", ["a", "b"], seed=1, layers=[0, 1])
        deep = random_head(tiny_onnx, "sequence_classification", ["a", "b"], seed=2, layers=[2, 3])
        engine = Engine(tiny_onnx)
        batch = tiny_onnx.tokenize(SAMPLE[:3])
        before = list(backend.runs)
        engine.logits(batch, {"shallow": LoadedModule("shallow", "1", None, shallow)})
        assert [a - b for a, b in zip(backend.runs, before)] == [1, 1, 0, 0]  # layers 2 and 3 never ran
        before = list(backend.runs)
        engine.logits(batch, {"shallow": LoadedModule("shallow", "1", None, shallow),
                              "deep": LoadedModule("deep", "1", None, deep)})
        assert [a - b for a, b in zip(backend.runs, before)] == [1, 1, 1, 1]
        before = list(backend.runs)
        for index, _ in tiny_onnx.stream(batch, upto=0):
            assert index == 0
        assert [a - b for a, b in zip(backend.runs, before)] == [1, 0, 0, 0]
        assert torch_calls == []  # no torch layer ran: the graphs did the work
    finally:
        for hook in hooks:
            hook.remove()


def test_onnx_streams_one_state_at_a_time(tiny_onnx):
    batch = tiny_onnx.tokenize(SAMPLE[:3])
    refs, most_alive = [], 0
    stream = tiny_onnx.stream(batch)
    for index, hidden in stream:
        refs.append(weakref.ref(hidden))
        del hidden
        most_alive = max(most_alive, sum(r() is not None for r in refs))
    assert most_alive <= 2 and len(refs) == tiny_onnx.num_layers + 1
    with pytest.raises(ValueError):
        tiny_onnx.stream(batch, upto=tiny_onnx.num_layers + 1)


# ---- the export cache -----------------------------------------------------------------------------
def test_export_cache_is_reused(tiny_backbone, tiny_onnx, onnx_cache, monkeypatch):
    """The session's export of the tiny backbone (`tiny_onnx`'s, or the identical BERT's of the
    families test) is found in the cache and used as it is; an export into a directory of its own is
    checked by test_unwritable_cache_falls_back_to_a_temporary_export."""
    graph_dir = tiny_onnx.backend.graph_dir
    assert graph_dir.parent == onnx_cache / "onnx"
    files = sorted(graph_dir.glob("*.onnx"))
    assert [f.name for f in files] == onnx_backend.graph_files(tiny_backbone.num_layers)
    stamps = {f: f.stat().st_mtime_ns for f in files}

    def no_export(*args, **kwargs):
        raise AssertionError("exported again although the cache holds the graphs")

    monkeypatch.setattr(onnx_backend, "export_fp32", no_export)
    second = tiny_backbone.use_backend("onnx", cache_dir=onnx_cache)
    assert not second.backend.exported and second.backend.graph_dir == graph_dir
    assert {f: f.stat().st_mtime_ns for f in files} == stamps
    batch = tiny_backbone.tokenize(SAMPLE[:2])
    assert_states_close(tiny_onnx, second, batch, atol=0)
    # int8 is derived from the cached fp32 graphs (no export) into its own entry, itself reused
    # (no other test makes the tiny backbone's int8 graphs)
    int8 = tiny_backbone.use_backend("onnx", precision="int8", cache_dir=onnx_cache)
    assert int8.backend.exported and int8.backend.graph_dir != graph_dir
    assert not tiny_backbone.use_backend("onnx", precision="int8", cache_dir=onnx_cache).backend.exported
    # no temporary directories left: only each entry's lock file (server/backbone/sources.py build_once)
    assert not [p.name for p in (onnx_cache / "onnx").iterdir() if p.name.startswith(".") and p.suffix != ".lock"]


def test_cache_key_follows_weights_precision_and_opset(tiny_backbone, tmp_path):
    fp = tiny_backbone.fingerprint
    key = onnx_backend.cache_key(fp, "fp32")
    assert key == onnx_backend.cache_key(fp.model_copy(update={"name": "renamed"}), "fp32")
    assert key != onnx_backend.cache_key(fp.model_copy(update={"weights_hash": "0" * 64}), "fp32")
    assert key != onnx_backend.cache_key(fp, "int8")
    assert key != onnx_backend.cache_key(fp, "fp32", opset=onnx_backend.OPSET + 1)
    # another model (other weights) gets its own entry
    other = Backbone.load(make_tiny_backbone_dir(tmp_path, "bert", seed=1))
    assert onnx_backend.graph_dir_name(other, "fp32") != onnx_backend.graph_dir_name(tiny_backbone, "fp32")


def test_unwritable_cache_falls_back_to_a_temporary_export(tiny_backbone, tmp_path, caplog, monkeypatch):
    """...and the export writes none of the exporter's info chatter (onnxscript's optimiser, onnx_ir's
    passes) into the server's log at the default level; the temporary export is removed once its
    sessions are made (it stayed in /tmp for good, 87 MB a start for MiniLM: memory on a --tmpfs /tmp),
    and the one a killed server left (its lock file held by nobody) is removed by the next export."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    temp = tmp_path / "tmp"
    left = temp / "tmod-onnx-killed"
    left.mkdir(parents=True)
    (left / "layer0.onnx").write_bytes(b"\0" * 1000)
    (left / ".lock").touch()
    os.utime(left / ".lock", (time.time() - 3600,) * 2)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    with caplog.at_level(logging.INFO):
        backbone = tiny_backbone.use_backend("onnx", cache_dir=blocker)
    assert backbone.backend.exported and backbone.backend.graph_dir is None and list(temp.iterdir()) == []
    assert backbone.backend.describe()["graph_dir"].startswith("none: exported for this process")
    exporter_lines = [r for r in caplog.records if r.name.startswith(("onnxscript", "onnx_ir", "torch.onnx"))]
    assert not exporter_lines, [r.getMessage() for r in exporter_lines[:3]]
    assert any("not writable" in r.getMessage() for r in caplog.records)  # tmod's own warning still says why
    assert_states_close(tiny_backbone, backbone, tiny_backbone.tokenize(SAMPLE[:2]), atol=1e-5)


def test_default_cache_dir_honours_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TMOD_CACHE_DIR", str(tmp_path / "c"))
    assert onnx_backend.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("TMOD_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert onnx_backend.default_cache_dir() == tmp_path / "xdg" / "tmod"


# ---- int8 ------------------------------------------------------------------------------------------
def test_int8_loads_and_keeps_shapes(minilm, onnx_cache):
    """int8 (dynamic quantisation) on the real backbone: right shapes, finite, close in direction.

    Its accuracy cost on the shipped modules' validation sets is recorded in
    bench/results/backends-cpu.md, not asserted here; this prints the agreement on the sample."""
    int8 = minilm.use_backend("onnx", precision="int8", cache_dir=onnx_cache)
    assert int8.backend.precision == "int8"
    batch = minilm.tokenize(SAMPLE)
    mask = batch.attention_mask.bool()
    cosines = []
    for (i, r), (j, q) in zip(minilm.stream(batch), int8.stream(batch)):
        assert i == j and q.shape == r.shape and q.dtype == torch.float32 and torch.isfinite(q).all()
        cosines.append(torch.nn.functional.cosine_similarity(q[mask], r[mask], dim=-1).mean().item())
    head = random_head(minilm, "token_classification", NER_LABELS, seed=12)
    from server.modules import LoadedModule

    modules = {"tok": LoadedModule("tok", "1", None, head)}
    ref = Engine(minilm).logits(batch, modules)["tok"].argmax(-1)[mask]
    got = Engine(int8).logits(batch, modules)["tok"].argmax(-1)[mask]
    print(f"\nint8 vs fp32 on the sample: mean token cosine per state {[round(c, 4) for c in cosines]}, "
          f"random token head argmax agreement {(ref == got).float().mean().item():.3f}")
    # state 0 (embeddings) is not quantised; a broken graph would give cosines near 0
    assert cosines[0] > 0.9999 and min(cosines) > 0.9


def test_torch_backend_refuses_int8(tiny_backbone):
    with pytest.raises(ValueError, match="needs backend onnx"):
        make_backend(tiny_backbone, "torch", precision="int8")
    with pytest.raises(ValueError, match="unknown backend"):
        make_backend(tiny_backbone, "tensorrt")
    with pytest.raises(ValueError, match="needs backend onnx"):
        Settings(precision="int8")


# ---- one setting picks the backend -----------------------------------------------------------------
def test_backend_is_one_setting(monkeypatch):
    monkeypatch.setenv("TMOD_BACKEND", "onnx")
    monkeypatch.setenv("TMOD_PRECISION", "int8")
    settings = Settings()
    assert (settings.backend, settings.precision) == ("onnx", "int8")
    monkeypatch.setenv("TMOD_BACKEND", "tensorrt")
    with pytest.raises(ValueError):
        Settings()


def test_server_with_onnx_backend_answers_like_torch(tiny_store, tiny_backbone, tiny_onnx, onnx_cache, monkeypatch):
    texts = SAMPLE[:6]
    answers = {}
    monkeypatch.setenv("TMOD_CACHE_DIR", str(onnx_cache))
    monkeypatch.setenv("TMOD_PRECISION", "fp32")  # the exact reference (auto would pick bf16 on some CPUs)
    for backend in ("torch", "onnx"):
        monkeypatch.setenv("TMOD_BACKEND", backend)
        app = create_app(Settings(store=tiny_store.root), backbone=tiny_backbone)
        answers[backend] = served_answer(app, texts)
        runtime = app.state.runtime
        assert runtime.backbone.backend.name == backend
        if backend == "onnx":
            assert not runtime.backbone.backend.exported  # the session's export was reused
    assert tiny_backbone.backend.name == "torch"  # the backbone handed in is left as it was
    torch_results, onnx_results = answers["torch"]["results"], answers["onnx"]["results"]
    by_task = lambda results: {t: [r[t] for r in results] for t in results[0]}  # noqa: E731
    compare_predictions(by_task(torch_results), by_task(onnx_results))
    assert answers["torch"]["model"] == answers["onnx"]["model"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_onnx_backend_on_a_gpu_backbone_without_a_gpu_says_why(tiny_backbone, onnx_cache):
    """A cuda backbone selects the CUDA execution provider (tests/test_precision.py checks the
    provider list); with no GPU the backend is refused before anything is exported."""
    import copy

    on_gpu = copy.copy(tiny_backbone)
    on_gpu.device = torch.device("cuda")
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        on_gpu.use_backend("onnx", cache_dir=onnx_cache)
    with pytest.raises(ValueError, match="precision int8 runs on the CPU only"):
        on_gpu.use_backend("onnx", precision="int8", cache_dir=onnx_cache)
