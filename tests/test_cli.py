"""tmod-serve flags come from the Settings model: every setting has a flag and an env var."""
from __future__ import annotations

import subprocess
import sys

import pytest

from server.cli import build_parser
from server.config import Settings

pytestmark = pytest.mark.smoke  # the quick tier: every test here


def test_every_setting_has_a_flag_named_after_it():
    parser = build_parser()
    dests = {action.dest for action in parser._actions}
    assert set(Settings.model_fields) <= dests
    args = vars(parser.parse_args(["--no-batching", "--max-wait-ms", "5.5", "--port", "9001", "--tasks", "ner,sentiment"]))
    settings = Settings(**{k: v for k, v in args.items() if v is not None})
    assert settings.batching is False and settings.max_wait_ms == 5.5 and settings.port == 9001
    assert settings.task_list() == ["ner", "sentiment"]


def test_env_vars_feed_settings_and_flags_win(monkeypatch):
    monkeypatch.setenv("TMOD_MAX_INPUTS", "7")
    monkeypatch.setenv("TMOD_BATCHING", "false")
    monkeypatch.setenv("TMOD_PORT", "9100")
    settings = Settings(port=9200)
    assert settings.max_inputs == 7 and settings.batching is False and settings.port == 9200


def test_help_runs():
    out = subprocess.run([sys.executable, "-m", "server.cli", "--help"], capture_output=True, text=True, check=True)
    assert "TMOD_MAX_BATCH_TOKENS" in out.stdout and "--no-batching" in out.stdout
