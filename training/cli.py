"""`tmod-train`: train heads (layer-mix, MTB, LoRA-MTB) into a module store, and score stored modules.

    tmod-train layermix --dataset sst2 --task sentiment --store modules_store
    tmod-train layermix --train a.tsv --validation b.tsv --text-column sentence --label-column label
    tmod-train layermix --config sst2.yaml --epochs 3          # options override the file
    tmod-train mtb --dataset sst2 --task sentiment --version mtb-1 --store modules_store
    tmod-train lora-mtb --dataset conll2003 --task ner --rank 8
    tmod-train layermix --dataset conll2003 --casing --distill-from ner/mpnet-2   # learn from a teacher's tags too
    tmod-train eval --store modules_store --task sentiment --dataset sst2
    tmod-train align --source minilm --target smollm2 --mapping avg --dataset sst2   # alignment bridge
    tmod-train bridge --source minilm --target smollm2 --target-layers 0,5,10,15,20,25,30 --objective mse
    tmod-train bridge --objective distill --module STORE/TASK/VERSION --dataset sst2   # transformer bridge
    tmod-train embedding --backbone mpnet --version mpnet-1   # the backbone's own sentence embedding
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from server import __version__
from server.command_line import CommandLineParser

S = argparse.SUPPRESS  # options left out stay out, so the config file and defaults show through
# transformers' TrainingArguments names for what tmod-train names otherwise (a config file reused from it)
TRAINING_ARGUMENTS = {"learning_rate": "lr", "num_train_epochs": "epochs", "per_device_train_batch_size": "batch_size",
                      "per_device_eval_batch_size": "eval_batch_size", "max_grad_norm": "grad_clip",
                      "early_stopping_patience": "patience", "output_dir": "run_dir", "optim": "optimizer"}


def at_least(minimum: int):
    """An argparse type: a whole number >= `minimum` (a count, a size), refused by argparse in one line."""
    def number(text: str) -> int:
        value = int(text)  # not a number: argparse's own "invalid number value" line
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is under {minimum}")
        return value
    number.__name__ = "number"
    return number


def version_name(text: str) -> str:
    """An argparse type: a version a store takes as a folder name, refused in one line (exit 2) before
    anything loads."""
    from training.settings import checked_version

    try:
        return checked_version(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_data_options(p: argparse.ArgumentParser, default=S) -> None:
    g = p.add_argument_group("reading the files (format, columns, labels)")
    g.add_argument("--data-dir", default=default, help="folder of the presets' files "
                   "(default: $TMOD_DATA_DIR, else ../shared/data from the repository root)")
    g.add_argument("--format", choices=["tsv", "csv", "jsonl", "conll"], default=default,
                   help="file format (default: from the extension; .txt means CoNLL)")
    g.add_argument("--text-column", default=default,
                   help="text column: name or 0-based index (default: the header's 'text' column, else the column of "
                        "longest cells among those the labels and pairs leave, said where it is not 0; "
                        "key 'text' in JSONL, else 'tokens': a list of words, a token task)")
    g.add_argument("--pair-column", default=default, help="second text of a pair task (default: none)")
    g.add_argument("--label-column", default=default,
                   help="label column: name or index (default: the header's 'label' column, else the column of "
                        "fewest different values among those the texts and pairs leave, said where it is not 1; "
                        "key 'label' in JSONL, 'labels' with --multi-label, 'ner_tags' or 'tags' beside 'tokens', "
                        "'entities' or 'spans' for entity spans; with --multi-label, several 0/1 columns, one a "
                        "label: 'toxic,obscene,insult')")
    g.add_argument("--header", action=argparse.BooleanOptionalAction, default=default,
                   help="the table's first line names its columns (default: yes)")
    g.add_argument("--label-map", default=default,
                   help="rename raw labels: '0=negative,1=positive' (tags given as numbers: '0=O,1=B-PER,...')")


def add_train_command(commands, kind: str, help_text: str) -> None:
    p = commands.add_parser(kind, help=help_text)
    p.set_defaults(kind=kind)
    p.add_argument("--config", help="YAML or JSON file of settings (same names as the options, '_' or '-')")
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=S, help="preset: sst2, cola, rte, conll2003, goemotions")
    g.add_argument("--train", default=S, help="training file (TSV/CSV/JSONL/CoNLL)")
    g.add_argument("--validation", default=S, help="validation file: chooses the epoch (and thresholds)")
    g.add_argument("--test", default=S, help="test file: scored once at the end with the baselines, never used to "
                   "choose anything")
    g.add_argument("--split", default=S, metavar="VAL[,TEST]",
                   help="carve validation (and test) fractions out of --train, seeded and stratified by label, a "
                        "repeated text's rows (a CoNLL file's document) kept in one part: '0.1,0.1' (for a single labelled "
                        "file; the held-out "
                        "share, at most half)")
    g.add_argument("--labels", default=S,
                   help="label order, comma-separated; class ids in the files (0, 1, ...) are named by their place")
    g.add_argument("--multi-label", action="store_true", default=S,
                   help="independent labels, one sigmoid each (binary cross-entropy); a label cell holds "
                        "comma-separated labels; per-label or global decision threshold chosen on validation "
                        "(whichever scores better there) and recorded in the manifest (the goemotions preset is multi-label)")
    g.add_argument("--none-below", default=S, metavar="P|auto",
                   help="single-label tasks: answer no label ('none of these', label null) when the best probability "
                        "is under P; auto: chosen on validation. Stored in the manifest; a request's threshold overrides it")
    g.add_argument("--max-train", type=int, default=S,
                   help="train on a seeded random subset of N examples (with --document-windows: whole documents, N "
                        "sentences in all, so that their windows exist)")
    g.add_argument("--max-validation", type=int, default=S,
                   help="validate on a seeded random subset of N examples (the epoch is then chosen on fewer)")
    g.add_argument("--document-windows", default=S,
                   help="token tasks from a CoNLL file: also train on its documents read in windows of these "
                        "many word pieces, comma-separated (e.g. 256,128), cut as the server cuts long texts; "
                        "validation stays sentence by sentence")
    add_data_options(p)

    add_head_options(p, kind)

    g = p.add_argument_group("knowledge distillation (token tasks from a CoNLL file)")
    g.add_argument("--distill-from", default=S, metavar="TASK/VERSION",
                   help="teacher module: TASK/VERSION in the shipped store (e.g. ner/mpnet-2) or a STORE/TASK/VERSION "
                        "folder. It tags every training word once, through the served path on its own backbone at the "
                        "precision it was trained at, or fp32 where this device would emulate that (bf16 on a CPU "
                        "without native bfloat16), and keeps its word logits in $TMOD_CACHE_DIR/teacher; "
                        "document windows look their words up there. Loss: (1 - w) * cross-entropy on the gold tags "
                        "+ w * T^2 * KL(teacher || student) at temperature T, per word (first sub-tokens)")
    g.add_argument("--distill-backbone", default=S,
                   help="the teacher's backbone: a folder, or minilm / smollm2 / mpnet (default: the one its manifest "
                        "names)")
    g.add_argument("--distill-temperature", type=float, default=S, metavar="T", help="softmax temperature")
    g.add_argument("--distill-weight", type=float, default=S, metavar="W", help="weight w of the KL term, 0..1")

    g = p.add_argument_group("optimisation")
    g.add_argument("--optimizer", choices=["adam", "adamw"], default=S)
    g.add_argument("--lr", type=float, default=S,
                   help="learning rate (default: layermix 1e-3, 3e-4 for token tasks; mtb 5e-5; lora-mtb 5e-4)")
    g.add_argument("--weight-decay", type=float, default=S)
    g.add_argument("--batch-size", type=int, default=S)
    g.add_argument("--eval-batch-size", type=int, default=S, help="batch size of backbone passes and scoring")
    g.add_argument("--epochs", type=int, default=S)
    g.add_argument("--patience", type=int, default=S, help="early stopping patience (epochs)")
    g.add_argument("--max-minutes", type=float, default=S,
                   help="time budget: start no epoch that would end, at the last epoch's pace, past this many minutes "
                        "of epochs (the kept epoch is still the best by validation; the manifest records the stop)")
    g.add_argument("--select", choices=["best", "last"], default=S,
                   help="best: keep the best epoch by validation (early stopping, lr cut on plateaus); last: train "
                        "exactly --epochs epochs, keep the last, validation only reported")
    g.add_argument("--min-delta", type=float, default=S,
                   help="an epoch replaces the kept one when its validation metric is higher by at least this, or "
                        "within this and its validation loss lower by --min-loss-delta (noise on a small validation "
                        "set is not chased)")
    g.add_argument("--min-loss-delta", type=float, default=S, help="relative drop of the validation loss that counts")
    g.add_argument("--lr-patience", type=int, default=S, help="ReduceLROnPlateau patience (epochs)")
    g.add_argument("--lr-factor", type=float, default=S, help="ReduceLROnPlateau factor")
    g.add_argument("--min-lr", type=float, default=S)
    g.add_argument("--grad-clip", type=float, default=S, help="max gradient norm (0: off)")
    g.add_argument("--metric", default=S, help="validation metric to select on (default: per dataset/task)")
    g.add_argument("--class-weights", choices=["none", "balanced"], default=S,
                   help="single-label sequence tasks: balanced weighs each class's loss by the inverse of its "
                        "share of the training rows, so a rare class counts as much as a frequent one (its "
                        "scores then lean toward rare classes); pair it with --metric mcc or f1_macro "
                        "(default: none)")
    g.add_argument("--seed", type=int, default=S)
    g.add_argument("--states", choices=["cache", "recompute"], default=S,
                   help="cache backbone states once in fp16 (in memory: word pieces x states x hidden size x 2 "
                        "bytes; refused over 80%% of the free memory), or recompute them every epoch")
    g.add_argument("--device", default=S, help="auto, cpu, cuda, cuda:1, ...")
    g.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default=S,
                   help="backbone precision (backend torch) of the states trained and scored on")
    g.add_argument("--state-cache", action=argparse.BooleanOptionalAction, default=S,
                   help="keep the backbone states on disk ($TMOD_CACHE_DIR/states), and the linear baseline's result "
                        "($TMOD_CACHE_DIR/baselines), for later runs on the same data")
    g.add_argument("--threads", type=int, default=S,
                   help="CPU threads; 0 = one per core, or a container's smaller CPU quota. Use 1 when other jobs "
                        "share the cores")
    g.add_argument("--amp", action=argparse.BooleanOptionalAction, default=S, help="bf16 autocast (default: on CUDA)")

    g = p.add_argument_group("output")
    g.add_argument("--task", default=S, help="module name (default: the dataset or train file name)")
    g.add_argument("--version", type=version_name, default=S, help="default: the next free number in --store (1 in "
                   "a new store): a repeated run adds the next version, which tmod-serve serves as the newest")
    g.add_argument("--store", default=S, help="module store to write into (default: RUN_DIR/store)")
    g.add_argument("--run-dir", default=S, help="default: runs/<task>-<version>-<time>")
    g.add_argument("--report-dir", default=S, help="default: RUN_DIR/report")
    g.add_argument("--backbone", default=S, help="backbone folder, or a named one: minilm (default), smollm2, mpnet")
    g.add_argument("--description", default=S, help="what /v1/tasks says the module is (default: '<kind> head on "
                   "<backbone>, trained on <data>')")
    g.add_argument("--overwrite", action=argparse.BooleanOptionalAction, default=S,
                   help="replace a --version the store holds (else it is refused before training)")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=S,
                   help="progress bars (default: only when stderr is a terminal; without them a plain line every 30 s of a "
                        "long step; one line per epoch is always written)")
    g.add_argument("--load-into", default=S, metavar="URL",
                   help="hot-load the new module into the tmod-serve at URL, whose store must be --store (admin token "
                        "from $TMOD_ADMIN_TOKEN; both checked before training), and print a request that queries "
                        "it beside the loaded tasks")

    _document_defaults(p)


def add_head_options(p: argparse.ArgumentParser, kind: str) -> None:
    g = p.add_argument_group("head")
    g.add_argument("--casing", action=argparse.BooleanOptionalAction, default=S,
                   help="casing embedding read from the raw text (the tokenizer lowercases), added to the mix "
                        "(layer-mix) or to the blocks' input (MTB, LoRA-MTB)")
    if kind == "layermix":
        g.add_argument("--layers", default=S, help="states to mix: 'all', '6' (last-layer baseline), '0-6', '1,3,5'")
        g.add_argument("--k", "--project-dim", dest="project_dim", type=int, default=S, help="projection width k")
        g.add_argument("--alpha", type=float, default=S, help="temperature of softmax(alpha * p)")
        g.add_argument("--cutoff", type=float, default=S, help="layer weights under this are zeroed")
        g.add_argument("--lambda", "--lambda-entropy", dest="lambda_entropy", type=float, default=S,
                       help="entropy penalty on the layer distribution")
        g.add_argument("--dropout", type=float, default=S)
        g.add_argument("--attention-heads", type=int, default=S)
        g.add_argument("--encoder-layers", type=int, default=S, help="token tasks: encoder layers on the mix")
        g.add_argument("--ffn-dim", type=int, default=S, help="token tasks: their feed-forward width")
        g.add_argument("--positional", action=argparse.BooleanOptionalAction, default=S,
                       help="learned positional embeddings on the mix")
        g.add_argument("--attention", action=argparse.BooleanOptionalAction, default=S,
                       help="sequence tasks: a self-attention layer over the mix before pooling "
                            "(--no-attention: pool the mix itself; fewer weights, for small datasets)")
        g.add_argument("--pooling", choices=["mean", "pair"], default=S,
                       help="sequence tasks: mean over every token, or pair: text and text pair pooled apart, "
                            "classified from [u, v, |u - v|, u * v] (pair tasks)")
        return
    g.add_argument("--blocks", type=int, default=S, help="backbone blocks copied and trained")
    g.add_argument("--source-layer", type=int, default=S,
                   help="state the blocks read (default: the one before the copied last blocks)")
    g.add_argument("--pooling", choices=["mean", "cls"], default=S, help="sequence tasks: pooling")
    g.add_argument("--dropout", type=float, default=S)
    if kind == "lora-mtb":
        g.add_argument("--rank", type=int, default=S, help="rank of the low-rank updates")
        g.add_argument("--lora-alpha", type=float, default=S, help="updates are scaled by lora_alpha / rank")
        g.add_argument("--targets", default=S, help="comma-separated block linears to adapt, by full name or last "
                                                     "parts: query,value (default: every linear of the block)")


def add_align_command(commands) -> None:
    """`tmod-train align` (training/bridges/align.py): an alignment bridge, fitted without training."""
    p = commands.add_parser("align", help="alignment bridge: serve TARGET's modules on SOURCE by matching "
                                          "hidden dimensions (Pearson + linear assignment; no training)")
    p.add_argument("--source", default="minilm", help="backbone the bridge is served on: minilm, smollm2, mpnet, a folder")
    p.add_argument("--target", default="smollm2", help="backbone the foreign modules were trained on (default: smollm2)")
    p.add_argument("--target-layers", default=None, help="target states to produce: 'all' (default), '0,5,10', '0-6'")
    p.add_argument("--mapping", choices=["skip", "avg"], default="skip",
                   help="deeper source: each group's last state (skip) or the group's mean (avg)")
    p.add_argument("--standardize", action=argparse.BooleanOptionalAction, default=False,
                   help="also match each dimension's mean and spread (default: the paper's plain permutation)")
    p.add_argument("--pool", choices=["token", "word"], default="token",
                   help="align rows per target token (default) or per whitespace word")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--dataset", default="sst2", help="preset(s) whose training texts are paired, comma-separated "
                        "(default: sst2)")
    source.add_argument("--texts", default=None, help="a UTF-8 file of your texts, one a line (the domain the bridge "
                        "will serve), paired instead: a seeded tenth held out to measure the matching on")
    p.add_argument("--data-dir", default=None, help="default: $TMOD_DATA_DIR, else ../shared/data")
    p.add_argument("--max-texts", type=at_least(0), default=2000, help="seeded random subset of the texts (0: all)")
    p.add_argument("--max-validation", type=at_least(0), default=500,
                   help="held-out texts where the matching is measured, at most this many (0: all) of the "
                        "presets' validation split or of --texts' held-out tenth (it is chosen on the others, "
                        "where it looks better)")
    p.add_argument("--seed", type=int, default=0, help="seed of the subsets and of the held-out tenth (default: 0)")
    p.add_argument("--heatmap", action=argparse.BooleanOptionalAction, default=True,
                   help="also pair every source state and report every source x target state correlation")
    p.add_argument("--store", default=None, help="bridge store (default: <module store>/_bridges)")
    p.add_argument("--name", default=None, help="bridge name (default: align-<source>-to-<target>)")
    p.add_argument("--version", type=version_name, default=None,
                   help="default: the next free number of this name in the store (the mapping is in its manifest)")
    p.add_argument("--description", default=None, help="what the bridge's manifest says it is (default: 'alignment "
                   "bridge: TARGET modules served on SOURCE')")
    p.add_argument("--overwrite", action=argparse.BooleanOptionalAction, default=False,
                   help="replace a --version the store holds (else it is refused before any state is paired)")
    p.add_argument("--report-dir", default=None, help="default: runs/<name>-<version>-<time>/report")
    p.add_argument("--cache-dir", default=None, help="paired states cache root (default: $TMOD_CACHE_DIR, else "
                   "$XDG_CACHE_HOME/tmod, else ~/.cache/tmod)")
    p.add_argument("--batch-size", type=at_least(1), default=64, help="backbone batch size")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda")
    p.add_argument("--threads", type=at_least(0), default=0,
                   help="CPU threads (0: one per core, or a container's smaller CPU quota)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars (default: only when stderr is a terminal)")


def add_bridge_command(commands) -> None:
    """`tmod-train bridge` (training/bridges/transformer.py): a transformer bridge, trained (MSE or
    distillation)."""
    p = commands.add_parser("bridge", help="transformer bridge: serve TARGET's modules on SOURCE; trained on "
                                           "paired states (MSE) or through a frozen target module (distill)")
    p.add_argument("--config", default=None, help="YAML or JSON file of settings (same names as the options, '_' or "
                                                   "'-'); the command line wins")
    p.add_argument("--source", default=None, help="backbone the bridge is served on: minilm (default), smollm2, mpnet, a folder")
    p.add_argument("--target", default=None, help="backbone the foreign modules were trained on (default: smollm2)")
    p.add_argument("--source-layers", default=None, help="source states mixed: 'all' (default), '0-6', '2,4,6'")
    p.add_argument("--target-layers", default=None,
                   help="target states produced: default the module's states, else all; '0,5,10,15,20,25,30'")
    p.add_argument("--objective", choices=["mse", "distill"], default=None, help="default: mse")
    p.add_argument("--module", default=None, help="a module of the TARGET backbone (TASK/VERSION of the shipped "
                   "store, or a STORE/TASK[/VERSION] folder): the teacher for distill; for mse only measured "
                   "(agreement with its teacher)")
    p.add_argument("--temperature", type=float, default=None, help="distill: softmax temperature (default 2)")
    p.add_argument("--ce-weight", type=float, default=None, help="distill: hard-label cross-entropy weight (default 0)")
    p.add_argument("--mse-weight", type=float, default=None, help="distill: log(1+MSE) state term weight (default 0)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--dataset", default=None, help="preset whose texts are paired: train split to train, "
                        "validation split to validate (default: sst2)")
    source.add_argument("--texts", default=None, help="a UTF-8 file of your texts, one a line (the domain the "
                        "bridge will serve), paired instead: a seeded tenth held out for validation; no labels")
    p.add_argument("--data-dir", default=None, help="default: $TMOD_DATA_DIR, else ../shared/data")
    p.add_argument("--max-texts", type=int, default=None, help="seeded random subset of the training texts")
    p.add_argument("--max-validation", type=int, default=None, help="seeded random subset of the validation texts")
    p.add_argument("--cache-dir", default=None, help="paired states cache root (default: $TMOD_CACHE_DIR, else "
                   "$XDG_CACHE_HOME/tmod, else ~/.cache/tmod)")
    for name, kind, note in (("d-model", int, 256), ("heads", int, 4), ("encoder-layers", int, 2),
                             ("decoder-layers", int, 2), ("ffn-dim", int, 1024), ("dropout", float, 0.1),
                             ("token-dim", int, 64), ("max-positions", int, 512), ("mix-alpha", float, 32.0),
                             ("lr", float, 3e-4),
                             ("weight-decay", float, 0.01), ("batch-size", int, 32), ("eval-batch-size", int, 64),
                             ("epochs", int, 20), ("patience", int, 3), ("lr-patience", int, 1),
                             ("warmup-steps", int, 200), ("grad-clip", float, 1.0), ("seed", int, 0),
                             ("threads", int, 0)):
        p.add_argument(f"--{name}", type=kind, default=None, help=f"default: {note}")
    p.add_argument("--max-minutes", type=float, default=None, help="start no epoch that would end past this many "
                   "minutes of training; the best epoch so far is kept (default: no budget)")
    p.add_argument("--standardise", action=argparse.BooleanOptionalAction, default=None,
                   help="per-dimension standardised source mix and target predictions (default: yes)")
    p.add_argument("--device", default=None, help="auto (default), cpu, cuda")
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None, help="bf16 autocast on CUDA (default: no)")
    p.add_argument("--bridge-store", default=None, help="default: modules_store/_bridges")
    p.add_argument("--name", default=None, help="default: <source>-to-<target>-<objective>[-<task>]")
    p.add_argument("--version", type=version_name, default=None,
                   help="default: the next free number of this name in the bridge store")
    p.add_argument("--report-dir", default=None, help="default: runs/bridge-<name>-<version>-<time>/report")
    p.add_argument("--run-dir", default=None, help="default: runs/bridge-<name>-<version>-<time>")
    p.add_argument("--description", default=None, help="what the bridge's manifest says it is (default: 'transformer "
                   "bridge SOURCE -> TARGET, OBJECTIVE objective')")
    p.add_argument("--overwrite", action=argparse.BooleanOptionalAction, default=None,
                   help="replace a --version the store holds (else it is refused before training)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars (default: only when stderr is a terminal)")


def add_embedding_command(commands) -> None:
    p = commands.add_parser("embedding", help="write a backbone's embedding module (its sentence-transformers "
                            "pooling and normalisation; nothing is trained) and check it against the reference")
    p.add_argument("--backbone", default=None, help="backbone folder, or a named one: minilm (default), mpnet, smollm2")
    p.add_argument("--task", default="embedding", help="task name (default: embedding)")
    p.add_argument("--version", type=version_name, default=None,
                   help="default: the next free number of the task in the store")
    p.add_argument("--store", default=None, help="module store (default: the shipped modules_store/)")
    p.add_argument("--overwrite", action="store_true", help="replace a --version the store holds")
    p.add_argument("--check", type=at_least(0), default=872, help="SST-2 validation sentences compared with "
                   "sentence-transformers (0: no check; default: all 872)")
    p.add_argument("--data-dir", default=None, help="folder of the datasets (default: $TMOD_DATA_DIR)")
    p.add_argument("--threads", type=at_least(0), default=None,
                   help="CPU threads (default: one per core, or a container's smaller CPU quota)")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandLineParser(prog="tmod-train", description="Train and evaluate tmod task heads.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    # not required=True: argparse then says "the following arguments are required: command"
    commands = parser.add_subparsers(dest="command")

    add_train_command(commands, "layermix", "train a layer-mix head: a learned mix of the backbone's layers read by a "
                      "small classifier or tagger (start here; docs/training.md)")
    add_train_command(commands, "mtb", "train a Modular Transformer Block head (copies of the last blocks)")
    add_train_command(commands, "lora-mtb", "train a LoRA-MTB head (frozen block copies + low-rank updates)")

    e = commands.add_parser("eval", help="score a stored module on a labelled file (served path)")
    e.add_argument("--store", default=None, help="module store (default: the shipped modules_store/)")
    e.add_argument("--task", required=True, help="the stored module's task name, or TASK/VERSION (e.g. sentiment/1)")
    e.add_argument("--version", type=version_name, default=None, help="default: the latest, on its own backbone; "
                   "with --backbone, the version a tmod-serve on that backbone (and --bridges) answers with")
    e.add_argument("--dataset", default=None, help="preset to score on (default, without --file: the preset the "
                   "module was trained on)")
    e.add_argument("--split", default=None, choices=["train", "validation", "test"],
                   help="with --dataset: the preset's split (train or validation; default validation); with --file: "
                        "the part the module's training run carved from that file with its --split (the same rows: "
                        "test scores its held-out rows again); default the whole file")
    e.add_argument("--file", default=None, help="labelled file to score on (instead of a preset)")
    add_data_options(e, default=None)
    e.add_argument("--max-examples", type=at_least(1), default=None, help="score a seeded random subset")
    e.add_argument("--backbone", default=None, help="backbone folder, or a named one: minilm, smollm2, mpnet "
                                                     "(default: the module's own); another needs --bridges")
    e.add_argument("--bridges", default=None, help="bridge store: a module of another backbone scored through the "
                                                    "bridge that serves it on --backbone, as tmod-serve --bridges serves it")
    e.add_argument("--batch-size", type=at_least(1), default=128, help="backbone batch size (default: 128)")
    e.add_argument("--device", default="auto", help="auto (default), cpu, cuda")
    e.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="fp32",
                   help="backbone precision (backend torch), as the module is served")
    e.add_argument("--output", default=None, help="also write the metrics JSON here")
    e.add_argument("--predictions", default=None, metavar="FILE",
                   help="also write the module's answer to every scored row here, one JSON line each in the order "
                        "scored: the text (a token task's words), the gold answer, the answer the metrics counted "
                        "and, for a sequence or multi-label task, every label's probability")
    e.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars (default: only when stderr is a terminal)")
    add_align_command(commands)
    add_bridge_command(commands)
    add_embedding_command(commands)
    parser.command_names = list(commands.choices)  # for main's line when none is given
    return parser


def _document_defaults(parser: argparse.ArgumentParser) -> None:
    """Append each knob's default (from TrainSettings, or per task type) to its help text."""
    from modules_store import TaskType
    from training.settings import TASK_DEFAULTS, TrainSettings

    sequence, token = TASK_DEFAULTS[TaskType.sequence_classification], TASK_DEFAULTS[TaskType.token_classification]
    for action in parser._actions:
        field = TrainSettings.model_fields.get(action.dest)
        if field is None or "default" in (action.help or ""):
            continue
        if action.dest in sequence:
            note = f"default: {sequence[action.dest]} sequence / {token[action.dest]} token tasks"
        elif field.default is not None:
            note = f"default: {field.default}"
        else:
            continue
        action.help = f"{action.help} ({note})" if action.help else note


