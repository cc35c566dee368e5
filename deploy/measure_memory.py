#!/usr/bin/env python
"""Memory of one tmod-serve replica, for sizing pods (deploy/README.md "Sizing").

Starts real `tmod-serve` processes on 127.0.0.1 (TMOD_THREADS=1, as in the CPU overlay) and reads
their resident memory from /proc (VmRSS now, VmHWM = peak):
1. an empty store: the backbone alone;
2. the load benchmark's store (bench/bench_load.py build_store: random-weight layer-mix heads
   `sentiment`, `ner`, `acceptability`, sized like the tmod-train defaults), after start, after a
   warm-up of short requests (SST-2 sentences, ner+sentiment), and after the largest requests the
   default limits admit: TMOD_MAX_INPUTS (64) inputs of about TMOD_MAX_TOKENS tokens each
   (truncated), which fill one backbone pass of max_batch_tokens.
Head sizes are the servers' own `parameters` from GET /v1/tasks (x 4 bytes, fp32).

    .venv/bin/python deploy/measure_memory.py --out deploy/results/memory-cpu.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_load import build_store, default_data_dir, free_port, read_sentences  # noqa: E402


def proc_memory_mib(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = round(int(value.split()[0]) / 1024, 1)
    return out


def serve(store: Path, threads: int = 1):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMOD_")}
    env.update({"TMOD_HOST": "127.0.0.1", "TMOD_PORT": str(port), "TMOD_STORE": str(store),
                "TMOD_THREADS": str(threads), "TMOD_LOG_LEVEL": "warning", "HF_HUB_OFFLINE": "1"})
    process = subprocess.Popen([str(Path(sys.executable).parent / "tmod-serve")], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit("tmod-serve exited during start-up")
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit("tmod-serve did not become ready")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Memory of one tmod-serve replica (RSS from /proc).")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    args = parser.parse_args(argv)
    sentences = read_sentences(default_data_dir())
    import torch
    import transformers

    commit = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    report = {"command": "python deploy/measure_memory.py", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": platform.platform(), "logical_cpus": os.cpu_count(), "python": platform.python_version(),
              "torch": torch.__version__, "transformers": transformers.__version__, "tmod_git": commit,
              "threads": 1}
    with tempfile.TemporaryDirectory(prefix="tmod-memory-") as tmp:
        empty = Path(tmp) / "empty"
        empty.mkdir()
        process, url = serve(empty)
        try:
            time.sleep(1)
            report["backbone_only_after_start_mib"] = proc_memory_mib(process.pid)
        finally:
            process.terminate()
            process.wait(timeout=60)

        store = Path(tmp) / "store"
        report["store"] = build_store(store, None, seed=0)
        process, url = serve(store)
        try:
            time.sleep(1)
            report["three_heads_after_start_mib"] = proc_memory_mib(process.pid)
            tasks = httpx.get(url + "/v1/tasks", timeout=30).json()["tasks"]
            report["heads"] = {t["task"]: {"parameters": t["parameters"],
                                           "fp32_mib": round(t["parameters"] * 4 / 2**20, 2)} for t in tasks}
            with httpx.Client(base_url=url, timeout=120) as client:
                for text in sentences[:300]:
                    client.post("/v1/infer", params={"tasks": "ner,sentiment"}, json={"inputs": [text]}).raise_for_status()
                report["after_300_short_requests_mib"] = proc_memory_mib(process.pid)
                long_text = " ".join(sentences[:60])  # far beyond the token limit: truncated to it
                body = {"inputs": [long_text[i:] for i in range(64)], "truncate": True}
                for _ in range(3):
                    response = client.post("/v1/infer", json=body)  # every loaded task
                    response.raise_for_status()
                report["largest_request"] = {"inputs": 64, "tasks": sorted(response.json()["tasks"]),
                                             "truncated_inputs": len(response.json()["truncated"])}
                report["after_3_largest_requests_mib"] = proc_memory_mib(process.pid)
        finally:
            process.terminate()
            process.wait(timeout=60)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
