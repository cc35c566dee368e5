"""Is the head worth it? The baselines trained on the same training data and scored on the same
split as the head (the test split when there is one, else validation), the head's margin over
each with its paired bootstrap interval (can these rows tell the two apart?), and the detail a user
reads to see where it fails: per-class scores, the confusion matrix and the most confidently wrong
examples (sequence tasks), per-type scores (token tasks)."""
from __future__ import annotations

import numpy as np

from modules_store import TaskType
from training.baselines import cached_run, majority, tfidf_logreg_scores, window_tagger_scores
from training.data.examples import LabelledData
from training.metrics import (LEVEL, ROUNDS, confusion_matrix, drawn_unit, entities, interval_text, margin_interval,
                              optimistic, per_class_scores, within_noise)
from training.states import Split

WORST = 10  # confidently wrong examples listed


def assess(train: LabelledData, evaluated: Split, probabilities: list, head: dict, metric: str, seed: int = 0,
           cache=None, validation: tuple[Split, dict, list] | None = None, balanced: bool = False,
           thresholds: dict | None = None) -> dict:
    """`head`: the head's metrics on `evaluated` (with its `split` name); `probabilities`: its label
    probabilities per row (sequence and multi-label tasks, the latter answered at `thresholds`, label
    -> threshold), its word tags per sentence (token tasks); `cache`: a folder keeping the linear
    baseline's result for a later run on the same data (`baselines.cached_run`); `validation`: where
    `evaluated` is the test split, the validation rows, the head's metrics and probabilities on them,
    which get the baselines too (from the same fit) as `validation_baselines`; `balanced`: the head was trained with
    --class-weights balanced, and the linear model is too."""
    examples, labels = evaluated.data.examples, evaluated.labels
    kind = evaluated.data.task_type
    runs = baseline_runs(train, [evaluated.data, *([validation[0].data] if validation else [])], labels, seed, cache,
                         balanced)
    gold, answered = head_answers(evaluated, probabilities, thresholds)

    def paired(gold, answered):  # what `against_baselines` draws its intervals from, where there are answers
        return (gold, answered, labels) if answered is not None else None

    baselines = against_baselines(runs[0], head, metric, kind, balanced=balanced, seed=seed,
                                  paired=paired(gold, answered))
    out = {"split": head["split"], "metric": metric, "head": head, "baselines": baselines}
    if validation:
        # no verdict of their own: the verdict is the test split's (one that told to add a test split misled)
        split, scores, split_probabilities = validation
        out["validation_baselines"] = against_baselines(
            runs[1], scores, metric, kind, with_verdict=False, balanced=balanced, seed=seed,
            paired=paired(*head_answers(split, split_probabilities, thresholds)))
    if kind == TaskType.sequence_classification:
        probs, pred = np.stack(probabilities), answered
        out["per_class"] = per_class_scores(gold, pred, labels)
        out["confusion"] = {"labels": labels, "counts": confusion_matrix(gold, pred, labels)}
        wrong = [r for r in range(len(gold)) if pred[r] != gold[r]]
        wrong.sort(key=lambda r: -float(probs[r].max()))
        listed: dict[tuple, dict] = {}  # a text the split holds many times (with one label) is listed once, counted
        for r in wrong:
            key = (examples[r].text, examples[r].text_pair, gold[r])
            if key in listed:
                listed[key]["rows"] += 1
            elif len(listed) < WORST:
                listed[key] = {"text": examples[r].text,
                               **({"text_pair": examples[r].text_pair} if examples[r].text_pair else {}),
                               "gold": gold[r], "predicted": pred[r], "score": round(float(probs[r].max()), 4),
                               "gold_score": round(float(probs[r][labels.index(gold[r])]), 4), "rows": 1}
        out["worst"] = list(listed.values())
    elif kind == TaskType.token_classification:
        out["per_type"] = head["per_type"]
        if probabilities:  # the head's word tags per sentence
            out["worst_sentences"] = worst_sentences(examples, probabilities, by_word=metric == "word_accuracy")
    else:
        out["per_label"] = head["per_label"]
    return out


def head_answers(evaluated: Split, probabilities: list, thresholds: dict | None = None) -> tuple[list, list | None]:
    """(the gold answers of `evaluated`'s rows, the head's answers as the metrics count them: the most
    probable label, the labels at or over their `thresholds` (multi-label), a sentence's word tags;
    None where `assess` was given no probabilities, or no thresholds for a multi-label head)."""
    kind, labels, examples = evaluated.data.task_type, evaluated.labels, evaluated.data.examples
    if kind == TaskType.token_classification:
        return [ex.tags for ex in examples], (list(probabilities) if probabilities else None)
    gold = [ex.label for ex in examples]
    if not probabilities or (kind == TaskType.multi_label_classification and thresholds is None):
        return gold, None
    probs = np.stack(probabilities)
    if kind == TaskType.multi_label_classification:
        cut = np.array([thresholds[label] for label in labels])
        return gold, [[labels[j] for j in np.flatnonzero(row >= cut)] for row in probs]
    return gold, [labels[i] for i in probs.argmax(1)]


