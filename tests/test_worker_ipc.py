"""What crosses the socket between a worker and the engine (server/workers/frames.py), frame by frame.

In one process: a real engine (`Runtime` + `EngineService` on a Unix socket) and a real
`RemoteRuntime` connected to it; every frame either side reads is recorded. Requests sent in one
event-loop iteration must go as one binary frame (one token array for all of them, no pickle) and a
batch's answers as one frame with one array per task, never as an object per input; the answers
must equal those of the single-process runtime on the same inputs; a request past the worker's
in-flight bound is refused 429; a cancelled request never reaches a batch."""
from __future__ import annotations

import asyncio
import pickle
import time

import numpy as np
import pytest

from server.workers import engine_service, frames as wire, processes, remote_runtime
from server.backbone.tokens import FIELDS
from server.batcher import Job
from server.config import Settings
from server.errors import ApiError
from server.runtime import Runtime

TEXTS = ["Angela Merkel visited the Siemens plant in Munich.", "A gripping, beautifully acted film.",
         "John lives in New York and works for the United Nations.", "Him be went store.", "ok"]
PAIRS = [("The cat sat.", "A cat was sitting."), ("Paris is in France.", "Berlin is in Germany.")]
TASKS = ["sentiment", "ner", "acceptability"]


async def wait_ready(runtime) -> None:
    deadline = time.monotonic() + 60
    while not runtime.ready.is_set():
        assert time.monotonic() < deadline and not runtime.startup_error, runtime.startup_error
        await asyncio.sleep(0.02)


def answer_of(runtime, texts, pairs, tasks, **job):
    rows = runtime.encode(texts, pairs, False, None)
    modules = {t: runtime.modules[t] for t in tasks}
    return Job(rows=rows, modules=modules, deadline=time.perf_counter() + 60, **job)


@pytest.fixture
def frames(monkeypatch):
    """Every frame read on either side, as (raw bytes, messages)."""
    seen = []

    read = wire.read_frame

    async def recording_read_frame(reader):
        body = await read(reader)
        seen.append(body)
        return body

    monkeypatch.setattr(remote_runtime, "read_frame", recording_read_frame)  # the worker's side
    engine_frame = engine_service.EngineService.frame

    def recording_frame(service, peer, body):  # the engine's side
        seen.append(body)
        return engine_frame(service, peer, body)

    monkeypatch.setattr(engine_service.EngineService, "frame", recording_frame)
    return seen


def run_pair(tmp_path, tiny_store, tiny_backbone, scenario, **settings):
    """Start an engine and one worker runtime in this process and run `scenario(single, remote)`."""
    settings = {"max_wait_ms": 5, **settings}

    async def main():
        engine = Runtime(Settings(store=tiny_store.root, tasks=",".join(TASKS), workers=2, head_precision="fp32",
                                  **settings), backbone=tiny_backbone)
        single = Runtime(Settings(store=tiny_store.root, tasks=",".join(TASKS), head_precision="fp32", max_wait_ms=5),
                         backbone=tiny_backbone)
        service = engine_service.EngineService(engine)
        await service.start(tmp_path / "engine.sock")
        await single.open()
        await wait_ready(engine)
        await wait_ready(single)
        remote = remote_runtime.RemoteRuntime(Settings(workers=2, **settings), tmp_path / "engine.sock")
        try:
            await remote.open()
            await scenario(single, remote, engine)
        finally:
            await remote.shutdown()
            await service.stop()
            await engine.shutdown()
            await single.shutdown()

    processes.run_engine_loop(main())  # the engine process's loop (uvloop where installed), as tmod-serve runs it


def test_the_engine_process_runs_uvloop_where_installed():
    uvloop = pytest.importorskip("uvloop")

    async def loop_type():
        return type(asyncio.get_running_loop())

    assert processes.run_engine_loop(loop_type()) is uvloop.Loop


