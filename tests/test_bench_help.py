"""Every option of a bench/ or deploy/ script has a help text: a user reads `python bench/X.py --help` before
running a benchmark (minutes of a shared machine, or of a lent GPU's), and `bench_engine_load.py --help` listed
`--tick-ms TICK_MS` and `--warmup WARMUP` with nothing saying what they are or in what unit."""
from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(path for folder in ("bench", "deploy") for path in (REPO / folder).glob("*.py")
                 if "add_argument(" in path.read_text())


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_option_of_a_bench_or_deploy_script_has_its_help(monkeypatch, path):
    """The script runs as `python <path>` up to its parse_args, which records the parser's options and stops it."""
    actions = []

    def record(self, args=None, namespace=None):
        actions.extend(self._actions)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", record)
    monkeypatch.setattr(sys, "argv", [str(path)])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts put their folders first
    with pytest.raises(SystemExit):
        runpy.run_path(str(path), run_name="__main__")
    assert actions, f"{path.name} stopped before parsing its arguments"
    unexplained = [a.option_strings for a in actions if a.option_strings and a.option_strings != ["-h", "--help"]
                   and not a.help]
    assert not unexplained, (path.name, unexplained)
