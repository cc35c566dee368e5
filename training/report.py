"""A run's report: metrics JSON, report.md and PNG plots (loss/metric curves; a layer-mix head's learned layer
distribution)."""
from __future__ import annotations

import json
import textwrap
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
# a label the font lacks a glyph for (an emoji) is drawn as a box: not worth a warning per glyph
warnings.filterwarnings("ignore", message=r"Glyph \d+ .* missing from font", category=UserWarning)
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from training.metrics import LEVEL, interval_text, optimistic, rows_seen  # noqa: E402


def state_name(index: int) -> str:
    return "emb" if index == 0 else f"L{index}"


def learns_its_layer_mix(result) -> bool:
    """A layer-mix head learns how much of each state it reads; an MTB or LoRA-MTB head reads one
    fixed state (its copied blocks' input), so it has no distribution to plot."""
    return result.training.get("settings", {}).get("kind", "layermix") == "layermix"


def write_report(report_dir: Path, result) -> dict[str, Path]:
    """Write metrics.json, report.md, curves.png and, for a layer-mix head, layer_weights.png; return their paths."""
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    paths = {"metrics": report_dir / "metrics.json", "curves": report_dir / "curves.png"}
    metrics = {k: v for k, v in result.metrics.items() if k not in ("test", "baselines")}
    summary = {
        "task": result.task,
        "version": result.version,
        "artifact": str(result.artifact),
        "validation": metrics,
        **({"test": result.metrics["test"]} if "test" in result.metrics else {}),
        "baselines": result.metrics.get("baselines"),
        "request": result.request,
        "layer_weights": {str(k): v for k, v in result.layer_weights.items()},
        "history": result.history,
        **{k: result.training[k] for k in ("command", "best_epoch", "epochs_run", "parameters", "timing", "data")
           if k in result.training},
    }
    if getattr(result, "decoding", None):
        summary["decoding"] = result.decoding
    paths["metrics"].write_text(json.dumps(summary, indent=2) + "\n")
    if "per_label" in result.metrics:  # multi-label: the per-label table and plot
        thresholds = (getattr(result, "decoding", None) or {}).get("thresholds", {})
        paths["per_label"] = report_dir / "per_label.md"
        paths["per_label_plot"] = report_dir / "per_label_f1.png"
        paths["per_label"].write_text(per_label_table(result.metrics, thresholds))
        plot_per_label(result.metrics["per_label"], thresholds, paths["per_label_plot"],
                       f"{result.task}: validation F1 per label (macro {result.metrics['f1_macro']:.3f})")
    if result.assessment.get("confusion"):
        paths["confusion"] = report_dir / "confusion.png"
        plot_confusion(result.assessment["confusion"], paths["confusion"],
                       f"{result.task}: confusion on the {result.assessment['split']} split")
    paths["report"] = report_dir / "report.md"
    paths["report"].write_text(report_text(result))
    if learns_its_layer_mix(result):
        paths["layer_weights"] = report_dir / "layer_weights.png"
        plot_layer_weights(result.layer_weights, paths["layer_weights"], f"{result.task}: learned layer distribution")
    plot_curves(result.history, sorted(result.layer_weights), result.metrics.get("metric", ""), paths["curves"],
                result.task, result.training.get("best_epoch"), validation_baselines(result.metrics))
    return paths


def validation_baselines(metrics: dict) -> dict | None:
    """The baselines scored on the validation rows: the verdict's where no test split was given, else
    their own (`metrics.validation_baselines`)."""
    baselines = metrics.get("baselines") or {}
    return metrics.get("validation_baselines") or (baselines if baselines.get("split") == "validation" else None)


def scored_baselines(baselines: dict | None, metric: str) -> list[dict]:
    """The baseline runs of a `metrics.baselines` entry that have a `metric` score (not those that could
    not be trained)."""
    return [run for run in (baselines or {}).values()
            if isinstance(run, dict) and isinstance(run.get(metric), (int, float))]


