#!/usr/bin/env python
"""The Transformer Modules comparison (issue 5, DESIGN.md section 1), measured on the default backbone.

For each task (SST-2, CoNLL-2003) and each method

* ``layermix``      tmod-train layermix (layer-mix head on cached backbone states),
* ``mtb``           tmod-train mtb (a trainable copy of the last backbone block + task layer),
* ``lora-mtb``      tmod-train lora-mtb (that copy frozen + rank-8 LoRA on its six linears),
* ``lora-mtb-nocache`` the same with ``--states recompute``: no state cache, the frozen backbone runs (no grad)
                    for every batch, as the thesis trains its modules; trades train time for memory,
* ``lora-adapters`` the baseline: peft LoRA (same rank, alpha and six linears) inside EVERY block of
                    the backbone model (Backbone.load().model; a deep copy where the plain backbone is
                    needed beside it), plus the MTB task layer (sequence: masked mean pooling,
                    dropout, linear; token: dropout, linear; labels on each word's first sub-token), trained
                    end to end (a backbone forward and backward every step: adapters sit inside the
                    backbone, so no state cache is possible),

it trains on the SAME seeded training subset (``--max-train``), with the same batch size, epoch budget,
early-stopping rule, optimiser (AdamW, weight decay, grad clipping, ReduceLROnPlateau) and batch order,
scores the FULL validation split, and records:

* validation metric (SST-2 accuracy, CoNLL-2003 entity F1) through the served computation;
* trainable parameters (and what the artifact stores, and what serving runs);
* train time per epoch (wall and CPU time of the training pass; validation excluded), the one-off
  backbone-state caching of the head kinds separately, and the whole run's wall/CPU time;
* peak training memory, measured the same way for every method, two ways:
  (a) peak RSS of the training process above its RSS right after the backbone was loaded (VmHWM reset
      through /proc/self/clear_refs at that point): data encoding, state caches, activations,
      gradients, optimiser state and allocator slack of the whole fit;
  (b) peak bytes of live tensors allocated during training steps (torch profiler allocator events) on
      the same fixed probe batches of the training subset for every method (the longest full batch plus
      evenly spaced others), in a separate fresh process: activations + gradients + optimiser state,
      allocator-independent; weights and state caches that exist before the steps are not counted;
  (c) the tensor footprint: (b) + the state cache + the weights held besides the shared frozen backbone
      (the live-tensor analogue of a GPU's peak allocated memory, without allocator slack);
* serving cost per request relative to the backbone alone (``Backbone.stream`` to the last layer, no
  heads): each trained module loaded with ``server.modules.load_module`` and run through
  ``server.engine.Engine.logits`` alone, and its head-only cost on precomputed states (its marginal cost
  when it shares a pass that already reaches the states it reads); the adapters: the adapted model's
  forward + task layer, unmerged (peft layers) and merged (W + BA folded in; it still needs a pass of
  its own per task, shared with nobody). Batch 1 and 32, interleaved rounds, process CPU time, one torch
  thread.

Every training run and every memory probe runs in its own subprocess (fresh memory accounting).
``tmod-train`` runs are the real command (``training.cli.main`` with the same arguments) inside a child that
only adds timers and RSS readings around the trainer's own functions. Outputs:
``bench/results/compare-heads.{json,md,png}`` (``--quick``: ``compare-heads-quick.*``); trained modules go to a
scratch store under ``runs/compare-heads/`` (git-ignored).

    .venv/bin/python bench/compare_heads.py --quick          # smoke run, a few minutes
    .venv/bin/python bench/compare_heads.py                  # the recorded comparison
    .venv/bin/python bench/compare_heads.py --resume runs/compare-heads/20260101-000000   # reuse finished runs
"""
from __future__ import annotations

import argparse
import copy
import datetime as dt
import gc
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "bench"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench_sharing import (  # noqa: E402  (shared bench helpers: machine info, interleaving, memory probes)
    _profiler_peak,
    _reset_peak_rss,
    _vm,
    interleaved_rounds,
    machine_info,
    paired_ratio,
    summarise,
)

TASKS = ("sst2", "conll2003")
METHODS = ("layermix", "mtb", "lora-mtb", "lora-mtb-nocache", "lora-adapters")
HEAD_KINDS = ("layermix", "mtb", "lora-mtb", "lora-mtb-nocache")
# tmod-train kind and extra options per head method; "lora-mtb-nocache" is LoRA-MTB trained with
# `--states recompute`: the backbone runs (no grad) for every batch instead of a state cache
TRAIN_KIND = {"layermix": ("layermix", []), "mtb": ("mtb", []), "lora-mtb": ("lora-mtb", []),
              "lora-mtb-nocache": ("lora-mtb", ["--states", "recompute"])}
LORA_MTB_VARIANTS = ("lora-mtb", "lora-mtb-nocache")
BASELINE = "lora-adapters"
TARGET_POINTS, TARGET_TIME, TARGET_MEMORY = 2.0, 0.5, 1 / 3  # issue 5, on SST-2
MIB = 2**20


# ---------------------------------------------------------------------------------------------
# the LoRA-adapter baseline (training and serving)
# ---------------------------------------------------------------------------------------------
class AdapterModel(nn.Module):
    """peft LoRA inside every block of a deep copy of the backbone model, plus the MTB task layer.

    Shaped like a Head for `training.trainer.run_epoch` / `validate`: `start` keeps nothing, no backbone
    states are fed (the model computes its own from the tokens), `finish` runs embeddings, every adapted
    layer and the task layer. The layers run through the backbone's own adapter (embed, mask, run_layer),
    i.e. exactly the computation `Backbone.stream` serves, with gradients.
    """

    def __init__(self, backbone, task_type, labels: list[str], rank: int, lora_alpha: float,
                 targets: list[str], dropout: float, pooling: str = "mean", copy_model: bool = True):
        from peft import LoraConfig, inject_adapter_in_model

        from modules_store import TaskType
        from server.backbone.architectures import adapter_for
        from server.heads.mtb.layer import PooledClassifier, TokenLinear

        super().__init__()
        self.task_type, self.labels = task_type, list(labels)
        # a deep copy where the plain backbone must stay usable (serving comparison); in place in the
        # training processes, where the backbone object only tokenizes afterwards, so the baseline is not
        # charged for a second copy of the weights that a real training job would not hold
        encoder = copy.deepcopy(backbone.model) if copy_model else backbone.model
        if getattr(encoder, "pooler", None) is not None:
            encoder.pooler = None  # unused by mean pooling / token heads; keep LoRA off it
        for param in encoder.parameters():
            param.requires_grad_(False)
        config = LoraConfig(r=rank, lora_alpha=lora_alpha, target_modules=list(targets), lora_dropout=0.0,
                            bias="none")
        inject_adapter_in_model(config, encoder, adapter_name="default")
        self.encoder = encoder
        self._layers = adapter_for(encoder)  # embed / mask / run_layer, as the server streams
        if task_type == TaskType.token_classification:
            self.task_layer = TokenLinear(backbone.hidden_size, len(labels), dropout)
        else:
            self.task_layer = PooledClassifier(backbone.hidden_size, len(labels), dropout, pooling)

    def start(self, batch):
        return None

    def consume(self, state, index, hidden):  # never fed states
        raise RuntimeError("the adapter model computes its own states")

    def finish(self, state, batch) -> torch.Tensor:
        hidden = self._layers.embed(batch.input_ids, batch.token_type_ids)
        mask = self._layers.mask(hidden, batch.attention_mask)
        for index in range(len(self._layers.layers)):
            hidden = self._layers.run_layer(index, hidden, mask)
        return self.task_layer(hidden, batch.attention_mask)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        names = {n for n, p in self.named_parameters() if p.requires_grad}
        return {k: v.detach().clone().contiguous() for k, v in self.state_dict().items() if k in names}

    def merged_copy(self) -> "AdapterModel":
        """A copy with every LoRA update folded into its base weight (peft's merge)."""
        from peft.tuners.lora import LoraLayer

        merged = copy.deepcopy(self).eval()
        for module in merged.modules():
            if isinstance(module, LoraLayer):
                module.merge()
        return merged


