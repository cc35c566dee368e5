"""`tmod-serve --workers N`: N HTTP worker processes feed one engine process that owns the device.

The split is vLLM's (API server / engine core). Each worker runs the whole HTTP app (`server/app.py`:
validation, tokenization, decode) over a `RemoteRuntime`; the engine process (the one `tmod-serve`
started) runs the `Runtime` (backbone, modules, batcher, model runner) and an `EngineService` that
takes every worker's requests, so one batch forms across workers. The workers share one listening
socket (the kernel hands each connection to one of them); the engine process starts another worker
when one dies, and on SIGTERM stops the listener taking connections, lets the workers accept what is
already queued, stops them (each finishes its requests) and then drains its queue and exits
(`stop_taking_connections`).

Measured why (bench/bench_frontend.py): one process spends ~1 ms of CPU per 1-input request on HTTP,
JSON, tokenization and decode, which caps it near 1,000 requests/s whatever the device computes.

Between the processes of one server, over a Unix socket in a folder only this user can open, each
side writes at most one frame of each kind per event-loop iteration (a 4-byte length, then a kind
byte and a header (`struct`), then arrays):
  worker -> engine  "R": every request ready in that iteration (`RequestFrame`): ids, seconds left,
                    task-set index (the frame names its task sets once), rows per request; per row
                    token count, flags (truncated, pair) and text ends; one int32 token array
                    (`server/backbone/tokens.py`'s FIELDS columns) for all rows; one UTF-8 text
                    block; ids of requests whose client left ("cancel")
  engine -> worker  "A": every answer ready in that iteration (`AnswerFrame`): ids, status, seconds
                    (queue, backbone, heads); per (task, version) answered one float32 array with
                    every request's rows (a token task: each row's own tokens, one after the other)
                    and a row count per request; refusals and the answers of tasks served through a
                    bridge (decoded here: their logits lie on a tokenization only the engine has) in
                    a pickled tail, present only when there are some
  either way        "P": pickled control messages, rare: ("state", EngineState) on connect and after
                    every change; ("manage", id, task, action, version) and its ("ok", id, value) or
                    ("error", id, status, type, message, details)
Arrays are written as bytes and read with `np.frombuffer`; no object per request crosses, and the
engine holds a request as a batcher entry (a tuple, `server/batcher.py`) and a key in its worker's
`Peer`: no Job, future or task per request. A frame's rows stay its arrays (`RowBlock`, each request
a range of it: `BlockRows`), with no object per row, down to collate. A batch's answers to one worker
leave in one frame.

Backpressure and cancellation: a worker keeps at most `in_flight_limit` requests in the engine and
answers 429 beyond that (the engine refuses the same way a worker that sends more); a request whose
client left (asked once it has waited `DISCONNECT_CHECK_AFTER`, then every `WATCH_EVERY`) is
cancelled in the engine, so a batch that has not started yet drops it (no device work). A deadline
travels with the request and the engine's batcher drops a request past it before compute.
"""
from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import struct
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from modules_store import Manifest, TaskType
from server.answers import RowLogits
from server.backbone import EncodedInput
from server.backbone.tokens import FIELDS, PAIR, TRUNCATED, BlockRows, RowBlock, TextEncoder, plain_rows
from server.batcher import ENQUEUED, KEY, LENGTHS, MODULES, DeadlineExceeded, Job, Owner, QueueFull
from server.config import STOP_SIGNALS, Settings
from server.errors import ApiError, unknown_tasks
from server.heads.decode import decode_rows
from server.logs import configure_logging
from server.metrics import Metrics
from server.runtime import Runtime, cannot_serve, name_os_thread, one_host_thread

log = logging.getLogger("tmod.workers")

LENGTH = struct.Struct("<I")  # a frame's size, before it
REQUESTS, ANSWERS, CONTROL = b"R", b"A", b"P"  # a frame's kind: its first byte
# "R": kind, requests, rows, tokens, cancels, task-set names' bytes, text bytes (32 bytes: the arrays
# after it start 8-aligned)
REQUEST_HEAD = struct.Struct("<c3x6I4x")
# "A": kind, requests, (task, version) entries, names' bytes, pickled tail's bytes
ANSWER_HEAD = struct.Struct("<c3x5I")
DISCONNECT_CHECK_AFTER = 0.05  # seconds a request waits before its client is asked whether it is still there
WATCH_EVERY = 0.1  # seconds between two such questions to a waiting request
YOUNG_COLLECTION_EVERY = 20_000  # a worker's garbage collector: container allocations between young collections


