"""GPU engine benchmark (issue 13 item 8, engine part; issue 14's K sweep): seq/s of one pass.

For each batch shape (B x T tokens), precision and number of random layer-mix heads K (k=64, every
state), a pass through `ModelRunner.logits` (the served path's device part: logits to the host in
one copy) with CUDA graphs off (eager) and on (one graph per plan x bucket), beside the backbone
alone (`Backbone.stream` to the last state, eager and captured by hand as one CUDA graph). Ratios
against the backbone alone are taken in the same run and mode. Writes
bench/results/gpu-<device name>.json. The served path over HTTP is not measured here yet.

    python bench/bench_gpu.py                       # on a cuda machine
    python bench/bench_gpu.py --ks 1 4 --shapes 8x16 --precisions fp32 --device cpu --smoke   # CPU check
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.environment import machine_info  # noqa: E402
from bench.random_heads import build_modules  # noqa: E402
from modules_store import ModuleStore  # noqa: E402
from server.backbone import Backbone  # noqa: E402
from server.config import Settings  # noqa: E402
from server.engine import Engine, Timings  # noqa: E402
from server.runner import ModelRunner  # noqa: E402


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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--backbone", default=None, help="model folder or name (default: minilm)")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    p.add_argument("--shapes", nargs="+", default=["1x32", "32x32", "128x32", "512x32", "128x128"])
    p.add_argument("--precisions", nargs="+", default=["fp16", "bf16", "fp32"])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--smoke", action="store_true", help="CPU check of the script: no graphs, nothing recorded")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("bench_gpu: torch sees no CUDA device (use --device cpu --smoke to check the script)")
    base = Backbone.load(args.backbone, device=args.device)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precisions:
            bb = base if precision == "fp32" else base.use_backend("torch", precision)
            store = ModuleStore(Path(tmp) / "store")
            all_heads = build_modules(store, bb, max(args.ks))
            names = sorted(all_heads)
            for size, tokens in shapes:
                settings = Settings(device=args.device, precision=precision, graph_seq_lens=str(tokens),
                                    graph_batch_sizes=str(size), max_batch_size=size,
                                    max_batch_tokens=size * tokens, graph_memory_mb=60_000)
                text = " ".join(["word"] * (tokens * 2))
                rows = bb.encode([text] * size, truncate=True, max_tokens=tokens)
                modes = [("eager", False)] + ([("graphs", True)] if cuda and not args.smoke else [])
                for mode, graphs in modes:
                    runner = ModelRunner(Engine(bb), settings.model_copy(update={"cuda_graphs": graphs}))
                    prepared = runner.prepare(rows, {names[0]: all_heads[names[0]]}).passes[0]
                    batch, bucket = prepared.batch, prepared.bucket
                    device_batch = runner.prepare(rows, {names[0]: all_heads[names[0]]}).passes[0].batch.to(args.device)
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
                    results.append(row)
                    if graphs:
                        runner.forget_plans()
    device_name = torch.cuda.get_device_name(0) if cuda else "cpu"
    out = {"benchmark": "bench_gpu (engine)", "device": device_name, "machine": machine_info(args.device),
           "command": " ".join(["python", "bench/bench_gpu.py", *(argv if argv is not None else sys.argv[1:])]),
           "results": results}
    if args.smoke:
        print("smoke run: nothing recorded")
        return
    path = args.out or REPO / "bench" / "results" / f"gpu-{re.sub(r'[^A-Za-z0-9]+', '-', device_name).strip('-')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