class NoStates:
    """The states source of the adapter model: nothing (it runs its own backbone copy)."""

    def states(self, rows, batch):
        return iter(())


# ---------------------------------------------------------------------------------------------
# child processes
# ---------------------------------------------------------------------------------------------
def _rusage() -> dict:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"ru_maxrss_bytes": ru.ru_maxrss * 1024, "cpu_seconds": ru.ru_utime + ru.ru_stime}


class Recorder:
    """Timers and RSS readings around the trainer's functions (behaviour unchanged)."""

    def __init__(self):
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        self.data = {"epochs": [], "validations": [], "caching": []}

    def after_backbone_load(self) -> None:
        gc.collect()
        self.data["hwm_before_backbone_reset_bytes"] = _vm("VmHWM")
        self.data["rss_after_backbone_bytes"] = _vm("VmRSS")
        self.data["peak_rss_reset_supported"] = _reset_peak_rss()
        self.data["backbone_loaded_at_seconds"] = time.perf_counter() - self.t0

    def fit_started(self) -> None:
        self.data["rss_at_fit_start_bytes"] = _vm("VmRSS")
        self.data["fit_started_at_seconds"] = time.perf_counter() - self.t0
        self._fit = (time.perf_counter(), time.process_time())

    def fit_done(self) -> None:
        self.data["hwm_after_fit_bytes"] = _vm("VmHWM")
        self.data["fit_wall_seconds"] = time.perf_counter() - self._fit[0]
        self.data["fit_cpu_seconds"] = time.process_time() - self._fit[1]

    def timed(self, key: str, fn, *args, **kwargs):
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn(*args, **kwargs)
        self.data[key].append({"wall_seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0})
        return out

    def time_epochs(self, trainer) -> None:
        """Time every training epoch and validation of tmod-train's epoch loop (training.trainer)."""
        run_epoch, validate = trainer.run_epoch, trainer.validate
        trainer.run_epoch = lambda *a, **k: self.timed("epochs", run_epoch, *a, **k)
        trainer.validate = lambda *a, **k: self.timed("validations", validate, *a, **k)

    def finish(self) -> dict:
        self.data["hwm_at_end_bytes"] = _vm("VmHWM")
        self.data["total_wall_seconds"] = time.perf_counter() - self.t0
        self.data["total_cpu_seconds"] = time.process_time() - self.c0
        self.data.update(_rusage())
        return self.data


def child_train_head(spec: dict) -> dict:
    """`tmod-train <kind> ...` (training.cli.main, same arguments) with timers and RSS readings added."""
    import training.trainer as trainer
    from server.backbone import Backbone
    from training import cli

    rec = Recorder()
    load = Backbone.load.__func__

    def timed_load(cls, *args, **kwargs):
        backbone = load(cls, *args, **kwargs)
        rec.after_backbone_load()
        return backbone

    Backbone.load = classmethod(timed_load)
    fit, cached = trainer.fit, trainer.CachedStates

    def timed_fit(*args, **kwargs):
        rec.fit_started()
        out = fit(*args, **kwargs)
        rec.fit_done()
        return out

    class TimedCache(cached):
        def __init__(self, *args, **kwargs):
            c0, t0 = time.process_time(), time.perf_counter()
            super().__init__(*args, **kwargs)
            rec.data["caching"].append({"wall_seconds": time.perf_counter() - t0,
                                        "cpu_seconds": time.process_time() - c0, "bytes": self.nbytes()})

    trainer.fit = timed_fit
    rec.time_epochs(trainer)
    trainer.CachedStates = TimedCache
    rc = cli.main(spec["argv"])
    if rc:
        raise SystemExit(rc)
    manifest_path = Path(spec["store"]) / spec["task"] / spec["version"] / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    training = manifest["training"]
    return {
        "method": spec["method"], "task": spec["task"], "command": "tmod-train " + " ".join(spec["argv"]),
        "artifact": str(manifest_path.parent), "metrics": manifest["metrics"], "metric": manifest["metrics"]["metric"],
        "trainable_parameters": training["trainable_parameters"],
        "artifact_parameters": training["artifact_parameters"], "served_parameters": training["parameters"],
        "epochs_run": training["epochs_run"], "best_epoch": training["best_epoch"], "history": training["history"],
        "layer_weights": training.get("layer_weights"), "settings": training["settings"],
        "data": training["data"], "trainer_timing": training["timing"], "measured": rec.finish(),
    }


def adapter_settings(spec: dict):
    from training.settings import TrainSettings

    return TrainSettings(kind="lora-mtb", dataset=spec["dataset"], max_train=spec["max_train"],
                         max_validation=spec.get("max_validation"), epochs=spec["epochs"],
                         patience=spec["patience"], batch_size=spec["batch_size"], seed=spec["seed"],
                         threads=spec["threads"], lr=spec["adapter_lr"], rank=spec["rank"],
                         lora_alpha=spec["lora_alpha"], progress=True, device="cpu")


def build_adapter_model(s, task_type, labels, backbone, copy_model: bool = True) -> AdapterModel:
    from server.heads.lora_mtb import DEFAULT_TARGETS

    return AdapterModel(backbone, task_type, labels, s.rank, s.lora_alpha, s.targets or DEFAULT_TARGETS,
                        s.dropout, s.pooling, copy_model=copy_model)


def child_train_adapters(spec: dict) -> dict:
    """The baseline's training run: tmod-train's own data, batching, step (run_epoch), validation
    (validate) and epoch loop (train_epochs: early stopping on the validation metric,
    ReduceLROnPlateau, best epoch kept), with the model above."""
    from safetensors.torch import save_file

    from server.backbone import Backbone
    from training.evaluate import collect, score
    from training.settings import TASK_DEFAULTS
    from training.states import Split
    import training.trainer as trainer
    from training.trainer import resolve_data, seed_everything

    rec = Recorder()
    s = adapter_settings(spec)
    seed_everything(s.seed)
    data = resolve_data(s)
    train_data, val_data, labels, preset_metric, provenance = (data.train, data.validation, data.labels, data.metric,
                                                               data.provenance)
    task_type = train_data.task_type
    metric = preset_metric or TASK_DEFAULTS[task_type]["metric"]
    s = s.with_task_defaults(task_type).model_copy(update={"metric": metric})
    torch.set_num_threads(s.threads)
    device = torch.device("cpu")
    backbone = Backbone.load(device="cpu")
    rec.after_backbone_load()
    model = build_adapter_model(s, task_type, labels, backbone, copy_model=False)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    train_split, val_split = Split(train_data, labels, backbone), Split(val_data, labels, backbone)

    rec.time_epochs(trainer)  # tmod-train's own epoch loop, timed as child_train_head times it
    rec.fit_started()
    history, best_epoch, _ = trainer.train_epochs(model, train_split, val_split, NoStates(), NoStates(), s, device,
                                                  False, state=model.trainable_state)
    rec.fit_done()

    # the number reported: the best model run the way it would be served (eval, inference mode, no cache)
    model.eval()
    with torch.inference_mode():
        predicted = collect(val_split, val_split.batches(s.eval_batch_size), lambda rows, batch: model.finish(None, batch))
    metrics = score(val_split, predicted)
    metrics.update(metric=metric, split="validation")
    weights_path = Path(spec["out_dir"]) / "adapters.safetensors"
    save_file(model.trainable_state(), str(weights_path))
    lora = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "lora_" in n)
    return {
        "method": "lora-adapters", "task": spec["task"],
        "command": "bench/compare_heads.py child train-adapters (training.trainer.train_epochs)",
        "artifact": str(weights_path), "metrics": metrics, "metric": metric,
        "trainable_parameters": trainable, "artifact_parameters": trainable,
        "served_parameters": sum(p.numel() for p in model.parameters()),
        "lora_parameters": lora, "epochs_run": len(history), "best_epoch": best_epoch, "history": history,
        "settings": s.model_dump(mode="json") | {"targets": list(model_targets(model)), "where": "every backbone block"},
        "data": provenance, "measured": rec.finish(),
    }


def model_targets(model: AdapterModel) -> list[str]:
    from peft.tuners.lora import LoraLayer

    return sorted({name.split("encoder.layer.", 1)[-1].split(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, LoraLayer)})


def probe_rows(split, batch_size: int, count: int) -> list[int]:
    """Rows of `count` full batches of the length-sorted training subset: the longest one and evenly
    spaced others (the same rows for every method)."""
    batches = [b for b in split.batches(batch_size) if len(b) == batch_size] or split.batches(batch_size)
    picks = sorted({round(i * (len(batches) - 1) / max(count - 1, 1)) for i in range(count)})
    return [r for i in picks for r in batches[i]]


def child_probe(spec: dict) -> dict:
    """Peak memory of training steps on fixed probe batches: torch profiler (live tensor bytes) and
    RSS (VmHWM) around one pass over them, model and optimiser built as in the training run."""
    from server.backbone import Backbone
    from training.data import LabelledData
    from training.settings import TASK_DEFAULTS, TrainSettings
    from training.states import CachedStates, RecomputedStates, Split
    from training.trainer import build_head, make_optimizer, resolve_data, run_epoch, seed_everything, training_states

    method = spec["method"]
    if method == BASELINE:
        s = adapter_settings(spec)
    else:
        s = TrainSettings(kind=TRAIN_KIND[method][0], dataset=spec["dataset"], max_train=spec["max_train"],
                          batch_size=spec["batch_size"], seed=spec["seed"], threads=spec["threads"],
                          rank=spec["rank"], lora_alpha=spec["lora_alpha"], progress=True, device="cpu")
    seed_everything(s.seed)
    data = resolve_data(s)
    train_data, labels, preset_metric = data.train, data.labels, data.metric
    task_type = train_data.task_type
    s = s.with_task_defaults(task_type).model_copy(
        update={"metric": preset_metric or TASK_DEFAULTS[task_type]["metric"]})
    torch.set_num_threads(s.threads)
    backbone = Backbone.load(device="cpu")
    full = Split(train_data, labels, backbone)
    rows = probe_rows(full, s.batch_size, spec["probe_batches"])
    probe = Split(LabelledData(task_type, [train_data.examples[r] for r in rows], train_data.source,
                               train_data.has_pairs), labels, backbone)
    del full
    if method == BASELINE:
        model, source = build_adapter_model(s, task_type, labels, backbone, copy_model=False), NoStates()
    else:
        model = build_head(s, task_type, labels, backbone)
        if "--states" in TRAIN_KIND[method][1]:  # recomputed states: the no-grad backbone pass is part of each step
            source = RecomputedStates(probe, training_states(model))
        else:
            source = CachedStates(probe, training_states(model), s.eval_batch_size, progress=False)
    optimizer = make_optimizer(s, model)
    batches = probe.batches(s.batch_size)
    gc.collect()
    rss0 = _vm("VmRSS")
    reset = _reset_peak_rss()
    c0, t0 = time.process_time(), time.perf_counter()
    peak, net = _profiler_peak(lambda: run_epoch(model, probe, source, optimizer, s, random.Random(s.seed),
                                                 torch.device("cpu"), False, "probe"))
    seconds = time.perf_counter() - t0
    hwm = _vm("VmHWM")
    params = list(model.parameters())
    return {
        "method": method, "task": spec["task"], "probe_batches": len(batches), "batch_size": s.batch_size,
        "probe_tokens_per_batch": [probe.token_batch(b).seq_len for b in batches],
        "step_peak_tensor_bytes": peak, "step_net_tensor_bytes": net,
        "step_peak_rss_delta_bytes": (hwm - rss0) if reset else None, "rss_before_steps_bytes": rss0,
        "profiled_wall_seconds": seconds, "profiled_cpu_seconds": time.process_time() - c0,
        "model_parameter_bytes": sum(p.numel() * p.element_size() for p in params),
        "trainable_parameter_bytes": sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        "backbone_parameter_bytes": sum(p.numel() * p.element_size() for p in backbone.model.parameters()),
    }


def child_serve(spec: dict) -> dict:
    """Serving cost per request of every trained method relative to the backbone alone."""
    from safetensors.torch import load_file

    from modules_store import ModuleStore
    from server.backbone import Backbone
    from server.engine import Engine
    from server.modules import load_module
    from training.data import preset_spec, PRESETS
    from training.settings import TASK_DEFAULTS

    torch.set_num_threads(spec["threads"])
    rng = random.Random(spec["seed"])
    backbone = Backbone.load(device="cpu")
    L = backbone.num_layers
    data = preset_spec(PRESETS[spec["dataset"]], "validation").read()
    texts = data.texts()
    store = ModuleStore(spec["store"])
    modules = {m: load_module(store, spec["task"], m, backbone) for m in spec["head_methods"]}
    adapters = {}
    if spec.get("adapter_weights"):
        s = adapter_settings(spec)
        labels = next(iter(modules.values())).head.labels if modules else list(PRESETS[spec["dataset"]].labels)
        s = s.with_task_defaults(data.task_type).model_copy(update={"metric": TASK_DEFAULTS[data.task_type]["metric"]})
        model = build_adapter_model(s, data.task_type, labels, backbone)
        missing, unexpected = model.load_state_dict(load_file(spec["adapter_weights"]), strict=False)
        if unexpected or any("lora_" in k or k.startswith("task_layer") for k in missing):
            raise SystemExit(f"adapter weights do not fit: missing {missing} unexpected {unexpected}")
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        adapters = {"unmerged": model, "merged": model.merged_copy()}
    engine = Engine(backbone)
    sample = rng.sample(range(len(texts)), 32 + 32 * spec["batches_32"])
    sets = {
        1: [backbone.tokenize([texts[i]], truncate=True) for i in sample[:32]],
        32: [backbone.tokenize([texts[i] for i in sample[32 + 32 * k: 64 + 32 * k]], truncate=True)
             for k in range(spec["batches_32"])],
    }
    checks = {}
    if adapters:
        with torch.inference_mode():
            b = sets[32][0]
            checks["merged_vs_unmerged_max_abs_logit_diff"] = float(
                (adapters["merged"].finish(None, b) - adapters["unmerged"].finish(None, b)).abs().max())
    out = {"requests_per_run": {}, "tokens": {}, "clock": spec["clock"], "checks": checks, "by_batch_size": {}}
    for size, batches in sets.items():
        with torch.inference_mode():
            states = [{i: h.clone() for i, h in backbone.stream(b)} for b in batches]
        configs = {}

        def backbone_only(batches=batches):
            for b in batches:
                for _ in backbone.stream(b, upto=L):
                    pass
        configs["backbone"] = backbone_only
        for method, module in modules.items():
            one = {spec["task"]: module}

            def served(batches=batches, one=one):
                for b in batches:
                    engine.logits(b, one)

            @torch.inference_mode()
            def head_only(batches=batches, states=states, head=module.head):
                for b, st in zip(batches, states):
                    state = head.start(b)
                    for index in head.layers_read():
                        state = head.consume(state, index, st[index])
                    head.finish(state, b)
            configs[f"{method}:served_alone"] = served
            configs[f"{method}:head_only"] = head_only
        for variant, model in adapters.items():
            @torch.inference_mode()
            def adapted(batches=batches, model=model):
                for b in batches:
                    model.finish(None, b)
            configs[f"{BASELINE}:{variant}"] = adapted
        times = interleaved_rounds(configs, spec["rounds"], spec["repeats"], rng, f"serve {spec['task']} b={size}")
        n = sum(b.size for b in batches)
        clock = spec["clock"]
        section = {"requests": n, "mean_padded_tokens": statistics.mean(b.seq_len for b in batches), "configs": {}}
        for name in configs:
            section["configs"][name] = {
                "ms_per_request": {c: summarise([t / n * 1e3 for t in times[c][name]]) for c in ("cpu", "wall")},
                "vs_backbone": {c: paired_ratio(times[c][name], times[c]["backbone"]) for c in ("cpu", "wall")},
            }
        out["by_batch_size"][str(size)] = section
        print(f"  serve {spec['task']} b={size}: " + ", ".join(
            f"{k} {v['vs_backbone'][clock]['median']:.3f}" for k, v in section["configs"].items()), flush=True)
    out["layers_read"] = {m: mod.head.layers_read() for m, mod in modules.items()}
    return out


CHILDREN = {"train-head": child_train_head, "train-adapters": child_train_adapters, "probe": child_probe,
            "serve": child_serve}


def child_main(kind: str, spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    result = CHILDREN[kind](spec)
    Path(spec["result_path"]).write_text(json.dumps(result, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# the parent: runs children one after the other
# ---------------------------------------------------------------------------------------------
def run_child(kind: str, spec: dict, run_dir: Path, name: str, resume: bool) -> dict:
    result_path = run_dir / f"{name}.result.json"
    if resume and result_path.is_file():
        print(f"[{name}] reusing {result_path}", flush=True)
        return json.loads(result_path.read_text())
    spec = {**spec, "result_path": str(result_path)}
    spec_path = run_dir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec, indent=2) + "\n")
    log_path = run_dir / f"{name}.log"
    load = os.getloadavg()
    print(f"[{name}] start (load {load[0]:.2f}), log {log_path}", flush=True)
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "_child", kind, str(spec_path)],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = log_path.read_text()[-3000:]
        raise SystemExit(f"[{name}] child failed (exit {proc.returncode}); log {log_path}:\n{tail}")
    result = json.loads(result_path.read_text())
    result["process"] = {"wall_seconds": wall, "cpu_seconds": usage.ru_utime + usage.ru_stime,
                         "ru_maxrss_bytes_seen_by_parent": usage.ru_maxrss * 1024,
                         "load_average_at_start": list(load), "load_average_at_end": list(os.getloadavg())}
    result_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"[{name}] done in {wall:.0f}s", flush=True)
    return result