def in_flight_limit(settings: Settings) -> int:
    """Requests one worker may have in the engine at once: its share of the engine's queue."""
    return max(1, -(-settings.max_queue // max(1, settings.workers)))


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """One frame's body: its kind is `body[:1]`."""
    (size,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
    return await reader.readexactly(size)


def write_frame(writer: asyncio.StreamWriter, parts: list) -> None:
    # uvloop writes the parts as they are (one vectored send, no join); asyncio's loop joins them once
    writer.writelines([LENGTH.pack(sum(map(len, parts))), *parts])


def control_frame(messages: list) -> list:
    return [CONTROL, pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL)]


class _Cursor:
    """Reads arrays one after the other out of a frame's body."""

    def __init__(self, body: bytes, offset: int):
        self.body, self.offset = body, offset

    def take(self, dtype, count: int) -> np.ndarray:
        array = np.frombuffer(self.body, dtype=dtype, count=count, offset=self.offset)
        self.offset += array.nbytes
        return array

    def raw(self, size: int) -> bytes:
        out = bytes(self.body[self.offset:self.offset + size])  # (the body may be a memoryview)
        self.offset += size
        return out


# ---- worker -> engine: requests ---------------------------------------------------------------------
def request_frame(requests: list[tuple], cancels: list[int]) -> list:
    """A worker's requests of one event-loop iteration, `(id, rows, task set "a,b", seconds left)`
    each, and the ids it cancels -> a frame's parts."""
    sets: dict[str, int] = {}
    ids, left, which, counts, lengths, flags, ends, texts, tokens = [], [], [], [], [], [], [], [], []
    end = 0
    for ident, rows, tasks, seconds in requests:
        ids.append(ident)
        left.append(seconds)
        which.append(sets.setdefault(tasks, len(sets)))
        counts.append(len(rows))
        for row in rows:
            pair = row.text_pair
            lengths.append(len(row))
            flags.append((TRUNCATED if row.truncated else 0) | (PAIR if pair is not None else 0))
            end += len(row.text)
            ends.append(end)
            texts.append(row.text)
            if pair is not None:
                end += len(pair)
                texts.append(pair)
            ends.append(end)
            tokens.append(row.tokens)
    names = "\n".join(sets).encode()
    text = "".join(texts).encode("utf-8", "surrogatepass")
    block = np.concatenate(tokens) if len(tokens) > 1 else tokens[0] if tokens else np.empty((0, FIELDS), np.int32)
    return [REQUEST_HEAD.pack(REQUESTS, len(ids), len(lengths), block.shape[0], len(cancels), len(names), len(text)),
            np.array(left, dtype=np.float64).tobytes(), np.array(ids, dtype=np.int32).tobytes(),
            np.array(which, dtype=np.int32).tobytes(), np.array(counts, dtype=np.int32).tobytes(),
            np.array(cancels, dtype=np.int32).tobytes(), np.array(lengths, dtype=np.int32).tobytes(),
            np.array(ends, dtype=np.int32).tobytes(), np.ascontiguousarray(block, dtype=np.int32).tobytes(),
            np.array(flags, dtype=np.uint8).tobytes(), names, text]


@dataclass
class RequestFrame:
    """A request frame read back: per request its id, seconds left, task set and rows (views of the
    frame's token array), and the ids cancelled."""

    ids: list[int]
    seconds_left: list[float]
    task_sets: list[str]
    which: list[int]  # per request, its index into task_sets
    rows: list[BlockRows]  # per request, its rows of the frame's one RowBlock (no object per row)
    lengths: list[list[int]]  # per request, its rows' token counts
    cancels: list[int]

    @classmethod
    def read(cls, body: bytes) -> "RequestFrame":
        _, n, count, size, cancelled, names, text_bytes = REQUEST_HEAD.unpack_from(body)
        view = memoryview(body)
        at = REQUEST_HEAD.size
        # the lists (seconds left; ids, task sets, rows per request, cancels, token counts) read as
        # Python lists straight from the bytes; the arrays (token counts, text ends, tokens, flags) as
        # numpy views: a frame often holds one request, so the calls per frame are what cost
        left = view[at:at + 8 * n].cast("d").tolist()
        at += 8 * n
        a = 3 * n + cancelled  # ids, task sets, rows per request and cancels lie first, then token counts, text ends
        listed = view[at:at + 4 * (a + count)].cast("i").tolist()
        ids, which, per_request = listed[:n], listed[n:2 * n], listed[2 * n:3 * n]
        cancels, lengths = listed[3 * n:a], listed[a:]
        ints = np.frombuffer(body, dtype=np.int32, count=3 * count, offset=at + 4 * a)
        at += 4 * (a + 3 * count)
        tokens = np.frombuffer(body, dtype=np.int32, count=size * FIELDS, offset=at).reshape(size, FIELDS)
        at += 4 * size * FIELDS
        flags = np.frombuffer(body, dtype=np.uint8, count=count, offset=at)
        pairs = view[at:at + count].tolist()  # each row's flags, to tell pairs (a request's first row says)
        at += count
        task_sets = str(view[at:at + names], "utf-8").split("\n") if n else []
        at += names
        text = str(view[at:at + text_bytes], "utf-8", "surrogatepass")
        block = RowBlock.of_frame(tokens, ints[:count], text, ints[count:].reshape(count, 2), flags)
        if count == n:  # one row per request (the common case)
            return cls(ids, left, task_sets, which,
                       [BlockRows(block, r, r + 1, pairs[r] & PAIR != 0) for r in range(n)],
                       [[length] for length in lengths], cancels)
        bounds = [0, *itertools.accumulate(per_request)]
        return cls(ids, left, task_sets, which, [BlockRows(block, x, y, x < y and pairs[x] & PAIR != 0)
                                                 for x, y in zip(bounds, bounds[1:])],
                   [lengths[x:y] for x, y in zip(bounds, bounds[1:])], cancels)


# ---- engine -> worker: answers ----------------------------------------------------------------------
def answer_frame(batches: list[tuple], errors: list[tuple]) -> list:
    """What the engine has for one worker in one event-loop iteration -> a frame's parts. `batches`:
    `(items, outputs, timings, started)` as the batcher hands an Owner; `errors`: `(id, status, type,
    message, details)`. Work per task per batch (one gather of its rows), not per request and task."""
    ids, queued, spans, status = [], [], [], []  # queued: each request's queue seconds; spans: a batch's requests
    table: dict[tuple[str, str], tuple[list, list]] = {}  # (task, version) -> (row answers, [(requests, rows)])
    tail: dict = {}
    for items, outputs, timings, started in batches:
        first = len(ids)
        ids += [entry[KEY] for entry, _ in items]
        queued += [started - entry[ENQUEUED] for entry, _ in items]
        spans.append((first, len(ids), timings.backbone, timings.heads))
        answered = [0] * len(items)  # each request's status: 0, or the status of a refusal of one of its rows
        refused = {r: a for answers in outputs.values() if type(answers) is not RowLogits  # never holds a refusal
                   for r, a in enumerate(answers) if type(a) is not np.ndarray and isinstance(a, Exception)}
        if refused:
            for k, (_, places) in enumerate(items):
                refusal = next((refused[p] for p in places if p in refused), None)
                if refusal is not None:
                    answered[k] = refusal.status if isinstance(refusal, ApiError) else 500
                    tail.setdefault("errors", {})[first + k] = describe_error(refusal)
        status += answered
        # per task, the requests that asked it in request order (a reader cuts a task's block by the
        # requests' counts in order): one list per task set, merged where a batch holds several
        groups: dict[int, tuple[dict, list]] = {}  # per task set (one dict per set): its modules, its requests
        for k, (entry, _) in enumerate(items):
            if not answered[k]:
                modules = entry[MODULES]
                groups.setdefault(id(modules), (modules, []))[1].append(k)
        asked: dict[str, tuple] = {}  # task -> (its module (one per task in a batch), the requests asking it)
        for modules, members in groups.values():
            for task, module in modules.items():
                if task in asked:
                    asked[task][1].extend(members)
                else:
                    asked[task] = (module, members if len(groups) == 1 else list(members))
        layouts: dict[int, RequestRows] = {}  # tasks asked by the same requests share one
        for task, (module, members) in asked.items():
            if len(groups) > 1:
                members.sort()
            layout = layouts.get(id(members))
            if layout is None:
                layout = layouts[id(members)] = RequestRows(items, members, first)
            answers = outputs[task]
            if type(answers) is RowLogits:  # one gather of the task's rows (no step per row)
                part = answers.take(layout.gather())
                token_task = answers.lengths is not None
            else:
                mine = [answers[p] for p in layout.places]
                if type(mine[0]) is not np.ndarray:  # decoded here (a bridged task)
                    at = 0
                    for i, count in zip(layout.requests, layout.rows):
                        tail.setdefault("decoded", {}).setdefault(i, {})[task] = (module.version, mine[at:at + count])
                        at += count
                    continue
                token_task = mine[0].ndim == 2
                part = np.concatenate(mine) if token_task else np.stack(mine)
            parts, counts = table.setdefault((task, module.version), ([], []))
            parts.append(part)
            counts.append((layout.requests, layout.tokens() if token_task else layout.rows))
    for ident, code, type_, message, details in errors:
        tail.setdefault("errors", {})[len(ids)] = (type_, message, details)
        ids.append(ident)
        queued.append(0.0)
        status.append(code)
    n = len(ids)
    times = np.zeros((n, 3), dtype=np.float64)  # per request: queue, backbone, heads seconds
    times[:, 0] = queued
    for a, b, backbone, heads in spans:
        times[a:b, 1:] = backbone, heads
    count_rows, widths, blocks = [], [], []
    for parts, counts in table.values():
        column = np.zeros(n, dtype=np.int32)
        for requests, values in counts:
            column[requests] = values
        count_rows.append(column.tobytes())
        block = parts[0] if len(parts) == 1 else np.concatenate(parts)
        widths.append(block.shape[1])
        # the array's own bytes, written as they are (write_frame)
        blocks.append(memoryview(np.ascontiguousarray(block, dtype=np.float32)).cast("B"))
    names = "\n".join(f"{task}\t{version}" for task, version in table).encode()
    pickled = pickle.dumps(tail, protocol=pickle.HIGHEST_PROTOCOL) if tail else b""
    return [ANSWER_HEAD.pack(ANSWERS, n, len(table), len(names), len(pickled), 0), times.tobytes(),
            np.array(ids, dtype=np.int32).tobytes(), np.array(status, dtype=np.int32).tobytes(), *count_rows,
            np.array(widths, dtype=np.int32).tobytes(), *blocks, names, pickled]


class RequestRows:
    """The rows of some of a batch's requests (`members`: their indices in the batch's items, in
    order), laid out as a task's block holds them: request after request, each one's rows in its order."""

    def __init__(self, items: list, members: list[int], first: int):
        self.items, self.members = items, members
        self.requests = [first + k for k in members]  # their indices in the frame
        self.places = list(itertools.chain.from_iterable(items[k][1] for k in members))  # rows in the batch
        self.rows = [len(items[k][1]) for k in members]
        self._gather = self._tokens = None

    def gather(self) -> np.ndarray:
        if self._gather is None:
            self._gather = np.array(self.places)
        return self._gather

    def tokens(self) -> list[int]:
        """Per request, its rows' tokens (a token task answers each row's own tokens)."""
        if self._tokens is None:
            self._tokens = [sum(self.items[k][0][LENGTHS]) for k in self.members]
        return self._tokens


def describe_error(exc: Exception) -> tuple:
    """(type, message, details) of what a request gets for an exception: its ApiError, or a 500."""
    if isinstance(exc, ApiError):
        return exc.type, exc.message, exc.details
    log.error("engine: a request failed", exc_info=exc)
    return "internal_error", f"{type(exc).__name__}: {exc}", {}


def read_answers(body: bytes) -> list[tuple]:
    """An answer frame -> per request `(id, answer)`: answer is an ApiError, or `(arrays by task (a
    bridged task: its decoded answers), versions by task, (queue, backbone, heads) seconds)`."""
    _, n, entries, names, pickled, _ = ANSWER_HEAD.unpack_from(body)
    at = _Cursor(body, ANSWER_HEAD.size)
    times = at.take(np.float64, 3 * n).reshape(n, 3).tolist()
    ids, status = at.take(np.int32, n).tolist(), at.take(np.int32, n).tolist()
    counts = at.take(np.int32, entries * n).reshape(entries, n)
    widths = at.take(np.int32, entries).tolist()
    blocks = []
    for e, width in enumerate(widths):
        rows = int(counts[e].sum())
        blocks.append(at.take(np.float32, rows * width).reshape(rows, width).copy())  # writable: decode reads it via torch
    keys = [line.split("\t") for line in at.raw(names).decode().split("\n")] if entries else []
    tail = pickle.loads(at.raw(pickled)) if pickled else {}
    errors, decoded = tail.get("errors", {}), tail.get("decoded", {})
    bounds = [[0, *itertools.accumulate(column)] for column in counts.tolist()]
    out = []
    for i in range(n):
        if status[i]:
            type_, message, details = errors[i]
            out.append((ids[i], ApiError(status[i], type_, message, **details)))
            continue
        arrays, versions = {}, {}
        for (task, version), bound, block in zip(keys, bounds, blocks):
            if bound[i + 1] > bound[i]:
                arrays[task], versions[task] = block[bound[i]:bound[i + 1]], version
        for task, (version, answers) in decoded.get(i, {}).items():
            arrays[task], versions[task] = answers, version
        out.append((ids[i], (arrays, versions, tuple(times[i]))))
    return out


def unpack_rows(packed: np.ndarray, lengths: list[int], token_task: bool) -> list[np.ndarray]:
    """A request's array for one task -> one array per input: (labels,) each, or for a token task
    (tokens, labels) each, `lengths` the inputs' token counts."""
    if not token_task:
        return list(packed)
    return np.split(packed, np.cumsum(lengths)[:-1])


@dataclass
class ModuleView:
    """What a worker knows of a loaded module: enough to check a request, decode and describe it."""

    task: str
    version: str
    manifest: Manifest
    bridge: str | None
    info: dict  # what /v1/tasks says of it (Runtime.describe)


@dataclass
class EngineState:
    ready: bool
    startup_error: str | None
    model: tuple[str, str] | None  # (backbone name, fingerprint short form), once loaded
    modules_of: dict[str, str] | None  # Runtime.modules_of(), once loaded
    modules: dict[str, ModuleView] = field(default_factory=dict)
    load_errors: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # Runtime.skipped
    text: TextEncoder | None = None  # the tokenizer: sent once per worker, in its first ready state


# ---- the engine process ------------------------------------------------------------------------------
class Peer(Owner):
    """One worker's connection, as the batcher's owner of that worker's requests: which are waiting
    (a set of ids), how many are in the engine, and what is to be written back at the end of this
    event-loop iteration (one answer frame)."""

    def __init__(self, writer: asyncio.WriteTransport, runtime: Runtime):
        self.writer, self.runtime = writer, runtime  # the connection's transport (`PeerConnection`)
        self.tokenizer_sent = False
        self.waiting_ids: set[int] = set()
        self.in_engine = 0  # waiting or in a running batch
        self.batches: list[tuple] = []
        self.errors: list[tuple] = []
        self.closed = False

    # the batcher's side (server/batcher.py, Owner)
    def waiting(self, key: int) -> bool:
        return key in self.waiting_ids

    def take(self, key: int) -> bool:
        if key not in self.waiting_ids:
            return False
        self.waiting_ids.discard(key)
        return True

    def expire(self, key: int) -> bool:
        if key not in self.waiting_ids:
            return False
        self.waiting_ids.discard(key)
        self.refuse(key, self.runtime.refusal(DeadlineExceeded("the request waited past its deadline")))
        return True

    def answer(self, items, outputs, timings, started) -> None:
        self.in_engine -= len(items)
        if not self.closed:
            self._soon()
            self.batches.append((items, outputs, timings, started))

    def fail(self, entries, exc) -> None:
        for entry in entries:
            self.refuse(entry[KEY], self.runtime.refusal(exc), counted=True)

    # the service's side
    def cancel(self, key: int) -> bool:
        if key not in self.waiting_ids:
            return False
        self.waiting_ids.discard(key)
        self.in_engine -= 1
        return True

    def refuse(self, key: int, exc: Exception, counted: bool = True) -> None:
        """Answer a request with an error (`counted`: it was in the engine)."""
        if counted:
            self.in_engine -= 1
        if not self.closed:
            self._soon()
            self.errors.append((key, exc.status if isinstance(exc, ApiError) else 500, *describe_error(exc)))

    def _soon(self) -> None:
        if not (self.batches or self.errors):
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        batches, errors, self.batches, self.errors = self.batches, self.errors, [], []
        if not (batches or errors) or self.closed or self.writer.is_closing():
            return
        try:
            parts = answer_frame(batches, errors)
        except Exception as exc:  # never leave a worker's requests unanswered: each gets the 500
            failed = describe_error(exc)
            parts = answer_frame([], [(entry[KEY], 500, *failed) for items, *_ in batches for entry, _ in items]
                                 + [(ident, 500, *failed) for ident, *_ in errors])
        write_frame(self.writer, parts)

    def control(self, messages: list) -> None:
        """Control messages go at once, after the answers before them (a state must not be overtaken)."""
        self.flush()
        if not self.closed and not self.writer.is_closing():
            write_frame(self.writer, control_frame(messages))


class PeerConnection(asyncio.Protocol):
    """A worker's connection to the engine, read without a task or stream: each frame is handled as
    soon as its last byte arrives (`EngineService.frame`), in the loop's own read callback; answers
    are written to the transport (`Peer`)."""

    def __init__(self, service: "EngineService"):
        self.service = service
        self.peer: Peer | None = None
        self.buffer = bytearray()  # a frame's bytes so far, when it came in several reads
        self.needed = LENGTH.size  # bytes the buffer must hold before a frame can end in it

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.peer = self.service.connected(transport)

    def data_received(self, data: bytes) -> None:
        """Each frame is handed on as a view of the bytes it came in (no copy of a frame that came
        in one read; one, the buffer's, of a frame that came in several)."""
        if self.buffer:
            self.buffer += data
            if len(self.buffer) < self.needed:
                return
            data, self.buffer = self.buffer, bytearray()  # the frames' views keep the old buffer
        view = memoryview(data)
        at, end = 0, len(data)
        while True:
            if end - at < LENGTH.size:
                self.needed = LENGTH.size
                break
            (size,) = LENGTH.unpack_from(data, at)
            stop = at + LENGTH.size + size
            if stop > end:
                self.needed = stop - at
                break
            self.service.frame(self.peer, view[at + LENGTH.size:stop])
            at = stop
        if at < end:
            self.buffer += view[at:]

    def connection_lost(self, exc: Exception | None) -> None:
        self.service.disconnected(self.peer)


class EngineService:
    """Serves one Runtime to the worker processes' connections. `on_loaded`: called once the runtime
    has loaded (not if its start-up failed)."""

    def __init__(self, runtime: Runtime, on_loaded: Callable[[], None] | None = None):
        self.runtime = runtime
        self.on_loaded = on_loaded
        self.peers: set[Peer] = set()
        self.limit = in_flight_limit(runtime.settings)
        self.server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._sets: dict[str, dict | ApiError] = {}  # a task set's modules (or why not), for `_sets_of`
        self._sets_of: dict | None = None

    async def start(self, path: Path) -> None:
        await self.runtime.open()
        self.server = await asyncio.get_running_loop().create_unix_server(lambda: PeerConnection(self),
                                                                          path=str(path))
        self._keep(self._announce_when_loaded())

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for peer in list(self.peers):
            peer.writer.close()

    def _keep(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _announce_when_loaded(self) -> None:
        while not (self.runtime.ready.is_set() or self.runtime.startup_error):
            await asyncio.sleep(0.05)
        self.broadcast()
        if self.runtime.ready.is_set() and self.on_loaded is not None:
            self.on_loaded()

    def state(self) -> EngineState:
        rt = self.runtime
        ready = rt.ready.is_set()
        return EngineState(
            ready=ready, startup_error=rt.startup_error, model=rt.model_info() if ready else None,
            modules_of=rt.modules_of() if ready else None,
            modules={task: self.view(m) for task, m in rt.modules.items()}, load_errors=dict(rt.load_errors),
            skipped=dict(rt.skipped),
        )

    def view(self, module) -> ModuleView:
        return ModuleView(module.task, module.version, module.manifest, module.bridge, self.runtime.describe(module))

    def broadcast(self) -> None:
        state = self.state()
        for peer in list(self.peers):
            self._send_state(peer, state)

    def _send_state(self, peer: Peer, state: EngineState) -> None:
        if state.ready and not peer.tokenizer_sent:
            state = replace(state, text=self.runtime.backbone.text)
            peer.tokenizer_sent = True
        peer.control([("state", state)])

    def connected(self, transport: asyncio.Transport) -> Peer:
        peer = Peer(transport, self.runtime)
        self.peers.add(peer)
        self._send_state(peer, self.state())
        return peer

    def frame(self, peer: Peer, body: memoryview) -> None:
        """A frame a worker sent (`PeerConnection`): requests, or control messages."""
        if body[:1] == REQUESTS:
            self._requests(peer, RequestFrame.read(body))
        else:
            for message in pickle.loads(body[1:]):
                self._keep(self._answer(peer, message))

    def disconnected(self, peer: Peer) -> None:
        """The worker exited: so are its requests (answers still being computed for it are dropped)."""
        self.peers.discard(peer)
        peer.closed = True
        for ident in list(peer.waiting_ids):
            self._cancel(peer, ident)
        peer.writer.close()

    def _cancel(self, peer: Peer, ident: int) -> None:
        """A worker's request whose client left: a batch that has not started drops it."""
        if peer.cancel(ident):
            self.runtime.metrics.child(self.runtime.metrics.dropped, "client_gone").inc()

    def _modules_for(self, tasks: str) -> dict | ApiError:
        """A task set's modules in the running set (one snapshot per set of loaded modules: the
        worker's view may be a change behind), or the 400 it gets."""
        loaded = self.runtime.modules
        if loaded is not self._sets_of:
            self._sets, self._sets_of = {}, loaded
        found = self._sets.get(tasks)
        if found is None:
            names = tasks.split(",")
            unknown = [t for t in names if t not in loaded]
            rt = self.runtime
            found = self._sets[tasks] = (unknown_tasks(unknown, loaded, rt.load_errors, rt.skipped) if unknown
                                         else {t: loaded[t] for t in names})
        return found

    def _requests(self, peer: Peer, frame: RequestFrame) -> None:
        """Queue a worker's requests as batcher entries (tuples); answers leave from `Peer.answer`."""
        for ident in frame.cancels:
            self._cancel(peer, ident)
        now = time.perf_counter()
        sets = [self._modules_for(tasks) for tasks in frame.task_sets]
        room = self.limit - peer.in_engine
        entries = []
        for ident, seconds, which, rows, lengths in zip(frame.ids, frame.seconds_left, frame.which, frame.rows,
                                                        frame.lengths):
            modules = sets[which]
            if type(modules) is not dict:  # the 400 of an unknown task
                peer.refuse(ident, modules, counted=False)
            elif len(entries) >= room:
                peer.refuse(ident, self._overloaded(), counted=False)
            else:
                entries.append((rows, modules, now + seconds, now, peer, ident, lengths))
        if not entries:
            return
        peer.waiting_ids.update(entry[KEY] for entry in entries)  # before the batcher sees them (it asks the owner)
        refusal = None
        try:
            queued = self.runtime.put_many(entries)
        except ApiError as exc:  # shutting down
            queued, refusal = 0, exc
        peer.in_engine += queued
        if queued == len(entries):
            return
        if refusal is None:  # the queue is full
            refusal = self.runtime.refusal(QueueFull(f"queue is full ({self.runtime.settings.max_queue} requests "
                                                     "waiting)"))
        for entry in entries[queued:]:
            peer.waiting_ids.discard(entry[KEY])
            peer.refuse(entry[KEY], refusal, counted=False)

    def _overloaded(self) -> ApiError:
        return ApiError(429, "overloaded", f"server overloaded: {self.limit} requests of this worker in flight; "
                                           "retry later")

    async def _answer(self, peer: Peer, message) -> None:
        kind, ident, *args = message
        try:
            if kind == "manage":
                reply = ("ok", ident, await self._manage(*args))
            else:
                raise ApiError(500, "internal_error", f"the engine got an unknown message {kind!r}")
        except Exception as exc:  # the engine stays up; the request gets what went wrong
            reply = ("error", ident, exc.status if isinstance(exc, ApiError) else 500, *describe_error(exc))
        peer.control([reply])

    async def _manage(self, task: str, action: str, version: str | None):
        module, previous = await self.runtime.manage(task, action, version)
        self.broadcast()  # every worker has the new set before this answer reaches the one that asked
        return self.view(module), previous


# ---- a worker process ---------------------------------------------------------------------------------
class WorkerOutbox:
    """What a worker sends in one event-loop iteration: its first message schedules a flush at the
    iteration's end, which writes one control frame (if any) and one request frame. `failed(ids,
    exc)`: requests that could not be written."""

    def __init__(self, writer: asyncio.StreamWriter, failed):
        self.writer, self.failed = writer, failed
        self.requests: list[tuple] = []
        self.cancels: list[int] = []
        self.messages: list = []

    def _soon(self) -> None:
        if not (self.requests or self.cancels or self.messages):
            asyncio.get_running_loop().call_soon(self.flush)

    def request(self, ident: int, rows, tasks: str, seconds_left: float) -> None:
        self._soon()
        self.requests.append((ident, rows, tasks, seconds_left))

    def cancel(self, ident: int) -> None:
        self._soon()
        self.cancels.append(ident)

    def send(self, message) -> None:
        self._soon()
        self.messages.append(message)

    def flush(self) -> None:
        requests, cancels, messages = self.requests, self.cancels, self.messages
        self.requests, self.cancels, self.messages = [], [], []
        if self.writer.is_closing():
            return
        if messages:
            write_frame(self.writer, control_frame(messages))
        if requests or cancels:
            try:
                parts = request_frame(requests, cancels)
            except Exception as exc:  # never leave the requests waiting for an answer that cannot come
                log.exception("worker %d: a request frame could not be made", os.getpid())
                self.failed([ident for ident, *_ in requests], exc)
                return
            write_frame(self.writer, parts)


class RemoteRuntime:
    """The Runtime interface the app uses (`server/runtime.py`), in a worker process: tokenization
    and decode here, everything else by asking the engine process."""

    def __init__(self, settings: Settings, path: str | Path):
        self.settings = settings
        self.path = str(path)
        self.metrics = Metrics()
        self.ready = threading.Event()
        self.startup_error: str | None = None
        self.modules: dict[str, ModuleView] = {}
        self.load_errors: dict[str, str] = {}
        self.skipped: dict[str, str] = {}
        self.text: TextEncoder | None = None
        self._model: tuple[str, str] | None = None
        self._modules_of: dict[str, str] | None = None
        self._seen: dict[tuple[str, str], ModuleView] = {}  # (task, version) -> view, for answers of a replaced version
        self.tokenize_executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tmod-tokenize",
                                                    initializer=name_os_thread)
        self._pending: dict[int, asyncio.Future] = {}
        self._waiting: dict[int, Job] = {}  # inference requests in the engine, watched for clients that left
        self.limit = in_flight_limit(settings)
        self._ids = itertools.count()
        self._writer: asyncio.StreamWriter | None = None
        self._listener: asyncio.Task | None = None
        self._gone: ApiError | None = None

    async def open(self) -> None:
        reader, self._writer = await asyncio.open_unix_connection(self.path)
        self._outbox = WorkerOutbox(self._writer, self._fail)
        self._informed = asyncio.Event()
        self._listener = asyncio.get_running_loop().create_task(self._listen(reader))
        self._watcher = asyncio.get_running_loop().create_task(self._watch())
        await self._informed.wait()  # the engine's state arrives first: /readyz never answers from a blank view
        if self._gone is not None:  # the engine died before it said anything: this worker cannot start
            raise RuntimeError("the engine process closed its connection during start-up")
        gc.freeze()  # start-up's objects (libraries, app) out of the collector's passes, as in Runtime.start
        # a young collection walks every container still alive, and a worker's in-flight requests are many:
        # at the default 700 allocations it ran every few requests, over the same live objects each time
        gc.set_threshold(YOUNG_COLLECTION_EVERY, *gc.get_threshold()[1:])

    async def shutdown(self) -> None:
        # uvicorn has answered this worker's requests by now
        if self._listener is not None:
            self._listener.cancel()
            self._watcher.cancel()
        if self._writer is not None:
            self._writer.close()
        self.tokenize_executor.shutdown(wait=True)

    async def _listen(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                body = await read_frame(reader)
                if body[:1] == ANSWERS:
                    self._answers(body)
                else:
                    for message in pickle.loads(memoryview(body)[1:]):
                        self._receive(message)
        except (asyncio.IncompleteReadError, ConnectionError):
            self._gone = ApiError(503, "engine_unavailable", "the engine process is gone; retry later")
            self.ready.clear()
            self.startup_error = "the engine process is gone"
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(self._gone)
            self._pending.clear()
            self._informed.set()  # an `open` still waiting for the first state gives up
            log.error("worker %d: the engine process closed its connection; stopping", os.getpid())
            os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful stop: nothing is left to serve

    def _answers(self, body: bytes) -> None:
        """An answer frame: every request in it decoded together (`_decode_frame`), then answered."""
        pending, waiting = self._pending, self._waiting
        answered = []  # (future, job, arrays) of the requests to decode
        for ident, answer in read_answers(body):
            future = pending.pop(ident, None)
            if future is None or future.done():
                continue
            if isinstance(answer, ApiError):
                future.set_exception(answer)
                continue
            arrays, versions, (queue, backbone, heads) = answer
            job = waiting[ident]
            # the versions that answered, in the order the request named its tasks (its answers' order)
            job.modules = {task: self._seen.get((task, versions[task]), module) for task, module in job.modules.items()
                           if task in versions}
            job.timings.extra["queue"], job.timings.backbone, job.timings.heads = queue, backbone, heads
            answered.append((future, job, arrays))
        for future, results in zip([a[0] for a in answered], self._decode_frame([a[1:] for a in answered])):
            if isinstance(results, Exception):
                future.set_exception(results)
            else:
                future.set_result(results)

    def _fail(self, idents: list[int], exc: Exception) -> None:
        for ident in idents:
            future = self._pending.pop(ident, None)
            if future is not None and not future.done():
                future.set_exception(ApiError(500, "internal_error", f"{type(exc).__name__}: {exc}"))

    def _receive(self, message) -> None:
        if message[0] == "state":
            self._apply(message[1])
            return
        future = self._pending.pop(message[1], None)
        if future is None or future.done():
            return
        if message[0] == "ok":
            future.set_result(message[2])
        else:
            _, _, status, type_, text, details = message
            future.set_exception(ApiError(status, type_, text, **details))

    def _apply(self, state: EngineState) -> None:
        if state.text is not None:
            self.text = state.text
        self._model, self._modules_of = state.model, state.modules_of
        self.startup_error = state.startup_error
        self.load_errors, self.skipped = state.load_errors, state.skipped
        self.modules = state.modules  # replaced whole: requests keep the snapshot they took
        self._seen.update({(v.task, v.version): v for v in state.modules.values()})
        self.metrics.modules_loaded.set(len(state.modules))
        if state.ready and self.text is not None:
            self.ready.set()
        else:
            self.ready.clear()
        self._informed.set()

    def _future(self) -> tuple[int, asyncio.Future]:
        if self._gone is not None:
            raise self._gone
        ident = next(self._ids) & 0x7FFFFFFF  # an int32 on the wire
        future = asyncio.get_running_loop().create_future()
        self._pending[ident] = future
        return ident, future

    async def _watch(self) -> None:
        """Requests whose client left are cancelled in the engine (and answered 499 here)."""
        while True:
            await asyncio.sleep(WATCH_EVERY)
            ask_before = time.perf_counter() - DISCONNECT_CHECK_AFTER
            for ident, job in list(self._waiting.items()):
                if job.enqueued < ask_before and job.is_disconnected is not None and await job.is_disconnected():
                    future = self._pending.pop(ident, None)
                    if future is not None and not future.done():
                        future.set_exception(ApiError(499, "client_closed_request", "client disconnected"))
                        self._outbox.cancel(ident)

    # ---- the interface the app uses (as Runtime's) ------------------------------------------------
    def model_info(self) -> tuple[str, str]:
        return self._model

    def modules_of(self) -> dict[str, str]:
        return self._modules_of

    def encode(self, texts, text_pairs, truncate: bool, max_tokens: int | None) -> list[EncodedInput]:
        return self.text.encode(texts, text_pairs, truncate, max_tokens)

    def describe(self, module: ModuleView) -> dict:
        return module.info

    async def submit(self, job: Job) -> list[dict]:
        if len(self._pending) >= self.limit:
            raise ApiError(429, "overloaded", f"server overloaded: {self.limit} requests of this worker in flight; "
                                              "retry later")
        ident, future = self._future()
        self._waiting[ident] = job
        self._outbox.request(ident, job.rows, ",".join(job.modules), job.deadline - time.perf_counter())
        try:
            return await future  # decoded, with the job's modules and timings set (`_answers`)
        finally:
            self._waiting.pop(ident, None)

    def _decode_frame(self, answered: list[tuple[Job, dict]]) -> list[list[dict] | Exception]:
        """The requests of one answer frame, `(job, packed logits by task)` each -> each one's answers
        (or the exception its decode raised). Decoded together, one `decode_rows` per module over every
        request's rows, as the one process decodes a batch: its numpy calls are paid once per frame,
        not once per request. A request read in windows (server/windows.py) is decoded on its own."""
        out: list = [None] * len(answered)
        groups: dict[int, tuple[str, object, list]] = {}  # id(module) -> (task, module, [(request, packed)])
        for i, (job, packed) in enumerate(answered):
            if len(plain_rows(job.rows)) < len(job.rows):
                out[i] = self._decode_alone(job, packed)
                continue
            out[i] = [dict.fromkeys(job.modules) for _ in job.rows]  # each answer's tasks in the request's order
            for task, module in job.modules.items():
                answers = packed[task]
                if not isinstance(answers, np.ndarray):  # decoded by the engine (a bridged task)
                    for row, answer in zip(out[i], answers):
                        row[task] = answer
                    continue
                groups.setdefault(id(module), (task, module, []))[2].append((i, answers))
        for task, module, members in groups.values():
            rows = [row for i, _ in members for row in answered[i][0].rows]
            values = members[0][1] if len(members) == 1 else np.concatenate([answers for _, answers in members])
            try:
                answers = decode_rows(module.manifest.task_type, module.manifest.labels, values, rows,
                                      [row.answer for row in rows], module.manifest.decoding)
            except Exception:  # noqa: BLE001 - each request alone: only the one that fails gets its error
                for i, _ in members:
                    if not isinstance(out[i], Exception):
                        out[i] = self._decode_alone(answered[i][0], {task: answered[i][1][task]}, out[i])
                continue
            at = 0
            for i, _ in members:
                if isinstance(out[i], Exception):
                    at += len(answered[i][0].rows)
                    continue
                for result in out[i]:
                    result[task] = answers[at]
                    at += 1
        return out

    def _decode_alone(self, job: Job, packed: dict[str, object], results: list[dict] | None = None
                      ) -> list[dict] | Exception:
        try:
            return self._decode(job, packed, results)
        except Exception as exc:  # noqa: BLE001 - this request's answer is its error (a 500)
            log.error("worker %d: decoding a request failed", os.getpid(), exc_info=exc)
            return ApiError(500, "internal_error", f"{type(exc).__name__}: {exc}")

    def _decode(self, job: Job, packed: dict[str, object], results: list[dict] | None = None) -> list[dict]:
        """Each task's packed logits -> answers, over the job's rows (answers already decoded by the
        engine, those of bridged tasks, are taken as they are), into `results` (one dict per row)."""
        results = results if results is not None else [{} for _ in job.rows]
        plain = plain_rows(job.rows)  # windows of a longer text keep their logits (server/windows.py)
        # the rows as they are: decode_rows reads their token arrays (collating them cost ~50 us more)
        rows_read = [job.rows[r] for r in plain]
        for task, module in job.modules.items():
            if task not in packed:
                continue
            answers = packed[task]
            if not isinstance(answers, np.ndarray):
                for row, answer in zip(results, answers):
                    row[task] = answer
                continue
            if len(plain) < len(job.rows):  # windows of a longer text keep their logits (server/windows.py)
                token_task = module.manifest.task_type == TaskType.token_classification
                rows = unpack_rows(answers, [len(row) for row in job.rows], token_task)
                for r, row in enumerate(rows):
                    results[r][task] = row
                if not plain:
                    continue
                answers = np.concatenate([rows[r] for r in plain]) if token_task else np.stack([rows[r] for r in plain])
            answers = decode_rows(module.manifest.task_type, module.manifest.labels, answers, rows_read,
                                  [row.answer for row in rows_read], module.manifest.decoding)
            for r, answer in zip(plain, answers):
                results[r][task] = answer
        return results

    async def manage(self, task: str, action: str, version: str | None) -> tuple[ModuleView, str | None]:
        ident, future = self._future()
        self._outbox.send(("manage", ident, task, action, version))
        return await future


def run_worker(settings: Settings, engine_path: str, listener: socket.socket, index: int) -> None:
    """A worker process: the HTTP app over a RemoteRuntime, on the shared listening socket."""
    from server.app import create_app
    from server.http_limits import DrainingServer, uvicorn_config

    configure_logging(settings.log_level)
    one_host_thread()  # decode's small tensors, one request's token lists: the cores belong to the others
    app = create_app(settings, runtime=RemoteRuntime(settings, engine_path))
    config = uvicorn_config(app, settings)
    log.info("worker %d (pid %d) serving", index, os.getpid())
    DrainingServer(config).run(sockets=[listener])


# ---- the shared listener at SIGTERM -------------------------------------------------------------------
SO_ATTACH_FILTER = 26  # Linux
# A classic BPF socket filter over a TCP segment (offset 0 is its TCP header): drop it when the SYN flag
# (byte 13, bit 0x02) is set, let every other segment through. On a listening socket: no new
# handshake starts (the client's SYN is retried, then refused once the socket is closed), while the
# handshakes under way complete and the connections already queued stay to be accepted.
NO_NEW_CONNECTIONS = ((0x30, 0, 0, 13), (0x45, 0, 1, 0x02), (0x06, 0, 0, 0), (0x06, 0, 0, 0xFFFFFFFF))


def refuse_new_connections(listener: socket.socket) -> bool:
    """Attach `NO_NEW_CONNECTIONS` to a listening socket (every process holding it is affected).
    False where the system has no such filter (not Linux)."""
    import ctypes

    program = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *op) for op in NO_NEW_CONNECTIONS))
    try:  # the kernel copies the program: the buffer may go once this returns
        listener.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER,
                            struct.pack("HL", len(NO_NEW_CONNECTIONS), ctypes.addressof(program)))
    except OSError:
        return False
    return True


