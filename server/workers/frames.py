"""The frames between an HTTP worker process and its engine process (server/workers/__init__.py).

Over a Unix socket in a folder only this user can open, each side writes at most one frame of each kind
per event-loop iteration (a 4-byte length, then a kind byte and a header (`struct`), then arrays):
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
leave in one frame."""
from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import struct
from dataclasses import dataclass, field

import numpy as np

from modules_store import Manifest
from server.answers import RowLogits
from server.backbone.tokens import FIELDS, PAIR, TRUNCATED, BlockRows, RowBlock, TextEncoder
from server.batcher import ENQUEUED, KEY, LENGTHS, MODULES
from server.config import Settings
from server.errors import ApiError

log = logging.getLogger("tmod.workers")

LENGTH = struct.Struct("<I")  # a frame's size, before it
REQUESTS, ANSWERS, CONTROL = b"R", b"A", b"P"  # a frame's kind: its first byte
# "R": kind, requests, rows, tokens, cancels, task-set names' bytes, text bytes (32 bytes: the arrays
# after it start 8-aligned)
REQUEST_HEAD = struct.Struct("<c3x6I4x")
# "A": kind, requests, (task, version) entries, names' bytes, pickled tail's bytes
ANSWER_HEAD = struct.Struct("<c3x5I")


# The engine process says it is alive to every worker every HEARTBEAT_S, from its event loop (a pass
# runs in its compute thread: a long pass does not silence it). A worker that hears nothing for
# ENGINE_SILENT_S takes the engine for stopped or stuck: its requests are answered 503 and its
# health routes say so, until the engine is heard again.
HEARTBEAT_S = 1.0
ENGINE_SILENT_S = 10.0


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
    retokenized: bool = False  # LoadedModule's


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
