"""tmod's own task routes: `/v1/infer` (every task named, or every one loaded, from one backbone
pass; answered in the raw ASGI layer, server/api/app.py) and `/v1/tasks` (what is served, with each
task's labels, layers, window and metrics)."""
from __future__ import annotations

import msgspec

from server.api.schemas import InferRequest, InferResponse, TaskDetail, TaskList, decode
from server.api.serving import Serving, task_types
from server.errors import no_such_task


def infer_route(serving: Serving) -> dict:
    """{"/v1/infer": its answer(body, request) -> (bytes, headers)}, for `TmodApp.fast_routes` (`request`:
    server/api/app.py's `Call`, the raw request's headers and query)."""

    async def infer(body: bytes, request) -> tuple[bytes, dict]:
        serving.require_ready()
        asked = decode(InferRequest, body)
        named = request.query("tasks")  # ?tasks=a&tasks=b asks for both: the lists are joined
        tasks = ",".join(named) if named else None
        pairs = not isinstance(asked.inputs[0], str)
        modules = serving.modules_for(tasks, pairs)
        texts = [item.text for item in asked.inputs] if pairs else asked.inputs
        text_pairs = [item.text_pair for item in asked.inputs] if pairs else None
        results, job, headers = await serving.run_inference(texts, text_pairs, modules, asked.truncate, request,
                                                            asked.window, asked.stride, asked)
        return msgspec.json.encode(InferResponse(
            results=results, model=serving.model_info(), tasks={t: m.version for t, m in job.modules.items()},
            truncated=[i for i, row in enumerate(job.rows) if row.truncated], windows=job.windows,
        )), headers

    return {"/v1/infer": infer}


def task_routes(app, serving: Serving) -> None:
    """Adds `/v1/tasks` and `/v1/tasks/{name}` to the FastAPI `app`."""
    runtime = serving.runtime

    @app.get("/v1/tasks", response_model=TaskList, tags=["tasks"])
    async def list_tasks():
        serving.require_ready()
        window_settings = serving.window_settings
        return {"tasks": [runtime.describe(m) for _, m in sorted(runtime.modules.items())],
                "backbone": msgspec.structs.asdict(serving.model_info()),
                "windows": {**window_settings(None, None).describe(), "window_by_task_type": {
                    kind: window_settings(None, None, None, [kind]).window for kind in sorted(task_types(runtime.modules))}}}

    @app.get("/v1/tasks/{name}", response_model=TaskDetail, tags=["tasks"], responses={404: {}})
    async def get_task(name: str):
        serving.require_ready()
        module = runtime.modules.get(name)
        if module is None:
            raise no_such_task(name, runtime.modules, runtime.load_errors, runtime.skipped)
        # not its training record: the command, file paths, store and machine of whoever trained it are
        # the operator's (the store's manifest.json), not every client's
        return {**runtime.describe(module), "manifest": module.manifest.model_dump(mode="json", exclude={"training"})}
