"""Which examples a training run learns from, selects on and is scored on: a preset's files or the
user's own (`--train` with `--validation`, or `--split` carved from it, and an optional `--test`), and
the head's labels. Every user mistake in them, and in the options that hang on the data (--metric,
--none-below, --distill-from) or on an optional package (peft), is a UsageError raised here, before
torch is imported (tmod-train checks these first: a wrong option costs a fraction of a second, not
the ~3-5 s of importing the training code)."""
from __future__ import annotations

import importlib.util
import random
import re
import sys
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from modules_store import DEFAULT_STORE, TaskType, sha256_file
from training.data.examples import LabelledData, label_order
from training.data.files import UsageError, guess_format
from training.data.presets import DataSpec, PRESETS, file_spec, preset_spec
from training.data.tables import is_number
from training.settings import METRICS, TASK_DEFAULTS, TrainSettings


@dataclass
class Splits:
    """What a run learns from, selects on and is finally scored on, with the head's labels."""

    train: LabelledData
    validation: LabelledData
    test: LabelledData | None
    labels: list[str]
    metric: str  # the selection metric: --metric, else the preset's, else the task type's default
    provenance: dict


def data_files(s: TrainSettings) -> tuple[dict, list[str] | None, str | None]:
    """(split -> the file spec it is read from, --labels or the preset's, the preset's metric): a preset's
    files, or the user's (--train with --validation or --split, and --test)."""
    if s.dataset:
        if s.train or s.validation or s.split:
            raise UsageError("give either --dataset or --train/--validation/--split, not both")
        if s.dataset not in PRESETS:
            raise UsageError(f"unknown dataset {s.dataset!r}; presets: {sorted(PRESETS)}")
        preset = PRESETS[s.dataset]
        specs = {split: preset_spec(preset, split, s.data_dir) for split in ("train", "validation")}
        if s.test:
            specs["test"] = replace(specs["validation"], path=Path(s.test), format=s.format or guess_format(Path(s.test)))
        if s.multi_label and not preset.multi_label:
            raise UsageError(f"--multi-label: preset {s.dataset!r} has one label per example")
        return specs, s.labels or list(preset.labels), preset.metric
    if not s.train:
        raise UsageError("give --dataset NAME, or --train FILE with --validation FILE or --split VAL[,TEST]")
    if bool(s.validation) == bool(s.split):
        raise UsageError("give one of --validation FILE or --split VAL[,TEST] (carved from --train)")
    if s.split and len(s.split) == 2 and s.test:
        raise UsageError("--split VAL,TEST carves a test split; give --split VAL with --test FILE")
    named = {"train": s.train, "validation": s.validation, "test": s.test}
    specs = {split: file_spec(path, s.format, s.text_column, s.label_column, s.pair_column, s.header,
                              s.label_map, s.multi_label) for split, path in named.items() if path}
    return specs, s.labels, None


def rows_also_in(part: LabelledData, other: LabelledData) -> int:
    """How many of `part`'s rows hold a text (and text pair) that a row of `other` holds."""
    texts = {text_key(ex) for ex in other.examples}
    return sum(text_key(ex) in texts for ex in part.examples)


def shared_rows(train: LabelledData, validation: LabelledData, test: LabelledData | None) -> dict:
    """Provenance counts of rows that are less held out than they look: validation and test rows whose
    text is also a training row's (files given apart may share texts), test rows validation holds too
    (validation chose the epoch), and training texts taught two answers (label noise)."""
    counts = {}
    for name, part in (("validation", validation), ("test", test)):
        if part is not None:
            counts[f"{name}_rows_also_in_training"] = rows_also_in(part, train)
    if test is not None:
        counts["test_rows_also_in_validation"] = rows_also_in(test, validation)
    if train.task_type != TaskType.token_classification:
        answers: dict = {}
        for ex in train.examples:
            answers.setdefault(text_key(ex), set()).add(ex.label if isinstance(ex.label, str) else frozenset(ex.label))
        counts["train_texts_labelled_two_ways"] = sum(len(labels) > 1 for labels in answers.values())
    return counts


