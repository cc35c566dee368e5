"""The model runner (server/runner/): batch shapes, bucket padding, the graph cache and its
invalidation on module changes, no host syncs inside a pass, head precision. CPU tests use the real
tiny backbone and real modules; CUDA-only tests are marked and skipped without a GPU."""
from __future__ import annotations

import logging
import os
import traceback
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from modules_store import ModuleStore
from server.backbone import Backbone
from server.config import Settings
from server.engine import Engine
from server.modules import LoadedModule, load_module, save_module, token_classes_read
from server.runner.graphs import CapturedPass, pack_logits, static_batch, unpack_logits
from server.runner.model_runner import ModelRunner
from server.runner.precision import head_precision
from server.runner.shapes import BatchShapes, Bucket, bounded
from server.runtime import Runtime
from server.timings import Timings
from tests.helpers import metric_sample, random_head

TEXTS = ["Peter Blackburn met Angela Merkel in Brussels.", "A dull film.", "ok",
         "The European Commission said on Thursday it disagreed with German advice to consumers.",
         "Great acting, poor plot, fine music.", "NASA and the U.N. met in New York on 3 May."]
SERVER_DIR = str(Path(__file__).resolve().parents[1] / "server")


def modules_of(store, backbone, tasks=("sentiment", "ner", "acceptability")):
    return {t: load_module(store, t, None, backbone) for t in tasks}


def sorted_rows(backbone, texts, pairs=None):
    return sorted(backbone.encode(texts, pairs), key=len)


def runner_for(backbone, mode, capture=None, **settings):
    engine = Engine(backbone)
    settings.setdefault("head_precision", "fp32")  # answers compared across paths: fp32 heads (16-bit heads round differently when grouped)
    return ModelRunner(engine, Settings(batch_shapes=mode, **settings), capture=capture)


def assert_same_answers(got, want, abs_tol=1e-4):
    assert set(got) == set(want)
    for task in want:
        assert len(got[task]) == len(want[task])
        for a, b in zip(got[task], want[task]):
            if "entities" in b:
                assert [(e["label"], e["start"], e["end"]) for e in a["entities"]] == \
                       [(e["label"], e["start"], e["end"]) for e in b["entities"]]
                for ea, eb in zip(a["entities"], b["entities"]):
                    assert ea["score"] == pytest.approx(eb["score"], abs=abs_tol)
            elif "embedding" in b:
                assert a["embedding"] == pytest.approx(b["embedding"], abs=abs_tol)
            else:  # one label, or a multi-label task's labels over its threshold
                assert a.get("label") == b.get("label") and a.get("labels") == b.get("labels")
                for label, p in b["scores"].items():
                    assert a["scores"][label] == pytest.approx(p, abs=abs_tol)


# ---- batch shapes ---------------------------------------------------------------------------------
def test_buckets_are_bounded_by_the_batch_limit_and_the_token_limit():
    assert bounded([1, 2, 4, 8, 16], 6) == [1, 2, 4, 8]  # the smallest covering size stays
    assert bounded([1, 2, 4], 100) == [1, 2, 4, 100]  # the limit itself when none covers it
    shapes = BatchShapes.for_settings(Settings(max_batch_size=100, graph_batch_sizes="1,8,64,128,256",
                                               graph_seq_lens="16,64,256,1024"), torch.device("cpu"), 300)
    assert shapes.mode == "length_runs"  # the CPU's default
    assert shapes.batch_sizes == [1, 8, 64, 128] and shapes.seq_lens == [16, 64, 256, 300]


def test_rows_per_batch_default_to_the_device_and_an_explicit_value_wins():
    # cuda: 512 rows (measured faster per sequence on an H100); a CPU keeps 128; no GPU is needed to check
    assert Settings().max_batch_size == 128
    assert Settings(device="cuda").max_batch_size == 512 and Settings(device="cuda:1").max_batch_size == 512
    assert Settings(device="cuda", max_batch_size=64).max_batch_size == 64
    shapes = BatchShapes.for_settings(Settings(device="cuda"), torch.device("cpu"), 512)
    assert shapes.batch_sizes[-1] == 512  # the 256- and 512-row buckets are kept on cuda


def test_bucket_choice_covers_each_pass_and_cuts_batches_over_the_largest_size():
    shapes = BatchShapes("buckets", [1, 2, 4, 8], [16, 32, 64])
    assert shapes.bucket(3, 17) == Bucket(4, 32)
    assert shapes.bucket(8, 64) == Bucket(8, 64)
    assert shapes.bucket(1, 65) is None  # longer than every bucket: eager, unpadded
    lengths = sorted([5, 9, 12, 12, 30, 31, 33, 40, 60, 61])
    passes = shapes.passes(lengths)
    assert [(p.start, p.stop) for p, _ in passes] == [(0, 8), (8, 10)]
    assert [b for _, b in passes] == [Bucket(8, 64), Bucket(2, 64)]
    # length runs: no bucket, runs within the padding ratio
    runs = BatchShapes("length_runs", [8], [64], max_padding_ratio=1.25).passes(lengths)
    assert all(b is None for _, b in runs) and len(runs) > 1


