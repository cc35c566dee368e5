"""The engine process's side of `--workers N`: `EngineService` takes every worker's connection
(`PeerConnection`), reads its request frames into the `Runtime`'s batcher, so one batch forms across
workers, and answers each worker in one frame per event-loop iteration (`Peer`, the batcher's owner
of that worker's requests); module changes a worker forwards (/admin) are made here and every worker
is told the new state."""
from __future__ import annotations

import asyncio
import logging
import pickle
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from server.batcher import KEY, DeadlineExceeded, Owner, QueueFull
from server.errors import ApiError, unknown_tasks
from server.runtime import Runtime
from server.workers.frames import (HEARTBEAT_S, LENGTH, REQUESTS, EngineState, ModuleView, RequestFrame,
                                   answer_frame, control_frame, describe_error, in_flight_limit, write_frame)

log = logging.getLogger("tmod.workers")

# A worker names a request's tasks from the set it last heard of; a change through /admin reaches it a
# frame later. For this long after a change, a task set the running set lacks is answered from the set
# replaced (as one process answers the requests it had taken); then that set, and any module unloaded
# with it, is let go.
REPLACED_SET_KEPT_S = 10.0


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
        self._replaced: dict | None = None  # the set the last change replaced, for REPLACED_SET_KEPT_S

    async def start(self, path: Path) -> None:
        await self.runtime.open()
        self.server = await asyncio.get_running_loop().create_unix_server(lambda: PeerConnection(self),
                                                                          path=str(path))
        self._keep(self._announce_when_loaded())
        self._keep(self._heartbeat())

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

    async def _heartbeat(self) -> None:
        """Every HEARTBEAT_S, each worker hears this process is alive (frames.py: ENGINE_SILENT_S)."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            for peer in list(self.peers):
                peer.control([("alive",)])

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
        return ModuleView(module.task, module.version, module.manifest, module.bridge, self.runtime.describe(module),
                          module.retokenized)

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
        """A task set's modules in the running set (one snapshot per set of loaded modules), or in the
        set a change just replaced (the worker's view may be a change behind), or the 400 it gets."""
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
        replaced = self._replaced
        if type(found) is not dict and replaced is not None and all(t in replaced for t in tasks.split(",")):
            return {t: replaced[t] for t in tasks.split(",")}
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

    def _let_go(self, replaced: dict) -> None:
        if self._replaced is replaced:
            self._replaced = None

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
        # kept from before the change: a request read while it is made may name the set it replaces
        replaced = self._replaced = self.runtime.modules
        asyncio.get_running_loop().call_later(REPLACED_SET_KEPT_S, self._let_go, replaced)
        module, previous = await self.runtime.manage(task, action, version)
        self.broadcast()  # every worker has the new set before this answer reaches the one that asked
        return self.view(module), previous
