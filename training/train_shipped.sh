#!/usr/bin/env bash
# Train the modules that ship in modules_store/ and their last-layer-only baselines, on the default
# backbone, from ../shared/data (or $TMOD_DATA_DIR). Reports (metrics JSON, layer weights and loss
# curves) go to docs/reports/<name>/; baselines go to runs/baselines (not shipped).
# Usage: bash training/train_shipped.sh [sentiment|ner|acceptability|entailment ...]   (default: the first three)
# entailment (RTE pairs) was trained and measured on MiniLM and is not shipped: 49.8% validation
# accuracy, below the majority class (52.7%); its reports are docs/reports/entailment-minilm*.
# The MPNet tier: training/train_shipped_mpnet.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
TRAIN="${TMOD_PYTHON:-.venv/bin/python} -m training.cli layermix --threads ${TMOD_TRAIN_THREADS:-1}"
tasks=("${@:-sentiment ner acceptability}")
for task in ${tasks[@]}; do
  case "$task" in
    sentiment)     args=(--dataset sst2) ;;
    ner)           args=(--dataset conll2003 --casing) ;;
    acceptability) args=(--dataset cola) ;;
    entailment)    args=(--dataset rte) ;;
    *) echo "unknown task $task" >&2; exit 2 ;;
  esac
  $TRAIN "${args[@]}" --task "$task" --version 1 --store modules_store \
         --report-dir "docs/reports/$task" --run-dir "runs/$task-1"
  $TRAIN "${args[@]}" --layers 6 --task "$task" --version last-layer --store runs/baselines \
         --report-dir "docs/reports/$task-last-layer" --run-dir "runs/$task-last-layer"
done