def test_bucket_runs_cut_a_batch_where_the_measured_passes_cost_least():
    """`bucket_runs` against brute force: every way of cutting sorted rows where their bucket length
    changes, each run padded to its bucket, priced by a table of pass times (some buckets without
    one); the cheapest is chosen, the whole batch on a tie, and nothing is cut where the whole
    batch's time is not known."""
    import itertools
    import random

    sizes, lens = [1, 2, 4, 8, 16, 32, 64, 128], [16, 32, 64, 128]
    shapes = BatchShapes("bucket_runs", sizes, lens)
    rng = random.Random(7)

    def brute(lengths, rows, cost):
        seq = [next(n for n in lens if n >= lengths[r]) for r in range(rows.start, rows.stop)]
        cuts = [rows.start + i for i in range(1, len(seq)) if seq[i] != seq[i - 1]]
        best = None
        for k in range(len(cuts) + 1):
            for chosen in itertools.combinations(cuts, k):
                bounds = [rows.start, *chosen, rows.stop]
                runs = [(a, b, shapes.bucket(b - a, max(lengths[a:b]))) for a, b in zip(bounds, bounds[1:])]
                prices = [cost(bucket) for _, _, bucket in runs]
                if None not in prices and (best is None or sum(prices) < best[0] - 1e-12):
                    best = (sum(prices), runs)
        return best

    for trial in range(300):
        floor, per_token = rng.uniform(0.1, 1.0), rng.uniform(1e-4, 1e-2)
        missing = set(rng.sample([(b, n) for b in sizes for n in lens], rng.randrange(0, 6)))
        table = {Bucket(b, n): floor + per_token * b * n * (1 + n / 256) for b in sizes for n in lens
                 if (b, n) not in missing}
        lengths = sorted(rng.choice([rng.randint(3, 16), rng.randint(17, 40), rng.randint(41, 128)])
                         for _ in range(rng.randint(1, 128)))
        whole = slice(0, len(lengths))
        got = shapes.cheapest_runs(lengths, whole, table.get)
        if table.get(shapes.bucket(len(lengths), lengths[-1])) is None:
            assert got is None
            continue
        price, runs = brute(lengths, whole, table.get)
        assert [(r.start, r.stop, b) for r, b in got] == [(a, b, bucket) for a, b, bucket in runs], trial
        assert abs(sum(table[b] for _, b in got) - price) < 1e-9
    # the served case: 65 short rows and one long one -> the short ones at 128x16 and the long one at 1x64
    lengths = [12] * 65 + [50]
    table = {Bucket(b, n): 0.6 + 0.0003 * b * n for b in sizes for n in lens}
    assert shapes.passes(lengths, table.get) == [(slice(0, 65), Bucket(128, 16)), (slice(65, 66), Bucket(1, 64))]
    assert shapes.passes(lengths, None) == [(slice(0, 66), Bucket(128, 64))]  # no times: as "buckets"
    flat = {bucket: 1.0 for bucket in table}  # every pass the same time: one pass
    assert shapes.passes(lengths, flat.get) == [(slice(0, 66), Bucket(128, 64))]


def test_reachable_buckets_are_every_bucket_a_pass_can_land_in():
    """Brute force over every pass the batcher can form (rows x longest within the token budget, or
    one request of up to max_inputs rows whatever its tokens; rows no longer than the token limit):
    the buckets they land in are exactly `reachable`. The old rule (bucket size x length within the
    budget) left out buckets that padding up reaches, e.g. 65 rows of 129 tokens -> 128x256."""
    for sizes, lens, budget, max_inputs, max_row in (([1, 2, 4, 8, 16, 32, 64, 128], [16, 32, 64, 128, 256, 512],
                                                      16384, 64, 512),
                                                     ([1, 4, 16], [16, 64], 256, 1, 64),
                                                     ([1, 8, 32], [16, 64, 100], 1000, 8, 90)):
        shapes = BatchShapes("buckets", sizes, lens)
        landed = {shapes.bucket(rows, longest) for rows in range(1, sizes[-1] + 1)
                  for longest in range(1, max_row + 1) if rows * longest <= budget or rows <= max_inputs}
        reachable = shapes.reachable(budget, max_inputs, max_row)
        assert set(reachable) == landed and reachable == sorted(reachable, reverse=True)
    served = BatchShapes("buckets", [1, 2, 4, 8, 16, 32, 64, 128], [16, 32, 64, 128, 256, 512]).reachable(16384, 64, 512)
    assert Bucket(128, 256) in served and Bucket(64, 512) in served and Bucket(128, 512) not in served


def test_settings_refuse_bad_bucket_lists_and_mixed_head_precision():
    with pytest.raises(ValueError, match="graph_seq_lens='16,x'"):
        Settings(graph_seq_lens="16,x")
    with pytest.raises(ValueError, match="head_precision bf16 needs the backbone in bf16"):
        Settings(head_precision="bf16", precision="fp32")
    assert Settings(head_precision="bf16", precision="bf16").head_precision == "bf16"


def test_packed_logits_round_trip_and_drop_filler_rows():
    logits = {"a": torch.randn(4, 3), "b": torch.randn(4, 7, 5)}
    flat, layout = pack_logits(logits)
    assert flat.dim() == 1 and flat.numel() == 4 * 3 + 4 * 7 * 5
    back = unpack_logits(flat, layout, rows=3)
    assert torch.equal(back["a"], logits["a"][:3]) and torch.equal(back["b"], logits["b"][:3])


# ---- padding changes no answer -------------------------------------------------------------------
def test_bucket_padding_gives_the_answers_of_unpadded_passes(tiny_backbone, tiny_store):
    modules = modules_of(tiny_store, tiny_backbone)
    rows = sorted_rows(tiny_backbone, TEXTS)
    plain = runner_for(tiny_backbone, "length_runs", max_padding_ratio=1000)  # one pass, padded to its longest row
    padded = runner_for(tiny_backbone, "buckets", graph_batch_sizes="8", graph_seq_lens="64")
    prepared = padded.prepare(rows, modules)
    assert [(p.batch.size, p.batch.seq_len, p.batch.filler_rows) for p in prepared.passes] == [(8, 64, 2)]
    assert_same_answers(padded.execute(prepared, modules, Timings()), plain.run(rows, modules))
    # the logits themselves: real rows and real tokens agree closely
    real_batch = tiny_backbone.collate(rows)
    want = Engine(tiny_backbone).logits(real_batch, modules)
    got, _ = padded.logits(prepared.passes[0].batch, prepared.passes[0].bucket, modules, Timings())
    for task in modules:
        if want[task].dim() == 3:
            torch.testing.assert_close(got[task][:, :real_batch.seq_len], want[task], atol=1e-5, rtol=1e-4)
        else:
            torch.testing.assert_close(got[task], want[task], atol=1e-5, rtol=1e-4)


