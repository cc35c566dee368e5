"""ONNX Runtime: the backbone exported as one graph per layer block, so states still stream.

The model is exported once, as L + 1 small graphs: the embeddings (token ids -> state 0) and one
graph per encoder layer (state l-1 and the additive attention mask -> state l; for MPNet the mask
with its relative position bias folded in, computed once per batch from the model's bias table). `stream` runs them
in order and hands out each state as it comes, so heads read layers as they are computed and a
plan that needs only states <= m runs only the first m layer graphs: early exit still cuts compute,
and every plan is served by the same graphs (no per-plan export).

Exported graphs are cached on disk, keyed by the backbone fingerprint (architecture, layer count,
width, tokenizer vocabulary hash, weights hash), the opset, the precision and the export format
version, so a second start loads them in seconds. int8 is ONNX Runtime's dynamic quantisation
(weights int8 per output channel, activations quantised per call) of the layer graphs' MatMuls; the
embeddings stay fp32 (a table lookup: nothing to gain).
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from server.backbone.architectures import BlockContext, MPNetAdapter, run_block
from server.backbone.sources import build_once, default_cache_dir, unwritable
from server.backbone.tokens import TokenBatch
from server.temp_folders import make_private_folder, remove_private_folder

log = logging.getLogger("tmod")

OPSET = 18
# Bump when what is exported changes (graph inputs/outputs, wrappers, quantisation recipe): old
# cache entries are then simply not found.
EXPORT_FORMAT = 1
PRECISIONS = ("fp32", "int8")
MASK_MIN = float(np.finfo(np.float32).min)


def cache_key(fingerprint, precision: str, opset: int = OPSET) -> str:
    fp = fingerprint.model_dump() if hasattr(fingerprint, "model_dump") else dict(fingerprint)
    fp.pop("name", None)  # a display name: the same weights under another name are the same graphs
    payload = {"fingerprint": fp, "precision": precision, "opset": opset, "format": EXPORT_FORMAT}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def graph_dir_name(backbone, precision: str, opset: int = OPSET) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", backbone.name or "backbone").strip("-")[:60] or "backbone"
    return f"{slug}-{precision}-opset{opset}-{cache_key(backbone.fingerprint, precision, opset)[:20]}"


def graph_files(num_layers: int) -> list[str]:
    return ["embeddings.onnx"] + [f"layer_{i:03d}.onnx" for i in range(num_layers)]


# ---- export ----------------------------------------------------------------------------------
class _Embeddings(torch.nn.Module):
    def __init__(self, adapter, token_types: bool):
        super().__init__()
        self.adapter, self.token_types = adapter, token_types
        self.embeddings = adapter.model.embeddings  # registered, so its weights are exported

    def forward(self, input_ids, token_type_ids=None):
        return self.adapter.embed(input_ids, token_type_ids if self.token_types else None)


class _Layer(torch.nn.Module):
    def __init__(self, block, position_bias: bool = False):
        super().__init__()
        self.block, self.position_bias = block, position_bias

    def forward(self, hidden, mask):
        return run_block(self.block, hidden, BlockContext(None, position_bias=mask) if self.position_bias else mask)


def takes_position_bias(adapter) -> bool:
    """MPNet's layer graphs take its relative position bias (with the padding mask folded in)."""
    return isinstance(adapter, MPNetAdapter)


def layer_input(adapter, hidden: torch.Tensor, attention_mask: torch.Tensor) -> np.ndarray:
    """What every layer graph takes besides the state, computed once per batch: the additive padding
    mask (B, 1, 1, T); for MPNet its relative position bias plus that mask (B, heads, T, T), from the
    torch model's bias table (a lookup: no graph needed)."""
    if takes_position_bias(adapter):
        with torch.inference_mode():
            return adapter.mask(hidden, attention_mask.cpu()).position_bias.numpy()
    return additive_mask(attention_mask.cpu().numpy())


# loggers the exporter writes to at info, per graph: torch.onnx ("torchvision is not installed" and
# similar), onnxscript's optimiser and onnx_ir's passes (~190 lines for MiniLM's seven graphs)
EXPORTER_LOGGERS = ("torch.onnx", "onnxscript", "onnx_ir")