def resolve_data(s: TrainSettings) -> Splits:
    """Train, validation and (optional) test splits, the head's labels, the selection metric and
    provenance. Every user mistake found here is a UsageError: nothing has touched a backbone yet."""
    specs, labels, metric = data_files(s)
    data = {split: spec.read() for split, spec in specs.items()}
    if labels and not s.label_map:  # class ids (0, 1, ...) named by their place in --labels
        data = {split: part.named_by_position(labels) for split, part in data.items()}
    begun = {}  # IOB1 tags (or slips): learnt as BIO, the order the server decodes tags in
    for split, part in data.items():
        data[split], begun[split] = part.with_entities_begun_with_b()
    train = data["train"]
    check_tag_names(train)
    check_label_column(train, specs["train"])
    say_labels_differing_in_case(train)
    provenance = {
        "dataset": s.dataset,
        **{f"{split}_file": str(spec.path) for split, spec in specs.items()},
        **{f"{split}_sha256": sha256_file(spec.path) for split, spec in specs.items()},
        "train_examples_in_file": len(train),
        **({"entities_begun_with_i": {split: n for split, n in begun.items() if n}} if any(begun.values()) else {}),
    }
    if s.split:
        by_documents = split_by_documents(train, s.split)
        train, data["validation"], carved_test = carve(train, s.split, s.seed, by_documents)
        if carved_test is not None:
            data["test"] = carved_test
        provenance["split"] = {"fractions": s.split, "seed": s.seed,
                               "stratified": {TaskType.sequence_classification: "by label",
                                              TaskType.multi_label_classification: "by label sets (iterative)"
                                              }.get(train.task_type, False),
                               "units": "documents" if by_documents else "texts",
                               "carved_from": str(specs["train"].path)}
    for split, part in data.items():
        if part.task_type != train.task_type:
            raise UsageError(f"{part.source} holds {part.task_type.value} data, the training file "
                             f"{train.task_type.value}: give both in one format (and --multi-label for both)")
    given = labels
    labels = label_order(train, labels)
    check_labels(train, given, labels, train)
    untaught = sorted(set(labels) - set(train.labels_seen()))
    if untaught and train.task_type != TaskType.token_classification:  # a tag set names tags a file may not use
        print(f"label(s) {untaught} of --labels have no training row: the head will not learn to answer them, and "
              "rows of theirs score as its misses", file=sys.stderr)
    validation, test = data["validation"], data.get("test")
    for part in (validation, test):
        if part is not None:
            check_labels(part, given, labels, train)
    provenance["validation_examples_in_file"] = len(validation)
    train = whole_documents(train, s.max_train, s.seed) if s.document_windows else train.subset(s.max_train, s.seed)
    validation = validation.subset(s.max_validation, s.seed)
    provenance.update(train_examples=len(train), validation_examples=len(validation))
    if test is not None:
        provenance["test_examples"] = len(test)
    provenance.update(shared_rows(train, validation, test))
    metric = check_options(s, train, labels, metric)
    return Splits(train, validation, test, labels, metric, provenance)


def check_options(s: TrainSettings, train: LabelledData, labels: list[str], preset_metric: str | None) -> str:
    """The options that depend on the training data (the selection metric, --class-weights,
    --none-below, --distill-from) or on an optional package (lora-mtb's peft) -> the selection metric."""
    task_type = train.task_type
    metric = s.metric or preset_metric or TASK_DEFAULTS[task_type]["metric"]
    if not (s.metric or preset_metric) and task_type == TaskType.token_classification and not entity_tags(train):
        metric = "word_accuracy"
        print(f"{train.source}: no tag is O nor begins with B-/I- (one tag a word, as part-of-speech tags are): "
              "the epoch is chosen on word accuracy, not entity F1 (--metric f1 for that)", file=sys.stderr)
    if metric not in METRICS[task_type] or (metric == "f1" and task_type != TaskType.token_classification
                                            and len(labels) != 2):
        raise UsageError(f"--metric {metric!r} is not available for {task_type.value} with {len(labels)} labels; "
                         f"choose from {METRICS[task_type]}")
    if s.class_weights != "none" and task_type != TaskType.sequence_classification:
        raise UsageError(f"--class-weights {s.class_weights}: only single-label sequence tasks (multi-label tasks choose "
                         "each label's threshold on validation; token tasks are scored on their entities)")
    if task_type == TaskType.sequence_classification and metric == "accuracy" and not s.metric \
            and s.class_weights == "none":  # accuracy by default, not chosen
        say_imbalance(train)
    if s.none_below is not None and task_type != TaskType.sequence_classification:
        raise UsageError("--none-below: only single-label classifiers answer 'none of these' "
                         "(multi-label tasks have per-label thresholds)")
    conll_tokens = task_type == TaskType.token_classification and train.examples[0].file_offset is not None
    if s.distill_from:
        if not conll_tokens:
            raise UsageError("--distill-from: only token tasks read from a CoNLL file (the teacher tags its words)")
        module_folder(s.distill_from)
    if s.document_windows and not conll_tokens:
        raise UsageError("--document-windows: only token tasks read from a CoNLL file (its documents are read in windows)")
    if s.kind == "lora-mtb" and importlib.util.find_spec("peft") is None:
        raise UsageError("tmod-train lora-mtb needs peft: pip install 'peft>=0.12' (or tmod's 'lora' extra)")
    return metric