def settings_from_args(args: argparse.Namespace):
    """Config file values, overridden by the options given on the command line."""
    from training.settings import TrainSettings, read_config_file

    values = read_config_file(args.config) if args.config else {}
    given = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    return TrainSettings(**{**values, **given})


def cmd_train(args: argparse.Namespace, command: str) -> int:
    from training.splits import resolve_data

    settings = settings_from_args(args)
    splits = resolve_data(settings)  # the user's files and options checked before torch is imported
    quiet_transformers(args)

    from training.trainer import train

    result = train(settings, command=command, config_file=args.config, splits=splits)

    def headline(metrics: dict) -> dict:
        return {k: v for k, v in metrics.items() if isinstance(v, (int, float, str))}

    def scores(baselines: dict) -> dict:  # each baseline's score on the compared metric (or why it has none)
        return {k: (v.get(baselines["metric"], v.get("error")) if isinstance(v, dict) else v)
                for k, v in baselines.items()}

    summary = {"task": result.task, "version": result.version, "artifact": str(result.artifact),
               "report": str(result.report_dir), "validation": headline(result.metrics)}
    if "validation_baselines" in result.metrics:  # with a test split: the validation rows' own baselines
        summary["validation_baselines"] = scores(result.metrics["validation_baselines"])
    if "test" in result.metrics:
        summary["test"] = headline(result.metrics["test"])
    summary["baselines"] = scores(result.metrics["baselines"])
    summary["loaded_into" if result.loaded_into else "serve"] = result.loaded_into or result.serve
    summary["query"] = result.request
    print(json.dumps(summary, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one command; a user's mistake (UsageError, a setting out of range) is one line and exit 2, a
    stored artifact that cannot be used as asked (ArtifactError) one line and exit 1."""
    from pydantic import ValidationError

    from modules_store import ArtifactError
    from training.data.files import UsageError

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error(f"say which command: {', '.join(parser.command_names)} (start with layermix: docs/training.md)")
    if getattr(args, "progress", S) is None:  # bars only where someone watches them
        args.progress = sys.stderr.isatty()
    try:
        return run_command(args, argv)
    except (UsageError, FileNotFoundError) as exc:  # FileNotFoundError: a backbone not there, as Backbone.load names it
        print(f"tmod-train {args.command}: error: {exc}", file=sys.stderr)
    except ArtifactError as exc:  # a name no store takes, a stored module or bridge that is broken: its reason
        print(f"tmod-train {args.command}: error: {exc.message}", file=sys.stderr)
        return 1
    except OSError as exc:  # the machine's, not the user's: a full disk, a folder made read-only meanwhile
        print(f"tmod-train {args.command}: error: {exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""),
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before a first epoch was kept (else the run finishes with the best so far)
        print(f"tmod-train {args.command}: interrupted before the run finished", file=sys.stderr)
        return 130
    except ValidationError as exc:
        first = exc.errors()[0]
        where = "--" + "-".join(str(part) for part in first["loc"]).replace("_", "-") if first["loc"] else "settings"
        if first["type"] == "extra_forbidden" and getattr(args, "config", None):  # only a config file can name one
            from server.errors import did_you_mean

            if args.command == "bridge":
                from training.bridges.transformer import BridgeSettings
                fields = BridgeSettings.model_fields
            else:
                from training.settings import TrainSettings
                fields = TrainSettings.model_fields
            name = str(first["loc"][0])
            ours = TRAINING_ARGUMENTS.get(name)  # a Hugging Face Trainer config's names, reused
            hint = f" (tmod-train calls it {ours!r})" if ours else did_you_mean([name], fields)
            print(f"tmod-train {args.command}: error: --config {args.config}: {name!r} is not a setting{hint}",
                  file=sys.stderr)
        else:
            print(f"tmod-train {args.command}: error: {where}: {str(first['msg']).removeprefix('Value error, ')}",
                  file=sys.stderr)
    return 2


def quiet_transformers(args: argparse.Namespace) -> None:
    """transformers' own progress bars (its "Loading weights" one too) off where ours are: by the variable
    it reads when imported, not by importing it (seconds before a usage error could be said); by its
    switch where it is imported already."""
    if not getattr(args, "progress", sys.stderr.isatty()):
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        if "transformers" in sys.modules:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()


def run_command(args: argparse.Namespace, argv: list[str]) -> int:
    from server.backbone.sources import backbone_problem
    from training.data.files import UsageError

    for option in ("backbone", "source", "target"):  # a typo said at once, not after torch's seconds of import
        named = getattr(args, option, None)
        if isinstance(named, str) and (problem := backbone_problem(named)):
            raise UsageError(problem)
    if args.command in ("layermix", "mtb", "lora-mtb"):
        return cmd_train(args, shlex.join(["tmod-train", *argv]))  # checks the data first, then quiet_transformers
    quiet_transformers(args)
    if args.command == "align":
        from training.bridges.align import cmd_align

        return cmd_align(args, shlex.join(["tmod-train", *argv]))
    if args.command == "bridge":
        from training.bridges.transformer import cmd_bridge

        return cmd_bridge(args, shlex.join(["tmod-train", *argv]))
    if args.command == "embedding":
        from training.embedding import cmd_embedding

        return cmd_embedding(args, shlex.join(["tmod-train", *argv]))
    from training.eval_command import cmd_eval

    return cmd_eval(args)


if __name__ == "__main__":
    sys.exit(main())
