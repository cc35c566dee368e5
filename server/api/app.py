"""The HTTP API. Decode -> validate -> run in the compute thread -> encode.

`TmodApp` is a FastAPI app with one raw ASGI layer in front (`TmodApp.__call__`) that every request
passes: its request id (echoed, and on every log line written while serving it), the body limits
(server/api/http_limits.py `limit_body`), a refusal in the protocol shape of its path (server/errors.py
`refusal`) and the access line (server/logs.py `AccessLog`, sampled at high rates). The inference routes
(`/v1/infer`, OpenAI's `/v1/embeddings`, TEI's `/embed`, OIP v2 `infer`) are answered in that layer,
never by FastAPI: the body is read once, decoded and validated in one pass into a msgspec struct
(server/api/schemas.py), and the answer encoded once into bytes; `/openapi.json` documents them from the
same structs. Task names are checked against one snapshot of the runtime's modules per request, so a
module swapped mid-request does not change what the request sees.

`create_app` makes one `Serving` (server/api/serving.py: readiness, the modules a request names, one
request's path through tokenizer and batcher) and hands it to each group of routes: `/v1/infer` and
`/v1/tasks` (server/api/infer.py), the admin routes (server/api/admin.py), OIP v2 (server/api/oip.py),
tokenize (server/api/tokenize.py), health and metrics (server/api/health.py) and the other protocols'
modules."""
from __future__ import annotations

import functools
import re
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException

from server import __version__
from server.api import oip_grpc
from server.api.admin import admin_routes
from server.api.classify import ClassifyRequest, ClassifyResponse, classify_routes
from server.api.cors import Cors
from server.api.embeddings import (OpenAIEmbeddingRequest, OpenAIEmbeddingResponse, RerankRequest, RerankResponse,
                                   ScoreRequest, ScoreResponse, TEIEmbedRequest, TEIRank, TEIRerankRequest,
                                   TEISimilarityRequest, embeddings_routes, model_list_routes, tei_root)
from server.api.health import health_routes
from server.api.http_limits import CYCLE, answer_whole, limit_body, read_body
from server.api.infer import infer_route, task_routes
from server.api.oip import oip_routes
from server.api.predict import PredictRequest, PredictResponse, TEIPredictRequest, predict_route, tei_predict_route
from server.api.schemas import (InferRequest, InferResponse, TeiDecodeRequest, TeiTokenizeRequest, TokenizeRequest,
                                VllmDetokenizeRequest, VllmDetokenizeResponse, VllmTokenizeRequest, VllmTokenizeResponse,
                                openapi_components)
from server.api.serving import Serving, bearer_matches, check_query, query_pairs, require_json
from server.api.tokenize import tokenize_routes
from server.backbone import Backbone
from server.config import Settings
from server.errors import (KSERVE_V1_PREDICT, ApiError, api_error_handler, http_error_handler, refusal,
                           validation_error_handler)
from server.logs import PROBES, AccessLog, request_id, request_id_for
from server.runtime import Runtime


# what stays open with an API key set: probes, scrapers and the schema (module changes have their own token)
OPEN_PATHS = PROBES | {"/metrics", "/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc"}
# the routes that change modules: the admin token guards them (in the same Authorization header), not the API key
ADMIN_PATHS = ("/admin/", "/v2/repository/models/")
NO_HEADERS: dict[str, str] = {}
OIP_INFER = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")


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
        check_query(scope)
        body = await read_body(receive)
        content, headers = await handler(body, Call(scope, receive), *params)
        await reply.whole(200, content, headers)


class Reply:
    """A request's answer on its way out. Called, it is the ASGI `send` the FastAPI routes get; every
    answer carries the request id; it keeps the status once the answer began and whether it was sent
    whole. `whole` answers with bytes made here: through uvicorn's cycle at once where tmod's protocol
    serves the request (server/api/http_limits.py `answer_whole`), else as two ASGI messages."""

    __slots__ = ("send", "rid", "cycle", "status", "complete", "extra")

    def __init__(self, send, rid: str, cycle):
        self.send, self.rid, self.cycle = send, rid, cycle
        self.status: int | None = None
        self.complete = False
        self.extra: dict[str, str] = NO_HEADERS  # on every answer: CORS headers (server/api/cors.py)

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
        the CORS values server/api/cors.py checked (an allowed origin, a list of header names)."""
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
        return tuple(value for key, value in query_pairs(self.scope["query_string"]) if key == name)

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


async def respond(send, status: int, content: bytes, headers: dict[str, str]) -> None:
    """One answer: its head (JSON unless `headers` says otherwise) and its body."""
    head = [(b"content-length", str(len(content)).encode())]
    if "content-type" not in headers:
        head.append((b"content-type", b"application/json"))
    head += [(name.encode(), value.encode()) for name, value in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": content})


def create_app(settings: Settings | None = None, backbone: Backbone | None = None, runtime=None) -> TmodApp:
    """The app over `runtime`: by default a Runtime in this process (backbone, modules, batcher);
    in an HTTP worker process a `server.workers.remote_runtime.RemoteRuntime` (the same interface) that forwards to
    the engine process."""
    settings = settings or Settings()
    runtime = runtime or Runtime(settings, backbone)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await runtime.open()
        grpc_server = None
        if settings.grpc_port is not None:  # OIP over gRPC beside HTTP, in each process that serves HTTP
            health = oip_grpc.Health(serving.require_serving)
            grpc_server = await oip_grpc.start(app.grpc_service, health, settings.host, settings.grpc_port,
                                               settings.max_body_bytes)
        yield
        if grpc_server is not None:
            health.stopping = True  # NOT_SERVING from now on; open watches are told and end
            await grpc_server.stop(grace=settings.request_timeout_s)  # calls under way are answered
        await runtime.shutdown()

    app = TmodApp(
        title="tmod", version=__version__, lifespan=lifespan,
        description="Multi-task NLP inference: one frozen backbone pass feeds every requested task head.",
    )
    app.configure(settings)
    app.state.runtime = runtime
    app.state.retry_after_s = settings.retry_after_s
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(Exception, api_error_handler)  # a 500 in the protocol's shape, its traceback logged
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)

    serving = Serving(settings, runtime)

    task_routes(app, serving)
    admin_routes(app, serving)
    model_list_routes(app, serving)
    oip_infer, oip_answer = oip_routes(app, serving)
    tokenize_routes(app, serving)
    health_routes(app, serving)

    app.fast_routes = {**infer_route(serving), **embeddings_routes(serving), **classify_routes(serving),
                       **tei_predict_route(serving)}
    app.fast_routes["/"] = tei_root(app.fast_routes)
    app.oip_infer = oip_infer
    app.grpc_service = oip_grpc.service(app, serving, oip_answer,
                                        lambda headers: app.api_keys is None or bearer_matches(headers, *app.api_keys))
    app.v1_predict = predict_route(serving)
    app.openapi = functools.partial(openapi, app)
    return app


# the inference routes, answered by `TmodApp.__call__`: (path, summary, body, answer, protocol's errors)
OIP_BODY = {"type": "object", "description": "an Open Inference Protocol v2 inference request (JSON, or the binary "
            "data extension: a JSON header of Inference-Header-Content-Length bytes, then raw tensors); server/api/oip.py "
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
    JSON Schema (server/api/schemas.py `openapi_components`): one declaration of each shape."""
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