@contextlib.contextmanager
def _exporter_quiet() -> Iterator[None]:
    """Only the exporter's errors reach the server's log while it runs."""
    loggers = [logging.getLogger(name) for name in EXPORTER_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")  # the exporter's own deprecation / naming chatter
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _export(module, args: tuple, path: Path, input_names, dynamic_shapes, opset: int) -> None:
    with _exporter_quiet():
        torch.onnx.export(
            module, args, str(path), input_names=list(input_names), output_names=["state"],
            dynamic_shapes=dynamic_shapes, opset_version=opset, dynamo=True, external_data=False,
            verbose=False, report=False,
        )


def export_fp32(backbone, out: Path, opset: int = OPSET) -> None:
    """Write embeddings.onnx and layer_NNN.onnx for `backbone` into `out` (torch.onnx, dynamo)."""
    from torch.export import Dim

    adapter = backbone.adapter
    if next(adapter.model.parameters()).device.type != "cpu":  # the graphs are exported from a CPU copy
        import copy

        from server.backbone.architectures import adapter_for

        adapter = adapter_for(copy.deepcopy(adapter.model).to("cpu"))
    # an example whose batch and sequence sizes differ from each other and from 0/1, so the
    # exporter keeps both symbolic
    example = backbone.tokenize(["tmod exports this backbone", "one graph per layer block, then stream them"])
    ids = example.input_ids.cpu()
    types = example.token_type_ids.cpu() if adapter.uses_token_types else None
    batch = Dim("batch", min=1, max=65536)
    seq = Dim("seq", min=1, max=max(backbone.max_tokens, ids.shape[1] + 1))
    with torch.no_grad():
        if types is not None:
            _export(_Embeddings(adapter, True).eval(), (ids, types), out / "embeddings.onnx",
                    ["input_ids", "token_type_ids"], {"input_ids": {0: batch, 1: seq}, "token_type_ids": {0: batch, 1: seq}},
                    opset)
        else:
            _export(_Embeddings(adapter, False).eval(), (ids,), out / "embeddings.onnx",
                    ["input_ids"], {"input_ids": {0: batch, 1: seq}}, opset)
        hidden = adapter.embed(ids, types)
        mask_t = torch.from_numpy(layer_input(adapter, hidden, example.attention_mask))
        bias = takes_position_bias(adapter)
        mask_dims = {0: batch, 2: seq, 3: seq} if bias else {0: batch, 3: seq}
        for index, block in enumerate(adapter.layers):
            _export(_Layer(block, bias).eval(), (hidden, mask_t), out / f"layer_{index:03d}.onnx", ["hidden", "mask"],
                    {"hidden": {0: batch, 1: seq}, "mask": mask_dims}, opset)


def quantize_int8(src: Path, out: Path, num_layers: int) -> None:
    """Dynamic int8 quantisation of every layer graph's MatMuls (weights per channel)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    shutil.copy2(src / "embeddings.onnx", out / "embeddings.onnx")
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantiser logs a "consider pre-processing" warning per graph
    try:
        for name in graph_files(num_layers)[1:]:
            quantize_dynamic(src / name, out / name, weight_type=QuantType.QInt8, per_channel=True,
                             op_types_to_quantize=["MatMul"])
    finally:
        root.setLevel(level)


def ensure_graphs(backbone, precision: str = "fp32", cache_dir: Path | str | None = None,
                  opset: int = OPSET) -> tuple[Path, bool, bool]:
    """The directory holding this backbone's graphs at `precision`, exporting them if no cache
    entry exists. Returns (directory, exported_now, temporary). An unwritable cache directory is not
    fatal: the graphs are exported to a temporary directory instead (and exported again next start),
    which the caller removes once it has read them."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not supported by the onnx backend; choose one of {PRECISIONS}")
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    root = root / "onnx"
    target = root / graph_dir_name(backbone, precision, opset)
    files = graph_files(backbone.num_layers)

    def complete(folder: Path) -> bool:
        return (folder / "meta.json").is_file() and all((folder / f).is_file() for f in files)

    def export(work: Path) -> None:
        t0 = time.perf_counter()
        if precision == "fp32":
            export_fp32(backbone, work, opset)
        else:  # derived from the fp32 graphs, themselves cached
            fp32_dir, *_ = ensure_graphs(backbone, "fp32", cache_dir if cached else work / "fp32", opset)
            quantize_int8(fp32_dir, work, backbone.num_layers)
        seconds = time.perf_counter() - t0
        meta = {
            "format": EXPORT_FORMAT, "opset": opset, "precision": precision, "files": files,
            "fingerprint": backbone.fingerprint.model_dump(), "key": cache_key(backbone.fingerprint, precision, opset),
            "exporter": "torch.onnx.export(dynamo=True)", "torch": torch.__version__,
            "onnxruntime": _ort_version(), "seconds": round(seconds, 2),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (work / "meta.json").write_text(json.dumps(meta, indent=2))  # written last: marks the entry complete
        log.info("backbone %s exported to onnx (%s, %d graphs) in %.1fs", backbone.name, precision, len(files), seconds)

    if complete(target):
        return target, False, False
    problem = unwritable(root)
    cached = problem is None
    if cached:
        return target, build_once(target, complete, export), False
    log.warning("onnx cache %s not writable (%s): exporting to a temporary directory", root, problem)
    work = make_private_folder("onnx")
    try:
        export(work)
    except BaseException:
        remove_private_folder(work)
        raise
    return work, True, True


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def additive_mask(attention_mask: np.ndarray) -> np.ndarray:
    """(B, T) 1/0 -> (B, 1, 1, T) float32: 0 where a key may be attended, float32 min where not."""
    return ((1.0 - attention_mask[:, None, None, :].astype(np.float32)) * MASK_MIN).astype(np.float32)


# ---- running ---------------------------------------------------------------------------------
def execution_providers(device: torch.device, precision: str) -> list:
    """ONNX Runtime providers for the backbone's device: the CPU provider on the CPU; on cuda:N the
    CUDA provider for GPU N (CPU as ONNX Runtime's fallback for any op without a CUDA kernel).
    Raises ValueError, in one sentence, when the device cannot be served."""
    import onnxruntime as ort

    if device.type == "cpu":
        return ["CPUExecutionProvider"]
    if device.type != "cuda":
        raise ValueError(f"backend onnx runs on cpu or cuda (device {device} asked)")
    if precision != "fp32":
        raise ValueError(f"backend onnx on a cuda device runs fp32 only ({precision} asked): int8 is a CPU recipe "
                         "and no fp16 graphs are exported; on a GPU use backend torch with precision fp16 or bf16")
    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        raise ValueError(f"device {device} with backend onnx needs ONNX Runtime's CUDAExecutionProvider, and "
                         f"onnxruntime {ort.__version__} offers only {available}: install onnxruntime-gpu in place "
                         "of onnxruntime, or use backend torch on the GPU")
    return [("CUDAExecutionProvider", {"device_id": device.index or 0}), "CPUExecutionProvider"]


class OnnxBackend:
    """Runs the cached per-layer graphs with ONNX Runtime (CPU execution provider, or CUDA's on a
    cuda backbone).

    `runs[i]` counts how many times graph i ran (0: embeddings, l: layer l), so early exit can be
    checked; `exported` says whether this load had to export (False: the cache was used).
    """

    name = "onnx"

    def __init__(self, backbone, precision: str = "fp32", cache_dir: Path | str | None = None,
                 threads: int | None = None, opset: int = OPSET):
        import onnxruntime as ort

        self.device = torch.device(backbone.device)
        providers = execution_providers(self.device, precision)
        self.precision = precision
        self.num_layers = backbone.num_layers
        self.uses_token_types = backbone.adapter.uses_token_types
        self.adapter = backbone.adapter  # MPNet: its position bias table feeds the layer graphs
        t0 = time.perf_counter()
        self.graph_dir, self.exported, temporary = ensure_graphs(backbone, precision, cache_dir, opset)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.inter_op_num_threads = 1
        options.intra_op_num_threads = threads or 0  # 0: ONNX Runtime's choice (one per physical core)
        options.log_severity_level = 3
        # the heads run in torch between two layer graphs: ORT's pool must not spin on the cores then
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.threads = threads
        try:
            self.sessions = [
                ort.InferenceSession(str(self.graph_dir / f), options, providers=providers)
                for f in graph_files(self.num_layers)
            ]
        finally:
            if temporary:  # no cache keeps it: the sessions hold the graphs (and a --tmpfs /tmp is memory)
                remove_private_folder(self.graph_dir)
                self.graph_dir = None
        self.providers = self.sessions[0].get_providers()
        if self.device.type == "cuda" and "CUDAExecutionProvider" not in self.providers:
            # ONNX Runtime falls back to the CPU silently when the CUDA provider fails to load
            raise ValueError(f"device {self.device} asked but ONNX Runtime could not start its CUDAExecutionProvider "
                             f"(sessions run on {self.providers}): check the CUDA / cuDNN libraries that "
                             "onnxruntime-gpu needs")
        self.load_seconds = time.perf_counter() - t0
        self.runs = [0] * (self.num_layers + 1)

    def stream(self, batch: TokenBatch, upto: int) -> Iterator[tuple[int, torch.Tensor]]:
        feed = {"input_ids": batch.input_ids.cpu().numpy()}
        if self.uses_token_types:
            types = batch.token_type_ids
            feed["token_type_ids"] = (types.cpu().numpy() if types is not None
                                      else np.zeros_like(feed["input_ids"]))
        hidden = self.sessions[0].run(None, feed)[0]
        self.runs[0] += 1
        mask = layer_input(self.adapter, torch.from_numpy(hidden), batch.attention_mask)
        yield 0, self._state(hidden)
        for index in range(upto):
            hidden = self.sessions[index + 1].run(None, {"hidden": hidden, "mask": mask})[0]
            self.runs[index + 1] += 1
            yield index + 1, self._state(hidden)

    def _state(self, hidden: np.ndarray) -> torch.Tensor:
        """A state for the heads, on the backbone's device. On cuda each state makes a round trip
        through host memory (ONNX Runtime copies inputs in and outputs out per graph); IO binding
        would keep it on the GPU."""
        state = torch.from_numpy(hidden)
        return state if self.device.type == "cpu" else state.to(self.device)

    def describe(self) -> dict:
        return {"backend": self.name, "precision": self.precision, "onnxruntime": _ort_version(),
                "device": str(self.device), "providers": self.providers,
                "intra_op_threads": self.threads or "default",
                "graph_dir": str(self.graph_dir or "none: exported for this process, the cache unwritable"),
                "exported_at_load": self.exported, "load_seconds": round(self.load_seconds, 2)}
