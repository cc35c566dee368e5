"""Backbone backends: PyTorch eager (the reference) and ONNX Runtime (one graph per layer block).

`make_backend(backbone, "onnx", precision="int8")` builds one; `Backbone.use_backend(...)` returns
a backbone that streams through it. The onnx module is imported only when asked for.
"""
from __future__ import annotations

from pathlib import Path

from server.backbone.backends.base import BackboneBackend
from server.backbone.backends.torch_backend import TorchBackend

BACKENDS = ("torch", "onnx")


def make_backend(backbone, name: str = "torch", precision: str = "fp32", cache_dir: Path | str | None = None,
                 threads: int | None = None) -> BackboneBackend:
    if name == "torch":
        if precision != "fp32":
            raise ValueError(f"precision {precision!r} needs backend onnx (backend torch runs fp32)")
        return TorchBackend(backbone.adapter)
    if name == "onnx":
        from server.backbone.backends.onnx_backend import OnnxBackend

        return OnnxBackend(backbone, precision=precision, cache_dir=cache_dir, threads=threads)
    raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")


__all__ = ["BACKENDS", "BackboneBackend", "TorchBackend", "make_backend"]
