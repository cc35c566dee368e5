"""Tokenizing with the `tokenizers` library directly (server/backbone/tokens.py, issue 37) gives every
backbone's tokenizer exactly the token arrays that the transformers wrapper path gave before it
(tests/tokens_reference.py, a frozen copy of that path): ids, type ids, sequence and word ids,
trimmed offsets and casing classes, for single texts and pairs, truncated from either side, too long
(InputTooLong with the same rows and lengths), whole and cut into windows; on real SST-2, CoNLL-2003
and RTE texts, awkward ones, and random ones."""
from __future__ import annotations

import csv
import pickle
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from server.backbone import InputTooLong
from server.backbone.sources import default_backbone_path, mpnet_parts, mpnet_path
from server.backbone.tokens import TextEncoder, token_spans
from server.windows import WindowSettings, read
from tests.helpers import mpnet_style_tokenizer
from tests.tokens_reference import reference_encode
from tests.tokens_reference import token_spans as reference_spans
from training.data.conll import read_conll
from training.data.files import default_data_dir

AWKWARD = [
    "", " ", "\n\t  \r\n", "🙂 Zürich naïve café 👩‍👩‍👧 🇩🇪", "e\u0301te\u0301 cafe\u0301 n\u0303",
    "東京は日本の首都です。 北京 서울", "a\x00b\x07c\x1b[0m\x7f", "\u200b\u200d\ufeff\u00ad", "ǅungla ǈ ǋ Ⅻ ⅻ ß ẞ İı ﬁ", "A",
    "AB ab Ab aB 1A a1 Éa ÉA", "Supercalifragilisticexpialidocious" * 20, "x" * 400, "  leading and trailing  ",
    "tab\tsep\tvalues", "[CLS] [SEP] <s> </s> [MASK] <pad>", "𝐀𝐁𝐂 𝒂𝒃 \U0001F600\U0001F600", "مرحبا بالعالم",
    "Ελληνικά ΚΕΦΑΛΑΙΑ", ("The Quick brown FOX jumps over the lazy DOG in NEW York. " * 400)[:20_000],
]


# ---- the tokenizers ---------------------------------------------------------------------------------
def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE as SmolLM2's (a word's leading space inside its token, so offsets are trimmed),
    trained here on SST-2 text: the Llama-style path's tokenizer, whose package is not installed here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(sst2()[:2000], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", pair="<|im_start|> $A <|im_start|> $B:1",
                                                       special_tokens=[("<|im_start|>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|endoftext|>",
                                   model_max_length=2048)


def bridge_copy(tokenizer, folder):
    """A tokenizer as a bridge artifact carries its target's: saved, then loaded from the folder."""
    tokenizer.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True, use_fast=True)


def mpnet_tokenizer():
    try:
        mpnet_parts()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return AutoTokenizer.from_pretrained(mpnet_path(), local_files_only=True, use_fast=True)


TOKENIZERS = {
    "minilm": lambda tmp: (AutoTokenizer.from_pretrained(default_backbone_path(), local_files_only=True), 512, True),
    "mpnet": lambda tmp: (mpnet_tokenizer(), 512, False),
    "mpnet_style": lambda tmp: (mpnet_style_tokenizer(tmp), 128, False),
    "byte_level": lambda tmp: (byte_level_tokenizer(), 2048, False),
    "bridge_minilm": lambda tmp: (bridge_copy(AutoTokenizer.from_pretrained(default_backbone_path()), tmp), 512, True),
}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def encoder(request, tmp_path_factory):
    tokenizer, limit, types = TOKENIZERS[request.param](tmp_path_factory.mktemp(request.param))
    return TextEncoder(tokenizer, limit, types)


# ---- the texts --------------------------------------------------------------------------------------
def _column(path, index: int) -> list[str]:
    with open(path, encoding="utf-8", newline="") as f:
        return [row[index] for row in list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]]


def sst2() -> list[str]:
    path = default_data_dir() / "sst2" / "validation.tsv"
    if not path.is_file():
        pytest.skip(f"shared data not found at {path}")
    return _column(path, 0)


def conll() -> list[str]:
    return read_conll(default_data_dir() / "conll2003" / "validation.txt").texts()


def rte() -> tuple[list[str], list[str]]:
    path = default_data_dir() / "rte" / "dev.tsv"
    return _column(path, 1), _column(path, 2)


# ---- comparing --------------------------------------------------------------------------------------
def same(encoder: TextEncoder, texts, pairs=None, truncate=False, max_tokens=None, whole=False):
    """The encoder's rows equal the reference's, array for array (dtype, shape, every value), and
    truncated flags; or both refuse with the same rows, lengths and limit."""
    want = reference_encode(encoder.tokenizer, encoder.max_tokens, texts, pairs, truncate, max_tokens, whole)
    try:
        rows = encoder.encode(texts, pairs, truncate=truncate, max_tokens=max_tokens, whole=whole)
    except InputTooLong as exc:
        assert (exc.rows, exc.lengths, exc.limit) == want
        return
    assert not isinstance(want, tuple), f"the reference refused: {want}"
    assert len(rows) == len(want)
    for i, (row, (tokens, cut)) in enumerate(zip(rows, want)):
        assert (row.text, row.text_pair) == (texts[i], pairs[i] if pairs else None)
        assert row.truncated == cut, i
        assert row.tokens.dtype == tokens.dtype == np.int32 and row.tokens.shape == tokens.shape, i
        np.testing.assert_array_equal(row.tokens, tokens, err_msg=f"input {i}: {texts[i][:60]!r}")