def test_requests_and_answers_cross_as_arrays_and_equal_one_process(tmp_path, tiny_store, tiny_backbone, frames):
    answers = {}
    cases = (("texts", TEXTS, None, TASKS), ("one", TEXTS[:1], None, ["ner"]),
             ("pairs", [a for a, _ in PAIRS], [b for _, b in PAIRS], ["ner", "sentiment"]))

    async def scenario(single, remote, engine):
        for name, texts, pairs, tasks in cases:  # one after the other: a frame each way per request
            answers[name] = (await remote.submit(answer_of(remote, texts, pairs, tasks)),
                             await single.submit(answer_of(single, texts, pairs, tasks)))
        # sent in one event-loop iteration: one request frame for all of them, batched as in one process
        together = [await asyncio.gather(*(runtime.submit(answer_of(runtime, texts, pairs, tasks))
                                           for _, texts, pairs, tasks in cases)) for runtime in (remote, single)]
        for (name, *_), got, want in zip(cases, *together):
            answers[name + " together"] = (got, want)

    run_pair(tmp_path, tiny_store, tiny_backbone, scenario)
    for name, (got, want) in answers.items():
        assert got == want, name  # identical answers, floats included
    requests = [wire.RequestFrame.read(body) for body in frames if body[:1] == wire.REQUESTS]
    replies = [body for body in frames if body[:1] == wire.ANSWERS]
    assert [len(frame.ids) for frame in requests] == [1, 1, 1, 3]  # the last three went as one frame
    control = [m for body in frames if body[:1] == wire.CONTROL for m in pickle.loads(body[1:])]
    # the only pickled messages: the engine's state, and its heartbeat where the scenario outlasted one
    # HEARTBEAT_S (seen on a loaded machine)
    assert "state" in {m[0] for m in control} and {m[0] for m in control} <= {"state", "alive"}
    for frame, (_, texts, pairs, tasks) in zip(requests, cases):
        rows = frame.rows[0]
        assert [row.text for row in rows] == texts and [row.text_pair for row in rows] == (pairs or [None] * len(texts))
        assert frame.task_sets == [",".join(tasks)]
        assert all(row.tokens.dtype == np.int32 and row.tokens.shape[1] == FIELDS for row in rows)
        assert isinstance(rows[0].tokens.base, np.ndarray)  # a view of the frame's one token array
    together = requests[-1]
    assert sorted(together.task_sets) == sorted({",".join(tasks) for *_, tasks in cases})
    assert len(replies) <= 3 + 3  # one answer frame per batch at most, however many requests it answered
    first = wire.read_answers(replies[0])
    (_, (arrays, versions, seconds)), = first
    assert set(arrays) == set(TASKS) and all(isinstance(v, np.ndarray) for v in arrays.values())
    assert arrays["sentiment"].shape == (len(TEXTS), 2)  # one array for every input of the request
    assert arrays["ner"].shape[0] == sum(len(row) for row in requests[0].rows[0])  # token task: all inputs' tokens
    assert versions == {task: "1" for task in TASKS} and len(seconds) == 3
    for body in frames:  # no pickle on the inference path: requests and answers are arrays
        if body[:1] != wire.CONTROL:
            assert b"\x80\x05" not in body[:8] and b"EncodedInput" not in body and b"numpy" not in body


def test_requests_of_interleaved_task_sets_in_one_batch_each_get_their_own_answers(tmp_path, tiny_store,
                                                                                   tiny_backbone, frames):
    """One batch of a worker's requests whose task sets alternate (ner; all three; ner; ...): each task's
    block holds the requests in order, so each gets its own rows (the engine at 4d423f9 laid a block out
    task set by task set and gave such requests each other's logits)."""
    cases = [(TEXTS[i % len(TEXTS)], ["ner"] if i % 2 else TASKS) for i in range(6)]
    answers = {}

    async def scenario(single, remote, engine):
        for name, runtime in (("workers", remote), ("one process", single)):
            answers[name] = await asyncio.gather(*(runtime.submit(answer_of(runtime, [text], None, tasks))
                                                   for text, tasks in cases))

    run_pair(tmp_path, tiny_store, tiny_backbone, scenario, max_wait_ms=50)
    assert answers["workers"] == answers["one process"]  # floats included
    assert [set(a[0]) for a in answers["workers"]] == [set(tasks) for _, tasks in cases]
    replies = [body for body in frames if body[:1] == wire.ANSWERS]
    assert len(replies) == 1  # one batch: the alternating task sets shared it