def test_bucket_padding_on_pairs_and_a_decoder(tiny_llama, tmp_path):
    store = ModuleStore(tmp_path)
    save_module(store, "sentiment", "1", random_head(tiny_llama, "sequence_classification", ["neg", "pos"], 1),
                tiny_llama)
    save_module(store, "ner", "1", random_head(tiny_llama, "token_classification", ["O", "B-X", "I-X"], 2,
                                               casing=True), tiny_llama)
    modules = modules_of(store, tiny_llama, ("sentiment", "ner"))
    rows = sorted_rows(tiny_llama, TEXTS[:3], ["Bonn.", "It was long and dull.", "Fine"])
    plain = runner_for(tiny_llama, "length_runs", max_padding_ratio=1000)
    padded = runner_for(tiny_llama, "buckets", graph_batch_sizes="4", graph_seq_lens="48")
    assert_same_answers(padded.run(rows, modules), plain.run(rows, modules))


# ---- graphs belong to their plan ----------------------------------------------------------------
def record_eager(engine: Engine, runner_ref: list):
    """A capture function for the CPU: the pass at a bucket runs eagerly on static input tensors
    (as a replay does), so the cache, its invalidation and the static-input copies are checked here;
    it records the heads each 'graph' was made with."""
    made = []

    def capture(plan, bucket):
        inputs = static_batch(bucket, engine.backbone.device, engine.backbone.text.uses_token_types,
                              token_classes_read(plan.modules))

        def replay():
            with runner_ref[0].precision():
                logits, _ = engine.run_plan(plan, inputs)
            return pack_logits(logits)[0]

        made.append({task: m.head for task, m in plan.modules.items()})
        return CapturedPass(inputs, replay, pack_logits(engine.run_plan(plan, inputs)[0])[1])

    return capture, made


def stand_in_graph_runner(backbone, metrics=None, **shapes) -> tuple[ModelRunner, list]:
    """A runner of whole batches padded to buckets whose 'graphs' are `record_eager`'s (the CPU's stand-in
    for capture), fp32 heads: (runner, the heads each graph was made with)."""
    engine, ref = Engine(backbone), []
    capture, made = record_eager(engine, ref)
    runner = ModelRunner(engine, Settings(batch_shapes="buckets", head_precision="fp32", **shapes), metrics=metrics,
                         capture=capture)
    ref.append(runner)
    return runner, made


def test_graphs_are_replayed_per_bucket_and_recaptured_after_every_module_change(tiny_backbone, tiny_store, tmp_path):
    # a store of its own: version 2 of sentiment (other weights) is the latest, loaded at start
    store = ModuleStore(tmp_path)
    for task in ("sentiment", "ner"):
        version = tiny_store.latest(task)
        save_module(store, task, "1", load_module(tiny_store, task, version, tiny_backbone).head, tiny_backbone)
    save_module(store, "sentiment", "2", random_head(tiny_backbone, "sequence_classification",
                                                     ["negative", "positive"], 99), tiny_backbone)
    settings = Settings(store=store.root, tasks="sentiment,ner", batch_shapes="buckets", head_precision="fp32",
                        graph_batch_sizes="2,8", graph_seq_lens="32,64", max_batch_tokens=64)
    runtime = Runtime(settings, backbone=tiny_backbone)
    runtime.start()
    assert runtime.ready.is_set(), runtime.startup_error
    runner = runtime.runner
    capture, made = record_eager(runtime.engine, [runner])
    runner.graphs.capture = capture  # what a GPU gets from capture_cuda_graph
    runner.warm_up(runtime.modules)  # every reachable bucket (a request of up to max_inputs rows reaches all)
    reachable = runner.reachable_buckets()
    assert runner.graphs.captures == len(reachable) == len(runner.graphs) > 1

    rows = sorted_rows(tiny_backbone, TEXTS)
    engine = Engine(tiny_backbone)
    first = runtime.run_batch(rows, runtime.modules, Timings())
    assert_same_answers(first, engine.predict(tiny_backbone.collate(rows), runtime.modules))
    runtime.run_batch(rows, runtime.modules, Timings())
    runtime.run_batch(rows[:2], runtime.modules, Timings())
    runtime.run_batch(rows[:2], {"ner": runtime.modules["ner"]}, Timings())  # a subset: the set's graph, ner's outputs
    assert runner.graphs.captures == len(reachable) and runner.graphs.replays == 4  # replayed, nothing captured

    runtime.load_task("sentiment", "1")
    assert len(runner.graphs) == len(reachable) and runner.graphs.captures == 2 * len(reachable)  # dropped, recaptured
    second = runtime.run_batch(rows, runtime.modules, Timings())
    assert made[-1]["sentiment"] is runtime.modules["sentiment"].head  # captured with the new head
    assert_same_answers(second, engine.predict(tiny_backbone.collate(rows), runtime.modules))
    assert [a["scores"] for a in second["sentiment"]] != [a["scores"] for a in first["sentiment"]]
    assert second["ner"] == first["ner"] or all(  # ner unchanged (same head weights)
        [e["label"] for e in a["entities"]] == [e["label"] for e in b["entities"]]
        for a, b in zip(second["ner"], first["ner"]))

    runtime.unload_task("ner")
    assert all("ner" not in heads for heads in made[-1:])  # recaptured without the unloaded head
    third = runtime.run_batch(rows, runtime.modules, Timings())
    assert set(third) == {"sentiment"}
    assert_same_answers(third, {"sentiment": second["sentiment"]})
    runtime.load_task("sentiment", "2")
    assert_same_answers(runtime.run_batch(rows, runtime.modules, Timings()), {"sentiment": first["sentiment"]})
    runtime.close()


