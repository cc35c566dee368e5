"""Opening a user's data files, and the one-line errors (`UsageError`) their mistakes get."""
from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[2]
FORMATS = ("tsv", "csv", "jsonl", "conll")
ENCODING = "utf-8-sig"  # UTF-8, with or without the byte-order mark spreadsheets write first
WORKBOOK_MAGIC = (b"PK\x03\x04", b"\xd0\xcf\x11\xe0")  # .xlsx / .ods (zip), .xls (OLE)
WORKBOOK_SUFFIXES = ("xlsx", "xlsm", "xls", "ods")
GZIP_MAGIC = b"\x1f\x8b"
Column = int | str  # a table's column or a record's key: its name, or its 0-based index


class UsageError(ValueError):
    """A mistake in the user's data or options (a missing file, an unknown column, an empty label...):
    `tmod-train` answers it with one line naming the file and line, and exit status 2."""


class EmptyCell(UsageError):
    """A row whose text or label is empty: a file's such rows are named together (`refuse_empty`), so
    a spreadsheet with a few unlabelled rows is mended in one go, not one error at a time."""


def refuse_empty(path: Path, empty: list[EmptyCell]) -> None:
    if not empty:
        return
    if len(empty) == 1:
        raise empty[0]
    shown = "; ".join(str(exc).removeprefix(f"{path}:").strip() for exc in empty[:6])
    more = f"; {len(empty) - 6} more" if len(empty) > 6 else ""
    raise UsageError(f"{path}: {len(empty)} rows with an empty text or label ({shown}{more}): fill them in or remove "
                     "them")


def folder_error(path: Path) -> "UsageError":
    """A folder given for a file; a Hugging Face dataset's `save_to_disk` folder said as such."""
    if any((path / name).is_file() for name in ("state.json", "dataset_info.json", "dataset_dict.json")):
        return UsageError(f"{path}: a Hugging Face dataset saved with save_to_disk, which is not read; write it as "
                          f"JSONL first, e.g. datasets.load_from_disk('{path.name}').to_json('train.jsonl') (a "
                          "DatasetDict: each split's)")
    return UsageError(f"{path}: a folder; give a file (TSV, CSV, JSONL or CoNLL)")


def workbook_error(path: Path) -> "UsageError":
    return UsageError(f"{path}: a spreadsheet workbook is not read; save the sheet as CSV first (Excel: File > Save "
                      "As > CSV UTF-8; LibreOffice: Save As > Text CSV), or as tab-separated text")


def guess_format(path: Path) -> str:
    if path.is_dir():
        raise folder_error(path)
    if path.suffix.lower() == ".gz":  # train.tsv.gz: the name inside says what it is (read through gzip)
        path = path.with_suffix("")
    suffix = path.suffix.lower().lstrip(".")
    if suffix in ("tsv", "csv", "jsonl"):
        return suffix
    if suffix == "json":
        return "jsonl"
    if suffix in ("txt", "conll", "bio", "iob", "conllu"):
        return "conll"
    if suffix in WORKBOOK_SUFFIXES:
        raise workbook_error(path)
    if suffix in ("parquet", "arrow"):  # a Hugging Face dataset's files
        raise UsageError(f"{path}: {suffix} is not read; write it as JSONL first, e.g. "
                         f"datasets.load_dataset('{suffix}', data_files='{path.name}')['train'].to_json('train.jsonl')")
    if suffix == "spacy":  # spaCy v3's DocBin: binary, read only through spaCy
        raise UsageError(
            f"{path}: a spaCy DocBin is not read; write its docs as JSONL first: python -c \"import json, spacy; "
            f"from spacy.tokens import DocBin; docs = DocBin().from_disk('{path.name}').get_docs(spacy.blank('en').vocab); "
            "print(*(json.dumps({'text': d.text, 'entities': [[e.start_char, e.end_char, e.label_] for e in d.ents], "
            "'labels': [c for c, p in d.cats.items() if p >= 0.5]}) for d in docs), sep='\\n')\" > train.jsonl; "
            "then --label-column entities (a token task) or labels (its categories)")
    raise UsageError(f"{path}: cannot tell the format from the extension; give --format ({'/'.join(FORMATS)})")


def open_text(path: Path, newline: str | None = None):
    """The file as text: UTF-8 (ENCODING), or UTF-16 where it starts with its byte-order mark (Excel's
    "Unicode text", a TSV); gzip-compressed (`train.tsv.gz`, as datasets are often published) or not.
    A workbook (a zip or OLE file) is refused: read as text it is a few garbled rows."""
    with open(path, "rb") as fh:
        start = fh.read(4)
    compressed = start.startswith(GZIP_MAGIC)
    if compressed:  # what the file holds starts after its compression
        with gzip.open(path, "rb") as fh:
            start = fh.read(4)
    if start.startswith(WORKBOOK_MAGIC):
        raise workbook_error(path)
    encoding = "utf-16" if start[:2] in (b"\xff\xfe", b"\xfe\xff") else ENCODING
    return (gzip.open if compressed else open)(path, "rt", encoding=encoding, newline=newline)


def numbered_lines(path: Path):
    """A file's lines, read as UTF-8; a missing or undecodable file is a UsageError."""
    if path.is_dir():
        raise folder_error(path)
    if not path.is_file():
        raise UsageError(f"no such file: {path}")
    try:
        with open_text(path) as fh:
            yield from enumerate(fh, 1)
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}) nor UTF-16 with "
                         f"its byte-order mark; convert it first, e.g. iconv -f latin1 -t utf-8") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:  # cut short in a download, say
        raise UsageError(f"{path}: a broken gzip file ({exc}); download it again, or check it with gzip -t") from None


def read_text_lines(path: str | Path, option: str = "--texts") -> list[str]:
    """A UTF-8 file of unlabelled texts, one a line: each text once, in file order, blank lines skipped
    (what a bridge or an alignment pairs: no labels needed)."""
    try:
        lines = Path(path).read_text(encoding=ENCODING).splitlines()
    except OSError as exc:
        raise UsageError(f"{option} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{option} {path}: not UTF-8 text") from None
    texts = list(dict.fromkeys(line.strip() for line in lines if line.strip()))
    if len(texts) < 2:
        raise UsageError(f"{option} {path}: {len(texts)} different text(s); at least 2 (one a line): some are held out")
    return texts


def default_data_dir() -> Path:
    """$TMOD_DATA_DIR, else ../shared/data relative to the repository root."""
    env = os.environ.get("TMOD_DATA_DIR")
    return Path(env) if env else (REPO_ROOT / ".." / "shared" / "data").resolve()