def test_a_worker_past_its_in_flight_bound_answers_429(tmp_path, tiny_store, tiny_backbone, frames):
    async def scenario(single, remote, engine):
        assert remote.limit == 1  # max_queue 2 shared by 2 workers
        first = asyncio.ensure_future(remote.submit(answer_of(remote, TEXTS[:1], None, ["sentiment"])))
        await asyncio.sleep(0)
        with pytest.raises(ApiError) as refused:
            await remote.submit(answer_of(remote, TEXTS[1:2], None, ["sentiment"]))
        assert refused.value.status == 429 and refused.value.type == "overloaded"
        assert len(await first) == 1  # the one in flight is answered

    run_pair(tmp_path, tiny_store, tiny_backbone, scenario, max_queue=2)


def test_a_request_whose_client_left_is_cancelled_in_the_engine(tmp_path, tiny_store, tiny_backbone, frames):
    ran = []

    async def scenario(single, remote, engine):
        original = engine.run_batch
        engine.batcher.run_batch = lambda rows, modules, timings: ran.append(len(rows)) or original(rows, modules, timings)

        async def gone():
            return True

        job = answer_of(remote, TEXTS[:1], None, ["sentiment"], is_disconnected=gone)
        with pytest.raises(ApiError) as refused:
            await remote.submit(job)
        assert refused.value.status == 499
        await asyncio.sleep(0.6)  # past the engine's batch window: the cancelled job would have run by now
        assert ran == []  # no pass ran for it
        assert engine.metrics.registry.get_sample_value("tmod_dropped_requests_total", {"reason": "client_gone"}) == 1
        # the cancel crossed the socket, in a request frame
        assert any(wire.RequestFrame.read(body).cancels for body in frames if body[:1] == wire.REQUESTS)
        # the engine still answers the next request
        assert len(await remote.submit(answer_of(remote, TEXTS[:1], None, ["sentiment"]))) == 1

    run_pair(tmp_path, tiny_store, tiny_backbone, scenario, max_wait_ms=500)


def test_a_request_sent_before_the_worker_heard_of_an_unload_is_answered(tmp_path, tiny_store, tiny_backbone,
                                                                         monkeypatch):
    """A worker checks a request's tasks against the set it last heard of; an unload through /admin
    reaches it a frame later. A request it sent in between was refused 400 unknown_task by the engine
    (an OIP client read INVALID_ARGUMENT; in a load/unload loop under --workers 2, 13 such on OIP and
    /classify, whose not-found is a 404, beside ~1,500 answered) where one process answers it (its job
    holds the modules). Now the set replaced answers it, and is let go a while later: a task unloaded
    then is refused."""
    monkeypatch.setattr(engine_service, "REPLACED_SET_KEPT_S", 1.0)

    async def scenario(single, remote, engine):
        before = [answer_of(remote, TEXTS[:1], None, ["sentiment", "ner"]) for _ in range(2)]  # the set it saw
        await remote.manage("sentiment", "unload", None)
        assert "sentiment" not in remote.modules  # the worker has heard of it; the jobs name the set before
        answered = await remote.submit(before[0])
        assert set(answered[0]) == {"sentiment", "ner"}
        assert answered == await single.submit(answer_of(single, TEXTS[:1], None, ["sentiment", "ner"]))
        await asyncio.sleep(1.5)  # past the time the replaced set is kept
        with pytest.raises(ApiError) as refused:
            await remote.submit(before[1])
        assert refused.value.status == 400 and refused.value.type == "unknown_task"

    run_pair(tmp_path, tiny_store, tiny_backbone, scenario)


def test_answers_the_engine_cannot_frame_are_a_500_not_a_wait(tmp_path, tiny_store, tiny_backbone, monkeypatch):
    framed = wire.answer_frame

    def broken(batches, errors):
        if batches:
            raise ValueError("broken on purpose")
        return framed(batches, errors)

    monkeypatch.setattr(engine_service, "answer_frame", broken)

    async def scenario(single, remote, engine):
        with pytest.raises(ApiError) as failed:
            await asyncio.wait_for(remote.submit(answer_of(remote, TEXTS[:2], None, TASKS)), timeout=30)
        assert failed.value.status == 500 and "broken on purpose" in failed.value.message

    run_pair(tmp_path, tiny_store, tiny_backbone, scenario)


