"""`tmod-serve`: start the HTTP server.

Every flag is generated from the Settings model, so flags, TMOD_* environment variables and
defaults cannot drift apart. Flags override environment variables, which override defaults.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import typing
from pathlib import Path

from pydantic import ValidationError

from modules_store import misplaced_store
from server import __version__
from server.command_line import CommandLineParser
from server.config import Settings, device_problem
from server.logs import configure_logging
from server.ports import bind_port


def _flag_type(annotation):
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return args[0]


def build_parser() -> argparse.ArgumentParser:
    parser = CommandLineParser(
        prog="tmod-serve",
        description="Serve every task module in a store from one frozen backbone pass per batch. "
        "Each flag can also be set as an environment variable TMOD_<NAME> (e.g. TMOD_PORT=9000).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        kind = _flag_type(field.annotation)
        default = "none" if field.default is None else field.default
        help_text = f"{field.description} [env TMOD_{name.upper()}; default {default}]"
        if kind is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=name, type=kind if kind in (int, float) else str, help=help_text)
    return parser


# TMOD_* variables read by tmod's other tools, not by tmod-serve (training and benchmark data)
OTHER_TOOLS_VARIABLES = frozenset({"TMOD_DATA_DIR"})
# what Kubernetes puts in a pod for each Service of its namespace named tmod[-...] (unless the pod sets
# enableServiceLinks: false, as deploy/ does): TMOD_SERVICE_HOST, TMOD_HEADLESS_PORT_80_TCP_ADDR, ...
SERVICE_LINK = re.compile(r"TMOD(_[A-Z0-9_]+?)?_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT(_\d+_(TCP|UDP|SCTP)(_[A-Z]+)?)?)")


def unknown_variables(environ) -> list[str]:
    """A warning for each TMOD_* variable that names no setting (a typo such as TMOD_MAX_BATCH is
    otherwise ignored without a word, as vLLM warns of unknown VLLM_* ones), with the likely one."""
    from server.errors import did_you_mean  # here, not at the top: --help stays fast

    known = {f"TMOD_{name.upper()}" for name in Settings.model_fields} | OTHER_TOOLS_VARIABLES
    return [f"environment variable {name} is not a tmod-serve setting{did_you_mean([name], known)}: ignored"
            for name in sorted(environ) if name.startswith("TMOD_") and name not in known
            and not SERVICE_LINK.fullmatch(name)]


def main(argv=None) -> None:
    try:
        check_and_serve(argv)
    except KeyboardInterrupt:  # Ctrl-C before the server took its signals over (checks, imports): nothing to drain
        print("tmod-serve: interrupted (Ctrl-C) before it was serving", file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT) from None


def check_and_serve(argv=None) -> None:
    overrides = {k: v for k, v in vars(build_parser().parse_args(argv)).items() if v is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:  # a setting out of range, from a flag or TMOD_*: one line, no traceback
        raise SystemExit(f"tmod-serve: {setting_problem(exc)}") from None
    problem = device_problem(settings.device)  # a GPU asked for on a machine without one: say so now
    problem = problem or store_problem(settings.store) or bridges_problem(settings.bridges) \
        or backbone_problem(settings.backbone, settings.cache_dir) \
        or tasks_problem(settings) or port_problem(settings.host, settings.port) \
        or (port_problem(settings.host, settings.grpc_port, "--grpc-port") if settings.grpc_port else None)
    if problem:
        raise SystemExit(f"tmod-serve: {problem}")
    configure_logging(settings.log_level, settings.log_format)
    for warning in unknown_variables(os.environ):  # a log line, as the server's others
        logging.getLogger("tmod").warning(warning)
    try:
        serve_settings(settings)
    finally:
        exit_status()


def store_problem(store: Path) -> str | None:
    """A --store that is no folder, or is one task's or one module's folder: either would start a
    server with nothing to serve, quietly."""
    if not store.is_dir():
        return f"the module store {store} is not a directory (--store / TMOD_STORE)"
    misplaced = misplaced_store(store)
    return f"--store / TMOD_STORE: {misplaced}" if misplaced else None


def bridges_problem(bridges: Path | None) -> str | None:
    """A --bridges store named and not there: its foreign modules would be refused one by one, the
    cause (a typo in the path) said nowhere. (The default, <store>/_bridges, may well be absent.)"""
    if bridges is not None and not bridges.is_dir():
        return f"the bridge store {bridges} is not a directory (--bridges / TMOD_BRIDGES)"
    return None


def backbone_problem(backbone: Path | str | None, cache_dir: Path | None = None) -> str | None:
    """A --backbone folder that is not there (a typo, a model hub name), or a named backbone whose
    package is not installed: said before anything loads."""
    from server.backbone import sources  # here, not at the top: --help stays fast

    problem = sources.backbone_problem(backbone, cache_dir)
    return f"--backbone / TMOD_BACKBONE: {problem}" if problem else None


def tasks_problem(settings: Settings) -> str | None:
    """A --tasks name the store has no folder for is a typo: said before anything loads (the server
    would otherwise start without it, the name only listed under /readyz "refused"). A task that is
    there but whose module is broken is refused at load as before, and the others serve."""
    if settings.tasks is None:
        return None
    wanted = settings.task_list()
    if not wanted:
        return f"--tasks / TMOD_TASKS names no task (got {settings.tasks!r}); leave it unset to serve the whole store"
    from modules_store.store import ModuleStore  # here, not at the top: --help stays fast
    from server.errors import did_you_mean

    store = ModuleStore(settings.store)
    held = store.tasks()
    named = [task for task, _ in settings.task_pins()]
    twice = sorted({task for task in named if named.count(task) > 1})
    if twice:
        return f"--tasks / TMOD_TASKS names {twice[0]!r} twice (got {settings.tasks!r}): name each task once"
    missing = [task for task in named if task not in held]
    if missing:
        task = missing[0]
        return (f"--tasks / TMOD_TASKS: no task {task!r} in the store {settings.store}"
                f"{did_you_mean([task], held)}; its tasks: {', '.join(held) or 'none'}")
    for task, version in settings.task_versions().items():
        if version is not None and version not in store.versions(task):
            return (f"--tasks / TMOD_TASKS: no version {version!r} of {task!r} in the store {settings.store}; "
                    f"its versions: {', '.join(store.versions(task)) or 'none'}")
    return None


def port_problem(host: str, port: int, flag: str = "--port") -> str | None:
    """Another process on the port, or a host that is not this machine's: said before anything loads
    (one process would log it once start-up began; the workers' listener would raise)."""
    if port == 0:
        return None
    try:
        bind_port(host, port).close()
    except OSError as exc:
        return f"cannot listen on {host}:{port}: {exc.strerror or exc} (--host / {flag})"
    return None


def setting_problem(exc: ValidationError) -> str:
    """The first wrong setting, named as its flag and variable: `--port / TMOD_PORT: Input should be ...`."""
    first = exc.errors()[0]
    if not first["loc"]:  # a check across settings (Settings' model validator) says what it is itself
        return str(first["msg"]).removeprefix("Value error, ")
    name = str(first["loc"][0])
    return f"--{name.replace('_', '-')} / TMOD_{name.upper()}: {first['msg']} (got {first.get('input')!r})"


def serve_settings(settings: Settings) -> None:
    if settings.engines > 1 and settings.workers < 2:
        raise SystemExit("tmod-serve: --engines N runs N engine processes with their own HTTP workers: "
                         "give --workers 2 or more")
    if settings.workers > 1:
        from server.temp_folders import engine_socket_problem, make_private_folder, remove_private_folder

        if problem := engine_socket_problem():
            raise SystemExit(f"tmod-serve: {problem}")
        # N HTTP worker processes and this one as the engine (server/workers/). Metrics of every
        # process go through files here; prometheus_client reads this when first imported, so set it first
        made = None
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            made = make_private_folder("metrics")
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(made)
        from server.workers.processes import serve, serve_engines

        stop_on_device_failure()
        try:
            return serve(settings) if settings.engines == 1 else serve_engines(settings)
        finally:
            if made:
                remove_private_folder(made)
    from server.api.app import create_app  # imported late so --help stays fast
    from server.api.http_limits import DrainingServer, uvicorn_config

    server = DrainingServer(uvicorn_config(create_app(settings), settings))
    stop_on_device_failure(lambda: setattr(server, "should_exit", True))
    server.run()


def stop_on_device_failure(stop=None) -> None:
    """A sticky device error, or a start-up that failed, stops this process as SIGTERM does
    (requests drain, answered 503; `stop`, default a SIGTERM to this process), and `main` then exits
    non-zero, so that Kubernetes (or any supervisor) starts a fresh one."""
    from server import runtime

    runtime.on_device_failure = stop or (lambda: os.kill(os.getpid(), signal.SIGTERM))


def exit_status() -> None:
    runtime = sys.modules.get("server.runtime")  # not imported: nothing ran, nothing failed
    reason = runtime.exit_reason() if runtime is not None else None
    if reason is not None:
        raise SystemExit(f"tmod-serve: {reason}")


if __name__ == "__main__":
    main()
