"""The bench harness: what every benchmark repeats, written once.

- where it ran: `machine_info` (platform, CPU model and flags, how idle CPUs halt, device, the
  interpreter and its build, versions, commit, load average); `loop_ms_on` (how fast Python runs on
  some CPUs right now, beside a level's figures)
- inputs: `read_sst2_sentences` (the real texts speed benchmarks send), `build_store` (random-weight
  layer-mix heads sized like the tmod-train defaults, saved as real artifacts)
- a real server: `ServerProcess` (a `tmod-serve` subprocess on a free loopback port, optionally
  pinned to CPUs of its own; `wait_ready` on /readyz; `stop` with SIGTERM, as Kubernetes does);
  `running_server` (one, ready, stopped on leaving); `split_cpus` / `pin_to` keep the load
  generator off the server's cores; its process tree, raw keep-alive clients, a SIGTERM under load
  and a module file rewritten under it: bench/live_server.py
- load: `measure` (a closed-loop httpx load generator at one concurrency, one keep-alive connection
  per client) and its latency summary; /metrics read before and after (`parse_metrics`,
  `metrics_delta`); CPU time from /proc (`CpuWindow`, per process and per thread)
- results: `write_results` (JSON with the machine record, plus a Markdown table, under bench/results/);
  `write_json` (the JSON alone, for results that are nested counts rather than one table)

Entry points (bench/README.md) import from here; none starts servers or records machines its own way.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import platform
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

from bench.live_server import engines_on_port, free_port

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
CONLL_LABELS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]
SST2_LABELS = ["negative", "positive"]
COLA_LABELS = ["unacceptable", "acceptable"]


# ---- where it ran ---------------------------------------------------------------------------------
def git_commit() -> dict:
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        except Exception:  # noqa: BLE001  (no git: record that, do not fail the benchmark)
            return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty_tracked_files": bool(status) if status is not None else None}


def cpuinfo_value(field: str) -> str | None:
    """The value of the first `field` line of /proc/cpuinfo ("model name", "flags"), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return cpuinfo_value("model name") or platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (avx2, avx512_bf16, amx_tile, ...)."""
    from server.config import cpu_flags as read_flags  # the server's reader, which warns by them

    return read_flags() or []


def vector_flags(machine: dict) -> str:
    """The flags a recorded `machine` ran its numbers with that change them (vector units: avx*, amx*,
    fma, f16c), for a results table's heading; 'flags not recorded' for a result made before they were."""
    flags = [f for f in machine.get("cpu_flags", []) if f.startswith(("avx", "amx")) or f in ("fma", "f16c")]
    return ", ".join(flags) if flags else "flags not recorded"


def interpreter() -> dict:
    """Which Python ran the benchmark: the host path's CPU is mostly the interpreter's, and builds
    differ by more than a fifth. How it was built does not reliably show (Debian's 3.11, whose
    changelog records LTO/PGO builds, reports neither in sysconfig), so its speed is measured instead:
    `interpreter_loop_ms`. On a 2-core AMD EPYC that was 40-44 ms under a pyenv 3.11.7 (configured
    without optimisations, libpython shared) and 31-34 ms under Debian's 3.11.2, within the same hour
    (docs/host-path-log.md)."""
    try:  # the interpreter's own code in a shared libpython (pyenv's default) or in the executable
        shared = "libpython" in Path("/proc/self/maps").read_text()
    except OSError:
        shared = None
    return {"executable": sys.executable, "version": platform.python_version(),
            "compiler": platform.python_compiler(), "build": " ".join(platform.python_build()),
            "libpython_shared": shared, "interpreter_loop_ms": interpreter_loop_ms()}


def interpreter_loop_ms() -> float:
    """Best of five runs of a fixed pure-Python loop (dict stores, arithmetic, small objects), in ms of
    CPU time: how fast this interpreter on this CPU runs Python, to set beside CPU figures of Python code."""
    class Box:
        __slots__ = ("x",)

        def __init__(self, x):
            self.x = x

    def loop(n: int) -> int:
        table, total = {}, 0
        for i in range(n):
            table[i & 255] = i
            total += len(table) + (i % 7) + Box(i).x
        return total

    best = float("inf")
    for _ in range(5):  # CPU time, not wall time: a CPU shared with other work does not count
        start = time.process_time()
        loop(200_000)
        best = min(best, time.process_time() - start)
    return round(best * 1e3, 1)


