"""Long texts read in overlapping windows and answered as one (server/windows.py), over real servers."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading

import httpx
import numpy as np
import pytest
import torch

from modules_store import DEFAULT_STORE
from server.api.app import create_app
from server.config import Settings
from server.windows import (MEASURED_WINDOWS, TextWindows, WindowSettings, cut, furthest_from_edge, mean_by_tokens,
                            mean_of_pooled_vectors, parts, split)
from bench.live_server import wait_until
from tests.helpers import LiveServer

ODD = ["Zoë met 東京の友達 in Köln 😀👍🏽 and e\u0301 ñ Ångström", "Ça va ? 北京 🇫🇷 Mañana", "naïve café 你好世界 🙂"]


def long_text(words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    vocab = ["Peter", "Blackburn", "met", "Angela", "Merkel", "in", "Brussels", "on", "Monday", "the", "said",
             "Reuters", "United", "Nations", "talks", "."] + ODD
    return " ".join(rng.choice(vocab) for _ in range(words))


@pytest.fixture(scope="module")
def live(tiny_store, tiny_backbone):
    settings = Settings(store=tiny_store.root, head_precision="fp32", max_chars=20_000, max_request_tokens=20_000)
    with LiveServer(create_app(settings, backbone=tiny_backbone)) as server:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            yield client


def infer(client, inputs, tasks=None, **extra):
    return client.post("/v1/infer", params={"tasks": tasks} if tasks else {}, json={"inputs": inputs, **extra})


def entity_keys(answer):
    return [(e["text"], e["label"], e["start"], e["end"], e.get("segment")) for e in answer["ner"]["entities"]]


# ---- cutting --------------------------------------------------------------------------------------
def test_cut_covers_every_piece_within_the_room_and_overlap_at_word_boundaries():
    rng = random.Random(0)
    for _ in range(300):
        words, word = [], 0
        for _ in range(rng.randint(1, 400)):  # words of 1..6 pieces, sometimes one of 40
            words += [word] * (40 if rng.random() < 0.01 else rng.randint(1, 6))
            word += 1
        room = rng.randint(8, 60)
        overlap = rng.randint(0, room - 1)
        spans = cut(words, room, overlap)
        assert spans[0][0] == 0 and spans[-1][1] == len(words)
        for (start, end), (next_start, next_end) in zip(spans, spans[1:]):
            assert start < next_start <= end <= next_end  # every piece covered, progress made
            assert end - next_start <= max(overlap, room)
        for start, end in spans:
            assert 0 < end - start <= room
            if end < len(words) and words[end] == words[end - 1]:  # a cut inside a word: no word starts in reach
                assert all(words[k] == words[k - 1] for k in range(start + 1, end + 1))


def test_a_text_that_fits_is_one_row_unchanged(tiny_backbone):
    whole = tiny_backbone.text.encode(["Peter Blackburn met Angela Merkel."], whole=True)[0]
    reading = split(whole, WindowSettings(window=len(whole), stride=len(whole), limit=128))
    assert reading.rows == [whole] and not reading.windowed


def test_windows_hold_the_special_tokens_the_pair_whole_and_a_stretch_of_the_text(tiny_backbone):
    text, pair = long_text(120), "London is bigger than Paris."
    whole = tiny_backbone.text.encode([text], [pair], whole=True)[0]
    reading = split(whole, WindowSettings(window=48, stride=36, limit=128))
    pair_ids = [i for i, s in zip(whole.ids, whole.sequence_ids) if s == 1]
    assert len(reading.rows) > 3
    for row, (start, end) in zip(reading.rows, reading.spans):
        assert len(row) <= 48
        assert row.ids[0] == whole.ids[0] and row.ids[-1] == whole.ids[-1]  # [CLS] ... [SEP]
        assert [i for i, s in zip(row.ids, row.sequence_ids) if s == 1] == pair_ids
        assert [i for i, s in zip(row.ids, row.sequence_ids) if s == 0] == whole.ids[reading.first + start:
                                                                                      reading.first + end]
    # neighbours share `overlap` pieces, moved back to word starts
    for (s0, e0), (s1, _) in zip(reading.spans, reading.spans[1:]):
        assert e0 - s1 >= 12


# ---- combining: hand computations ------------------------------------------------------------------
def windows_of(spans, count, first=1, tail=1):
    whole = type("Whole", (), {"__len__": lambda self: first + count + tail})()
    return TextWindows(whole, first, count, spans, [None] * len(spans))


def test_sequence_logits_are_averaged_weighted_by_the_texts_pieces_in_each_window():
    text = windows_of([(0, 10), (6, 16), (12, 14)], 14)
    outputs = [np.array([1.0, 0.0]), np.array([0.0, 2.0]), np.array([4.0, 4.0])]
    # by hand: weights 10, 10, 2 -> (10*1 + 0 + 2*4) / 22, (0 + 10*2 + 2*4) / 22
    assert mean_by_tokens(text, outputs) == pytest.approx(np.array([18 / 22, 28 / 22]), abs=1e-6)


def test_embeddings_are_averaged_by_tokens_then_normalised():
    text = windows_of([(0, 3), (2, 4)], 4)
    # each output: the unit vector, then the pooled vector's norm before normalisation (2 and 1 here)
    outputs = [np.array([1.0, 0.0, 0.0, 2.0]), np.array([0.0, 1.0, 0.0, 1.0])]
    # by hand: pooled vectors (2, 0, 0) and (0, 1, 0), weights 3 and 2 -> (1.2, 0.4, 0); norm sqrt(1.6)
    mean = np.array([1.2, 0.4, 0.0])
    expected = np.append(mean / np.sqrt(1.6), np.sqrt(1.6))
    assert mean_of_pooled_vectors(text, outputs) == pytest.approx(expected, abs=1e-6)
    # a model that does not normalise: its vectors are the pooled ones, and so is the answer
    raw = [np.array([2.0, 0.0, 0.0, 2.0]), np.array([0.0, 0.5, 0.0, 0.5])]
    expected_raw = np.array([1.2, 0.2, 0.0])
    assert mean_of_pooled_vectors(text, raw) == pytest.approx(np.append(expected_raw, np.linalg.norm(expected_raw)),
                                                              abs=1e-6)


def test_token_logits_come_from_the_window_where_the_token_is_furthest_from_a_cut():
    count = 10
    text = windows_of([(0, 6), (4, 10)], count)  # rows: [CLS] pieces [SEP]
    # window w's logit for its j-th row position is 100 * w + j: which window and where a value came from
    outputs = [np.array([[100.0 * w + j] for j in range(1 + (end - start) + 1)]) for w, (start, end) in
               enumerate(text.spans)]
    merged = furthest_from_edge(text, outputs)[:, 0]
    # pieces 0..3: only window 0; piece 4: distance to window 0's cut 1, to window 1's start 0 -> window 0;
    # piece 5: 0 from window 0's cut, 1 from window 1's -> window 1; 6..9 only window 1 (its end is the text's)
    expected_text = [0 + 1 + i for i in range(5)] + [100 + 1 + (i - 4) for i in range(5, 10)]
    assert merged[1:1 + count].tolist() == expected_text
    assert merged[0] == pytest.approx((0 + 100) / 2) and merged[-1] == pytest.approx(((1 + 6) + (100 + 1 + 6)) / 2)


def test_parts_fit_one_batch_each_and_keep_order(tiny_backbone):
    rows = tiny_backbone.text.encode([long_text(n, n) for n in (3, 50, 7, 90, 20, 5)], whole=True)
    for max_rows, budget in ((2, 10_000), (100, 200), (3, 150)):
        got = parts(rows, max_rows, budget)
        assert [i for part in got for i in range(len(rows))[part]] == list(range(len(rows)))
        for part in got:
            chunk = rows[part]
            assert len(chunk) == 1 or (len(chunk) <= max_rows and len(chunk) * max(map(len, chunk)) <= budget)


# ---- through a real server ------------------------------------------------------------------------
def test_texts_that_fit_answer_as_before_alone_or_beside_long_ones(live, tiny_backbone, tiny_store):
    from server.runtime import Runtime

    short = ["Peter Blackburn met Angela Merkel in Brussels.", "A wonderful film."] + ODD
    runtime = Runtime(Settings(store=tiny_store.root, head_precision="fp32"), tiny_backbone)
    runtime.start()
    reference = runtime.runner.run(tiny_backbone.encode(short), runtime.modules)  # the path without windows
    runtime.close()
    alone = infer(live, short).json()
    beside = infer(live, [long_text(300, 1)] + short + [long_text(200, 2)], window=32).json()
    assert alone["windows"] == [1] * len(short) and beside["windows"][1:-1] == [1] * len(short)
    assert beside["windows"][0] > 1 and beside["windows"][-1] > 1
    for i, text in enumerate(short):
        for answers in (alone["results"][i], beside["results"][1 + i]):
            assert entity_keys(answers) == entity_keys({"ner": reference["ner"][i]})
            for task in ("sentiment", "acceptability"):
                assert answers[task]["label"] == reference[task][i]["label"]
                assert answers[task]["score"] == pytest.approx(reference[task][i]["score"], abs=1e-5)


def test_sequence_answer_is_the_token_weighted_mean_of_the_windows_logits(live, tiny_backbone, tiny_store):
    from server.runtime import Runtime

    text = long_text(150, 3)
    pieces = live.post("/v1/tokenize", json={"inputs": [text], "window": 40}).json()
    windows = pieces["results"][0]["windows"]
    assert len(windows) > 3
    # by hand: each window's text through the backbone alone, its logits, weighted by its text pieces
    runtime = Runtime(Settings(store=tiny_store.root, head_precision="fp32"), tiny_backbone)
    runtime.start()
    module = {"sentiment": runtime.modules["sentiment"]}
    whole = tiny_backbone.text.encode([text], whole=True)[0]
    reading = split(whole, WindowSettings(40, pieces["stride"], 128))
    logits, weights = [], []
    for row, window in zip(reading.rows, windows):
        batch = tiny_backbone.text.collate([row])
        logits.append(runtime.engine.logits(batch, module)["sentiment"][0].double())
        weights.append(window["tokens"] - 2)  # the row's pieces less [CLS] and [SEP]
    runtime.close()
    mean = sum(w * l for w, l in zip(weights, logits)) / sum(weights)
    expected = torch.softmax(mean, dim=-1).tolist()
    answer = infer(live, [text], "sentiment", window=40).json()["results"][0]["sentiment"]
    assert [answer["scores"][label] for label in ("negative", "positive")] == pytest.approx(expected, abs=1e-5)


def test_offsets_are_exact_on_long_texts_with_emoji_cjk_and_combining_marks(live):
    texts = [long_text(400, seed) for seed in range(3)] + [" ".join(ODD * 40)]
    body = infer(live, texts, "ner", window=24, stride=16).json()
    assert min(body["windows"]) > 5
    for text, result in zip(texts, body["results"]):
        entities = result["ner"]["entities"]
        assert len(entities) > 20  # random weights tag most words
        for e in entities:
            assert text[e["start"]:e["end"]] == e["text"]
        assert all(a["end"] <= b["start"] for a, b in zip(entities, entities[1:]))  # once each, in order
    tokens = live.post("/v1/tokenize", json={"inputs": texts[-1:]}).json()["results"][0]["tokens"]
    assert all(texts[-1][t["start"]:t["end"]] == t["text"] for t in tokens if not t["special"])


def test_pairs_keep_the_pair_whole_or_are_refused(live):
    pair = "London is bigger than Paris."
    body = infer(live, [{"text": long_text(200, 4), "text_pair": pair}], "ner", window=32).json()
    assert body["windows"][0] > 1
    pair_entities = [e for e in body["results"][0]["ner"]["entities"] if e["segment"] == 1]
    assert all(pair[e["start"]:e["end"]] == e["text"] for e in pair_entities)
    assert len({(e["start"], e["end"]) for e in pair_entities}) == len(pair_entities)
    refused = infer(live, [{"text": long_text(200, 4), "text_pair": long_text(40, 5)}], window=32)
    assert refused.status_code == 413 and "text pair" in refused.json()["error"]["message"]


def test_truncate_cuts_at_the_first_window(live):
    text = long_text(300, 6)
    body = infer(live, [text, "short"], "ner", truncate=True, window=32).json()
    assert body["truncated"] == [0] and body["windows"] == [1, 1]
    last = max(e["end"] for e in body["results"][0]["ner"]["entities"])
    first_window = live.post("/v1/tokenize", json={"inputs": [text], "window": 32}).json()["results"][0]["windows"][0]
    assert last <= first_window["end"]


def test_limits(live):
    over = infer(live, [" ".join(["word"] * 3000)] * 3, window=32, stride=8)
    assert over.status_code == 413 and over.json()["error"]["type"] == "too_many_tokens"
    error = over.json()["error"]
    assert error["token_budget"] == 20_000 and error["tokens"] > 20_000 and str(error["tokens"]) in error["message"]
    assert infer(live, ["y" * 20_001]).status_code == 413
    for extra in ({"window": 8}, {"window": 129}, {"window": 64, "stride": 7}, {"window": 64, "stride": 65}):
        bad = infer(live, ["fine"], **extra)
        assert bad.status_code == 422 and bad.json()["error"]["type"] == "invalid_request", extra


def test_server_window_settings_are_checked_against_the_backbone(tiny_backbone):
    """--window-tokens over the backbone's limit was cut to it without a word; a stride that did not
    fit made every request 422 for a setting its client never sent. Both now stop start-up."""
    from server.windows import server_window_problem

    text = tiny_backbone.text
    assert server_window_problem(text, None, None, None) is None
    assert server_window_problem(text, None, text.max_tokens, None) is None
    assert server_window_problem(text, None, 64, 8) is None and server_window_problem(text, None, 64, 64) is None
    assert server_window_problem(text, None, text.max_tokens + 1, None) == (
        f"--window-tokens={text.max_tokens + 1}: a window holds 16 to {text.max_tokens} word pieces on this backbone")
    assert server_window_problem(text, 32, 64, None).endswith("16 to 32 word pieces on this backbone with --max-tokens 32")
    assert server_window_problem(text, None, 64, 7) == "--window-stride=7: with --window-tokens=64 the stride is 8 to 64 word pieces"
    assert server_window_problem(text, text.max_tokens, None, None) is None
    assert server_window_problem(text, text.max_tokens + 1, None, None) == (  # it was cut to the limit quietly
        f"--max-tokens={text.max_tokens + 1}: a row holds at most {text.max_tokens} word pieces on this backbone")


def test_tmod_serve_with_a_window_over_the_backbones_limit_exits_in_one_line(tiny_backbone_dir, tiny_backbone, tmp_path):
    over = tiny_backbone.text.max_tokens + 100
    done = subprocess.run([sys.executable, "-m", "server.cli", "--port", "0", "--backbone", str(tiny_backbone_dir),
                           "--store", str(tmp_path), "--window-tokens", str(over)],
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    said = [line for line in done.stderr.splitlines() if line.startswith("tmod-serve:")]
    assert said == [f"tmod-serve: cannot serve: --window-tokens={over}: a window holds 16 to "
                    f"{tiny_backbone.text.max_tokens} word pieces on this backbone ({tiny_backbone.name})"], done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_a_request_over_its_token_budget_is_refused_before_it_is_tokenized_whole(tiny_backbone, monkeypatch):
    """64 inputs of 20,000 characters: the budget is passed within the first run of inputs
    (READ_RUN_CHARS), so the rest is never tokenized (the whole request took 5-9 s of CPU before its 413)."""
    from server import windows

    encoder = tiny_backbone.text
    tokenized = []
    encode = encoder.encode
    monkeypatch.setattr(encoder, "encode", lambda texts, *a, **k: tokenized.extend(texts) or encode(texts, *a, **k))
    texts = ["word " * 4000] * 64  # 20,000 characters each: one run of READ_RUN_CHARS
    chosen = windows.settings_for(encoder, 128, None, None, None, None)
    with pytest.raises(windows.TooManyTokens) as refused:
        windows.read(encoder, texts, None, chosen, False, budget=5_000)
    assert refused.value.tokens > 5_000 and "first 1 of 64 inputs" in str(refused.value)
    assert len(tokenized) == 1  # the first input, not 64
    within = windows.read(encoder, texts[:3], None, chosen, False, budget=100_000)
    assert within.tokens == windows.read(encoder, texts[:3], None, chosen, False).tokens > 5_000


def test_tasks_name_the_window_and_the_rules(live):
    listing = live.get("/v1/tasks").json()
    assert listing["windows"]["window"] == 128 and listing["windows"]["stride"] == 96  # tiny model: its limit
    rules = {t["task"]: t["windows"] for t in listing["tasks"]}
    assert rules["ner"].startswith("token_logits") and rules["sentiment"].startswith("mean_of_logits")


def test_tei_tokenize_route_shape(live):
    body = live.post("/tokenize", json={"inputs": "Zoë 😀 東京", "add_special_tokens": True}).json()
    assert isinstance(body, list) and len(body) == 1
    first, *rest = body[0]
    assert first == {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None}
    assert all(set(t) == {"id", "text", "special", "start", "stop"} for t in body[0])
    assert all("Zoë 😀 東京"[t["start"]:t["stop"]] == t["text"] for t in rest if not t["special"])
    plain = live.post("/tokenize", json={"inputs": ["a b"], "add_special_tokens": False}).json()
    assert [t["special"] for t in plain[0]] == [False, False]


def test_a_request_of_many_windows_takes_turns_with_short_requests(tiny_store, tiny_backbone):
    """A request of 24 long texts (hundreds of windows, many batches) beside short requests sent after it:
    every short request is answered before the long one (its parts go to the back of the queue)."""
    settings = Settings(store=tiny_store.root, max_batch_tokens=256, max_request_tokens=100_000, max_chars=20_000,
                        tasks="sentiment")
    with LiveServer(create_app(settings, backbone=tiny_backbone)) as server:
        finished = []
        lock = threading.Lock()

        def send(name, inputs, **extra):
            response = httpx.post(server.url + "/v1/infer", json={"inputs": inputs, **extra}, timeout=300)
            with lock:
                finished.append((name, response.status_code))

        long = threading.Thread(target=send, args=("long", [long_text(300, s) for s in range(24)]),
                                kwargs={"window": 16, "stride": 12})
        long.start()

        def long_is_running():
            text = httpx.get(server.url + "/metrics").text
            return "tmod_batch_requests_count" in text and any(
                line.startswith("tmod_batch_requests_count ") and float(line.split()[1]) >= 2
                for line in text.splitlines())

        wait_until(long_is_running, "the long request's first parts", timeout=60)
        shorts = [threading.Thread(target=send, args=(f"short{i}", [f"short request {i}"])) for i in range(8)]
        for thread in shorts:
            thread.start()
        for thread in shorts + [long]:
            thread.join(timeout=300)
    assert all(status == 200 for _, status in finished), finished
    assert finished[-1][0] == "long", finished


def test_an_entity_across_a_window_cut_comes_back_once_with_exact_offsets(minilm):
    """The shipped MiniLM ner module: an organisation name placed so that the first window's cut falls
    inside it, or the second window starts inside it, is answered once, whole, as in a short text."""
    name = "United Nations Security Council"
    filler = "The talks went on for hours and nobody said much about the weather that day ."
    settings = Settings(store=DEFAULT_STORE, tasks="ner", head_precision="fp32")
    window = WindowSettings(32, 24, minilm.max_tokens)
    with LiveServer(create_app(settings, backbone=minilm)) as server, httpx.Client(base_url=server.url) as client:
        alone = infer(client, [f"He spoke to the {name} on Monday ."], "ner").json()["results"][0]["ner"]["entities"]
        assert [e["text"] for e in alone if e["label"] == "ORG"] == [name]
        placed = {"cut": 0, "start": 0}
        for words in range(1, 40):
            text = " ".join((filler + " " + filler).split()[:words]) + f" he spoke to the {name} on Monday . " + filler + " " + filler
            begin = text.index(name)
            reading = split(minilm.text.encode([text], whole=True)[0], window)
            offsets = reading.whole.offsets[reading.first:reading.first + reading.count]
            (_, end0), (start1, _) = reading.spans[:2]
            # where does it fall: the first window's last piece, or the second's first, inside the name
            cut_inside = begin < offsets[end0 - 1][1] < begin + len(name)
            start_inside = begin < offsets[start1][0] < begin + len(name)
            if not (cut_inside or start_inside):
                continue
            placed["cut" if cut_inside else "start"] += 1
            body = infer(client, [text], "ner", window=32, stride=24).json()
            assert body["windows"] == [len(reading.rows)] and len(reading.rows) >= 2
            entities = body["results"][0]["ner"]["entities"]
            for e in entities:
                assert text[e["start"]:e["end"]] == e["text"]
            touching = [e for e in entities if e["start"] < begin + len(name) and begin < e["end"]]
            assert [(e["text"], e["label"], e["start"]) for e in touching] == [(name, "ORG", begin)], (words, touching)
        assert placed["cut"] >= 2 and placed["start"] >= 2, placed


def test_oip_requests_take_window_parameters(live):
    text = long_text(200, 8)

    def oip(parameters):
        return live.post("/v2/models/ner/infer", json={
            "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [text]}], "parameters": parameters})

    body = oip({"window": 32, "stride": 24})
    assert body.status_code == 200, body.text
    entities = json.loads(body.json()["outputs"][0]["data"][0])
    assert entities and all(text[e["start"]:e["end"]] == e["text"] for e in entities)
    assert entities == infer(live, [text], "ner", window=32, stride=24).json()["results"][0]["ner"]["entities"]
    for bad in ({"window": "32"}, {"window": 8}, {"stride": True}):
        assert oip(bad).status_code == 422, bad


def test_truncating_and_whole_reads_of_one_tokenizer_do_not_mix_across_threads(minilm):
    """A request cut with `truncate` and a document read whole, tokenized at once in two threads (the
    server's tokenizer threads): neither gets the other's truncation. Before the truncating copy,
    ~1% of whole reads here came back cut and as many cut reads came back whole."""
    text = minilm.text
    long = " ".join(f"word{i}" for i in range(200))
    whole_length = len(text.encode([long], whole=True)[0])
    seen = {"whole": set(), "cut": set()}

    def read(kind, rounds=400):
        for _ in range(rounds):
            row = text.encode([long], whole=True)[0] if kind == "whole" else \
                text.encode([long], truncate=True, max_tokens=16)[0]
            seen[kind].add(len(row))

    threads = [threading.Thread(target=read, args=(kind,)) for kind in ("whole", "cut")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"whole": {whole_length}, "cut": {16}}


def test_a_requests_default_window_is_the_measured_one_of_its_task_types(minilm):
    """The shipped MiniLM modules: a long text asked for ner is read in the window measured best for
    token tasks on MiniLM (MEASURED_WINDOWS), for sentiment alone in the trained length (256; nothing
    measured), and for both in the trained length too, so sentiment's answer never depends on what was
    asked beside it; a request's own window and the server's window_tokens win."""
    measured = MEASURED_WINDOWS[("all-MiniLM-L6-v2", "token_classification")]
    assert measured != 256
    text = long_text(700)
    settings = Settings(store=DEFAULT_STORE, tasks="ner,sentiment", head_precision="fp32", max_chars=20_000)
    with LiveServer(create_app(settings, backbone=minilm)) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        count = {w: len(client.post("/v1/tokenize", json={"inputs": [text], "window": w}).json()["results"][0]["windows"])
                 for w in (measured, 256)}
        assert count[measured] != count[256]
        assert infer(client, [text], "ner").json()["windows"] == [count[measured]]
        assert infer(client, [text], "sentiment").json()["windows"] == [count[256]]
        assert infer(client, [text], "ner,sentiment").json()["windows"] == [count[256]]
        assert infer(client, [text], "ner", window=256).json()["windows"] == [count[256]]
        assert client.get("/v1/tasks").json()["windows"]["window_by_task_type"] == {
            "sequence_classification": 256, "token_classification": measured}
    with LiveServer(create_app(settings.model_copy(update={"window_tokens": 256}), backbone=minilm)) as server, \
            httpx.Client(base_url=server.url, timeout=120) as client:
        assert infer(client, [text], "ner").json()["windows"] == [count[256]]
