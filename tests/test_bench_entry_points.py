"""Every benchmark that README and docs quote for a figure still runs, at a tiny size: each entry
point in bench/ started as docs say (`.venv/bin/python bench/<script>.py ...`), its results read
back. Timings are not asserted (they are the benchmarks' business); what is asserted is that the
script finishes, writes what its figures come from, and that the served answers had no errors.
bench/bench_gpu.py is covered by tests/test_bench_gpu_smoke.py."""
from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness import markdown_table, vector_flags, write_results

REPO = Path(__file__).resolve().parents[1]


def run_bench(*argv: str, timeout: int = 900) -> str:
    done = subprocess.run([sys.executable, *argv], cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_write_results_writes_the_json_and_a_table_with_machine_and_command(tmp_path):
    result = {"rows": [1, 2]}
    path = write_results(tmp_path / "x", result, "A title", [markdown_table(["a", "b"], [[1, 2]])], "a note")
    recorded = json.loads(path.read_text())
    assert recorded["rows"] == [1, 2] and recorded["machine"]["cpu_flags"] and recorded["command"]
    md = path.with_suffix(".md").read_text()
    assert md.startswith("# A title") and "| a | b |" in md and "| 1 | 2 |" in md and "Command: `" in md
    # the vector units a CPU figure depends on, named beside the CPU (x86 CI machines have avx at least)
    assert f"{recorded['machine']['cpu_model']} ({vector_flags(recorded['machine'])})" in md
    assert "avx" in vector_flags(recorded["machine"]) or platform.machine() != "x86_64"
    assert vector_flags({"cpu_flags": []}) == "flags not recorded"
    python = recorded["machine"]["python"]  # which interpreter ran it, and how fast it runs Python
    assert python["executable"] == sys.executable and python["version"] == platform.python_version()
    assert python["interpreter_loop_ms"] > 0 and isinstance(python["libpython_shared"], bool)
    assert set(recorded["machine"]["cpu_idle"]) == {"driver", "guest_halt_poll_ns"}


def test_a_benchmarks_server_gets_only_the_settings_it_names(monkeypatch, tmp_path):
    """Server settings the shell exported (TMOD_TASKS, oneDNN's) stay out of a benchmark's server, which
    runs and records the ones it names; other variables pass, such as the log files bench/gpu_checks.sh's
    engine patches write to (TMOD_SWITCH_LOG), which a server without them fails on."""
    from bench.harness import ServerProcess

    for name, value in (("TMOD_TASKS", "ner"), ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8"), ("TMOD_SWITCH_LOG", "/x"),
                        ("TMOD_DATA_DIR", "/d")):
        monkeypatch.setenv(name, value)
    server = ServerProcess("s", {"TMOD_THREADS": "1"}, tmp_path / "s.log", ["true"])
    assert "TMOD_TASKS" not in server.env and "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in server.env
    assert server.env["TMOD_SWITCH_LOG"] == "/x" and server.env["TMOD_DATA_DIR"] == "/d"
    assert server.env["TMOD_THREADS"] == "1" and server.settings == {"TMOD_THREADS": "1"}


def test_the_box_speed_probe_runs_python_on_the_cpus_asked():
    from bench.harness import loop_ms_on

    cpu = min(os.sched_getaffinity(0))
    assert loop_ms_on({cpu}) > 0 and loop_ms_on(None) > 0
    with pytest.raises(subprocess.CalledProcessError):  # the child does pin itself: a CPU that is not there fails
        loop_ms_on({(os.cpu_count() or 1) + 7})


def test_a_workers_table_names_its_interpreter_and_idle_polling_where_the_result_recorded_them():
    from bench.bench_frontend import python_and_idle

    python = {"version": "3.11.2", "executable": "/usr/bin/python3.11", "interpreter_loop_ms": 31.2}
    idle = {"driver": "haltpoll", "guest_halt_poll_ns": 3000000}
    assert python_and_idle({"python": python, "cpu_idle": idle}) == (
        "Python 3.11.2 (/usr/bin/python3.11, pure-Python loop 31.2 ms) · "
        "idle vCPUs poll 3,000,000 ns before they halt (haltpoll) · ")
    assert python_and_idle({"cpu_idle": {"driver": None, "guest_halt_poll_ns": None}}) == ""  # not a KVM guest
    assert python_and_idle({}) == ""  # results recorded before either was


def test_every_bridge_command_of_the_transfer_benchmark_parses():
    """transfer.py trains its bridges with tmod-train (minutes each, SmolLM2): its printed commands
    must still be commands tmod-train accepts."""
    from training.cli import build_parser

    lines = run_bench("bench/transfer.py", "--plan").splitlines()
    assert len(lines) >= 8
    for line in lines:
        argv = shlex.split(line)
        assert argv[0].endswith("tmod-train"), line
        build_parser().parse_args(argv[1:])  # a refused command exits (SystemExit): the test fails


def test_the_stand_in_pass_draws_its_logits_again_only_when_a_shape_does_not_fit():
    """bench_frontend's stand-in copies its logits out of a pool drawn once: a batch one row larger than
    any before must not draw it again (each draw is milliseconds of the engine's CPU), only one that does
    not fit; every answer is a fresh copy of the asked shape."""
    import numpy as np

    from bench import bench_frontend

    bench_frontend._POOLS.clear()
    first = bench_frontend.standin_logits((300, 12, 9))
    pool = bench_frontend._POOLS[(3, 9)]
    for shape in [(301, 12, 9), (290, 40, 9), (600, 256, 9)]:
        out = bench_frontend.standin_logits(shape)
        assert tuple(out.shape) == shape and out.dtype == first.dtype
        assert bench_frontend._POOLS[(3, 9)] is pool
        assert not np.shares_memory(out.numpy(), pool)
    bench_frontend.standin_logits((601, 12, 9))
    assert bench_frontend._POOLS[(3, 9)] is not pool and bench_frontend._POOLS[(3, 9)].shape[0] >= 601
    bench_frontend._POOLS.clear()


def test_spread_summarises_recorded_runs_figure_by_figure(tmp_path):
    """`bench_frontend.py --spread` over session 9's six recorded runs gives what docs/host-path-log.md
    quotes for them: the c=64 workers 281 / 256 / 281 / 299 / 235 / 257 µs (all six <= 300), the 32-text
    engine at c=64 10.4 / 10.0 / 10.0 / 10.8 / 9.8 / 12.2 µs per text (three <= 10)."""
    runs = [str(REPO / f"bench/results/frontend-workers-cpu-issue37-session9-2026-11-27-run{i}.json") for i in range(1, 7)]
    cells = [[cell.strip() for cell in line.strip("|").split("|")]
             for line in run_bench("bench/bench_frontend.py", "--spread", *runs).splitlines() if line.startswith("| ")]
    rows = {what: rest for what, *rest in cells}
    median, quartiles, extent, target, met = rows["workers, one-text, c=64 (µs per request)"]
    assert (float(median), extent, target, met) == (268.9, "234.9-299.4", "<= 300", "6 of 6")
    median, quartiles, extent, target, met = rows["engine, 32-text, c=64 (µs per text)"]
    assert (float(median), extent, met) == (10.2, "9.8-12.2", "3 of 6")
    assert rows["engine, one-text, c=256: requests per batch"][-2:] == ["", ""]  # no target, no count

    # a run that is not a --workers --before result: one line naming the run and the missing level
    alone = tmp_path / "alone.json"
    alone.write_text(json.dumps({"levels": [{"workers": 1, "inputs_per_request": 1, "concurrency": 64,
                                              "server_cpu_us_per_request": 200.0}]}))
    done = subprocess.run([sys.executable, "bench/bench_frontend.py", "--spread", str(alone)], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [f"bench_frontend --spread: {alone}: no level (before, --workers 1, "
                                                "1 input(s), c=64); --spread reads `--workers --before` results"]


@pytest.mark.slow
@pytest.mark.parametrize("compare, servers", [((), ("batching_on", "batching_off")),
                                              (("--window-against", "0"), ("window_2ms", "window_0ms"))])
def test_bench_load_runs_both_servers_at_one_level(tmp_path, compare, servers):
    run_bench("bench/bench_load.py", "--levels", "2", "--rounds", "1", "--warmup", "0.2", "--duration", "1",
              "--max-wait-ms", "2", *compare, "--out", str(tmp_path / "load"))
    recorded = json.loads((tmp_path / "load.json").read_text())
    level = recorded["levels"][0]
    assert level["concurrency"] == 2 and level[servers[0]]["requests_per_s"] > 0
    assert level[servers[0]]["errors"] == level[servers[1]]["errors"] == 0
    assert level["ratios"]["of"] == f"{servers[0]} / {servers[1]}"
    assert recorded["servers"][servers[0]]["TMOD_MAX_WAIT_MS"] == "2.0"


@pytest.mark.slow
def test_bench_sharing_runs_every_section(tmp_path):
    run_bench("bench/bench_sharing.py", "--ks", "1", "2", "--max-separate", "2", "--batch-sizes", "2",
              "--rounds", "1", "--repeats", "1", "--early-exit-batch", "2", "--memory-batch", "2",
              "--memory-tokens", "32", "--stem", str(tmp_path / "sharing"))
    recorded = json.loads((tmp_path / "sharing.json").read_text())
    assert set(recorded["throughput"]["2"]["ratios"]) == {"shared_K1_vs_backbone", "shared_K2_vs_backbone",
                                                          "shared_K1_vs_separate_K1", "shared_K2_vs_separate_K2"}
    assert len(recorded["early_exit"]["rows"]) == 7  # MiniLM: states 0..6
    assert all(p["peak_tensor_bytes"] > 0 for p in recorded["memory"]["paths"].values())


@pytest.mark.slow
def test_bench_frontend_quick_runs(tmp_path):
    out = tmp_path / "frontend.json"
    run_bench("bench/bench_frontend.py", "--quick", "--no-profile", "--out", str(out))
    assert json.loads(out.read_text())


@pytest.mark.slow
def test_bench_frontend_engine_only_runs(tmp_path):
    out = tmp_path / "engine.json"
    run_bench("bench/bench_frontend.py", "--engine-only", "--frames", "3", "--out", str(out))
    levels = json.loads(out.read_text())["levels"]
    assert levels and all(level["frames"] == 3 and level["batches"] == 3 for level in levels)


@pytest.mark.slow
def test_quality_rescores_one_task(tmp_path):
    for anchor in (REPO / "bench" / "results").glob("finetune-*.json"):
        shutil.copy(anchor, tmp_path)
    run_bench("bench/quality.py", "--tiers", "minilm", "--tasks", "sentiment", "--results", str(tmp_path))
    row = json.loads((tmp_path / "quality.json").read_text())["tiers"]["minilm"]["tasks"]["sentiment"]
    assert row["layermix"]["metrics"]["accuracy"] > 0.5


@pytest.mark.slow
def test_long_documents_runs_on_a_few_documents(tmp_path):
    out = tmp_path / "long.json"
    run_bench("bench/long_documents.py", "--limit", "3", "--sizes", "2", "--repeats", "1", "--out", str(out))
    assert json.loads(out.read_text())


@pytest.mark.slow
def test_bench_attack_runs_small(tmp_path):
    out = tmp_path / "attack.json"
    run_bench("bench/bench_attack.py", "--requests", "20", "--concurrency", "4", "--burst", "16", "--reload-rounds", "1",
              "--workers", "1", "--out", str(out))
    assert json.loads(out.read_text())


@pytest.mark.slow
def test_head_precision_scores_one_task_in_fp32_and_int8(tmp_path):
    run_bench("bench/head_precision.py", "--tasks", "sentiment", "--limit", "40", "--variants", "int8",
              "--stem", str(tmp_path / "heads"))
    recorded = json.loads((tmp_path / "heads.json").read_text())
    entry = recorded["tasks"]["sentiment"]
    assert entry["examples"] == 40 and set(entry["variants"]) == {"fp32", "int8"}
    assert entry["variants"]["int8"]["value"] > 0.5 and recorded["decision"]["int8"]["lowest_agreement"] >= 0.9
    assert "| sentiment (accuracy, 40 examples) |" in (tmp_path / "heads.md").read_text()


@pytest.mark.slow
def test_measure_memory_mixed_traffic_runs_small(tmp_path):
    """deploy/measure_memory.py (deploy/README.md "Sizing"): the sustained mixed-traffic phase, one tiny
    round on a server per oneDNN cache capacity."""
    run_bench("deploy/measure_memory.py", "--mixed-only", "--mixed-rounds", "1", "--mixed-requests", "16",
              "--onednn-cache", "default,8", "--out", str(tmp_path / "memory.json"))
    recorded = json.loads((tmp_path / "memory.json").read_text())
    assert [level["onednn_primitive_cache_capacity"] for level in recorded["mixed"]] == ["default", "8"]
    for level in recorded["mixed"]:
        (only,) = level["rounds"]
        assert sum(only["answered"].values()) == 16 and only["VmRSS"] > level["after_start_mib"]["VmRSS"] / 2
        assert set(only["answered"]) <= {"200", "400", "422"}
    assert "avx2" in recorded["machine"]["cpu_flags"] or platform.machine() != "x86_64"


@pytest.mark.slow
def test_measure_memory_default_phases_run_small(tmp_path):
    """Its default run: the backbone alone (a server with an empty store, which /readyz answers 503
    no_modules: it waited for a 200 that never came), three heads, short and largest requests, then
    one short level of the worst mix."""
    run_bench("deploy/measure_memory.py", "--worst-clients", "1", "--worst-seconds", "2",
              "--out", str(tmp_path / "memory.json"))
    recorded = json.loads((tmp_path / "memory.json").read_text())
    alone, heads = recorded["backbone_only_after_start_mib"]["VmRSS"], recorded["three_heads_after_start_mib"]["VmRSS"]
    assert 0 < alone < heads * 1.1 and heads <= recorded["after_3_largest_requests_mib"]["VmHWM"]  # two processes: RSS varies
    (level,) = recorded["worst_mix"]
    assert set(level["answered"]["long"]) == {"200"} and level["peak_rss_sampled_mib"] > 0