def test_real_texts_one_request_each_and_batched(encoder):
    texts = sst2()[:150] + conll()[:150]
    for text in texts[::3]:
        same(encoder, [text], whole=True)
    for first in range(0, len(texts), 50):
        same(encoder, texts[first:first + 50], whole=True)
        same(encoder, texts[first:first + 50])


def test_pairs_truncation_and_refusals(encoder):
    premises, hypotheses = rte()
    premises, hypotheses = premises[:60], hypotheses[:60]
    same(encoder, premises, hypotheses, whole=True)
    same(encoder, premises[:1], hypotheses[:1])
    same(encoder, premises, hypotheses, truncate=True, max_tokens=40)  # longest first, between the two
    same(encoder, premises[:1], hypotheses[:1], truncate=True, max_tokens=24)
    same(encoder, premises, hypotheses, max_tokens=40)  # InputTooLong, naming the same inputs
    long = sst2()[:80]
    for side in (True, "right", "left"):
        same(encoder, long, truncate=side, max_tokens=12)
        same(encoder, long[5:6], truncate=side, max_tokens=12)
    same(encoder, long, max_tokens=12)
    with pytest.raises(ValueError, match="left"):
        encoder.encode(premises[:2], hypotheses[:2], truncate="left", max_tokens=12)


def test_awkward_texts(encoder):
    for text in AWKWARD:
        same(encoder, [text], whole=True)
        same(encoder, [text], [text[::-1]], whole=True)
    same(encoder, AWKWARD, whole=True)
    same(encoder, AWKWARD, truncate=True, max_tokens=9)
    same(encoder, AWKWARD, truncate="left", max_tokens=9)
    same(encoder, AWKWARD, AWKWARD[::-1], truncate=True, max_tokens=30)
    same(encoder, AWKWARD)  # the 20,000-character text is over every limit


def test_long_texts_cut_into_windows_as_before(encoder):
    """server/windows.py cuts what `encode(whole=True)` gave: the same windows from both paths."""

    class Reference:
        def __init__(self, encoder):
            self.encoder = encoder

        def encode(self, texts, text_pairs=None, truncate=False, max_tokens=None, whole=False):
            rows = reference_encode(self.encoder.tokenizer, self.encoder.max_tokens, texts, text_pairs, truncate,
                                    max_tokens, whole)
            new = self.encoder.encode(texts, text_pairs, truncate, max_tokens, whole)
            for row, (tokens, cut) in zip(new, rows):
                row.tokens, row.truncated = tokens, cut
            return new

    texts = [AWKWARD[-1], " ".join(conll()[:300]), sst2()[0]]
    settings_ = WindowSettings(window=64, stride=48, limit=512)
    for truncate in (False, True, "left"):
        new, old = read(encoder, texts, None, settings_, truncate), read(Reference(encoder), texts, None, settings_, truncate)
        assert new.windows == old.windows and len(new.rows) == len(old.rows)
        assert truncate or len(new.rows) > 10  # the long texts were cut
        for a, b in zip(new.rows, old.rows):
            np.testing.assert_array_equal(a.tokens, b.tokens)
            assert (a.text, a.truncated, getattr(a, "part", None)) == (b.text, b.truncated, getattr(b, "part", None))


CHARS = "aZ éÉ ß 1. \t\n🙂東\u0301ǅ'\"-_()[]\u00a0\u200b\x00"


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_random_texts(encoder, seed):
    rng = random.Random(seed)
    texts = ["".join(rng.choice(CHARS) for _ in range(rng.randint(0, 40))) for _ in range(rng.randint(1, 4))]
    pairs = ["".join(rng.choice(CHARS) for _ in range(rng.randint(0, 40))) for _ in texts] if rng.random() < 0.4 else None
    same(encoder, texts, pairs, whole=True)
    same(encoder, texts, pairs, truncate=rng.choice([True, "left"]) if pairs is None else True, max_tokens=rng.randint(4, 12))


def test_span_arithmetic_for_texts_past_the_packed_counts():
    """token_spans counts cased characters packed 21 bits a field; a text of 2**21 characters or more
    takes the plain counts: both agree with the reference on spans across the whole text."""
    rng = np.random.default_rng(0)
    text = "".join(rng.choice(list("aA bB1ǅ\t"), size=(1 << 21) + 5))
    starts = np.sort(rng.integers(0, len(text), 400))
    ends = np.minimum(starts + rng.integers(0, 9, 400), len(text))
    starts[-1], ends[-1] = 0, len(text)  # one span over everything
    segment = np.zeros(400, dtype=np.int64)
    segment[::17] = -1
    for got, want in zip(token_spans([text], None, 0, segment, starts, ends),
                         reference_spans([text], None, np.zeros(400, dtype=np.int64), segment, starts, ends)):
        np.testing.assert_array_equal(got, want)


def test_an_encoder_sent_to_a_worker_process_encodes_the_same(encoder):
    """Workers receive the encoder pickled; its library tokenizer is rebuilt there from the wrapper."""
    copy = pickle.loads(pickle.dumps(encoder))
    texts = sst2()[:20] + AWKWARD
    for a, b in zip(copy.encode(texts, truncate=True, max_tokens=16), encoder.encode(texts, truncate=True, max_tokens=16)):
        np.testing.assert_array_equal(a.tokens, b.tokens)
