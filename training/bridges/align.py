"""Alignment transfer (Klimaszewski et al.): serve modules of backbone B on backbone A, no training.

On paired states (the same texts through both backbones, rows aligned by characters: see
`training.bridges.pairing`), the Pearson correlation C (H_s x H_t) between every source dimension and
every target dimension is measured, and `scipy.optimize.linear_sum_assignment(-C)` matches
min(H_s, H_t) pairs of dimensions one to one, maximising the summed correlation. The bridge
(`server.bridges.alignment.AlignmentBridge`) then feeds each target dimension from its matched
source dimension.

Layers: the deeper backbone's layers are split into consecutive groups, one per layer of the
shallower one (state 0, the embeddings, maps to state 0). A deeper source feeds target state j
from its group's last state (SKIP) or the mean of the group's states (AVG); a shallower source
feeds target state j from source state round(j * L_s / L_t) (SKIP and AVG coincide).

    tmod-train align --source minilm --target smollm2 --target-layers 0,5,10,15,20,25,30 \\
        --mapping avg --dataset sst2 --max-texts 2000
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from server.bridges.alignment import AlignmentBridge, AlignmentConfig
from training.data.examples import hold_out, seeded_subset
from training.data.files import UsageError, read_text_lines
from training.bridges.pairing import PairedStates
from training.progress import progress_of
from training.serving import bridge_serving
from training.settings import check_layers, parse_layers

MAPPINGS = ("skip", "avg")


# ---- layers -----------------------------------------------------------------------------------
def _round(x: float) -> int:
    return int(math.floor(x + 0.5))  # half up, not Python's half-to-even


def layer_groups(source_layers: int, target_layers: int, target_states: Sequence[int],
                 mapping: str = "skip") -> dict[int, list[int]]:
    """{target state j: the source states that feed it} for backbones of `source_layers` and
    `target_layers` layers (states 0..L)."""
    if mapping not in MAPPINGS:
        raise UsageError(f"mapping must be one of {MAPPINGS}, not {mapping!r}")
    l_s, l_t = source_layers, target_layers
    out = {}
    for j in sorted(set(target_states)):
        if not 0 <= j <= l_t:
            raise UsageError(f"target state {j} outside 0..{l_t}")
        if j == 0:
            out[j] = [0]
        elif l_s > l_t:  # deeper source: group j is (b_{j-1}, b_j]
            lo, hi = _round((j - 1) * l_s / l_t), _round(j * l_s / l_t)
            out[j] = [hi] if mapping == "skip" else list(range(lo + 1, hi + 1))
        else:
            out[j] = [_round(j * l_s / l_t)]
    return out


# ---- correlation and matching ------------------------------------------------------------------
def correlation(x: torch.Tensor, y: torch.Tensor, chunk: int = 65536) -> np.ndarray:
    """Pearson correlation (H_s, H_t) between every column of x (N, H_s) and of y (N, H_t),
    accumulated in float64 over row chunks. Constant columns correlate 0 with everything."""
    if x.shape[0] != y.shape[0] or x.shape[0] < 2:
        raise ValueError(f"need the same number (>= 2) of rows, got {x.shape[0]} and {y.shape[0]}")
    n = x.shape[0]
    mx, my = x.double().mean(0), y.double().mean(0)
    cross = torch.zeros(x.shape[1], y.shape[1], dtype=torch.float64)
    vx = torch.zeros(x.shape[1], dtype=torch.float64)
    vy = torch.zeros(y.shape[1], dtype=torch.float64)
    for s in range(0, n, chunk):
        xc, yc = x[s:s + chunk].double() - mx, y[s:s + chunk].double() - my
        cross += xc.T @ yc
        vx += (xc * xc).sum(0)
        vy += (yc * yc).sum(0)
    denom = torch.sqrt(vx)[:, None] * torch.sqrt(vy)[None, :]
    c = torch.where(denom > 0, cross / denom.clamp(min=1e-300), torch.zeros_like(cross))
    return c.numpy()


def match(c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source dims, target dims) of the one-to-one matching maximising the summed correlation."""
    from scipy.optimize import linear_sum_assignment

    return linear_sum_assignment(-c)