ENTITY_TAG = re.compile(r"O|[BIESLU]-.+")  # server/heads/decode.py split_tag's prefixes, and O


def entity_tags(train: LabelledData) -> bool:
    """Whether a token task's tags mark entities (BIO, BIOES, BILOU: the entity F1 reads them so) rather
    than giving every word a tag of its own (part of speech), where entity F1 would score runs of
    like tags as entities."""
    return any(ENTITY_TAG.fullmatch(tag) for tag in train.labels_seen())


def module_folder(spec: str, option: str = "--distill-from") -> tuple[Path, str, str]:
    """(store folder, task, version) of a stored module named on the command line: a
    STORE/TASK/VERSION folder, TASK/VERSION in the shipped store, or a STORE/TASK folder (its newest
    version). Found from the files alone: the data's checks run before torch is imported."""
    path = Path(spec)
    if (path / "manifest.json").is_file():
        return path.parent.parent, path.parent.name, path.name
    parts = [p for p in spec.split("/") if p]
    if len(parts) == 2 and (DEFAULT_STORE / parts[0] / parts[1] / "manifest.json").is_file():
        return DEFAULT_STORE, parts[0], parts[1]
    versions = []
    if path.is_dir():
        from modules_store import ModuleStore  # reads tensors, imports torch: only for this form

        versions = ModuleStore(path.parent).versions(path.name)
    if versions:
        return path.parent, path.name, versions[-1]
    raise UsageError(f"{option} {spec!r}: no such module; give TASK/VERSION of the shipped store (e.g. "
                     "sentiment/mpnet-2), a STORE/TASK/VERSION folder or a STORE/TASK folder (its newest version)")


def check_tag_names(train: LabelledData) -> None:
    """Word tags given as class ids (a Hugging Face token dataset's `ner_tags`) need their names: as
    ids, no tag says where an entity begins. Words all tagged alike leave nothing to learn."""
    if train.task_type == TaskType.token_classification and len(train.labels_seen()) == 1:
        raise UsageError(f"{train.source}: every word is tagged {train.labels_seen()[0]!r}: no entity to learn (a "
                         "CoNLL file's last column holds each word's tag: B-PER, I-PER, O, ...)")
    if train.task_type == TaskType.token_classification:  # a tag column holding words: the wrong column, or
        counts = Counter(tag for ex in train.examples for tag in ex.tags)  # WikiNER's "word|POS|tag" tokens
        once = [tag for tag, n in counts.items() if n == 1]
        if len(counts) > 100 and len(once) > len(counts) / 2:
            raise UsageError(f"{train.source}: {len(counts)} different tags, {len(once)} of them on one word only "
                             f"({', '.join(map(repr, once[:3]))}, ...): words, not tags; a CoNLL file is one word a "
                             "line, its tag the last column (WikiNER's sentence a line of word|POS|tag tokens becomes "
                             "one: sed -E 's/ +/\\n/g; s/\\|[^|]*\\|/ /g; s/$/\\n/' FILE > FILE.conll)")
    if train.task_type == TaskType.token_classification and all(tag.isdigit() for tag in train.labels_seen()):
        seen = train.labels_seen()
        raise UsageError(f"{train.source}: the tags are class ids ({', '.join(sorted(seen, key=int)[:6])}"
                         f"{', ...' if len(seen) > 6 else ''}): name them with --labels O,B-PER,I-PER,... in their "
                         "order (a Hugging Face dataset's ds.features['ner_tags'].feature.names), or --label-map "
                         "0=O,1=B-PER,...")