def worst_sentences(examples: list, predicted: list[list[str]], by_word: bool = False) -> list[dict]:
    """The sentences with the most mistakes (at most WORST), most first: entities missed (gold, not
    answered) and wrong (answered, not gold), each as 'TYPE words'; `by_word` (tags that are no
    entities, such as parts of speech): the words tagged wrong, as 'word: gold -> predicted'."""
    found = []
    for r, (example, tags) in enumerate(zip(examples, predicted)):
        words = example.words
        if by_word:
            wrong = [f"{w}: {g} -> {p}" for w, g, p in zip(words, example.tags, tags) if g != p]
            row = {"wrong": wrong}
        else:
            gold, answered = set(entities(example.tags)), set(entities(tags))
            said = (lambda spans: [f"{kind} {' '.join(words[first:last + 1])}" for kind, first, last in sorted(
                spans, key=lambda e: e[1])])
            row = {"missed": said(gold - answered), "wrong": said(answered - gold)}
        mistakes = sum(map(len, row.values()))
        if mistakes:
            found.append((-mistakes, len(words), r, {"text": " ".join(words), **row}))
    return [row for *_, row in sorted(found)[:WORST]]


def baseline_runs(train: LabelledData, evaluated: list[LabelledData], labels: list[str], seed: int = 0,
                  cache=None, balanced: bool = False) -> list[list[dict]]:
    """For each of `evaluated`: the majority answer and the linear model (window tagger for token
    tasks), trained on `train` and scored on it, each as the metrics dict `training/baselines.py`
    returns. The linear model is fitted once for every split scored (the test and validation rows of
    a run with a test split), its classes weighed where the head's were (`balanced`). A linear model
    these rows cannot fit (or that fails otherwise) is `{"baseline", "error"}`: the head it is measured
    for is kept, not lost to a traceback after its training."""
    kind = train.task_type
    if kind == TaskType.token_classification:
        train_x, train_y = [ex.words for ex in train.examples], [ex.tags for ex in train.examples]
        sets = [([ex.words for ex in d.examples], [ex.tags for ex in d.examples]) for d in evaluated]
        bases = [majority(train_y, gold) for _, gold in sets]
        key = {"baseline": "window_tagger", "seed": seed, "train": [train_x, train_y], "evaluate": sets}
        fit = lambda: window_tagger_scores(train_x, train_y, sets, seed=seed)  # noqa: E731
    else:
        multi = kind == TaskType.multi_label_classification
        train_x, train_y = [_text(ex) for ex in train.examples], [ex.label for ex in train.examples]
        sets = [([_text(ex) for ex in d.examples], [ex.label for ex in d.examples]) for d in evaluated]
        bases = [majority(train_y, gold, multi_label=multi, labels=labels) for _, gold in sets]
        key = {"baseline": "tfidf_logreg", "seed": seed, "multi_label": multi, "labels": labels,
               "train": [train_x, train_y], "evaluate": sets, **({"balanced": True} if balanced else {})}
        fit = lambda: tfidf_logreg_scores(train_x, train_y, sets, multi_label=multi, seed=seed,  # noqa: E731
                                          labels=labels, balanced=balanced)
    try:
        linear = cached_run(cache, key, fit)
    except Exception as exc:  # noqa: BLE001 - scikit-learn refusing the rows, memory a big file outgrows: recorded
        linear = [{"baseline": key["baseline"], "error": f"{type(exc).__name__}: {str(exc)[:200]}"}] * len(sets)
    return [[base, run] for base, run in zip(bases, linear)]


def against_baselines(runs: list[dict], head: dict, metric: str, kind: TaskType, with_verdict: bool = True,
                      balanced: bool = False, paired: tuple[list, list, list] | None = None, seed: int = 0) -> dict:
    """What a manifest's `metrics.baselines` holds: the split and metric compared, the head's score,
    each baseline's metrics (not its answers) and the head's margin over it, and the verdict line (not
    `with_verdict`: the validation rows' baselines beside a test split, which has the verdict). `head`:
    the head's metrics on that split (its `split`, and on validation its `role`: what that split
    chose); `balanced`: head and linear model trained with balanced class weights (`class_weights`
    said); `paired`: (gold answers, the head's answers, labels) of those rows: each margin gets its
    LEVEL paired bootstrap interval (`margin_interval`, seeded with `seed`), which the verdict reads."""
    baselines = {"split": head["split"], "metric": metric, "head": head[metric],
                 **({"class_weights": "balanced"} if balanced else {})}
    for said in ("role", "rows_seen"):
        if head.get(said):
            baselines[said] = head[said]
    for run in runs:
        name = run["baseline"]
        baselines[name] = {k: v for k, v in run.items() if k != "answers"}
        if metric in run:  # not where it could not be trained (`baseline_runs`)
            # a difference of two scores, rounded: 0.07, not the float sum's 0.07000000000000006
            baselines[f"margin_over_{name}"] = round(head[metric] - run[metric], 6)
            if paired and "answers" in run:
                gold, answered, labels = paired
                if interval := margin_interval(kind, metric, gold, answered, run["answers"], labels, seed):
                    baselines[f"margin_over_{name}_interval"] = [round(end, 6) for end in interval]
    if any(key.endswith("_interval") for key in baselines):
        baselines["intervals"] = (f"{LEVEL:.0%} paired bootstrap intervals of the margins: {ROUNDS} draws of these "
                                  f"{len(paired[0])} {drawn_unit(kind)} with replacement, each scored with both "
                                  "answers")
    if with_verdict:
        baselines["verdict"] = verdict(baselines, kind)
    return baselines


