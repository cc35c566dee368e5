"""`tmod-train eval`: score a stored module the way the server runs it, on a preset's split or on a
file, and say what that file was to the module's training run (training, validation, test, or
held out, counted) beside the majority answer on the same rows.

    tmod-train eval --store modules_store --task sentiment --dataset sst2
    tmod-train eval --task sentiment --file reviews.csv --text-column review --label-column stars
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable


def label_map_guess(seen: list[str], head_labels: list[str]) -> str:
    """`--label-map` for a file whose labels are spelt otherwise than the head's (a map names every
    label of the file): each paired with the one head label it is, begins or is begun by (any case:
    positive=pos, NEG=negative), else a pattern."""
    def match(label: str) -> list[str]:
        if label in head_labels:
            return [label]
        return [head for head in head_labels
                if label.lower().startswith(head.lower()) or head.lower().startswith(label.lower())]

    guesses = [match(label) for label in seen]
    if all(len(found) == 1 for found in guesses):
        return ",".join(f"{label}={found[0]}" for label, found in zip(seen, guesses))
    return "FILE_LABEL=HEAD_LABEL,..."


def cmd_eval(args: argparse.Namespace) -> int:
    from modules_store import DEFAULT_STORE, ArtifactError, ModuleStore, TaskType, sha256_file
    from server.errors import did_you_mean
    from training.data.files import UsageError
    from training.settings import checked_version

    # the user's mistakes first, before torch is imported (seconds) and a backbone loaded
    if args.dataset and args.file:
        raise UsageError("give one of --dataset NAME or --file FILE, not both")
    if args.bridges and not Path(args.bridges).is_dir():
        raise UsageError(f"--bridges {args.bridges}: no such folder (a bridge store, as tmod-serve --bridges takes)")
    for option, path in (("--output", args.output), ("--predictions", args.predictions)):
        if path:  # found out after the scoring, it cost the whole run
            check_output_file(Path(path), option)
    if "/" in args.task:  # TASK/VERSION, as tmod-serve --tasks and --distill-from name a module
        args.task, _, version = args.task.partition("/")
        if args.version not in (None, version):
            raise UsageError(f"--task {args.task}/{version} names version {version}, --version {args.version}: give one")
        try:
            args.version = checked_version(version)
        except ValueError as exc:
            raise UsageError(f"--task {args.task}/{version}: {exc}") from None
    store = ModuleStore(args.store or DEFAULT_STORE)
    if args.task not in store.tasks():
        raise UsageError(f"no task {args.task!r} in the store {store.root}; its tasks: "
                         f"{', '.join(store.tasks()) or 'none'}{did_you_mean([args.task], store.tasks())}")
    try:
        manifest = store.read_manifest(args.task, args.version)  # the latest: the version scored on its own backbone
    except ArtifactError as exc:
        if args.version is not None and args.version not in store.versions(args.task):
            raise UsageError(exc.message) from None  # a version the store lacks: a mistake, not a broken store
        raise
    loaded = None
    if args.version is None and args.backbone:  # the version a server on --backbone answers with: known once loaded
        loaded = eval_module(args, store, manifest)
        manifest = loaded[1].manifest
    if not args.dataset and not args.file:
        args.dataset = preset_trained_on(manifest)
    spec, data = eval_data(args, manifest)
    from server.backbone import Backbone
    from server.engine import Engine
    from training.evaluate import score_module
    from training.states import Split

    backbone, module, bridges, own = loaded or eval_module(args, store, manifest)
    split = Split(data, module.head.labels, backbone)
    through = f"{module.bridge}/{bridges[module.bridge].version}" if module.bridge else None
    if through:
        print(f"tmod-train eval: {args.task}/{module.version} scored on {backbone.name} through bridge {through}",
              file=sys.stderr)
    token_task = manifest.task_type == TaskType.token_classification
    answers = split  # where a token task's tags are read: a bridge that re-tokenizes answers on the target's tokens
    if token_task and module.retokenized:
        if own is None:
            raise UsageError(f"{args.task}/{manifest.version} tags the tokens of {manifest.backbone.name!r}, which has "
                             "no name here: it cannot be scored through a bridge")
        answers = Split(data, module.head.labels, Backbone.load(own, device=str(backbone.device)))
    answered: list = []  # the module's answer per row, for the margins' intervals
    metrics = score_module(split, module, args.batch_size, progress=args.progress,
                           engine=Engine(backbone, bridges=bridges), answer_split=answers, probabilities=answered)
    ran, validation_role = run_data(module.manifest), module.manifest.metrics.get("role", "chose the epoch")
    role = file_role(module.manifest.training.get("data", {}), sha256_file(spec.path), validation_role,
                     args.split if args.file else None, held_out=lambda: rows_learnt(data, ran, validation_role))
    if not role.startswith(("test", "not a file")) or "not wholly unseen" in role:  # a score that flatters: said
        print(f"tmod-train eval: {spec.path}: {role}", file=sys.stderr)
    result = {"task": module.task, "version": module.version, "backbone": backbone.name, "bridge": through,
              "file": str(spec.path), **({"split": args.split or "validation"} if args.split or args.dataset else {}),
              "file_role": role,
              "manifest_metrics": {k: v for k, v in module.manifest.metrics.items() if not isinstance(v, dict)},
              "metrics": metrics, "baseline": eval_baseline(split, module, metrics, ran, answered)}
    if args.predictions:
        write_predictions(Path(args.predictions), answers, answered, (module.manifest.decoding or {}).get("thresholds"))
    text = json.dumps(result, indent=2)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text + "\n")
    print(text)
    return 0


def run_data(manifest) -> tuple:
    """(the module's training run's data: its training and validation rows, "") read again as its
    manifest records them (its settings, the `--split` carve and `--max-train` included, the training
    file checked by its sha256), or (None, why they cannot be read here)."""
    import contextlib
    import io

    from pydantic import ValidationError

    from training.data.files import UsageError
    from training.settings import TrainSettings
    from training.splits import resolve_data

    trained, recorded = manifest.training.get("settings"), manifest.training.get("data", {})
    if not trained or not recorded.get("train_sha256"):
        return None, "the module records no tmod-train run to check against"
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # what the run's data holds was said when it trained
            run = resolve_data(TrainSettings(**trained))
    except ValidationError as exc:  # settings an older tmod-train recorded
        first = exc.errors()[0]
        return None, f"its recorded settings are not this tmod-train's: {'.'.join(map(str, first['loc']))}: " \
                     f"{first['msg']}"
    except UsageError as exc:  # a file moved or gone
        return None, f"its training data cannot be read here: {str(exc).splitlines()[0][:200]}"
    if run.provenance["train_sha256"] != recorded["train_sha256"]:
        return None, f"its training file {recorded.get('train_file')} has changed since"
    return run, ""


def rows_learnt(data, ran: tuple, validation_role: str) -> str:
    """What `file_role` says of a file of none of the run's parts: how many of its rows hold a text the
    module's training rows hold, and the validation rows where validation chose something (`ran`:
    `run_data`), or why that cannot be told here."""
    from training.metrics import rows_seen  # (numpy, scipy, the heads: after eval's checks)
    from training.splits import rows_also_in

    run, why = ran
    if run is None:
        return f"held out, unless it shares rows with the training file ({why})"
    shared = {"file_examples": len(data), "file_rows_also_in_training": rows_also_in(data, run.train),
              "file_rows_also_in_validation": rows_also_in(data, run.validation)}
    if seen := rows_seen(shared, "file", validation_role):
        return f"not wholly unseen: {seen}"
    return f"held out: none of its {len(data)} rows holds a text the training rows hold"


def check_output_file(path: Path, option: str = "--output") -> None:
    """`option` names a file that can be written (its folder is made when the file is written)."""
    from training.data.files import UsageError
    from training.runs import cannot_make

    if path.is_dir():
        example = "eval.json" if option == "--output" else "predictions.jsonl"
        raise UsageError(f"{option} {path}: a folder; give a file's name, e.g. {path / example}")
    why = cannot_make(path.parent)
    if why:
        raise UsageError(f"{option} {path}: {why}")


def write_predictions(path: Path, split, probabilities: list, thresholds: dict | None) -> None:
    """--predictions: one JSON line a scored row, in the order scored: its text (and text pair), or a
    token task's words; the gold answer; the module's answer as the metrics counted it (the most
    probable label, the labels at or over their thresholds, each word's tag); a sequence or multi-label
    task's probability of every label. For reading where the module fails, row by row."""
    from training.assess import head_answers

    gold, answered = head_answers(split, probabilities, thresholds)
    labels = split.labels
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for r, example in enumerate(split.data.examples):
            if split.is_token_task:
                line = {"words": example.words, "gold": gold[r], "predicted": answered[r]}
            else:
                line = {"text": example.text, **({"text_pair": example.text_pair} if example.text_pair else {}),
                        # a multi-label row's gold labels in the head's order, as its predicted ones
                        "gold": [label for label in labels if label in gold[r]] if split.is_multi_label else gold[r],
                        "predicted": answered[r],
                        "probabilities": {label: round(float(p), 6) for label, p in zip(labels, probabilities[r])}}
            out.write(json.dumps(line, ensure_ascii=False) + "\n")


def preset_trained_on(manifest) -> str:
    """What `tmod-train eval` scores without --dataset or --file: the preset the module was trained on
    (said); a module trained on one's own files, or not trained, needs one named."""
    from training.data.files import UsageError
    from training.data.presets import PRESETS

    recorded = manifest.training.get("data", {})
    preset = recorded.get("dataset")
    name = f"{manifest.task}/{manifest.version}"
    if preset in PRESETS:
        print(f"tmod-train eval: {name} scored on {preset}, the preset it was trained on (--dataset or --file to "
              "choose another)", file=sys.stderr)
        return preset
    files = [f"{part} {recorded[f'{part}_file']}" for part in ("validation", "test") if recorded.get(f"{part}_file")]
    raise UsageError("give --dataset NAME or --file FILE to score on" + (
        f": {name} was trained on files of its own ({'; '.join(files)})" if files else
        f": {name} was not trained on a preset" if recorded else f": {name} records no training data"))


def eval_data(args: argparse.Namespace, manifest):
    """(spec, data): the labelled rows `tmod-train eval` scores, read as the options (or the module's
    training run) say, and refused in one line where the module cannot answer them."""
    from modules_store import TaskType
    from training.data.files import UsageError
    from training.data.presets import PRESETS, file_spec, preset_spec
    from training.settings import parse_label_map

    if args.dataset:
        if args.dataset not in PRESETS:
            raise UsageError(f"unknown dataset {args.dataset!r}; presets: {sorted(PRESETS)}")
        if args.split == "test":
            raise UsageError(f"--split test: the {args.dataset} preset has train and validation splits (its test "
                             "labels are not published)")
        spec = preset_spec(PRESETS[args.dataset], args.split or "validation", args.data_dir)
    else:
        columns_as_in_training(args, manifest)
        spec = file_spec(args.file, args.format, args.text_column, args.label_column, args.pair_column,
                         args.header is not False, parse_label_map(args.label_map),
                         multi_label=manifest.task_type == TaskType.multi_label_classification)
    data = spec.read()
    if args.file and not args.label_map and not set(data.labels_seen()) <= set(manifest.labels):
        spec, data = named_as_in_training(spec, data, manifest)
    pairs = trained_on_pairs(manifest)
    if data.has_pairs != pairs:  # a pair task scored on single texts (or the reverse) scores nothing it answers
        raise UsageError(f"{spec.path}: {args.task} compares a text with a text pair; give --pair-column" if pairs else
                         f"{spec.path}: {args.task} reads single texts; leave out --pair-column")
    if args.file and args.split:
        data = carved_part(spec, data, manifest, args.split)
    data = data.subset(args.max_examples, seed=0)
    token_task = manifest.task_type == TaskType.token_classification
    if (data.task_type == TaskType.token_classification) != token_task:
        hint = " (a CoNLL file under another name? give --format conll)" if token_task else ""
        raise UsageError(f"{spec.path}: holds {data.task_type.value} data and {args.task} is a "
                         f"{manifest.task_type.value} task{hint}")
    head_labels = manifest.labels
    unknown = sorted(set(data.labels_seen()) - set(head_labels))
    if unknown:
        named = label_map_guess(sorted(set(data.labels_seen())), head_labels)
        hint = "; class ids need their names: --label-map 0=NAME,1=NAME,..." if all(map(str.isdigit, unknown)) \
            else f"; name them as the head does with --label-map {named}"
        raise UsageError(f"{spec.path}: label(s) {unknown} are not among {args.task}'s labels {head_labels}{hint}")
    return spec, data


def carved_part(spec, data, manifest, part: str):
    """The rows of `data` (the file the module's training run carved its parts from with --split) that the
    run carved as `part`: the same carve, with the fractions and seed its manifest records."""
    from modules_store import sha256_file
    from training.data.files import UsageError
    from training.splits import carve

    recorded = manifest.training.get("data", {})
    carving = recorded.get("split")
    if not carving or sha256_file(spec.path) != recorded.get("train_sha256"):
        raise UsageError(f"--split {part} with --file scores a part the module's training run carved from that file; "
                         f"{manifest.task}/{manifest.version}'s run " + (
                             f"carved its parts from {recorded.get('train_file')}, not from {spec.path}" if carving
                             else "carved none (it was given --validation): leave out --split"))
    data, _ = data.with_entities_begun_with_b()  # as the run read it before carving
    parts = dict(zip(("train", "validation", "test"),
                     carve(data, carving["fractions"], carving["seed"], carving.get("units") == "documents")))
    if parts[part] is None:
        raise UsageError(f"--split test: {manifest.task}/{manifest.version}'s run carved no test part from "
                         f"{spec.path} (its --split was {','.join(map(str, carving['fractions']))})")
    return parts[part]


def eval_module(args: argparse.Namespace, store, manifest):
    """(backbone, module, bridges, own): the module loaded as the server would load it, on its own
    backbone (`own`, its name here) or on --backbone through a bridge of --bridges."""
    from modules_store import ArtifactError
    from server.backbone import Backbone
    from server.backbone.sources import named_for
    from server.bridges import bridge_store, load_bridges_on
    from server.modules import load_module
    from server.probe import probe_module
    from training.data.files import UsageError
    from training.settings import pick_device

    own = named_for(manifest.backbone.name)
    if not (args.backbone or own):
        raise UsageError(f"{args.task}/{manifest.version} runs on {manifest.backbone.name!r}, which has no name here; "
                         "give its folder with --backbone")
    device = str(pick_device(args.device))
    backbone = Backbone.load(args.backbone or own, device=device)
    if args.precision != "fp32":
        backbone = backbone.use_backend("torch", args.precision)
    bridges = {}
    if args.bridges:
        bridges, _, refused = load_bridges_on(bridge_store(args.bridges), backbone, device)
        for name, exc in refused.items():  # as the server logs them: a broken bridge is no silent absence
            print(f"tmod-train eval: bridge {name} refused: {exc.message}", file=sys.stderr)
    try:
        module = load_module(store, args.task, args.version, backbone, device=device, bridges=bridges,
                             probe=probe_module)
    except ArtifactError as exc:
        if exc.reason not in ("fingerprint_mismatch", "other_backbone"):
            raise
        which = (f"{args.task}/{manifest.version} runs on {manifest.backbone.name}, not on {backbone.name}"
                 if args.version else f"no version of {args.task} runs on {backbone.name} (the latest, "
                                      f"{manifest.version}, runs on {manifest.backbone.name})")
        raise UsageError(f"{which}, "
                         + (f"and no bridge in {args.bridges} leads there" if args.bridges else
                            f"and no --bridges store was given to lead there; leave out --backbone to score it on its "
                            f"own ({own or 'its folder'})")) from None
    return backbone, module, bridges, named_for(module.manifest.backbone.name)


def eval_baseline(split, module, metrics: dict, ran: tuple, probabilities: list) -> dict:
    """The simple answers on the same rows beside the module's score, also said on stderr: every row
    given the file's own most frequent label (chosen on this file, so the best any constant answer
    scores here: no head should need a backbone to beat it), and the linear model (TF-IDF + logistic
    regression, the window tagger for token tasks) trained on the module's training rows (`ran`:
    `run_data`), as tmod-train compared it: does the head beat a bag of words on this file? Each
    margin with its paired bootstrap interval (the module's `probabilities` as `score_module` gives
    them); one that holds 0 is said to be within the noise of the file's rows."""
    from modules_store import TaskType
    from server.backbone.sources import default_cache_dir
    from training.assess import baseline_runs, head_answers, linear_baseline, too_few
    from training.baselines import majority
    from training.metrics import LEVEL, drawn_unit, interval_text, margin_interval, within_noise

    data, task_type, labels = split.data, module.manifest.task_type, module.head.labels
    gold, answered = head_answers(split, probabilities, (module.manifest.decoding or {}).get("thresholds"))
    constant = majority(gold, gold, multi_label=task_type == TaskType.multi_label_classification, labels=labels)
    seed = module.manifest.training.get("settings", {}).get("seed", 0)
    metric = module.manifest.metrics.get("metric") or next(k for k in ("f1", "accuracy", "f1_macro") if k in metrics)
    constant_is = {TaskType.token_classification: "every word tagged with the file's most frequent tag",
                   TaskType.multi_label_classification: "every row answered with the file's most frequent label set"
                   }.get(task_type, "every row answered with the file's most frequent label")

    def noise(other: dict, into: dict) -> str:
        """The margin's interval over `other`'s answers, kept in `into`; its words for stderr."""
        interval = answered and margin_interval(task_type, metric, gold, answered, other["answers"], labels, seed)
        if not interval:
            return ""
        into["margin_interval"] = [round(end, 6) for end in interval]
        return (f", {LEVEL:.0%} paired bootstrap interval {interval_text(interval)}"
                + (f": within the noise of these {len(gold)} {drawn_unit(task_type)}"
                   if within_noise(interval) else ""))

    baseline = {"metric": metric, "head": metrics[metric], "majority_in_file": constant[metric],
                "margin": round(metrics[metric] - constant[metric], 6),
                "majority_in_file_is": f"{constant_is} (chosen on it)"}
    said = (f"{metric} {metrics[metric]:.4f} against {constant[metric]:.4f} for {constant_is} "
            f"({baseline['margin']:+.4f}{noise(constant, baseline)})")
    run, why = ran
    name = linear_baseline(task_type)
    if run is None:
        baseline["linear"] = {"model": name, "not_fitted": why}
    else:
        rows = run.train
        print(f"tmod-train eval: fitting the linear baseline ({name}) on the module's {len(rows):,} training rows "
              "(kept in the cache for the next eval of this file)", file=sys.stderr)
        [(_, linear)] = baseline_runs(rows, [data], labels, seed, default_cache_dir() / "baselines",
                                      module.manifest.training["settings"].get("class_weights") == "balanced")
        if metric in linear:
            baseline["linear"] = {"model": name, metric: linear[metric],
                                  "margin": round(metrics[metric] - linear[metric], 6),
                                  "trained_on": f"the module's {len(rows)} training rows"}
            said += (f", and {linear[metric]:.4f} for {name} trained on its training rows "
                     f"({baseline['linear']['margin']:+.4f}{noise(linear, baseline['linear'])})")
        else:
            baseline["linear"] = {"model": name, "error": linear.get("error", f"it scores no {metric}")}
    caveat = too_few(len(gold))
    if caveat:
        baseline["too_few_rows"] = caveat
    print(f"tmod-train eval: {said}" + (f"; {caveat}" if caveat else ""), file=sys.stderr)
    return baseline


def training_run(manifest):
    """(the settings of the tmod-train run that made the module, as its manifest records them; the
    preset it trained on, or None)."""
    from training.data.presets import PRESETS

    trained = manifest.training.get("settings", {})
    return trained, PRESETS.get(trained.get("dataset"))


def columns_as_in_training(args: argparse.Namespace, manifest) -> None:
    """The column options not given on the command line, as the module's training run read its files
    (its manifest records them), so a new file of the same layout needs none; said on stderr."""
    trained, _ = training_run(manifest)
    if not trained.get("train"):  # trained on a preset, or not by tmod-train: nothing to go by
        return
    taken = []
    for option in ("text_column", "pair_column", "label_column"):
        if getattr(args, option) is None and trained.get(option) is not None:
            setattr(args, option, trained[option])
            taken.append(f"--{option.replace('_', '-')} {trained[option]}")
    if args.header is None and trained.get("header") is False:
        args.header = False
        taken.append("--no-header")
    if args.format is None and trained.get("format") and Path(args.file).suffix == Path(trained["train"]).suffix:
        args.format = trained["format"]  # a layout its name does not say (a table named .txt), as in training
        taken.append(f"--format {trained['format']}")
    if taken:
        print(f"tmod-train eval: {args.file}: read as {manifest.task}'s training run read its files: {' '.join(taken)}",
              file=sys.stderr)


def trained_on_pairs(manifest) -> bool:
    """Whether the module was trained on a text with a text pair (pair pooling, a --pair-column, or a
    pair preset such as RTE)."""
    from server.modules import compares_pairs

    trained, preset = training_run(manifest)
    return compares_pairs(manifest) or trained.get("pair_column") is not None or \
        (preset is not None and preset.pair_column is not None)


def named_as_in_training(spec, data, manifest):
    """A scored file's class ids (0, 1, ...) named as the module's training run named its own files':
    by its --label-map (a preset's own, for a run on a preset), or by their place in its --labels (never
    by the module's label order alone: that need not be the ids' order). Else the file as read."""
    trained, preset = training_run(manifest)
    label_map = trained.get("label_map") or (dict(preset.label_map) if preset else None)
    seen = set(data.labels_seen())
    if label_map and seen <= set(label_map):
        spec = replace(spec, label_map=label_map)
        named = spec.read()
        how = (f"by the --label-map of {manifest.task}'s training run" if trained.get("label_map") else
               f"as the {preset.name} preset that {manifest.task} was trained on names them")
    elif trained.get("labels") and (named := data.named_by_position(trained["labels"])) is not data:
        how = f"by their place in the --labels of {manifest.task}'s training run"
    else:
        return spec, data
    print(f"tmod-train eval: {spec.path}: class ids named {how}", file=sys.stderr)
    return spec, named


def file_role(training_data: dict, sha256: str, validation_role: str, part: str | None, *,
              held_out: Callable[[], str]) -> str:
    """What a scored file was to the module's training run (its manifest's `training.data`, which
    records each file's sha256): a score on rows the head learnt from says nothing about new text.
    `validation_role`: what the validation split chose (the manifest's `metrics.role`); `part`: the
    part of the file the run carved (--split) that is scored, not the whole file; `held_out`: what is
    known of a file of none of the run's parts (called only for such a file: it may read the run's data)."""
    from training.metrics import optimistic, rows_seen  # (numpy, scipy, the heads: after eval's checks)

    if part is not None:  # `carved_part` checked that the run carved it from this file
        return {"train": "training: the part of this file the run carved for training, so this score is not held out",
                "validation": f"validation: the part of this file the run carved for validation; it {validation_role}"
                              f"{optimistic(validation_role)}",
                "test": "test: the part of this file the run carved for test, scored once at the end of training; it "
                        "chose nothing"}[part]
    if sha256 == training_data.get("train_sha256"):
        if training_data.get("split"):
            held_out = "test" if len(training_data["split"]["fractions"]) == 2 else "validation"
            return ("training: the file the run carved its training, validation (and test) rows from; most rows "
                    f"were trained on, so this score is not held out (--split {held_out} scores its {held_out} rows)")
        return "training: the head was trained on this file, so this score is not held out"
    if sha256 == training_data.get("validation_sha256"):
        return f"validation: this file {validation_role}{optimistic(validation_role)}"
    if sha256 == training_data.get("test_sha256"):
        seen = rows_seen(training_data, "test", validation_role)
        return "test: scored once at the end of training; it chose nothing" + (f"; not wholly unseen: {seen}"
                                                                               if seen else "")
    return f"not a file of the training run: {held_out()}"
