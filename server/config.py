"""Server settings: command-line flags override TMOD_* environment variables override defaults."""
from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from modules_store import DEFAULT_STORE


class SettingError(ValueError):
    """A setting that cannot work with what start-up found (the backbone's limits): tmod-serve says it
    in one line and exits, without a traceback."""


# what stops tmod-serve, its requests drained (server/api/http_limits.py, server/workers/processes.py): SIGHUP too (a
# closed terminal or SSH session), whose default action ended the process at once, its requests unanswered
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TMOD_", extra="ignore")

    host: str = Field("127.0.0.1", description="interface to bind")
    port: int = Field(8080, ge=0, le=65535, description="port to bind (0 = any free port)")
    grpc_port: int | None = Field(None, ge=1, le=65535, description="also serve the Open Inference Protocol v2 over "
                                  "gRPC on this port (KServe's InferenceGRPCClient, tritonclient.grpc; Triton's "
                                  "8001, KServe's 8081), with gRPC's health service (grpc.health.v1) "
                                  "(default: none, HTTP only)")
    workers: int = Field(
        1, ge=1, le=64, description="HTTP worker processes. 1: one process does everything. N > 1: N processes "
        "share the port and do HTTP, JSON, validation, tokenization and decode; one engine process owns the "
        "backbone and the device and batches every worker's requests (as vLLM splits API server and engine). "
        "Size it by CPU: ~3,000 1-input requests/s or ~7,000 inputs/s in 32-input requests "
        "per worker core, plus a core for the engine process (deploy/README.md, Sizing)")
    engines: int = Field(
        1, ge=1, le=16, description="engine processes, each with its own `workers` HTTP workers and its own copy of "
        "the backbone and modules, all on one port (SO_REUSEPORT: the kernel spreads connections over them): for "
        "when one engine process's CPU is what caps the rate. On one GPU, run NVIDIA MPS (docs/gpu.md). N > 1 needs "
        "workers >= 2; its engines join the port as they load (engine 0 first), and /admin module changes are off")
    store: Path = Field(DEFAULT_STORE, description="module store directory")
    backbone: Path | None = Field(None, description="local Hugging Face model directory, or a named offline backbone: "
                                  "minilm (all-MiniLM-L6-v2, the default), mpnet (all-mpnet-base-v2, the quality "
                                  "tier) or smollm2 (SmolLM2-135M-Instruct)")
    bridges: Path | None = Field(None, description="bridge store: bridges from this backbone let modules trained on "
                                 "another backbone serve here (default: <store>/_bridges)")
    device: str = Field("cpu", description="torch device for backbone and heads: cpu, cuda or cuda:N "
                        "(backend onnx then uses ONNX Runtime's CUDAExecutionProvider)")
    tasks: str | None = Field(None, description="comma-separated tasks to load at start, each its newest version this "
                              "backbone serves, or the version named after a slash: 'ner/2,emotion' (a pin holds across "
                              "restarts: a rollback stays rolled back) (default: every task in the store)")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads, and ONNX Runtime's with backend onnx "
                                "(default: the library's choice, one per core; on a CPU in a container whose CPU "
                                "quota is smaller, the quota)")
    backend: Literal["torch", "onnx"] = Field(
        "torch", description="what runs the backbone's layers: torch (PyTorch eager) or onnx (ONNX Runtime, "
        "one exported graph per layer, cached under cache_dir)")
    precision: Literal["auto", "fp32", "bf16", "fp16", "int8"] = Field(
        "auto", description="backbone precision: auto (fp16 with backend torch on cuda, its fp32 products in TF32; "
        "bf16 with backend torch on a CPU with native bfloat16, avx512_bf16 or AMX; fp32 everywhere else); fp32 (exact); bf16 (backend torch: bfloat16 matrix products, "
        "fp32 layer norms and residual stream; such a CPU, or cuda); fp16 (backend torch on a cuda device); "
        "int8 (backend onnx on the CPU: dynamic quantisation)")
    cache_dir: Path | None = Field(None, description="where the named backbones (mpnet, smollm2) are unpacked "
                                   "and exported ONNX graphs cached (default: $XDG_CACHE_HOME/tmod, else "
                                   "~/.cache/tmod)")
    max_inputs: int = Field(64, ge=1, description="most inputs in one request (413 above)")
    max_chars: int = Field(20_000, ge=1, description="most characters in one input text (413 above)")
    max_tokens: int | None = Field(None, ge=16, description="most word pieces in one backbone row: the longest window "
                                   "a request may ask for, 16 (the shortest window) up to the backbone's limit "
                                   "(default: that limit)")
    window_tokens: int | None = Field(
        None, ge=16, description="word pieces per window (special tokens and a text pair included): a longer text is "
        "read in overlapping windows and answered as one (docs/windows.md); truncate cuts a text at one window. "
        "Default: per request, the window measured best for its task types on this backbone where all of them "
        "have one (token tasks: MiniLM 128, MPNet 256; server/windows.py MEASURED_WINDOWS), else the backbone's "
        "trained length where its "
        "sentence-transformers config states one (MiniLM 256, MPNet 384), else its limit")
    window_stride: int | None = Field(
        None, ge=1, description="how far each window starts after the one before (neighbours share window - stride "
        "word pieces), with --window-tokens: window/8 to window (default: three quarters of the window)")
    max_request_tokens: int = Field(
        131072, ge=1, description="most word pieces one request may have read, all its windows counted (413 above)")
    max_tokenize_chars: int = Field(
        100_000, ge=1, description="most characters (texts and text pairs together) one /v1/tokenize or /tokenize "
        "request may have (413 above): bounds its answer, ~25 bytes of JSON per character (2.5 MB at the default, "
        "measured with English text); also the most ids one /decode or /detokenize request may have")
    max_body_bytes: int = Field(2_000_000, ge=1024, description="largest request body in bytes (413 above)")
    max_header_bytes: int = Field(65536, ge=4096, description="largest request line and headers in bytes (400 above, "
                                  "connection closed)")
    header_timeout_s: float = Field(10.0, gt=0, description="a connection that has not sent a whole request head "
                                    "this long after connecting (on a kept-alive connection: after the head's first "
                                    "byte) gets 408 and is closed")
    keep_alive_s: float = Field(5.0, gt=0, description="how long a kept-alive connection may stay idle between "
                                "requests before it is closed (uvicorn's timeout_keep_alive). Behind a proxy or load "
                                "balancer that keeps connections to tmod open, set it above the proxy's idle timeout "
                                "(nginx upstream keepalive 60 s, AWS ALB 60 s): else the proxy can send a request into "
                                "a connection tmod is closing, and its client gets a 502 or 503 (deploy/README.md)")
    body_timeout_s: float = Field(30.0, gt=0, description="a request body still arriving this long after it began: 408")
    retry_after_s: int = Field(1, ge=0, description="the Retry-After header (seconds) on a 429 (queue full)")
    batching: bool = Field(True, description="batch concurrent requests into one backbone pass")
    max_batch_tokens: int = Field(16384, ge=1, description="padded tokens per backbone pass (rows x longest)")
    max_batch_size: int | None = Field(
        None, ge=1, description="most inputs per backbone pass (unset: 512 on cuda, where a 512 x 32-token pass "
        "ran 1.39x the sequences per second of a 128-row one on an H100, see docs/gpu.md; 128 on a CPU)")
    max_padding_ratio: float = Field(
        1.25, ge=1.0, description="with batch_shapes length_runs (the CPU's), a batch is cut into length runs "
        "whose padded tokens stay within this factor of their real tokens, one backbone pass each (a large value: "
        "one pass per batch)")
    max_wait_ms: float = Field(2.0, ge=0, description="how long a batch waits for more requests after its first")
    max_queue: int = Field(256, ge=1, description="requests waiting for compute; beyond this, 429 at once")
    request_timeout_s: float = Field(
        30.0, gt=0, description="one deadline per request, from when its body has been read: a request (every "
        "part of a long one) not taken into a batch by then is answered 503 and its parts not yet run are not run")
    pass_timeout_s: float = Field(
        300.0, ge=0, description="a batch that runs longer is taken for a stuck device (a hung kernel or driver): "
        "the server fails as on a device error (its requests and /healthz answered 503, the process exits non-zero "
        "for its supervisor to start a fresh one); 0: never. Ten times the default request deadline, which no "
        "request of such a batch meets")
    # ---- the model runner (server/runner/): batch shapes, CUDA graphs, head precision -----------
    batch_shapes: Literal["auto", "length_runs", "buckets", "bucket_runs"] = Field(
        "auto", description="how a batch becomes backbone passes: length_runs (rows cut into runs within "
        "max_padding_ratio, one pass each: right on a CPU, where compute scales with padded tokens); buckets (one "
        "pass per batch, rows padded up to a bucket length and the batch up to a bucket size from graph_seq_lens x "
        "graph_batch_sizes: right on a GPU, where a pass costs launches, not padding); bucket_runs (buckets, but a "
        "batch is cut where its rows' bucket length changes when the captured graphs' pass times, measured at "
        "capture, sum to less than the one pass; GPU only, not yet measured served: docs/gpu.md); auto: buckets on "
        "cuda, length_runs on the CPU")
    cuda_graphs: bool = Field(
        True, description="on a cuda device with backend torch, capture the whole pass (backbone and heads) of the "
        "task sets default requests run as one CUDA graph per reachable bucket shape, at start and after each module "
        "change, and replay it (for those sets and their subsets; foreign modules and shapes outside the buckets run "
        "eager); no effect on the CPU")
    graph_batch_sizes: str = Field(
        "1,2,4,8,16,32,64,128,256,512", description="bucket batch sizes (comma-separated); those above "
        "max_batch_size are dropped, except the smallest one that covers it")
    graph_seq_lens: str = Field(
        "16,32,64,128,256,512", description="bucket sequence lengths in tokens (comma-separated); those above "
        "the backbone's token limit are dropped, and the limit itself is the last bucket")
    graph_memory_mb: int = Field(
        4096, ge=0, description="GPU memory the captured graphs may hold (one shared memory pool); capture stops "
        "when it is reached and further shapes run eager (0: capture nothing)")
    head_precision: Literal["auto", "fp32", "bf16", "fp16", "int8"] = Field(
        "auto", description="precision the task heads compute in: fp32, or the backbone's 16-bit precision "
        "(bf16 / fp16, matrix products under torch.autocast); auto: the backbone's bf16 or fp16 on any device "
        "(16-bit heads measured within the accuracy rule on every shipped module of both tiers, and faster on the "
        "CPU too, see docs/gpu.md), fp32 otherwise; int8 (CPU only): the layer-mix heads' per-state projections, most "
        "of many heads' multiply-adds, as int8 products and the rest of the heads in the backbone's precision "
        "(on a CPU with AVX-512 VNNI, 16 heads beside an fp32 backbone served 0.85x the backbone's throughput "
        "against 0.74x for fp32 heads; without VNNI, e.g. AVX2, torch's int8 product is far slower and int8 "
        "heads are much slower than fp32 ones, said at start-up; see docs/gpu.md)")
    admin_token: str | None = Field(None, description="bearer token for /admin endpoints (unset: admin disabled)")
    api_key: str | None = Field(
        None, description="bearer token every other route asks for ('Authorization: Bearer <key>', "
        "as the openai, tritonclient, kserve and huggingface_hub clients send their key or token): 401 without it; "
        "health (/healthz, /readyz, /v2/health/*), /metrics and the schema (/docs, /openapi.json) stay open for "
        "probes and scrapers, /admin keeps its own token. Several keys, comma-separated, are each accepted (to "
        "rotate one: serve new,old, move the clients, then serve new) (unset or empty: no key asked)")
    cors_origins: str | None = Field(
        None, description="browser origins allowed to call the API (CORS): comma-separated scheme://host[:port], "
        "or * for any; preflights from them are answered (before the API key, which browsers send only after) and "
        "every answer to them names the origin (unset: no CORS headers, so pages on other origins cannot read answers)")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="log level of uvicorn's and tmod's log lines: critical, error, warning, info or debug "
        "(either case)")
    log_format: Literal["auto", "json", "text"] = Field(
        "auto", description="log lines as JSON objects (what a log collector parses) or text: auto writes text where "
        "stderr is a terminal, JSON everywhere else (a container, a service, a file)")
    access_log_per_s: float = Field(
        100.0, ge=0, description="most access-log lines (one per request, at info) a process writes per second: "
        "beyond it lines are sampled and the next one written says how many were skipped; a written line costs ~16-24 "
        "us of CPU, a skipped one under 1 us: at the default ~1-2 us per request at 1,000-2,000 requests a second "
        "(docs/host-path-log.md). 0: none. Metrics count every request either way")

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_in_lower_case(cls, value):  # INFO as Python's logging writes it: one name, either case
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _precision_fits_backend(self) -> "Settings":
        # static checks only: a GPU setting must parse on a machine without one (deployment manifests
        # are checked on CPUs); whether the device is there is checked at start (`device_problem`)
        problem = device_name_problem(self.device)
        if self.precision == "auto":
            self.precision = auto_precision(self.backend, self.device)
        if self.max_batch_size is None:
            self.max_batch_size = auto_max_batch_size(self.device)
        problem = problem or precision_problem(self.backend, self.precision, self.device)
        problem = problem or head_precision_problem(self.head_precision, self.precision, self.device)
        problem = problem or sizes_problem("graph_batch_sizes", self.graph_batch_sizes)
        problem = problem or sizes_problem("graph_seq_lens", self.graph_seq_lens)
        problem = problem or (origins_problem(self.cors_origins) if self.cors_origins else None)
        if not problem and self.api_key and "," in self.api_key and not self.api_keys():
            problem = "--api-key / TMOD_API_KEY names no key (only commas): give the key(s), or leave it unset for none"
        if not problem and self.window_stride and not self.window_tokens:
            problem = ("--window-stride / TMOD_WINDOW_STRIDE needs --window-tokens (the window it steps through): "
                       "without it each request's window is chosen by its tasks, and one stride does not fit them all")
        if not problem and self.window_tokens and self.window_stride and self.window_stride > self.window_tokens:
            problem = f"window_stride={self.window_stride} is over window_tokens={self.window_tokens}: windows would skip text"
        if not problem and self.grpc_port is not None and self.grpc_port == self.port:
            problem = f"--grpc-port / TMOD_GRPC_PORT is --port's {self.port}: gRPC needs a port of its own"
        if problem:
            raise ValueError(problem)
        return self

    def bridge_dir(self) -> Path:
        return self.bridges if self.bridges is not None else self.store / "_bridges"

    def task_list(self) -> list[str]:
        """The tasks named in `tasks`, as named (a pinned version included: 'ner/2')."""
        return [t.strip() for t in (self.tasks or "").split(",") if t.strip()]

    def task_pins(self) -> list[tuple[str, str | None]]:
        """(task, the version pinned in `tasks` ('ner/2'), or None for the newest this backbone serves),
        in the order named, a task named twice twice."""
        return [(task.strip(), version.strip() or None)
                for task, _, version in (name.partition("/") for name in self.task_list())]

    def task_versions(self) -> dict[str, str | None]:
        """{task: its pinned version or None} (`task_pins`)."""
        return dict(self.task_pins())

    def api_keys(self) -> list[str]:
        """The API keys accepted (none: no key asked)."""
        return [k.strip() for k in (self.api_key or "").split(",") if k.strip()]