def check_label_column(train: LabelledData, spec: DataSpec) -> None:
    """A label column holding text (a wrong --label-column, or a default column that is not the
    labels) makes nearly every row its own class, and one holding a single label leaves nothing to
    tell apart: refuse both before any training (multi-label: one label set on every row)."""
    if train.task_type == TaskType.multi_label_classification:
        sets = {tuple(sorted(ex.label)) for ex in train.examples}
        if len(sets) < 2:
            raise UsageError(f"{train.source}: every row is labelled {', '.join(next(iter(sets)))}: a classifier "
                             "learns to tell labels apart (is --label-column the right column?)")
    if train.task_type != TaskType.sequence_classification:
        return
    seen = Counter(ex.label for ex in train.examples)
    tags = sum(n for label, n in seen.items() if label == "O" or label[:2] in ("B-", "I-", "E-", "S-", "L-", "U-"))
    one_word = sum(1 for ex in train.examples if not any(char.isspace() for char in ex.text))
    if "O" in seen and tags >= 0.9 * len(train) and one_word >= 0.9 * len(train):  # BioBERT's NER sets: train.tsv
        examples = ", ".join(repr(label) for label in list(seen)[:3])
        raise UsageError(f"{train.source}: one word a row with BIO tags ({examples}, ...): a CoNLL file (one word a "
                         "line, a blank line between sentences); give --format conll to train a token task")
    if len(seen) < 2:
        raise UsageError(f"{train.source}: every row is labelled {next(iter(seen))!r}: a classifier learns to tell "
                         "two or more labels apart (is --label-column the right column?)")
    if len(seen) > 20 and len(seen) > len(train) / 2:  # under two rows a label: nothing to learn
        examples = ", ".join(repr(label[:40]) for label in list(seen)[:3])
        if all(is_number(label) for label in seen):  # STS-B's similarities, a price
            raise UsageError(f"{train.source}: {len(seen)} different numbers in {len(train)} rows ({examples}, ...): a "
                             "score to predict, which tmod's heads do not (they choose among labels); bin it into "
                             "a few labels first (e.g. low,mid,high)")
        column = ("the default: the header's 'label', else the column of fewest different values"
                  if spec.label_column is None else repr(spec.label_column))
        raise UsageError(f"{train.source}: {len(seen)} different labels in {len(train)} rows ({examples}, ...): "
                         f"the label column ({column}) looks like text; name the labels' column with --label-column")


def say_labels_differing_in_case(train: LabelledData) -> None:
    """A spreadsheet's `Positive` beside `positive`: labels taken as written are learnt as two classes,
    each with a share of the rows; said, with the --label-map that merges them (its most frequent spelling
    kept), before anything is trained. Not refused: a task may mean them apart."""
    if train.task_type == TaskType.token_classification:
        return
    counts = Counter(label for ex in train.examples for label in train.labels_of(ex))
    spellings: dict[str, list[str]] = {}
    for label in sorted(counts, key=lambda name: -counts[name]):
        spellings.setdefault(label.casefold(), []).append(label)
    alike = [names for names in spellings.values() if len(names) > 1]
    if not alike:
        return
    merge = {label: names[0] for names in spellings.values() for label in names}
    shown = ", ".join(" and ".join(f"{name!r} ({counts[name]})" for name in names) for names in alike[:3])
    fix = (f"--label-map {','.join(f'{label}={kept}' for label, kept in sorted(merge.items()))} merges them"
           if len(merge) <= 12 else "a --label-map naming each label merges them")
    print(f"{train.source}: labels {shown} differ only in case: they are learnt as different labels; {fix}",
          file=sys.stderr)


