"""`tmod-train embedding`: write a backbone's embedding module (nothing to train: its pooling and
normalisation come from the backbone's sentence-transformers configuration) and check it.

    tmod-train embedding --backbone minilm --version 1 --store modules_store
    tmod-train embedding --backbone mpnet --version mpnet-1 --store modules_store

The check embeds SST-2 validation sentences through the served path (the module's head in an
`Engine` pass) and, where the `sentence-transformers` package is installed, compares them with
`SentenceTransformer(<the same folder>).encode`: cosine, largest difference, and whether each
sentence's nearest neighbour is the same. Those figures go into the manifest's metrics.
`embed` is how any script reads embeddings in process: through the head.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from modules_store import DEFAULT_STORE, ModuleStore, TaskType
from server.backbone import Backbone
from server.backbone.sources import resolve_backbone
from server.engine import Engine
from server.heads.embedding import EmbeddingHead
from server.modules import LoadedModule, load_module, save_module
from server.probe import probe_module
from training import serving
from training.runs import check_outputs, save_as_free_version, stored_name
from training.settings import set_threads


def embed(engine: Engine, module: LoadedModule, texts: list[str], batch_size: int = 64,
          truncate: bool = True) -> np.ndarray:
    """(N, D) float32 vectors of `texts` through the module's head, as the server computes them
    (rows sorted by length into batches, like the batcher; answers in input order)."""
    limit = module.head.config.max_tokens
    rows = engine.backbone.encode(texts, None, truncate, limit)
    order = sorted(range(len(rows)), key=lambda r: len(rows[r]))
    out = np.zeros((len(texts), module.head.config.dimensions), dtype=np.float32)
    for start in range(0, len(order), batch_size):
        chosen = order[start:start + batch_size]
        batch = engine.backbone.collate([rows[r] for r in chosen])
        logits = engine.logits(batch, {module.task: module})[module.task]
        out[chosen] = logits[:, :-1].float().cpu().numpy()
    return out


def nearest_neighbours(vectors: np.ndarray) -> np.ndarray:
    """Each row's most cosine-similar other row."""
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True).clip(min=1e-12)
    similarity = unit @ unit.T
    np.fill_diagonal(similarity, -np.inf)
    return similarity.argmax(axis=1)


def compare(ours: np.ndarray, reference: np.ndarray) -> dict:
    """Agreement of two sets of vectors of the same texts."""
    cosine = (ours * reference).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1))
    same = nearest_neighbours(ours) == nearest_neighbours(reference)
    return {"texts": len(ours), "min_cosine": float(cosine.min()), "max_abs_diff": float(np.abs(ours - reference).max()),
            "nearest_neighbour_agreement": float(same.mean())}


def reference_vectors(folder: Path, texts: list[str], normalize: bool, batch_size: int = 64) -> np.ndarray:
    """sentence-transformers' own vectors (the reference the equality tests and benches use)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    return model.encode(texts, batch_size=batch_size, normalize_embeddings=normalize, convert_to_numpy=True)


def cmd_embedding(args: argparse.Namespace, command: str) -> int:
    set_threads(args.threads)
    store = ModuleStore(args.store or DEFAULT_STORE)
    task = stored_name(args.task, "embedding", "--task", "task", served=True)
    numbered = args.version is None
    version = store.next_version(task) if numbered else args.version
    check_outputs(store, task, version, args.overwrite, (store.root,), fix="give --store in a folder you can write",
                  task_type=TaskType.embedding)
    folder, name = resolve_backbone(args.backbone)
    backbone = Backbone.load(args.backbone)
    head = EmbeddingHead.from_backbone(backbone, folder, name)
    metrics = {}
    if args.check:
        from training.data.presets import PRESETS, preset_spec

        texts = preset_spec(PRESETS["sst2"], "validation", args.data_dir).read().texts()[:args.check]
        module = LoadedModule(task, version, None, head.eval())
        ours = embed(Engine(backbone), module, texts)
        try:
            import sentence_transformers
        except ImportError:
            print("sentence-transformers is not installed: no reference check", file=sys.stderr)
        else:
            reference = reference_vectors(folder, texts, head.config.normalize)
            metrics = {"reference_check": {"data": "sst2 validation sentences", "reference":
                                           f"sentence-transformers {sentence_transformers.__version__} encode",
                                           **compare(ours, reference)}}
    path, version = save_as_free_version(
        lambda v: save_module(store, task, v, head, backbone, overwrite=args.overwrite and not numbered,
                              metrics=metrics, training={"command": command, "trained": False,
                                                         "settings_from": head.config.settings_from},
                              description=f"{name}'s own sentence embedding ({'+'.join(head.config.pooling)} pooling"
                                          f"{', normalised' if head.config.normalize else ''}), computed in the shared pass"),
        store, task, version, numbered)
    loaded = load_module(store, task, version, backbone, probe=probe_module)  # what was written loads and checks
    serving.say_which_version_serves(store, task, version, backbone)
    print(json.dumps({"artifact": str(path), "config": loaded.manifest.config, "metrics": metrics,
                      "serve": serving.serve_command(store, args.backbone),
                      "query": serving.embeddings_request("http://127.0.0.1:8080", task, "tmod embeds this sentence")},
                     indent=2))
    return 0