def train_argv(method: str, task: str, args, store: Path, run_dir: Path) -> list[str]:
    kind, extra = TRAIN_KIND[method]
    argv = [kind, "--dataset", task, "--max-train", str(args.max_train[task]), "--epochs", str(args.epochs),
            "--patience", str(args.patience), "--batch-size", str(args.batch_size), "--seed", str(args.seed),
            "--threads", str(args.threads), "--device", "cpu", "--task", task, "--version", method,
            "--store", str(store), "--run-dir", str(run_dir / f"{task}-{method}"),
            "--report-dir", str(run_dir / f"{task}-{method}" / "report"), "--overwrite", "--no-progress"]
    if args.max_validation:
        argv += ["--max-validation", str(args.max_validation)]
    if kind == "lora-mtb":
        argv += ["--rank", str(args.rank), "--lora-alpha", str(args.lora_alpha)]
    return argv + extra


def summarise_method(train: dict, probe: dict | None) -> dict:
    m = train["measured"]
    epochs = m["epochs"]
    caching = m.get("caching", [])
    reset = m.get("peak_rss_reset_supported")
    out = {
        "metric_name": train["metric"], "metric": train["metrics"][train["metric"]],
        "trainable_parameters": train["trainable_parameters"], "artifact_parameters": train["artifact_parameters"],
        "served_parameters": train["served_parameters"], "epochs_run": train["epochs_run"],
        "best_epoch": train["best_epoch"],
        "epoch_wall_seconds": [e["wall_seconds"] for e in epochs],
        "epoch_cpu_seconds": [e["cpu_seconds"] for e in epochs],
        "epoch_wall_seconds_median": statistics.median(e["wall_seconds"] for e in epochs),
        "epoch_cpu_seconds_median": statistics.median(e["cpu_seconds"] for e in epochs),
        "validation_wall_seconds_median": statistics.median(v["wall_seconds"] for v in m["validations"]),
        "caching_wall_seconds": sum(c["wall_seconds"] for c in caching),
        "caching_cpu_seconds": sum(c["cpu_seconds"] for c in caching),
        "state_cache_bytes": sum(c["bytes"] for c in caching),
        "fit_wall_seconds": m["fit_wall_seconds"], "fit_cpu_seconds": m["fit_cpu_seconds"],
        "run_wall_seconds": train["process"]["wall_seconds"], "run_cpu_seconds": train["process"]["cpu_seconds"],
        "peak_rss_above_backbone_bytes": (m["hwm_after_fit_bytes"] - m["rss_after_backbone_bytes"]) if reset else None,
        "process_peak_rss_bytes": max(m["hwm_before_backbone_reset_bytes"], m["hwm_at_end_bytes"]),
        "rss_after_backbone_bytes": m["rss_after_backbone_bytes"],
    }
    if probe:
        # weights the method holds besides the frozen backbone every method keeps loaded: the whole head
        # (MTB block copy, LoRA-MTB's frozen copy + factors, layer-mix), or the adapters' LoRA factors + task layer
        extra = probe["trainable_parameter_bytes"] if train["method"] == BASELINE else probe["model_parameter_bytes"]
        out.update(step_peak_tensor_bytes=probe["step_peak_tensor_bytes"],
                   step_peak_rss_delta_bytes=probe["step_peak_rss_delta_bytes"],
                   probe_tokens_per_batch=probe["probe_tokens_per_batch"],
                   extra_weight_bytes=extra,
                   tensor_footprint_bytes=probe["step_peak_tensor_bytes"] + out["state_cache_bytes"] + extra)
    return out


