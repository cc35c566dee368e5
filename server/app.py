"""The HTTP API. Decode -> validate -> run in the compute thread -> encode.

`TmodApp` is a FastAPI app (admin, task listing, health, tokenize, the OpenAPI schema) with one raw
ASGI layer in front (`TmodApp.__call__`) that every request passes: its request id (echoed, and on
every log line written while serving it), the body limits (server/http_limits.py `limit_body`), a
refusal in the protocol shape of its path (server/errors.py `refusal`) and the access line
(server/logs.py `AccessLog`, sampled at high rates). The inference routes (`/v1/infer`, OpenAI's
`/v1/embeddings`, TEI's `/embed`, OIP v2 `infer`) are answered in that layer, never by FastAPI: the
body is read once, decoded and validated in one pass into a msgspec struct (server/schemas.py), and
the answer encoded once into bytes; `/openapi.json` documents them from the same structs. Task names
are checked against one snapshot of the runtime's modules per request, so a module swapped
mid-request does not change what the request sees. `read_inputs` says where a request is tokenized."""
from __future__ import annotations

import asyncio
import contextvars
import functools
import hmac
import re
import time
from collections import Counter
from contextlib import asynccontextmanager
from typing import Any, Callable
from urllib.parse import parse_qsl

import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from modules_store import ModuleStore
from modules_store.manifest import NAME_PATTERN
from server import oip, oip_grpc, tokenize_api, windows
from server.backbone import Backbone
from server.batcher import Job
from server.classify_api import ClassifyRequest, ClassifyResponse, classify_routes
from server.config import Settings
from server.cors import Cors
from server.embeddings_api import (OpenAIEmbeddingRequest, OpenAIEmbeddingResponse, RerankRequest, RerankResponse,
                                   ScoreRequest, ScoreResponse, TEIEmbedRequest, TEIRank, TEIRerankRequest,
                                   TEISimilarityRequest,
                                   embedding_model_names, embedding_module, embeddings_routes, refuse_prompt, tei_info,
                                   tei_root)
from server.errors import (KSERVE_V1_PREDICT, ApiError, api_error_handler, clip, clip_list, did_you_mean,
                           error_content, http_error_handler, not_loaded, protocol_of, refusal, unknown_tasks,
                           validation_error_handler)
from server.http_limits import CYCLE, answer_whole, limit_body, read_body
from server.logs import AccessLog, request_id, request_id_for
from server.modules import LoadedModule, compares_pairs, reads_single_texts, token_limit
from server.predict_api import PredictRequest, PredictResponse, TEIPredictRequest, predict_route, tei_predict_route
from server.runtime import Runtime
from server.schemas import (DEFAULT_CONTROLS, AdminModules, AnswerControls, InferRequest, InferResponse, ModelInfo,
                            ModuleAction, ModuleActionResult, OpenAIModel, OpenAIModelList, RepositoryChangeRequest,
                            RepositoryIndexRequest, TaskDetail, TaskList, TeiDecodeRequest, TeiTokenizeRequest,
                            TokenizeRequest, VllmDetokenizeRequest, VllmDetokenizeResponse, VllmTokenizeRequest,
                            VllmTokenizeResponse, decode, probe,
                            openapi_components)


# A request this short is tokenized on the event loop: the hand-off to a tokenizer thread and back
# costs more CPU than its tokenization (bench/bench_frontend.py --workers, issues 25 and 37: at 1,000
# characters, 32-text requests of ~1,700 went to a thread and cost the workers and the engine more per
# text). At the limit a request holds the loop 1.8-2.8 ms (2-core EPYC). Past it, a thread: the tokenizer's
# batch call releases the GIL, so on a host with cores to spare a longer request is read beside the loop.
INLINE_TOKENIZE_CHARS = 4096
# C0/C1 controls other than tab, newline and carriage return never belong in text to analyse
CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


JSON_TYPES = (b"application/json",)
# what stays open with an API key set: probes, scrapers and the schema (module changes have their own token)
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/health", "/v2/health/live", "/v2/health/ready", "/metrics", "/docs",
                        "/docs/oauth2-redirect", "/openapi.json", "/redoc"})
# the routes that change modules: the admin token guards them (in the same Authorization header), not the API key
ADMIN_PATHS = ("/admin/", "/v2/repository/models/")
NO_HEADERS: dict[str, str] = {}
OIP_INFER = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")


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


class TmodApp(FastAPI):
    """FastAPI, with the raw ASGI layer every request passes first (see the module docstring)."""

    fast_routes: dict  # path -> handler(body, request) -> (answer bytes, headers): the inference routes
    oip_infer = None  # handler(body, request, task, version)
    v1_predict = None  # handler(body, request, task, verb): KServe's V1 :predict

    def configure(self, settings: Settings) -> None:
        self.body_limit, self.body_timeout_s = settings.max_body_bytes, settings.body_timeout_s
        self.access = AccessLog(settings.access_log_per_s)
        self.api_keys = tuple(key.encode() for key in settings.api_keys()) or None
        self.cors = Cors(settings.cors_origins) if settings.cors_origins else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # lifespan
            return await super().__call__(scope, receive, send)
        rid = request_id_for(scope["headers"])
        token = request_id.set(rid)
        started, reply = time.perf_counter(), Reply(send, rid, scope.get(CYCLE))
        path, served = scope["path"], scope
        try:
            if self.cors is not None and (origin := self.cors.allowed_origin(scope["headers"])) is not None:
                reply.extra = self.cors.answer_headers(origin)
                if scope["method"] == "OPTIONS" and (preflight := self.cors.preflight_headers(scope["headers"])):
                    return await reply.whole(200, b"", preflight)  # before the key: a browser sends none here
            if self.api_keys is not None and path not in OPEN_PATHS and not path.startswith(ADMIN_PATHS) \
                    and not bearer_matches(scope["headers"], *self.api_keys):
                raise ApiError(401, "unauthorized", "this server needs 'Authorization: Bearer <API key>'",
                               headers={"www-authenticate": "Bearer"})
            scope, receive = limit_body(scope, receive, self.body_limit, self.body_timeout_s)
            if scope["method"] == "HEAD":  # as GET: HTTP servers must answer HEAD where they answer GET (RFC
                scope = {**scope, "method": "GET"}  # 9110, 9.1); uvicorn's scope, still HEAD, sends no body
            handler = self.fast_routes.get(path)
            if handler is not None and not (path == "/" and scope["method"] == "GET"):  # TEI's root: GET is health
                await self.answer(handler, (), scope, receive, reply)
            elif path.startswith("/v2/models/") and (found := OIP_INFER.fullmatch(path)):
                await self.answer(self.oip_infer, found.groups(), scope, receive, reply)
            elif path.startswith("/v1/models/") and (found := KSERVE_V1_PREDICT.fullmatch(path)):
                await self.answer(self.v1_predict, found.groups(), scope, receive, reply)
            else:
                await super().__call__(scope, receive, reply)
        except Exception as exc:  # noqa: BLE001 - every failure is answered in the route's shape
            if reply.status is not None:
                if not reply.complete:
                    raise  # an answer cut off midway: the server closes the connection
                # answered already: a FastAPI route's error, answered by `api_error_handler` and raised on
            else:
                inference = path in self.fast_routes or any(route.fullmatch(path)
                                                             for route in (OIP_INFER, KSERVE_V1_PREDICT))
                status, headers, content = refusal(self, path, exc, inference)
                await reply.whole(status, content, headers)
        finally:
            self.access.write(served, reply.status or 500, time.perf_counter() - started)
            request_id.reset(token)
            # uvicorn's cycle holds the scope and tmod's protocol put the cycle in it (CYCLE): unlinked here,
            # the cycle, its scope, headers and event go by reference counting, not left to the garbage
            # collector (9 objects a request found in its garbage in a worker under load, issue 37)
            served.pop(CYCLE, None)

    async def answer(self, handler, params, scope, receive, reply: "Reply") -> None:
        """An inference route: POST only, its body read once, its answer sent as bytes."""
        if scope["method"] != "POST":
            raise ApiError(405, "method_not_allowed", "Method Not Allowed", headers={"allow": "POST"})
        if handler is not self.oip_infer:  # OIP reads any body (its binary extension included)
            require_json(scope)
        body = await read_body(receive)
        content, headers = await handler(body, Call(scope, receive), *params)
        await reply.whole(200, content, headers)