def test_graph_memory_cap_and_a_failed_capture_fall_back_to_eager(tiny_backbone, tiny_store):
    modules = modules_of(tiny_store, tiny_backbone)
    rows = sorted_rows(tiny_backbone, TEXTS)
    calls = []

    def failing(plan, bucket):
        calls.append(bucket)
        raise RuntimeError("operation not permitted when stream is capturing")

    runner = runner_for(tiny_backbone, "buckets", capture=failing, graph_batch_sizes="8", graph_seq_lens="64")
    runner.warm_up(modules)
    assert calls == runner.reachable_buckets()  # each tried once
    want = runner_for(tiny_backbone, "length_runs", max_padding_ratio=1000).run(rows, modules)
    assert_same_answers(runner.run(rows, modules), want)
    runner.warm_up(modules)
    assert_same_answers(runner.run(rows, modules), want)
    assert calls == runner.reachable_buckets()  # not tried again: eager for those shapes

    tried = len(calls)
    capped = runner_for(tiny_backbone, "buckets", capture=failing, graph_memory_mb=0)
    assert not capped.graphs.enabled
    capped.warm_up(modules)
    assert_same_answers(capped.run(rows, modules), want)
    assert len(calls) == tried


def test_reaching_the_graph_memory_cap_is_said_once_and_the_rest_run_eager(tiny_backbone, tiny_store, caplog):
    """Capture stops at --graph-memory-mb (largest shapes first, so the small one-text shapes are the
    ones left eager): said in one warning line naming the cap, where it had been silent."""
    modules = modules_of(tiny_store, tiny_backbone)
    engine, ref = Engine(tiny_backbone), []
    stand_in, _ = record_eager(engine, ref)

    def capture(plan, bucket):  # each 'graph' holds 3 MiB of a 5 MiB cap
        captured = stand_in(plan, bucket)
        captured.memory_bytes = 3 * 2**20
        return captured

    runner = ModelRunner(engine, Settings(batch_shapes="buckets", head_precision="fp32", graph_batch_sizes="1,2,4",
                                          graph_seq_lens="32,64", graph_memory_mb=5), capture=capture)
    ref.append(runner)
    with caplog.at_level(logging.WARNING, logger="tmod"):
        runner.warm_up(modules)
    reachable = runner.reachable_buckets()
    plan, = runner.graphs.plans()
    assert len(reachable) > 2 and runner.graphs.captures == 2 and runner.graphs.buckets(plan) == reachable[:2]
    said = [r.getMessage() for r in caplog.records if "cap" in r.getMessage()]
    assert len(said) == 1 and "6 MiB, the cap (--graph-memory-mb 5)" in said[0] and str(reachable[2]) in said[0], said
    rows = sorted_rows(tiny_backbone, TEXTS[:1])  # one short text: the smallest shape, left out
    want = runner_for(tiny_backbone, "length_runs", max_padding_ratio=1000).run(rows, modules)
    assert_same_answers(runner.run(rows, modules), want)
    assert runner.graphs.replays == 0  # that pass ran eager


# ---- nothing in the pass waits on the device -----------------------------------------------------
class HostSyncs(TorchFunctionMode):
    """Records calls that read a tensor's values on the host (each one a device sync on a GPU, and
    an error inside CUDA graph capture) or build a tensor from Python data, made from tmod's own code."""

    READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero"}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS or func in (torch.tensor, torch.as_tensor):
            caller = traceback.extract_stack(limit=2)[0]  # the frame that called it
            if caller.filename.startswith(SERVER_DIR):
                self.calls.append(f"{name} at {os.path.relpath(caller.filename, SERVER_DIR)}:{caller.lineno}")
        return func(*args, **(kwargs or {}))


def test_a_pass_reads_nothing_back_from_the_device(tiny_backbone, tiny_store):
    """Engine.run with the three test modules (casing included), fused and unfused, on a prepared
    batch: no host read of a device value and no tensor built from Python lists in tmod's code."""
    modules = modules_of(tiny_store, tiny_backbone)
    rows = sorted_rows(tiny_backbone, TEXTS)
    for fuse in (True, False):
        engine = Engine(tiny_backbone, fuse=fuse)
        runner = ModelRunner(engine, Settings(batch_shapes="buckets", graph_batch_sizes="8", graph_seq_lens="64"))
        batch = runner.prepare(rows, modules).passes[0].batch
        engine.plan(modules)  # plans are built once per module set, outside the pass
        with torch.inference_mode(), HostSyncs() as syncs:
            engine.run(batch, modules)
        assert syncs.calls == []
    with HostSyncs() as syncs:  # the detector sees what it looks for: layers_read() reads weights back
        modules["sentiment"].head.layers_read()
    assert syncs.calls and syncs.calls[0].startswith("tolist at heads/layermix/model.py")


# ---- heads in 16 bits ----------------------------------------------------------------------------
def test_bf16_heads_run_under_autocast_and_stay_close(tiny_backbone, tiny_store):
    modules = modules_of(tiny_store, tiny_backbone)
    rows = sorted_rows(tiny_backbone, TEXTS)
    bb16 = tiny_backbone.use_backend("torch", "bf16")
    # unfused: the hook below sits on one head's own classifier, which grouped heads run stacked
    runner = ModelRunner(Engine(bb16, fuse=False), Settings(precision="bf16", head_precision="bf16"))
    assert runner.head_precision == "bf16"
    seen = []
    hook = modules["sentiment"].head.classifier.classifier.register_forward_hook(
        lambda mod, args, out: seen.append(out.dtype))
    try:
        got = runner.run(rows, modules)
    finally:
        hook.remove()
    assert seen and set(seen) == {torch.bfloat16}  # the head's matrix products ran in bf16
    want = ModelRunner(Engine(bb16), Settings(precision="bf16", head_precision="fp32")).run(rows, modules)
    assert [a["label"] for a in got["sentiment"]] == [a["label"] for a in want["sentiment"]]
    for a, b in zip(got["sentiment"], want["sentiment"]):
        assert a["score"] == pytest.approx(b["score"], abs=0.02)
    # auto: the backbone's bf16 on the CPU too
    assert ModelRunner(Engine(bb16), Settings(precision="bf16")).head_precision == "bf16"