def ratio(a, b):
    return a / b if a is not None and b else None


SHIPPED_TASK = {"sst2": "sentiment", "conll2003": "ner"}


def shipped_layermix(task: str) -> dict | None:
    """The shipped layer-mix module of a task (modules_store/<name>/1), if trained yet: its validation metric."""
    path = REPO / "modules_store" / SHIPPED_TASK[task] / "1" / "manifest.json"
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    metrics, training = manifest.get("metrics", {}), manifest.get("training", {})
    name = metrics.get("metric")
    return {"manifest": str(path.relative_to(REPO)), "kind": manifest.get("kind"), "metric_name": name,
            "metric": metrics.get(name), "train_examples": training.get("data", {}).get("train_examples"),
            "command": training.get("command")}


def targets_for(task_results: dict) -> dict:
    """Issue 5's three targets for each LoRA-MTB variant trained, against the adapters."""
    if BASELINE not in task_results:
        return {}
    return {v: target_checks(task_results[v]["summary"], task_results[BASELINE]["summary"])
            for v in LORA_MTB_VARIANTS if v in task_results}


def target_checks(x: dict, base: dict) -> dict:
    points = 100 * (x["metric"] - base["metric"])
    checks = {
        "metric_difference_points": points,
        "metric_within_2_points": points >= -TARGET_POINTS,
        "train_time_per_epoch_ratio_wall": ratio(x["epoch_wall_seconds_median"], base["epoch_wall_seconds_median"]),
        "train_time_per_epoch_ratio_cpu": ratio(x["epoch_cpu_seconds_median"], base["epoch_cpu_seconds_median"]),
        "train_time_fit_ratio_wall_incl_caching_and_validation": ratio(x["fit_wall_seconds"], base["fit_wall_seconds"]),
        "train_time_run_ratio_wall_whole_process": ratio(x["run_wall_seconds"], base["run_wall_seconds"]),
        "peak_memory_ratio_rss_above_backbone": ratio(x["peak_rss_above_backbone_bytes"],
                                                      base["peak_rss_above_backbone_bytes"]),
        "peak_memory_ratio_step_tensors": ratio(x.get("step_peak_tensor_bytes"), base.get("step_peak_tensor_bytes")),
        "peak_memory_ratio_tensor_footprint": ratio(x.get("tensor_footprint_bytes"), base.get("tensor_footprint_bytes")),
        "peak_memory_ratio_process_rss": ratio(x["process_peak_rss_bytes"], base["process_peak_rss_bytes"]),
    }
    # verdicts on the measures that describe training; the whole-process numbers (Python, torch, imports,
    # report writing) are recorded for information only
    checks["train_time_at_most_half"] = {
        k: v <= TARGET_TIME for k, v in checks.items()
        if k.startswith("train_time") and "whole_process" not in k and v is not None}
    checks["peak_memory_at_most_a_third"] = {
        k: v <= TARGET_MEMORY for k, v in checks.items()
        if k.startswith("peak_memory") and "process_rss" not in k and v is not None}
    return checks


