"""What every route of a serving process shares: whether the runtime can answer, the modules a request
asks for, and one inference request's path (limits, tokenization with long texts in windows, the
batcher, metrics, timing headers) that every protocol's route takes (`Serving.run_inference`).

The app (server/api/app.py) makes one `Serving` over its runtime and hands it to each group of routes:
/v1/infer and /v1/tasks (server/api/infer.py), health (server/api/health.py), the admin routes
(server/api/admin.py), OIP v2 (server/api/oip.py, server/api/oip_grpc.py), tokenize (server/api/tokenize.py),
the embedding, classify and predict routes of the other protocols."""
from __future__ import annotations

import asyncio
import contextvars
import functools
import hmac
import re
import time
from collections import Counter
from typing import Callable
from urllib.parse import parse_qsl

from modules_store import ModuleStore
from server import windows
from server.api.schemas import DEFAULT_CONTROLS, AnswerControls, ModelInfo
from server.batcher import Job
from server.config import Settings
from server.errors import (ApiError, clip, clip_list, did_you_mean, no_such_task, nothing_served, protocol_of,
                           unknown_tasks)
from server.modules import LoadedModule, compares_pairs, reads_single_texts, token_limit

# A request this short is tokenized on the event loop: the hand-off to a tokenizer thread and back
# costs more CPU than its tokenization (bench/bench_frontend.py --workers, issues 25 and 37: at 1,000
# characters, 32-text requests of ~1,700 went to a thread and cost the workers and the engine more per
# text). At the limit a request holds the loop 1.8-2.8 ms (2-core EPYC). Past it, a thread: the tokenizer's
# batch call releases the GIL, so on a host with cores to spare a longer request is read beside the loop.
INLINE_TOKENIZE_CHARS = 4096
# C0/C1 controls other than tab, newline and carriage return never belong in text to analyse
CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
JSON_TYPES = (b"application/json",)


