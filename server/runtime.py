"""What a running server holds: the backbone, the engine, the loaded modules, the metrics.

`Runtime` is what the HTTP app talks to, through a small interface (`open`, `shutdown`, `encode`,
`submit`, `manage`, `describe`, `model_info`, and the snapshots `ready`, `startup_error`, `modules`,
`load_errors`, `metrics`). With `--workers N` the app runs in N processes and talks to
`server/workers/remote_runtime.py`'s `RemoteRuntime`, which has the same interface and forwards to the one Runtime in
the engine process.
"""
from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import signal
import threading
import time
import queue
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Callable

import torch

from modules_store import ArtifactError, ModuleStore
from server import __version__
from server.backbone import Backbone, EncodedInput
from server.config import SettingError, Settings, quota_threads, quota_threads_line
from server.batcher import Batcher, BatchSettings, ClientGone, DeadlineExceeded, Job, QueueFull
from server.engine import Engine
from server.errors import ApiError, clip, no_such_task, nothing_served
from server.host_memory import keep_freed_memory
from server.metrics import Metrics
from server.modules import (LoadedModule, compares_pairs, count_parameters, load_module, load_servable,
                            measured_through, no_better_than_majority)
from server.probe import probe_module
from server.runner.failures import error_text, is_device_failure
from server.runner.model_runner import ModelRunner, PreparedBatch
from server.runner.precision import head_precision, int8_heads_warning
from server.timings import Timings
from server.windows import server_window_problem, window_rule

log = logging.getLogger("tmod")

# A sticky device error (server/runner/failures.py, `is_device_failure`) leaves the whole process's CUDA
# context unusable: the first one seen in this process, and what to do then (tmod-serve: stop the
# process, and exit non-zero once it has stopped; server/cli.py). Tests leave it None.
_device_failure: str | None = None
on_device_failure: Callable[[], None] | None = None  # also called when start-up fails (nothing to serve)
_startup_failure: str | None = None  # start-up failed (the backbone did not load): why


def startup_failure() -> str | None:
    """Why start-up failed in this process, if it did (tmod-serve's exit status reads it)."""
    return _startup_failure


def cannot_serve(reason: str) -> None:
    """This process stops for a reason outside the runtime (its HTTP workers keep dying at start):
    tmod-serve then exits non-zero with it, as for a start-up that failed."""
    global _startup_failure
    _startup_failure = reason


def device_failure() -> str | None:
    """The sticky device error this process met, if any (tmod-serve's exit status reads it)."""
    return _device_failure


def exit_reason() -> str | None:
    """Why this process stops with a non-zero status, as tmod-serve says it in one line; None: it
    did not fail."""
    if _startup_failure is not None:
        return f"cannot serve: {_startup_failure}"
    if _device_failure is not None:
        return f"stopped after a device failure: {_device_failure}"
    return None


def set_host_threads(settings: Settings) -> None:
    """Torch's intra-op threads: `threads` when set. On cuda, unset: one thread, and the tokenizers
    library's own thread pool off. The host side of a GPU server works on small tensors and short
    token lists from its own threads (tokenizer threads, the compute thread, workers); library pools
    sized to every core compete with them: with both at their defaults one process on a 16-core H100
    host used 6.2 cores for 700 1-input req/s and 11.5 for 4,700 seq/s of 32-input requests, 6-12x
    the CPU per request the same code costs on 2 cores (bench_gpu.py served, 2026-11-24)."""
    threads = host_threads(settings)
    if threads:
        torch.set_num_threads(threads)
        if not settings.threads:
            log.info(quota_threads_line(threads))
    elif torch.device(settings.device).type == "cuda":
        one_host_thread()


def host_threads(settings: Settings) -> int | None:
    """Intra-op threads for torch and ONNX Runtime: `threads` when set; unset, on a CPU in a container whose
    CPU quota is less than the cores it sees, the quota (`quota_threads`); else None (the library's choice,
    one per core)."""
    if settings.threads or torch.device(settings.device).type != "cpu":
        return settings.threads
    return quota_threads()