# ---------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------
LABEL = {"layermix": "layer-mix", "mtb": "MTB", "lora-mtb": "LoRA-MTB", "lora-mtb-nocache": "LoRA-MTB, no state cache",
         "lora-adapters": "LoRA adapters (peft)"}


def load_range(result: dict) -> str:
    loads = [r["train"]["process"]["load_average_at_start"][0] for ms in result["results"].values() for r in ms.values()]
    loads += [r["probe"]["process"]["load_average_at_start"][0] for ms in result["results"].values() for r in ms.values()]
    loads += [s["process"]["load_average_at_start"][0] for s in result["serving"].values() if "process" in s]
    return f"{min(loads):.2f} to {max(loads):.2f}" if loads else "n/a"


VERDICT_NAMES = {
    "train_time_per_epoch_ratio_wall": "per epoch, wall", "train_time_per_epoch_ratio_cpu": "per epoch, CPU",
    "train_time_fit_ratio_wall_incl_caching_and_validation": "whole fit incl. caching",
    "peak_memory_ratio_rss_above_backbone": "peak RSS above backbone",
    "peak_memory_ratio_step_tensors": "training-step tensors",
    "peak_memory_ratio_tensor_footprint": "tensor footprint",
}


def fmt(value, spec=".2f", none="n/a"):
    return none if value is None else format(value, spec)


