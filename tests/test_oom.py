"""Out of memory is an answer: a pass that does not fit is split in halves down to one row; a row
that cannot fit alone is refused with 503 and a precise message; the server keeps serving.

Fault injection: the real tiny backbone behind a backend that makes a real allocation of an
impossible size (the CPU allocator's own error) or raises torch.OutOfMemoryError (what CUDA's
allocator raises) when a pass holds more than a given number of padded tokens."""
from __future__ import annotations

import asyncio
import copy
import gc
import weakref

import httpx
import pytest
import torch

from server.api.app import create_app
from server.config import Settings
from server.engine import Engine
from server.modules import load_module
from server.runner.failures import OutOfMemory, is_out_of_memory
from server.runner.model_runner import ModelRunner
from tests.helpers import LiveServer
from tests.test_runner import assert_same_answers

SHORT = ["A dull film.", "Great acting.", "Paris is big.", "ok", "Bonn in May.", "Fine music, poor plot.",
         "Peter met Angela.", "It rained."]
LONG = " ".join(["The European Commission said on Thursday it disagreed with German advice."] * 4)


class MemoryBoundBackend:
    """The real backend, with device memory for at most `max_tokens` padded tokens per pass."""

    def __init__(self, inner, max_tokens: int, cuda_error: bool = False):
        self.inner, self.max_tokens, self.cuda_error = inner, max_tokens, cuda_error
        self.name, self.precision = inner.name, inner.precision
        self.passes: list[tuple[int, int]] = []  # (rows, tokens) of every pass tried

    def stream(self, batch, upto):
        self.passes.append((batch.size, batch.seq_len))
        if batch.size * batch.seq_len > self.max_tokens:
            if self.cuda_error:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.11 GiB "
                                             "total capacity)")
            torch.empty(2**50, dtype=torch.uint8)  # the CPU allocator refuses: RuntimeError, can't allocate memory
        return self.inner.stream(batch, upto)

    def describe(self):
        return self.inner.describe()


def bounded_backbone(backbone, max_tokens, cuda_error=False):
    other = copy.copy(backbone)
    other.backend = MemoryBoundBackend(backbone.backend, max_tokens, cuda_error)
    return other


def test_what_counts_as_out_of_memory():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(MemoryError())
    try:
        torch.empty(2**50, dtype=torch.uint8)
    except RuntimeError as exc:
        assert is_out_of_memory(exc)
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))


@pytest.mark.parametrize("cuda_error", [False, True])
def test_a_pass_that_does_not_fit_is_split_and_every_row_answered(tiny_backbone, tiny_store, cuda_error):
    modules = {t: load_module(tiny_store, t, None, tiny_backbone) for t in ("sentiment", "ner")}
    rows = sorted(tiny_backbone.encode(SHORT), key=len)
    longest = max(len(r) for r in rows)
    bounded = bounded_backbone(tiny_backbone, max_tokens=2 * longest, cuda_error=cuda_error)  # two rows at most
    settings = Settings(max_padding_ratio=1000)  # one pass for the whole batch, then halves
    got = ModelRunner(Engine(bounded), settings).run(rows, modules)
    want = ModelRunner(Engine(tiny_backbone), settings).run(rows, modules)
    assert_same_answers(got, want)
    tried = bounded.backend.passes
    fitted = [rows for rows, tokens in tried if rows * tokens <= 2 * longest]
    assert tried[0][0] == len(SHORT) and len(fitted) < len(tried)  # the whole batch first, then halves
    assert sum(fitted) == len(SHORT) and max(fitted) <= 2  # each row answered once, in passes that fit


def test_a_row_too_large_alone_is_refused_and_the_others_answered(tiny_backbone, tiny_store):
    modules = {"sentiment": load_module(tiny_store, "sentiment", None, tiny_backbone)}
    rows = sorted(tiny_backbone.encode(SHORT[:3] + [LONG]), key=len)
    bounded = bounded_backbone(tiny_backbone, max_tokens=len(rows[-1]) - 1)
    out = ModelRunner(Engine(bounded), Settings(max_padding_ratio=1000)).run(rows, modules)["sentiment"]
    assert [isinstance(a, OutOfMemory) for a in out] == [False, False, False, True]
    refusal = out[-1]
    assert refusal.status == 503 and refusal.type == "out_of_memory"
    assert f"an input of {len(rows[-1])} tokens does not fit in cpu memory" in refusal.message
    assert "can't allocate memory" in refusal.message
    want = ModelRunner(Engine(tiny_backbone), Settings()).run(rows[:3], modules)
    assert_same_answers({"sentiment": out[:3]}, want)