def queued_connections(listener: socket.socket) -> int:
    """Connections the kernel completed on a listening socket that no process has accepted yet (Linux
    `tcp_info.tcpi_unacked` of a listener)."""
    return struct.unpack_from("I", listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104), 24)[0]


async def stop_taking_connections(listener: socket.socket, timeout: float = 2.0, settle: float = 0.05) -> bool:
    """Refuse new connections and wait (at most `timeout`) until the workers have accepted every one
    queued, with `settle` seconds of an empty queue for handshakes under way. False: not supported."""
    if not refuse_new_connections(listener):
        return False
    deadline = time.monotonic() + timeout
    empty_since = None
    while time.monotonic() < deadline:
        if queued_connections(listener):
            empty_since = None
        elif empty_since is None:
            empty_since = time.monotonic()
        elif time.monotonic() - empty_since >= settle:
            return True
        await asyncio.sleep(0.005)
    log.warning("tmod-serve: %d connections still queued after %.1fs; stopping anyway", queued_connections(listener),
                timeout)
    return True


# ---- the process that starts it all (and becomes the engine) ------------------------------------------
class WorkerPool:
    RESTART_AFTER_S = 1.0  # a worker that keeps dying is restarted at most this often
    # A worker that dies this soon after its start, this many times in a row, will not start (it cannot
    # reach the engine's socket, say): the server stops, for its supervisor, instead of holding the port
    # with nobody to answer while it restarts workers every second
    EARLY_DEATH_S, GIVE_UP_AFTER = 10.0, 5

    def __init__(self, settings: Settings, engine_path: Path, listener: socket.socket):
        self.settings, self.engine_path, self.listener = settings, str(engine_path), listener
        # Workers are forked from a fresh interpreter (no threads of this process, no CUDA state) that
        # imported this module and the app once: a worker starts without importing torch again
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload([__name__, "server.app", "server.http_limits"])
        self.processes: list = [None] * settings.workers
        self.started: list[float] = [0.0] * settings.workers
        self.early_deaths: list[int] = [0] * settings.workers  # in a row, each worker

    def start(self, index: int) -> None:
        process = self.context.Process(target=run_worker, name=f"tmod-worker-{index}",
                                       args=(self.settings, self.engine_path, self.listener, index))
        process.start()
        self.processes[index], self.started[index] = process, time.monotonic()

    def start_all(self) -> None:
        for index in range(len(self.processes)):
            self.start(index)

    def replace_dead(self) -> str | None:
        """Start a worker in place of each that died; or why the server stops instead (one keeps dying
        at start)."""
        for index, process in enumerate(self.processes):
            lived = time.monotonic() - self.started[index]
            if process.is_alive() or lived < self.RESTART_AFTER_S:
                continue
            self.early_deaths[index] = self.early_deaths[index] + 1 if lived < self.EARLY_DEATH_S else 0
            _forget_process(process.pid)
            if self.early_deaths[index] >= self.GIVE_UP_AFTER:
                return (f"HTTP worker {index} exited at start {self.early_deaths[index]} times in a row (the last with "
                        f"code {process.exitcode}; the log says why)")
            log.error("worker %d (pid %d) exited with code %s; starting another", index, process.pid, process.exitcode)
            self.start(index)
        return None

    def stop(self, timeout: float) -> None:
        """SIGTERM every worker (each stops taking connections and finishes its requests), then wait."""
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.error("worker pid %d did not stop in %.0fs; killing it", process.pid, timeout)
                process.kill()
                process.join()
            _forget_process(process.pid)

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.is_alive()]