def loop_ms_on(cpus: set[int] | None) -> float:
    """`interpreter_loop_ms` in a process of its own on `cpus`: how fast Python runs there right now.
    A shared machine's speed moves under a benchmark (on the 2-core box the same loop took 40-44 ms
    and, within the hour, 74-76 ms), so a level's CPU figures are read beside it. The loop stays in
    the core's own caches: it shows the core's speed, not contention for the shared cache."""
    pin = f"import os; os.sched_setaffinity(0, {sorted(cpus)}); " if cpus else ""  # the child pins itself
    done = subprocess.run([sys.executable, "-c", pin + "from bench.harness import interpreter_loop_ms as f; print(f())"],
                          cwd=REPO, capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def cpu_idle() -> dict:
    """How this machine's CPUs idle: the cpuidle driver and, in a KVM guest with the haltpoll driver,
    how long an idle vCPU polls before it halts (`guest_halt_poll_ns`; 0: it halts at once). A halted
    vCPU gives its core back to the host, and what runs next starts cold: on the 2-core box the engine
    loop alone spent less CPU per batch with 3 ms of polling than with 0 in seven of eight pairs
    (median 0.85x); served, it did not lower the figures in three pairs (issue 37, docs/host-path-log.md)."""
    def read(path: str) -> str | None:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return None

    poll = read("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
    return {"driver": read("/sys/devices/system/cpu/cpuidle/current_driver"),
            "guest_halt_poll_ns": int(poll) if poll is not None and poll.isdigit() else None}


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info(device: str = "cpu", **extra_versions: str) -> dict:
    import torch
    import transformers

    if device.startswith("cuda") and torch.cuda.is_available():
        device = f"{device} ({torch.cuda.get_device_name(0)})"
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "logical_cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average_at_start_1_5_15min": loadavg(),
        "device": device,
        "python": interpreter(),
        "cpu_idle": cpu_idle(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            **extra_versions,
            "tmod_git": git_commit(),
        },
    }


def read_sst2_sentences(data_dir: Path | None = None) -> list[str]:
    """SST-2 validation sentences: the real inputs the speed benchmarks send."""
    from training.data.files import default_data_dir

    path = Path(data_dir or default_data_dir()) / "sst2" / "validation.tsv"
    if not path.is_file():
        raise SystemExit(f"no SST-2 validation file at {path} (set --data-dir or TMOD_DATA_DIR)")
    lines = path.read_text(encoding="utf-8").splitlines()[1:]  # header; tab-separated, no quoting
    return [s for s in (line.split("\t")[0].strip() for line in lines if line.strip()) if s]


# ---- a store of random-weight heads ---------------------------------------------------------------
def build_store(store_dir: Path, backbone_path: str | None, seed: int) -> dict:
    """Random-weight layer-mix heads sized like the tmod-train defaults, saved as real artifacts."""
    import torch

    from modules_store import ModuleStore
    from server.backbone import Backbone
    from server.heads.layermix import LayerMixConfig, LayerMixHead
    from server.modules import save_module

    t0 = time.perf_counter()
    backbone = Backbone.load(backbone_path)
    store = ModuleStore(store_dir)
    layers = list(range(backbone.num_layers + 1))
    specs = {
        "sentiment": dict(task_type="sequence_classification", labels=SST2_LABELS, project_dim=64, alpha=64.0,
                          ffn_dim=256),
        "ner": dict(task_type="token_classification", labels=CONLL_LABELS, project_dim=128, alpha=128.0,
                    ffn_dim=512),
        "acceptability": dict(task_type="sequence_classification", labels=COLA_LABELS, project_dim=64, alpha=64.0,
                              ffn_dim=256),
    }
    described = {}
    for i, (task, spec) in enumerate(specs.items()):
        labels = spec.pop("labels")
        torch.manual_seed(seed * 100 + i)
        config = LayerMixConfig(num_labels=len(labels), hidden_size=backbone.hidden_size, layers=layers,
                                cutoff=0.0, **spec)
        head = LayerMixHead(config, labels)
        with torch.no_grad():  # spread the layer logits a little so the mix is not uniform
            head.layer_logits.copy_(torch.randn(len(layers)) * 0.05)
        save_module(store, task, "1", head.eval(), backbone, description="bench harness: random weights")
        described[task] = {**spec, "labels": len(labels), "layers": layers}
    info = {"backbone": backbone.name, "num_layers": backbone.num_layers, "hidden_size": backbone.hidden_size,
            "heads": described, "seconds": round(time.perf_counter() - t0, 1)}
    del backbone
    return info


# ---- CPU accounting from /proc (Linux; absent elsewhere -> None) ----------------------------------
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def engine_side_of_workers():
    """The engine's side of `tmod-serve --workers` (its frames, `EngineService`, `run_engine_loop`) in
    the checkout on sys.path, which a `--before` run may have put there: one module, server/workers.py,
    in checkouts before it became the package server/workers/."""
    from server import workers
    if hasattr(workers, "EngineService"):
        return workers
    from server.workers import engine_service, frames, processes
    return SimpleNamespace(**{**vars(frames), **vars(engine_service), **vars(processes)})


def proc_cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime, all threads
    except (OSError, IndexError, ValueError):
        return None


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """{thread id: utime + stime seconds} for every thread of a process."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
        except (OSError, IndexError, ValueError):
            pass
    return out


def busiest_threads(pid: int, before: dict[int, float], after: dict[int, float], seconds: float,
                    top: int = 8) -> list[dict]:
    """The `top` threads of a process by cores used between two `thread_cpu_seconds` readings, each
    with its OS name (`comm`: tmod names its compute and tokenizer threads, `server/runtime.py`; a
    thread started by a named one, such as torch's pool threads, inherits its name) and whether it is
    the main thread (the event loop's)."""
    used = sorted(((after[tid] - before.get(tid, 0.0), tid) for tid in after), reverse=True)[:top]
    out = []
    for cpu, tid in used:
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            name = "?"
        out.append({"tid": tid, "name": name, "main": tid == pid, "cores": round(cpu / seconds, 3)})
    return out


def system_cpu() -> tuple[float, float, float] | None:
    """(busy, total, steal) jiffies over all CPUs since boot (busy excludes idle, iowait, steal)."""
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    steal = values[7] if len(values) > 7 else 0
    total = sum(values[:8])
    return total - idle - steal, total, steal


class CpuWindow:
    """CPU cores used over a window by the server, this process (load generator) and the machine."""

    def __init__(self, server_pid: int):
        self.pid = server_pid

    def start(self):
        self.t = time.perf_counter()
        self.server = proc_cpu_seconds(self.pid)
        self.threads = thread_cpu_seconds(self.pid)
        self.me = time.process_time()
        self.system = system_cpu()
        self.load_start = loadavg()

    def stop(self) -> dict:
        wall = time.perf_counter() - self.t
        server, me, system = proc_cpu_seconds(self.pid), time.process_time(), system_cpu()
        out = {"load_avg_1min_start": self.load_start[0] if self.load_start else None,
               "load_avg_1min_end": (loadavg() or [None])[0],
               "server_cores": round((server - self.server) / wall, 3) if server is not None and self.server is not None else None,
               "generator_cores": round((me - self.me) / wall, 3)}
        threads = thread_cpu_seconds(self.pid)
        if threads:
            # Python 3.11 does not name OS threads: the main thread (tid == pid) runs the event loop
            # (HTTP, JSON, validation, the batcher); the busiest other thread is the compute thread
            delta = {tid: threads[tid] - self.threads.get(tid, 0.0) for tid in threads}
            main_thread = delta.pop(self.pid, 0.0)
            busiest = max(delta.values(), default=0.0)
            out["server_threads_cores"] = {
                "event_loop_main_thread": round(main_thread / wall, 3),
                "busiest_other_thread_compute": round(busiest / wall, 3),
                "all_other_threads": round((sum(delta.values()) - busiest) / wall, 3),
            }
        if system and self.system and system[1] > self.system[1]:
            busy = (system[0] - self.system[0]) / (system[1] - self.system[1])
            out["machine_busy_cores"] = round(busy * (os.cpu_count() or 1), 3)
            out["steal_cores"] = round((system[2] - self.system[2]) / (system[1] - self.system[1]) * (os.cpu_count() or 1), 3)
            if out["server_cores"] is not None:
                out["other_cores"] = round(out["machine_busy_cores"] - out["server_cores"] - out["generator_cores"], 3)
        return out


# ---- the servers ----------------------------------------------------------------------------------
def serve_command() -> list[str]:
    """`tmod-serve` beside this Python, or `python -m server.cli` where the script is not installed."""
    script = Path(sys.executable).parent / "tmod-serve"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "server.cli"]


def split_cpus(generator_share: float = 0.5) -> tuple[set[int], set[int]]:
    """(server CPUs, load-generator CPUs): this process's usable CPUs in two apart, so that a
    benchmark does not measure its own load generator (on 2 cores: the server on one, the generator
    on the other). One CPU: both get it (said so by the sets being equal)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cpus) < 2:
        return set(cpus), set(cpus)
    take = min(len(cpus) - 1, max(1, round(len(cpus) * generator_share)))
    return set(cpus[:-take]), set(cpus[-take:])


def pin_to(cpus: set[int] | None) -> None:
    """Run this process (and the processes it starts after) on `cpus` only (None: leave it)."""
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


def inherited_environment() -> dict[str, str]:
    """This process's environment without the server's settings (TMOD_<setting>, oneDNN's ONEDNN_*):
    a benchmark's server runs with the settings it names and records, never with what the shell happened
    to export. Other variables pass (TMOD_DATA_DIR; the TMOD_*_LOG files bench/gpu_checks.sh's engine
    patches write to)."""
    from server.config import Settings

    settings = {f"TMOD_{name.upper()}" for name in Settings.model_fields}
    return {k: v for k, v in os.environ.items() if k not in settings and not k.startswith("ONEDNN_")}


class ServerProcess:
    def __init__(self, name: str, env: dict[str, str], log_path: Path, command: list[str],
                 cpus: set[int] | None = None):
        self.name = name
        self.cpus = cpus  # the server and every process it starts run on these CPUs only (None: any)
        self.command = command
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**inherited_environment(), **env, "TMOD_HOST": "127.0.0.1", "TMOD_PORT": str(self.port)}
        self.settings = {k: v for k, v in env.items() if k.startswith("TMOD_")}
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self._log = open(self.log_path, "wb")
        cpus = self.cpus
        self.proc = subprocess.Popen(self.command, cwd=REPO, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=(lambda: pin_to(cpus)) if cpus else None)

    def wait_ready(self, timeout: float, engines: int = 1, workers: int = 0, modules: bool = True) -> None:
        """Until /readyz answers 200; with `engines` > 1 also until every engine has its `workers`
        (/readyz answers once engine 0 is loaded, the others join the port once loaded). `modules`
        False: a store with none to serve, loaded once /readyz answers 503 no_modules."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                r = httpx.get(self.url + "/readyz", timeout=2)
                loaded = r.status_code == 200 or (not modules and r.status_code == 503 and "no_modules" in r.text)
                if loaded and (engines == 1 or engines_on_port(self.proc.pid, engines, workers)):
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"{self.name} server not ready (every engine on the port) after {timeout:.0f}s:\n"
                         f"{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)  # graceful: drain and exit
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()
        return self.proc.returncode


@contextlib.contextmanager
def running_server(name: str, env: dict[str, str], log_path: Path, args: list[str] = (), ready_timeout: float = 300,
                   modules: bool = True):
    """A `ServerProcess` of `tmod-serve ARGS`, started and ready (`modules` as `wait_ready`'s); stopped
    (SIGTERM) on leaving, also when it never got ready."""
    server = ServerProcess(name, env, log_path, [*serve_command(), *args])
    server.start()
    try:
        server.wait_ready(ready_timeout, modules=modules)
        yield server
    finally:
        server.stop()


# ---- /metrics -------------------------------------------------------------------------------------
def parse_metrics(text: str) -> dict[str, float]:
    """Flat {sample name + labels: value} from the Prometheus text format."""
    from prometheus_client.parser import text_string_to_metric_families

    flat = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            if "le" in sample.labels:
                continue  # buckets are not needed
            flat[f"{sample.name}{{{labels}}}"] = sample.value
    return flat


def metrics_delta(before: dict, after: dict) -> dict:
    def d(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    def mean(name):
        count = d(f"{name}_count{{}}")
        return d(f"{name}_sum{{}}") / count if count else None

    def phase(p):
        count = d(f"tmod_request_duration_seconds_count{{phase={p}}}")
        return d(f"tmod_request_duration_seconds_sum{{phase={p}}}") / count * 1000 if count else None

    passes = d("tmod_batch_size_count{}")
    return {
        "backbone_passes": int(passes),
        "mean_batch_requests": mean("tmod_batch_requests"),
        "mean_batch_inputs": mean("tmod_batch_size"),
        "mean_batch_padded_tokens": mean("tmod_batch_tokens"),
        "server_successes": int(d("tmod_requests_total{outcome=success}")),
        "server_mean_ms": {p: phase(p) for p in ("queue", "tokenize", "backbone", "heads", "total")},
        "server_errors": {k.split("type=", 1)[1].rstrip("}"): int(after[k] - before.get(k, 0.0))
                          for k in after if k.startswith("tmod_request_errors_total{") and after[k] - before.get(k, 0.0)},
        "dropped": {k.split("reason=", 1)[1].rstrip("}"): int(after[k] - before.get(k, 0.0))
                    for k in after if k.startswith("tmod_dropped_requests_total{") and after[k] - before.get(k, 0.0)},
        # how the passes ran (server/runner/model_runner.py): launched ahead by a tokenizer thread, by the compute thread, eager;
        # and those whose inputs were not page-locked
        "passes_by_path": {k.split("path=", 1)[1].rstrip("}"): int(d(k))
                           for k in after if k.startswith("tmod_passes_total{") and d(k)},
        "pageable_passes": int(d("tmod_pageable_passes_total{}")),
        # the CUDA graphs held at the end of the level (gauges), against the buckets its passes needed
        "cuda_graphs": int(after.get("tmod_cuda_graphs{}", 0.0)),
        "cuda_graph_memory_mib": round(after.get("tmod_cuda_graph_memory_bytes{}", 0.0) / 2**20, 1),
    }


# ---- the load generator ---------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile, linear between order statistics (numpy's default); None for no values."""
    if not values:
        return None
    import numpy as np

    return float(np.percentile(np.asarray(values), q))


async def measure(server: ServerProcess, bodies: list[bytes], tasks: list[str], concurrency: int,
                  warmup_s: float, duration_s: float, max_requests: int, inputs_per_request: int,
                  timeout_s: float) -> dict:
    """One closed-loop measurement of one server at one concurrency."""
    import httpx

    # one client (one keep-alive connection) per worker: a single pool of `concurrency` connections
    # costs the generator more CPU per request as it grows, and more under bursty (batched) replies
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    clients = [httpx.AsyncClient(base_url=server.url, limits=limits, timeout=timeout_s) for _ in range(concurrency)]
    scraper = httpx.AsyncClient(base_url=server.url, timeout=30)
    path = "/v1/infer?tasks=" + ",".join(tasks)
    headers = {"content-type": "application/json"}
    counter = itertools.count()
    state = {"measure_start": None, "stop": False, "done": 0}
    stopped = asyncio.Event()
    records: list[tuple[float, float, str]] = []  # (start, end, outcome) for requests started in the window
    warm_errors: dict[str, int] = {}

    def check(r) -> str:
        if r.status_code != 200:
            return f"http_{r.status_code}"
        try:
            results = r.json()["results"]
            if len(results) != inputs_per_request or any(set(res) != set(tasks) for res in results):
                return "bad_body"
        except (ValueError, KeyError, TypeError):
            return "bad_body"
        return "ok"

    async def worker(client):
        while not state["stop"]:
            body = bodies[next(counter) % len(bodies)]
            t0 = time.perf_counter()
            try:
                outcome = check(await client.post(path, content=body, headers=headers))
            except httpx.HTTPError as exc:
                outcome = type(exc).__name__
            t1 = time.perf_counter()
            start = state["measure_start"]
            if start is not None and t0 >= start:
                records.append((t0, t1, outcome))
                state["done"] += 1
                if state["done"] >= max_requests and not stopped.is_set():
                    stopped.set()
            elif outcome != "ok":
                warm_errors[outcome] = warm_errors.get(outcome, 0) + 1

    cpu = CpuWindow(server.proc.pid)
    workers = [asyncio.create_task(worker(client)) for client in clients]
    try:
        await asyncio.sleep(warmup_s)
        before = parse_metrics((await scraper.get("/metrics")).text)
        cpu.start()
        state["measure_start"] = time.perf_counter()
        try:
            await asyncio.wait_for(stopped.wait(), duration_s)
        except asyncio.TimeoutError:
            pass
        t_stop = time.perf_counter()
        state["stop"] = True
        await asyncio.gather(*workers)
        usage = cpu.stop()
        after = parse_metrics((await scraper.get("/metrics")).text)
    finally:
        state["stop"] = True
        for w in workers:
            w.cancel()
        for client in clients:
            await client.aclose()
        await scraper.aclose()

    window = t_stop - state["measure_start"]
    completed_in_window = [r for r in records if r[1] <= t_stop]
    ok_in_window = sum(1 for r in completed_in_window if r[2] == "ok")
    latencies = [(end - start) * 1000 for start, end, outcome in records if outcome == "ok"]
    errors: dict[str, int] = {}
    for _, _, outcome in records:
        if outcome != "ok":
            errors[outcome] = errors.get(outcome, 0) + 1
    rps = ok_in_window / window
    return {
        "concurrency": concurrency,
        "window_s": round(window, 3),
        "bounded_by": "requests" if stopped.is_set() else "time",
        "requests_recorded": len(records),
        "ok_completed_in_window": ok_in_window,
        "requests_per_s": rps,
        "sequences_per_s": rps * inputs_per_request,
        "latency_ms": summarise_latency(latencies),
        "latencies_ms": latencies,
        "errors": sum(errors.values()),
        "errors_by_kind": errors,
        "warmup_errors_by_kind": warm_errors,
        "server": metrics_delta(before, after),
        "cpu": usage,
    }


def summarise_latency(latencies: list[float]) -> dict:
    if not latencies:
        return {"n": 0, "mean": None, "p50": None, "p95": None, "p99": None, "max": None}
    return {"n": len(latencies), "mean": sum(latencies) / len(latencies), "p50": percentile(latencies, 50),
            "p95": percentile(latencies, 95), "p99": percentile(latencies, 99), "max": max(latencies)}


# ---- results --------------------------------------------------------------------------------------
def fmt(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(stem: Path | str, result: dict, title: str, tables: list[str], notes: str = "") -> Path:
    """`<stem>.json` (the result, with `machine` filled in if missing) and `<stem>.md` (title, the
    machine in one line, the tables, the notes and the command). A bare stem lands in bench/results/."""
    stem = Path(stem)
    if not stem.is_absolute() and stem.parent == Path("."):
        stem = RESULTS / stem
    stem.parent.mkdir(parents=True, exist_ok=True)
    result.setdefault("machine", machine_info())
    result.setdefault("command", " ".join([".venv/bin/python", *sys.argv]))
    m = result["machine"]
    commit = (m["versions"]["tmod_git"]["commit"] or "?")[:10]
    md = [f"# {title}", "",
          f"{m['date']} · {m['cpu_model']} ({vector_flags(m)}), {m['logical_cpus']} logical CPUs · device {m['device']} · "
          f"torch {m['versions']['torch']} · tmod {commit} · load average {m['load_average_at_start_1_5_15min']}", ""]
    for table in tables:
        md += [table, ""]
    if notes:
        md += [notes, ""]
    md += [f"Command: `{result['command']}`", ""]
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    stem.with_suffix(".md").write_text("\n".join(md))
    return stem.with_suffix(".json")


def write_json(path: Path | str, result: dict) -> Path:
    """`path` with the result as JSON, `machine` and `command` filled in if missing (as `write_results`
    does), for results that are nested records rather than one table (bench_attack, long_documents)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    result.setdefault("machine", machine_info())
    result.setdefault("command", " ".join([".venv/bin/python", *sys.argv]))
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return path
