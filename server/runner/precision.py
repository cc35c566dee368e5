"""The precision heads run in: the setting's meaning, and the autocast context of a pass."""
from __future__ import annotations

import contextlib

import torch

from server.backbone.backends.torch_backend import DTYPES  # the 16-bit precisions and their torch dtypes
from server.config import Settings, cpu_flags

# 16-bit head precisions that passed the accuracy rule (>= 99% labels equal to fp32, metric change
# < 0.3 points) on every shipped module of both tiers (bench/README.md names the command):
# bench/results/head-precision-cpu.json and head-precision-cpu-mpnet.json (fp16 computed on the CPU)
HEAD_PRECISIONS_WITHIN_RULE = ("bf16", "fp16")


def head_precision(settings: Settings) -> str:
    """What `head_precision` means here: auto -> the backbone's 16-bit precision where it passed the
    accuracy rule (on a CPU that is bf16, which `precision` auto picks where bfloat16 is native;
    on cuda fp16, `precision` auto's pick there), fp32 otherwise. On the CPU, bf16 heads run 16
    grouped heads in 0.4x fp32 heads' time (bench/results/sharing-cpu-bf16.md)."""
    if settings.head_precision != "auto":
        return settings.head_precision
    if settings.precision in HEAD_PRECISIONS_WITHIN_RULE:
        return settings.precision
    return "fp32"


def int8_heads_warning(settings: Settings) -> str | None:
    """Why int8 heads (asked by name: auto never picks them) are likely slower than fp32 heads here, or
    None. torch's int8 product (`torch._int_mm`) was measured fast only on a CPU with AVX-512 VNNI
    (8x fp32's rate, docs/gpu.md); on a 2-core AVX2 AMD EPYC without it (2026-12-01) the projection's
    product took 36x fp32's time, and 4 heads at batch 32 served 0.36x the backbone alone against
    0.85x with fp32 heads (bench/results/sharing-cpu-avx2-int8-heads-2026-12-01.md)."""
    flags = cpu_flags()
    if head_precision(settings) != "int8" or flags is None or "avx512_vnni" in flags:
        return None
    return ("head_precision int8 on a CPU without AVX-512 VNNI (avx512_vnni): torch's int8 product is far slower "
            "there (on an AVX2 CPU, 4 heads at batch 32 served 0.36x the backbone alone's rate, against 0.85x "
            "with fp32 heads); use head_precision fp32 (or auto)")


def heads_autocast(precision: str, device_type: str, backbone_precision: str = "fp32") -> contextlib.AbstractContextManager:
    """The context a pass runs in for heads of `precision`: autocast to that 16-bit dtype, or nothing
    for fp32. int8 heads compute their projections in int8 whatever the context (the engine's
    `int8`) and the rest in the backbone's precision: beside a bf16 backbone, 16 heads' classifiers
    in bf16 left 0.74x the backbone's throughput, in fp32 0.67x (scratch measurement, one thread).
    The autocast cache is off: a captured pass must not keep casts made at capture time."""
    if precision == "int8":
        precision = backbone_precision if backbone_precision in DTYPES else "fp32"
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=DTYPES[precision], cache_enabled=False)
