"""One error shape per protocol for every failure, with the request id the access log carries.

tmod's own routes: {"error": {"type", "message", ...}}. The Open Inference Protocol (`/v2`): the
message string in "error" (its clients, tritonclient among them, format that string), the type
beside it. OpenAI's `/v1/embeddings` and `/v1/models`: {"error": {"message", "type", "param", "code"}}, a malformed
body 400. Text Embeddings Inference's `/embed` and `/tokenize`: {"error", "error_type"}. Every
refusal goes through `error_response`, which picks the shape from the path, whoever raises it: a
route, FastAPI's validation, Starlette's routing (404, 405), the body limits, or an exception nobody
caught. `refusal` builds the answer's bytes once for every caller: the raw ASGI layer of server/api/app.py
(the inference routes, and whatever escapes FastAPI) and FastAPI's exception handlers.
"""
from __future__ import annotations

import difflib
import logging
import re
import sys
from typing import Any

import msgspec
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from modules_store import ModuleStore

log = logging.getLogger("tmod")

CLIP = 80  # characters of a client's value an error message quotes back


class ApiError(Exception):
    # a path whose protocol's shape answers this refusal, where a route serves two protocols' bodies
    # (/rerank: TEI's and vLLM's; /tokenize: vLLM's and TEI's); None: the request's own path's
    protocol: str | None = None

    def __init__(self, status: int, type_: str, message: str, headers: dict[str, str] | None = None, **details: Any):
        super().__init__(message)
        self.status, self.type, self.message, self.details = status, type_, message, details
        self.headers = headers or {}


