"""CoNLL and CoNLL-U files: sentences of tagged words, their documents, and those documents read in
windows as the server reads a long text."""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Sequence

from modules_store import TaskType

from training.data.examples import LabelledData, TokenExample, begin_entities_with_b
from training.data.files import UsageError, numbered_lines


CONLL_TAGS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]
CONLLU_TOKEN = re.compile(r"\d+\t[^\t]+(\t[^\t]*){8}\n?")  # ID FORM LEMMA UPOS XPOS FEATS HEAD DEPREL DEPS MISC
COMMENT = re.compile(r"#\s+(\S+\s*=|id\s)")  # UD's "# sent_id = 1", MultiCoNER's "# id 5c1e... domain=en"


def read_conll(path: str | Path, word_column: int = 0, tag_column: int = -1) -> LabelledData:
    """CoNLL column file: one `word ... tag` line per token, blank lines between sentences,
    -DOCSTART- lines and comment lines (`# key = value`, `# id ...`) skipped. A CoNLL-U file
    (Universal Dependencies: ten tab-separated columns, an ID first) gives each word (FORM) its
    part of speech (UPOS); its multiword-token and empty-node lines (IDs 1-2, 1.1) are skipped."""
    path = Path(path)
    first = next((line for _, line in numbered_lines(path) if line.strip() and not line.startswith("#")), "")
    conllu = bool(CONLLU_TOKEN.fullmatch(first))
    if conllu:
        word_column, tag_column = 1, 3
        print(f"{path}: CoNLL-U (ten columns): each word (FORM) tagged with its part of speech (UPOS)", file=sys.stderr)
    examples, words, tags = [], [], []
    seen = 0  # words of the file before the current sentence
    document = 0  # -DOCSTART- lines read before it (the first one opens document 0)
    spaced = []  # the lines whose text before a tab holds a space: a table's rows, not a word and its tag

    def end_sentence():
        nonlocal seen
        if words:
            examples.append(TokenExample(words=list(words), tags=list(tags), file_offset=seen,
                                         document=max(document - 1, 0)))
            seen += len(words)
        words.clear()
        tags.clear()

    for line_no, line in numbered_lines(path):
        if (conllu and line.startswith("#")) or COMMENT.match(line):
            continue
        if conllu and line.strip() and not line.split("\t", 1)[0].isdigit():  # a multiword token or an empty node
            continue
        if "\t" in line and " " in (cell := line.split("\t")[0].strip()):
            spaced.append(cell)
        parts = line.rstrip("\r\n").split("\t") if conllu else line.split()  # a CoNLL-U FORM may hold a space
        if not any(part.strip() for part in parts):
            end_sentence()
            continue
        if parts[0] == "-DOCSTART-":
            end_sentence()
            document += 1
            continue
        if len(parts) < 2:
            raise UsageError(f"{path}:{line_no}: a CoNLL line needs a word and a tag (whitespace-separated), "
                             f"got {line.strip()!r}")
        try:
            words.append(parts[word_column])
            tags.append(parts[tag_column])
        except IndexError:
            raise UsageError(f"{path}:{line_no}: expected word and tag columns, got {line.strip()!r}") from None
    end_sentence()
    if not examples:
        raise UsageError(f"{path}: no sentences")
    if len(spaced) > seen / 2:  # "good film<TAB>pos" lines: a table read as words and tags (seen: all words)
        raise UsageError(f"{path}: most lines hold a text with spaces before a tab ({spaced[0][:40]!r}): a table "
                         "(text, tab, label), not a CoNLL file (one word a line); give --format tsv")
    return LabelledData(TaskType.token_classification, examples, str(path))


def read_conll_documents(path: str | Path, word_column: int = 0, tag_column: int = -1) -> list[list[TokenExample]]:
    """A CoNLL file's documents (the sentences between -DOCSTART- lines), each a list of sentences."""
    documents: dict[int, list[TokenExample]] = {}
    for example in read_conll(path, word_column, tag_column).examples:
        documents.setdefault(example.document, []).append(example)
    return list(documents.values())


def document_windows(path: str | Path, encoder, windows: Sequence[int]) -> dict[int, list[TokenExample]]:
    """A CoNLL file's documents read as the server reads a long text, for each window length in
    `windows`: each document's words joined with spaces, tokenized once, and cut by
    server/windows.py into windows of that many word pieces (its default stride), each window an
    example of the words wholly inside it; a document that fits in one window is one example.
    `encoder`: the backbone's TextEncoder. A window the server would refuse raises ValueError."""
    from server.errors import ApiError
    from server.windows import settings_for, split

    try:
        settings = {window: settings_for(encoder, None, window) for window in windows}
    except ApiError as exc:
        raise ValueError(f"--document-windows: {exc.message}") from None
    out: dict[int, list[TokenExample]] = {window: [] for window in windows}
    for document in read_conll_documents(path):
        whole = TokenExample([w for s in document for w in s.words],
                             begin_entities_with_b([t for s in document for t in s.tags])[0],
                             file_offset=document[0].file_offset)
        encoded = encoder.encode([whole.text], whole=True)[0]
        offsets, spans = encoded.offsets, whole.spans
        for window, setting in settings.items():
            reading = split(encoded, setting)
            if not reading.windowed:
                out[window].append(whole)
                continue
            for start, end in reading.spans:
                low, high = offsets[reading.first + start][0], offsets[reading.first + end - 1][1]
                keep = [i for i, (a, b) in enumerate(spans) if a >= low and b <= high]
                if keep:  # a run of the document's words (spans are in order); an entity the window cuts begins
                    tags = begin_entities_with_b([whole.tags[i] for i in keep])[0]  # where the window does
                    out[window].append(TokenExample([whole.words[i] for i in keep], tags,
                                                    file_offset=whole.file_offset + keep[0]))
    return out
