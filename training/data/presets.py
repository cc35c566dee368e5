"""The datasets of the shared data folder (`PRESETS`), and a split's file with how to read it (`DataSpec`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from training.data.conll import CONLL_TAGS, read_conll
from training.data.examples import LabelledData
from training.data.files import Column, UsageError, default_data_dir, guess_format
from training.data.tables import read_table


@dataclass(frozen=True)
class DatasetPreset:
    """How to read one of the datasets in the shared data folder."""

    name: str
    format: str
    train: str  # relative to the data dir
    validation: str
    metric: str  # the validation metric to select on
    labels: tuple[str, ...]  # label order of the head
    text_column: Column = 0
    label_column: Column = 1
    pair_column: Column | None = None
    header: bool = True
    label_map: dict[str, str] = field(default_factory=dict)
    multi_label: bool = False


GOEMOTIONS_LABELS = (  # goemotions/labels.txt, in its order (the label ids of the data files index it)
    "admiration", "amusement", "anger", "annoyance", "approval", "caring", "confusion", "curiosity", "desire",
    "disappointment", "disapproval", "disgust", "embarrassment", "excitement", "fear", "gratitude", "grief", "joy",
    "love", "nervousness", "optimism", "pride", "realization", "relief", "remorse", "sadness", "surprise", "neutral",
)

PRESETS = {
    "sst2": DatasetPreset(
        "sst2", "tsv", "sst2/train.tsv", "sst2/validation.tsv", metric="accuracy",
        labels=("negative", "positive"), text_column="sentence", label_column="label",
        label_map={"0": "negative", "1": "positive"},
    ),
    "cola": DatasetPreset(
        "cola", "tsv", "cola/train.tsv", "cola/validation.tsv", metric="mcc",
        labels=("unacceptable", "acceptable"), text_column=3, label_column=1, header=False,
        label_map={"0": "unacceptable", "1": "acceptable"},
    ),
    "rte": DatasetPreset(
        "rte", "tsv", "rte/train.tsv", "rte/dev.tsv", metric="accuracy",
        labels=("entailment", "not_entailment"), text_column="sentence1", pair_column="sentence2",
        label_column="label",
    ),
    "conll2003": DatasetPreset(
        "conll2003", "conll", "conll2003/train.txt", "conll2003/validation.txt", metric="f1",
        labels=tuple(CONLL_TAGS),
    ),
    "goemotions": DatasetPreset(
        "goemotions", "tsv", "goemotions/train.tsv", "goemotions/validation.tsv", metric="f1_macro",
        labels=GOEMOTIONS_LABELS, text_column=0, label_column=1, header=False,
        label_map={str(i): name for i, name in enumerate(GOEMOTIONS_LABELS)}, multi_label=True,
    ),
}


@dataclass
class DataSpec:
    """Where a split comes from and how to read it (a preset fills these in)."""

    path: Path
    format: str
    text_column: Column | None = None  # None: the table's column named text, else 0 (JSONL: key text or tokens)
    label_column: Column | None = None  # None: the column named label, else the one of fewest values (JSONL: label, ...)
    pair_column: Column | None = None
    header: bool = True
    label_map: dict[str, str] | None = None
    multi_label: bool = False

    def read(self) -> LabelledData:
        """The split's examples; a missing or unreadable file, or a bad row, is a UsageError."""
        if self.format == "conll":
            return read_conll(self.path)
        return read_table(self.path, text_column=self.text_column, label_column=self.label_column,
                          pair_column=self.pair_column, fmt=self.format, header=self.header, label_map=self.label_map,
                          multi_label=self.multi_label)


def file_spec(path: str | Path, fmt: str | None = None, text_column: Column | None = None,
              label_column: Column | None = None, pair_column: Column | None = None, header: bool = True,
              label_map: dict[str, str] | None = None, multi_label: bool = False) -> DataSpec:
    """A user's file, read as the options say (tmod-train's training and eval files alike)."""
    path = Path(path)
    fmt = fmt or guess_format(path)
    return DataSpec(path, fmt, text_column, label_column, pair_column, header, label_map, multi_label)


def preset_spec(preset: DatasetPreset, split: str, data_dir: Path | None = None) -> DataSpec:
    """How to read a preset's split; a file that is not there is one line naming the way to point at it."""
    data_dir = Path(data_dir) if data_dir else default_data_dir()
    path = data_dir / {"train": preset.train, "validation": preset.validation}[split]
    if not path.is_file():
        raise UsageError(f"no such file: {path} (the {preset.name} preset; set --data-dir or TMOD_DATA_DIR)")
    return DataSpec(path, preset.format, preset.text_column, preset.label_column,
                    preset.pair_column, preset.header, dict(preset.label_map) or None, preset.multi_label)