class Reply:
    """A request's answer on its way out. Called, it is the ASGI `send` the FastAPI routes get; every
    answer carries the request id; it keeps the status once the answer began and whether it was sent
    whole. `whole` answers with bytes made here: through uvicorn's cycle at once where tmod's protocol
    serves the request (server/http_limits.py `answer_whole`), else as two ASGI messages."""

    __slots__ = ("send", "rid", "cycle", "status", "complete", "extra")

    def __init__(self, send, rid: str, cycle):
        self.send, self.rid, self.cycle = send, rid, cycle
        self.status: int | None = None
        self.complete = False
        self.extra: dict[str, str] = NO_HEADERS  # on every answer: CORS headers (server/cors.py)

    async def __call__(self, message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            message["headers"] = [*message.get("headers", ()), (b"x-request-id", self.rid.encode()),
                                  *((k.encode(), v.encode()) for k, v in self.extra.items())]
        elif not message.get("more_body", False):
            self.complete = True
        await self.send(message)

    async def whole(self, status: int, content: bytes, headers: dict[str, str]) -> None:
        """One answer: JSON unless `headers` names its content-type. `headers`: names in lower case,
        values the app made (numbers, constants): nothing a client sent but the checked request id and
        the CORS values server/cors.py checked (an allowed origin, a list of header names)."""
        if self.cycle is not None:  # (through `respond`, the extra headers are added where it sends, above)
            lines = (f"content-length: {len(content)}\r\n"
                     + ("" if "content-type" in headers else "content-type: application/json\r\n")
                     + "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
                     + "".join([f"{name}: {value}\r\n" for name, value in self.extra.items()])
                     + f"x-request-id: {self.rid}\r\n").encode("latin-1")
            if answer_whole(self.cycle, status, lines, content):
                self.status, self.complete = status, True
                return
        await respond(self, status, content, headers)


class Call:
    """What an inference route reads of its request besides the body."""

    __slots__ = ("scope", "receive", "gone")

    def __init__(self, scope, receive):
        self.scope, self.receive, self.gone = scope, receive, False

    def header(self, name: bytes) -> str | None:
        for key, value in self.scope["headers"]:
            if key == name:
                return value.decode("latin-1")
        return None

    def query(self, name: str) -> tuple[str, ...]:
        """The values of `name` in the query string, in order (`?tasks=a&tasks=b`: both)."""
        query = self.scope["query_string"]
        if len(query) <= SHORT_QUERY:  # clients send the same few again and again
            return query_values(query, name)
        return query_values.__wrapped__(query, name)

    def check_query(self, known: frozenset[str], route: str, takes: str) -> None:
        """400 for a query parameter the route does not read: a misspelt `?task=ner` would otherwise
        be ignored, and every task answered."""
        query = self.scope["query_string"]
        if query:
            names = query_names(query) if len(query) <= SHORT_QUERY else query_names.__wrapped__(query)
            unknown = sorted(names - known)
            if unknown:
                raise ApiError(400, "invalid_request", f"unknown query parameter(s) {clip_list(unknown)}"
                               f"{did_you_mean(unknown, known)}: {route} takes {takes}")

    async def is_disconnected(self) -> bool:
        """Whether the client left. Its body is read, so the next ASGI message is a disconnect: one step
        of `receive` tells whether it is there without waiting (Starlette's check, an anyio cancel scope
        per call, cost ~100 us of CPU)."""
        if not self.gone:
            step = self.receive()
            try:
                step.send(None)
            except StopIteration as done:
                self.gone = done.value["type"] == "http.disconnect"
            else:
                step.close()  # it would wait: the client is still there
        return self.gone


INFER_QUERY = frozenset({"tasks"})
SHORT_QUERY = 256  # bytes: a query string this short has its reading remembered (`query_values`)


@functools.lru_cache(maxsize=256)
def query_values(query: bytes, name: str) -> tuple[str, ...]:
    """The values of `name` in a query string, in order."""
    text = query.decode("latin-1")
    if "%" in text or "+" in text:  # percent-encoded: the standard reading
        return tuple(v for k, v in parse_qsl(text, keep_blank_values=True) if k == name)
    return tuple(v for k, _, v in (pair.partition("=") for pair in text.split("&")) if k == name)


@functools.lru_cache(maxsize=256)
def query_names(query: bytes) -> frozenset[str]:
    """The parameter names in a query string."""
    return frozenset(name for name, _ in parse_qsl(query.decode("latin-1"), keep_blank_values=True))


async def respond(send, status: int, content: bytes, headers: dict[str, str]) -> None:
    """One answer: its head (JSON unless `headers` says otherwise) and its body."""
    head = [(b"content-length", str(len(content)).encode())]
    if "content-type" not in headers:
        head.append((b"content-type", b"application/json"))
    head += [(name.encode(), value.encode()) for name, value in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": content})


def bearer_matches(headers, *secrets: bytes) -> bool:
    """Whether the request says `Authorization: Bearer <one of secrets>` (each compared in constant
    time, every one compared: the time does not say which matched)."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            token = token.strip()
            return scheme.lower() == b"bearer" and sum(hmac.compare_digest(token, secret) for secret in secrets) > 0
    return False


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


def create_app(settings: Settings | None = None, backbone: Backbone | None = None, runtime=None) -> TmodApp:
    """The app over `runtime`: by default a Runtime in this process (backbone, modules, batcher);
    in an HTTP worker process a `server.workers.RemoteRuntime` (the same interface) that forwards to
    the engine process."""
    settings = settings or Settings()
    runtime = runtime or Runtime(settings, backbone)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await runtime.open()
        grpc_server = None
        if settings.grpc_port is not None:  # OIP over gRPC beside HTTP, in each process that serves HTTP
            health = oip_grpc.Health(require_serving)
            grpc_server = await oip_grpc.start(app.grpc_service, health, settings.host, settings.grpc_port,
                                               settings.max_body_bytes)
        yield
        if grpc_server is not None:
            health.stopping = True  # NOT_SERVING from now on; open watches are told and end
            await grpc_server.stop(grace=settings.request_timeout_s)  # calls under way are answered
        await runtime.shutdown()

    app = TmodApp(
        title="tmod", version="0.1.0", lifespan=lifespan,
        description="Multi-task NLP inference: one frozen backbone pass feeds every requested task head.",
    )
    app.configure(settings)
    app.state.runtime = runtime
    app.state.retry_after_s = settings.retry_after_s
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(Exception, api_error_handler)  # a 500 in the protocol's shape, its traceback logged
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    metrics = runtime.metrics

    def model_info() -> ModelInfo:
        name, fingerprint = runtime.model_info()
        return ModelInfo(backbone=name, fingerprint=fingerprint)

    def require_ready() -> None:
        if not runtime.ready.is_set():
            detail = runtime.startup_error or "the backbone and modules are still loading"
            raise ApiError(503, "not_ready", f"server not ready: {detail}")

    def select_modules(tasks: str | None) -> dict[str, LoadedModule]:
        loaded = runtime.modules  # one snapshot for the whole request
        if tasks is None:
            if not loaded:
                raise ApiError(503, "no_modules", f"no task modules are loaded (store: {settings.store})")
            return dict(loaded)
        names = task_names(tasks)
        unknown = [n for n in names if n not in loaded]
        if unknown:
            raise unknown_tasks(unknown, loaded, runtime.load_errors, runtime.skipped)
        return {n: loaded[n] for n in names}

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

    # a request's modules by (tasks, pairs), and each such dict's task types and token limit: clients send
    # the same few task lists again and again, so these are worked out once per snapshot of the loaded
    # modules (forgotten when a module changes), not once per request
    planned: dict[tuple, dict[str, LoadedModule]] = {}
    traits: dict[int, tuple] = {}  # id(modules) -> (modules, task types, token limit): held, so an id is not reused
    planned_for = None  # the snapshot both were made against

    def current_modules() -> None:
        nonlocal planned_for
        if runtime.modules is not planned_for:
            planned.clear()
            traits.clear()
            planned_for = runtime.modules

    def modules_for(tasks: str | None, has_pairs: bool) -> dict[str, LoadedModule]:
        """`fit_to_inputs(select_modules(tasks), ...)`, remembered (a refusal is not)."""
        current_modules()
        found = planned.get((tasks, has_pairs))
        if found is None:
            found = fit_to_inputs(select_modules(tasks), has_pairs, named=tasks is not None)
            if len(planned) >= 1024:  # task lists a client makes up: the table stays small
                planned.clear()
            planned[tasks, has_pairs] = found
        return found

    def modules_traits(modules: dict) -> tuple[frozenset, int | None]:
        """`modules`' task types and token limit (`token_limit`), remembered per modules dict."""
        current_modules()
        found = traits.get(id(modules))
        if found is None or found[0] is not modules:
            if len(traits) >= 1024:
                traits.clear()
            found = traits[id(modules)] = (modules, frozenset(task_types(modules)),
                                           token_limit(modules, settings.max_tokens))
        return found[1], found[2]

    async def run_inference(texts: list[str], text_pairs: list[str] | None, modules: dict[str, LoadedModule],
                            truncate: bool, request: Call, window: int | None = None, stride: int | None = None,
                            controls: AnswerControls | None = None,
                            names: Callable[[int], str] | None = None) -> tuple[list[dict], Job, dict[str, str]]:
        """Shared by every protocol: limits, tokenization (long texts in windows), the batcher, metrics,
        timing headers. `controls`: the request's answer controls (docs/answer-controls.md); `names`: text i's
        name in a refusal where the protocol's fields are not one list of inputs (default "input i").
        -> (per-input results keyed by task, the job (one row per input, the module versions that answered,
        per input its `windows`), response headers)."""
        metrics.in_flight(1)
        try:
            return await answer_inference(texts, text_pairs, modules, truncate, request, window, stride,
                                          controls or DEFAULT_CONTROLS, names)
        finally:
            metrics.in_flight(-1)

    def check_inputs(texts: list[str], text_pairs: list[str] | None,
                     names: Callable[[int], str] | None = None) -> None:
        """The limits and checks every text meets before it is tokenized (413 / 422); `names(i)`: text i's
        name in the request (default "input i")."""
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

    # what window_settings answered, by its arguments and the encoder itself (a worker's encoder is replaced
    # when the engine sends a new one; the key holds the old one, so its id cannot be reused by the next)
    chosen_windows: dict[tuple, windows.WindowSettings] = {}

    def window_settings(window: int | None, stride: int | None, max_tokens: int | None = None,
                        task_types=()) -> windows.WindowSettings:
        key = (window, stride, max_tokens, frozenset(task_types), runtime.text)
        found = chosen_windows.get(key)
        if found is None:
            task_window = windows.measured_window(runtime.model_info()[0], task_types) if task_types else None
            found = windows.settings_for(runtime.text, max_tokens or settings.max_tokens, window, stride,
                                         settings.window_tokens, settings.window_stride, task_window)
            if len(chosen_windows) >= 1024:  # windows and strides a client names: the table stays small
                chosen_windows.clear()
            chosen_windows[key] = found
        return found

    def task_types(modules: dict) -> set[str]:
        return {m.manifest.task_type.value for m in modules.values() if m.manifest is not None}

    inline = IterationTokenizer()

    async def read_inputs(texts, text_pairs, truncate, window, stride, max_tokens=None, modules=None,
                          budget: int | None = None, names: Callable[[int], str] | None = None) -> windows.Reading:
        """Tokenize (a long request in a tokenizer thread) and cut long texts into windows (server/windows.py) of at
        most `max_tokens` word pieces (default: the server's limit), by default as measured best for `modules`;
        413 past `budget` word pieces in all, found before the whole request is tokenized."""
        check_inputs(texts, text_pairs, names)
        # a truncated text is read in one row, as long as the backbone reads: the measured (shorter) reading
        # windows of a task type pay off only where a whole text is read in overlapping windows
        chosen = window_settings(window, stride, max_tokens, () if truncate or not modules else modules_traits(modules)[0])
        read = functools.partial(windows.read, runtime.text, texts, text_pairs, chosen, truncate, budget)
        try:
            if sum(map(len, texts)) + sum(map(len, text_pairs or ())) <= INLINE_TOKENIZE_CHARS:
                return await inline.read(read)
            return await asyncio.get_running_loop().run_in_executor(runtime.tokenize_executor, read)
        except windows.PairTooLong as exc:
            raise ApiError(413, "input_too_long", str(exc)) from exc
        except windows.TooManyTokens as exc:
            raise ApiError(413, "too_many_tokens", str(exc), tokens=exc.tokens, token_budget=exc.budget) from exc

    async def answer_inference(texts, text_pairs, modules, truncate, request, window=None, stride=None,
                               controls: AnswerControls | None = None, names: Callable[[int], str] | None = None):
        received = time.perf_counter()
        deadline = received + settings.request_timeout_s  # one per request, shared by all its parts
        controls = controls or DEFAULT_CONTROLS
        if truncate and controls.truncation_direction == "left":
            if text_pairs is not None:
                raise ApiError(422, "invalid_request", "truncation_direction 'left' is for single texts, not text pairs")
            truncate = "left"  # the tokenizer keeps the end of the text (server/backbone/tokens.py)
        reading = await read_inputs(texts, text_pairs, truncate, window, stride, modules_traits(modules)[1], modules,
                                    settings.max_request_tokens, names)
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
        metrics.record_answer((("queue", queue), ("tokenize", timings.tokenize), ("backbone", timings.backbone),
                               ("heads", timings.heads), ("total", total)), len(texts), modules)
        headers = {
            "x-queue-time": queue, "x-tokenization-time": timings.tokenize, "x-backbone-time": timings.backbone,
            "x-heads-time": timings.heads, "x-inference-time": timings.backbone + timings.heads, "x-total-time": total,
        }
        return results, job, {name: f"{seconds * 1000:.3f}" for name, seconds in headers.items()}

    async def infer(body: bytes, request: Call) -> tuple[bytes, dict]:
        require_ready()
        asked = decode(InferRequest, body)
        request.check_query(INFER_QUERY, "/v1/infer", "only ?tasks=a,b (truncate, window and the answer controls "
                            "go in the JSON body)")
        named = request.query("tasks")  # ?tasks=a&tasks=b asks for both: the lists are joined
        tasks = ",".join(named) if named else None
        pairs = not isinstance(asked.inputs[0], str)
        modules = modules_for(tasks, pairs)
        texts = [item.text for item in asked.inputs] if pairs else asked.inputs
        text_pairs = [item.text_pair for item in asked.inputs] if pairs else None
        results, job, headers = await run_inference(texts, text_pairs, modules, asked.truncate, request,
                                                    asked.window, asked.stride, asked)
        return msgspec.json.encode(InferResponse(
            results=results, model=model_info(), tasks={t: m.version for t, m in job.modules.items()},
            truncated=[i for i, row in enumerate(job.rows) if row.truncated], windows=job.windows,
        )), headers

    # ---- admin: hot module management --------------------------------------------------------
    def require_admin(request: Request) -> None:
        if not settings.admin_token:
            raise ApiError(403, "admin_disabled", "the admin API is disabled: set TMOD_ADMIN_TOKEN to enable it")
        if not bearer_matches(request.scope["headers"], settings.admin_token.encode()):
            raise ApiError(401, "unauthorized", "admin endpoints need 'Authorization: Bearer <admin token>'")

    def require_module_changes(request: Request) -> None:
        """The admin routes' common gate: the token, one engine, the backbone loaded."""
        require_admin(request)
        if settings.engines > 1:  # each engine holds its own modules: a change would reach the one that took it
            raise ApiError(409, "several_engines", f"module changes through /admin are off with --engines "
                           f"{settings.engines}: each engine process holds its own modules, and this request would "
                           "change only the one that took it; change --tasks or the store and restart the server "
                           "(in Kubernetes, a rolling restart)")
        require_ready()

    async def change_module(request: Request, task: str, action: str, version: str | None, version_goes: str):
        """/admin's module change, and Triton's repository load and unload: the admin token, then the store."""
        require_module_changes(request)
        if request.query_params:  # `?version=2` was ignored, and the latest loaded in its place
            names = sorted(request.query_params)
            raise ApiError(400, "invalid_request", f"unknown query parameter(s) {clip_list(names)}: "
                           f"{request.url.path} takes none; {version_goes}")
        if not NAME_PATTERN.fullmatch(task):  # it names a folder of the store: nothing else may reach the disk
            raise ApiError(400, "invalid_name", f"task {clip(task)} is not a module name: use 1-64 of a-z, 0-9, "
                                                "'_' and '-', starting with a letter or digit")
        return await runtime.manage(task, action, version)

    @app.get("/admin/modules", response_model=AdminModules, tags=["admin"], responses={401: {}, 403: {}, 409: {}})
    async def admin_modules(request: Request):
        """Where this server loads modules from and what it serves: what `tmod-train --load-into` checks
        before training (the token, the store it writes to, the backbone it trains on)."""
        require_module_changes(request)
        return AdminModules(store=str(settings.store.resolve()), backbone=msgspec.structs.asdict(model_info()),
                            tasks={task: module.version for task, module in sorted(runtime.modules.items())},
                            modules_of=runtime.modules_of(), api_key=bool(settings.api_keys()),
                            not_served=dict(sorted(runtime.skipped.items())))

    @app.post("/admin/modules/{task}/{action}", response_model=ModuleActionResult, tags=["admin"],
              responses={400: {}, 401: {}, 403: {}, 404: {}, 409: {}})
    async def manage_module(task: str, action: str, request: Request, body: ModuleAction | None = None):
        """load: load or replace with a store version (default: the latest for this backbone); reload: read the loaded
        version (or the one named) again from the store; unload: stop serving the task.
        A refused artifact (checksum, fingerprint, shapes) answers 409 and changes nothing."""
        module, previous = await change_module(request, task, action, body.version if body else None,
                                               'a version goes in the JSON body: {"version": "2"}')
        if action == "unload":
            return ModuleActionResult(task=task, action=action, version=module.version)
        return ModuleActionResult(task=task, action=action, version=module.version, previous_version=previous)

    @app.get("/v1/tasks", response_model=TaskList, tags=["tasks"])
    async def list_tasks():
        require_ready()
        return {"tasks": [runtime.describe(m) for _, m in sorted(runtime.modules.items())],
                "backbone": msgspec.structs.asdict(model_info()),
                "windows": {**window_settings(None, None).describe(), "window_by_task_type": {
                    kind: window_settings(None, None, None, [kind]).window for kind in sorted(task_types(runtime.modules))}}}

    @app.get("/v1/tasks/{name}", response_model=TaskDetail, tags=["tasks"], responses={404: {}})
    async def get_task(name: str):
        require_ready()
        module = runtime.modules.get(name)
        if module is None:
            why = not_loaded([name], runtime.load_errors, runtime.skipped)
            raise ApiError(404, "unknown_task", f"no task {clip(name)}{why}; loaded tasks: {sorted(runtime.modules)}",
                           loaded_tasks=sorted(runtime.modules))
        # not its training record: the command, file paths, store and machine of whoever trained it are
        # the operator's (the store's manifest.json), not every client's
        return {**runtime.describe(module), "manifest": module.manifest.model_dump(mode="json", exclude={"training"})}

    # ---- OpenAI's model list: the names /v1/embeddings takes -----------------------------------
    started_s = int(time.time())

    @app.get("/v1/models", response_model=OpenAIModelList, tags=["embeddings"], responses={503: {}})
    async def openai_models():
        """OpenAI's model list (`client.models.list()`): each embedding task, then the backbone's name."""
        require_ready()
        return OpenAIModelList(data=[OpenAIModel(id=name, created=started_s) for name in embedding_model_names(runtime)])

    @app.get("/v1/models/{model:path}", response_model=OpenAIModel, tags=["embeddings"], responses={404: {}, 503: {}})
    async def openai_model(model: str):
        """One name of the list (`client.models.retrieve(name)`); 404 in OpenAI's shape for any other. The
        path is KServe V1's model readiness too: OpenAI's answer is kept (a task is no embedding model),
        and the 404 of a served task says where KServe's readiness is."""
        require_ready()
        try:
            embedding_module(runtime, model)
        except ApiError as exc:
            if model not in runtime.modules:
                raise
            raise ApiError(404, exc.type, f"{exc.message}; {model!r} is a task: KServe V1 clients predict at POST "
                           f"/v1/models/{model}:predict and ask its readiness at GET /v2/models/{model}/ready",
                           **exc.details) from None
        return OpenAIModel(id=model, created=started_s)

    # ---- Open Inference Protocol v2 (KServe / Triton clients) --------------------------------
    def oip_module(task: str, version: str | None = None) -> LoadedModule:
        module = runtime.modules.get(task)
        if module is None:
            why = not_loaded([task], runtime.load_errors, runtime.skipped)
            raise ApiError(404, "unknown_task", f"no model {clip(task)}{why}; loaded: {sorted(runtime.modules)}",
                           loaded_tasks=sorted(runtime.modules))
        if version is not None and version != module.version:
            raise ApiError(404, "unknown_version", f"model {task!r} serves version {module.version}, not {clip(version)}")
        return module

    @app.get("/v2", tags=["oip-v2"])
    async def oip_server_metadata():
        return {"name": "tmod", "version": app.version,
                "extensions": ["binary_tensor_data", "classification", "model_configuration", "model_repository"]}

    @app.get("/v2/health/live", tags=["oip-v2"])
    async def oip_live():
        return {"live": True}

    def no_modules() -> ApiError:
        return ApiError(503, "no_modules", f"no task modules are loaded (store: {settings.store}); load one through "
                                           "/admin", refused=runtime.load_errors)

    def require_serving() -> None:
        """Ready to answer inference: the backbone loaded and at least one module (an operator who
        unloaded every module took the server out of service; it is still ready for /admin)."""
        require_ready()
        if not runtime.modules:
            raise no_modules()

    @app.get("/v2/health/ready", tags=["oip-v2"], responses={503: {}})
    async def oip_ready():
        require_serving()
        return {"ready": True}

    # before the model routes (/v2/models/stats is no model called "stats"); a refusal, not in the schema
    @app.get("/v2/models/stats", include_in_schema=False)
    @app.get("/v2/models/{task}/stats", include_in_schema=False)
    @app.get("/v2/models/{task}/versions/{version}/stats", include_in_schema=False)
    async def oip_statistics(task: str | None = None, version: str | None = None):
        """Triton's statistics extension (tritonclient's `get_inference_statistics`) is not served: its
        counts are per model and per batch, and tmod's passes serve every task at once. Said, with where
        tmod's own counts are, instead of a bare 404 (or "no model 'stats'")."""
        raise ApiError(404, "not_found", oip.STATISTICS_REFUSED)

    @app.get("/v2/models/{task}", tags=["oip-v2"], responses={404: {}})
    @app.get("/v2/models/{task}/versions/{version}", tags=["oip-v2"], responses={404: {}})
    async def oip_model_metadata(task: str, version: str | None = None):
        require_ready()
        return oip.model_metadata(oip_module(task, version))

    @app.get("/v2/models/{task}/config", tags=["oip-v2"], responses={404: {}})
    @app.get("/v2/models/{task}/versions/{version}/config", tags=["oip-v2"], responses={404: {}})
    async def oip_model_config(task: str, version: str | None = None):
        """Triton's model configuration extension (tritonclient's `get_model_config`)."""
        require_ready()
        return oip.model_config(oip_module(task, version))

    @app.post("/v2/repository/index", tags=["oip-v2"])
    async def oip_repository_index(request: Request):
        """Triton's repository index (tritonclient's `get_model_repository_index`): each served task READY,
        each other task of the store UNAVAILABLE with why (left out or refused at start-up, or not loaded);
        `{"ready": true}` asks the READY ones only. Loading and unloading: the routes below, or /admin."""
        require_ready()
        body = await request.body()
        return repository_index(decode(RepositoryIndexRequest, body or b"{}", protocol_of(request.url.path)[1]).ready)

    def repository_index(ready_only: bool) -> list[dict]:
        """The repository index, over HTTP and gRPC: the served tasks, then (unless `ready_only`) the others."""
        index = [{"name": task, "version": module.version, "state": "READY", "reason": ""}
                 for task, module in sorted(runtime.modules.items())]
        if not ready_only:
            left_out = {**runtime.skipped, **runtime.load_errors}
            for task in ModuleStore(settings.store).tasks():
                left_out.setdefault(task, f"not loaded (not named in --tasks, unloaded, or added to the store since "
                                          f"start-up): POST /v2/repository/models/{task}/load (or /admin's) serves it")
            index += [{"name": task, "state": "UNAVAILABLE", "reason": why} for task, why in sorted(left_out.items())
                      if task not in runtime.modules]
        return index

    @app.post("/v2/repository/models/{task}/load", tags=["oip-v2"],
              responses={400: {}, 401: {}, 403: {}, 404: {}, 409: {}})
    @app.post("/v2/repository/models/{task}/unload", tags=["oip-v2"], responses={400: {}, 401: {}, 403: {}, 404: {}})
    async def oip_repository_change(task: str, request: Request):
        """Triton's repository load and unload (tritonclient's `load_model`, `unload_model`): /admin's load
        and unload, with its token (`Authorization: Bearer`, tritonclient's `headers=`). Load serves the
        store's latest version for this backbone, or `{"parameters": {"version": "2"}}`; a model
        configuration or files sent with the request are refused (tmod loads the store's artifacts)."""
        action = request.url.path.rsplit("/", 1)[1]
        body = await request.body()
        parameters = decode(RepositoryChangeRequest, body or b"{}", protocol_of(request.url.path)[1]).parameters
        known = {"load": {"version"}, "unload": {"unload_dependents"}}[action]
        sent = [name for name in parameters if name not in known]
        if sent:
            sent_files = any(name == "config" or name.startswith("file:") for name in sent)
            raise ApiError(400, "invalid_request", f"parameter(s) {clip_list(sent)} not read: "
                           + ("tmod loads the store's artifacts, not a configuration or files sent with the request "
                              "(write the module into the store, e.g. tmod-train --store, and load it by name)"
                              if sent_files else f"{action} takes {sorted(known)}{did_you_mean(sent, known)}"))
        version = parameters.get("version")
        if version is not None and not isinstance(version, str):
            raise ApiError(400, "invalid_request", "parameter 'version' is a string, e.g. \"2\"")
        await change_module(request, task, action, version,
                            'a version goes in the JSON body: {"parameters": {"version": "2"}}')
        return Response(status_code=200)

    @app.get("/v2/models/{task}/ready", tags=["oip-v2"], responses={404: {}})
    @app.get("/v2/models/{task}/versions/{version}/ready", tags=["oip-v2"], responses={404: {}})
    async def oip_model_ready(task: str, version: str | None = None):
        require_ready()
        module = oip_module(task, version)
        return {"name": module.task, "version": module.version, "ready": True}

    async def oip_answer(module: LoadedModule, read: tuple, request) -> tuple[LoadedModule, list, dict]:
        """An OIP inference request, read (`oip.read_request`) over HTTP or gRPC, answered: (the module
        version that answered, each text's answer, the timing headers). `request`: its `is_disconnected`."""
        parsed, texts, text_pairs, shape = read
        task = module.task
        oip.check_declared_inputs(module, text_pairs)
        fit_to_inputs({task: module}, text_pairs is not None, named=True)
        parameters = parsed.get("parameters") or {}
        truncate = oip.bool_parameter(parameters, "truncate")
        window, stride = (windows.whole_number(parameters, name) for name in ("window", "stride"))
        controls = oip.answer_controls(parsed)
        # top_k reaches OIP clients as the classification extension on `scores`: decode every label
        decoded = msgspec.structs.replace(controls, top_k=None)
        results, job, headers = await run_inference(texts, text_pairs, {task: module}, truncate, request, window, stride,
                                                    decoded)
        module = job.modules[task]  # the version that answered
        return module, oip.response_tensors(module, parsed, [r[task] for r in results], controls.top_k, shape), headers

    async def oip_infer(body: bytes, request: Call, task: str, version: str | None) -> tuple[bytes, dict]:
        """Body: OIP v2 JSON, or the binary data extension (Inference-Header-Content-Length)."""
        require_ready()
        module = oip_module(task, version)
        read = oip.parse_request(body, request.header(oip.HEADER.encode()))
        module, tensors, headers = await oip_answer(module, read, request)
        content, extra = oip.encode_response(module, read[0], tensors)
        return content, {**headers, **extra}

    # ---- tokenization: what the server reads (server/windows.py) --------------------------------
    # An answer is ~25 bytes of JSON per character read: its size is capped (max_tokenize_chars) and it
    # is built and serialised in a tokenizer thread, so the event loop (and /healthz) never waits on it.
    def check_tokenize_size(texts: list[str], text_pairs: list[str] | None) -> None:
        characters = sum(map(len, texts)) + sum(map(len, text_pairs or ()))
        if characters > settings.max_tokenize_chars:
            raise ApiError(413, "too_many_characters",
                           f"the request is {characters} characters; at most {settings.max_tokenize_chars} per "
                           "tokenize request (send fewer or shorter texts)",
                           characters=characters, limit=settings.max_tokenize_chars)

    async def json_answer(build) -> Response:
        """`build()`'s answer as JSON bytes, built and serialised in a tokenizer thread."""
        content = await asyncio.get_running_loop().run_in_executor(
            runtime.tokenize_executor, lambda: msgspec.json.encode(build()))
        return Response(content=content, media_type="application/json")

    async def json_body(request: Request) -> bytes:
        require_json(request.scope)
        return await request.body()

    async def body_of(kind: type, request: Request):
        return decode(kind, await json_body(request), protocol_of(request.url.path)[1])

    @app.post("/v1/tokenize", tags=["tokenize"], responses={413: {}, 422: {}, 503: {}},
              openapi_extra=request_body(TokenizeRequest))
    async def tokenize(request: Request):
        """The word pieces of each input with their character offsets, and the windows the server would
        read it in (with this request's `window` / `stride`, or the defaults). At most `max_tokenize_chars`
        characters per request (413 above)."""
        require_ready()
        body = await body_of(TokenizeRequest, request)
        items = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        if items and len({isinstance(item, str) for item in items}) > 1:
            raise ApiError(422, "invalid_request", "inputs must be all texts or all {text, text_pair} objects")
        pairs = bool(items) and not isinstance(items[0], str)
        texts = [item.text if pairs else item for item in items]
        text_pairs = [item.text_pair for item in items] if pairs else None
        check_tokenize_size(texts, text_pairs)
        reading = await read_inputs(texts, text_pairs, False, body.window, body.stride)
        chosen = {k: v for k, v in window_settings(body.window, body.stride).describe().items() if k != "rules"}
        return await json_answer(lambda: {
            "results": [tokenize_api.describe(runtime.text, text, body.add_special_tokens) for text in reading.texts],
            **chosen})

    @app.post("/tokenize", tags=["tokenize"], responses={400: {}, 404: {}, 413: {}, 422: {}, 503: {}},
              openapi_extra=request_body(TeiTokenizeRequest))
    async def tei_tokenize(request: Request):
        """Text Embeddings Inference's route: `[[{id, text, special, start, stop}]]` per input (character
        offsets; special tokens have no offsets). At most `max_tokenize_chars` characters per request.
        A body with `prompt` (VllmTokenizeRequest) is vLLM's tokenize, answered VllmTokenizeResponse,
        its errors in OpenAI's shape."""
        require_ready()
        raw = await json_body(request)
        sent = probe(raw)
        if sent.has("prompt") or sent.has("messages"):  # vLLM's body
            try:
                return await vllm_tokenize(decode(VllmTokenizeRequest, raw, 400))
            except ApiError as exc:
                exc.protocol = "/detokenize"  # vLLM's
                raise
        body = decode(TeiTokenizeRequest, raw, protocol_of(request.url.path)[1])
        refuse_prompt(body.prompt_name)
        texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        check_tokenize_size(texts, None)
        reading = await read_inputs(texts, None, False, None, None)
        return await json_answer(lambda: [tokenize_api.tei_tokens(runtime.text, text.whole, body.add_special_tokens)
                                          for text in reading.texts])

    def served_model(model: str | None) -> None:
        """vLLM's `model`: the backbone's name or a loaded task's (one tokenizer reads for all), else 404."""
        if model is not None and model != runtime.model_info()[0] and model not in runtime.modules:
            raise ApiError(404, "model_not_found", f"no model {clip(model)}: this server's tokenizer is the "
                           f"backbone's, {runtime.model_info()[0]!r} (or name a loaded task)", param="model")

    async def vllm_tokenize(asked: VllmTokenizeRequest) -> Response:
        served_model(asked.model)
        if not asked.prompt.strip():  # vLLM answers no word pieces (or only the special ones)
            ids = [] if not asked.add_special_tokens else tokenize_api.text_ids(runtime.text.encode([""])[0], True)
        else:
            check_tokenize_size([asked.prompt], None)
            reading = await read_inputs([asked.prompt], None, False, None, None, names=lambda i: "prompt")
            ids = tokenize_api.text_ids(reading.texts[0].whole, asked.add_special_tokens)
        strs = runtime.text.tokenizer.convert_ids_to_tokens(ids) if asked.return_token_strs else None
        return Response(msgspec.json.encode(VllmTokenizeResponse(len(ids), runtime.text.max_tokens, ids, strs)),
                        media_type="application/json")

    @app.post("/detokenize", tags=["tokenize"], responses={400: {}, 404: {}, 413: {}, 503: {}},
              openapi_extra=request_body(VllmDetokenizeRequest), response_model=None)
    async def vllm_detokenize(request: Request):
        """vLLM's route: word piece ids back to text (special tokens kept, as vLLM decodes), `{"prompt"}`;
        errors in OpenAI's shape."""
        require_ready()
        asked = await body_of(VllmDetokenizeRequest, request)
        served_model(asked.model)
        text, = tokenize_api.decoded(runtime.text, [asked.tokens], False, "tokens", settings.max_tokenize_chars, 400)
        return Response(msgspec.json.encode(VllmDetokenizeResponse(text)), media_type="application/json")

    @app.post("/decode", tags=["tokenize"], responses={413: {}, 422: {}, 503: {}},
              openapi_extra=request_body(TeiDecodeRequest), response_model=None)
    async def tei_decode(request: Request):
        """Text Embeddings Inference's route: word piece ids back to text, one string per list of ids
        (`ids` one list, or a list of lists); special tokens left out unless `skip_special_tokens` is false."""
        require_ready()
        asked = await body_of(TeiDecodeRequest, request)
        lists = {isinstance(item, list) for item in asked.ids}
        if len(lists) > 1:
            raise ApiError(422, "invalid_request", "ids: send one list of ids, or a list of lists, not both mixed")
        ids = asked.ids if lists == {True} else [asked.ids]
        return tokenize_api.decoded(runtime.text, ids, asked.skip_special_tokens, "ids", settings.max_tokenize_chars)

    app.fast_routes = {"/v1/infer": infer, **embeddings_routes(runtime, require_ready, run_inference),
                       **classify_routes(runtime, require_ready, run_inference),
                       **tei_predict_route(runtime, require_ready, run_inference)}
    app.fast_routes["/"] = tei_root(app.fast_routes)
    app.oip_infer = oip_infer
    app.grpc_service = oip_grpc.service(
        app, require_ready, require_serving, oip_module, oip_answer, repository_index,
        lambda headers: app.api_keys is None or bearer_matches(headers, *app.api_keys))
    app.v1_predict = predict_route(require_ready, oip_module, fit_to_inputs, run_inference)
    app.openapi = functools.partial(openapi, app)

    def device_failure() -> ApiError | None:
        """503 once the device failed (a sticky CUDA error): the process is stopping to be restarted."""
        failure = getattr(runtime, "failure", None)  # a worker's RemoteRuntime has none: its engine exits
        return None if failure is None else ApiError(503, "device_failed", f"the device failed: {failure}")

    def device_failed() -> Response | None:
        """`device_failure` as tmod's health routes answer it."""
        failed = device_failure()
        if failed is None:
            return None
        return Response(content=error_content("/healthz", 503, failed.type, failed.message), status_code=503,
                        media_type="application/json")

    @app.get("/healthz", tags=["health"], responses={503: {}})
    async def healthz():
        return device_failed() or {"status": "ok"}

    @app.get("/info", tags=["embeddings"], responses={503: {}})
    async def tei_endpoint_info():
        """Text Embeddings Inference's /info (huggingface_hub's `get_endpoint_info`): the backbone, its
        precision, the embedding's pooling and this server's limits, in TEI's field names."""
        require_ready()
        return tei_info(runtime, settings, app.version)

    @app.get("/health", tags=["embeddings"], responses={503: {}})
    @app.get("/", tags=["embeddings", "kserve-v1"], responses={503: {}})
    async def tei_health(request: Request):
        """Text Embeddings Inference's health route (huggingface_hub's `health_check`; TEI answers it at
        `GET /` too): 200 while the server can answer, else 503 in TEI's error shape. The body is empty,
        but at `/`: KServe V1's liveness there (the kserve client's `is_server_live`) is {"status": "alive"}."""
        failed = device_failure()
        if failed is not None:
            raise failed
        require_serving()
        if request.url.path == "/":
            return Response(b'{"status":"alive"}', status_code=200, media_type="application/json")
        return Response(status_code=200)

    @app.get("/readyz", tags=["health"], responses={503: {}})
    async def readyz():
        failed = device_failed()
        if failed is not None:
            return failed
        if not runtime.ready.is_set():
            detail = runtime.startup_error or "loading"
            return Response(
                content=error_content("/readyz", 503, "not_ready", f"not ready: {detail}"),
                status_code=503, media_type="application/json",
            )
        if not runtime.modules:  # every module unloaded (or none loaded at start): out of service
            out = no_modules()
            return Response(content=error_content("/readyz", 503, out.type, out.message, **out.details),
                            status_code=503, media_type="application/json")
        return {"status": "ready", "backbone": runtime.model_info()[0], "tasks": sorted(runtime.modules),
                "refused": runtime.load_errors}

    @app.get("/metrics", tags=["health"])
    async def prometheus_metrics():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


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


def request_body(kind: type) -> dict:
    """A FastAPI route's `openapi_extra`: its JSON body is `kind` (a msgspec struct, in the components)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{kind.__name__}"}}}}}


# the inference routes, answered by `TmodApp.__call__`: (path, summary, body, answer, protocol's errors)
OIP_BODY = {"type": "object", "description": "an Open Inference Protocol v2 inference request (JSON, or the binary "
            "data extension: a JSON header of Inference-Header-Content-Length bytes, then raw tensors); server/oip.py "
            "says what each model reads and answers (GET /v2/models/{task})"}
FAST_ROUTES_DOC = [
    ("/v1/infer", "Tasks on texts or text pairs, every task from one backbone pass", "inference",
     InferRequest, InferResponse, (400, 413, 422, 429, 503)),
    ("/v1/embeddings", "OpenAI's embeddings API", "embeddings", OpenAIEmbeddingRequest, OpenAIEmbeddingResponse,
     (400, 404, 413, 422, 429, 503)),
    ("/embed", "Text Embeddings Inference's /embed: one vector per input", "embeddings", TEIEmbedRequest,
     list[list[float]], (413, 422, 424, 429, 503)),
    ("/similarity", "Text Embeddings Inference's /similarity: each sentence's cosine similarity to the source "
     "sentence", "embeddings", TEISimilarityRequest, list[float], (413, 422, 424, 429, 503)),
    ("/", "Text Embeddings Inference's root: /embed, or /similarity where `inputs` is an object, or /predict where "
     "Hugging Face's `parameters` come beside a text (what huggingface_hub's InferenceClient posts to a server's URL)",
     "embeddings", TEIEmbedRequest, list[list[float]], (413, 422, 424, 429, 503)),
    *((path, f"vLLM's score API{where}: each pair's cosine similarity, from an embedding task", "embeddings",
       ScoreRequest, ScoreResponse, (400, 404, 413, 429, 503))
      for path, where in (("/score", ""), ("/v1/score", " (its older path)"))),
    *((path, f"vLLM's rerank API{where}: the documents by their embeddings' cosine similarity to the query, best "
       "first", "embeddings", RerankRequest, RerankResponse, (400, 404, 413, 429, 503))
      for path, where in (("/rerank", " (Jina's and Cohere's; a body with `texts` instead of `documents` is Text "
                                      "Embeddings Inference's rerank, TEIRerankRequest, answered as a list of "
                                      "TEIRank, its errors in TEI's shape, 422 for a malformed body)"),
                          ("/v1/rerank", " (Jina's path)"), ("/v2/rerank", " (Cohere's v2 path)"))),
    ("/classify", "vLLM's classification API: one single-label task on texts", "classification", ClassifyRequest,
     ClassifyResponse, (400, 404, 413, 429, 503)),
    ("/v1/classify", "/classify, where SGLang serves it", "classification", ClassifyRequest, ClassifyResponse,
     (400, 404, 413, 429, 503)),
    ("/predict", "Text Embeddings Inference's /predict: one classification task's labels, best first (?tasks= names "
     "it where several are loaded)", "classification", TEIPredictRequest, list[Any], (400, 413, 422, 424, 429, 503)),
    ("/v2/models/{task}/infer", "Open Inference Protocol v2 inference", "oip-v2", None, None, (400, 404, 413, 422, 429)),
    ("/v1/models/{task}:predict", "KServe's V1 predict (the kserve client's default protocol): one task on texts",
     "kserve-v1", PredictRequest, PredictResponse, (400, 404, 413, 422, 429, 503)),
    ("/v2/models/{task}/versions/{version}/infer", "Open Inference Protocol v2 inference, naming the version served",
     "oip-v2", None, None, (400, 404, 413, 422, 429)),
]
TASKS_QUERY = {"name": "tasks", "in": "query", "required": False, "schema": {"type": "string"},
               "description": "comma-separated task names; none = all loaded; given more than once, the lists are joined"}


def openapi(app: TmodApp) -> dict:
    """FastAPI's schema of its own routes, with the inference routes' paths and the msgspec structs'
    JSON Schema (server/schemas.py `openapi_components`): one declaration of each shape."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    kinds = [kind for _, _, _, body, answer, _ in FAST_ROUTES_DOC for kind in (body, answer) if kind is not None]
    found, components = openapi_components(*kinds, TokenizeRequest, TeiTokenizeRequest, TEIRerankRequest, TEIRank,
                                           TeiDecodeRequest, VllmTokenizeRequest, VllmTokenizeResponse,
                                           VllmDetokenizeRequest, VllmDetokenizeResponse)
    schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
    for path, summary, tag, body, answer, errors in FAST_ROUTES_DOC:
        operation = {
            "tags": [tag], "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": found[body] if body is not None else OIP_BODY}}},
            "responses": {"200": {"description": "the answer", "content": {"application/json": {
                "schema": found[answer] if answer is not None else {"type": "object"}}}},
                **{str(status): {"description": "refused (the protocol's error shape)"} for status in errors}},
        }
        names = re.findall(r"{(\w+)}", path)
        parameters = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}} for n in names]
        if path == "/v1/infer":
            parameters.append(TASKS_QUERY)
        elif path == "/predict":
            parameters.append({**TASKS_QUERY, "description": "the task to answer, where several classification tasks "
                                                            "read such inputs"})
        if parameters:
            operation["parameters"] = parameters
        schema["paths"].setdefault(path, {})["post"] = operation
    app.openapi_schema = schema
    return schema