def markdown(result: dict) -> str:
    st = result["settings"]
    m = result["machine"]
    validation_note = ("the FULL validation split" if not st["max_validation"]
                       else f"{st['max_validation']} validation examples (quick run)")
    lines = [
        "# Transformer Modules comparison: layer-mix, MTB, LoRA-MTB vs LoRA adapters",
        "",
        f"Measured {result['date_utc']} on {m['cpu_model']} ({m['logical_cpus']} logical CPUs, device cpu, "
        f"torch threads {st['threads']}, load average at start "
        f"{', '.join(f'{x:.2f}' for x in m['load_average_at_start_1_5_15min'] or [])}), "
        f"torch {m['versions']['torch']}, transformers {m['versions']['transformers']}, peft {result['versions']['peft']}, "
        f"tmod {m['versions']['tmod_git']['commit'][:10] if m['versions']['tmod_git']['commit'] else '?'}. "
        f"Backbone {st['backbone']} (frozen). Command: `{result['command']}`.",
        "",
        f"1-minute load average at the start of each child process: {load_range(result)} (2 logical CPUs shared "
        f"with other jobs; timings are CPU time of the process as well as wall time).",
        "",
        f"Same run, same machine, one method at a time, each in its own process. Training: the same seeded subset "
        f"of the training split per task ({', '.join(f'{t}: {n}' for t, n in st['max_train'].items())} examples), "
        f"batch size {st['batch_size']}, at most {st['epochs']} epochs (early stopping patience {st['patience']}, best "
        f"epoch kept), AdamW with each kind's tmod-train default learning rate (layer-mix 1e-3, MTB 5e-5, LoRA-MTB "
        f"5e-4; adapters {st['adapter_lr']}), LoRA rank {st['rank']}, alpha {st['lora_alpha']}, on the six linears of "
        f"a block (LoRA-MTB: the copied last block; adapters: every block). Validation: "
        f"{validation_note}"
        f" (SST-2 accuracy, CoNLL-2003 entity-level micro F1), best epoch, served computation.",
        "",
    ]
    for task, methods in result["results"].items():
        rows = {k: v["summary"] for k, v in methods.items()}
        name = next(iter(rows.values()))["metric_name"] if rows else "metric"
        lines += [f"## {task} ({name}, {result['settings']['max_train'][task]} training examples)", ""]
        lines += [
            f"| method | val {name} | trainable params | stored params | epochs (best) | train s/epoch wall (CPU) | state caching s "
            f"| fit s (all epochs + val) | peak RSS above backbone MiB | step peak tensors MiB | state cache MiB "
            f"| tensor footprint MiB | serve b=1 alone / head-only "
            f"| serve b=32 alone / head-only |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        serve = result["serving"].get(task, {}).get("by_batch_size", {})
        clock = result["settings"]["serve_clock"]

        def cost(method, size):
            cfg = serve.get(str(size), {}).get("configs", {})
            if method == BASELINE:
                a, b = cfg.get(f"{BASELINE}:unmerged"), cfg.get(f"{BASELINE}:merged")
                if not a:
                    return "n/a"
                return (f"{a['vs_backbone'][clock]['median']:.2f} unmerged / {b['vs_backbone'][clock]['median']:.2f} "
                        f"merged (own pass)")
            a, h = cfg.get(f"{method}:served_alone"), cfg.get(f"{method}:head_only")
            if not a and method == "lora-mtb-nocache":
                return "as LoRA-MTB (same served artifact kind)"
            if not a:
                return "n/a"
            return f"{a['vs_backbone'][clock]['median']:.2f} / +{h['vs_backbone'][clock]['median']:.3f}"

        for method, r in rows.items():
            lines.append(
                f"| {LABEL[method]} | {100 * r['metric']:.2f} | {r['trainable_parameters']:,} | "
                f"{r['artifact_parameters']:,} | "
                f"{r['epochs_run']} ({r['best_epoch']}) | {r['epoch_wall_seconds_median']:.1f} "
                f"({r['epoch_cpu_seconds_median']:.1f}) | {fmt(r['caching_wall_seconds'], '.1f') if r['caching_wall_seconds'] else '-'} | "
                f"{r['fit_wall_seconds']:.0f} | {fmt(r['peak_rss_above_backbone_bytes'] and r['peak_rss_above_backbone_bytes'] / MIB, '.0f')} | "
                f"{fmt(r.get('step_peak_tensor_bytes') and r['step_peak_tensor_bytes'] / MIB, '.1f')} | "
                f"{r['state_cache_bytes'] / MIB:.0f} | "
                f"{fmt(r.get('tensor_footprint_bytes') and r['tensor_footprint_bytes'] / MIB, '.0f')} | "
                f"{cost(method, 1)} | {cost(method, 32)} |")
        lines += ["", "Serving columns: Engine.logits with only that module / backbone alone (both per request, "
                  f"{clock} time), then '+' the head's own cost on precomputed states relative to the backbone (what it "
                  "adds to a pass shared with other heads). Adapters: their own adapted forward / backbone alone.", ""]
        shipped = result.get("shipped_layermix", {}).get(task)
        if shipped and shipped.get("metric") is not None:
            better = [LABEL[k] for k in ("mtb", *LORA_MTB_VARIANTS) if k in rows and rows[k]["metric"] > shipped["metric"]]
            lines += [f"Shipped layer-mix module `{shipped['manifest']}` ({shipped['train_examples']} training "
                      f"examples): {shipped['metric_name']} {100 * shipped['metric']:.2f}. "
                      + (f"Beaten here by: {', '.join(better)}." if better else
                         "No MTB / LoRA-MTB trained here beats it."), ""]
        for variant, t in (result["targets"].get(task) or {}).items():
            lines += [
                f"**Targets (issue 5 sets them on SST-2): {LABEL[variant]} vs LoRA adapters, {task}**",
                "",
                f"- within {TARGET_POINTS:g} points: {LABEL[variant]} - adapters = {t['metric_difference_points']:+.2f} points -> "
                f"{'met' if t['metric_within_2_points'] else 'NOT met'}",
                f"- at most half the training time: per-epoch train time ratio {fmt(t['train_time_per_epoch_ratio_wall'])} wall, "
                f"{fmt(t['train_time_per_epoch_ratio_cpu'])} CPU (state caching excluded); whole fit incl. caching and "
                f"per-epoch validation {fmt(t['train_time_fit_ratio_wall_incl_caching_and_validation'])}; whole process "
                f"{fmt(t['train_time_run_ratio_wall_whole_process'])} (information only) -> "
                + ", ".join(f"{VERDICT_NAMES.get(k, k)}: {'met' if v else 'NOT met'}"
                            for k, v in t["train_time_at_most_half"].items()),
                f"- at most a third of the peak training memory: peak RSS above backbone ratio "
                f"{fmt(t['peak_memory_ratio_rss_above_backbone'])}, training-step peak tensors ratio "
                f"{fmt(t['peak_memory_ratio_step_tensors'])}, tensor footprint ratio "
                f"{fmt(t['peak_memory_ratio_tensor_footprint'])}, whole-process peak RSS ratio "
                f"{fmt(t['peak_memory_ratio_process_rss'])} (information only: Python and torch dominate it) -> "
                + ", ".join(f"{VERDICT_NAMES.get(k, k)}: {'met' if v else 'NOT met'}"
                            for k, v in t["peak_memory_at_most_a_third"].items()),
                "",
            ]
    lines += [
        "## How it was measured",
        "",
        *[f"- **{k.replace('_', ' ')}**: {v}" for k, v in result["method_notes"].items()],
        "",
    ]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(result["results"])
    panels = [("validation metric (%)", lambda r: 100 * r["metric"]),
              ("train s / epoch (wall, caching excluded)", lambda r: r["epoch_wall_seconds_median"]),
              ("peak RSS above backbone (MiB)", lambda r: (r["peak_rss_above_backbone_bytes"] or 0) / MIB),
              ("training-step peak tensors (MiB)", lambda r: (r.get("step_peak_tensor_bytes") or 0) / MIB),
              ("trainable parameters (M)", lambda r: r["trainable_parameters"] / 1e6)]
    fig, grid = plt.subplots(2, 3, figsize=(13, 7.5))
    axes = list(grid.flat)
    colors = {"layermix": "tab:blue", "mtb": "tab:orange", "lora-mtb": "tab:green", "lora-mtb-nocache": "tab:olive",
              "lora-adapters": "tab:red"}
    width = 0.8 / len(METHODS)
    for ax, (title, get) in zip(axes, panels):
        for j, method in enumerate(METHODS):
            xs, ys = [], []
            for i, task in enumerate(tasks):
                r = result["results"][task].get(method)
                if r:
                    xs.append(i + (j - (len(METHODS) - 1) / 2) * width)
                    ys.append(get(r["summary"]))
            ax.bar(xs, ys, width=width, color=colors[method], label=LABEL[method])
        ax.set_xticks(range(len(tasks)), tasks)
        ax.set_title(title, fontsize=9)
    ax = axes[-1]
    clock = result["settings"]["serve_clock"]
    for j, method in enumerate(METHODS):
        xs, ys = [], []
        for i, task in enumerate(tasks):
            cfg = result["serving"].get(task, {}).get("by_batch_size", {}).get("32", {}).get("configs", {})
            key = f"{method}:served_alone" if method != BASELINE else f"{BASELINE}:unmerged"
            if key in cfg:
                xs.append(i + (j - (len(METHODS) - 1) / 2) * width)
                ys.append(cfg[key]["vs_backbone"][clock]["median"])
        ax.bar(xs, ys, width=width, color=colors[method])
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set_title("serving cost vs backbone, b=32\n(served alone; adapters unmerged)", fontsize=9)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(METHODS), fontsize=8)
    fig.suptitle(f"Transformer Modules vs LoRA adapters, {result['settings']['backbone']}, CPU "
                 f"({', '.join(f'{t}: {n} train' for t, n in result['settings']['max_train'].items() if t in tasks)})",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


METHOD_NOTES = {
    "same_run": "All methods of a task trained one after the other in this run, each in a fresh subprocess, "
                "torch threads as in settings, on the same seeded training subset (tmod-train's --max-train: "
                "LabelledData.subset(n, seed)), with the same batch size, the same batch order "
                "(Split.batches with random.Random(seed)), the same epoch budget and early-stopping rule.",
    "baseline": "LoRA adapters: peft inject_adapter_in_model(LoraConfig(r, lora_alpha, lora_dropout=0, "
                "target_modules = the six linears of a BERT block)) into Backbone.load().model "
                "(in place in the training and memory-probe processes, where the backbone object only tokenizes, "
                "so no second copy of the weights is held; into a deep copy in the serving process, next to the "
                "plain backbone; pooler dropped, unused), every backbone weight frozen, the MTB task layer on top; the training step "
                "is tmod-train's own run_epoch (loss, clipping, AdamW via make_optimizer, weight decay) and the "
                "epoch loop mirrors training.trainer.fit. Dropout of the backbone copy is active in training, as in "
                "MTB blocks.",
    "validation_metric": "Full validation split (unless a quick run), best epoch. Head kinds: tmod-train's "
                         "served-path re-score (Engine.logits on the real backbone). Adapters: the best model in "
                         "eval/inference mode on the same batches, scored by training.evaluate (same metrics code).",
    "train_time_per_epoch": "Wall (perf_counter) and CPU (process_time) time of each call of "
                            "training.trainer.run_epoch (the training pass over the subset; validation excluded), "
                            "median over the epochs run. The head kinds train on backbone states cached once in "
                            "fp16 before epoch 1; that caching is reported separately (state caching s, train + "
                            "validation split) and is included in 'fit s' (caching + every epoch + per-epoch "
                            "validation) and in the whole-process wall time in the JSON.",
    "peak_rss_above_backbone": "In the training process: VmHWM is reset (/proc/self/clear_refs = 5) right after "
                               "Backbone.load returns, and read when fit returns; minus VmRSS at the reset. "
                               "Covers data encoding, state caches, activations, gradients, optimizer state and "
                               "allocator slack of the whole fit; the process's RSS after loading the backbone "
                               "(Python, torch, the backbone weights) is the common baseline taken out.",
    "step_peak_tensors": "In a separate fresh process per method: the model and optimizer built as for training "
                         "(tmod-train's build_head/make_optimizer, or the adapter model), then ONE pass of "
                         "run_epoch over the same probe batches (the longest full batch of the subset and evenly "
                         "spaced others, batch size as in training) under torch.profiler(profile_memory=True); the "
                         "peak of live tensor bytes allocated during those steps (activations kept for backward, "
                         "gradients, AdamW state, temporaries). Weights and the probe's state cache are allocated "
                         "before and not counted.",
    "tensor_footprint": "step peak tensors + the state cache (train and validation splits, fp16; head kinds only) + "
                        "the weights the method holds besides the frozen backbone that every method keeps loaded "
                        "(head kinds: the whole head, e.g. LoRA-MTB's frozen block copy; adapters: LoRA factors and "
                        "task layer). The live-tensor analogue of a GPU's max_memory_allocated minus the shared "
                        "backbone weights; allocator slack excluded.",
    "serving_cost": "One process per task, torch threads 1, process CPU time (time.process_time; wall in the "
                    "JSON), interleaved rounds (every config once per round in a shuffled order, fastest of the "
                    "repeats kept), ratios per round against the backbone alone (Backbone.stream to the last layer, "
                    "no heads), medians. 'alone' = Engine.logits with only that module (loaded from the scratch "
                    "store by load_module; LoRA-MTB merged at load): the backbone runs only as deep as the head "
                    "reads (an MTB reading state 5 replaces block 6). 'head-only' = the head's start/consume/finish "
                    "on precomputed states = what it adds to a pass shared with other heads. Adapters: the adapted "
                    "model's forward + task layer, unmerged (peft layers) and merged (peft merge: W + scale*B@A); "
                    "either way a pass of its own per task that no other task can share. Tokenization excluded.",
}


def parse_max_train(value: str) -> dict[str, int]:
    if "=" not in value:
        return {t: int(value) for t in TASKS}
    out = {}
    for part in value.split(","):
        task, n = part.split("=")
        out[task.strip()] = int(n)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Layer-mix vs MTB vs LoRA-MTB vs peft LoRA adapters on the default backbone (issue 5): "
                    "validation metric, trainable parameters, train time per epoch, peak training memory and "
                    "serving cost per request, each training run in its own subprocess. See the module docstring.")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 64 training examples, 200 validation examples, 1 epoch, 2 short serving "
                        "rounds; writes <stem>-quick.* so recorded results are not overwritten")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated (default: {','.join(TASKS)})")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated (default: {','.join(METHODS)})")
    p.add_argument("--max-train", default="sst2=12000,conll2003=5000",
                   help="training subset size, one number for every task or task=N pairs; seeded, the same "
                        "examples for every method (default: sst2=12000,conll2003=5000)")
    p.add_argument("--epochs", type=int, default=3, help="epoch budget of every method (default: 3)")
    p.add_argument("--patience", type=int, default=2,
                   help="early stopping: epochs without a better validation metric (default: 2)")
    p.add_argument("--batch-size", type=int, default=32, help="training batch size of every method (default: 32)")
    p.add_argument("--seed", type=int, default=0, help="subset, initialisation and batch order (default: 0)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of every child process (default: 1, for a shared machine)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank of LoRA-MTB and the adapters (default: 8)")
    p.add_argument("--lora-alpha", type=float, default=16.0,
                   help="LoRA alpha of LoRA-MTB and the adapters (default: 16)")
    p.add_argument("--adapter-lr", type=float, default=5e-4,
                   help="learning rate of the adapters (default: 5e-4, LoRA-MTB's tmod-train default)")
    p.add_argument("--probe-batches", type=int, default=4,
                   help="training batches in the step-memory probe (default: 4; quick: 2)")
    p.add_argument("--serve-rounds", type=int, default=None, help="interleaved serving rounds (default: 5; quick: 2)")
    p.add_argument("--serve-repeats", type=int, default=2,
                   help="runs of each config per round, the fastest kept (default: 2; quick: 1)")
    p.add_argument("--serve-batches-32", type=int, default=4,
                   help="batches of 32 per timed run; batch 1 always times 32 requests (default: 4; quick: 1)")
    p.add_argument("--serve-clock", choices=["cpu", "wall"], default="cpu",
                   help="clock of the reported serving ratios; both are in the JSON (default: cpu)")
    p.add_argument("--max-validation", type=int, default=None,
                   help="score only N validation examples (default: the full split; quick: 200)")
    p.add_argument("--run-root", type=Path, default=REPO / "runs" / "compare-heads",
                   help="scratch folder for module stores, logs and per-run results (default: runs/compare-heads, "
                        "git-ignored)")
    p.add_argument("--resume", type=Path, default=None,
                   help="an earlier run folder: reuse its finished child results, run the rest")
    p.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results",
                   help="where the JSON, Markdown and PNG go (default: bench/results)")
    p.add_argument("--stem", default="compare-heads",
                   help="output file stem (default: compare-heads; quick: compare-heads-quick)")
    args = p.parse_args(argv)
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for t in args.tasks:
        if t not in TASKS:
            p.error(f"unknown task {t!r}")
    for m in args.methods:
        if m not in METHODS:
            p.error(f"unknown method {m!r}")
    if args.quick:
        args.max_train = "64"
        args.epochs = 1
        args.max_validation = args.max_validation or 200
        args.serve_rounds = args.serve_rounds or 2
        args.serve_repeats = 1
        args.serve_batches_32 = 1
        args.probe_batches = min(args.probe_batches, 2)
        if args.stem == "compare-heads":
            args.stem = "compare-heads-quick"
    args.serve_rounds = args.serve_rounds or 5
    args.max_train = parse_max_train(args.max_train)
    for t in args.tasks:
        if t not in args.max_train:
            p.error(f"--max-train has no size for {t}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    import peft

    machine = machine_info()  # load average first
    started = time.perf_counter()
    if args.resume:
        run_dir = args.resume
    else:
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
        run_dir = args.run_root / (stamp + ("-quick" if args.quick else ""))
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    command = "python bench/compare_heads.py " + " ".join(sys.argv[1:] if argv is None else argv)
    # the run's own start: machine (load average before any child ran) and date, kept for --resume
    first = run_dir / "run.json"
    previous = args.out_dir / f"{args.stem}.json"
    if first.is_file():
        started_info = json.loads(first.read_text())
    elif args.resume and previous.is_file() and json.loads(previous.read_text()).get("run_folder") == str(run_dir):
        old = json.loads(previous.read_text())
        started_info = {"machine": old["machine"], "date_utc": old["date_utc"], "command": old["command"],
                        "elapsed_seconds": old.get("elapsed_seconds", 0.0)}
    else:
        started_info = {"machine": machine, "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                        "command": command, "elapsed_seconds": 0.0}
    first.write_text(json.dumps(started_info, indent=2) + "\n")
    machine = started_info["machine"]
    elapsed_before = started_info.get("elapsed_seconds", 0.0)
    store = run_dir / "store"
    print(f"run folder {run_dir}; load average {machine['load_average_at_start_1_5_15min']}", flush=True)
    results, serving, targets = {}, {}, {}
    base_spec = {"epochs": args.epochs, "patience": args.patience, "batch_size": args.batch_size, "seed": args.seed,
                 "threads": args.threads, "rank": args.rank, "lora_alpha": args.lora_alpha,
                 "adapter_lr": args.adapter_lr, "max_validation": args.max_validation}

    def write():
        result = {
            "benchmark": "compare-heads",
            "date_utc": started_info["date_utc"],
            "written_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine,
            "versions": {"peft": peft.__version__},
            "command": started_info.get("command", command),
            **({"resumed_with": command} if args.resume else {}),
            "run_folder": str(run_dir),
            "elapsed_seconds": elapsed_before + time.perf_counter() - started,
            "children_wall_seconds": sum(r[k]["process"]["wall_seconds"] for ms in results.values()
                                         for r in ms.values() for k in ("train", "probe") if "process" in r[k])
            + sum(v["process"]["wall_seconds"] for v in serving.values() if "process" in v),
            "settings": {**base_spec, "tasks": args.tasks, "methods": args.methods, "max_train": args.max_train,
                         "quick": args.quick, "probe_batches": args.probe_batches, "serve_rounds": args.serve_rounds,
                         "serve_repeats": args.serve_repeats, "serve_batches_32": args.serve_batches_32,
                         "serve_clock": args.serve_clock, "backbone": "all-MiniLM-L6-v2", "device": "cpu",
                         "head_defaults": "tmod-train defaults per kind (layer-mix: all states, k=64/128, ...; "
                                          "MTB/LoRA-MTB: 1 block copied from the last, reads state 5, mean pooling)"},
            "targets_definition": {"metric_points": TARGET_POINTS, "train_time_ratio_max": TARGET_TIME,
                                   "peak_memory_ratio_max": TARGET_MEMORY, "task": "sst2",
                                   "compared": "lora-mtb vs lora-adapters"},
            "method_notes": METHOD_NOTES,
            "results": results, "targets": targets, "serving": serving,
            "shipped_layermix": {t: shipped_layermix(t) for t in args.tasks},
        }
        first.write_text(json.dumps({**started_info, "elapsed_seconds": result["elapsed_seconds"]}, indent=2) + "\n")
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / f"{args.stem}.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out_dir / f"{args.stem}.md").write_text(markdown(result))
        return result

    for task in args.tasks:
        results[task] = {}
        spec = {**base_spec, "task": task, "dataset": task, "max_train": args.max_train[task]}
        for method in args.methods:
            name = f"{task}-{method}"
            if method == BASELINE:
                out_dir = run_dir / name
                out_dir.mkdir(exist_ok=True)
                train = run_child("train-adapters", {**spec, "out_dir": str(out_dir)}, run_dir, name, bool(args.resume))
            else:
                argv_ = train_argv(method, task, args, store, run_dir)
                train = run_child("train-head", {**spec, "method": method, "argv": argv_, "store": str(store),
                                                 "version": method}, run_dir, name, bool(args.resume))
            probe = run_child("probe", {**spec, "method": method, "probe_batches": args.probe_batches}, run_dir,
                              f"{name}-probe", bool(args.resume))
            results[task][method] = {"summary": summarise_method(train, probe), "train": train, "probe": probe}
            s = results[task][method]["summary"]
            print(f"  {task} {method}: {s['metric_name']} {s['metric']:.4f}, {s['trainable_parameters']:,} trainable, "
                  f"{s['epoch_wall_seconds_median']:.1f}s/epoch, peak RSS +"
                  f"{(s['peak_rss_above_backbone_bytes'] or 0) / MIB:.0f} MiB, step tensors "
                  f"{s['step_peak_tensor_bytes'] / MIB:.1f} MiB", flush=True)
            write()
        heads = [m for m in args.methods if m in HEAD_KINDS]
        adapter_weights = str(run_dir / f"{task}-{BASELINE}" / "adapters.safetensors") if BASELINE in args.methods else None
        serving[task] = run_child("serve", {**spec, "store": str(store), "head_methods": heads,
                                            "adapter_weights": adapter_weights, "rounds": args.serve_rounds,
                                            "repeats": args.serve_repeats, "batches_32": args.serve_batches_32,
                                            "clock": args.serve_clock}, run_dir, f"{task}-serve", bool(args.resume))
        targets[task] = targets_for(results[task])
        write()
    result = write()
    try:
        plot(result, args.out_dir / f"{args.stem}.png")
    except Exception as exc:  # noqa: BLE001  (a plot must not lose the measured results)
        print(f"plot failed: {exc}", flush=True)
    print(markdown(result))
    print(f"wrote {args.out_dir / (args.stem + '.json')} ({(time.perf_counter() - started) / 60:.1f} min)")


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "_child":  # internal: python compare_heads.py _child KIND SPEC
        child_main(sys.argv[2], sys.argv[3])
    else:
        main()
