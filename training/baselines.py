"""Baselines a head must beat, trained on the same data and scored with the same metrics
(training/metrics.py) as the head: the majority answer, TF-IDF + logistic regression for sequence
tasks, and a linear tagger on word-window features for token tasks (scikit-learn learners).

Each function returns the metrics dict the project's evaluation reports for the task type:
accuracy / macro F1 / MCC (and binary F1) for sequence classification, macro and micro F1 for
multi-label, entity micro F1 with per-type scores for token tasks; plus `baseline`, its name, and
`answers`, its answer for each evaluation row (JSON-able: a label, a list of labels, a sentence's
tags), which a paired comparison with the head reads (`training.metrics.margin_interval`).
"""
from __future__ import annotations

from collections import Counter
from itertools import accumulate
from pathlib import Path
from typing import Sequence

import numpy as np
from sklearn.feature_extraction import DictVectorizer
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.multiclass import OneVsRestClassifier
from sklearn.pipeline import FeatureUnion, make_pipeline
from sklearn.preprocessing import MultiLabelBinarizer
from sklearn.svm import LinearSVC

from training.metrics import classification_scores, entity_scores, multi_hot, multilabel_scores
from training.runs import write_cache_file

PAIR_SEPARATOR = " ||| "  # joins a text pair into one string for the bag-of-words models
WINDOW = 2  # the tagger sees each word with this many words either side


def majority(train_labels: Sequence, eval_labels: Sequence, multi_label: bool = False,
             labels: Sequence[str] | None = None) -> dict:
    """Answer every example with the training data's most frequent answer.

    Labels are strings (one per example), label collections with `multi_label` (the most frequent
    label set is answered), or one list of tags per sentence (token tasks: every word gets the most
    frequent tag, usually O, so entity F1 is 0). `labels`: the head's label order (binary F1 takes
    labels[1] as positive; default: sorted)."""
    if multi_label:
        most = sorted(Counter(frozenset(y) for y in train_labels).most_common(1)[0][0])
        answers = [most] * len(eval_labels)
        return {"baseline": "majority", **_multi_label_scores(train_labels, eval_labels, answers, labels),
                "answers": answers}
    if _is_token_task(train_labels):
        tag = Counter(t for tags in train_labels for t in tags).most_common(1)[0][0]
        answers = [[tag] * len(tags) for tags in eval_labels]
        return {"baseline": "majority", **entity_scores(eval_labels, answers), "answers": answers}
    answers = [Counter(train_labels).most_common(1)[0][0]] * len(eval_labels)
    return {"baseline": "majority", **_sequence_scores(train_labels, eval_labels, answers, labels), "answers": answers}


def tfidf_features(min_df: int = 2) -> FeatureUnion:
    """The linear baselines' text features: TF-IDF of word 1-2-grams and character 2-5-grams (within
    words), each seen in at least `min_df` training texts."""
    return FeatureUnion([
        ("words", TfidfVectorizer(ngram_range=(1, 2), min_df=min_df, sublinear_tf=True)),
        ("chars", TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 5), min_df=min_df, sublinear_tf=True,
                                  max_features=200_000)),
    ])


def fit_on_tfidf(learner, train_x: Sequence[str], y):
    """`learner` fitted on the TF-IDF features of `train_x` (a pipeline): terms seen in two texts or
    more, or, where no term is (a toy file of a dozen rows, every word in one), every term: a
    user's first try ends with its baselines, not a traceback after the head is trained."""
    try:
        return make_pipeline(tfidf_features(), learner).fit(train_x, y)
    except ValueError as exc:
        if "no terms remain" not in str(exc):
            raise
        return make_pipeline(tfidf_features(min_df=1), learner).fit(train_x, y)