class IterationTokenizer:
    """Short requests tokenized on the event loop, together: those read in one event-loop iteration
    are tokenized one after the other at its end. Tokenized alone, between other requests' HTTP and
    decode work, a one-text request found the tokenizer's code and tables out of the CPU's caches and
    cost about twice its CPU (~90 against ~45 us in a worker, issue 37)."""

    def __init__(self):
        self.pending: list[tuple] = []

    def read(self, read) -> asyncio.Future:
        """A future of `read()`'s result (or its exception), run at the end of this iteration."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self.pending:  # run in a context of its own: not the request id of the first request
            loop.call_soon(self._run, context=contextvars.Context())
        self.pending.append((read, future))
        return future

    def _run(self) -> None:
        pending, self.pending = self.pending, []
        for read, future in pending:
            if future.done():  # the request was cancelled (its client left)
                continue
            try:
                future.set_result(read())
            except Exception as exc:  # noqa: BLE001 - the request's own error, raised where it awaits
                future.set_exception(exc)


class Serving:
    """The routes' view of one runtime (a Runtime in this process, or a worker's RemoteRuntime)."""

    def __init__(self, settings: Settings, runtime):
        self.settings, self.runtime, self.metrics = settings, runtime, runtime.metrics
        # a request's modules by (tasks, pairs), and each such dict's task types and token limit: clients send
        # the same few task lists again and again, so these are worked out once per snapshot of the loaded
        # modules (forgotten when a module changes), not once per request
        self.planned: dict[tuple, dict[str, LoadedModule]] = {}
        self.traits: dict[int, tuple] = {}  # id(modules) -> (modules, task types, token limit): held, so an id is not reused
        self.planned_for = None  # the snapshot both were made against
        # what window_settings answered, by its arguments and the encoder itself (a worker's encoder is replaced
        # when the engine sends a new one; the key holds the old one, so its id cannot be reused by the next)
        self.chosen_windows: dict[tuple, windows.WindowSettings] = {}
        self.inline = IterationTokenizer()

    # ---- readiness ---------------------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        name, fingerprint = self.runtime.model_info()
        return ModelInfo(backbone=name, fingerprint=fingerprint)

    def require_ready(self) -> None:
        if not self.runtime.ready.is_set():
            detail = self.runtime.startup_error or "the backbone and modules are still loading"
            raise ApiError(503, "not_ready", f"server not ready: {detail}")

    def no_modules(self) -> ApiError:
        runtime = self.runtime
        return ApiError(503, "no_modules", nothing_served(
            ModuleStore(self.settings.store), runtime.load_errors, runtime.skipped, bool(self.settings.admin_token)),
            refused=runtime.load_errors, not_served=dict(sorted(runtime.skipped.items())))

    def require_serving(self) -> None:
        """Ready to answer inference: the backbone loaded and at least one module (an operator who
        unloaded every module took the server out of service; it is still ready for /admin), and (a
        worker) an engine process that answers."""
        self.require_ready()
        silence = self.engine_silence()
        if silence is not None:
            raise silence
        if not self.runtime.modules:
            raise self.no_modules()

    def cannot_answer(self) -> ApiError | None:
        """The 503 of a process that cannot answer at all, what liveness says: the device failed (a sticky
        CUDA error; the process is stopping to be restarted), or, in a worker, its engine process sends
        nothing (stopped or stuck: `RemoteRuntime._silent`)."""
        if getattr(self.runtime, "failure", None) is not None:  # a worker's RemoteRuntime has none: its engine exits
            return self.runtime.failed()
        return self.engine_silence()

    def engine_silence(self) -> ApiError | None:
        """A worker's 503 while its engine process sends nothing (stopped or stuck), else None."""
        silence = getattr(self.runtime, "silence", None)  # a worker's RemoteRuntime
        return None if silence is None else silence()

    # ---- the modules a request asks for ------------------------------------------------------------
    def module(self, task: str, version: str | None = None) -> LoadedModule:
        """The loaded module of one task (OIP's and KServe's model), 404 naming what is loaded."""
        runtime = self.runtime
        module = runtime.modules.get(task)
        if module is None:
            raise no_such_task(task, runtime.modules, runtime.load_errors, runtime.skipped, noun="model")
        if version is not None and version != module.version:
            raise ApiError(404, "unknown_version", f"model {task!r} serves version {module.version}, not {clip(version)}")
        return module

    def select_modules(self, tasks: str | None) -> dict[str, LoadedModule]:
        loaded = self.runtime.modules  # one snapshot for the whole request
        if tasks is None:
            if not loaded:
                raise self.no_modules()
            return dict(loaded)
        names = task_names(tasks)
        unknown = [n for n in names if n not in loaded]
        if unknown:
            raise unknown_tasks(unknown, loaded, self.runtime.load_errors, self.runtime.skipped)
        return {n: loaded[n] for n in names}

    @staticmethod
    def fit_to_inputs(modules: dict[str, LoadedModule], has_pairs: bool, named: bool) -> dict[str, LoadedModule]:
        """Pair tasks (entailment) compare a text with a text pair: asked for by name with single
        texts they are refused; among all loaded tasks they are left out of a single-text request."""
        if has_pairs:
            single = sorted(t for t, m in modules.items() if reads_single_texts(m.manifest))
            if single and (named or len(single) == len(modules)):
                raise ApiError(422, "single_text_task", f"task(s) {single} read single texts: send inputs as texts")
            return {t: m for t, m in modules.items() if t not in single} if single else modules
        pair_tasks = sorted(t for t, m in modules.items() if compares_pairs(m.manifest))
        rest = {t: m for t, m in modules.items() if t not in pair_tasks}
        if pair_tasks and (named or not rest):
            raise ApiError(422, "pair_task", f"task(s) {pair_tasks} compare a text with a text pair: send inputs "
                                             'as {"text": ..., "text_pair": ...} objects (on /v2: a text_pair input, '
                                             "BYTES [N] beside text)")
        return rest

    def current_modules(self) -> None:
        if self.runtime.modules is not self.planned_for:
            self.planned.clear()
            self.traits.clear()
            self.planned_for = self.runtime.modules

    def modules_for(self, tasks: str | None, has_pairs: bool) -> dict[str, LoadedModule]:
        """`fit_to_inputs(select_modules(tasks), ...)`, remembered (a refusal is not)."""
        self.current_modules()
        found = self.planned.get((tasks, has_pairs))
        if found is None:
            found = self.fit_to_inputs(self.select_modules(tasks), has_pairs, named=tasks is not None)
            if len(self.planned) >= 1024:  # task lists a client makes up: the table stays small
                self.planned.clear()
            self.planned[tasks, has_pairs] = found
        return found

    def modules_traits(self, modules: dict) -> tuple[frozenset, int | None]:
        """`modules`' task types and token limit (`token_limit`), remembered per modules dict."""
        self.current_modules()
        found = self.traits.get(id(modules))
        if found is None or found[0] is not modules:
            if len(self.traits) >= 1024:
                self.traits.clear()
            found = self.traits[id(modules)] = (modules, frozenset(task_types(modules)),
                                                token_limit(modules, self.settings.max_tokens))
        return found[1], found[2]

    # ---- one inference request ---------------------------------------------------------------------
    async def run_inference(self, texts: list[str], text_pairs: list[str] | None, modules: dict[str, LoadedModule],
                            truncate: bool, request, window: int | None = None, stride: int | None = None,
                            controls: AnswerControls | None = None,
                            names: Callable[[int], str] | None = None) -> tuple[list[dict], Job, dict[str, str]]:
        """Shared by every protocol: limits, tokenization (long texts in windows), the batcher, metrics,
        timing headers. `request`: its `is_disconnected()`; `controls`: the request's answer controls
        (docs/answer-controls.md); `names`: text i's name in a refusal where the protocol's fields are not
        one list of inputs (default "input i").
        -> (per-input results keyed by task, the job (one row per input, the module versions that answered,
        per input its `windows`), response headers)."""
        self.metrics.in_flight(1)
        try:
            return await self.answer_inference(texts, text_pairs, modules, truncate, request, window, stride,
                                               controls or DEFAULT_CONTROLS, names)
        finally:
            self.metrics.in_flight(-1)

    def check_inputs(self, texts: list[str], text_pairs: list[str] | None,
                     names: Callable[[int], str] | None = None) -> None:
        """The limits and checks every text meets before it is tokenized (413 / 422); `names(i)`: text i's
        name in the request (default "input i")."""
        settings = self.settings
        if not texts:
            raise ApiError(422, "invalid_request", "no inputs: send at least one text")
        if len(texts) > settings.max_inputs:
            counted = f"{len(texts)} inputs" if names is None else \
                f"{len(texts)} texts ({names(0)} to {names(len(texts) - 1)}, counted together)"
            raise ApiError(413, "too_many_inputs", f"{counted}; at most {settings.max_inputs} per request on this "
                           f"server (its --max-inputs): send them in requests of {settings.max_inputs} or fewer" +
                           (" (a client's batch size, e.g. LangChain OpenAIEmbeddings' chunk_size, default 1000)"
                            if names is None else ""))
        name = names or "input {}".format
        for i, text in enumerate(texts + (text_pairs or [])):
            row = name(i) if i < len(texts) else f"{name(i - len(texts))}'s text_pair"
            if len(text) > settings.max_chars:
                raise ApiError(413, "input_too_long",
                               f"{row} has {len(text)} characters; at most {settings.max_chars}")
            if not text.strip():
                raise ApiError(422, "invalid_request", f"{row} is empty or only whitespace")
            bad = CONTROL_CHARS.search(text)
            if bad:
                raise ApiError(422, "invalid_request", f"{row} has control character "
                               f"U+{ord(bad.group()):04X} at position {bad.start()}")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ApiError(422, "invalid_request",
                               f"{row} is not valid Unicode (lone surrogate at position {exc.start})") from exc

    def window_settings(self, window: int | None, stride: int | None, max_tokens: int | None = None,
                        task_types=()) -> windows.WindowSettings:
        runtime, settings = self.runtime, self.settings
        key = (window, stride, max_tokens, frozenset(task_types), runtime.text)
        found = self.chosen_windows.get(key)
        if found is None:
            task_window = windows.measured_window(runtime.model_info()[0], task_types) if task_types else None
            found = windows.settings_for(runtime.text, max_tokens or settings.max_tokens, window, stride,
                                         settings.window_tokens, settings.window_stride, task_window)
            if len(self.chosen_windows) >= 1024:  # windows and strides a client names: the table stays small
                self.chosen_windows.clear()
            self.chosen_windows[key] = found
        return found

    async def read_inputs(self, texts, text_pairs, truncate, window, stride, max_tokens=None, modules=None,
                          budget: int | None = None, names: Callable[[int], str] | None = None) -> windows.Reading:
        """Tokenize (a long request in a tokenizer thread) and cut long texts into windows (server/windows.py) of at
        most `max_tokens` word pieces (default: the server's limit), by default as measured best for `modules`;
        413 past `budget` word pieces in all, found before the whole request is tokenized."""
        self.check_inputs(texts, text_pairs, names)
        # a truncated text is read in one row, as long as the backbone reads: the measured (shorter) reading
        # windows of a task type pay off only where a whole text is read in overlapping windows
        chosen = self.window_settings(window, stride, max_tokens,
                                      () if truncate or not modules else self.modules_traits(modules)[0])
        read = functools.partial(windows.read, self.runtime.text, texts, text_pairs, chosen, truncate, budget)
        try:
            if sum(map(len, texts)) + sum(map(len, text_pairs or ())) <= INLINE_TOKENIZE_CHARS:
                return await self.inline.read(read)
            return await asyncio.get_running_loop().run_in_executor(self.runtime.tokenize_executor, read)
        except windows.PairTooLong as exc:
            raise ApiError(413, "input_too_long", str(exc)) from exc
        except windows.TooManyTokens as exc:
            raise ApiError(413, "too_many_tokens", str(exc), tokens=exc.tokens, token_budget=exc.budget) from exc

    async def answer_inference(self, texts, text_pairs, modules, truncate, request, window, stride,
                               controls: AnswerControls, names: Callable[[int], str] | None):
        """`run_inference`'s work (it counts the request in flight around it)."""
        settings, runtime = self.settings, self.runtime
        received = time.perf_counter()
        deadline = received + settings.request_timeout_s  # one per request, shared by all its parts
        if truncate and controls.truncation_direction == "left":
            if text_pairs is not None:
                raise ApiError(422, "invalid_request", "truncation_direction 'left' is for single texts, not text pairs")
            truncate = "left"  # the tokenizer keeps the end of the text (server/backbone/tokens.py)
        reading = await self.read_inputs(texts, text_pairs, truncate, window, stride, self.modules_traits(modules)[1],
                                         modules, settings.max_request_tokens, names)
        options = controls.options()
        for row in reading.rows + [text.whole for text in reading.texts]:
            row.answer = options
        windows.check_windowable(reading, modules)
        job = windows.AnsweredJob(rows=[text.whole for text in reading.texts], modules=modules, deadline=0.0,
                                  windows=reading.windows)
        job.timings.tokenize = time.perf_counter() - received
        rows, answers, versions = reading.rows, [], None
        # a request over one batch's budget goes in parts, each to the back of the queue (fair turns);
        # a part not yet run when the request's deadline passes is not run
        pieces = windows.parts(rows, settings.max_batch_size, settings.max_batch_tokens)
        if len(pieces) == 1 and not reading.windowed:  # most requests: one part, the job's own rows
            pieces = ()
            job.deadline, job.is_disconnected = deadline, request.is_disconnected
            answers = await runtime.submit(job)  # sets the job's timings and (in a worker) the versions that answered
        for part in pieces:
            if time.perf_counter() >= deadline:
                raise ApiError(503, "deadline_exceeded", "the request ran past its deadline with parts left to run "
                               f"({settings.request_timeout_s}s)")
            piece = Job(rows=rows[part], modules=modules, deadline=deadline, is_disconnected=request.is_disconnected)
            answers += await runtime.submit(piece)
            answered = {t: m.version for t, m in piece.modules.items()}
            if versions is not None and answered != versions:
                raise ApiError(503, "module_changed", "a task's module was replaced while this request was read "
                               f"(versions {versions} then {answered}); retry")
            versions, job.modules = answered, piece.modules
            job.timings.extra["queue"] = job.timings.extra.get("queue", 0.0) + piece.timings.extra.get("queue", 0.0)
            job.timings.backbone += piece.timings.backbone
            job.timings.heads += piece.timings.heads
        results = answers
        if reading.windowed:  # decode each long text once, whole (host work, in a tokenizer thread)
            results = await asyncio.get_running_loop().run_in_executor(
                runtime.tokenize_executor, reading.answers, job.modules, answers, runtime.text)
        timings = job.timings
        total = time.perf_counter() - received
        queue = timings.extra.get("queue", 0.0)
        self.metrics.record_answer((("queue", queue), ("tokenize", timings.tokenize), ("backbone", timings.backbone),
                                    ("heads", timings.heads), ("total", total)), len(texts), modules)
        headers = {
            "x-queue-time": queue, "x-tokenization-time": timings.tokenize, "x-backbone-time": timings.backbone,
            "x-heads-time": timings.heads, "x-inference-time": timings.backbone + timings.heads, "x-total-time": total,
        }
        return results, job, {name: f"{seconds * 1000:.3f}" for name, seconds in headers.items()}