def linear_baseline(kind: TaskType) -> str:
    """The name of the linear model a head of this task type is compared with (`baseline_runs`)."""
    return "window_tagger" if kind == TaskType.token_classification else "tfidf_logreg"


FEW_ROWS = 100  # under this many scored rows one row moves accuracy by more than a point


def too_few(rows: int | None) -> str:
    """What a comparison on under FEW_ROWS rows is worth, said beside it; "" for more. 2 validation rows
    made "above both baselines: +0.5000" read as a finding."""
    if not rows or rows >= FEW_ROWS:
        return ""
    return (f"scored on {rows} rows only, each {100 / rows:.0f}% of them: too few for these numbers to rank the "
            "head against the baselines")


def verdict(baselines: dict, kind: TaskType) -> str:
    """One line a user reads first: does the head beat the majority answer and the linear model? A margin
    whose paired bootstrap interval holds 0 (`against_baselines`) is said to be within the noise of the
    rows scored, not a win."""
    split, metric, head = baselines["split"], baselines["metric"], baselines["head"]
    linear = linear_baseline(kind)
    majority_score, linear_score = baselines["majority"][metric], baselines[linear].get(metric)
    role = baselines.get("role", "chose the epoch")
    caveat = (f"; the validation split also {role}: a test split (--test FILE; --split VAL,TEST of a --train file) "
              "gives one that chose nothing"
              if split == "validation" and optimistic(role) else "")
    if baselines.get("rows_seen"):
        caveat = f"; the test split is not wholly unseen: {baselines['rows_seen']}"
    scored = baselines["majority"]  # on the rows every score here is on (a token task's: sentences)
    rows = scored.get("examples", scored.get("sentences"))
    if few := too_few(rows):
        caveat = f"; {few}{caveat}"
    if linear_score is None:  # these rows could not train it (`baseline_runs`)
        standing = (f"no better than the majority answer on the {split} split ({metric} {head:.4f} against "
                    f"{majority_score:.4f})" if head <= majority_score else
                    f"above the majority answer on the {split} split: {metric} {head - majority_score:+.4f}")
        return (f"{standing}; the linear model ({linear}) could not be trained on these rows "
                f"({baselines[linear]['error']})" + caveat)
    if head <= majority_score:
        imbalanced = metric == "accuracy" and majority_score >= 0.6  # the majority answer alone scores well
        weigh = "" if baselines.get("class_weights") else ", and --class-weights balanced trains on every class alike"
        return (f"no better than the majority answer on the {split} split ({metric} {head:.4f} against "
                f"{majority_score:.4f}): the head has not learnt this task from these rows"
                + (f"; the classes are imbalanced, so --metric f1_macro or mcc judges a head better{weigh}"
                   if imbalanced else "") + caveat)
    over_majority, over_linear = (baselines.get(f"margin_over_{name}_interval") for name in ("majority", linear))
    unit = drawn_unit(kind)
    if within_noise(over_majority):
        return (f"above the majority answer on the {split} split by {head - majority_score:+.4f} {metric}, but within "
                f"the noise of these {rows} {unit} ({LEVEL:.0%} paired bootstrap interval of the margin: "
                f"{interval_text(over_majority)}): not shown to have learnt this task; more scored {unit} can tell"
                + caveat)
    if head <= linear_score:
        return (f"above the majority answer but no better than the linear model ({linear}) on the {split} split "
                f"({metric} {head:.4f} against {linear_score:.4f}): not worth a backbone pass for this task alone"
                + caveat)
    if within_noise(over_linear):
        return (f"above the majority answer on the {split} split ({metric} {head - majority_score:+.4f}), but level "
                f"with the linear model ({linear}) within the noise of these {rows} {unit}: {head - linear_score:+.4f} "
                f"over it, {LEVEL:.0%} paired bootstrap interval of the margin {interval_text(over_linear)}: not shown "
                f"better than the linear model; more scored {unit} can tell" + caveat)
    intervals = (f" ({LEVEL:.0%} paired bootstrap intervals of the margins over these {rows} {unit}: "
                 f"{interval_text(over_majority)} and {interval_text(over_linear)})"
                 if over_majority and over_linear else "")
    return (f"above both baselines on the {split} split: {metric} {head - majority_score:+.4f} over the majority "
            f"answer, {head - linear_score:+.4f} over the linear model ({linear}){intervals}" + caveat)


def _text(example):
    return (example.text, example.text_pair) if example.text_pair else example.text