def test_over_http_a_refused_input_gets_503_and_the_server_keeps_serving(tiny_backbone, tiny_store):
    long_tokens = len(tiny_backbone.encode([LONG])[0])
    bounded = bounded_backbone(tiny_backbone, max_tokens=long_tokens - 1, cuda_error=True)
    # fp32: the backend the wrapper runs (a different precision would make the runtime swap backends)
    settings = Settings(store=tiny_store.root, max_wait_ms=200, max_padding_ratio=1000, precision="fp32")
    with LiveServer(create_app(settings, backbone=tiny_backbone)) as server:
        want = [httpx.post(server.url + "/v1/infer", params={"tasks": "sentiment,ner"}, json={"inputs": [t]}).json()
                for t in SHORT]

    async def burst(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            posts = [client.post("/v1/infer", params={"tasks": "sentiment,ner"}, json={"inputs": [t]}) for t in SHORT]
            posts.insert(3, client.post("/v1/infer", params={"tasks": "sentiment,ner"}, json={"inputs": [LONG]}))
            return await asyncio.gather(*posts)

    with LiveServer(create_app(settings, backbone=bounded)) as server:
        responses = asyncio.run(burst(server.url))
        refused = responses.pop(3)
        assert refused.status_code == 503
        error = refused.json()["error"]
        assert error["type"] == "out_of_memory"
        assert f"an input of {long_tokens} tokens does not fit" in error["message"]
        assert "OutOfMemoryError" in error["message"]
        for response, expected in zip(responses, want):
            assert response.status_code == 200
            assert_same_answers(*(
                {t: [r[t] for r in body["results"]] for t in ("sentiment", "ner")}
                for body in (response.json(), expected)))
        # still serving, and saying what happened
        again = httpx.post(server.url + "/v1/infer", json={"inputs": ["Still here?"]})
        assert again.status_code == 200
        metrics = httpx.get(server.url + "/metrics").text
        assert 'tmod_out_of_memory_total{outcome="refused"} 1.0' in metrics
        assert httpx.get(server.url + "/readyz").status_code == 200


class LeakWatch:
    """The real backend; a pass over `max_tokens` padded tokens yields its first states, then runs
    out of memory (as a pass does mid-way). Each state of a failed pass is watched by a weak
    reference, and every pass that fits counts how many of them are still alive when it starts."""

    def __init__(self, inner, max_tokens: int):
        self.inner, self.max_tokens = inner, max_tokens
        self.name, self.precision = inner.name, inner.precision
        self.failed_states: list = []
        self.alive_at_retry: list[int] = []

    def stream(self, batch, upto):
        too_big = batch.size * batch.seq_len > self.max_tokens
        if not too_big:
            self.alive_at_retry.append(sum(ref() is not None for ref in self.failed_states))
        for index, hidden in self.inner.stream(batch, upto):
            if too_big:
                self.failed_states.append(weakref.ref(hidden))
            yield index, hidden
            if too_big and index >= 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def describe(self):
        return self.inner.describe()


def test_the_retry_runs_after_the_failed_pass_is_freed(tiny_backbone, tiny_store):
    """Weak references to the failed passes' states (the 8-row pass, then its 4-row halves): all
    dead when each half that fits starts, with no garbage collection in between. Keeping the
    exception (its traceback holds the pass's frames) kept them alive, so halves that would fit
    failed again on a GPU."""
    modules = {t: load_module(tiny_store, t, None, tiny_backbone) for t in ("sentiment", "ner")}
    rows = sorted(tiny_backbone.encode(SHORT), key=len)
    longest = max(len(r) for r in rows)
    watched = copy.copy(tiny_backbone)
    watched.backend = LeakWatch(tiny_backbone.backend, max_tokens=2 * longest)
    settings = Settings(max_padding_ratio=1000)
    gc.disable()  # only references count: what a collection would free is not freed here
    try:
        got = ModelRunner(Engine(watched), settings).run(rows, modules)
    finally:
        gc.enable()
    assert len(watched.backend.failed_states) >= 2 * 2  # the 8-row pass and its 4-row halves, two states each
    assert watched.backend.alive_at_retry and set(watched.backend.alive_at_retry) == {0}
    assert_same_answers(got, ModelRunner(Engine(tiny_backbone), settings).run(rows, modules))