ORIGIN = re.compile(r"https?://[^/\s,*]+")  # a CORS origin: scheme://host[:port], no path


def origins_problem(origins: str) -> str | None:
    """What is wrong with a --cors-origins value, or None: '*' or comma-separated scheme://host[:port]."""
    for origin in (o.strip() for o in origins.split(",")):
        if origin != "*" and not ORIGIN.fullmatch(origin):
            return (f"--cors-origins / TMOD_CORS_ORIGINS: {origin!r} is not an origin: give scheme://host[:port] "
                    "(no path), comma-separated, or * for any")
    return None


# ---- which backend / precision / device combinations exist -----------------------------------------
# Combinations are checked when Settings are built (so a bad setting stops the server before it
# loads anything) and again by `make_backend` (so a benchmark or a test that builds a backend
# directly gets the same message). Whether a cuda device is present is checked at start-up
# (`tmod-serve`, `make_backend`), not when Settings are parsed.
PRECISIONS_BY_BACKEND = {"torch": ("fp32", "bf16", "fp16"), "onnx": ("fp32", "int8")}


def _device_type(device: str) -> str:
    return str(device).split(":", 1)[0].strip().lower()


def precision_problem(backend: str, precision: str, device: str = "cpu") -> str | None:
    """Why (backend, precision, device) cannot run, in one sentence; None when it can."""
    kind = _device_type(device)
    if precision == "int8":
        if backend != "onnx":
            return f"precision int8 needs backend onnx (backend {backend} runs fp32, bf16 or fp16)"
        if kind != "cpu":
            return (f"precision int8 runs on the CPU only (device {device} asked): ONNX Runtime's dynamic "
                    "quantisation has no CUDA kernels; on a GPU use backend torch with precision fp16 or bf16")
        return None
    if precision in ("bf16", "fp16"):
        if backend != "torch":
            return (f"precision {precision} needs backend torch (backend {backend} runs "
                    f"{' or '.join(PRECISIONS_BY_BACKEND.get(backend, ('fp32',)))})")
        if precision == "fp16" and kind != "cuda":
            return (f"precision fp16 needs a cuda device (device {device} asked): CPUs have no fast float16 "
                    "matrix products; on the CPU use precision bf16 (backend torch) or int8 (backend onnx)")
        return None
    if precision != "fp32":
        return f"unknown precision {precision!r}; choose one of fp32, bf16, fp16, int8"
    return None


