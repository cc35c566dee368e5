"""Hostile input against one real `tmod-serve` process: every case answers its documented status in
its protocol's shape (tmod's `{"error": {"type", "message"}}`, the Open Inference Protocol's
`{"error": "<message>", "type"}` on `/v2`, OpenAI's `{"error": {"message", "type", "param", "code"}}`
on `/v1/embeddings`, Text Embeddings Inference's `{"error", "error_type"}` on `/embed` and
`/tokenize`), refusals made before the route included, with a request id, without echoing the input
back, and the server stays up and answers a good request after all of them.

The cases are data (`CASES`, `RAW_CASES`): one module-scoped server, one parametrised test each.
"""
from __future__ import annotations

import gzip
import json
import os
import socket
import threading
import zlib
from urllib.parse import urlsplit

import httpx
import pytest

from bench.live_server import read_until_closed
from tests.helpers import start_tmod_serve, with_a_pair_task

ADMIN = {"authorization": "Bearer hostile-admin-token"}
MAX_BODY = 65536
SLOW_CLIENT_S = 2  # the server's header and body read timeouts
BIG = "x" * 100_000  # an attacker-sized value: no error body may echo it

OIP_TEXT = {"name": "text", "datatype": "BYTES", "shape": [1], "data": ["a fine film"]}


def oip(**changes):
    """An OIP infer body for sentiment, with `changes` applied to the request (or to its text input
    under the key "text")."""
    text = {**OIP_TEXT, **changes.pop("text", {})}
    return {"inputs": [text], **changes}


def nested(depth: int, leaf="a") -> str:
    return "[" * depth + json.dumps(leaf) + "]" * depth


