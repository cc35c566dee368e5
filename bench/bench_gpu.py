"""GPU benchmark (issue 13 item 8; issue 14's K sweep). Four sections, each on by default:

* engine: one pass through `ModelRunner.logits` (the served path's device part: logits to the host
  in one copy) with K random layer-mix heads (k=64, every state) for each batch shape (B x T tokens)
  and precision, CUDA graphs off (eager) and on (one graph per plan x bucket), beside the backbone
  alone (`Backbone.stream` to the last state, eager and captured by hand as one CUDA graph). Ratios
  against the backbone alone are taken in the same run and mode.
* separate: K separate models (deep copies of the backbone, one head each, one pass each) against
  the same K heads sharing one pass, per shape, precision and mode.
* pipelines: what a user does today, 4 Hugging Face text-classification pipelines (one model each,
  batch --pipeline-batch) over raw SST-2 sentences, against tmod in process on the same sentences
  (tokenize, one pass for 4 heads, decode: `ModelRunner.run`).
* served: a real `tmod-serve` with the shipped sentiment, ner and acceptability modules on the
  device, under HTTP load from --clients load-generator processes (bench_frontend's raw HTTP/1.1
  clients): 1-input and 32-input requests at c = 64 and 256, for each --workers count; seq/s,
  req/s, p50/p99, errors, the achieved batch size from /metrics, and CPU per request of the engine
  process, each worker and the load generator. The server and the generator run on CPUs apart
  (--server-cpus, --generator-cpus; default half each), so the benchmark does not measure itself.
  --engines N serves with N engine processes (tmod-serve --engines, each with its --workers):
  their CPU is summed in the engine figure and listed apart.

Writes bench/results/gpu-<device name>.json, rewritten after every row (with each section's seconds),
so a run stopped at a time limit keeps what it measured.

    python bench/bench_gpu.py                       # on a cuda machine, every section
    python bench/bench_gpu.py --sections served --workers 1 4
    python bench/bench_gpu.py --device cpu --smoke  # CPU check of the script: tiny sizes, nothing recorded
    timeout 540 python bench/bench_gpu.py --sections served --out $OUT/gpu-served.json   # on a lent GPU:
                                                    # SIGTERM stops the server, rows so far are kept

SST-2 is read from --data-dir ($TMOD_DATA_DIR, default ../shared/data); on a device host without
../shared, carry a copy in an ignored folder (bench/README.md).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_frontend import add_cpu_split, cpu_list  # noqa: E402
from bench.harness import machine_info, read_sst2_sentences  # noqa: E402
from bench.random_heads import build_modules  # noqa: E402
from modules_store import ModuleStore  # noqa: E402
from server.backbone import Backbone  # noqa: E402
from server.config import Settings  # noqa: E402
from server.engine import Engine  # noqa: E402
from server.timings import Timings  # noqa: E402
from server.runner.model_runner import ModelRunner# noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def seconds_per_call(fn, device: str, repeats: int) -> float:
    for _ in range(3):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / repeats


def backbone_pass(bb: Backbone, batch):
    """The backbone alone: every state streamed, the last one returned."""
    last = None
    for _, hidden in bb.stream(batch, upto=bb.num_layers):
        last = hidden
    return last


def backbone_graph(bb: Backbone, batch, device: str):
    """`backbone_pass` captured as one CUDA graph by hand (warm-up on a side stream first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(2):
            backbone_pass(bb, batch)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        backbone_pass(bb, batch)
    return graph.replay


def engine_section(args, base: Backbone, cuda: bool, tmp: Path):
    """Yields a row per precision x shape x mode."""
    shapes = [parse_shape(s) for s in args.shapes]
    for precision in args.precisions:
        bb = with_precision(base, precision)
        store = ModuleStore(tmp / f"engine-{precision}")
        all_heads = build_modules(store, bb, max(args.ks))
        names = sorted(all_heads)
        for size, tokens in shapes:
            rows = sample_rows(bb, size, tokens)
            for mode, graphs in modes(args, cuda):
                runner = shape_runner(bb, args.device, precision, size, tokens, graphs)
                prepared = runner.prepare(rows, {names[0]: all_heads[names[0]]}).passes[0]
                batch, bucket = prepared.batch, prepared.bucket
                # the backbone alone reads a device copy: `to` moves a batch's tensors in place, and the
                # runner takes the host batch (pinned, copied into its inputs)
                device_batch = copy.copy(batch).to(args.device)
                with torch.inference_mode(), runner.precision():
                    alone = (backbone_graph(bb, device_batch, args.device) if graphs
                             else (lambda: backbone_pass(bb, device_batch)))
                    t_backbone = seconds_per_call(alone, args.device, args.repeats)
                row = {"precision": precision, "batch": size, "tokens": tokens, "mode": mode,
                       "backbone_seq_per_s": size / t_backbone, "k": {}}
                print(f"{precision} {size}x{tokens} {mode}: backbone {size / t_backbone:,.0f} seq/s", flush=True)
                for k in args.ks:
                    modules = {n: all_heads[n] for n in names[:k]}
                    try:
                        t = seconds_per_call(lambda: runner.logits(batch, bucket, modules, Timings()),
                                             args.device, args.repeats)
                    except Exception as exc:  # noqa: BLE001  (record, e.g. out of memory at K=64 x 512)
                        row["k"][str(k)] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                        continue
                    row["k"][str(k)] = {"seq_per_s": size / t, "ms_per_pass": 1000 * t,
                                        "vs_backbone": t_backbone / t,
                                        "graphs_captured": runner.graphs.captures if graphs else 0}
                    print(f"  K={k}: {size / t:,.0f} seq/s ({t_backbone / t:.2f}x backbone, "
                          f"{1000 * t:.2f} ms)", flush=True)
                yield row
                if graphs:
                    runner.forget_plans()


def separate_section(args, base: Backbone, cuda: bool, tmp: Path):
    """K models of one head each, every one a deep copy of the backbone with its own runner (and,
    with graphs, its own captured pass), run one after the other, against one shared pass. Yields a
    row per precision x shape x mode."""
    from server.modules import load_module

    most = max(args.separate_ks)
    for precision in args.precisions:
        bb = with_precision(base, precision)
        store = ModuleStore(tmp / f"separate-{precision}")
        heads = build_modules(store, bb, most)
        names = sorted(heads)
        copies = [with_precision(Backbone(copy.deepcopy(base.model), base.tokenizer, name=base.name), precision)
                  for _ in range(most)]
        own = [{name: load_module(store, name, None, copy_bb, args.device)} for name, copy_bb in zip(names, copies)]
        for size, tokens in (parse_shape(s) for s in args.separate_shapes):
            rows = sample_rows(bb, size, tokens)
            for mode, graphs in modes(args, cuda):
                shared = shape_runner(bb, args.device, precision, size, tokens, graphs)
                runners = [shape_runner(copy_bb, args.device, precision, size, tokens, graphs) for copy_bb in copies]
                prepared = shared.prepare(rows, own[0]).passes[0]
                row = {"precision": precision, "batch": size, "tokens": tokens, "mode": mode, "k": {}}
                for k in args.separate_ks:
                    modules = {n: heads[n] for n in names[:k]}

                    def apart(k=k):
                        for runner, mods in zip(runners[:k], own[:k]):
                            runner.logits(prepared.batch, prepared.bucket, mods, Timings())
                    t_shared = seconds_per_call(lambda: shared.logits(prepared.batch, prepared.bucket, modules,
                                                                      Timings()), args.device, args.repeats)
                    t_apart = seconds_per_call(apart, args.device, args.repeats)
                    row["k"][str(k)] = {"shared_seq_per_s": size / t_shared, "separate_seq_per_s": size / t_apart,
                                        "shared_vs_separate": t_apart / t_shared}
                    print(f"{precision} {size}x{tokens} {mode} K={k}: shared {size / t_shared:,.0f} seq/s, "
                          f"{k} separate {size / t_apart:,.0f} seq/s ({t_apart / t_shared:.2f}x)", flush=True)
                yield row
                for runner in (shared, *runners):
                    runner.forget_plans()
        del copies


def pipelines_section(args, base: Backbone, cuda: bool, tmp: Path, sentences: list[str]):
    """4 Hugging Face text-classification pipelines (one model each) over raw sentences, against
    tmod serving 4 heads from one pass on the same sentences, both in the served precision. Yields
    one row."""
    import transformers
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    from server.backbone.sources import resolve_backbone

    precision = "fp16" if cuda else "fp32"
    dtype = {"fp16": torch.float16, "fp32": torch.float32}[precision]
    texts = (sentences * (args.pipeline_sentences // len(sentences) + 1))[:args.pipeline_sentences]
    path, _ = resolve_backbone(args.backbone)
    tokenizer = AutoTokenizer.from_pretrained(path)
    pipes = []
    transformers.logging.set_verbosity_error()  # each load reports its new (random) classifier
    for _ in range(4):  # a model per task, as each task is a fine-tuned model of its own today
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2).to(args.device, dtype).eval()
        pipes.append(pipeline("text-classification", model=model, tokenizer=tokenizer, device=torch.device(args.device),
                              batch_size=args.pipeline_batch))

    def run_pipelines(texts):
        for pipe in pipes:
            pipe(texts)

    bb = with_precision(base, precision)
    modules = build_modules(ModuleStore(tmp / "pipelines"), bb, 4)
    runner = ModelRunner(Engine(bb), Settings(device=args.device, precision=precision,
                                              max_batch_size=args.pipeline_batch))

    def run_tmod(texts):
        for i in range(0, len(texts), args.pipeline_batch):
            runner.run(bb.encode(texts[i:i + args.pipeline_batch], truncate=True), modules)

    out = {"precision": precision, "sentences": len(texts), "batch": args.pipeline_batch, "tasks": 4}
    for name, run in (("hf_pipelines_4", run_pipelines), ("tmod_in_process_4_heads", run_tmod)):
        run(texts[:2 * args.pipeline_batch])  # warm-up: allocator, kernels, captured graphs
        sync(args.device)
        t0 = time.perf_counter()
        run(texts)
        sync(args.device)
        seconds = time.perf_counter() - t0
        out[name] = {"seconds": seconds, "seq_per_s": len(texts) / seconds}
        print(f"{name}: {len(texts) / seconds:,.0f} seq/s", flush=True)
    out["tmod_vs_pipelines"] = out["hf_pipelines_4"]["seconds"] / out["tmod_in_process_4_heads"]["seconds"]
    yield out


def served_section(args, sentences: list[str], tmp: Path):
    """A real tmod-serve per --workers count, under HTTP load at each level (inputs x concurrency).
    Yields a row per workers x level."""
    import httpx

    from bench.bench_frontend import TASKS, measure
    from bench.harness import ServerProcess, metrics_delta, parse_metrics, serve_command

    levels = [parse_shape(level) for level in args.levels]
    bodies = {n: [json.dumps({"inputs": sentences[i * n:(i + 1) * n]}).encode() for i in range(len(sentences) // n)]
              for n in {n for n, _ in levels}}
    for workers in args.workers:
        env = {"TMOD_STORE": str(REPO / "modules_store"), "TMOD_TASKS": ",".join(TASKS), "TMOD_DEVICE": args.device,
               "TMOD_WORKERS": str(workers), "TMOD_ENGINES": str(args.engines), "TMOD_BATCH_SHAPES": args.batch_shapes,
               "TMOD_LOG_LEVEL": "warning", "TMOD_MAX_INPUTS": "64", "TMOD_MAX_QUEUE": "100000",
               "TMOD_MAX_WAIT_MS": str(args.max_wait_ms),
               **({"TMOD_BACKBONE": str(args.backbone)} if args.backbone else {})}
        server = ServerProcess(f"served-w{workers}", env, tmp / f"served-w{workers}.log", serve_command(),
                               cpus=args.server_cpus)
        server.start()
        LIVE_SERVERS.append(server)
        try:
            server.wait_ready(900, args.engines, workers)
            for inputs, concurrency in levels:
                before = parse_metrics(httpx.get(server.url + "/metrics", timeout=30).text)
                run = measure(server, bodies[inputs], inputs, concurrency, args.clients, args.warmup, args.duration,
                              generator_cpus=args.generator_cpus)
                after = parse_metrics(httpx.get(server.url + "/metrics", timeout=30).text)
                run = {"workers": workers, "engines": args.engines, "batch_shapes": args.batch_shapes, **run,
                       "batches": metrics_delta(before, after)}
                lat = run["latency_ms"]
                engines = f" engines={args.engines}" if args.engines > 1 else ""
                print(f"served workers={workers}{engines} {inputs} input(s) x c={concurrency}: {run['requests_per_s']:,} req/s, "
                      f"{run['sequences_per_s']:,} seq/s, p50 {lat['p50'] or 0:.1f} ms, p99 {lat['p99'] or 0:.1f} ms, "
                      f"errors {run['errors']}, mean batch {run['batches']['mean_batch_inputs']} inputs / "
                      f"{run['requests_per_batch']} requests; CPU us/request engine {run['engine_process_cpu_us_per_request']}"
                      + (f" {run.get('each_engine_cpu_us_per_request')}" if args.engines > 1 else "")
                      + f", workers {run['each_worker_cpu_us_per_request']}, generator {run['generator_cpu_us_per_request']}"
                      f"; passes {run['batches']['passes_by_path']}, pageable {run['batches']['pageable_passes']}"
                      f", graphs {run['batches']['cuda_graphs']} ({run['batches']['cuda_graph_memory_mib']} MiB)"
                      f"; engine threads (cores) " + " ".join(f"{t['name']}{'(main)' if t['main'] else ''}={t['cores']}"
                                                             for t in run["server_busiest_threads"][:5]),
                      flush=True)
                yield run
        except BaseException:
            print(server.log_tail(), flush=True)
            raise
        finally:
            server.stop()
            LIVE_SERVERS.remove(server)
            # why passes ran eager where graphs are captured (server/runner/model_runner.py says it once per shape, and
            # once where the graph memory cap stopped capture)
            for line in [line for line in server.log_tail(100_000).splitlines()
                         if "ran eager" in line or "not captured" in line or "--graph-memory-mb" in line][:30]:
                print("server said:", line[:800], flush=True)


# ---- helpers -------------------------------------------------------------------------------------
LIVE_SERVERS: list = []  # the served section's running tmod-serve, for stop_on_sigterm


def stop_on_sigterm() -> None:
    """A call's time limit (`timeout`) ends the run with SIGTERM. tmod-serve runs in a session of its
    own, so the signal does not reach it: stop it here, then exit (every finished row is saved).
    The handler does the work itself rather than raising: an exception raised where Python ignores
    them (a fork hook of the load generators' processes) would let the run go on."""
    main = os.getpid()

    def handler(signum, frame):
        if os.getpid() == main:  # not in a forked load-generator process
            for server in list(LIVE_SERVERS):
                server.stop()
            sys.stdout.flush()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def parse_shape(text: str) -> tuple[int, int]:
    """'128x32' -> (128, 32)"""
    first, second = text.lower().split("x")
    return int(first), int(second)


def with_precision(bb: Backbone, precision: str) -> Backbone:
    return bb if precision == "fp32" else bb.use_backend("torch", precision)


def sample_rows(bb: Backbone, size: int, tokens: int):
    """`size` rows of exactly `tokens` tokens."""
    return bb.encode([" ".join(["word"] * (tokens * 2))] * size, truncate=True, max_tokens=tokens)


def modes(args, cuda: bool) -> list[tuple[str, bool]]:
    return [("eager", False)] + ([("graphs", True)] if cuda and not args.smoke else [])


def shape_runner(bb: Backbone, device: str, precision: str, size: int, tokens: int, graphs: bool) -> ModelRunner:
    """A runner whose one bucket is this shape (graphs captured on first use when on)."""
    settings = Settings(device=device, precision=precision, graph_seq_lens=str(tokens), graph_batch_sizes=str(size),
                        max_batch_size=size, max_batch_tokens=size * tokens, graph_memory_mb=60_000,
                        cuda_graphs=graphs)
    return ModelRunner(Engine(bb), settings)


SECTIONS = ("engine", "separate", "pipelines", "served")
SECTION_KEYS = {"engine": "results", "separate": "separate", "pipelines": "pipelines", "served": "served"}  # in the JSON


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="torch device of every section: cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--backbone", default=None, help="model folder or name (default: minilm)")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                   help=f"sections to run, in this order (default all: {' '.join(SECTIONS)})")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64],
                   help="engine: numbers of heads K on one pass (default 1 4 8 16 32 64)")
    p.add_argument("--shapes", nargs="+", default=["1x32", "32x32", "128x32", "512x32", "128x128"],
                   help="engine: batch shapes, rows x tokens (default 1x32 32x32 128x32 512x32 128x128)")
    p.add_argument("--precisions", nargs="+", default=["fp16", "bf16", "fp32"],
                   help="engine, separate: backbone precisions, of fp16 bf16 fp32 (default all three)")
    p.add_argument("--repeats", type=int, default=30,
                   help="engine, separate: timed calls per figure, their mean (after 3 untimed)")
    p.add_argument("--separate-ks", type=int, nargs="+", default=[1, 4, 8], help="separate: numbers of models")
    p.add_argument("--separate-shapes", nargs="+", default=["1x32", "128x32"],
                   help="separate: batch shapes, rows x tokens (default 1x32 128x32)")
    p.add_argument("--pipeline-sentences", type=int, default=4096, help="pipelines: SST-2 sentences (repeated)")
    p.add_argument("--pipeline-batch", type=int, default=128,
                   help="pipelines: sentences per batch, for the pipelines and for tmod alike")
    p.add_argument("--levels", nargs="+", default=["1x64", "1x256", "32x64", "32x256"],
                   help="served: inputs per request x concurrency")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 4], help="served: tmod-serve --workers counts")
    p.add_argument("--engines", type=int, default=1,
                   help="served: tmod-serve --engines (engine processes, each with --workers workers; N > 1 needs "
                        "workers >= 2; on one GPU with NVIDIA MPS where its daemon runs, docs/gpu.md)")
    p.add_argument("--batch-shapes", default="auto", choices=["auto", "buckets", "bucket_runs", "length_runs"],
                   help="served: TMOD_BATCH_SHAPES (auto: buckets on cuda)")
    p.add_argument("--clients", type=int, default=8, help="served: load-generator processes")
    p.add_argument("--warmup", type=float, default=3.0, help="served: unrecorded seconds per level")
    p.add_argument("--duration", type=float, default=10.0, help="served: recorded seconds per level")
    p.add_argument("--max-wait-ms", type=float, default=2.0, help="served: TMOD_MAX_WAIT_MS")
    p.add_argument("--server-cpus", type=cpu_list, default=None,
                   help="served: CPUs tmod-serve runs on, e.g. 0-7 (default: the first half of the usable CPUs)")
    p.add_argument("--generator-cpus", type=cpu_list, default=None,
                   help="served: CPUs the load generator runs on (default: the rest), apart from the server's")
    p.add_argument("--data-dir", type=Path, default=None, help="where sst2/validation.tsv is")
    p.add_argument("--smoke", action="store_true",
                   help="CPU check of the script: small sizes, no graphs, nothing recorded unless --out is given")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default bench/results/gpu-<device name>.json); rewritten after every row")
    args = p.parse_args(argv)
    add_cpu_split(args)
    stop_on_sigterm()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("bench_gpu: torch sees no CUDA device (use --device cpu --smoke to check the script)")
    if args.smoke:  # sizes a 2-core CPU runs in a minute or two
        args.ks, args.shapes, args.precisions, args.repeats = [1, 4], ["8x16"], ["fp32"], 2
        args.separate_ks, args.separate_shapes = [1, 2], ["4x16"]
        args.pipeline_sentences, args.pipeline_batch = 64, 32
        args.levels, args.workers, args.clients, args.warmup, args.duration = ["1x4", "4x4"], [1, 2], 2, 1.0, 2.0
    base = Backbone.load(args.backbone, device=args.device)
    device_name = torch.cuda.get_device_name(0) if cuda else "cpu"
    out = {"benchmark": "bench_gpu", "device": device_name, "machine": machine_info(args.device),
           "command": " ".join(["python", "bench/bench_gpu.py", *(argv if argv is not None else sys.argv[1:])]),
           "server_cpus": sorted(args.server_cpus), "generator_cpus": sorted(args.generator_cpus)}
    needs_text = {"pipelines", "served"} & set(args.sections)
    sentences = read_sst2_sentences(args.data_dir) if needs_text else []
    path = None if args.smoke and not args.out else (
        args.out or REPO / "bench" / "results" / f"gpu-{re.sub(r'[^A-Za-z0-9]+', '-', device_name).strip('-')}.json")

    def save() -> None:
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".partial")
            partial.write_text(json.dumps(out, indent=2))
            partial.replace(path)  # never a half-written file, even if the run is killed here

    # every row is saved as it comes: a run stopped at a time limit (a lent GPU's call) keeps what it measured
    out["seconds"] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sections = {"engine": lambda: engine_section(args, base, cuda, tmp),
                    "separate": lambda: separate_section(args, base, cuda, tmp),
                    "pipelines": lambda: pipelines_section(args, base, cuda, tmp, sentences),
                    "served": lambda: served_section(args, sentences, tmp)}
        for name in (name for name in SECTIONS if name in args.sections):
            t0 = time.perf_counter()
            rows = out[SECTION_KEYS[name]] = []
            for row in sections[name]():
                rows.append(row)
                save()
            out["seconds"][name] = round(time.perf_counter() - t0, 1)
            print(f"[{name}: {out['seconds'][name]:.0f} s]", flush=True)
            save()
    print(f"wrote {path}" if path else "smoke run: nothing recorded")


if __name__ == "__main__":
    main()
