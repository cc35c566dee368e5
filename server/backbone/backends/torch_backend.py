"""PyTorch eager: the model's own modules, one layer call per state.

fp32 runs the backbone's layers as they are. bf16 (and fp16, on a GPU) runs a copy of the layers
whose `nn.Linear` weights are stored in that dtype, each layer call under `torch.autocast`: the
matrix products and the SDPA attention kernel run in 16 bits, while layer norms and the residual
stream stay float32 (autocast's fp32 list and type promotion), so every state is
float32 as with fp32 and the heads are unchanged. Storing the weights in 16 bits once, instead of
letting autocast cast the fp32 weights at every call, matters at batch 1 (one scratch measurement on
MiniLM, one thread: 1.47x fp32 instead of 1.32x; the same at batch 32, ~1.9x).
"""
from __future__ import annotations

import copy
import logging
from typing import Iterator

import torch
from torch import nn

from server.backbone.architectures import run_block
from server.backbone.tokens import TokenBatch
from server.config import cpu_has_native_bf16

log = logging.getLogger("tmod")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def low_precision_layers(layers, dtype: torch.dtype) -> nn.ModuleList:
    """A copy of `layers` whose nn.Linear weights and biases are `dtype`; everything else (layer
    norms, buffers) stays as it was. The backbone's own layers are left untouched (fp32)."""
    copies = []
    for layer in layers:
        clone = copy.deepcopy(layer)
        for module in clone.modules():
            if isinstance(module, nn.Linear):
                module.to(dtype)
        copies.append(clone.eval().requires_grad_(False))
    return nn.ModuleList(copies)


def check_low_precision(precision: str, device: torch.device) -> None:
    """Raise ValueError, in one sentence, when `precision` cannot run on `device` here."""
    if precision not in ("fp32", *DTYPES):
        raise ValueError(f"precision {precision!r} is not supported by backend torch; choose one of fp32, bf16, fp16")
    if precision == "fp16" and device.type != "cuda":
        raise ValueError(f"precision fp16 needs a cuda device (the backbone is on {device}): CPUs have no fast "
                         "float16 matrix products; on the CPU use precision bf16 (backend torch) or int8 (backend onnx)")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"precision bf16 asked on {device} ({torch.cuda.get_device_name(device)}), which has no "
                         "bfloat16 support; use precision fp16")
    if precision == "bf16" and device.type == "cpu" and not cpu_has_native_bf16():
        log.warning("precision bf16 on a CPU without native bfloat16 instructions (avx512_bf16 / AMX): "
                    "it runs, but emulated, and slower than fp32 (MiniLM with AVX-512 alone: 0.31x fp32's "
                    "rate at batch 32)")


class TorchBackend:
    name = "torch"

    def __init__(self, adapter, precision: str = "fp32"):
        self.adapter = adapter
        self.precision = precision
        parameter = next(adapter.model.parameters(), None)
        self.device = parameter.device if parameter is not None else torch.device("cpu")
        check_low_precision(precision, self.device)
        self.dtype = DTYPES.get(precision)
        # fp32: the backbone's own layers; bf16 / fp16: a copy with 16-bit Linear weights
        self.layers = adapter.layers if self.dtype is None else low_precision_layers(adapter.layers, self.dtype)

    @torch.inference_mode()
    def stream(self, batch: TokenBatch, upto: int) -> Iterator[tuple[int, torch.Tensor]]:
        """Only the state being handed out (and the next one while it is computed) is alive: the
        generator keeps no list, so each state is freed as soon as the consumer drops it."""
        hidden = self.adapter.embed(batch.input_ids, batch.token_type_ids)
        mask = self.adapter.mask(hidden, batch.attention_mask)
        yield 0, hidden
        for index in range(upto):
            if self.dtype is None:
                hidden = self.adapter.run_layer(index, hidden, mask)
            else:
                # autocast only around the layer call, never across a yield: the heads that run
                # between two layers must not run under it
                # no autocast cache: a captured pass must not keep casts made at capture time
                with torch.autocast(self.device.type, dtype=self.dtype, cache_enabled=False):
                    hidden = run_block(self.layers[index], hidden, mask)
                hidden = hidden.float()  # already float32 in the encoders (fp32 residual); a no-op then
            yield index + 1, hidden

    def describe(self) -> dict:
        out = {"backend": self.name, "precision": self.precision, "device": str(self.device),
               "torch_threads": torch.get_num_threads()}
        if self.dtype is not None:
            out["compute"] = (f"nn.Linear weights stored as {self.dtype}, layer calls under torch.autocast; "
                              "layer norms and residual stream float32")
            if self.device.type == "cpu":
                out["cpu_native_bf16"] = cpu_has_native_bf16()
        return out