IMBALANCED = 4  # the most frequent training label this many times the rarest: accuracy mostly counts the first


def say_imbalance(train: LabelledData) -> None:
    """Labels far apart in number, with the epoch chosen on accuracy: a head that mostly answers the
    frequent label scores well there (90% on a 90/10 file), so say which metric and which weighting
    judge and train every class; not refused, accuracy may be what the task wants."""
    counts = Counter(ex.label for ex in train.examples).most_common()
    (most, most_rows), (rarest, rarest_rows) = counts[0], counts[-1]
    if len(counts) < 2 or most_rows < IMBALANCED * rarest_rows:
        return
    print(f"{train.source}: the labels are imbalanced ({most!r} holds {most_rows:,} of the {len(train):,} training rows, "
          f"{100 * most_rows / len(train):.0f}%; {rarest!r} {rarest_rows:,}): accuracy, which chooses the epoch, rewards "
          "answering the frequent label; --metric mcc (or f1_macro) chooses it on every class, and --class-weights "
          "balanced trains on every class alike", file=sys.stderr)


def check_labels(data: LabelledData, given: list[str] | None, labels: list[str], train: LabelledData) -> None:
    """Every label of `data` must be one the head has: from --labels, else from the training data."""
    unknown = sorted(set(data.labels_seen()) - set(labels))
    if not unknown:
        return
    if given:
        raise UsageError(f"{data.source}: label(s) {unknown} are not among --labels {labels}")
    every = ",".join([*labels, *unknown])
    raise UsageError(f"{data.source}: label(s) {unknown} never seen in training ({train.source}); "
                     f"the head can only answer {labels} (to score those rows as its misses, as an official test "
                     f"set asks, name every label: --labels {every})")


def text_key(example) -> tuple:
    """What makes two examples the same text: the text, and its pair's."""
    return example.text, getattr(example, "text_pair", None)


def document_key(example) -> tuple:
    return ("document", example.document)


def whole_documents(data: LabelledData, n: int | None, seed: int) -> LabelledData:
    """--max-train N with --document-windows: a seeded random choice of whole documents, N sentences
    in all (the last document cut), in file order. N sentences drawn one by one are scattered over the
    file's documents, and a window holds only training sentences: 800 of CoNLL-2003's gave 2 windows
    of 128 pieces. A file without -DOCSTART- lines is one document: its first N sentences."""
    if not n or n >= len(data.examples):
        return data
    documents: dict = {}
    for i, ex in enumerate(data.examples):
        documents.setdefault(getattr(ex, "document", None), []).append(i)
    order = list(documents.values())
    random.Random(seed).shuffle(order)
    kept = [i for rows in order for i in rows][:n]
    return LabelledData(data.task_type, [data.examples[i] for i in sorted(kept)], data.source, data.has_pairs)


def split_by_documents(data: LabelledData, fractions: list[float]) -> bool:
    """Whether --split carves a CoNLL file by documents: its sentences were carved one by one, so a
    document's sentences (its names again and again) sat in training and in validation, and the training
    documents read in windows (--document-windows) held validation sentences whole. By documents where
    each part gets one at least; else by sentences, said."""
    documents = {getattr(ex, "document", None) for ex in data.examples} - {None}
    if len(documents) < 2:
        return False
    if all(round(len(documents) * f) >= 1 for f in fractions):
        return True
    print(f"{data.source}: its {len(documents)} documents are too few to give each part of --split "
          f"{','.join(map(str, fractions))} one: carved by sentences (a document's sentences may be in two parts)",
          file=sys.stderr)
    return False