def beside_baselines(baselines: dict | None, metric: str) -> str:
    """'; majority 0.5222, tfidf_logreg 0.6556 on the same rows' after a number the baselines were scored beside."""
    scores = [f"{run['baseline']} {run[metric]:.4f}" for run in scored_baselines(baselines, metric)]
    return f"; {', '.join(scores)} on the same rows" if scores else ""


def examples_cut(data: dict) -> str:
    """'294 of 300 training, 99 of 100 validation' examples cut to the backbone's first window, or ''."""
    counted = {"training": "train_examples", "validation": "validation_examples", "test": "test_examples"}
    return ", ".join(f"{data[f'{name}_examples_cut']}" + (f" of {data[total]}" if total in data else "") + f" {name}"
                     for name, total in counted.items() if data.get(f"{name}_examples_cut"))


def report_text(result) -> str:
    """report.md: each number named for what it is, the baselines and the head's margins, where the
    head fails (per class / per type, the most confidently wrong examples) and how to query it."""
    a, m = result.assessment, result.metrics
    metric = m["metric"]
    lines = [f"# {result.task}/{result.version}", "",
             f"- validation {metric}: **{m[metric]:.4f}** ({m['examples'] if 'examples' in m else m.get('sentences')} "
             f"examples; this split {m['role']}{optimistic(m['role'])}"
             f"{beside_baselines(validation_baselines(m), metric)})"]
    if "test" in m:
        t = m["test"]
        lines.append(f"- test {metric}: **{t[metric]:.4f}** ({t.get('examples', t.get('sentences'))} examples; "
                     "never used to choose anything" + (f"; not wholly unseen: {t['rows_seen']})" if t.get("rows_seen")
                                                        else ")"))
    else:
        lines.append("- test: none (give --test FILE, or --split VAL,TEST of a --train file): only the validation "
                     "number above exists")
    data = result.training.get("data", {})
    if data.get("entities_begun_with_i"):
        counts = ", ".join(f"{n} in the {split} file" for split, n in data["entities_begun_with_i"].items())
        lines.append(f"- entities that begin with I- (IOB1 tags, or slips in BIO): {counts}; learnt and scored as "
                     "beginning with B- (BIO), the same entities")
    if data.get("training_word_pieces_unknown"):
        unknown, pieces = data["training_word_pieces_unknown"], data["training_word_pieces"]
        lines.append(f"- {unknown} of the {pieces} training word pieces ({100 * unknown / pieces:.2f}%) are unknown to "
                     "the backbone's vocabulary ([UNK]: another script, emoji): the head learns nothing from them")
    if cut := examples_cut(data):
        limit = data["examples_cut_at"]
        scored = (f"learnt and scored on their first {limit}, where the server reads a long text whole, in windows"
                  if "sentences" in m else f"learnt on their first {limit}; scored (validation, test and `tmod-train "
                  "eval`) as the server answers them, read in windows")
        lines.append(f"- examples longer than the backbone reads at once ({limit} word pieces): {cut}; {scored} "
                     "(docs/windows.md)")
    if data.get("train_texts_labelled_two_ways"):
        lines.append("- training texts labelled more than one way (the same text, different labels): "
                     f"{data['train_texts_labelled_two_ways']}")
    if (result.training.get("settings") or {}).get("class_weights") == "balanced":
        lines.append("- trained with balanced class weights (--class-weights balanced): a rare class's rows weigh as "
                     "much as a frequent one's, so the head's scores lean toward rare classes; the linear baseline "
                     "is weighed alike")
    asked = (result.training.get("settings") or {}).get("precision", "fp32")
    read_at = (result.training.get("environment") or {}).get("backbone_backend", {}).get("precision", asked)
    if read_at != "fp32":
        how = f" (--precision {asked}, on this device)" if asked != read_at else ""
        lines.append(f"- learnt and scored on backbone states read at {read_at}{how}, as a server at that precision "
                     "reads them (a server at another precision answers slightly otherwise)")
    if d := result.training.get("distillation"):
        lines.append(f"- distilled from {d['teacher']} ({d['teacher_backbone']}, {d['teacher_precision']}; KL weight "
                     f"{d['weight']}, temperature {d['temperature']}): its most likely tag is the gold one for "
                     f"{100 * d['teacher_train_word_accuracy']:.1f}% of the {d['words']} training words (its view of "
                     "the training data, a check that it tags the right words, not a score)")
    if seen := rows_seen(data, "validation"):  # the test number's are said on its line
        lines.append(f"- the validation split is not wholly unseen: {seen}")
    best, run = result.training.get("best_epoch"), result.training.get("epochs_run")
    stopped_by = (result.history or [{}])[-1].get("stopped_by")
    patience = result.training.get("settings", {}).get("patience")
    stopped = {"interrupt": f"; the run was stopped by Ctrl-C in epoch {run + 1}",
               "max_minutes": "; the run was stopped by --max-minutes",
               "patience": f"; the run stopped early: {patience} epochs in a row without a better validation {metric} "
                           f"(--patience {patience})"}.get(stopped_by, "")
    lines.append(f"- kept epoch {best} of {run} run" + (" (the last: validation was still improving; train longer)"
                                                       if result.training.get("still_improving") else "") + stopped)
    if learns_its_layer_mix(result):
        lines.append("- the backbone states it reads, and how much of each it learnt: layer_weights.png")
    else:
        lines.append(f"- reads backbone state {', '.join(state_name(i) for i in sorted(result.layer_weights))} "
                     "(the input of its copied blocks: fixed, not learnt)")
    b = m["baselines"]
    lines.append(f"- against simple baselines: {b['verdict']}")
    lines += ["", f"## Baselines on the {b['split']} split ({metric})", "",
              "| model | " + metric + f" | head's margin | its {LEVEL:.0%} interval |", "| --- | ---: | ---: | ---: |",
              f"| this head | {b['head']:.4f} | | |"]
    for name in ("majority", "tfidf_logreg", "window_tagger"):
        if name in b and metric in b[name]:
            interval = b.get(f"margin_over_{name}_interval")
            lines.append(f"| {name} | {b[name][metric]:.4f} | {b[f'margin_over_{name}']:+.4f} | "
                         + (f"{interval_text(interval)} |" if interval else "|"))
        elif name in b:
            lines.append(f"| {name} | not trained: {b[name]['error']} | | |")
    if "intervals" in b:
        lines += ["", f"Intervals: {b['intervals']}; one that holds 0 means these rows cannot tell the head from "
                      "that baseline."]
    rows = a.get("per_class") or a.get("per_type") or a.get("per_label")
    if rows:
        what = "class" if "per_class" in a else "type" if "per_type" in a else "label"
        lines += ["", f"## Per {what} ({a['split']} split)", "", f"| {what} | precision | recall | F1 | support |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        lines += [f"| {k} | {r['precision']:.3f} | {r['recall']:.3f} | {r['f1']:.3f} | {r['support']} |"
                  for k, r in rows.items()]
        lines += absent_note(rows, a["split"])
    if a.get("confusion"):
        shown, labels = len(confused_labels(a["confusion"]["counts"])), len(a["confusion"]["labels"])
        some = f"; the {shown} of the {labels} labels most often confused" if shown < labels else ""
        lines += ["", f"Confusion matrix: confusion.png (rows: gold, columns: predicted{some})."]
    if a.get("worst"):
        lines += ["", f"## Most confidently wrong ({a['split']} split)", "", "| text | gold | predicted (p) |",
                  "| --- | --- | --- |"]
        for w in a["worst"]:
            text = (w["text"] + (" ||| " + w["text_pair"] if "text_pair" in w else "")).replace("|", "\\|")
            rows = f" ({w['rows']} rows)" if w.get("rows", 1) > 1 else ""
            lines.append(f"| {text}{rows} | {w['gold']} ({w['gold_score']:.2f}) | {w['predicted']} ({w['score']:.2f}) |")
    if a.get("worst_sentences"):
        by_word = "missed" not in a["worst_sentences"][0]
        lines += ["", f"## Sentences with the most mistakes ({a['split']} split)", ""]
        lines += (["| sentence | words tagged wrong (gold -> predicted) |", "| --- | --- |"] if by_word else
                  ["| sentence | missed (gold, not answered) | wrong (answered, not gold) |", "| --- | --- | --- |"])
        for w in a["worst_sentences"]:
            cells = [w["text"]] + ([w["wrong"]] if by_word else [w["missed"], w["wrong"]])
            lines.append("| " + " | ".join((c if isinstance(c, str) else "; ".join(c) or "-").replace("|", "\\|")
                                           for c in cells) + " |")
    if result.loaded_into:
        lines += ["", f"## Query it (loaded into {result.loaded_into})", "", "    " + result.request, ""]
    else:
        lines += ["", "## Serve it, then query it", "", "    " + result.serve, "", "    " + result.request, ""]
    return "\n".join(lines)