def _forget_process(pid: int) -> None:
    """A gone process's live gauges leave the /metrics sums (its counters stay counted)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


def serve(settings: Settings, index: int = 0, first_loaded=None) -> None:
    """`tmod-serve` with workers > 1, in the process that becomes the engine process (`index`: which
    engine of `serve_engines`, `first_loaded` their event that engine 0 is loaded: `_serve`)."""
    run_engine_loop(_serve(settings, index, first_loaded))


def run_engine_loop(main):
    """Run the engine process's event loop until `main` is done: uvloop where installed (a compiled
    loop, as the workers' uvicorn runs: each batch's timer, hand-off to the compute thread and back and
    answer write cost it less CPU than asyncio's loop in Python), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def serve_engines(settings: Settings) -> None:
    """`tmod-serve --engines N`: N engine processes, each `serve` with its own workers, on one port.
    This process holds the port (bound, never listening: it takes no connection), starts them, passes
    SIGTERM / SIGINT on (each drains as one server does) and exits non-zero if one of them did; one
    that stops on its own (a device failure) stops the others, for the supervisor to start afresh."""
    reserve = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET, socket.SOCK_STREAM)
    reserve.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    reserve.bind((settings.host, settings.port))
    port = reserve.getsockname()[1]
    settings = settings.model_copy(update={"port": port})
    context = multiprocessing.get_context("spawn")
    first_loaded, reasons = context.Event(), context.SimpleQueue()
    engines = [context.Process(target=run_engine, args=(settings, i, first_loaded, reasons), name=f"tmod-engine-{i}")
               for i in range(settings.engines)]
    stop = threading.Event()
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda *_: stop.set())
    for engine in engines:
        engine.start()
    log.info("tmod-serve: %d engine processes (pids %s), %d HTTP workers each, on http://%s:%d", len(engines),
             [e.pid for e in engines], settings.workers, settings.host, port)
    while not stop.wait(0.5):
        if any(not engine.is_alive() for engine in engines):
            log.error("tmod-serve: an engine process exited; stopping the others")
            break
    for engine in engines:
        if engine.is_alive():
            engine.terminate()  # SIGTERM: its workers finish their requests, then it drains
    for engine in engines:
        engine.join()
    reserve.close()
    failed = [e.exitcode for e in engines if e.exitcode not in (0, -signal.SIGTERM)]
    if failed:  # in the one line a single engine gives (server/cli.py), the first engine's to fail
        raise SystemExit(f"tmod-serve: {reasons.get()}" if not reasons.empty()
                         else f"tmod-serve: an engine process exited with {failed[0]}")