def matched_correlation(x: torch.Tensor, y: torch.Tensor) -> float:
    c = correlation(x, y)
    rows, cols = match(c)
    return float(c[rows, cols].mean())


# ---- fitting ------------------------------------------------------------------------------------
def null_matched_correlation(x: torch.Tensor, y: torch.Tensor, seed: int = 0) -> float:
    """The mean matched correlation with the pairing broken (target rows shuffled): what the
    matching finds in noise alone with this many rows and dimensions, the floor to read the real
    number against."""
    order = torch.randperm(y.shape[0], generator=torch.Generator().manual_seed(seed))
    return matched_correlation(x, y[order])


def align(paired: PairedStates, mapping: str = "skip", standardize: bool = False,
          target_states: Sequence[int] | None = None, pool: str = "token",
          progress: bool = False, null: bool = True,
          held_out: PairedStates | None = None) -> tuple[AlignmentBridge, dict]:
    """Fit an AlignmentBridge on `paired` (source = the backbone it will serve on). Returns the
    bridge and its diagnostics: per target state, the source states used, the mean / median
    correlation of the matched dimensions, the number of aligned rows, and (`null`) the same
    mean with the pairs shuffled (the noise floor). With `held_out` (texts not in `paired`): the
    matched dimensions' mean correlation there, and with those pairs shuffled: the matching
    chose its dimensions on `paired`, so only these numbers are not optimistic."""
    targets = sorted(set(target_states if target_states is not None else paired.target_layers))
    groups = layer_groups(paired.source_fingerprint.num_layers, paired.target_fingerprint.num_layers, targets, mapping)
    needed = sorted({i for g in groups.values() for i in g})
    missing = sorted(set(needed) - set(paired.source_layers)) + [f"target {j}" for j in targets
                                                                   if j not in paired.target_layers]
    if missing:
        raise ValueError(f"states {missing} are not in the paired states (source {paired.source_layers}, "
                         f"target {paired.target_layers})")
    config = AlignmentConfig(mapping=mapping, standardize=standardize, pool=pool, groups=groups,
                             source_hidden_size=paired.source_hidden, target_hidden_size=paired.target_hidden)
    bridge = AlignmentBridge(config)
    per_state = {}
    for j in progress_of(targets, bars=progress, desc="aligning target states"):
        x, y = paired.token_pairs(groups[j], j, pool=pool)
        c = correlation(x, y)
        rows, cols = match(c)
        index = torch.zeros(paired.target_hidden, dtype=torch.long)
        scale = torch.zeros(paired.target_hidden)
        shift = y.double().mean(0).float()  # unmatched target dims: their mean on the pairs
        index[torch.as_tensor(cols)] = torch.as_tensor(rows, dtype=torch.long)
        if standardize:
            mu_s, sd_s = x.double().mean(0), x.double().std(0)
            mu_t, sd_t = y.double().mean(0), y.double().std(0)
            src = torch.as_tensor(rows, dtype=torch.long)
            tgt = torch.as_tensor(cols, dtype=torch.long)
            ratio = torch.where(sd_s[src] > 0, sd_t[tgt] / sd_s[src].clamp(min=1e-12), torch.zeros_like(sd_s[src]))
            scale[tgt] = ratio.float()
            shift[tgt] = (mu_t[tgt] - mu_s[src] * ratio).float()
        else:
            scale[torch.as_tensor(cols)] = 1.0
            shift[torch.as_tensor(cols)] = 0.0
        bridge.set_alignment(j, index, scale, shift)
        matched = c[rows, cols]
        per_state[j] = {"source_states": groups[j], "rows": int(x.shape[0]), "matched": int(len(rows)),
                        "mean_matched_correlation": float(matched.mean()),
                        "median_matched_correlation": float(np.median(matched)),
                        "mean_max_correlation": float(np.abs(c).max(axis=0).mean())}
        if null:
            per_state[j]["null_matched_correlation"] = null_matched_correlation(x, y)
        if held_out is not None:
            hx, hy = held_out.token_pairs(groups[j], j, pool=pool)
            shuffled = torch.randperm(hy.shape[0], generator=torch.Generator().manual_seed(0))
            per_state[j]["held_out"] = {"rows": int(hx.shape[0]),
                                        "mean_matched_correlation": float(correlation(hx, hy)[rows, cols].mean()),
                                        "pairs_shuffled": float(correlation(hx, hy[shuffled])[rows, cols].mean())}
    diagnostics = {"mapping": mapping, "standardize": standardize, "pool": pool, "per_state": per_state,
                   "mean_matched_correlation": float(np.mean([v["mean_matched_correlation"]
                                                             for v in per_state.values()]))}
    if held_out is not None:
        diagnostics["held_out_mean_matched_correlation"] = float(np.mean(
            [v["held_out"]["mean_matched_correlation"] for v in per_state.values()]))
    return bridge.eval(), diagnostics


