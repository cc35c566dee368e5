"""A module proves itself before it serves: one pass over a fixed probe input, whose outputs must
be finite and shaped as its manifest says. Weights that pass the store's checks (checksum, finite
values, shapes) can still compute NaN (an overflow, a zeroed norm) or a layer mix that reads no
layer; such a module is refused at load, never met by the batches of other tasks.

The probe runs the engine, so it lies above it: the module layer (server/modules.py) takes it as
`load_module(..., probe=probe_module)` from whoever loads with an engine at hand."""
from __future__ import annotations

import torch

from modules_store import ArtifactError, TaskType
from server.engine import Engine
from server.modules import token_classes_read

PROBE_TEXTS = ["The probe checks that Ada Lovelace's module answers in Paris.", "Fine."]
PROBE_PAIRS = ["A second text for pair tasks.", "Yes."]


def probe_module(module, backbone, bridges: dict | None = None) -> None:
    """Raise ArtifactError("probe_failed") unless `module` answers the probe input with finite
    outputs of its manifest's shape (on `backbone`, through its bridge if it is foreign)."""
    manifest = module.manifest
    where = f"{manifest.task}/{manifest.version}"
    if not module.head.layers_read():
        raise ArtifactError("probe_failed", f"{where}: the head reads no backbone state (its layer weights "
                            "are all zero or not finite)")
    pairs = PROBE_PAIRS if (manifest.config or {}).get("pooling") == "pair" else None
    rows = backbone.encode(PROBE_TEXTS, pairs, truncate=True)
    modules = {manifest.task: module}
    batch = backbone.text.collate(rows, device=backbone.device, classes=token_classes_read(modules))
    try:
        with torch.inference_mode():
            logits, batches = Engine(backbone, bridges=bridges).run(batch, modules)
    except Exception as exc:  # noqa: BLE001  (whatever the head raised, the artifact is what is refused)
        raise ArtifactError("probe_failed", f"{where}: the probe pass failed: {type(exc).__name__}: "
                            f"{str(exc)[:200]}") from exc
    out = logits[manifest.task]
    rows_out = batches[manifest.task].size
    expected = {
        TaskType.sequence_classification: (rows_out, len(manifest.labels)),
        TaskType.token_classification: (rows_out, batches[manifest.task].seq_len, len(manifest.labels)),
    }.get(manifest.task_type)
    shape_ok = tuple(out.shape) == expected if expected else out.shape[0] == rows_out and out[0].numel() >= 1
    if not shape_ok:
        raise ArtifactError("probe_failed", f"{where}: the probe pass gave outputs of shape {tuple(out.shape)}, "
                            f"not {expected or (rows_out, '...')} as its manifest says")
    if not bool(torch.isfinite(out.float()).all()):
        raise ArtifactError("probe_failed", f"{where}: the probe pass gave non-finite outputs (NaN or inf)")