async def until_both_loaded(runtime: Runtime, first_loaded, stop: asyncio.Event) -> None:
    """Until this engine and engine 0 (`first_loaded`, set in its process) are loaded, or `stop`."""
    while not (stop.is_set() or (runtime.ready.is_set() and first_loaded.is_set())):
        try:
            await asyncio.wait_for(stop.wait(), 0.1)
        except asyncio.TimeoutError:
            pass


def run_engine(settings: Settings, index: int, first_loaded, reasons) -> None:
    """Engine `index` of `serve_engines` (a spawned process): `serve`, exiting 1 where start-up or the
    device failed (as `tmod-serve` does), the reason put on `reasons` for the parent to say."""
    from server import runtime

    configure_logging(settings.log_level)
    runtime.on_device_failure = lambda: os.kill(os.getpid(), signal.SIGTERM)
    serve(settings, index, first_loaded)
    reason = runtime.exit_reason()
    if reason is not None:
        reasons.put(reason)
        raise SystemExit(1)


async def _serve(settings: Settings, index: int = 0, first_loaded=None) -> None:
    loop = asyncio.get_running_loop()
    folder = Path(tempfile.mkdtemp(prefix="tmod-engine-"))  # mode 0700: only this user reaches the engine
    engine_path = folder / "engine.sock"
    # bound before anything loads (a port in use fails at once); a further engine binds once loaded
    listener = listen(settings) if index == 0 else None
    runtime = Runtime(settings)
    stop = asyncio.Event()
    for sig in STOP_SIGNALS:  # before start-up runs: a failed start-up stops the process by SIGTERM
        loop.add_signal_handler(sig, stop.set)
    # With `--engines N` the kernel hands each connection to any engine listening on the port, so /readyz
    # (answered by whichever) is true only while every listening engine is loaded or none is. Engine 0
    # listens at once (/healthz answers through a long start-up such as CUDA graphs' capture, /readyz says
    # "loading") and sets `first_loaded` once loaded; a further engine joins the port once it is loaded
    # and engine 0 is: it never answers 503 not_ready while a loaded engine's /readyz says ready.
    service = EngineService(runtime, first_loaded.set if first_loaded is not None and index == 0 else None)
    await service.start(engine_path)
    if first_loaded is not None and index > 0:
        await until_both_loaded(runtime, first_loaded, stop)
    if not stop.is_set():  # (stopped, or start-up failed, before it joined the port: no workers to stop)
        await _serve_port(settings, engine_path, listener if listener is not None else listen(settings), stop)
    elif listener is not None:
        listener.close()
    await service.stop()
    await runtime.shutdown()
    shutil.rmtree(folder, ignore_errors=True)
    log.info("tmod-serve: stopped")


