"""bench/bench_gpu.py runs on the CPU at toy sizes, so the script is known to work before a GPU is lent
(every section: engine, separate models, Hugging Face pipelines, a real tmod-serve under HTTP load)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_gpu_smoke_runs_every_section_on_the_cpu():
    done = subprocess.run([sys.executable, "bench/bench_gpu.py", "--device", "cpu", "--smoke"], cwd=REPO,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for line in ("fp32 8x16 eager: backbone", "4x16 eager K=2: shared", "hf_pipelines_4:", "tmod_in_process_4_heads:",
                 "served workers=2 4 input(s) x c=4:", "smoke run: nothing recorded"):
        assert line in out, (line, out[-3000:])
    served = [line for line in out.splitlines() if line.startswith("served ")]
    assert len(served) == 4 and all("errors 0," in line for line in served), served
