#!/usr/bin/env python
"""Long documents through a real `tmod-serve`: document-level NER on CoNLL-2003 validation, and the
cost of windows.

What it does
------------
1. Starts one `tmod-serve` (bench/harness.py `running_server`: the shipped `ner` module of
   `--backbone`, `--threads` torch threads) and keeps it up for the whole run: every figure below
   comes from the same server.
2. NER, three ways, on the validation split's documents (the sentences between -DOCSTART- lines):
   - `sentences`: every sentence its own input (its words joined with spaces), a document's sentences
     in one request (split at the server's 64-input limit): the sentence-by-sentence reading;
   - `documents`: one request per document, the text its words joined with spaces, read in windows of
     `--window` word pieces (the request's `window`, stride three quarters of it);
   - `truncated`: the same requests with `truncate`: each document cut at its first window.
   Entities come back as character spans; each is mapped back to the gold words it overlaps (B- on the
   first, I- on the rest), the document's tags are cut back into its sentences, and entity F1 (exact
   span and type, training/metrics.py) is computed per sentence, as for the shipped modules.
3. Speed: requests of one synthetic document (validation sentences joined until it needs exactly N
   windows, N in --sizes) against requests of one single-window text (a text of one window's length), each timed
   `--repeats` times, alternating, median taken: `per_window_ratio` = time(N windows) / (N x time(1 window)).
   Also time(N windows) against one request of the same N windows sent as N separate texts, which is
   the same rows without the windowing.

Output: bench/results/long-documents-<backbone>.json (with the machine, CPU flags, versions, date) and
a short table on stdout.

    .venv/bin/python bench/long_documents.py --backbone minilm
    .venv/bin/python bench/long_documents.py --backbone mpnet
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.harness import machine_info, read_sst2_sentences, running_server, write_json  # noqa: E402
from training.data.conll import read_conll_documents  # noqa: E402
from training.data.files import default_data_dir  # noqa: E402
from training.metrics import entity_scores  # noqa: E402

MAX_INPUTS = 64


def word_spans(words: list[str]) -> list[tuple[int, int]]:
    spans, start = [], 0
    for word in words:
        spans.append((start, start + len(word)))
        start += len(word) + 1
    return spans


def tags_from_entities(entities: list[dict], spans: list[tuple[int, int]]) -> list[str]:
    """BIO tags over words from served entities: each entity tags the words its characters overlap."""
    tags = ["O"] * len(spans)
    for entity in entities:
        covered = [i for i, (s, e) in enumerate(spans) if s < entity["end"] and entity["start"] < e]
        covered = [i for i in covered if tags[i] == "O"]  # a word already in an entity keeps it
        for k, i in enumerate(covered):
            tags[i] = ("B-" if k == 0 else "I-") + entity["label"]
    return tags


def post(client: httpx.Client, body: dict) -> dict:
    response = client.post("/v1/infer", params={"tasks": "ner"}, json=body)
    if response.status_code != 200:
        raise SystemExit(f"server answered {response.status_code}: {response.text[:500]}")
    return response.json()


def ner_scores(client: httpx.Client, documents, windows: list[int]) -> dict:
    out = sentence_scores(client, documents)
    for window in windows:
        out.update(document_scores(client, documents, window))
    return out


def sentence_scores(client: httpx.Client, documents) -> dict:
    gold = [s.tags for doc in documents for s in doc]
    out = {}
    # sentence by sentence
    predicted, seconds = [], time.perf_counter()
    for doc in documents:
        for first in range(0, len(doc), MAX_INPUTS):
            chunk = doc[first:first + MAX_INPUTS]
            body = post(client, {"inputs": [" ".join(s.words) for s in chunk]})
            for sentence, result in zip(chunk, body["results"]):
                predicted.append(tags_from_entities(result["ner"]["entities"], word_spans(sentence.words)))
    out["sentences"] = {**entity_scores(gold, predicted), "seconds": time.perf_counter() - seconds}
    return out


def document_scores(client: httpx.Client, documents, window: int) -> dict:
    gold = [s.tags for doc in documents for s in doc]
    out = {}
    # whole documents, in windows / cut at the first window
    for mode, truncate in (("documents", False), ("truncated", True)):
        mode = f"{mode}_window_{window}"
        predicted, windows, cut, seconds = [], [], 0, time.perf_counter()
        for doc in documents:
            words = [w for s in doc for w in s.words]
            body = post(client, {"inputs": [" ".join(words)], "window": window, "truncate": truncate})
            windows.append(body["windows"][0])
            cut += bool(body["truncated"])
            tags = tags_from_entities(body["results"][0]["ner"]["entities"], word_spans(words))
            at = 0
            for s in doc:
                predicted.append(tags[at:at + len(s.words)])
                at += len(s.words)
        out[mode] = {**entity_scores(gold, predicted), "seconds": time.perf_counter() - seconds,
                     "windows_per_document": {"mean": statistics.mean(windows), "max": max(windows),
                                              "documents_over_one_window": sum(w > 1 for w in windows)}}
        out[mode]["documents_cut"] = cut
    for mode in out:
        out[mode].pop("per_type", None)
    return out


def document_of(client: httpx.Client, sentences: list[str], windows: int, window: int) -> str:
    """Validation sentences joined until the text is read in exactly `windows` windows (asked of
    /v1/tokenize, so the count is the server's own)."""
    text, k = "", 0
    while True:
        text = (text + " " + sentences[k % len(sentences)]).strip()
        k += 1
        count = len(client.post("/v1/tokenize", json={"inputs": [text], "window": window}).json()["results"][0]["windows"])
        if count == windows:
            return text
        if count > windows:
            raise SystemExit(f"could not build a document of exactly {windows} windows")


def timed(client: httpx.Client, body: dict) -> float:
    start = time.perf_counter()
    post(client, body)
    return time.perf_counter() - start


def speed(client: httpx.Client, documents, window: int, sizes: list[int], repeats: int) -> dict:
    sentences = [" ".join(s.words) for doc in documents for s in doc if len(s.words) > 5]
    single = document_of(client, sentences, 1, window)
    while True:  # a single-window text as long as a window can hold: what one window costs
        longer = single + " " + sentences[len(single) % len(sentences)]
        if len(client.post("/v1/tokenize", json={"inputs": [longer], "window": window}).json()["results"][0]["windows"]) > 1:
            break
        single = longer
    out = {"single_window_tokens": client.post("/v1/tokenize", json={"inputs": [single]}).json()["results"][0]["length"]}
    for n in sizes:
        doc = document_of(client, sentences, n, window)
        rows = [w for w in client.post("/v1/tokenize", json={"inputs": [doc], "window": window}).json()["results"][0]["windows"]]
        pieces = [doc[w["start"]:w["end"]] for w in rows]  # the same windows' text, sent as separate texts
        one, many, separate = [], [], []
        for _ in range(repeats):
            one.append(timed(client, {"inputs": [single], "window": window}))
            many.append(timed(client, {"inputs": [doc], "window": window}))
            if len(pieces) <= MAX_INPUTS:
                separate.append(timed(client, {"inputs": pieces, "window": window}))
        t1, tn = statistics.median(one), statistics.median(many)
        out[str(n)] = {"windows": n, "seconds_one_window": t1, "seconds_document": tn,
                       "per_window_ratio": tn / (n * t1),
                       "seconds_same_windows_as_texts": statistics.median(separate) if separate else None,
                       "document_vs_windows_as_texts": tn / statistics.median(separate) if separate else None}
        print(f"N={n}: document {tn * 1000:.1f} ms, one window {t1 * 1000:.1f} ms, ratio {tn / (n * t1):.2f}"
              + (f", vs the same windows as texts {tn / statistics.median(separate):.2f}" if separate else ""),
              flush=True)
    return out


def host_cost(backbone: str, repeats: int = 7) -> dict:
    """Host work per short request (an SST-2 sentence), in this process: what the server did before
    windows (tokenize with the token limit) against what it does now (tokenize whole, choose the
    window, cut, count, plan parts), alternating, median microseconds over 500 sentences."""
    from server import windows
    from server.backbone import Backbone

    text = Backbone.load(backbone).text
    sentences = read_sst2_sentences()[:500]

    def before(sentence):
        text.encode([sentence], None, False, None)

    def after(sentence):
        reading = windows.read(text, [sentence], None, windows.settings_for(text, None), False)
        windows.parts(reading.rows, 128, 16384)
        return reading.tokens, reading.windows, reading.windowed

    runs = {"before": [], "after": []}
    for rep in range(repeats):
        for name, work in ((("before", before), ("after", after)) if rep % 2 == 0 else (("after", after), ("before", before))):
            start = time.perf_counter()
            for sentence in sentences:
                work(sentence)
            runs[name].append(1e6 * (time.perf_counter() - start) / len(sentences))
    medians = {name: statistics.median(values) for name, values in runs.items()}
    return {"us_per_request": medians, "extra_us_per_request": medians["after"] - medians["before"], "runs_us": runs}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backbone", default="minilm", help="minilm or mpnet (served with the shipped ner module)")
    p.add_argument("--window", default="128", help="word pieces per window (the request's `window`); several "
                   "comma-separated: documents read at each (the first is the one the speed section uses)")
    p.add_argument("--store", type=Path, default=None, help="module store to serve ner from (default: the shipped one)")
    p.add_argument("--threads", type=int, default=1, help="server torch threads")
    p.add_argument("--sizes", default="2,8,32", help="windows per document in the speed section")
    p.add_argument("--repeats", type=int, default=5, help="timings per size (median)")
    p.add_argument("--limit", type=int, default=None, help="first N documents only (a quick check)")
    p.add_argument("--skip-speed", action="store_true", help="leave out the speed section (step 3)")
    p.add_argument("--skip-ner", action="store_true", help="leave out the NER scores (step 2)")
    p.add_argument("--host-cost", action="store_true", help="only the host work per short request, before and "
                   "after windows, in this process (no server)")
    p.add_argument("--out", type=Path, default=None, help="JSON results (default bench/results/long-documents-"
                   "<backbone>.json; with --host-cost, long-documents-host-cost-<backbone>.json)")
    args = p.parse_args(argv)
    windows = [int(w) for w in args.window.split(",")]
    if args.host_cost:
        record = {"benchmark": "host work per short request, before and after windows", "backbone": args.backbone,
                  "machine": machine_info("cpu"), **host_cost(args.backbone)}
        out = write_json(args.out or REPO / "bench" / "results" / f"long-documents-host-cost-{args.backbone}.json", record)
        print(json.dumps(record["us_per_request"]), f"wrote {out}")
        return
    path = Path(default_data_dir()) / "conll2003" / "validation.txt"
    documents = read_conll_documents(path)[:args.limit]
    env = {"HF_HUB_OFFLINE": "1", "TMOD_THREADS": str(args.threads), "TMOD_LOG_LEVEL": "warning"}
    serve_args = ["--backbone", args.backbone, "--tasks", "ner", *(["--store", str(args.store)] if args.store else [])]
    with tempfile.TemporaryDirectory() as tmp, running_server("ner", env, Path(tmp) / "serve.log", serve_args) as server, \
            httpx.Client(base_url=server.url, timeout=600) as client:
        tasks = client.get("/v1/tasks").json()
        ner = tasks["tasks"][0]
        record = {
            "benchmark": "long documents: document-level NER in windows, and the cost of windows",
            "machine": machine_info("cpu"),
            "backbone": args.backbone, "module": f"ner/{ner['version']}", "threads": args.threads,
            "windows": windows, "server_windows": tasks["windows"],
            "data": {"path": str(path), "documents": len(documents),
                     "sentences": sum(len(d) for d in documents)},
        }
        started = time.perf_counter()
        if not args.skip_ner:
            record["ner"] = ner_scores(client, documents, windows)
            for mode, scores in record["ner"].items():
                print(f"{mode:10s} F1 {100 * scores['f1']:.2f} (P {100 * scores['precision']:.2f}, "
                      f"R {100 * scores['recall']:.2f}) {scores['seconds']:.0f}s", flush=True)
            record["f1_documents_minus_sentences_points"] = {
                w: 100 * (record["ner"][f"documents_window_{w}"]["f1"] - record["ner"]["sentences"]["f1"])
                for w in windows}
            record["ner_seconds"] = time.perf_counter() - started
        if not args.skip_speed:
            record["speed"] = speed(client, documents, windows[0], [int(x) for x in args.sizes.split(",")],
                                    args.repeats)
    out = write_json(args.out or REPO / "bench" / "results" / f"long-documents-{args.backbone}.json", record)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