def test_the_answer_frame_gathers_row_logits_as_the_rows_one_by_one():
    """A pass's logits leave the runner as `RowLogits` (one array per task) and the answer frame
    gathers each task's rows with one index: the frame is byte for byte the one made from each row's
    own view (the runner's answers before), over two task sets, many-row requests and a token task;
    a request with a refused row (an out-of-memory answer in a list) gets its status, the others theirs."""
    from types import SimpleNamespace

    from server.answers import RowLogits
    from server.timings import Timings

    rng = np.random.default_rng(0)
    rows, width = 12, 9
    lengths = rng.integers(1, width + 1, rows)
    sequence = rng.normal(size=(rows, 3)).astype(np.float32)
    tokens = rng.normal(size=(rows, width, 5)).astype(np.float32)
    module = SimpleNamespace(version="1")
    both, ner_only = {"sentiment": module, "ner": module}, {"ner": module}
    requests = [[3, 0], [5], [1, 2, 4], [6], [11, 7, 8, 9, 10]]
    items = [((None, both if i % 2 == 0 else ner_only, 0.0, 0.5, None, 100 + i, [int(lengths[p]) for p in places]),
              places) for i, places in enumerate(requests)]
    timings = Timings()
    timings.backbone, timings.heads = 0.25, 0.125
    gathered = {"sentiment": RowLogits(sequence), "ner": RowLogits(tokens, lengths)}
    one_by_one = {"sentiment": [sequence[r] for r in range(rows)], "ner": [tokens[r, :lengths[r]] for r in range(rows)]}
    frame = b"".join(wire.answer_frame([(items, gathered, timings, 1.0)], []))
    assert frame == b"".join(wire.answer_frame([(items, one_by_one, timings, 1.0)], []))
    answers = dict(wire.read_answers(frame))
    for i, places in enumerate(requests):
        arrays, versions, times = answers[100 + i]
        assert times == (0.5, 0.25, 0.125)
        np.testing.assert_array_equal(arrays["ner"], np.concatenate([tokens[p, :lengths[p]] for p in places]))
        if i % 2 == 0:
            np.testing.assert_array_equal(arrays["sentiment"], sequence[places])
        else:
            assert "sentiment" not in arrays
    refused = dict(one_by_one, ner=list(one_by_one["ner"]))
    refused["ner"][5] = ApiError(503, "out_of_memory", "too long")
    answers = dict(wire.read_answers(b"".join(wire.answer_frame([(items, refused, timings, 1.0)], []))))
    assert isinstance(answers[101], ApiError) and answers[101].status == 503
    assert all(not isinstance(answers[100 + i], ApiError) for i in (0, 2, 3, 4))

def test_a_batch_cut_into_passes_answers_as_one_array_per_task():
    """A batch cut into passes (CPU length runs, GPU bucket_runs, an out-of-memory split) joins its
    passes' RowLogits into one per task, the token task's passes of different widths included: its
    answer frame is byte for byte the one made from each row's own view, and a pass answered otherwise
    (a refusal) leaves that task a list."""
    from types import SimpleNamespace

    from server.answers import RowLogits, joined_answers
    from server.timings import Timings

    rng = np.random.default_rng(1)
    cuts = [(0, 4, 6), (4, 9, 11), (9, 12, 3)]  # each pass's rows and its width (its bucket length)
    parts, one_by_one = [], {"sentiment": [], "ner": []}
    for start, stop, width in cuts:
        lengths = rng.integers(1, width + 1, stop - start)
        sequence = rng.normal(size=(stop - start, 3)).astype(np.float32)
        tokens = rng.normal(size=(stop - start, width, 5)).astype(np.float32)
        parts.append({"sentiment": RowLogits(sequence), "ner": RowLogits(tokens, lengths)})
        one_by_one["sentiment"] += [sequence[r] for r in range(stop - start)]
        one_by_one["ner"] += [tokens[r, :lengths[r]] for r in range(stop - start)]
    joined = joined_answers(parts)
    assert all(type(joined[task]) is RowLogits for task in joined)
    module = SimpleNamespace(version="1")
    both, ner_only = {"sentiment": module, "ner": module}, {"ner": module}
    requests = [[3, 0], [5], [1, 2, 4], [6], [11, 7, 8, 9, 10]]
    items = [((None, both if i % 2 == 0 else ner_only, 0.0, 0.5, None, 100 + i, [0] * len(places)), places)
             for i, places in enumerate(requests)]
    timings = Timings()
    frame = b"".join(wire.answer_frame([(items, joined, timings, 1.0)], []))
    assert frame == b"".join(wire.answer_frame([(items, one_by_one, timings, 1.0)], []))
    refused = [parts[0], {task: [ApiError(503, "out_of_memory", "too long")] * 5 for task in parts[1]}, parts[2]]
    mixed = joined_answers(refused)
    assert type(mixed["ner"]) is list and len(mixed["ner"]) == 12 and isinstance(mixed["ner"][4], ApiError)
    np.testing.assert_array_equal(mixed["ner"][11], one_by_one["ner"][11])


