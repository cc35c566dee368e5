"""What every benchmark records about where it ran: machine, device, versions, commit, load."""
from __future__ import annotations

import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


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
    return (cpuinfo_value("flags") or "").split()


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
    from training.data import default_data_dir

    path = Path(data_dir or default_data_dir()) / "sst2" / "validation.tsv"
    if not path.is_file():
        raise SystemExit(f"no SST-2 validation file at {path} (set --data-dir or TMOD_DATA_DIR)")
    lines = path.read_text(encoding="utf-8").splitlines()[1:]  # header; tab-separated, no quoting
    return [s for s in (line.split("\t")[0].strip() for line in lines if line.strip()) if s]