def one_host_thread() -> None:
    """One torch intra-op thread and no tokenizers thread pool (the library reads the variable at
    each call): for processes whose cores belong to other threads and processes."""
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def name_os_thread() -> None:
    """Give the calling thread's Python name to the OS (`top -H`, /proc/<pid>/task/*/comm, profilers,
    the served benchmark's busiest threads): before Python 3.14 every thread shows the process's name.
    Linux's prctl; elsewhere nothing."""
    try:
        ctypes.CDLL(None).prctl(15, threading.current_thread().name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except Exception:  # noqa: BLE001 - a name is not worth a thread: an executor's initializer that raises breaks it
        pass


def stop_with_parent() -> bool:
    """Have the kernel send this process SIGTERM (it drains, as at shutdown) when its parent dies: a
    worker's (multiprocessing's fork server, whose death makes the engine take every worker it forked
    for dead and start others) or an `--engines N` engine's (tmod-serve, killed: a supervisor then
    starts another beside it). Either served on with nobody to stop it. -> False where the parent is
    already gone. Linux's prctl; elsewhere nothing."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return True
    return os.getppid() == parent  # it did not die before the request was in place


class ComputeThread(Executor):
    """The one thread torch work runs on, off the event loop, in the order given: `call(fn, *args)`
    hands it work with no future (a batch: the batcher reports back itself, server/batcher.py), and
    `submit` with one (start-up, module changes). A ThreadPoolExecutor made a future, a condition and
    an idle-semaphore round per batch."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable, *args) -> None:
        if self._closed:
            raise RuntimeError("cannot schedule new work after shutdown")
        self._queue.put((fn, args))

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        future: Future = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - the future's to raise
                future.set_exception(exc)
            else:
                future.set_result(result)

        self.call(run)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more work; what was given still runs (`cancel_futures` is not supported: nothing is dropped)."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _work(self) -> None:
        name_os_thread()
        while (item := self._queue.get()) is not None:
            fn, args = item
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - the thread serves the next call
                log.exception("compute thread: a call failed")


class Runtime:
    def __init__(self, settings: Settings, backbone: Backbone | None = None):
        self.settings = settings
        self.store = ModuleStore(settings.store)
        self.metrics = Metrics()
        self.backbone = backbone
        self.engine: Engine | None = None
        self.runner: ModelRunner | None = None  # batch shapes, CUDA graphs, out-of-memory splits
        self.modules: dict[str, LoadedModule] = {}  # replaced whole, never mutated: readers see a snapshot
        self.bridges: dict = {}  # name -> LoadedBridge from this backbone (foreign modules are served through them)
        self.load_errors: dict[str, str] = {}
        self.skipped: dict[str, str] = {}  # task -> why the store's task is not served (opt-in, another backbone's, unloaded)
        self.ready = threading.Event()
        self.startup_error: str | None = None
        self.failure: str | None = None  # a sticky device error: not ready, not live, the process stops
        self._watch: asyncio.Task | None = None  # `_watch_passes`, where --pass-timeout-s is on
        self._layers: dict[str, tuple[LoadedModule, list[int]]] = {}  # task -> (module, layers_read()), read at load
        # torch work runs on one thread of its own, off the event loop; torch itself uses the cores
        self.executor = ComputeThread("tmod-compute")
        # tokenization (Rust, releases the GIL) runs beside compute so the next batch is ready
        self.tokenize_executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tmod-tokenize",
                                                    initializer=name_os_thread)
        # on a GPU the next batch is formed and collated (in a tokenizer thread) while the device runs
        # this one; on a CPU the compute thread is the whole machine's work, so batches go one at a time,
        # a batch forms from everything that queued meanwhile and is collated where it runs
        on_gpu = settings.device.startswith("cuda")
        self.batcher = Batcher(
            self.run_batch, self.executor,
            BatchSettings(
                max_batch_tokens=settings.max_batch_tokens, max_batch_size=settings.max_batch_size,
                max_wait=settings.max_wait_ms / 1000, max_queue=settings.max_queue, enabled=settings.batching,
                in_flight=2 if on_gpu else 1,
            ),
            self.metrics, prepare=self.prepare_batch if on_gpu else None, prepare_executor=self.tokenize_executor,
        )

    # ---- the interface the HTTP app uses -------------------------------------------------------
    async def open(self) -> None:
        """Start loading (in the compute thread, so /healthz answers at once and /readyz tells when
        loading ends) and start batching."""
        loop = asyncio.get_running_loop()
        loop.run_in_executor(self.executor, self.start)
        self.batcher.start()
        if self.settings.pass_timeout_s:
            self._watch = loop.create_task(self._watch_passes(self.settings.pass_timeout_s))

    async def _watch_passes(self, limit: float) -> None:
        """A batch running past `limit` seconds is taken for a stuck device (a hung kernel or driver,
        which no error ever reports): the runtime fails as on a device error. From then on the
        compute thread's batches are answered here, 503, since none will come back from it."""
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            started = self.batcher.oldest_running()
            if started is None:
                continue
            ran = time.perf_counter() - started
            if self.failure is None and ran > limit:
                self.fail(f"a batch has run for {ran:.1f} s, past --pass-timeout-s ({limit:g} s): the device "
                          "(or its driver) is taken for stuck")
            if self.failure is not None:
                self.batcher.abandon_running(self.failed())

    async def shutdown(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await self.batcher.drain_and_stop()  # answer what was queued before exiting
        self.close()

    def model_info(self) -> tuple[str, str]:
        """(backbone name, fingerprint short form)."""
        return self.backbone.name, self.backbone.fingerprint.short

    def modules_of(self) -> dict[str, str]:
        """The backbones whose modules this server can load, fingerprint short form -> name: its own,
        and those a loaded bridge leads to."""
        targets = [self.backbone.fingerprint, *(bridge.manifest.target for bridge in self.bridges.values())]
        return {target.short: target.name for target in targets}

    def encode(self, texts, text_pairs, truncate: bool, max_tokens: int | None) -> list[EncodedInput]:
        return self.backbone.encode(texts, text_pairs, truncate, max_tokens)

    @property
    def text(self):
        """The backbone's TextEncoder (windows are cut from what it reads: server/windows.py)."""
        return self.backbone.text

    async def submit(self, job: Job) -> list[dict]:
        """A request's rows through the batcher: per input, answers by task; refusals as ApiError."""
        try:
            return await self.batcher.enqueue(job)
        except (QueueFull, DeadlineExceeded, ClientGone) as exc:
            raise self.refusal(exc) from exc

    def put_many(self, entries: list[tuple]) -> int:
        """Queue batcher entries that came together (server/batcher.py; the engine process queues a
        worker's frame so, no future per request) -> how many the queue took (the rest: 429 for the
        caller to give); a closing queue raises the 503 ApiError."""
        try:
            return self.batcher.put_many(entries)
        except QueueFull as exc:
            raise self.refusal(exc) from exc

    def refusal(self, exc: Exception) -> Exception:
        """A batcher's reason for not answering a job -> the request's ApiError (others unchanged)."""
        if isinstance(exc, QueueFull):
            return ApiError(429, "overloaded", f"server overloaded: {exc}; retry later")
        if isinstance(exc, DeadlineExceeded):
            return ApiError(503, "deadline_exceeded", f"{exc} ({self.settings.request_timeout_s}s)")
        if isinstance(exc, ClientGone):
            return ApiError(499, "client_closed_request", str(exc))
        return exc

    async def manage(self, task: str, action: str, version: str | None) -> tuple[LoadedModule, str | None]:
        """Admin: load (default: the store's latest for this backbone), reload (the loaded version or
        the one named) or unload a task, in the compute thread between batches. -> (the module loaded
        or removed, the version it replaced). A refused artifact answers 404/409 and changes nothing."""
        current = self.modules.get(task)
        if action not in ("load", "reload", "unload"):
            raise ApiError(404, "not_found", f"unknown action {clip(action)}: use load, reload or unload")
        if action in ("reload", "unload") and current is None:
            raise no_such_task(task, self.modules, self.load_errors, self.skipped)
        if action == "reload":
            version = version or current.version
        work = (self.unload_task, task) if action == "unload" else (self.load_task, task, version)
        try:
            module = await asyncio.get_running_loop().run_in_executor(self.executor, *work)
        except ArtifactError as exc:
            self.metrics.child(self.metrics.module_refusals, exc.reason).inc()
            status = {"not_found": 404, "invalid_name": 400}.get(exc.reason, 409)
            raise ApiError(status, f"artifact_{exc.reason}", exc.message) from exc
        except RuntimeError as exc:  # a capture at warm-up can meet a dead device too
            if not is_device_failure(exc):
                raise
            self.fail(error_text(exc))
            raise self.failed() from None
        return module, current.version if current else None

    def describe(self, module: LoadedModule) -> dict:
        """What /v1/tasks says of a loaded module."""
        m = module.manifest
        via = None
        if module.bridge is not None:  # a foreign module: the chain backbone -> bridge -> module's backbone
            b = self.bridges[module.bridge].manifest
            via = {"bridge": b.name, "version": b.version, "kind": b.kind, "objective": b.training.get("objective"),
                   "chain": [b.source.name or b.source.short, f"bridge {b.name}/{b.version}",
                             b.target.name or b.target.short],
                   # `metrics` are the module's on its own backbone; what serving it this way costs:
                   "measured": measured_through(b, m)[0]}
        return {
            "task": module.task, "version": module.version, "kind": m.kind, "task_type": m.task_type.value,
            "labels": m.labels, "layers": self.layers_read(module), "parameters": count_parameters(module.head),
            "metrics": m.metrics, "backbone": m.backbone.model_dump(mode="json"), "description": m.description,
            "inputs": "text_pair" if compares_pairs(m) else "text", "served_through": via,
            "windows": getattr(window_rule(module), "name", None),
        }

    def layers_read(self, module: LoadedModule) -> list[int]:
        """The states a module's head reads, as read when it was loaded (reading them reads weights
        back from the device: never on the event loop)."""
        known = self._layers.get(module.task)
        if known is not None and known[0] is module:
            return known[1]
        return module.head.layers_read()

    def _read_layers(self, modules: dict[str, LoadedModule]) -> None:
        self._layers = {task: (m, m.head.layers_read()) for task, m in modules.items()}

    # ---- start-up ----------------------------------------------------------------------------
    def start(self) -> None:
        """Load backbone and modules (called in the compute thread; /readyz answers when done)."""
        began = time.perf_counter()
        try:
            set_host_threads(self.settings)
            if torch.device(self.settings.device).type == "cpu":
                keep_freed_memory()  # passes on the CPU reuse their activations' memory (server/host_memory.py)
            self.backbone = self._started_backbone()
            self.bridges = self.load_bridges()
            self.engine = Engine(self.backbone, bridges=self.bridges, int8=head_precision(self.settings) == "int8")
            if slow := int8_heads_warning(self.settings):
                log.warning(slow)
            self.runner = ModelRunner(self.engine, self.settings, self.metrics)
            log.info("tmod %s, passes on %s: backbone %s %s, heads %s", __version__, self.settings.device,
                     self.backbone.backend.name, self.backbone.backend.precision, self.runner.head_precision)
            loaded = self._load_store_modules()
            self._read_layers(loaded)
            self.modules = loaded
            self.metrics.modules_loaded.set(len(loaded))
            self.runner.warm_up(loaded)  # staging sets and CUDA graphs of every reachable bucket (nothing on the CPU)
            # what start-up made (model, libraries: ~400k objects) lives as long as the server: kept out
            # of the collector's full passes, which per-request garbage triggers (a 32-input request's
            # rows unpickled in half the CPU: bench/results/frontend-workers-cpu.md)
            gc.freeze()
            self.ready.set()
            log.info("ready in %.1fs: %d task%s", time.perf_counter() - began, len(loaded), "" if len(loaded) == 1 else "s")
            if not loaded:  # e.g. a store of another backbone's modules: say so, and why, where operators look
                log.warning("%s (/readyz answers 503 no_modules until then)", nothing_served(
                    self.store, self.load_errors, self.skipped, bool(self.settings.admin_token)))
        except Exception as exc:  # a process that cannot serve says why, and (under tmod-serve) exits
            if isinstance(exc, SettingError):  # the operator's setting: its one line says it all
                self.startup_error = str(exc)
                log.error("start-up failed: %s", exc)
            else:
                self.startup_error = f"{type(exc).__name__}: {exc}"
                log.exception("start-up failed")
            if is_device_failure(exc):  # a dead device does not come back in this process
                self.fail(error_text(exc))
            else:  # nothing to serve: under tmod-serve the process stops and exits 1 (server/cli.py)
                global _startup_failure
                _startup_failure = self.startup_error
                if on_device_failure is not None:
                    on_device_failure()

    def _started_backbone(self) -> Backbone:
        """The backbone (given, else loaded) on the backend and precision the settings ask, its window
        settings checked against its limit (known only now)."""
        backbone = self.backbone
        if backbone is None:
            t0 = time.perf_counter()
            backbone = Backbone.load(self.settings.backbone, device=self.settings.device,
                                     cache_dir=self.settings.cache_dir)
            log.info("backbone %s loaded in %.1fs", backbone.name, time.perf_counter() - t0)
        if (self.settings.backend, self.settings.precision) != (backbone.backend.name, backbone.backend.precision):
            t0 = time.perf_counter()
            backbone = backbone.use_backend(self.settings.backend, self.settings.precision, self.settings.cache_dir,
                                            host_threads(self.settings))
            log.info("backend %s %s ready in %.1fs (%s)", self.settings.backend, self.settings.precision,
                     time.perf_counter() - t0, backbone.backend.describe())
        problem = server_window_problem(backbone.text, self.settings.max_tokens, self.settings.window_tokens,
                                        self.settings.window_stride)
        if problem:
            raise SettingError(f"{problem} ({backbone.name})")
        return backbone

    def _load_store_modules(self) -> dict[str, LoadedModule]:
        """The modules start-up serves: each task of --tasks (its pinned version, or its newest that
        passes), else every task of the store but the opt-in ones and other backbones' (`skipped`, said
        why); a refused artifact is reported (`refuse`) and keeps no other module from serving."""
        asked = self.settings.tasks is not None
        wanted = self.settings.task_versions() if asked else dict.fromkeys(self.store.tasks())
        for folder in self.store.misnamed():
            log.warning("store folder %r holds modules but is not a task name (1-64 of a-z, 0-9, '_' and '-', "
                        "starting with a letter or digit): not served; rename it", folder)
        loaded = {}
        for task, pinned in wanted.items():
            try:
                if pinned is not None:  # the version named, or none: a pin falls back to no other
                    module, refused = load_module(self.store, task, pinned, self.backbone, self.settings.device,
                                                  self.bridges, probe_module), []
                else:  # the newest version that passes its checks; each newer one refused is reported
                    module, refused = load_servable(self.store, task, self.backbone, self.settings.device,
                                                    self.bridges, probe_module)
                if not asked and module.manifest.opt_in:  # served when named, not on a start-up over the store
                    log.info("module %s/%s skipped: opt-in (%s); name it in --tasks to serve it", task,
                             module.version, module.manifest.opt_in)
                    why = module.manifest.opt_in.split("; ")[0]  # its first reason; the log has them all
                    self.skipped[task] = (f"{task}/{module.version} is opt-in ({why}): name it in --tasks, or load "
                                          f"it with POST /admin/modules/{task}/load")
                    continue
                loaded[task] = module
                self.say_loaded(module)
                if refused:
                    self.refuse(task, "; ".join(f"{err.message}" for err in refused)
                                + f" (serving {task}/{loaded[task].version})", *refused)
            except ArtifactError as exc:
                if exc.reason == "other_backbone" and not asked:
                    # one store serves several backbones: another backbone's module is not a refusal
                    log.info("module %s skipped: %s", task, exc.message)
                    self.skipped[task] = exc.message
                    continue
                # one broken artifact must not keep the others from serving
                self.refuse(task, exc.message, exc)
        return loaded

    def refuse(self, task: str, message: str, *errors: ArtifactError) -> None:
        """An artifact not served: on /readyz ("refused"), in the log and in the metrics."""
        self.load_errors[task] = message
        for error in errors:
            self.metrics.child(self.metrics.module_refusals, error.reason).inc()
        self.metrics.modules_refused.set(len(self.load_errors))
        log.error("module %s refused: %s", task, message)

    def load_bridges(self, known: dict | None = None) -> dict:
        """Every bridge in the bridge store that runs on this backbone (its newest version from it), the
        `known` ones kept as they are: at start none, at each module load those loaded (a bridge written
        into the store since joins then, one refused before is tried again). Bridges from other
        backbones are skipped, broken ones refused with a logged reason."""
        from server.bridges import bridge_store, load_bridges_on

        known = known or {}
        loaded, skipped, refused = load_bridges_on(bridge_store(self.settings.bridge_dir()), self.backbone,
                                                   self.settings.device, known)
        for name, runs_on in skipped.items():  # said once, at start
            log.log(logging.DEBUG if known else logging.INFO, "bridge %s skipped: it runs on %s", name, runs_on)
        for name, bridge in loaded.items():
            self.load_errors.pop(f"bridge:{name}", None)
            log.info("bridge %s/%s loaded: %s -> %s", name, bridge.version, bridge.manifest.source.name,
                     bridge.manifest.target.name)
        for name, exc in refused.items():
            self.refuse(f"bridge:{name}", exc.message, exc)
        return {**known, **loaded} if loaded else known

    # ---- hot modules (run in the compute thread, between batches) ----------------------------
    def load_task(self, task: str, version: str | None = None) -> LoadedModule:
        """Load (or replace with) a version, default the store's latest for this backbone. A refused artifact
        raises ArtifactError and leaves the running set untouched. A bridge written into the bridge store
        since start serves from here on (no restart)."""
        bridges = self.load_bridges(self.bridges)
        if bridges is not self.bridges:  # replaced whole: plans made before keep the dict they read
            self.bridges = self.engine.bridges = bridges
        module = load_module(self.store, task, version, self.backbone, self.settings.device, self.bridges, probe_module)
        modules = {**self.modules, task: module}  # new dict: in-flight requests keep theirs
        self._read_layers(modules)
        self.modules = modules
        self.runner.forget_plans()  # plans and graphs: none may serve the replaced head
        self.runner.warm_up(self.modules)
        self.load_errors.pop(task, None)
        self.skipped.pop(task, None)
        self.metrics.modules_refused.set(len(self.load_errors))
        self.metrics.modules_loaded.set(len(self.modules))
        self.say_loaded(module)
        return module

    def say_loaded(self, module: LoadedModule) -> None:
        """The log line of a module loaded: a warning where its training (or, for a foreign one, its bridge's)
        measured it no better than the majority answer; a foreign one's names its bridge and what it measured."""
        if module.bridge is None:
            if poor := no_better_than_majority(module.manifest):
                log.warning("module %s/%s loaded, but %s", module.task, module.version, poor)
            else:
                log.info("module %s/%s loaded", module.task, module.version)
            return
        said, poor = measured_through(self.bridges[module.bridge].manifest, module.manifest)
        log.log(logging.WARNING if poor else logging.INFO, "module %s/%s loaded through bridge %s (%s)",
                module.task, module.version, module.bridge, said)

    def unload_task(self, task: str) -> LoadedModule:
        modules = dict(self.modules)
        removed = modules.pop(task)
        self._read_layers(modules)
        self.modules = modules
        self.runner.forget_plans()
        self.runner.warm_up(modules)
        self.metrics.modules_loaded.set(len(modules))
        # a request that names it then says why it is not served, not only "unknown task"
        self.skipped[task] = (f"{task}/{removed.version} was unloaded through the admin API: POST "
                              f"/admin/modules/{task}/load serves it again")
        log.info("module %s/%s unloaded", task, removed.version)
        return removed

    def close(self) -> None:
        self.tokenize_executor.shutdown(wait=True)
        self.executor.shutdown(wait=self.failure is None)  # after a failure it may be stuck for good

    # ---- inference ---------------------------------------------------------------------------
    def prepare_batch(self, rows: list[EncodedInput], modules: dict[str, LoadedModule]) -> PreparedBatch:
        """Host work of a batch (passes chosen, rows collated), then its captured passes launched on
        the device: runs in a tokenizer thread (a GPU's batches only)."""
        return self.runner.launch(self.runner.prepare(rows, modules), modules)

    def run_batch(self, rows: list[EncodedInput] | PreparedBatch, modules: dict[str, LoadedModule],
                  timings: Timings) -> dict[str, list]:
        """Backbone passes for rows gathered from one or more requests (compute thread), sorted by
        length, or already prepared. The runner cuts them into passes (length runs on a CPU, one
        bucket-padded pass on a GPU: `server/runner/shapes.py`, `BatchShapes`). A row refused for memory
        holds an `OutOfMemory` (503) in place of its answers. A sticky device error fails the
        runtime (`fail`): this batch and every later one are answered 503."""
        if self.failure is not None:
            raise self.failed()
        prepared = rows if isinstance(rows, PreparedBatch) else self.runner.prepare(rows, modules)
        try:
            return self.runner.execute(prepared, modules, timings)
        except Exception as exc:
            if not is_device_failure(exc):
                raise
            reason = error_text(exc)
        self.fail(reason)
        raise self.failed()

    def failed(self) -> ApiError:
        """The 503 every request gets once the device has failed (`fail`)."""
        return ApiError(503, "device_failed", f"the device failed and the server is stopping: {self.failure}")

    def fail(self, reason: str) -> None:
        """A sticky device error: the CUDA context of this process is unusable, so the server stops
        being ready and live (/readyz, /healthz: 503) and, under tmod-serve, the process exits
        non-zero (`on_device_failure`) so that its supervisor (Kubernetes) starts a fresh one."""
        global _device_failure
        if self.failure is not None:
            return
        self.failure = _device_failure = reason
        self.ready.clear()
        log.critical("device failure, the server stops: %s", reason)
        if on_device_failure is not None:
            on_device_failure()