def test_a_frames_requests_decode_together_each_as_on_its_own(tmp_path, tiny_store, tiny_backbone, monkeypatch):
    """A worker decodes every request of an answer frame in one call per module: each request still
    gets its own answers, its tasks in the order it named them, equal to one process's; one request
    whose decode fails gets a 500 and the others of its frame their answers."""
    calls = []
    decode_rows = remote_runtime.decode_rows

    def counted(task_type, labels, packed, rows, *args):
        calls.append(len(rows))
        if any(row.text == "Him be went store." for row in rows):
            raise ValueError("broken on purpose")
        return decode_rows(task_type, labels, packed, rows, *args)

    monkeypatch.setattr(remote_runtime, "decode_rows", counted)
    cases = ((TEXTS[:2], ["ner", "sentiment"]), (TEXTS[2:3], ["sentiment", "ner"]), (TEXTS[4:5], ["ner"]))

    async def scenario(single, remote, engine):
        got, want = [await asyncio.gather(*(runtime.submit(answer_of(runtime, texts, None, tasks)) for texts, tasks in cases))
                     for runtime in (remote, single)]  # batched alike: the same logits
        assert got == want
        assert [[list(answer) for answer in answers] for answers in got] == [[tasks] * len(texts)
                                                                             for texts, tasks in cases]
        assert sorted(calls) == [3, 4]  # one call per module for the frame (sentiment: 3 rows, ner: 4)
        calls.clear()
        broken, fine = await asyncio.gather(remote.submit(answer_of(remote, TEXTS[3:4], None, ["ner"])),
                                            remote.submit(answer_of(remote, TEXTS[:1], None, ["ner"])),
                                            return_exceptions=True)
        assert isinstance(broken, ApiError) and broken.status == 500 and "broken on purpose" in broken.message
        assert calls == [2, 1, 1]  # the frame's call failed, then each request alone
        monkeypatch.setattr(remote_runtime, "decode_rows", decode_rows)
        _, alone = await asyncio.gather(*(single.submit(answer_of(single, TEXTS[i:i + 1], None, ["ner"])) for i in (3, 0)))
        assert fine == alone

    run_pair(tmp_path, tiny_store, tiny_backbone, scenario, max_wait_ms=200)


def test_frames_in_any_pieces_reach_the_engine_whole_and_in_order():
    """The engine reads a worker's bytes as they come (`PeerConnection`): a frame split over several
    reads, several frames in one read, a read ending inside a frame's length prefix. Each frame goes on
    whole, once, in order, as a view of the bytes it came in (and stays intact once later reads came)."""
    rng = np.random.default_rng(0)
    bodies = [wire.REQUESTS + rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in (0, 3, 70_000, 1, 300)]
    stream = b"".join(wire.LENGTH.pack(len(body)) + body for body in bodies)

    class Service:
        def __init__(self):
            self.frames = []

        def connected(self, transport):
            return "peer"

        def frame(self, peer, body):
            self.frames.append(body)  # kept as given: a later read must not change it

    for cuts in ([], [1], [2, 5], list(range(1, 40)), [len(stream) - 1], sorted(rng.choice(len(stream), 30, replace=False))):
        service = Service()
        connection = engine_service.PeerConnection(service)
        connection.connection_made(None)
        bounds = [0, *cuts, len(stream)]
        for a, b in zip(bounds, bounds[1:]):
            connection.data_received(stream[a:b])
        assert [bytes(body) for body in service.frames] == bodies, cuts
        assert not connection.buffer
