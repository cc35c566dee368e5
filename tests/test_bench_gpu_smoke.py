"""bench/bench_gpu.py runs on the CPU at toy sizes, so the script is known to work before a GPU is lent
(every section: engine, separate models, Hugging Face pipelines, a real tmod-serve under HTTP load)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_gpu_smoke_runs_every_section_on_the_cpu(tmp_path):
    path = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, "bench/bench_gpu.py", "--device", "cpu", "--smoke", "--out", str(path)],
                          cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for line in ("fp32 8x16 eager: backbone", "4x16 eager K=2: shared", "hf_pipelines_4:", "tmod_in_process_4_heads:",
                 "served workers=2 4 input(s) x c=4:", f"wrote {path}"):
        assert line in out, (line, out[-3000:])
    served = [line for line in out.splitlines() if line.startswith("served ")]
    assert len(served) == 4 and all("errors 0," in line for line in served), served
    recorded = json.loads(path.read_text())
    assert set(recorded["seconds"]) == {"engine", "separate", "pipelines", "served"}
    assert [row["batch"] for row in recorded["results"]] == [8] and set(recorded["results"][0]["k"]) == {"1", "4"}
    assert recorded["pipelines"][0]["tmod_vs_pipelines"] > 0
    assert [row["workers"] for row in recorded["served"]] == [1, 1, 2, 2]
    assert all(row["errors"] == 0 for row in recorded["served"])


@pytest.mark.slow
def test_a_run_stopped_midway_keeps_the_rows_it_measured(tmp_path):
    """A lent GPU's call ends at a time limit: the JSON holds every finished row, whole."""
    path = tmp_path / "gpu.json"
    process = subprocess.Popen([sys.executable, "bench/bench_gpu.py", "--device", "cpu", "--smoke", "--out", str(path),
                                "--sections", "engine", "pipelines"], cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while not path.exists() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
    finally:
        process.kill()
        process.wait()
    recorded = json.loads(path.read_text())
    assert recorded["results"] and set(recorded["results"][0]["k"]) == {"1", "4"}
    assert "pipelines" not in recorded["seconds"]  # stopped during the next section (~4 s here)