def listen(settings: Settings) -> socket.socket:
    # several engines (`serve_engines`) each listen on the port: the kernel spreads connections over them
    return socket.create_server((settings.host, settings.port), backlog=2048, reuse_port=settings.engines > 1)


async def _serve_port(settings: Settings, engine_path: Path, listener: socket.socket, stop: asyncio.Event) -> None:
    """This engine's HTTP workers on `listener` until `stop`; then they drain."""
    loop = asyncio.get_running_loop()
    pool = WorkerPool(settings, engine_path, listener)
    pool.start_all()
    host, port = listener.getsockname()[:2]
    log.info("tmod-serve: engine process %d, %d HTTP workers (pids %s) on http://%s:%d", os.getpid(),
             settings.workers, pool.pids(), host, port)
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            reason = pool.replace_dead()
            if reason is not None:
                log.critical("tmod-serve: %s; stopping", reason)
                cannot_serve(reason)
                break
    log.info("tmod-serve: stopping; the workers finish their requests first")
    # New connections refused, and those the kernel already queued on the listener accepted by the
    # workers, before any of them stops: a socket closed with connections queued resets them (a
    # client that reconnected after a `Connection: close` answer lost its request, issue 37)
    if await stop_taking_connections(listener):
        await loop.run_in_executor(None, pool.stop, settings.request_timeout_s + 5)
        listener.close()
    else:  # no socket filter here: this copy goes first, the workers' close ends the listener
        listener.close()
        await loop.run_in_executor(None, pool.stop, settings.request_timeout_s + 5)