def task_types(modules: dict) -> set[str]:
    return {m.manifest.task_type.value for m in modules.values() if m.manifest is not None}


@functools.lru_cache(maxsize=256)  # clients ask the same few task lists again and again
def task_names(tasks: str) -> tuple[str, ...]:
    """`?tasks=` as task names (400 for an empty or repeated one). Linear in the query's length (it is
    bounded by the server's header limits, a product of them would not be): one split, one count."""
    names = tuple(t.strip() for t in tasks.split(","))
    if any(not n for n in names):
        raise ApiError(400, "invalid_tasks", f"empty task name in tasks={clip(tasks)}")
    duplicates = sorted(n for n, times in Counter(names).items() if times > 1)
    if duplicates:
        raise ApiError(400, "duplicate_tasks", f"tasks named more than once: {clip_list(duplicates)}"
                       + (f" and {len(duplicates) - 10} more" if len(duplicates) > 10 else ""))
    return names


def bearer_matches(headers, *secrets: bytes) -> bool:
    """Whether the request says `Authorization: Bearer <one of secrets>` (each compared in constant
    time, every one compared: the time does not say which matched)."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            token = token.strip()
            return scheme.lower() == b"bearer" and sum(hmac.compare_digest(token, secret) for secret in secrets) > 0
    return False


# the query parameters a POST route reads (`check_query`); any other is refused, not ignored
QUERY_READ = {
    "/v1/infer": (frozenset({"tasks"}), "only ?tasks=a,b (truncate, window and the answer controls go in the JSON "
                                        "body)"),
    "/predict": (frozenset({"tasks"}), "only ?tasks=<task>, the task to answer"),
    "/": (frozenset({"tasks"}), "only ?tasks=<task>, the task a body of /predict's asks"),
}
NO_QUERY = (frozenset(), "no query parameters (what it reads goes in the JSON body)")
SHORT_QUERY = 256  # bytes: a query string this short has its reading remembered (`query_pairs`)


def check_query(scope) -> None:
    """400 for a query parameter the route does not read (`QUERY_READ`): a misspelt `?task=ner` would
    otherwise be ignored and every task answered, `/embed?normalize=false` answered normalized."""
    query = scope["query_string"]
    if query:
        names = {name for name, _ in query_pairs(query)}
        known, takes = QUERY_READ.get(scope["path"], NO_QUERY)
        unknown = sorted(names - known)
        if unknown:
            raise ApiError(400, "invalid_request", f"unknown query parameter(s) {clip_list(unknown)}"
                           f"{did_you_mean(unknown, known)}: {scope['path']} takes {takes}")


def query_pairs(query: bytes) -> tuple[tuple[str, str], ...]:
    """(name, value) of each parameter of a query string, in order; a short one's reading remembered
    (clients send the same few again and again)."""
    return _read_query(query) if len(query) <= SHORT_QUERY else _read_query.__wrapped__(query)


@functools.lru_cache(maxsize=256)
def _read_query(query: bytes) -> tuple[tuple[str, str], ...]:
    text = query.decode("latin-1")
    if "%" in text or "+" in text:  # percent-encoded: the standard reading
        return tuple(parse_qsl(text, keep_blank_values=True))
    return tuple((name, value) for name, _, value in (pair.partition("=") for pair in text.split("&") if pair))


def require_json(scope) -> None:
    """A body FastAPI would have read as JSON: no Content-Type, application/json or application/*+json."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            kind = value.split(b";", 1)[0].strip().lower()
            if kind not in JSON_TYPES and not (kind.startswith(b"application/") and kind.endswith(b"+json")):
                _, status = protocol_of(scope["path"])
                raise ApiError(status, "invalid_request", f"request is malformed: body: Content-Type "
                               f"{clip(kind.decode('latin-1'))} is not JSON (send application/json)")
            return
