"""Health, readiness and metrics: tmod's `/healthz` (alive) and `/readyz` (serving), Prometheus'
`/metrics`, and Text Embeddings Inference's `/health`, `/` and `/info` (huggingface_hub's
`health_check` and `get_endpoint_info`; KServe V1's liveness at `/`). A dead device, or (a worker) an
engine process that sends nothing, answers 503 on every one of them but `/metrics`."""
from __future__ import annotations

from fastapi import Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from server.api.embeddings import tei_info
from server.api.serving import Serving
from server.errors import error_content


def health_routes(app, serving: Serving) -> None:
    """Adds the health, readiness, metrics and TEI info routes to the FastAPI `app`."""
    settings, runtime = serving.settings, serving.runtime

    def cannot_answer() -> Response | None:
        """`Serving.cannot_answer` as tmod's health routes answer it."""
        failed = serving.cannot_answer()
        if failed is None:
            return None
        return Response(content=error_content("/healthz", 503, failed.type, failed.message), status_code=503,
                        media_type="application/json")

    @app.get("/healthz", tags=["health"], responses={503: {}})
    async def healthz():
        return cannot_answer() or {"status": "ok"}

    @app.get("/info", tags=["embeddings"], responses={503: {}})
    async def tei_endpoint_info():
        """Text Embeddings Inference's /info (huggingface_hub's `get_endpoint_info`): the backbone, its
        precision, the embedding's pooling and this server's limits, in TEI's field names."""
        serving.require_ready()
        return tei_info(runtime, settings, app.version)

    @app.get("/health", tags=["embeddings"], responses={503: {}})
    @app.get("/", tags=["embeddings", "kserve-v1"], responses={503: {}})
    async def tei_health(request: Request):
        """Text Embeddings Inference's health route (huggingface_hub's `health_check`; TEI answers it at
        `GET /` too): 200 while the server can answer, else 503 in TEI's error shape. The body is empty,
        but at `/`: KServe V1's liveness there (the kserve client's `is_server_live`) is {"status": "alive"}."""
        failed = serving.cannot_answer()
        if failed is not None:
            raise failed
        serving.require_serving()
        if request.url.path == "/":
            return Response(b'{"status":"alive"}', status_code=200, media_type="application/json")
        return Response(status_code=200)

    @app.get("/readyz", tags=["health"], responses={503: {}})
    async def readyz():
        failed = cannot_answer()
        if failed is not None:
            return failed
        if not runtime.ready.is_set():
            detail = runtime.startup_error or "loading"
            return Response(
                content=error_content("/readyz", 503, "not_ready", f"not ready: {detail}"),
                status_code=503, media_type="application/json",
            )
        if not runtime.modules:  # every module unloaded (or none loaded at start): out of service
            out = serving.no_modules()
            return Response(content=error_content("/readyz", 503, out.type, out.message, **out.details),
                            status_code=503, media_type="application/json")
        return {"status": "ready", "backbone": runtime.model_info()[0], "tasks": sorted(runtime.modules),
                "refused": runtime.load_errors}

    @app.get("/metrics", tags=["health"])
    async def prometheus_metrics():
        return Response(runtime.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
