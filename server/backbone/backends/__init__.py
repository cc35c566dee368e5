"""Backbone backends: PyTorch eager (the reference) and ONNX Runtime (one graph per layer block).

`make_backend(backbone, "onnx", precision="int8")` builds one; `Backbone.use_backend(...)` returns
a backbone that streams through it. The onnx module is imported only when asked for.

Precision by backend (server/config.py's `precision_problem` says why a combination is refused):
torch runs fp32, bf16 (CPU with native bfloat16, or cuda) and fp16 (cuda); onnx runs fp32 (CPU, or
cuda through the CUDAExecutionProvider) and int8 (CPU). The device is the backbone's. "auto" is
fp16 for torch on cuda, bf16 for torch on a CPU with native bfloat16, fp32 otherwise
(server/config.py, `auto_precision`).
"""
from __future__ import annotations

from pathlib import Path

from server.backbone.backends.base import BackboneBackend
from server.backbone.backends.torch_backend import TorchBackend
from server.config import auto_precision, device_problem, precision_problem

BACKENDS = ("torch", "onnx")


def make_backend(backbone, name: str = "torch", precision: str = "fp32", cache_dir: Path | str | None = None,
                 threads: int | None = None) -> BackboneBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")
    device = str(backbone.device)
    if precision == "auto":
        precision = auto_precision(name, device)
    problem = precision_problem(name, precision, device) or device_problem(device)
    if problem:
        raise ValueError(problem)
    if name == "torch":
        return TorchBackend(backbone.adapter, precision=precision)
    from server.backbone.backends.onnx_backend import OnnxBackend

    return OnnxBackend(backbone, precision=precision, cache_dir=cache_dir, threads=threads)


__all__ = ["BACKENDS", "BackboneBackend", "TorchBackend", "make_backend"]