def gzipped(body: dict | bytes, coding: str = "gzip") -> dict:
    """Request kwargs for `body` sent compressed (as tritonclient's request compression sends it)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    packed = gzip.compress(data) if coding == "gzip" else zlib.compress(data)
    return {"content": packed, "headers": {"content-type": "application/json", "content-encoding": coding}}


def raw_body(data: bytes) -> dict:
    return {"content": data, "headers": {"content-type": "application/json"}}


HUGE_INTEGER = b'{"inputs": ["a"], "window": ' + b"9" * 5001 + b"}"
ZIP_BOMB = gzip.compress(b'{"inputs": ["' + b"a" * (MAX_BODY * 40) + b'"]}')  # 2.6 MB inflated, 3 KB sent


def chunks(total: int, size: int = 8192):
    def gen():
        sent = 0
        while sent < total:
            yield b"x" * min(size, total - sent)
            sent += size
    return gen()


def refused_before_the_route(name: str, path: str, field: str, bad_bytes_status: int, body: dict | None = None):
    """Cases refused before `path`'s handler, answered in its protocol's shape (`name`'s prefix): a
    body over the limit (whole and chunked), JSON nested too deep, bytes that are not UTF-8 and a
    5,001-digit integer in `field` (those two answer `bad_bytes_status`). `body`: the rest of a valid body."""
    shape = name.split("-")[0]
    return [
        (f"{name}-body-over-limit", "POST", path, {"json": {**(body or {}), field: BIG}}, 413, shape),
        (f"{name}-chunked-over-limit", "POST", path,
         {"headers": {"content-type": "application/json"}, "content": chunks(MAX_BODY * 2)}, 413, shape),
        (f"{name}-deep-json", "POST", path, raw_body(nested(20_000).encode()), 413, shape),
        (f"{name}-not-utf8", "POST", path, raw_body(b'{"%s": "\xff\xfe"}' % field.encode()), bad_bytes_status, shape),
        (f"{name}-huge-integer", "POST", path, raw_body(b'{"%s": ' % field.encode() + b"9" * 5001 + b"}"),
         bad_bytes_status, shape),
    ]


# (id, method, path, request kwargs, status, shape)
CASES = [
    # ---- /v1/infer: bodies ------------------------------------------------------------------------
    ("v1-no-body", "POST", "/v1/infer", {}, 422, "v1"),
    ("v1-null", "POST", "/v1/infer", {"json": None, "content": b"null"}, 422, "v1"),
    ("v1-list-body", "POST", "/v1/infer", {"json": []}, 422, "v1"),
    ("v1-empty-object", "POST", "/v1/infer", {"json": {}}, 422, "v1"),
    ("v1-empty-inputs", "POST", "/v1/infer", {"json": {"inputs": []}}, 422, "v1"),
    ("v1-inputs-string", "POST", "/v1/infer", {"json": {"inputs": "text"}}, 422, "v1"),
    ("v1-inputs-number", "POST", "/v1/infer", {"json": {"inputs": [1]}}, 422, "v1"),
    ("v1-inputs-null-item", "POST", "/v1/infer", {"json": {"inputs": [None]}}, 422, "v1"),
    ("v1-inputs-nested-list", "POST", "/v1/infer", {"json": {"inputs": [["a"]]}}, 422, "v1"),
    ("v1-mixed-forms", "POST", "/v1/infer", {"json": {"inputs": ["a", {"text": "a", "text_pair": "b"}]}}, 422, "v1"),
    ("v1-pair-missing-field", "POST", "/v1/infer", {"json": {"inputs": [{"text": "a"}]}}, 422, "v1"),
    ("v1-pair-extra-field", "POST", "/v1/infer",
     {"json": {"inputs": [{"text": "a", "text_pair": "b", "extra": 1}]}}, 422, "v1"),
    ("v1-huge-extra-key", "POST", "/v1/infer", {"json": {"inputs": ["a"], BIG[:50_000]: 1}}, 422, "v1"),
    ("v1-truncate-string", "POST", "/v1/infer", {"json": {"inputs": ["a"], "truncate": "maybe"}}, 422, "v1"),
    ("v1-empty-text", "POST", "/v1/infer", {"json": {"inputs": [""]}}, 422, "v1"),
    ("v1-whitespace-text", "POST", "/v1/infer", {"json": {"inputs": [" \t\n"]}}, 422, "v1"),
    ("v1-nul-char", "POST", "/v1/infer", {"json": {"inputs": ["a\u0000b"]}}, 422, "v1"),
    ("v1-c1-control", "POST", "/v1/infer", {"json": {"inputs": ["a\u0085b"]}}, 422, "v1"),
    ("v1-lone-surrogate", "POST", "/v1/infer", {"content": b'{"inputs": ["a\\ud800b"]}'}, 422, "v1"),
    ("v1-not-utf8", "POST", "/v1/infer", {"content": b'{"inputs": ["\xff\xfe"]}',
                                          "headers": {"content-type": "application/json"}}, 422, "v1"),
    ("v1-not-json", "POST", "/v1/infer", {"content": b"{inputs:", "headers": {"content-type": "application/json"}},
     422, "v1"),
    ("v1-trailing-garbage", "POST", "/v1/infer", {"content": b'{"inputs": ["a"]} x',
                                                  "headers": {"content-type": "application/json"}}, 422, "v1"),
    ("v1-too-many-inputs", "POST", "/v1/infer", {"json": {"inputs": ["a"] * 9}}, 413, "v1"),
    ("v1-too-many-chars", "POST", "/v1/infer", {"json": {"inputs": ["a " * 1001]}}, 413, "v1"),
    ("v1-too-many-tokens", "POST", "/v1/infer", {"json": {"inputs": ["word " * 399] * 3}}, 413, "v1"),
    ("v1-body-over-limit", "POST", "/v1/infer", {"json": {"inputs": [BIG]}}, 413, "v1"),
    ("v1-chunked-over-limit", "POST", "/v1/infer", {"content": chunks(MAX_BODY * 2),
                                                    "headers": {"content-type": "application/json"}}, 413, "v1"),
    ("v1-deep-json", "POST", "/v1/infer", {"content": ('{"inputs": ' + nested(20_000) + "}").encode(),
                                           "headers": {"content-type": "application/json"}}, 413, "v1"),
    ("v1-pair-task-single-texts", "POST", "/v1/infer?tasks=pairs", {"json": {"inputs": ["a"]}}, 422, "v1"),
    ("v1-wrong-content-type", "POST", "/v1/infer", {"content": b'{"inputs": ["a"]}',
                                                    "headers": {"content-type": "text/plain"}}, 422, "v1"),
    # ---- /v1/infer: the tasks query ---------------------------------------------------------------
    ("v1-tasks-unknown", "POST", "/v1/infer?tasks=nope", {"json": {"inputs": ["a"]}}, 400, "v1"),
    ("v1-tasks-empty", "POST", "/v1/infer?tasks=", {"json": {"inputs": ["a"]}}, 400, "v1"),
    ("v1-tasks-empty-name", "POST", "/v1/infer?tasks=sentiment,,ner", {"json": {"inputs": ["a"]}}, 400, "v1"),
    ("v1-tasks-duplicate", "POST", "/v1/infer?tasks=ner,ner", {"json": {"inputs": ["a"]}}, 400, "v1"),
    ("v1-tasks-20000-duplicates", "POST", "/v1/infer?tasks=" + ",".join(["a"] * 20_000),
     {"json": {"inputs": ["a"]}}, 400, "v1"),
    ("v1-tasks-3000-unknown", "POST", "/v1/infer?tasks=" + ",".join(f"t{i}" for i in range(3000)),
     {"json": {"inputs": ["a"]}}, 400, "v1"),
    ("v1-tasks-long-name", "POST", "/v1/infer?tasks=" + "z" * 30_000, {"json": {"inputs": ["a"]}}, 400, "v1"),
    ("v1-tasks-path-like", "POST", "/v1/infer?tasks=../sentiment", {"json": {"inputs": ["a"]}}, 400, "v1"),
    ("v1-tasks-unicode", "POST", "/v1/infer?tasks=s\u00e9ntiment", {"json": {"inputs": ["a"]}}, 400, "v1"),
    ("v1-tasks-only-commas", "POST", "/v1/infer?tasks=,,,", {"json": {"inputs": ["a"]}}, 400, "v1"),
    # ---- /v1: other routes and methods ------------------------------------------------------------
    ("v1-get-infer", "GET", "/v1/infer", {}, 405, "v1"),
    ("v1-put-infer", "PUT", "/v1/infer", {"json": {"inputs": ["a"]}}, 405, "v1"),
    ("v1-unknown-route", "GET", "/v1/nope", {}, 404, "v1"),
    ("v1-unknown-task-detail", "GET", "/v1/tasks/nope", {}, 404, "v1"),
    ("v1-huge-task-detail", "GET", "/v1/tasks/" + "z" * 20_000, {}, 404, "v1"),
    ("v1-task-detail-dotdot", "GET", "/v1/tasks/..%2F..%2Fetc", {}, 404, "v1"),
    ("root-unknown", "GET", "/nope", {}, 404, "v1"),
    ("healthz-post", "POST", "/healthz", {}, 405, "v1"),
    ("metrics-post", "POST", "/metrics", {}, 405, "v1"),
    # ---- /v2 (Open Inference Protocol) ------------------------------------------------------------
    ("v2-unknown-model", "POST", "/v2/models/nope/infer", {"json": oip()}, 404, "oip"),
    ("v2-unknown-model-metadata", "GET", "/v2/models/nope", {}, 404, "oip"),
    ("v2-unknown-model-ready", "GET", "/v2/models/nope/ready", {}, 404, "oip"),
    ("v2-unknown-version", "POST", "/v2/models/sentiment/versions/99/infer", {"json": oip()}, 404, "oip"),
    ("v2-huge-version", "POST", "/v2/models/sentiment/versions/" + "9" * 20_000 + "/infer", {"json": oip()}, 404, "oip"),
    ("v2-unknown-route", "GET", "/v2/nope", {}, 404, "oip"),
    ("v2-get-infer", "GET", "/v2/models/sentiment/infer", {}, 405, "oip"),
    ("v2-delete-model", "DELETE", "/v2/models/sentiment", {}, 405, "oip"),
    ("v2-no-body", "POST", "/v2/models/sentiment/infer", {}, 422, "oip"),
    ("v2-not-json", "POST", "/v2/models/sentiment/infer", {"content": b"{not json"}, 422, "oip"),
    ("v2-not-utf8", "POST", "/v2/models/sentiment/infer", {"content": b"\xff\xfe\xfd"}, 422, "oip"),
    ("v2-list-body", "POST", "/v2/models/sentiment/infer", {"json": []}, 422, "oip"),
    ("v2-no-inputs", "POST", "/v2/models/sentiment/infer", {"json": {}}, 422, "oip"),
    ("v2-empty-inputs", "POST", "/v2/models/sentiment/infer", {"json": {"inputs": []}}, 422, "oip"),
    ("v2-input-not-object", "POST", "/v2/models/sentiment/infer", {"json": {"inputs": ["text"]}}, 422, "oip"),
    ("v2-input-no-name", "POST", "/v2/models/sentiment/infer", {"json": {"inputs": [{"datatype": "BYTES"}]}}, 422, "oip"),
    ("v2-unknown-input", "POST", "/v2/models/sentiment/infer", {"json": oip(text={"name": "txt"})}, 400, "oip"),
    ("v2-huge-input-name", "POST", "/v2/models/sentiment/infer", {"json": oip(text={"name": BIG[:60_000]})}, 400, "oip"),
    ("v2-input-twice", "POST", "/v2/models/sentiment/infer", {"json": {"inputs": [OIP_TEXT, OIP_TEXT]}}, 400, "oip"),
    ("v2-wrong-datatype", "POST", "/v2/models/sentiment/infer", {"json": oip(text={"datatype": "FP32"})}, 400, "oip"),
    ("v2-shape-string", "POST", "/v2/models/sentiment/infer", {"json": oip(text={"shape": ["a"]})}, 400, "oip"),
    ("v2-shape-floats", "POST", "/v2/models/sentiment/infer", {"json": oip(text={"shape": [1e300, 1e300]})}, 400, "oip"),
    ("v2-shape-huge-ints", "POST", "/v2/models/sentiment/infer", {"json": oip(text={"shape": [10**30, 10**30]})}, 400, "oip"),
    ("v2-shape-nested", "POST", "/v2/models/sentiment/infer", {"json": oip(text={"shape": [1, [1]]})}, 400, "oip"),
    ("v2-shape-negative", "POST", "/v2/models/sentiment/infer", {"json": oip(text={"shape": [-1]})}, 400, "oip"),
    ("v2-shape-bool", "POST", "/v2/models/sentiment/infer", {"json": oip(text={"shape": [True]})}, 400, "oip"),
    ("v2-shape-missing", "POST", "/v2/models/sentiment/infer", {"json": oip(text={"shape": None})}, 400, "oip"),
    ("v2-shape-mismatch", "POST", "/v2/models/sentiment/infer", {"json": oip(text={"shape": [2]})}, 400, "oip"),
    ("v2-shape-empty", "POST", "/v2/models/sentiment/infer", {"json": oip(text={"shape": []})}, 400, "oip"),
    ("v2-data-not-list", "POST", "/v2/models/sentiment/infer", {"json": oip(text={"data": "a fine film"})}, 400, "oip"),
    ("v2-data-number", "POST", "/v2/models/sentiment/infer", {"json": oip(text={"data": [5]})}, 400, "oip"),
    ("v2-data-ragged-mismatch", "POST", "/v2/models/sentiment/infer",
     {"json": oip(text={"shape": [1], "data": ["a", ["b"]]})}, 400, "oip"),
    ("v2-data-nested-deep", "POST", "/v2/models/sentiment/infer",
     {"content": ('{"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": '
                  + nested(30_000) + "}]}").encode()}, 400, "oip"),
    ("v2-data-nested-40", "POST", "/v2/models/sentiment/infer",
     {"content": ('{"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": '
                  + nested(40) + "}]}").encode()}, 400, "oip"),
    ("v2-empty-text", "POST", "/v2/models/sentiment/infer", {"json": oip(text={"data": [""]})}, 422, "oip"),
    ("v2-parameters-string", "POST", "/v2/models/sentiment/infer", {"json": oip(parameters="x")}, 400, "oip"),
    ("v2-parameters-list", "POST", "/v2/models/sentiment/infer", {"json": oip(parameters=[1])}, 400, "oip"),
    ("v2-input-parameters-string", "POST", "/v2/models/sentiment/infer",
     {"json": oip(text={"parameters": "x"})}, 400, "oip"),
    ("v2-truncate-string-false", "POST", "/v2/models/sentiment/infer",
     {"json": oip(parameters={"truncate": "false"})}, 400, "oip"),
    ("v2-truncate-number", "POST", "/v2/models/sentiment/infer", {"json": oip(parameters={"truncate": 1})}, 400, "oip"),
    ("v2-binary-output-string", "POST", "/v2/models/sentiment/infer",
     {"json": oip(parameters={"binary_data_output": "true"})}, 400, "oip"),
    ("v2-outputs-strings", "POST", "/v2/models/sentiment/infer", {"json": oip(outputs=["label"])}, 400, "oip"),
    ("v2-outputs-not-list", "POST", "/v2/models/sentiment/infer", {"json": oip(outputs={"name": "label"})}, 400, "oip"),
    ("v2-outputs-params-string", "POST", "/v2/models/sentiment/infer",
     {"json": oip(outputs=[{"name": "label", "parameters": "x"}])}, 400, "oip"),
    ("v2-outputs-binary-string", "POST", "/v2/models/sentiment/infer",
     {"json": oip(outputs=[{"name": "label", "parameters": {"binary_data": "no"}}])}, 400, "oip"),
    ("v2-outputs-unknown", "POST", "/v2/models/sentiment/infer", {"json": oip(outputs=[{"name": "nope"}])}, 400, "oip"),
    ("v2-outputs-huge-name", "POST", "/v2/models/sentiment/infer",
     {"json": oip(outputs=[{"name": BIG[:60_000]}])}, 400, "oip"),
    ("v2-header-superscript", "POST", "/v2/models/sentiment/infer",
     {"json": oip(), "headers": {"inference-header-content-length": "\u00b2".encode()}}, 400, "oip"),
    ("v2-header-negative", "POST", "/v2/models/sentiment/infer",
     {"json": oip(), "headers": {"inference-header-content-length": "-5"}}, 400, "oip"),
    ("v2-header-too-long", "POST", "/v2/models/sentiment/infer",
     {"json": oip(), "headers": {"inference-header-content-length": "99999999"}}, 400, "oip"),
    ("v2-binary-size-overrun", "POST", "/v2/models/sentiment/infer",
     {"json": oip(text={"parameters": {"binary_data_size": 1000}})}, 400, "oip"),
    ("v2-binary-size-string", "POST", "/v2/models/sentiment/infer",
     {"json": oip(text={"parameters": {"binary_data_size": "8"}})}, 400, "oip"),
    ("v2-text-pair-length", "POST", "/v2/models/pairs/infer",
     {"json": {"inputs": [OIP_TEXT, {**OIP_TEXT, "name": "text_pair", "shape": [2], "data": ["a", "b"]}]}}, 400, "oip"),
    ("v2-pair-task-without-pair", "POST", "/v2/models/pairs/infer", {"json": oip()}, 422, "oip"),
    ("v2-too-many-inputs", "POST", "/v2/models/sentiment/infer",
     {"json": oip(text={"shape": [9], "data": ["a"] * 9})}, 413, "oip"),
    ("v2-body-over-limit", "POST", "/v2/models/sentiment/infer", {"json": oip(text={"data": [BIG]})}, 413, "oip"),
    ("v2-chunked-over-limit", "POST", "/v2/models/sentiment/infer", {"content": chunks(MAX_BODY * 2)}, 413, "oip"),
    ("v2-deep-json", "POST", "/v2/models/sentiment/infer", {"content": nested(30_000).encode()}, 400, "oip"),
    ("v2-text-pair-undeclared", "POST", "/v2/models/sentiment/infer",
     {"json": {"inputs": [OIP_TEXT, {**OIP_TEXT, "name": "text_pair"}]}}, 400, "oip"),
    # ---- compressed bodies (tritonclient's request compression): read, bounded, or 415 --------------
    ("v1-gzip", "POST", "/v1/infer", gzipped({"inputs": ["a fine film"]}), 200, None),
    ("v1-deflate", "POST", "/v1/infer", gzipped({"inputs": ["a fine film"]}, "deflate"), 200, None),
    ("v2-gzip", "POST", "/v2/models/sentiment/infer", gzipped(oip()), 200, None),
    ("v1-gzip-bomb", "POST", "/v1/infer", {**gzipped(b""), "content": ZIP_BOMB}, 413, "v1"),
    ("v2-gzip-bomb", "POST", "/v2/models/sentiment/infer", {**gzipped(b""), "content": ZIP_BOMB}, 413, "oip"),
    ("v1-gzip-broken", "POST", "/v1/infer", {**gzipped(b""), "content": b"\x1f\x8bnot gzip at all"}, 400, "v1"),
    ("v1-gzip-truncated", "POST", "/v1/infer", {**gzipped(b""), "content": gzip.compress(b'{"inputs": ["a"]}')[:-9]},
     400, "v1"),
    ("v1-brotli", "POST", "/v1/infer", {"content": b"x", "headers": {"content-encoding": "br"}}, 415, "v1"),
    ("v2-brotli", "POST", "/v2/models/sentiment/infer", {"content": b"x", "headers": {"content-encoding": "br"}},
     415, "oip"),
    ("v1-huge-integer", "POST", "/v1/infer", raw_body(HUGE_INTEGER), 422, "v1"),
    # ---- OpenAI's and TEI's routes: refusals made before the route, in their protocol's shape ----------
    *refused_before_the_route("openai", "/v1/embeddings", "input", 400, {"model": "embedding"}),
    ("openai-malformed", "POST", "/v1/embeddings", {"json": {"input": 5}}, 400, "openai"),
    ("openai-get", "GET", "/v1/embeddings", {}, 405, "openai"),
    ("openai-brotli", "POST", "/v1/embeddings", {"content": b"x", "headers": {"content-encoding": "br"}}, 415,
     "openai"),
    ("openai-gzip-bomb", "POST", "/v1/embeddings", {**gzipped(b""), "content": ZIP_BOMB}, 413, "openai"),
    ("tei-embed-body-over-limit", "POST", "/embed", {"json": {"inputs": BIG}}, 413, "tei"),
    ("tei-embed-deep-json", "POST", "/embed", raw_body(nested(20_000).encode()), 413, "tei"),
    ("tei-embed-not-utf8", "POST", "/embed", raw_body(b'{"inputs": "\xff\xfe"}'), 422, "tei"),
    ("tei-embed-get", "GET", "/embed", {}, 405, "tei"),
    ("tei-embed-brotli", "POST", "/embed", {"content": b"x", "headers": {"content-encoding": "br"}}, 415, "tei"),
    *refused_before_the_route("tei-tokenize", "/tokenize", "inputs", 422),
    ("tei-tokenize-malformed", "POST", "/tokenize", {"json": {"inputs": 5}}, 422, "tei"),
    ("tei-tokenize-empty", "POST", "/tokenize", {"json": {"inputs": "   "}}, 422, "tei"),
    ("tei-tokenize-control", "POST", "/tokenize", {"json": {"inputs": "a\x00b"}}, 422, "tei"),
    ("tei-tokenize-too-long", "POST", "/tokenize", {"json": {"inputs": "word " * 1000}}, 413, "tei"),
    ("tei-tokenize-get", "GET", "/tokenize", {}, 405, "tei"),
    ("tei-tokenize-prompt", "POST", "/tokenize", {"json": {"inputs": "a", "prompt_name": "query"}}, 422, "tei"),
    ("tei-tokenize-unknown-field", "POST", "/tokenize", {"json": {"inputs": "a", "add_special": False}}, 422, "tei"),
    ("tei-similarity-empty", "POST", "/similarity",
     {"json": {"inputs": {"source_sentence": "a", "sentences": []}}}, 422, "tei"),
    ("tei-similarity-no-embedding-task", "POST", "/similarity",  # this store has none
     {"json": {"inputs": {"source_sentence": "a", "sentences": ["b"]}}}, 404, "tei"),
    # token ids back to text: TEI's /decode in its shape, vLLM's /detokenize and tokenize in OpenAI's
    *refused_before_the_route("tei-decode", "/decode", "ids", 422),
    ("tei-decode-unknown-id", "POST", "/decode", {"json": {"ids": [2**40]}}, 422, "tei"),
    ("tei-decode-get", "GET", "/decode", {}, 405, "tei"),
    *refused_before_the_route("openai-detokenize", "/detokenize", "tokens", 400),
    ("openai-detokenize-strings", "POST", "/detokenize", {"json": {"tokens": ["a"]}}, 400, "openai"),
    ("openai-detokenize-huge-id", "POST", "/detokenize", {"json": {"tokens": [2**63 - 1]}}, 400, "openai"),
    ("openai-tokenize-chat", "POST", "/tokenize", {"json": {"messages": []}}, 400, "openai"),
    ("openai-tokenize-huge-prompt", "POST", "/tokenize", {"json": {"prompt": "word " * 5_000}}, 413, "openai"),
    # TEI's body on /rerank (vLLM's path too): in TEI's shape
    ("tei-rerank-no-embedding-task", "POST", "/rerank", {"json": {"query": "a", "texts": ["b"]}}, 404, "tei"),
    ("tei-rerank-empty", "POST", "/rerank", {"json": {"query": "a", "texts": []}}, 422, "tei"),
    ("tei-rerank-huge-integer", "POST", "/rerank", raw_body(b'{"query": "a", "texts": ' + b"9" * 5001 + b"}"), 422,
     "tei"),
    ("tei-rerank-texts-objects", "POST", "/rerank", {"json": {"query": "a", "texts": [{"text": "b"}]}}, 422, "tei"),
    ("tei-predict-parameters", "POST", "/predict?tasks=sentiment",
     {"json": {"inputs": "a", "parameters": {"function_to_apply": "sigmoid"}}}, 422, "tei"),
    ("tei-tokenize-gzip-bomb", "POST", "/tokenize", {**gzipped(b""), "content": ZIP_BOMB}, 413, "tei"),
    # ---- vLLM's /classify and TEI's root and /info: in OpenAI's and TEI's shapes ---------------------------
    *refused_before_the_route("openai-classify", "/classify", "input", 400, {"model": "sentiment"}),
    ("openai-classify-malformed", "POST", "/classify", {"json": {"model": "sentiment", "input": 5}}, 400, "openai"),
    ("openai-classify-unknown-field", "POST", "/v1/classify", {"json": {"model": "sentiment", "inputs": ["a"]}}, 400,
     "openai"),
    ("openai-classify-unknown-model", "POST", "/classify", {"json": {"model": "nope", "input": ["a"]}}, 404, "openai"),
    ("openai-classify-token-task", "POST", "/classify", {"json": {"model": "ner", "input": ["a"]}}, 400, "openai"),
    ("openai-classify-huge-model", "POST", "/classify", {"json": {"model": BIG[:60_000], "input": ["a"]}}, 404,
     "openai"),
    ("openai-classify-too-many-inputs", "POST", "/classify", {"json": {"model": "sentiment", "input": ["a"] * 9}},
     413, "openai"),
    ("openai-classify-empty-text", "POST", "/classify", {"json": {"model": "sentiment", "input": [" "]}}, 422,
     "openai"),
    ("openai-classify-get", "GET", "/classify", {}, 405, "openai"),
    # ---- vLLM's /score and /rerank (this store has no embedding task): in OpenAI's shape ------------------
    *refused_before_the_route("openai-score", "/score", "text_1", 400, {"text_2": "a"}),
    ("openai-score-sides-mixed", "POST", "/v1/score", {"json": {"text_1": "a", "items": ["b"]}}, 400, "openai"),
    ("openai-score-two-to-three", "POST", "/score", {"json": {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}}, 400,
     "openai"),
    ("openai-score-no-embedding-task", "POST", "/score", {"json": {"text_1": "a", "text_2": "b"}}, 404, "openai"),
    *refused_before_the_route("openai-rerank", "/v2/rerank", "query", 400, {"documents": ["a"]}),
    ("openai-rerank-document-objects", "POST", "/rerank", {"json": {"query": "a", "documents": [{"text": "b"}]}}, 400,
     "openai"),
    ("openai-rerank-no-embedding-task", "POST", "/v1/rerank", {"json": {"query": "a", "documents": ["b"]}}, 404,
     "openai"),
    ("openai-rerank-get", "GET", "/v2/rerank", {}, 405, "openai"),
    *refused_before_the_route("tei-root", "/", "inputs", 422),
    ("tei-root-malformed", "POST", "/", {"json": {"inputs": 5}}, 422, "tei"),
    ("tei-root-put", "PUT", "/", {"json": {"inputs": "a"}}, 405, "tei"),
    ("tei-info-post", "POST", "/info", {}, 405, "tei"),
    *refused_before_the_route("tei-predict", "/predict?tasks=sentiment", "inputs", 422),
    ("tei-predict-malformed", "POST", "/predict?tasks=sentiment", {"json": {"inputs": 5}}, 422, "tei"),
    ("tei-predict-deep-batch", "POST", "/predict?tasks=sentiment", {"json": {"inputs": [[["a"]]]}}, 422, "tei"),
    ("tei-predict-unnamed", "POST", "/predict", {"json": {"inputs": "a"}}, 400, "tei"),
    ("tei-predict-too-many", "POST", "/predict?tasks=sentiment", {"json": {"inputs": [["a"]] * 9}}, 413, "tei"),
    ("tei-predict-get", "GET", "/predict", {}, 405, "tei"),
    ("tei-health-post", "POST", "/health", {}, 405, "tei"),
    # ---- KServe V1's :predict: in its servers' shape, as OIP's -------------------------------------------
    *refused_before_the_route("oip-predict", "/v1/models/sentiment:predict", "instances", 400),
    ("oip-predict-malformed", "POST", "/v1/models/sentiment:predict", {"json": {"instances": [5]}}, 400, "oip"),
    ("oip-predict-not-json", "POST", "/v1/models/sentiment:predict", {"content": b"{not json"}, 400, "oip"),
    ("oip-predict-unknown-task", "POST", "/v1/models/nope:predict", {"json": {"instances": ["a"]}}, 404, "oip"),
    ("oip-predict-huge-task", "POST", "/v1/models/" + "x" * 20_000 + ":predict", {"json": {"instances": ["a"]}}, 404,
     "oip"),
    ("oip-predict-too-many", "POST", "/v1/models/sentiment:predict", {"json": {"instances": ["a"] * 9}}, 413, "oip"),
    ("oip-predict-control-char", "POST", "/v1/models/sentiment:predict", {"json": {"instances": ["a\x00b"]}}, 422,
     "oip"),
    ("oip-predict-get", "GET", "/v1/models/sentiment:predict", {}, 405, "oip"),
    ("oip-explain", "POST", "/v1/models/sentiment:explain", {"json": {"instances": ["a"]}}, 501, "oip"),
    # ---- /admin --------------------------------------------------------------------------------------
    ("admin-no-token", "POST", "/admin/modules/sentiment/reload", {}, 401, "v1"),
    ("admin-list-wrong-token", "GET", "/admin/modules", {"headers": {"authorization": "Bearer no"}}, 401, "v1"),
    ("admin-wrong-token", "POST", "/admin/modules/sentiment/reload", {"headers": {"authorization": "Bearer no"}}, 401, "v1"),
    ("admin-basic-auth", "POST", "/admin/modules/sentiment/reload", {"headers": {"authorization": "Basic eDp5"}}, 401, "v1"),
    ("admin-huge-token", "POST", "/admin/modules/sentiment/reload",
     {"headers": {"authorization": "Bearer " + "t" * 30_000}}, 401, "v1"),
    ("admin-unknown-action", "POST", "/admin/modules/sentiment/explode", {"headers": ADMIN}, 404, "v1"),
    ("admin-huge-action", "POST", "/admin/modules/sentiment/" + "x" * 20_000, {"headers": ADMIN}, 404, "v1"),
    ("admin-unknown-task", "POST", "/admin/modules/nope/load", {"headers": ADMIN}, 404, "v1"),
    ("admin-reload-unloaded", "POST", "/admin/modules/nope/reload", {"headers": ADMIN}, 404, "v1"),
    ("admin-task-dotdot", "POST", "/admin/modules/../load", {"headers": ADMIN}, 404, "v1"),
    ("admin-task-dots", "POST", "/admin/modules/.../load", {"headers": ADMIN}, 400, "v1"),
    ("admin-task-uppercase", "POST", "/admin/modules/Sentiment/load", {"headers": ADMIN}, 400, "v1"),
    ("admin-task-encoded-slash", "POST", "/admin/modules/..%2Fsentiment/load", {"headers": ADMIN}, 404, "v1"),
    ("admin-version-traversal", "POST", "/admin/modules/sentiment/load",
     {"headers": ADMIN, "json": {"version": "../sentiment/1"}}, 422, "v1"),
    ("admin-version-absolute", "POST", "/admin/modules/sentiment/load", {"headers": ADMIN, "json": {"version": "/etc"}},
     422, "v1"),
    ("admin-version-dotdot", "POST", "/admin/modules/sentiment/load", {"headers": ADMIN, "json": {"version": ".."}},
     422, "v1"),
    ("admin-version-newline", "POST", "/admin/modules/sentiment/load", {"headers": ADMIN, "json": {"version": "1\n"}},
     422, "v1"),
    # a numbered version may come as a JSON number ({"version": 1} loads "1"); no other number names one
    ("admin-version-negative", "POST", "/admin/modules/sentiment/load", {"headers": ADMIN, "json": {"version": -1}},
     422, "v1"),
    ("admin-version-fraction", "POST", "/admin/modules/sentiment/load", {"headers": ADMIN, "json": {"version": 1.5}},
     422, "v1"),
    ("admin-version-huge", "POST", "/admin/modules/sentiment/load", {"headers": ADMIN, "json": {"version": BIG[:50_000]}},
     422, "v1"),
    ("admin-version-missing", "POST", "/admin/modules/sentiment/load", {"headers": ADMIN, "json": {"version": "77"}},
     404, "v1"),
    ("admin-extra-field", "POST", "/admin/modules/sentiment/load", {"headers": ADMIN, "json": {"versoin": "1"}},
     422, "v1"),
    ("admin-body-list", "POST", "/admin/modules/sentiment/load", {"headers": ADMIN, "json": ["1"]}, 422, "v1"),
    ("admin-chunked-over-limit", "POST", "/admin/modules/sentiment/load",
     {"headers": {**ADMIN, "content-type": "application/json"}, "content": chunks(MAX_BODY * 2)}, 413, "v1"),
    ("admin-deep-json", "POST", "/admin/modules/sentiment/load",
     {"headers": {**ADMIN, "content-type": "application/json"}, "content": nested(20_000).encode()}, 413, "v1"),
    ("admin-get", "GET", "/admin/modules/sentiment/load", {"headers": ADMIN}, 405, "v1"),
]

# raw HTTP: (id, bytes sent, status, shape); shape None: no JSON body is required (the parser's
# refusals before a request exists are still JSON, checked where given). Where the two HTTP parsers
# uvicorn may run (httptools when installed, else h11) read a request differently, the status is
# given per parser.
PARSER = "httptools"  # what tmod-serve runs (server/api/http_limits.py uvicorn_config); the h11 column is kept for reference


def per_parser(h11: int, httptools: int) -> int:
    return {"h11": h11, "httptools": httptools}[PARSER]


RAW_CASES = [
    ("raw-garbage", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400, "v1"),
    ("raw-bad-method-line", b"GET\r\n\r\n", 400, "v1"),
    ("raw-http-0.9", b"GET /healthz\r\n\r\n", per_parser(400, 200), "v1"),
    ("raw-unknown-version", b"GET /healthz HTTP/1.9\r\nhost: x\r\n\r\n", per_parser(200, 400), "v1"),
    ("raw-no-host", b"GET /healthz HTTP/1.1\r\n\r\n", per_parser(400, 200), "v1"),
    ("raw-bad-header", b"GET /healthz HTTP/1.1\r\nhost: x\r\nno colon here\r\n\r\n", 400, "v1"),
    ("raw-space-before-colon", b"GET /healthz HTTP/1.1\r\nhost : x\r\n\r\n", 400, "v1"),
    ("raw-two-content-lengths", b"POST /v1/infer HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}",
     400, "v1"),
    ("raw-bad-chunk-size", b"POST /v1/infer HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", 400, "v1"),
    ("raw-negative-content-length", b"POST /v1/infer HTTP/1.1\r\nhost: x\r\ncontent-length: -1\r\n\r\n", 400, "v1"),
    ("raw-superscript-content-length", "POST /v1/infer HTTP/1.1\r\nhost: x\r\ncontent-length: \u00b2\r\n\r\n"
                                       .encode("latin-1"), 400, "v1"),
    ("raw-lf-only", b"GET /healthz HTTP/1.1\nhost: x\n\n", per_parser(200, 400), "v1"),
    ("raw-null-in-path", b"GET /heal\x00thz HTTP/1.1\r\nhost: x\r\n\r\n", 400, "v1"),
    ("raw-declared-length-over-limit", b"POST /v1/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                                       b"content-length: 999999999\r\n\r\n{", 413, "v1"),
    ("raw-v2-declared-length-over-limit", b"POST /v2/models/sentiment/infer HTTP/1.1\r\nhost: x\r\n"
                                          b"content-length: 999999999\r\n\r\n{", 413, "oip"),
    ("raw-absolute-uri", b"GET http://evil.example/healthz HTTP/1.1\r\nhost: x\r\n\r\n", per_parser(404, 200), "v1"),
    ("raw-path-traversal", b"GET /../../etc/passwd HTTP/1.1\r\nhost: x\r\n\r\n", 404, "v1"),
    ("raw-encoded-traversal", b"GET /v1/tasks/..%2f..%2fetc%2fpasswd HTTP/1.1\r\nhost: x\r\n\r\n", 404, "v1"),
    ("raw-bad-request-id", b"GET /nope HTTP/1.1\r\nhost: x\r\nx-request-id: <script>\r\n\r\n", 404, "v1"),
    ("raw-connect", b"CONNECT evil.example:443 HTTP/1.1\r\nhost: evil.example:443\r\n\r\n", per_parser(404, 400), "v1"),
]


@pytest.fixture(scope="module")
def hostile_store(tmp_path_factory, tiny_store, tiny_backbone):
    return with_a_pair_task(tmp_path_factory.mktemp("hostile") / "store", tiny_store, tiny_backbone)


@pytest.fixture(scope="module")
def server(hostile_store, tiny_backbone_dir, tmp_path_factory):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMOD_ADMIN_TOKEN": ADMIN["authorization"].split()[1]}
    log_path = tmp_path_factory.mktemp("hostile-log") / "tmod-serve.log"
    with open(log_path, "w") as log:
        url, process = start_tmod_serve(
            ["--backbone", str(tiny_backbone_dir), "--store", str(hostile_store), "--max-body-bytes", str(MAX_BODY),
             "--max-inputs", "8", "--max-chars", "2000", "--max-tokens", "128", "--max-request-tokens", "1000",
             "--threads", "1",
             "--header-timeout-s", str(SLOW_CLIENT_S), "--body-timeout-s", str(SLOW_CLIENT_S)], env, output=log)
        try:
            yield url
        finally:
            process.terminate()
            process.wait(timeout=60)
    # uvicorn stops on SIGTERM, then raises the signal again: the exit status says what stopped it
    assert process.returncode in (0, -15), log_path.read_text()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server, timeout=60) as client:
        yield client


def check_shape(status: int, body: dict, shape: str, sent: int) -> None:
    if shape == "v1":
        assert set(body) == {"error"}, body
        assert isinstance(body["error"]["type"], str) and isinstance(body["error"]["message"], str), body
    elif shape == "openai":
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["type"] == ("invalid_request_error" if status < 500 else "server_error"), body
    elif shape == "tei":
        assert set(body) == {"error", "error_type"} and isinstance(body["error"], str), body
    else:
        assert isinstance(body["error"], str) and isinstance(body["type"], str), body
        from tritonclient.http._utils import _get_error  # tritonclient's own reading of an error answer

        error = _get_error(_TritonResponse(status, json.dumps(body).encode()))
        assert str(error) == f"[{status}] {body['error']}"


class _TritonResponse:
    """An answer as tritonclient's HTTP layer hands it to its error reader (status and read())."""

    def __init__(self, status: int, body: bytes):
        self.status_code, self._body = status, body

    def read(self) -> bytes:
        return self._body


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hostile_request(client, case):
    _, method, path, kwargs, status, shape = case
    kwargs = dict(kwargs)
    if "json" in kwargs and kwargs["json"] is None:
        kwargs.pop("json")
    response = client.request(method, path, **kwargs)
    assert response.status_code == status, response.text[:500]
    assert response.headers.get("x-request-id")
    assert len(response.content) < 4096, "an error body echoed the input"
    if shape is not None:
        check_shape(status, response.json(), shape, len(path))


def raw_exchange(url: str, data: bytes) -> tuple[int, dict, bytes]:
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(data)
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        received = read_until_closed(sock)
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    headers = {k.lower(): v for k, v in headers.items()}
    if "content-length" in headers:
        body = body[: int(headers["content-length"])]
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize("case", RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_hostile_raw_http(server, case):
    _, data, status, shape = case
    got, headers, body = raw_exchange(server, data)
    assert got == status, body[:300]
    assert len(body) < 4096
    if shape is not None and status != 200:
        check_shape(status, json.loads(body), shape, len(data))


def test_server_still_serves_after_the_hostile_cases(client):
    response = client.post("/v1/infer", params={"tasks": "sentiment,ner"}, json={"inputs": ["A fine film in Paris."]})
    assert response.status_code == 200
    assert set(response.json()["results"][0]) == {"sentiment", "ner"}
    assert client.get("/readyz").json()["refused"] == {}


def test_20000_duplicate_names_answer_400_while_healthz_answers(server):
    """The duplicate check is linear: three such requests at once leave /healthz answering (it waited
    8.7 s per request when the check was quadratic). The 1 s bound is a liveness probe's, not a timing."""
    url = server + "/v1/infer?tasks=" + ",".join(["sentiment"] * 1000 + ["a"] * 19_000)  # 20,000 names, 48 KB
    answers = []

    def ask():
        try:
            answers.append(httpx.post(url, json={"inputs": ["a"]}, timeout=60))
        except httpx.HTTPError as exc:
            answers.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for thread in threads:
        thread.start()
    health = [httpx.get(server + "/healthz", timeout=1.0).status_code for _ in range(5)]
    for thread in threads:
        thread.join()
    assert health == [200] * 5
    assert [getattr(a, "status_code", a) for a in answers] == [400] * 3
    error = answers[0].json()["error"]
    assert error["type"] == "duplicate_tasks" and len(error["message"]) < 400


def test_tritonclient_reads_every_kind_of_v2_error(server):
    from tritonclient.http import InferenceServerClient, InferInput
    from tritonclient.utils import InferenceServerException

    client = InferenceServerClient(url=server.removeprefix("http://"))
    text = InferInput("text", [1], "BYTES")
    text.set_data_from_numpy(__import__("numpy").array([b"a fine film"], dtype=object))
    calls = {
        "unknown model": lambda: client.infer("nope", [text]),
        "unknown version": lambda: client.infer("sentiment", [text], model_version="99"),
        "metadata of an unknown model": lambda: client.get_model_metadata("nope"),
        "bad parameter": lambda: client.infer("sentiment", [text], parameters={"truncate": "false"}),
        "unknown output": lambda: client.infer("sentiment", [text], outputs=[
            __import__("tritonclient.http", fromlist=["InferRequestedOutput"]).InferRequestedOutput("nope")]),
    }
    for what, call in calls.items():
        with pytest.raises(InferenceServerException) as caught:
            call()
        message = str(caught.value)  # raised TypeError when "error" held an object
        assert message.startswith("[4") and "an exception occurred in the client" not in message, (what, message)


def test_oip_metadata_lists_text_pair_only_for_pair_tasks(client):
    single = client.get("/v2/models/sentiment").json()
    pair = client.get("/v2/models/pairs").json()
    assert [i["name"] for i in single["inputs"]] == ["text"]
    assert [i["name"] for i in pair["inputs"]] == ["text", "text_pair"]


def slow_exchange(server: str, parts: list[bytes]) -> bytes:
    """Send `parts` with pauses as a slow client would, then read what the server says (it must close)."""
    address = urlsplit(server)
    with socket.create_connection((address.hostname, address.port), timeout=SLOW_CLIENT_S * 15) as sock:
        for part in parts:
            sock.sendall(part)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received


def test_a_request_head_sent_too_slowly_is_answered_408_and_closed(server):
    received = slow_exchange(server, [b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-slow: a"])
    assert received.startswith(b"HTTP/1.1 408 ")
    assert json.loads(received.partition(b"\r\n\r\n")[2])["error"]["type"] == "request_timeout"


def test_a_connection_that_sends_nothing_is_closed(server):
    assert slow_exchange(server, []).startswith(b"HTTP/1.1 408 ")


@pytest.mark.parametrize("path, shape", [("/v1/infer", "v1"), ("/v2/models/sentiment/infer", "oip")])
def test_a_body_sent_too_slowly_is_answered_408_in_the_protocol_shape(server, path, shape):
    head = (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            "content-length: 100\r\n\r\n").encode()
    received = slow_exchange(server, [head, b'{"inputs": '])
    status_line, _, rest = received.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 408 "), received[:300]
    headers, _, answer = rest.partition(b"\r\n\r\n")
    assert b"connection: close" in headers.lower()  # the rest of that body is never read: closed at once
    body = json.loads(answer)
    check_shape(408, body, shape, 0)


def test_enough_cases():
    assert len(CASES) + len(RAW_CASES) >= 100


@pytest.mark.smoke
@pytest.mark.parametrize("path, shape", [("/v1/infer", "v1"), ("/v2/models/sentiment/infer", "oip"),
                                         ("/embed", "tei"), ("/v1/embeddings", "openai")])
def test_content_length_with_chunked_is_refused_and_the_request_in_its_body_never_answered(server, path, shape):
    """RFC 9112 section 6.1: Transfer-Encoding beside Content-Length may be a smuggling attempt; the
    connection closes after the answer. A second request hidden in the chunked body (after its last
    chunk) must not be read: before the fix it was answered 200 on the same connection."""
    smuggled = b"GET /v1/tasks HTTP/1.1\r\nhost: x\r\n\r\n"
    body = b"0\r\n\r\n" + smuggled
    head = (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "transfer-encoding: chunked\r\n\r\n").encode()
    address = urlsplit(server)
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        sock.sendall(head + body)
        received = read_until_closed(sock)  # the server closes: a keep-alive connection would time this out
    assert received.count(b"HTTP/1.1 ") == 1, received[:600]
    status_line, _, rest = received.partition(b"\r\n")
    headers, _, answer = rest.partition(b"\r\n\r\n")
    assert status_line.startswith(b"HTTP/1.1 400 "), received[:300]
    assert b"connection: close" in headers.lower()
    check_shape(400, json.loads(answer), shape, 0)
    assert "Transfer-Encoding" in str(json.loads(answer))


def test_head_is_answered_as_get_without_a_body_and_the_connection_stays_in_step(server, client):
    """RFC 9110 9.1: HEAD where GET is answered (uptime monitors and some load balancers probe with
    it; it was 405). A HEAD answer has a head only: the inference routes' refusal once wrote its body
    after it, and a keep-alive client read those bytes as the start of its next answer."""
    heads = [("/v1/infer", 405), ("/healthz", 200), ("/readyz", 200), ("/v2/health/ready", 200),
             ("/v1/tasks", 200), ("/metrics", 200), ("/", 200), ("/nope", 404)]
    sent = b"".join(f"HEAD {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode() for path, _ in heads)
    sent += b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    address = urlsplit(server)
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        sock.sendall(sent)
        received = read_until_closed(sock)
    answers = received.split(b"HTTP/1.1 ")[1:]
    assert [int(a[:3]) for a in answers] == [status for _, status in heads] + [200], received[:2000]
    for (path, _), answer in zip(heads, answers):
        head, _, rest = answer.partition(b"\r\n\r\n")
        assert rest == b"" and b"content-length: " in head, (path, answer[:400])
    assert answers[-1].endswith(b"\r\n\r\n" + client.get("/healthz").content)
    assert b"allow: POST" in answers[0]
    assert client.post("/healthz").headers["allow"] == "GET, HEAD"


def test_a_repeated_tasks_parameter_asks_for_every_task_named(client):
    both = client.post("/v1/infer?tasks=sentiment&tasks=ner", json={"inputs": ["A fine film in Paris."]})
    assert both.status_code == 200 and set(both.json()["results"][0]) == {"sentiment", "ner"}
    twice = client.post("/v1/infer?tasks=sentiment&tasks=sentiment,ner", json={"inputs": ["a"]})
    assert twice.status_code == 400 and twice.json()["error"]["type"] == "duplicate_tasks"


def test_an_integer_of_5001_digits_is_called_what_it_is(client):
    for path in ("/v1/infer", "/v1/embeddings", "/tokenize"):
        response = client.post(path, content=HUGE_INTEGER, headers={"content-type": "application/json"})
        text = response.text
        assert "4300 digits" in text and "UTF-8" not in text, (path, text)


def test_tritonclient_request_compression_is_read(server):
    import numpy as np
    from tritonclient.http import InferenceServerClient, InferInput

    client = InferenceServerClient(url=server.removeprefix("http://"))
    text = InferInput("text", [2], "BYTES")
    text.set_data_from_numpy(np.array([b"a fine film", b"Peter flew to Paris."], dtype=object))
    plain = client.infer("ner", [text]).as_numpy("entities").tolist()
    for algorithm in ("gzip", "deflate"):
        compressed = client.infer("ner", [text], request_compression_algorithm=algorithm)
        assert compressed.as_numpy("entities").tolist() == plain, algorithm


def test_the_embedding_routes_without_an_embedding_task_say_how_to_serve_one(client):
    """This store has no embedding task: each embedding route says so (it said 'no embedding model None')."""
    for path, body in [("/embed", {"inputs": "a"}), ("/v1/embeddings", {"input": "a", "model": "embedding"}),
                       ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}})]:
        answer = client.post(path, json=body)
        assert answer.status_code == 404 and "no embedding task is loaded: serve one" in answer.text, answer.text
        assert "a store without one gets the backbone's from tmod-train embedding --store STORE" in answer.text
        assert "None" not in answer.text