def tfidf_logreg(train_texts: Sequence, train_labels: Sequence, eval_texts: Sequence, eval_labels: Sequence,
                 multi_label: bool = False, seed: int = 0, labels: Sequence[str] | None = None) -> dict:
    """TF-IDF of word 1-2-grams and character 2-5-grams (within words), logistic regression on top
    (one-vs-rest with a 0.5 threshold for multi-label). A text may be a (text, text_pair) pair: the
    two are joined with a separator. Fixed settings, nothing tuned on the evaluation split."""
    return tfidf_logreg_scores(train_texts, train_labels, [(eval_texts, eval_labels)], multi_label, seed, labels)[0]


def tfidf_logreg_scores(train_texts: Sequence, train_labels: Sequence, evaluations: Sequence[tuple[Sequence, Sequence]],
                        multi_label: bool = False, seed: int = 0, labels: Sequence[str] | None = None,
                        balanced: bool = False) -> list[dict]:
    """`tfidf_logreg` fitted once and scored on each (texts, labels) of `evaluations`: a run with a
    test split scores its validation and test rows with one fit. `balanced`: classes weighed as a head
    trained with --class-weights balanced (single-label)."""
    predicted = tfidf_logreg_predictions(train_texts, train_labels, [t for texts, _ in evaluations for t in texts], seed,
                                         multi_label, balanced)
    score = _multi_label_scores if multi_label else _sequence_scores
    parts = _cut(predicted, [len(texts) for texts, _ in evaluations])
    return [{"baseline": "tfidf_logreg", **score(train_labels, eval_labels, answers, labels), "answers": answers}
            for (_, eval_labels), answers in zip(evaluations, parts)]


def tfidf_logreg_predictions(train_texts: Sequence, train_labels: Sequence, eval_texts: Sequence,
                             seed: int = 0, multi_label: bool = False, balanced: bool = False) -> list:
    """The linear baseline's answer for each evaluation text (the model `tfidf_logreg` scores; a sorted
    list of labels with `multi_label`)."""
    train_x, eval_x = [_joined(t) for t in train_texts], [_joined(t) for t in eval_texts]
    if multi_label:  # one binary model per label; liblinear is the fast solver for those
        learner = OneVsRestClassifier(LogisticRegression(C=10.0, solver="liblinear", random_state=seed))
        binarizer = MultiLabelBinarizer().fit(train_labels)  # a label no training row has is never answered
        model = fit_on_tfidf(learner, train_x, binarizer.transform(train_labels))
        return [sorted(row) for row in binarizer.inverse_transform(model.predict(eval_x))]
    learner = LogisticRegression(C=10.0, max_iter=2000, random_state=seed,  # multinomial over the labels
                                 class_weight="balanced" if balanced else None)
    return list(fit_on_tfidf(learner, train_x, list(train_labels)).predict(eval_x))


def window_tagger(train_words: Sequence[Sequence[str]], train_tags: Sequence[Sequence[str]],
                  eval_words: Sequence[Sequence[str]], eval_tags: Sequence[Sequence[str]], seed: int = 0) -> dict:
    """A linear SVM tagging each word independently from features of the words around it (forms,
    lowercase, affixes, shape); entity scores as the head's."""
    return window_tagger_scores(train_words, train_tags, [(eval_words, eval_tags)], seed)[0]


def window_tagger_scores(train_words: Sequence[Sequence[str]], train_tags: Sequence[Sequence[str]],
                         evaluations: Sequence[tuple[Sequence, Sequence]], seed: int = 0) -> list[dict]:
    """`window_tagger` fitted once and scored on each (words, tags) of `evaluations`."""
    predicted = window_tags(train_words, train_tags, [words for eval_words, _ in evaluations for words in eval_words],
                            seed)
    parts = _cut(predicted, [len(eval_words) for eval_words, _ in evaluations])
    return [{"baseline": "window_tagger", **entity_scores(eval_tags, answers), "answers": answers}
            for (_, eval_tags), answers in zip(evaluations, parts)]