class BodyRefused(Exception):
    """Raised while a request body is read (too large, too slow): answered with its status, never
    as a parse error."""

    def __init__(self, status: int, type_: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.type, self.message, self.headers = status, type_, message, headers


def clip(value: Any, limit: int = CLIP) -> str:
    """repr(value), cut to `limit` characters: error messages never echo attacker-sized input."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def clip_list(values: list, most: int = 10) -> list:
    """The first `most` values, each clipped (for the lists an error names)."""
    return [v if isinstance(v, str) and len(v) <= CLIP else clip(v) for v in values[:most]]


def unknown_tasks(unknown: list[str], loaded, refused: dict[str, str], skipped: dict[str, str] | None = None) -> ApiError:
    """400 unknown_task: the tasks asked that are not loaded (one refused at load says why: its
    artifact's error, as /readyz lists it; one the store holds but start-up left out says why: opt-in,
    or no module for this backbone) and the tasks that are."""
    message = f"unknown task(s) {clip_list(unknown)}" + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else "")
    unexplained = [t for t in unknown if t not in refused and t not in (skipped or {})]  # typos, perhaps
    return ApiError(400, "unknown_task", message + not_loaded(unknown, refused, skipped)
                    + (comma_hint(unexplained, loaded) or did_you_mean(unexplained, loaded))
                    + f"; loaded tasks: {sorted(loaded)}", loaded_tasks=sorted(loaded))


def no_such_task(name: str, loaded, refused: dict[str, str], skipped: dict[str, str] | None = None,
                 noun: str = "task") -> ApiError:
    """404 unknown_task: `name` (a task; OIP's and KServe's model) is not loaded: why, where it was refused
    at load or left out at start, else the loaded name it is close to; and the ones that are."""
    hint = not_loaded([name], refused, skipped) or did_you_mean([name], loaded)
    return ApiError(404, "unknown_task", f"no {noun} {clip(name)}{hint}; loaded {noun}s: {sorted(loaded)}",
                    loaded_tasks=sorted(loaded))


def comma_hint(unknown: list[str], names) -> str:
    """' (tasks are separated by commas: ner,emotion)' where an unknown name is loaded tasks joined by
    another separator ('ner;emotion', 'ner emotion': a '+' in a query string), else ''."""
    for name in unknown[:10]:
        parts = [p for p in re.split(r"[;| ]+", name) if p]
        if len(parts) > 1 and all(p in names for p in parts):
            return f" (tasks are separated by commas: {','.join(parts)})"
    return ""


def did_you_mean(unknown: list[str], names) -> str:
    """' (did you mean 'ner' for 'NER'?)' for the first of `unknown` close to one of `names` (case
    aside), else ''."""
    by_lower = {name.lower(): name for name in names}
    for name in unknown[:10]:
        close = difflib.get_close_matches(name.lower(), by_lower, n=1, cutoff=0.75)
        if close:
            return f" (did you mean {by_lower[close[0]]!r} for {clip(name)}?)"
    return ""


# how the reason a task is left out because none of its versions runs on this backbone begins (after
# 'task: '): the one place that writes it (server/modules.py) and the one that reads it (nothing_served)
NO_VERSION_HERE = "no version for backbone"


def not_loaded(tasks: list[str], refused: dict[str, str], skipped: dict[str, str] | None = None) -> str:
    """' (x was refused at load: <its artifact's error>; y is not served: <why start-up left it out>)'
    for those of `tasks` (the first 10) refused at load, as /readyz lists them, or left out at start
    (`skipped`); '' when none was."""
    skipped = skipped or {}
    # an artifact's error begins with the task's name ('ner: no version for ...'): not said twice
    why = [f"{task} was refused at load: {refused[task]}" if task in refused
           else f"{task} is not served: {skipped[task].removeprefix(f'{task}: ')}"
           for task in tasks[:10] if task in refused or task in skipped]
    return f" ({'; '.join(why)})" if why else ""


def nothing_served(store: ModuleStore, refused: dict[str, str], skipped: dict[str, str], admin_enabled: bool) -> str:
    """Why a server serves no task, and how it gets one: each task refused at load or left out at start
    with why (opt-in, another backbone's), or a store folder that is gone or holds no module, or tasks
    unloaded since; then /admin's load, and the token it needs where it is off (or, where every module
    runs on another backbone, which /admin cannot load here, what would serve one)."""
    left_out = sorted({**skipped, **refused})
    elsewhere = bool(left_out) and not refused and all(
        skipped[task].startswith(f"{task}: {NO_VERSION_HERE}") for task in left_out)
    if left_out:
        why = not_loaded(left_out, refused, skipped)
    elif not (tasks := store.tasks()):  # the store is read only where the reasons above do not say it all
        misnamed = store.misnamed()
        why = store.gone_note() or (
            f" (its folder(s) {clip_list(misnamed)} hold modules under names that are no task's: rename them, 1-64 of "
            "a-z, 0-9, '_' and '-')" if misnamed else
            " (it holds no module: train one into it, tmod-train layermix ... --store STORE)")
    else:
        why = f" (its tasks {clip_list(tasks)} are not loaded: unloaded, or added since start-up)"
    if elsewhere:  # every module runs on another backbone: /admin cannot load one here either
        how = ("serve the store on a backbone its modules run on (--backbone), train a module on this one into it "
               "(tmod-train layermix --backbone ... --store ...), or give --bridges a bridge from this backbone to theirs")
    else:
        how = "load one through /admin" + ("" if admin_enabled else ", which needs TMOD_ADMIN_TOKEN set at start")
    return f"no task modules are loaded from the store {store.root}{why}; {how}"


def error_body(type_: str, message: str, **details: Any) -> dict:
    return {"error": {"type": type_, "message": message, **details}}


def is_oip(path: str) -> bool:
    return path == "/v2" or path.startswith("/v2/")


def oip_error_body(status: int, type_: str, message: str, **details: Any) -> dict:
    # the Open Inference Protocol puts the message string in "error"; its clients read it there
    return {"error": message, "type": type_, **details}


def openai_error_body(status: int, type_: str, message: str, **details: Any) -> dict:
    # what the `openai` package reads: message, type (its error class), param, code (tmod's type)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": details.get("param"), "code": type_}}


TEI_ERROR_TYPES = {400: "Validation", 401: "Unauthorized", 408: "Validation", 413: "Validation", 415: "Validation",
                   422: "Validation", 429: "Overloaded", 503: "Unhealthy"}


def tei_error_body(status: int, type_: str, message: str, **details: Any) -> dict:
    # Text Embeddings Inference's ErrorResponse: the message and its error_type
    return {"error": message, "error_type": TEI_ERROR_TYPES.get(status, "Backend")}


def tmod_error_body(status: int, type_: str, message: str, **details: Any) -> dict:
    return error_body(type_, message, **details)


# path -> (error body, status of a body that fails validation); any other path is tmod's own
PROTOCOLS = {"/v1/embeddings": (openai_error_body, 400), "/classify": (openai_error_body, 400),
             "/v1/classify": (openai_error_body, 400), "/score": (openai_error_body, 400),
             "/v1/score": (openai_error_body, 400), "/rerank": (openai_error_body, 400),
             "/v1/rerank": (openai_error_body, 400), "/v2/rerank": (openai_error_body, 400),
             "/embed": (tei_error_body, 422), "/": (tei_error_body, 422),
             "/predict": (tei_error_body, 422), "/similarity": (tei_error_body, 422),
             "/tokenize": (tei_error_body, 422), "/health": (tei_error_body, 422), "/info": (tei_error_body, 422),
             "/decode": (tei_error_body, 422), "/detokenize": (openai_error_body, 400)}

# peers' routes a client moving to tmod may call that tmod does not serve: why, and what answers instead
# (404 in that peer's error shape, where a route that is not there answers a bare 'no route')
NO_GENERATION = "tmod generates no text: it serves encoder tasks (/v1/infer) and embeddings (/v1/embeddings)"
NOT_SERVED = {
    "/embed_all": (tei_error_body, "Text Embeddings Inference's per-token embeddings are not served: /embed "
                                   "answers one pooled vector a text"),
    "/embed_sparse": (tei_error_body, "Text Embeddings Inference's sparse (SPLADE) embeddings are not served: "
                                      "/embed answers dense vectors"),
    "/pooling": (openai_error_body, "vLLM's pooling API is not served: /v1/embeddings (or /embed) answers pooled "
                                    "vectors, /classify labels, /v1/infer every task"),
    "/v1/completions": (openai_error_body, NO_GENERATION),
    "/v1/chat/completions": (openai_error_body, NO_GENERATION),
}


# KServe V1's inference paths (server/api/predict.py): here, where each path's error shape is chosen
KSERVE_V1_PREDICT = re.compile(r"/v1/models/([^/]+):(predict|explain)")


def protocol_of(path: str):
    """(the error body builder, the status of a malformed body) for the protocol `path` belongs to."""
    if path in PROTOCOLS:  # vLLM's /v2/rerank is no OIP route
        return PROTOCOLS[path]
    if path in NOT_SERVED:
        return NOT_SERVED[path][0], 400
    if is_oip(path):
        return oip_error_body, 422
    if KSERVE_V1_PREDICT.fullmatch(path):  # KServe V1: as its servers, and V2's, answer: the message in "error"
        return oip_error_body, 400
    if path == "/v1/models" or path.startswith("/v1/models/"):
        return openai_error_body, 400
    return PROTOCOLS.get(path, (tmod_error_body, 422))


def error_content(path: str, status: int, type_: str, message: str, **details: Any) -> bytes:
    """The refusal's JSON bytes in the shape of the protocol `path` belongs to."""
    shape, _ = protocol_of(path)
    return msgspec.json.encode(shape(status, type_, message, **details))


