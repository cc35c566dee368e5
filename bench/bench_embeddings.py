"""Embeddings in the shared pass: speed as ratios in one run (issue 27).

    python bench/bench_embeddings.py --texts 256 --rounds 3 --threads 1

On the same SST-2 validation sentences, in batches of 32 sent one after another, interleaved
round by round (the median round of each row is kept):

- `st-encode`: sentence-transformers' `SentenceTransformer(<the backbone folder>).encode` in this
  process (fp32, `--threads` torch threads): what an embedding library costs without any server.
- `http-embedding`: a real `tmod-serve` (fp32, the same threads) answering `POST /v1/embeddings`.
- `http-infer-embedding` and `http-infer-embedding-ner-sentiment`: `/v1/infer?tasks=...`.
- `encode-plus-pass-per-task`: `st-encode` plus, per extra task (ner, sentiment), one more backbone
  pass with that task's head in this process (tmod's engine, no HTTP): what one service per task
  costs at least.

Writes bench/results/embeddings-cpu.json (machine, CPU flags, versions, date) and a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.environment import cpu_flags as environment_cpu_flags, machine_info, read_sst2_sentences  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FLAGS_OF_INTEREST = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8",
                     "amx_tile", "f16c")


def cpu_flags() -> dict:
    """The CPU's flags: those that decide fp32/bf16 speed, and the full list."""
    flags = environment_cpu_flags()
    return {"relevant": [f for f in FLAGS_OF_INTEREST if f in flags], "all": flags} if flags else {}


def batches(texts: list[str], size: int) -> list[list[str]]:
    return [texts[i:i + size] for i in range(0, len(texts), size)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS / "embeddings-cpu.json"))
    args = parser.parse_args(argv)

    import httpx
    import sentence_transformers
    import torch
    from sentence_transformers import SentenceTransformer

    from modules_store import DEFAULT_STORE, ModuleStore
    from server.backbone import Backbone, default_backbone_path
    from server.engine import Engine
    from server.modules import load_module
    from tests.helpers import start_tmod_serve

    torch.set_num_threads(args.threads)
    texts = read_sst2_sentences()[:args.texts]
    groups = batches(texts, args.batch_size)
    model = SentenceTransformer(str(default_backbone_path()), device="cpu")
    backbone = Backbone.load()
    engine = Engine(backbone)
    store = ModuleStore(DEFAULT_STORE)
    extra = {task: load_module(store, task, None, backbone) for task in ("ner", "sentiment")}

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    url, process = start_tmod_serve(["--tasks", "embedding,ner,sentiment", "--precision", "fp32", "--threads",
                                     str(args.threads), "--log-level", "warning"], env)
    client = httpx.Client(base_url=url, timeout=300)

    def st_encode():
        for group in groups:
            model.encode(group, batch_size=args.batch_size, normalize_embeddings=True)

    def pass_per_task():
        st_encode()
        with torch.inference_mode():
            for task, module in extra.items():
                for group in groups:  # sorted by length within the batch, as encode and the server do
                    engine.logits(backbone.tokenize(sorted(group, key=len)), {task: module})

    def http_embeddings():
        for group in groups:
            client.post("/v1/embeddings", json={"model": "embedding", "input": group}).raise_for_status()

    def http_infer(tasks):
        def run():
            for group in groups:
                client.post("/v1/infer", params={"tasks": tasks}, json={"inputs": group}).raise_for_status()
        return run

    rows = {"st-encode": st_encode, "http-embedding": http_embeddings,
            "http-infer-embedding": http_infer("embedding"),
            "http-infer-embedding-ner-sentiment": http_infer("embedding,ner,sentiment"),
            "encode-plus-pass-per-task": pass_per_task}
    try:
        for run in rows.values():  # warm-up: first passes, allocator, connections
            run()
        seconds = {name: [] for name in rows}
        for _ in range(args.rounds):
            for name, run in rows.items():
                t0 = time.perf_counter()
                run()
                seconds[name].append(time.perf_counter() - t0)
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=60)

    throughput = {name: len(texts) / statistics.median(s) for name, s in seconds.items()}
    ratios = {
        "http-embedding / st-encode": throughput["http-embedding"] / throughput["st-encode"],
        "infer embedding,ner,sentiment / infer embedding": throughput["http-infer-embedding-ner-sentiment"]
        / throughput["http-infer-embedding"],
        "infer embedding,ner,sentiment / encode + pass per task": throughput["http-infer-embedding-ner-sentiment"]
        / throughput["encode-plus-pass-per-task"],
    }
    out = {
        "benchmark": "embeddings in the shared pass (bench/bench_embeddings.py)",
        "command": "python bench/bench_embeddings.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info("cpu", sentence_transformers=sentence_transformers.__version__),
        "cpu_flags": cpu_flags(),
        "settings": {"texts": len(texts), "batch_size": args.batch_size, "rounds": args.rounds,
                     "threads": args.threads, "precision": "fp32 (server and sentence-transformers)",
                     "data": "SST-2 validation sentences", "backbone": "all-MiniLM-L6-v2"},
        "seconds_per_round": seconds,
        "texts_per_second_median": throughput,
        "ratios": ratios,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    table = markdown(out)
    Path(args.out).with_suffix(".md").write_text(table)
    print(table)


def markdown(out: dict) -> str:
    lines = ["| row | texts/s (median of rounds) |", "|---|---:|"]
    lines += [f"| {name} | {value:.1f} |" for name, value in out["texts_per_second_median"].items()]
    lines += ["", "| ratio | value |", "|---|---:|"]
    lines += [f"| {name} | {value:.2f}x |" for name, value in out["ratios"].items()]
    m = out["machine"]
    lines += ["", f"{m['cpu_model']}, {out['settings']['threads']} thread(s), flags {', '.join(out['cpu_flags'].get('relevant', []))}; "
              f"{out['settings']['texts']} SST-2 sentences in batches of {out['settings']['batch_size']}, "
              f"{out['settings']['rounds']} rounds, {m['date']}, load average at start {m['load_average_at_start_1_5_15min']}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