def window_tags(train_words: Sequence[Sequence[str]], train_tags: Sequence[Sequence[str]],
                eval_words: Sequence[Sequence[str]], seed: int = 0) -> list[list[str]]:
    """The window tagger's tags for each evaluation sentence."""
    vectorizer = DictVectorizer()
    train_x = _int32_indices(vectorizer.fit_transform([f for words in train_words for f in _window_features(words)]))
    model = LinearSVC(C=0.1, random_state=seed).fit(train_x, [t for tags in train_tags for t in tags])
    flat = model.predict(_int32_indices(vectorizer.transform([f for words in eval_words for f in _window_features(words)])))
    return [[str(t) for t in tags] for tags in _cut(flat, [len(words) for words in eval_words])]


# ---- helpers ----------------------------------------------------------------------------------
def _is_token_task(labels: Sequence) -> bool:
    return bool(labels) and not isinstance(labels[0], str)


def _cut(flat, lengths: Sequence[int]) -> list:
    """`flat` (answers one after another) cut back into consecutive parts of `lengths` (a sentence's
    words, an evaluation set's rows)."""
    return [flat[end - n:end] for n, end in zip(lengths, accumulate(lengths))]


def _joined(text) -> str:
    return text if isinstance(text, str) else PAIR_SEPARATOR.join(str(t) for t in text if t is not None)


def _sequence_scores(train_labels, eval_labels, predicted, labels) -> dict:
    labels = list(labels) if labels else sorted(set(train_labels) | set(eval_labels))
    return classification_scores(list(eval_labels), predicted, labels)


def _multi_label_scores(train_labels, eval_labels, predicted, labels) -> dict:
    labels = list(labels) if labels else sorted({y for row in [*train_labels, *eval_labels] for y in row})
    return multilabel_scores(multi_hot(eval_labels, labels), multi_hot(predicted, labels), labels)


def _int32_indices(matrix):
    """DictVectorizer's matrices carry int64 indices, which liblinear (LinearSVC) refuses."""
    matrix.indices, matrix.indptr = matrix.indices.astype(np.int32), matrix.indptr.astype(np.int32)
    return matrix


def _shape(word: str) -> str:
    """Xxxx -> 'Xx', 'U.S.' -> 'X.X.', '1999' -> 'd': character classes, runs collapsed."""
    out = []
    for ch in word:
        c = "X" if ch.isupper() else "x" if ch.islower() else "d" if ch.isdigit() else ch
        if not out or out[-1] != c:
            out.append(c)
    return "".join(out)


def _word_features(word: str, at: int) -> dict:
    low = word.lower()
    return {f"{at}:w={low}": 1, f"{at}:shape={_shape(word)}": 1, f"{at}:suf3={low[-3:]}": 1,
            f"{at}:pre3={low[:3]}": 1, f"{at}:title": float(word.istitle())}


def _window_features(words: Sequence[str]) -> list[dict]:
    out = []
    for i, word in enumerate(words):
        features = {"bias": 1, f"form={word}": 1, f"suf2={word[-2:].lower()}": 1, f"pre2={word[:2].lower()}": 1}
        for at in range(-WINDOW, WINDOW + 1):
            j = i + at
            if 0 <= j < len(words):
                features.update(_word_features(words[j], at))
            else:
                features[f"{at}:{'<s>' if j < 0 else '</s>'}"] = 1
        out.append(features)
    return out


def cached_run(cache: Path | str | None, key: dict, run):
    """`run()`'s result (JSON-able), kept in `cache` (a folder) under the sha256 of `key` and of
    this file's source: a later training run on the same data (another head on the same split) reads
    it instead of training the baseline again (the window tagger takes minutes on CoNLL). No cache:
    just `run()`. A damaged file is recomputed."""
    if cache is None:
        return run()
    import hashlib
    import json

    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(json.dumps(key, sort_keys=True, default=_key_part).encode())
    path = Path(cache) / f"{digest.hexdigest()}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    result = json.loads(json.dumps(run(), default=float))  # as a later read gives it back
    write_cache_file(path, lambda tmp: Path(tmp).write_text(json.dumps(result)))
    return result


def _key_part(value):
    """JSON for what json cannot write: a set (multi-label labels) sorted, anything else as its str."""
    return sorted(value, key=str) if isinstance(value, (set, frozenset)) else str(value)