CONFUSION_LABELS = 20  # more are drawn unreadably small (Banking77's 77 intents, CLINC's 150)


def confused_labels(counts: list[list[int]], most: int = CONFUSION_LABELS) -> list[int]:
    """The places of the labels a confusion matrix shows: every label, or where there are more than
    `most`, the `most` in the most errors (as gold or as predicted; then by rows), in label order."""
    if len(counts) <= most:
        return list(range(len(counts)))
    errors = [sum(counts[i]) - counts[i][i] + sum(row[i] for row in counts) - counts[i][i] for i in range(len(counts))]
    chosen = sorted(range(len(counts)), key=lambda i: (-errors[i], -sum(counts[i]), i))[:most]
    return sorted(chosen)


def plot_confusion(confusion: dict, path: Path, title: str) -> None:
    shown = confused_labels(confusion["counts"])
    labels = [confusion["labels"][i] for i in shown]
    counts = [[confusion["counts"][i][j] for j in shown] for i in shown]
    if len(shown) < len(confusion["labels"]):
        title = f"{title}\nthe {len(shown)} of {len(confusion['labels'])} labels most often confused"
    size = max(4.0, 0.55 * len(labels) + 2)
    fig, ax = plt.subplots(figsize=(size, size * 0.9))
    ax.imshow(counts, cmap="Blues")
    peak = max(max(row) for row in counts) or 1
    for i, row in enumerate(counts):
        for j, n in enumerate(row):
            ax.text(j, i, str(n), ha="center", va="center", fontsize=8, color="white" if n > peak / 2 else "black")
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_xlabel("predicted")
    ax.set_ylabel("gold")
    # wrapped to the figure's width: a task's name made a one-line title run past a small matrix's edge
    ax.set_title("\n".join(textwrap.fill(line, int(8 * size)) for line in title.split("\n")), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def per_label_table(metrics: dict, thresholds: dict) -> str:
    """Markdown: each label's threshold, precision, recall, F1 and support on validation."""
    lines = [f"Validation macro F1 {metrics['f1_macro']:.4f}, micro F1 {metrics['f1_micro']:.4f} "
             f"({metrics['examples']} examples; rule: {metrics.get('rule', '?')})", "",
             "| label | threshold | precision | recall | F1 | support | predicted |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label, row in metrics["per_label"].items():
        t = thresholds.get(label)
        lines.append(f"| {label} | {'' if t is None else f'{t:.2f}'} | {row['precision']:.3f} | {row['recall']:.3f} | "
                     f"{row['f1']:.3f} | {row['support']} | {row['predicted']} |")
    return "\n".join(lines + absent_note(metrics["per_label"], "validation")) + "\n"


def absent_note(rows: dict, split: str) -> list[str]:
    """A line under a per-label table naming the labels the split has no row of: their F1 0 says
    nothing about the head, yet counts in the macro mean."""
    absent = [label for label, row in rows.items() if row["support"] == 0]
    if not absent:
        return []
    return ["", f"No row of the {split} split carries {', '.join(absent)} (support 0): F1 is 0 there whatever the "
                "head answers, and counts as 0 in the macro mean (scikit-learn's zero_division=0)."]


def plot_per_label(per_label: dict, thresholds: dict, path: Path, title: str) -> None:
    labels = list(per_label)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.38 * len(labels) + 2), 3.8))
    ax.bar(labels, [per_label[k]["f1"] for k in labels], color="#4c72b0", label="F1")
    if thresholds:
        ax.plot(labels, [thresholds.get(k, float("nan")) for k in labels], "o", color="#c44e52", markersize=4,
                label="threshold")
    ax.set_ylim(0, 1)
    ax.set_ylabel("validation F1")
    ax.tick_params(axis="x", rotation=70, labelsize=8)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars: F1 near 1 hid under it
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_layer_weights(weights: dict[int, float], path: Path, title: str) -> None:
    layers = sorted(weights)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(layers) + 2), 3.2))
    bars = ax.bar([state_name(i) for i in layers], [weights[i] for i in layers], color="#4c72b0")
    for bar, i in zip(bars, layers):
        ax.annotate(f"{weights[i]:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, max(1.0, max(weights.values()) * 1.15))
    ax.set_xlabel("backbone state")
    ax.set_ylabel("weight p~ (after cutoff)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mark_epochs(axes, best_epoch: int | None) -> None:
    """Curves by epoch: whole epochs on the x axis, the kept one dashed."""
    for ax in axes:
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if best_epoch:
            ax.axvline(best_epoch, color="grey", linestyle="--", linewidth=0.8)


def plot_curves(history: list[dict], layers: list[int], metric: str, path: Path, task: str,
                best_epoch: int | None = None, baselines: dict | None = None) -> None:
    """Loss, the validation metric (with the simple baselines' scores on the same split, where they were
    measured there: `validation_baselines`) and, for a layer-mix head, its layer weights, epoch by epoch."""
    epochs = [h["epoch"] for h in history]
    mixed = bool(history and history[0].get("layer_weights"))  # a layer-mix head's learnt weights, epoch by epoch
    fig, axes = plt.subplots(1, 3 if mixed else 2, figsize=(14 if mixed else 9.5, 3.4))
    axes[0].plot(epochs, [h["train_loss"] for h in history], marker="o", label="train")
    axes[0].plot(epochs, [h["validation_loss"] for h in history], marker="o", label="validation")
    axes[0].set_title("loss")
    axes[0].legend()
    axes[1].plot(epochs, [h[metric] for h in history], marker="o", color="#55a868", label="head")
    axes[1].set_title(f"validation {metric}")
    if baselines and baselines.get("split") == "validation" and baselines.get("metric") == metric:
        runs = scored_baselines(baselines, metric)
        for run, style in zip(runs, (":", "-.")):
            axes[1].axhline(run[metric], color="grey", linestyle=style, linewidth=1,
                            label=f"{run['baseline']} ({run[metric]:.3f})")
        if runs:
            axes[1].legend(fontsize=7, loc="best")
    if mixed:
        per_state = list(zip(*[h["layer_weights"] for h in history]))
        for i, series in zip(layers, per_state):
            axes[2].plot(epochs, series, marker=".", label=state_name(i))
        axes[2].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
        axes[2].set_title("layer weights")
    mark_epochs(axes, best_epoch)
    fig.suptitle(f"{task} (dashed: best epoch, the one kept)" if best_epoch else task)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
