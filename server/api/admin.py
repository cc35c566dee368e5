"""Changing what a running server serves: `/admin/modules` (tmod's own routes, `tmod-train --load-into`,
deploy/rollout_modules.py) and Triton's model repository extension over HTTP (tritonclient's
`get_model_repository_index`, `load_model`, `unload_model`). Both take the admin token
(`Authorization: Bearer`), not the API key; the runtime swaps a module between batches."""
from __future__ import annotations

import msgspec
from fastapi import Request, Response

from modules_store import ModuleStore
from modules_store.manifest import NAME_PATTERN
from server.api.schemas import (AdminModules, ModuleAction, ModuleActionResult, RepositoryChangeRequest,
                                RepositoryIndexRequest, decode, numbered_version)
from server.api.serving import Serving, bearer_matches
from server.errors import ApiError, clip, clip_list, did_you_mean, protocol_of


def repository_index(serving: Serving, ready_only: bool) -> list[dict]:
    """The repository index, over HTTP and gRPC: the served tasks, then (unless `ready_only`) the others."""
    runtime = serving.runtime
    index = [{"name": task, "version": module.version, "state": "READY", "reason": ""}
             for task, module in sorted(runtime.modules.items())]
    if not ready_only:
        left_out = {**runtime.skipped, **runtime.load_errors}
        for task in ModuleStore(serving.settings.store).tasks():
            left_out.setdefault(task, f"not loaded (not named in --tasks, unloaded, or added to the store since "
                                      f"start-up): POST /v2/repository/models/{task}/load (or /admin's) serves it")
        index += [{"name": task, "state": "UNAVAILABLE", "reason": why} for task, why in sorted(left_out.items())
                  if task not in runtime.modules]
    return index


def admin_routes(app, serving: Serving) -> None:
    """Adds /admin's routes and Triton's repository routes to the FastAPI `app`."""
    settings, runtime = serving.settings, serving.runtime

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
        serving.require_ready()

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
        return AdminModules(store=str(settings.store.resolve()), backbone=msgspec.structs.asdict(serving.model_info()),
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

    @app.post("/v2/repository/index", tags=["oip-v2"])
    async def oip_repository_index(request: Request):
        """Triton's repository index (tritonclient's `get_model_repository_index`): each served task READY,
        each other task of the store UNAVAILABLE with why (left out or refused at start-up, or not loaded);
        `{"ready": true}` asks the READY ones only. Loading and unloading: the routes below, or /admin."""
        serving.require_ready()
        body = await request.body()
        ready_only = decode(RepositoryIndexRequest, body or b"{}", protocol_of(request.url.path)[1]).ready
        return repository_index(serving, ready_only)

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
        version = numbered_version(parameters.get("version"))
        if version is not None and not isinstance(version, str):
            raise ApiError(400, "invalid_request", "parameter 'version' is a version's name, e.g. \"2\" (or 2)")
        await change_module(request, task, action, version,
                            'a version goes in the JSON body: {"parameters": {"version": "2"}}')
        return Response(status_code=200)
