"""Labelled data for training and scoring heads, by what a newcomer looks for:

- `files`: opening the user's files (UTF-8 or UTF-16, gzip or not; workbooks and folders refused) and
  the one-line errors their mistakes get (`UsageError`);
- `examples`: what a split holds: labelled texts (`SequenceExample`) or tagged words (`TokenExample`)
  in a `LabelledData`; seeded subsets; the head's label order;
- `tables`: `read_table`, labelled texts from TSV, CSV or JSON(L), the columns left unnamed chosen and
  said; `records` reads JSON files as records, `cells` makes one example of a row's or record's cells;
- `conll`: CoNLL and CoNLL-U files, and their documents read in windows as the server reads them;
- `presets`: the datasets of the shared data folder, and a split's file with how to read it (`DataSpec`);
- `word_tags`: word-level tags onto sub-word tokens and back.

Token tasks come from CoNLL files, from JSONL word lists with their tags (a Hugging Face dataset's
rows), or from texts with their entities as character spans (annotation tools' exports), split into
words as BERT's pre-tokenizer splits them (`cells.word_spans`). They build their text by joining the
words with single spaces and keep each word's character span, so training tokenizes exactly as the
server does (`Backbone.tokenize` on a plain string) and a word's tag can be found again from token
offsets.
"""