def error_response(path: str, status: int, type_: str, message: str, headers: dict[str, str] | None = None,
                   **details: Any) -> Response:
    """The refusal in the shape of the protocol `path` belongs to."""
    return Response(error_content(path, status, type_, message, **details), status_code=status, headers=headers,
                    media_type="application/json")


def refusal(app, path: str, exc: Exception, inference: bool = False) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) answering `exc` on `path`, counted in the metrics (`inference`: on an
    inference route, also as a failed inference request): an ApiError or a body refusal with its own
    status (a 429 says when to come back: the app's `retry_after_s`), anything else a 500 whose
    traceback is logged with the request id."""
    if isinstance(exc, (ApiError, BodyRefused)):
        status, type_, headers = exc.status, exc.type, dict(exc.headers or {})
        message, details = exc.message, getattr(exc, "details", {})
        if status == 429:
            headers.setdefault("retry-after", str(getattr(getattr(app, "state", None), "retry_after_s", 1)))
    else:
        log.error("unhandled error on %s", path, exc_info=exc)
        status, type_, headers, details = 500, "internal_error", {}, {}
        message = f"{type(exc).__name__}: {str(exc)[:200]}"
    count_error(app, type_, inference)
    return status, headers, error_content(getattr(exc, "protocol", None) or path, status, type_, message, **details)


def count_error(app, type_: str, inference: bool = False) -> None:
    """A refusal, by type, on any route; and where it refused an inference request, an inference
    request that failed (a scanner's 404 or a 401 on /admin would otherwise inflate the error ratio
    of tmod_requests_total, whose successes are inference answers)."""
    runtime = getattr(getattr(app, "state", None), "runtime", None)
    if runtime is not None:
        if inference:
            runtime.metrics.requests.labels("error").inc()
        runtime.metrics.errors.labels(type_).inc()


async def api_error_handler(request: Request, exc: Exception) -> Response:
    """FastAPI's handler of ApiError, and of any exception its routes let escape (a 500)."""
    status, headers, content = refusal(request.app, request.url.path, exc)
    return Response(content, status_code=status, headers=headers, media_type="application/json")


async def validation_error_handler(request: Request, exc: RequestValidationError) -> Response:
    problems = []
    for err in exc.errors()[:20]:
        where = ".".join(str(p)[:CLIP] for p in err.get("loc", ()) if p != "body") or "body"
        problems.append({"location": where, "message": str(err.get("msg", "invalid"))[:200]})
    count_error(request.app, "invalid_request")
    summary = "; ".join(f"{p['location']}: {p['message']}" for p in problems[:5])
    _, status = protocol_of(request.url.path)
    return error_response(request.url.path, status, "invalid_request", f"request is malformed: {summary}",
                          problems=problems)


async def http_error_handler(request: Request, exc: StarletteHTTPException) -> Response:
    path = request.url.path
    if exc.status_code == 400 and "parsing the body" in str(exc.detail):
        cause = exc.__cause__
        if isinstance(cause, BodyRefused):  # the body limits stopped reading it
            count_error(request.app, cause.type)
            return error_response(path, cause.status, cause.type, cause.message, cause.headers)
        if isinstance(cause, RecursionError):
            count_error(request.app, "payload_too_large")
            return error_response(path, 413, "payload_too_large", "request body is JSON nested too deeply")
        count_error(request.app, "invalid_request")
        _, status = protocol_of(path)
        if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
            return error_response(path, status, "invalid_request", "request body has an integer of more than "
                                  f"{sys.get_int_max_str_digits()} digits")
        # what else reaches here is a body that is not UTF-8 at all
        return error_response(path, status, "invalid_request", "request body is not valid UTF-8 encoded JSON")
    type_ = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    count_error(request.app, type_)
    headers = exc.headers
    allowed = (headers or {}).get("Allow", "").split(", ")
    if "GET" in allowed and "HEAD" not in allowed:  # the raw layer answers HEAD as GET (server/api/app.py)
        headers = {**headers, "Allow": ", ".join([*allowed, "HEAD"])}
    message = str(exc.detail)[:200]
    if exc.status_code == 404:
        message = f"no route {clip(path)}" + (f": {NOT_SERVED[path][1]}" if path in NOT_SERVED
                                              else route_hint(request.app, path))
    return error_response(path, exc.status_code, type_, message, headers=headers)


def route_hint(app, path: str) -> str:
    """' (did you mean /v1/embeddings? ...)' for a path one slip away from a route: OpenAI's client given a
    base_url without /v1 posts to /embeddings; else the closest route of a fixed path, or ''."""
    routes = {route.path for route in getattr(app, "routes", ()) if "{" not in getattr(route, "path", "{")}
    routes |= set(getattr(app, "fast_routes", ()))
    if "/v1" + path in routes:
        return f" (did you mean /v1{path}? an OpenAI client's base_url ends with /v1: http://host:port/v1)"
    close = difflib.get_close_matches(path[:200], sorted(routes), n=1, cutoff=0.8)
    return f" (did you mean {close[0]}?)" if close else ""
