"""One install serves and trains: the README's first command's install (its steps before it starts
the server), into a fresh virtual environment, gives console scripts that each run their main job:
`tmod-train layermix` and `tmod-train eval` on a small real file, `tmod-serve` serving what was
trained. Slow (a full install: minutes, PyPI or a local pip cache)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from bench.live_server import free_port
from training.data.files import default_data_dir
from training.data.presets import PRESETS, preset_spec

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def readme_install(venv: Path) -> str:
    """The README's first command up to the server start, with its `.venv` at `venv`."""
    first = re.search(r"^```bash\n(.*?)\n", README, re.M).group(1)
    install, start = first.rsplit(" && ", 1)
    assert "tmod-serve" in start and "pip install" in install, first
    return install.replace(".venv", str(venv))


@pytest.mark.slow
def test_the_readme_install_trains_evaluates_and_serves(tmp_path):
    validation = preset_spec(PRESETS["sst2"], "validation")
    if not validation.path.is_file():
        pytest.skip(f"shared data not found at {default_data_dir()}")
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TMOD_DATA_DIR=str(default_data_dir()))
    subprocess.run(["bash", "-c", readme_install(venv)], cwd=ROOT, env=env, check=True, capture_output=True, timeout=3000)
    # the layer-mix trainer below runs without peft (only `tmod-train lora-mtb` needs it)
    assert subprocess.run([venv / "bin" / "python", "-c", "import peft"], env=env, capture_output=True).returncode != 0

    # a small real file: the first 300 rows of SST-2's validation file, its own header and label column
    rows = validation.path.read_text(encoding="utf-8").splitlines()
    data = tmp_path / "reviews.tsv"
    data.write_text("\n".join(rows[:301]) + "\n", encoding="utf-8")
    store, run = tmp_path / "store", tmp_path / "run"
    train = subprocess.run(
        [venv / "bin" / "tmod-train", "layermix", "--train", data, "--split", "0.2,0.2", "--text-column", "sentence",
         "--label-map", "0=negative,1=positive", "--task", "reviews", "--epochs", "2", "--threads", "1",
         "--store", store, "--run-dir", run],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert train.returncode == 0, train.stderr
    summary = json.loads(train.stdout)
    assert summary["test"]["examples"] == 60 and summary["validation"]["split"] == "validation"
    assert "tfidf_logreg" in summary["baselines"] and (run / "report" / "report.md").is_file()
    assert "\r" not in train.stderr and len(re.findall(r"^epoch \d+/2: ", train.stderr, re.M)) == 2  # no bars: not a tty

    scored = subprocess.run(
        [venv / "bin" / "tmod-train", "eval", "--store", store, "--task", "reviews", "--file", data,
         "--text-column", "sentence", "--label-map", "0=negative,1=positive", "--max-examples", "50"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert scored.returncode == 0, scored.stderr
    rescored = json.loads(scored.stdout)
    assert rescored["metrics"]["examples"] == 50
    assert rescored["file_role"].startswith("training: the file the run carved")  # not held out: said so

    port = free_port()
    server = subprocess.Popen([venv / "bin" / "tmod-serve", "--port", str(port), "--store", store], cwd=tmp_path,
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        answer = httpx.post(url + "/v1/infer", params={"tasks": "reviews"}, json={"inputs": ["a fine film ."]}, timeout=60)
        assert answer.status_code == 200 and answer.json()["results"][0]["reviews"]["label"] in ("negative", "positive")
    finally:
        server.kill()
        server.wait(timeout=30)