def label_set_parts(label_sets: list[set], fractions: list[float], rng: random.Random) -> list[int]:
    """Each label set's part (0 training, 1 validation, 2 test) for a multi-label split, stratified
    by label as far as label sets allow: iterative stratification (Sechidis, Tsoumakas and Vlahavas,
    ECML PKDD 2011). The rarest label still to place goes first; each example holding it goes to the
    part that still wants most of that label (ties: most examples wanted, then by chance). A random cut
    left rare labels out of validation (GoEmotions' grief), where thresholds are chosen."""
    shares = [1 - sum(fractions), *fractions]
    wanted = [len(label_sets) * share for share in shares]  # examples each part still wants
    count = Counter(label for labels in label_sets for label in labels)
    wanted_of = {label: [n * share for share in shares] for label, n in count.items()}
    holders: dict = {label: [] for label in count}
    for i, labels in enumerate(label_sets):
        for label in labels:
            holders[label].append(i)
    part_of: list[int | None] = [None] * len(label_sets)

    def place(i: int, desire: list[float]) -> None:
        part = max(range(len(shares)), key=lambda p: (desire[p], wanted[p], rng.random()))
        part_of[i] = part
        wanted[part] -= 1
        for label in label_sets[i]:
            wanted_of[label][part] -= 1
            count[label] -= 1

    while any(count.values()):
        label = min((label for label, n in count.items() if n), key=lambda label: (count[label], str(label)))
        unplaced = [i for i in holders[label] if part_of[i] is None]
        rng.shuffle(unplaced)
        for i in unplaced:
            place(i, wanted_of[label])
    for i in [i for i, part in enumerate(part_of) if part is None]:  # no label at all
        place(i, wanted)
    return part_of


def carve(data: LabelledData, fractions: list[float], seed: int, by_documents: bool = False
          ) -> tuple[LabelledData, LabelledData, LabelledData | None]:
    """(train, validation, test or None) out of one split: `fractions` of each label's examples
    (single-label tasks: stratified; multi-label: `label_set_parts`) or of all examples, chosen by a
    seeded shuffle; file order kept.
    The rows of one text go to one part (a text the head learnt, scored again, would flatter it: SST-2's
    training file holds 361 texts twice); `by_documents`, the sentences of one CoNLL document
    (split_by_documents). A carved row holding a label (or tag) that no training row
    has goes back to training: the head cannot answer a label it never saw, and a rare one would
    otherwise end the run."""
    rng = random.Random(seed)
    unit = document_key if by_documents else text_key
    units: dict = {}  # a text (or a CoNLL document) -> its rows (one text: one row, unless the file repeats it)
    for i, ex in enumerate(data.examples):
        units.setdefault(unit(ex), []).append(i)
    parts: list[list[int]] = [[], [], []]
    if data.task_type == TaskType.multi_label_classification:
        texts = list(units.values())
        label_sets = [set().union(*(data.labels_of(data.examples[i]) for i in rows)) for rows in texts]
        for rows, part in zip(texts, label_set_parts(label_sets, fractions, rng)):
            parts[part] += rows
    else:
        groups: dict = {}
        for rows in units.values():
            first = data.examples[rows[0]]
            key = first.label if data.task_type == TaskType.sequence_classification else None
            groups.setdefault(key, []).append(rows)
        for key in sorted(groups, key=str):
            texts = groups[key]
            rng.shuffle(texts)  # with no text repeated, the same shuffle (and so the same split) as row by row
            cuts = [round(len(texts) * f) for f in fractions]
            parts[1] += [i for rows in texts[:cuts[0]] for i in rows]
            if len(cuts) == 2:
                parts[2] += [i for rows in texts[cuts[0]:cuts[0] + cuts[1]] for i in rows]
            parts[0] += [i for rows in texts[sum(cuts):] for i in rows]
    taught = {label for i in parts[0] for label in data.labels_of(data.examples[i])}
    for part in parts[1:]:
        for i in list(part):
            if i in part and not data.labels_of(data.examples[i]) <= taught:
                for j in units[unit(data.examples[i])]:  # the text's (document's) every row, as carved
                    part.remove(j)
                    parts[0].append(j)
                    taught |= data.labels_of(data.examples[j])
    train, validation, test = (LabelledData(data.task_type, [data.examples[i] for i in sorted(rows)], data.source,
                                            data.has_pairs) for rows in parts)
    for name, part in (("training", train), ("validation", validation)):
        if not len(part):
            few = (f": its {len(data.examples)} rows hold {len(units)} different "
                   f"{'documents' if by_documents else 'texts'}, and the rows of one stay in one part"
                   if len(units) < len(data.examples) else "")
            raise UsageError(f"--split {fractions}: the {name} part of {data.source} would be empty{few}")
    return train, validation, (test if len(fractions) == 2 else None)