def correlation_grid(paired: PairedStates, source_states: Sequence[int] | None = None,
                     target_states: Sequence[int] | None = None, pool: str = "token",
                     progress: bool = False) -> dict:
    """Mean matched correlation of every (source state, target state) pair: which source layer
    looks most like which target layer after the best matching of dimensions."""
    sources = list(source_states if source_states is not None else paired.source_layers)
    targets = list(target_states if target_states is not None else paired.target_layers)
    ys = {j: paired.token_pairs(sources[0], j, pool)[1] for j in targets}
    grid = np.zeros((len(sources), len(targets)))
    with progress_of(total=len(sources) * len(targets), bars=progress, desc="layer x layer correlation") as bar:
        for a, i in enumerate(sources):
            x, _ = paired.token_pairs(i, targets[0], pool)
            for b, j in enumerate(targets):
                grid[a, b] = matched_correlation(x, ys[j])
                bar.update(1)
    return {"source_states": sources, "target_states": targets, "mean_matched_correlation": grid.tolist()}


# ---- the report -------------------------------------------------------------------------------
def plot_alignment(diagnostics: dict, grid: dict | None, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from training.report import state_name

    per_state = diagnostics["per_state"]
    targets = sorted(int(j) for j in per_state)
    fig, axes = plt.subplots(1, 2 if grid else 1, figsize=(13 if grid else 6.5, 4.2), squeeze=False)
    ax = axes[0][0]
    values = [per_state[j]["mean_matched_correlation"] for j in targets]
    held = all("held_out" in per_state[j] for j in targets)
    width = 0.4 if held else 0.8
    bars = ax.bar(np.arange(len(targets)) - width / 2 * held, values, width, color="#4c72b0",
                  label="fit texts (chose the matching)" if held else None)
    if held:
        ax.bar(np.arange(len(targets)) + width / 2, [per_state[j]["held_out"]["mean_matched_correlation"]
                                                     for j in targets], width, color="#dd8452",
               label="held-out texts")
    ax.set_xticks(range(len(targets)))
    ax.set_xticklabels([state_name(j) for j in targets])
    for bar, v, j in zip(bars, values, targets):
        label = f"{v:.2f}\n<-" + ",".join(state_name(i) for i in per_state[j]["source_states"][:1])
        if len(per_state[j]["source_states"]) > 1:
            label += f"..{state_name(per_state[j]['source_states'][-1])}"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=7)
    if all("null_matched_correlation" in per_state[j] for j in targets):
        ax.plot(np.arange(len(targets)) - width / 2 * held, [per_state[j]["null_matched_correlation"] for j in targets],
                "k_", markersize=18 - 8 * held, label="pairs shuffled (noise floor)")
    if held or any("null_matched_correlation" in per_state[j] for j in targets):
        ax.legend(fontsize=7, loc="upper right")
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("target state")
    ax.set_ylabel("mean matched correlation")
    ax.set_title(f"mapping {diagnostics['mapping']}")
    if grid:
        ax = axes[0][1]
        g = np.array(grid["mean_matched_correlation"])
        im = ax.imshow(g, aspect="auto", cmap="viridis", vmin=0, vmax=max(1e-6, float(g.max())), origin="lower")
        ax.set_yticks(range(len(grid["source_states"])))
        ax.set_yticklabels([state_name(i) for i in grid["source_states"]], fontsize=6)
        ax.set_xticks(range(len(grid["target_states"])))
        ax.set_xticklabels([state_name(j) for j in grid["target_states"]], fontsize=7)
        ax.set_xlabel("target state")
        ax.set_ylabel("source state")
        ax.set_title("mean matched correlation, every pair of states")
        for b, j in enumerate(grid["target_states"]):
            for i in per_state.get(j, {}).get("source_states", []):
                if i in grid["source_states"]:
                    a = grid["source_states"].index(i)
                    ax.add_patch(plt.Rectangle((b - 0.5, a - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1))
        fig.colorbar(im, ax=ax)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the command --------------------------------------------------------------------------------
def load_texts(args, split: str = "train", limit: int | None = None, besides: Sequence[str] = ()) -> list[str]:
    """`split` texts of the presets (comma-separated), each once and none of `besides`, a seeded
    subset of `limit` (0 or None: all), order kept; pair tasks give both texts of each example."""
    from training.data.presets import PRESETS, preset_spec

    texts: list[str] = []
    for name in [d.strip() for d in args.dataset.split(",") if d.strip()]:
        if name not in PRESETS:
            raise UsageError(f"unknown dataset {name!r}; presets: {sorted(PRESETS)}")
        data = preset_spec(PRESETS[name], split, args.data_dir).read()
        texts += data.texts()
        if data.has_pairs:
            texts += [t for t in data.text_pairs() if t]
    seen, unique = set(besides), []
    for t in texts:
        if t and t not in seen:
            seen.add(t)
            unique.append(t)
    return seeded_subset(unique, limit, args.seed)


def findings(diagnostics: dict, texts: int, held_out: int, held_from: str = "the validation split") -> list[str]:
    """The correlations in words: where the matching was chosen (optimistic) and where it was not,
    each beside the same rows with their pairs shuffled."""
    states = diagnostics["per_state"].values()
    lines = [f"fit on {texts} texts: the matched dimensions' mean correlation {diagnostics['mean_matched_correlation']:.4f}"
             + (f" (pairs shuffled, matched the same way: {np.mean([v['null_matched_correlation'] for v in states]):.4f})"
                if all("null_matched_correlation" in v for v in states) else "")
             + "; the matching chose its dimensions on these texts, so this is optimistic"]
    if "held_out_mean_matched_correlation" in diagnostics:
        lines.append(f"held out: {held_out} texts, {held_from}, never used to fit: "
                     f"{diagnostics['held_out_mean_matched_correlation']:.4f} "
                     f"(pairs shuffled: {np.mean([v['held_out']['pairs_shuffled'] for v in states]):.4f})")
    return lines


def cmd_align(args, command: str) -> int:
    from modules_store import DEFAULT_STORE
    from server.backbone import Backbone
    from server.bridges import bridge_store, save_bridge
    from training.runs import (RunOutputs, check_cache_dir, save_as_free_version, say_if_bridge_outranked,
                               stored_name)
    from training.settings import pick_device, set_threads

    set_threads(args.threads)
    device = str(pick_device(args.device))
    t0 = time.perf_counter()
    if args.texts:  # the user's own (the domain served): a seeded tenth held out
        texts, held_out_texts = hold_out(read_text_lines(args.texts), 0.1, args.max_validation, args.seed)
        texts = seeded_subset(texts, args.max_texts, args.seed)
        file_name = Path(args.texts).name
        fitted_on, held_from = f"{file_name} (less a held-out tenth)", f"a held-out tenth of {file_name}"
    else:
        texts = load_texts(args, "train", args.max_texts)
        held_out_texts = load_texts(args, "validation", args.max_validation, besides=texts)
        fitted_on, held_from = f"{args.dataset}'s training split", "the validation split"
    source = Backbone.load(args.source, device=device)
    target = Backbone.load(args.target, device=device)
    targets = parse_layers(args.target_layers, "--target-layers") or list(range(target.num_layers + 1))
    check_layers(targets, target, "--target-layers")
    groups = layer_groups(source.num_layers, target.num_layers, targets, args.mapping)
    needed = sorted({i for g in groups.values() for i in g})
    source_states = list(range(source.num_layers + 1)) if args.heatmap else needed

    name = stored_name(args.name, f"align-{_slug(source.name)}-to-{_slug(target.name)}", "--name", "bridge")
    store = bridge_store(Path(args.store) if args.store else Path(DEFAULT_STORE) / "_bridges")
    numbered = args.version is None
    version = store.next_version(name) if numbered else args.version
    outputs = RunOutputs.checked(f"{name}-{version}", None, store,
                                 args.report_dir, name, version, args.overwrite, what="bridge ",
                                 fix="give --store and --report-dir in a folder you can write")
    check_cache_dir(args.cache_dir)

    t_load = time.perf_counter()
    build = dict(source_layers=source_states, target_layers=targets, batch_size=args.batch_size,
                 cache_dir=Path(args.cache_dir) if args.cache_dir else None, progress=args.progress)
    paired = PairedStates.build(texts, source, target, **build)
    held_out = PairedStates.build(held_out_texts, source, target, **build) if held_out_texts else None
    t_states = time.perf_counter()
    bridge, diagnostics = align(paired, args.mapping, args.standardize, targets, args.pool, progress=args.progress,
                                held_out=held_out)
    t_fit = time.perf_counter()
    grid = correlation_grid(paired, pool=args.pool, progress=args.progress) if args.heatmap else None
    t_grid = time.perf_counter()
    pool = paired.pooling(args.pool)
    training = {"command": command, "method": "alignment (Pearson correlation + linear_sum_assignment)",
                "datasets": None if args.texts else args.dataset,
                "texts_file": str(Path(args.texts).resolve()) if args.texts else None,
                "texts": len(texts), "held_out_texts": len(held_out_texts),
                "aligned_rows": pool.rows,
                "source_tokens": paired.source_cache.total, "target_tokens": paired.target_cache.total,
                "source": source.name, "target": target.name, "mapping": args.mapping,
                "standardize": args.standardize, "pool": args.pool, "seed": args.seed,
                "timing": {"load_seconds": t_load - t0, "states_seconds": t_states - t_load,
                           "fit_seconds": t_fit - t_states, "grid_seconds": t_grid - t_fit},
                "paired_cache": str(paired.path) if paired.path else None}
    metrics = {"mean_matched_correlation": diagnostics["mean_matched_correlation"],
               **({"held_out_mean_matched_correlation": diagnostics["held_out_mean_matched_correlation"]}
                  if held_out else {}),
               "per_state": {str(j): v for j, v in diagnostics["per_state"].items()}}
    outputs = outputs.claimed()
    report_dir = outputs.report_dir
    artifact, version = save_as_free_version(
        lambda v: save_bridge(store, name, v, bridge, source, target, training=training, metrics=metrics,
                              description=args.description or f"alignment bridge: {target.name} modules served on "
                                                              f"{source.name}", overwrite=args.overwrite and not numbered),
        store, name, version, numbered, outputs)
    say_if_bridge_outranked(store, name, version)
    report_dir.mkdir(parents=True, exist_ok=True)
    said = findings(diagnostics, len(texts), len(held_out_texts), held_from)
    summary = {"name": name, "version": version, "artifact": str(artifact), **training, "metrics": metrics,
               "layer_grid": grid}
    (report_dir / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_alignment(diagnostics, grid, report_dir / "correlation.png",
                   f"alignment: {target.name} states from {source.name} ({len(texts)} texts, {pool.rows} rows)")
    (report_dir / "report.md").write_text("\n".join(
        [f"# alignment bridge {name}/{version}", "",
         f"{target.name} modules served on {source.name}: each target dimension fed by its matched source dimension "
         f"({args.mapping} mapping{', standardized' if args.standardize else ''}), fitted on {len(texts)} texts of "
         f"{fitted_on} ({pool.rows} rows).", ""]
        + [f"- {line}" for line in said]
        + ["- per target state (bars; the black marks: pairs shuffled)"
           + (" and every source x target pair of states" if grid else "") + ": correlation.png", "",
           bridge_serving(args.source, store.root, target.name), ""]))
    for line in said:
        print(line, file=sys.stderr)
    print(json.dumps({"name": name, "version": version, "artifact": str(artifact), "report": str(report_dir),
                      "mean_matched_correlation": {
                          str(j): {"fit": round(v["mean_matched_correlation"], 4),
                                   **({"held_out": round(v["held_out"]["mean_matched_correlation"], 4)}
                                      if "held_out" in v else {})}
                          for j, v in diagnostics["per_state"].items()}}, indent=2))
    return 0


def _slug(name: str) -> str:
    import re

    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:24] or "backbone"
