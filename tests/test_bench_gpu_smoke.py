"""bench/bench_gpu.py runs on the CPU at toy sizes, so the script is known to work before a GPU is lent
(every section: engine, separate models, Hugging Face pipelines, a real tmod-serve under HTTP load)."""
from __future__ import annotations

import json
import os
import signal
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


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_a_run_ended_by_sigterm_stops_its_server(tmp_path):
    """`timeout` ends a call with SIGTERM: the served section's tmod-serve (its own session, so not
    in the killed group) is stopped, not left holding the device for the next call."""
    path = tmp_path / "gpu.json"
    process = subprocess.Popen([sys.executable, "bench/bench_gpu.py", "--device", "cpu", "--smoke", "--out", str(path),
                                "--sections", "served"], cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    servers = []
    try:
        deadline = time.monotonic() + 600
        while not path.exists() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)  # the first served row: its server is up
        servers = children_of(process.pid)
        assert servers and process.poll() is None
        process.terminate()
        assert process.wait(timeout=60) != 0
        stopped = time.monotonic() + 30
        while any(alive(pid) for pid in servers) and time.monotonic() < stopped:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in servers)
    finally:
        process.kill()
        for pid in filter(alive, servers):
            os.kill(pid, signal.SIGKILL)