def head_precision_problem(head_precision: str, precision: str, device: str = "cpu") -> str | None:
    """Heads compute in fp32 or in the backbone's own 16-bit precision (their matrix products run
    under torch.autocast around the whole pass, which would also take the torch backend's fp32
    layers down to 16 bits); int8 heads beside any backbone precision, on the CPU, where they
    were measured."""
    if head_precision == "int8":
        if _device_type(device) != "cpu":
            return (f"head_precision int8 runs on the CPU only (device {device} asked): its speed and accuracy "
                    "were measured there; on a GPU use head_precision auto (the backbone's fp16 or bf16)")
        return None
    if head_precision in ("auto", "fp32") or head_precision == precision:
        return None
    return (f"head_precision {head_precision} needs the backbone in {head_precision} too (precision is {precision}); "
            "heads compute in fp32 or in the backbone's 16-bit precision")


def parse_sizes(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (ascending, unique); ValueError naming the bad entry."""
    sizes = set()
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"{part!r} is not a positive whole number")
        sizes.add(int(part))
    if not sizes:
        raise ValueError("no sizes given")
    return sorted(sizes)


def sizes_problem(name: str, text: str) -> str | None:
    try:
        parse_sizes(text)
    except ValueError as exc:
        return f"{name}={text!r}: {exc} (give comma-separated positive numbers, e.g. 1,2,4,8)"
    return None


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 matrix products natively: avx512_bf16 or AMX, as /proc/cpuinfo
    lists its flags. torch's own check (oneDNN's) says yes to any AVX-512 CPU, which emulates bf16: with
    oneDNN capped at AVX512_CORE_VNNI (a Cascade Lake's or Ice Lake's ISA) on an AVX-512 + AMX Xeon, the
    MiniLM backbone's bf16 passes ran 0.31x fp32's rate at batch 32 and 0.71x at batch 1
    (bench/results/bf16-emulated-cpu-2026-12-02.md).
    Where the flags cannot be read (not Linux, or not x86), torch's check."""
    flags = cpu_flags()
    if flags is not None:
        return not {"avx512_bf16", "amx_bf16"}.isdisjoint(flags)
    import torch

    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def cpu_flags() -> list[str] | None:
    """The CPU's feature flags as /proc/cpuinfo lists them (avx2, avx512_vnni, ...); None where it cannot
    be read (not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].split()
    except OSError:
        pass
    return None


def cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The CPUs a container's CFS quota lets this process use, rounded up: cgroup v2's `cpu.max`, else v1's
    `cpu.cfs_quota_us` / `cpu.cfs_period_us`, as a container sees its own cgroup at `root`. None where no
    quota is set or none can be read (not Linux)."""
    for quota_file, period_file in ((root / "cpu.max", None),
                                    (root / "cpu" / "cpu.cfs_quota_us", root / "cpu" / "cpu.cfs_period_us")):
        try:
            values = quota_file.read_text().split()
            if period_file is not None:
                values.append(period_file.read_text().strip())
            quota, period = int(values[0]), int(values[1])
        except (OSError, ValueError, IndexError):  # "max" (v2) and a missing file: no quota here
            continue
        if quota > 0 and period > 0:  # v1's -1: none
            return max(1, -(-quota // period))
    return None


def quota_threads() -> int | None:
    """The CPUs a container's quota allows where they are fewer than the cores this process may run on,
    else None: the threads torch and ONNX Runtime should take unless told (their default, a thread per
    core, is throttled under a smaller quota: MiniLM's passes (batch 8) under a 1-CPU quota on 2 cores ran
    6.5 a second with torch's 2 threads, 10.2 with 1, p50 160 against 97 ms)."""
    quota = cpu_quota()
    return quota if quota is not None and quota < len(os.sched_getaffinity(0)) else None


def quota_threads_line(threads: int) -> str:
    """What tmod-serve logs and tmod-train says where `quota_threads` chose the threads."""
    return (f"threads: {threads}, as the container's CPU quota allows (this process sees "
            f"{len(os.sched_getaffinity(0))} cores; --threads sets them)")


def auto_precision(backend: str, device: str) -> str:
    """What precision "auto" means: the 16-bit type where it was measured to pay for a negligible
    accuracy cost. Backend torch on cuda: fp16 (within the accuracy rule on every shipped module, an
    fp16 backbone and fp16 heads alike: bench/results/head-precision-cpu.md, fp16 computed on the
    CPU; tensor-core products several times fp32's rate); fp32 matrix products that remain there use TF32
    (server/runner/model_runner.py, `use_device`). Backend torch on a CPU with native bfloat16: bf16
    (bench/results/backends-cpu.md, 1.7-1.9x fp32 at batch 32, shipped modules' metrics within 0.04
    points). fp32 everywhere else (onnx; a CPU that would emulate bfloat16)."""
    if backend == "torch" and _device_type(device) == "cuda":
        return "fp16"
    if backend == "torch" and _device_type(device) == "cpu" and cpu_has_native_bf16():
        return "bf16"
    return "fp32"


def auto_max_batch_size(device: str) -> int:
    """Rows per pass when unset. On cuda 512: a pass costs launches more than rows, and on an H100
    (bench/results/gpu-NVIDIA-H100-80GB-HBM3-engine-2026-11-24.json, CUDA graphs, four heads, fp16) 512
    x 32-token passes ran 117k sequences/s against 84k at 128 rows; the token budget still caps long
    rows (16384 tokens: 128 rows of 128). On a CPU 128, as before: a CPU pass's cost grows with its
    rows, and 512 was not measured there."""
    return 512 if _device_type(device) == "cuda" else 128


def device_name_problem(device: str) -> str | None:
    """Why `device` is not a device name tmod serves on, in one sentence; None when it is one."""
    kind = _device_type(device)
    if kind == "cpu":
        return None
    if kind != "cuda":
        return f"device {device!r} is not supported; choose cpu, cuda or cuda:N"
    index_text = str(device).split(":", 1)[1] if ":" in str(device) else "0"
    if not index_text.isdigit():
        return f"device {device!r}: the cuda index must be a number (cuda:0, cuda:1, ...)"
    return None


def device_problem(device: str) -> str | None:
    """Why `device` cannot be used by torch on this machine, in one sentence; None when it can.
    Imports torch only for a cuda device."""
    problem = device_name_problem(device)
    if problem or _device_type(device) == "cpu":
        return problem
    index_text = str(device).split(":", 1)[1] if ":" in str(device) else "0"
    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        return (f"device {device} asked but torch sees no CUDA device (torch {torch.__version__}, {build}); "
                "use device cpu, or install a CUDA build of torch on a machine with an NVIDIA GPU")
    count = torch.cuda.device_count()
    if int(index_text) >= count:
        return f"device {device} asked but torch sees {count} CUDA device(s) (cuda:0..cuda:{count - 1})"
    return None