@pytest.mark.parametrize("precision, want", [("fp16", "fp16"), ("bf16", "bf16"), ("fp32", "fp32"), ("int8", "fp32")])
def test_auto_head_precision_follows_the_backbone(precision, want):
    """Both 16-bit precisions met the accuracy rule on every shipped module (bench/results/head-precision-*),
    and bf16 heads measured faster on the CPU (bench/results/sharing-cpu-bf16.md): auto follows the backbone
    on every device; int8 (onnx) keeps fp32 heads."""
    settings = Settings.model_construct(precision=precision, head_precision="auto")  # no cuda here to check
    assert head_precision(settings) == want
    assert head_precision(Settings.model_construct(precision=precision, head_precision="fp32")) == "fp32"


# ---- on a GPU ------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_cuda_graph_replay_equals_eager(tiny_backbone_dir, tmp_path):
    backbone = Backbone.load(tiny_backbone_dir, device="cuda")
    store = ModuleStore(tmp_path)
    from tests.helpers import populate_store

    populate_store(tmp_path, backbone)
    modules = {t: load_module(store, t, None, backbone, "cuda") for t in ("sentiment", "ner", "acceptability")}
    rows = sorted_rows(backbone, TEXTS)
    graphs = ModelRunner(Engine(backbone), Settings(device="cuda", graph_batch_sizes="8", graph_seq_lens="64"))
    eager = ModelRunner(Engine(backbone), Settings(device="cuda", cuda_graphs=False, graph_batch_sizes="8",
                                                   graph_seq_lens="64"))
    prepared = graphs.prepare(rows, modules)
    got, _ = graphs.logits(prepared.passes[0].batch, prepared.passes[0].bucket, modules, Timings())
    assert graphs.graphs.captures == 1 and graphs.graphs.memory_bytes >= 0
    # a replay is timed at capture only with --batch-shapes bucket_runs, its one reader (the next test)
    assert graphs.graphs.find(modules, Bucket(8, 64)).seconds is None
    want, _ = eager.logits(eager.prepare(rows, modules).passes[0].batch, Bucket(8, 64), modules, Timings())
    for task in modules:
        torch.testing.assert_close(got[task], want[task], atol=1e-5, rtol=1e-5)
    # replay again on other rows of the same bucket: static inputs are refilled, not stale
    other = sorted_rows(backbone, TEXTS[::-1][:5])
    got2, _ = graphs.logits(graphs.prepare(other, modules).passes[0].batch, Bucket(8, 64), modules, Timings())
    want2, _ = eager.logits(eager.prepare(other, modules).passes[0].batch, Bucket(8, 64), modules, Timings())
    assert graphs.graphs.captures == 1
    for task in modules:
        torch.testing.assert_close(got2[task], want2[task], atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
def test_cuda_bucket_runs_time_every_graph_and_cut_passes_answer_as_eager(tiny_backbone_dir, tmp_path):
    """On a GPU: warm-up times every captured graph (seconds > 0); with times that make a cut pay, a
    batch of short rows and a long one runs as two launched replays whose answers are an eager pass's."""
    backbone = Backbone.load(tiny_backbone_dir, device="cuda")
    from tests.helpers import populate_store

    populate_store(tmp_path, backbone)
    store = ModuleStore(tmp_path)
    modules = {t: load_module(store, t, None, backbone, "cuda") for t in ("sentiment", "ner", "acceptability")}
    runner = ModelRunner(Engine(backbone), Settings(device="cuda", batch_shapes="bucket_runs", head_precision="fp32",
                                                    graph_batch_sizes="1,2,4,8", graph_seq_lens="16,32,64"))
    runner.warm_up(modules)
    captured = {bucket: runner.graphs.find(modules, bucket) for bucket in runner.reachable_buckets()}
    assert captured and all(c is not None and c.seconds > 0 for c in captured.values()), captured
    for bucket, c in captured.items():  # times that make cutting off a long row pay
        c.seconds = 0.01 + 0.01 * bucket.size * bucket.seq_len
    runner.graphs.generation += 1  # the runner's table of times is made anew
    rows = sorted_rows(backbone, TEXTS)
    prepared = runner.launch(runner.prepare(rows, modules), modules)
    assert [item.bucket for item in prepared.passes] == [Bucket(8, 16), Bucket(1, 32)]
    assert all(item.launched is not None for item in prepared.passes)
    eager = ModelRunner(Engine(backbone), Settings(device="cuda", cuda_graphs=False, batch_shapes="length_runs",
                                                   max_padding_ratio=1000, head_precision="fp32"))
    assert_same_answers(runner.execute(prepared, modules, Timings()), eager.run(rows, modules))


@pytest.mark.cuda
def test_cuda_reload_under_load_switches_answers_and_drops_no_request(tiny_backbone_dir, tmp_path):
    """A real server on cuda with graphs: requests keep coming while sentiment is switched between
    two versions; every request is answered 200, each with the answers of the version it names."""
    import asyncio

    import httpx

    from server.api.app import create_app
    from tests.helpers import LiveServer

    backbone = Backbone.load(tiny_backbone_dir, device="cuda")
    store = ModuleStore(tmp_path)
    for version, seed in (("1", 1), ("2", 2)):
        save_module(store, "sentiment", version, random_head(backbone, "sequence_classification",
                                                             ["negative", "positive"], seed), backbone)
    token = "t0ken"
    settings = Settings(store=store.root, device="cuda", admin_token=token, graph_batch_sizes="1,2,4,8,16",
                        graph_seq_lens="32,64")
    texts = TEXTS[:4]

    async def load(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async def ask():
                return await client.post("/v1/infer", params={"tasks": "sentiment"}, json={"inputs": texts})

            reference = {}
            for version in ("1", "2"):
                await client.post("/admin/modules/sentiment/load", json={"version": version},
                                  headers={"authorization": f"Bearer {token}"})
                reference[version] = (await ask()).json()["results"]
            answers, switches = [], []
            for round_ in range(6):
                version = "12"[round_ % 2]
                burst = [asyncio.create_task(ask()) for _ in range(24)]
                switches.append(await client.post("/admin/modules/sentiment/load", json={"version": version},
                                                  headers={"authorization": f"Bearer {token}"}))
                answers += await asyncio.gather(*burst, *[ask() for _ in range(8)])
            return reference, answers, switches

    with LiveServer(create_app(settings, backbone=backbone)) as server:
        reference, answers, switches = asyncio.run(load(server.url))
        metrics = httpx.get(server.url + "/metrics").text
    assert all(s.status_code == 200 for s in switches)
    assert all(a.status_code == 200 for a in answers)  # no request dropped
    for answer in answers:
        body = answer.json()
        want = reference[body["tasks"]["sentiment"]]
        for got, expected in zip(body["results"], want):
            assert got["sentiment"]["label"] == expected["sentiment"]["label"]
            assert got["sentiment"]["score"] == pytest.approx(expected["sentiment"]["score"], abs=1e-4)
    assert reference["1"] != reference["2"]
    # graphs are captured again after the last reload (not silently served eager from then on)
    graphs = [line for line in metrics.splitlines() if line.startswith("tmod_cuda_graphs ")]
    assert graphs and float(graphs[0].split()[1]) > 0, graphs


def test_pipelined_batches_prepare_the_next_while_one_runs_and_answer_the_same(tiny_backbone, tiny_store):
    """The GPU's batcher pipeline (two batches in flight, collation in a tokenizer thread), run on
    the CPU over real HTTP: batch n+1 is prepared while batch n runs, and every answer is the one
    of the one-at-a-time path."""
    import asyncio
    import threading
    import time

    import httpx

    from server.api.app import create_app
    from tests.helpers import LiveServer

    requests = [([TEXTS[i % 6]], "sentiment,ner") for i in range(24)]

    async def fire(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(*(client.post("/v1/infer", params={"tasks": t}, json={"inputs": x})
                                          for x, t in requests))

    # fp32 heads: batches are cut differently in the two runs, and 16-bit heads round differently when grouped
    settings = Settings(store=tiny_store.root, max_batch_size=4, max_wait_ms=20, head_precision="fp32")
    with LiveServer(create_app(settings, backbone=tiny_backbone)) as server:
        want = asyncio.run(fire(server.url))
    app = create_app(settings, backbone=tiny_backbone)
    runtime = app.state.runtime
    events, lock = [], threading.Lock()

    def logged(name, fn, pause=0.0):
        def call(*args):
            with lock:
                events.append((name, "start"))
            time.sleep(pause)  # a slow device: the overlap has time to show
            out = fn(*args)
            with lock:
                events.append((name, "end"))
            return out
        return call

    # both take a while (a slow tokenizer thread, a slow device), so that a batch prepared while another
    # runs shows as overlapping spans, whichever of the two threads logs its start first once a slot frees
    runtime.batcher.prepare = logged("prepare", runtime.prepare_batch, pause=0.03)
    runtime.batcher.run_batch = logged("run", runtime.run_batch, pause=0.05)
    runtime.batcher.settings.in_flight = 2
    with LiveServer(app) as server:
        got = asyncio.run(fire(server.url))
    for a, b in zip(got, want):
        assert a.status_code == b.status_code == 200
        assert_same_answers({t: [r[t] for r in a.json()["results"]] for t in ("sentiment", "ner")},
                            {t: [r[t] for r in b.json()["results"]] for t in ("sentiment", "ner")})
    active, overlapped = {"prepare": 0, "run": 0}, False
    for name, what in events:
        active[name] += 1 if what == "start" else -1
        overlapped = overlapped or (active["prepare"] > 0 and active["run"] > 0)  # prepared while another ran
    assert overlapped, events
    assert sum(1 for e in events if e == ("run", "start")) >= 6  # 24 rows, at most 4 per batch


def test_a_pass_launched_from_the_preparing_thread_answers_as_an_eager_pass(tiny_backbone, tiny_store):
    """`launch` (a tokenizer thread's, after `prepare`) queues a batch's captured pass; `execute` (the
    compute thread's) only waits for it: the answers are an eager pass's, each pass replayed once.
    A pass that cannot be launched ahead (its graph's replay raises there) runs in `execute`, and a
    batch launched before a module change still answers with the heads it was launched with."""
    import threading

    modules = modules_of(tiny_store, tiny_backbone, ("sentiment", "ner"))
    runner, made = stand_in_graph_runner(tiny_backbone, graph_batch_sizes="4,8", graph_seq_lens="32,64")
    runner.warm_up(modules)
    eager = runner_for(tiny_backbone, "length_runs", max_padding_ratio=1000)
    rows = sorted_rows(tiny_backbone, TEXTS)
    prepared = []
    worker = threading.Thread(target=lambda: prepared.append(runner.launch(runner.prepare(rows, modules), modules)))
    worker.start()
    worker.join()
    assert all(item.launched is not None for item in prepared[0].passes)
    replays = runner.graphs.replays
    assert_same_answers(runner.execute(prepared[0], modules, Timings()), eager.run(rows, modules))
    assert runner.graphs.replays == replays + len(prepared[0].passes)
    assert all(item.launched is None for item in prepared[0].passes)  # waited for once

    # launched before the module set changes (graphs dropped, captured anew): the launched pass answers
    ahead = runner.launch(runner.prepare(rows, modules), modules)
    runner.forget_plans()
    runner.warm_up(modules)
    assert_same_answers(runner.execute(ahead, modules, Timings()), eager.run(rows, modules))

    # a replay that raises while launching: logged, and the compute thread runs the pass itself
    captured = runner.graphs.find(modules, prepared[0].passes[0].bucket)
    replay, calls = captured.replay, []

    def fails_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("replay failed")
        return replay()

    captured.replay = fails_once
    again = runner.launch(runner.prepare(rows, modules), modules)
    assert again.passes[0].launched is None
    assert_same_answers(runner.execute(again, modules, Timings()), eager.run(rows, modules))
    assert len(calls) == 2


def test_bucket_runs_launch_each_run_and_answer_as_an_eager_pass(tiny_backbone, tiny_store):
    """`bucket_runs` with pass times that make a cut pay: the batch's short rows and its long one go
    in passes of their own buckets, each launched ahead, and the answers are an eager pass's; with
    times that do not, one pass; with no times (graphs that were not timed), one pass."""
    import threading

    modules = modules_of(tiny_store, tiny_backbone, ("sentiment", "ner"))
    engine, ref = Engine(tiny_backbone), []
    eager_capture, _ = record_eager(engine, ref)
    times = {}

    def capture(plan, bucket):
        captured = eager_capture(plan, bucket)
        captured.seconds = times.get(bucket)
        return captured

    runner = ModelRunner(engine, Settings(batch_shapes="bucket_runs", graph_batch_sizes="1,2,4,8",
                                          graph_seq_lens="16,32,64", head_precision="fp32"), capture=capture)
    ref.append(runner)
    rows = sorted_rows(tiny_backbone, TEXTS)
    lengths = [len(row) for row in rows]
    assert lengths[-2] <= 16 < lengths[-1] <= 32  # five short texts and one long
    eager = runner_for(tiny_backbone, "length_runs", max_padding_ratio=1000).run(rows, modules)
    for per_token, want in ((0.01, [Bucket(8, 16), Bucket(1, 32)]), (0.0, [Bucket(8, 32)]), (None, [Bucket(8, 32)])):
        times.clear()
        if per_token is not None:
            times.update({Bucket(b, n): 0.01 + per_token * b * n for b in (1, 2, 4, 8) for n in (16, 32, 64)})
        runner.forget_plans()
        runner.warm_up(modules)
        prepared = []
        worker = threading.Thread(target=lambda: prepared.append(runner.launch(runner.prepare(rows, modules), modules)))
        worker.start()
        worker.join()
        assert [item.bucket for item in prepared[0].passes] == want, per_token
        assert all(item.launched is not None for item in prepared[0].passes)
        assert_same_answers(runner.execute(prepared[0], modules, Timings()), eager)


def test_passes_whose_inputs_found_no_page_locked_set_are_counted(tiny_backbone, tiny_store):
    """Two page-locked input sets per bucket: a third batch prepared while both are taken stays in
    pageable memory (on cuda its copy in would wait for the device) and `tmod_pageable_passes` counts
    it; the sets, given back once their batches ran, serve the next batches."""
    from server.metrics import Metrics

    modules = modules_of(tiny_store, tiny_backbone, ("sentiment", "ner"))
    metrics = Metrics()
    runner, _ = stand_in_graph_runner(tiny_backbone, metrics, graph_batch_sizes="8", graph_seq_lens="64")
    runner.staged = True  # a GPU's staging, in ordinary memory here
    runner.warm_up(modules)
    rows = sorted_rows(tiny_backbone, TEXTS)
    eager = runner_for(tiny_backbone, "length_runs", max_padding_ratio=1000).run(rows, modules)
    prepared = [runner.prepare(rows, modules) for _ in range(3)]
    assert [item.staging is not None for batch in prepared for item in batch.passes] == [True, True, False]
    for batch in prepared:
        assert_same_answers(runner.execute(batch, modules, Timings()), eager)
    assert runner.prepare(rows, modules).passes[0].staging is not None  # given back
    page = metrics.exposition().decode()
    assert metric_sample(page, "tmod_pageable_passes_total") == 1
    assert metric_sample(page, 'tmod_passes_total{path="graph"}') == 3


def test_served_batches_launched_ahead_answer_as_eager_passes_across_a_reload(tiny_backbone, tiny_store,
                                                                            monkeypatch):
    """A GPU's pipeline run on the CPU over real HTTP, with the CPU's stand-in capture: two batches in
    flight, each collated and its captured pass launched on a tokenizer thread, the compute thread
    waiting and answering. Passes are replayed from the tokenizer threads (not the compute thread), a
    reload in the middle of the traffic drops and captures the graphs again under the same lock, and
    every answer is the eager one-at-a-time server's."""
    import asyncio
    import threading

    import httpx

    from server.api.app import create_app
    from server.runner.graphs import LaunchedPass
    from tests.helpers import LiveServer

    token = "t" * 32
    settings = Settings(store=tiny_store.root, tasks="sentiment,ner", max_batch_size=4, max_wait_ms=5,
                        head_precision="fp32", admin_token=token)
    requests = [([TEXTS[i % 6], TEXTS[(i + 1) % 6]], "sentiment,ner") for i in range(32)]

    async def fire(url, reload_after=None):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async def one(i, inputs, tasks):
                if reload_after is not None and i == reload_after:
                    reloaded = await client.post("/admin/modules/sentiment/reload",
                                                 headers={"authorization": f"Bearer {token}"})
                    assert reloaded.status_code == 200, reloaded.text
                return await client.post("/v1/infer", params={"tasks": tasks}, json={"inputs": inputs})
            return await asyncio.gather(*(one(i, x, t) for i, (x, t) in enumerate(requests)))

    with LiveServer(create_app(settings, backbone=tiny_backbone)) as server:  # a CPU's server: eager passes
        want = asyncio.run(fire(server.url))

    original_init, original_enqueue = ModelRunner.__init__, LaunchedPass.enqueue.__func__
    threads = []

    def init(self, engine, settings, metrics=None, capture=None):
        capture, _ = record_eager(engine, [self])  # the CPU's stand-in for capture_cuda_graph
        original_init(self, engine, settings, metrics, capture=capture)

    def enqueue(cls, captured, batch):
        threads.append(threading.current_thread().name)
        return original_enqueue(cls, captured, batch)

    monkeypatch.setattr(ModelRunner, "__init__", init)
    monkeypatch.setattr(LaunchedPass, "enqueue", classmethod(enqueue))
    graphed = Settings(**{**settings.model_dump(exclude_unset=True), "batch_shapes": "buckets",
                          "graph_batch_sizes": "1,2,4", "graph_seq_lens": "32,64"})
    app = create_app(graphed, backbone=tiny_backbone)
    runtime = app.state.runtime
    runtime.batcher.prepare, runtime.batcher.settings.in_flight = runtime.prepare_batch, 2  # as on cuda
    with LiveServer(app) as server:
        captures = runtime.runner.graphs.captures
        got = asyncio.run(fire(server.url, reload_after=12))
        assert runtime.runner.graphs.captures > captures  # the reload dropped the graphs and captured them again
        metrics = httpx.get(server.url + "/metrics").text
    for a, b in zip(got, want):
        assert a.status_code == b.status_code == 200, a.text
        assert_same_answers({t: [r[t] for r in a.json()["results"]] for t in ("sentiment", "ner")},
                            {t: [r[t] for r in b.json()["results"]] for t in ("sentiment", "ner")})
    # launched where they were collated; a batch collated while the reload had dropped the graphs and not yet
    # captured them again (two at most: two in flight) is replayed, if at all, by the compute thread
    ahead = sum(name.startswith("tmod-tokenize") for name in threads)
    assert ahead >= len(threads) - 2 and ahead > len(threads) // 2, threads
    assert runtime.runner.graphs.replays == len(threads)
    # /metrics says how the passes ran
    assert metric_sample(metrics, 'tmod_passes_total{path="graph_ahead"}') == ahead
    assert metric_sample(metrics, 'tmod_passes_total{path="graph"}') == len(threads) - ahead


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="thread names are read from Linux's /proc")
def test_the_runtime_threads_carry_their_names_to_the_os(tiny_backbone, tiny_store):
    """`top -H`, profilers and the served benchmark's busiest threads see tmod-compute and
    tmod-tokenize_N, not the process's name on every thread."""
    import threading

    runtime = Runtime(Settings(store=tiny_store.root, tasks="sentiment"), backbone=tiny_backbone)
    try:
        runtime.executor.submit(lambda: None).result()
        runtime.tokenize_executor.submit(lambda: None).result()
        names = {Path(f"/proc/self/task/{t.native_id}/comm").read_text().strip() for t in threading.enumerate()}
        assert {"tmod-compute", "tmod-tokenize_0"} <= names, names
    finally:
        runtime.close()


def test_a_pair_head_reads_each_batch_segments_in_a_captured_pass(tiny_backbone):
    """The segment classes a pair-pooling head reads are a static input of the captured pass: a
    replay for a batch with other texts and pairs answers as an eager pass does."""
    head = random_head(tiny_backbone, "sequence_classification", ["entailment", "not_entailment"], 31, pooling="pair")
    modules = {"entailment": LoadedModule("entailment", "1", None, head)}
    runner, made = stand_in_graph_runner(tiny_backbone, graph_batch_sizes="8", graph_seq_lens="64")
    runner.warm_up(modules)
    eager = runner_for(tiny_backbone, "length_runs", max_padding_ratio=1000)
    answers = []
    pairs = ["He met her.", "It was dull.", "fine", "They agreed.", "Mixed reviews.", "A meeting."]
    for texts, pairs in ((TEXTS, pairs), (pairs, TEXTS)):
        rows = sorted_rows(tiny_backbone, texts, pairs)
        answers.append(runner.run(rows, modules))
        assert_same_answers(answers[-1], eager.run(rows, modules))
    assert runner.graphs.replays == 2 and runner.graphs.captures == len(made) == len(runner.reachable_buckets())
    assert answers[0] != answers[1]


def test_a_pass_that_runs_eager_where_graphs_are_captured_says_why_once(tiny_backbone, tiny_store, caplog):
    """On the H200s (2026-11-28..30) a third to a half of the one-text passes ran eager, and nothing said
    why. A pass of native tasks that runs eager where graphs are captured now says so, once per bucket
    and task set: its shape, whether that bucket is reachable, the graphs held and which buckets are
    captured for those tasks. A pass a graph covers says nothing."""
    import logging

    modules = modules_of(tiny_store, tiny_backbone, ("sentiment", "ner"))
    runner, _ = stand_in_graph_runner(tiny_backbone, graph_batch_sizes="8", graph_seq_lens="64")
    alone = {"sentiment": modules["sentiment"]}
    runner.warm_up(alone)  # graphs for sentiment alone: a pass running ner too finds none
    rows = sorted_rows(tiny_backbone, TEXTS)
    with caplog.at_level(logging.WARNING, logger="tmod"):
        runner.run(rows, modules)
        runner.run(rows, modules)
        said = [r.getMessage() for r in caplog.records if "ran eager" in r.getMessage()]
        assert len(said) == 1, said
        assert f"a pass of {len(rows)} rows for tasks ['ner', 'sentiment'] ran eager: no captured graph at 8x64 " \
               f"covers these tasks (a reachable bucket; {len(runner.graphs)} graphs held" in said[0]
        assert said[0].endswith("captured for them: none)")
        caplog.clear()
        runner.run(rows, alone)  # replayed
        assert not [r for r in caplog.records if "ran eager" in r.getMessage()]
