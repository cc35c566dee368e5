"""The README's front door works as written.

- Its first lines are the two commands that do everything on a fresh machine: the serve command and
  the test command, which is the one `.ci/run` runs, byte for byte; both install the same way, each
  from its own lock.
- Its first request names a route and tasks a real `tmod-serve` (the serve command's settings, the
  shipped store) has, on the serve command's port, and gets the answer the README shows (labels and
  entity offsets; scores depend on the CPU's precision, so they are not compared); and that answer is
  correct: Angela Merkel `PER`, Munich `LOC` (issue 39).
- Its "API at a glance" has an example for every route of the server's OpenAPI schema, and every
  example, sent as written (host and port aside), is answered 200: on the serve command's server, or,
  for an example whose comment says it runs on the quality tier, on `--backbone mpnet` (slow; skipped
  where MPNet is not installed), where the pair example gets the label its comment shows.
"""
from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from server.backbone.sources import mpnet_parts
from tests.helpers import start_tmod_serve

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
ADMIN_TOKEN = "readme-test-token"


# ---- reading the README --------------------------------------------------------------------------
def fenced_blocks(text: str, language: str) -> list[tuple[int, str]]:
    """(offset, body) of every ```<language> block of `text`, in order."""
    return [(m.start(), m.group(1)) for m in re.finditer(rf"^```{language}\n(.*?)^```", text, re.S | re.M)]


def section(title: str) -> str:
    """The text of the README's `## <title>` section, up to the next `## ` heading."""
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end != -1 else None]


def shell_commands(block: str) -> list[str]:
    """The commands of a bash block: comment lines dropped, `\\` continuations joined."""
    commands, current = [], ""
    for line in block.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        piece = line.rstrip("\\").strip()
        current = f"{current} {piece}" if current else piece
        if not line.endswith("\\"):
            commands.append(current)
            current = ""
    return commands


def parse_curl(command: str, env: dict[str, str] | None = None) -> dict:
    """A `curl` command line as {method, url, headers, body}; `$NAME`s in its words expanded from `env`."""
    words = shlex.split(command)
    assert words[0] == "curl", command
    request = {"method": None, "url": None, "headers": {}, "body": None}
    i = 1
    while i < len(words):
        word = words[i]
        if word in ("-X", "--request"):
            request["method"] = words[i + 1]
        elif word in ("-H", "--header"):
            name, value = words[i + 1].split(":", 1)
            value = re.sub(r"\$(\w+)", lambda m: (env or {})[m.group(1)], value.strip())
            request["headers"][name.strip()] = value
        elif word in ("-d", "--data", "--data-raw"):
            request["body"] = words[i + 1]
        elif word.startswith("-"):
            assert word == "-s", f"unexpected curl option {word} in {command}"
            i += 1
            continue
        else:
            assert request["url"] is None, command
            request["url"] = word
            i += 1
            continue
        i += 2
    request["method"] = request["method"] or ("POST" if request["body"] is not None else "GET")
    return request


def split_url(url: str):
    """'localhost:8080/v1/infer?tasks=a' -> (host, port, path, query)."""
    parts = urlsplit(url if "://" in url else "http://" + url)
    return parts.hostname, parts.port, parts.path, parts.query


def setup_commands() -> tuple[str, str]:
    offset, block = fenced_blocks(README, "bash")[0]
    assert README[:offset].count("\n") <= 2, "the two commands must be the README's first lines"
    lines = block.splitlines()
    assert len(lines) == 2, lines
    return lines[0], lines[1]


def first_request() -> tuple[str, dict]:
    """The README's first curl command, and the JSON answer shown after it."""
    blocks = fenced_blocks(README, "bash")
    offset, block = next((o, b) for o, b in blocks[1:] if "curl" in b)
    answer = next(b for o, b in fenced_blocks(README, "json") if o > offset)
    return shell_commands(block)[0], json.loads(answer)


API_EXAMPLES = [c for _, block in fenced_blocks(section("API at a glance"), "bash") for c in shell_commands(block)]
QUALITY_TIER = "runs on the quality tier, `tmod-serve --backbone mpnet`"


def quality_tier_examples() -> dict[str, str]:
    """Commands of the API section whose comments since the command before say they run on the quality
    tier -> the label those comments show."""
    found = {}
    for _, block in fenced_blocks(section("API at a glance"), "bash"):
        comment = ""
        for line in block.splitlines():
            if line.startswith("#"):
                comment += " " + line.lstrip("# ")
            elif line.startswith("curl"):
                if QUALITY_TIER in comment:
                    command = next(c for c in shell_commands(block) if c.startswith(line.rstrip("\\ ")))
                    found[command] = re.search(r'"label": "([^"]+)"', comment).group(1)
                comment = ""
    return found


def example_id(command: str) -> str:
    request = parse_curl(command, {"TMOD_ADMIN_TOKEN": ""})
    return f"{request['method']} {split_url(request['url'])[2]}"


# ---- the two commands ----------------------------------------------------------------------------
def steps(command: str) -> list[str]:
    return [step.strip() for step in command.split("&&")]


def test_the_first_lines_are_the_serve_and_test_commands_and_ci_runs_the_test_command():
    serve, test = setup_commands()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[ci.index("# README test command:") + 1] == test
    assert steps(serve)[-1] == ".venv/bin/tmod-serve --host 127.0.0.1 --port 8080"
    assert steps(test)[-1] == ".venv/bin/python -m pytest -q -n 2 --dist loadfile"
    # the same install, each from its own lock
    assert [s.replace("requirements/serve.lock", "requirements/test.lock") for s in steps(serve)[:-1]] == steps(test)[:-1]
    assert "requirements/serve.lock" in serve and (ROOT / "requirements" / "serve.lock").is_file()


def test_the_first_request_goes_to_the_serve_commands_port_and_shows_a_whole_answer():
    serve, _ = setup_commands()
    command, answer = first_request()
    host, port, path, query = split_url(parse_curl(command)["url"])
    assert host in ("localhost", "127.0.0.1") and str(port) == shlex.split(serve)[-1]
    tasks = parse_qs(query)["tasks"][0].split(",")
    assert sorted(answer["tasks"]) == sorted(tasks) and set(answer["results"][0]) == set(tasks)


def test_the_first_answer_shown_is_correct():
    """Issue 39: the first answer is right, not only the real one (the served test below checks that the
    server answers what is shown): Angela Merkel is a person and Munich a place, nothing else an entity."""
    command, answer = first_request()
    text = json.loads(parse_curl(command)["body"])["inputs"][0]
    entities = answer["results"][0]["ner"]["entities"]
    assert [(e["text"], e["label"]) for e in entities] == [("Angela Merkel", "PER"), ("Munich", "LOC")]
    assert all(text[e["start"]:e["end"]] == e["text"] for e in entities)


def test_the_readme_parsers_see_what_they_should():
    """The helpers above fail on what they must not accept (a test of the test's own reading)."""
    assert shell_commands("# c\ncurl -s a \\\n     -d '{}'\ncurl b\n") == ["curl -s a -d '{}'", "curl b"]
    assert parse_curl("curl -s -X POST 'h:1/p?x=1' -H 'a: $T' -d '{}'", {"T": "v"}) == {
        "method": "POST", "url": "h:1/p?x=1", "headers": {"a": "v"}, "body": "{}"}
    with pytest.raises(AssertionError):
        parse_curl("curl -k h:1/p")
    assert route_pattern("/v2/models/{task}/ready").match("/v2/models/ner/ready")
    assert not route_pattern("/v2/models/{task}").match("/v2/models/ner/ready")
    assert len(API_EXAMPLES) >= 10 and all(c.startswith("curl ") for c in API_EXAMPLES)


# ---- against a real server -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    """tmod-serve as the serve command starts it (the shipped store, the default backbone), with an
    admin token so the admin example can run; its log is kept quiet so its pipe never fills."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMOD_ADMIN_TOKEN": ADMIN_TOKEN}
    url, process = start_tmod_serve(["--host", "127.0.0.1", "--log-level", "warning"], env)
    try:
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)


def send(server: str, command: str) -> httpx.Response:
    request = parse_curl(command, {"TMOD_ADMIN_TOKEN": ADMIN_TOKEN})
    _, _, path, query = split_url(request["url"])
    return httpx.request(request["method"], f"{server}{path}" + (f"?{query}" if query else ""),
                         headers=request["headers"], content=request["body"], timeout=60)


def route_pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)) + "$")


def test_the_first_requests_route_and_tasks_exist_and_it_gets_the_answer_shown(server):
    command, shown = first_request()
    request = parse_curl(command)
    _, _, path, query = split_url(request["url"])
    assert request["method"].lower() in httpx.get(server + "/openapi.json").json()["paths"][path]
    loaded = {t["task"] for t in httpx.get(server + "/v1/tasks").json()["tasks"]}
    assert set(parse_qs(query)["tasks"][0].split(",")) <= loaded

    response = send(server, command)
    assert response.status_code == 200, response.text
    got = response.json()
    assert got.keys() == shown.keys() and got["truncated"] == shown["truncated"] and got["windows"] == shown["windows"]
    assert got["tasks"] == shown["tasks"] and got["model"]["backbone"] == shown["model"]["backbone"]
    assert len(got["results"]) == len(shown["results"])
    for got_row, shown_row in zip(got["results"], shown["results"]):
        assert got_row.keys() == shown_row.keys()
        for task, output in shown_row.items():
            if "entities" in output:
                fields = ("text", "label", "start", "end")
                assert [[e[f] for f in fields] for e in got_row[task]["entities"]] == \
                       [[e[f] for f in fields] for e in output["entities"]]
            elif "labels" in output:  # a multi-label task: its labels; the scores shown may be shortened to a few
                assert got_row[task]["labels"] == output["labels"]
                assert output["scores"].keys() <= got_row[task]["scores"].keys()
            else:
                assert got_row[task]["label"] == output["label"]
                assert got_row[task]["scores"].keys() == output["scores"].keys()


def test_every_route_has_an_example_in_the_api_section(server):
    routes = [(method.upper(), path) for path, item in httpx.get(server + "/openapi.json").json()["paths"].items()
              for method in item]
    examples = [example_id(c) for c in API_EXAMPLES]
    missing = [f"{method} {path}" for method, path in routes
               if not any(e.split(" ", 1)[0] == method and route_pattern(path).match(e.split(" ", 1)[1])
                          for e in examples)]
    assert missing == [], f"routes with no example in the README's 'API at a glance': {missing}"


DEFAULT_TIER_EXAMPLES = [c for c in API_EXAMPLES if c not in quality_tier_examples()]


@pytest.mark.parametrize("command", DEFAULT_TIER_EXAMPLES, ids=[example_id(c) for c in DEFAULT_TIER_EXAMPLES])
def test_every_api_example_is_answered_as_written(server, command):
    host, port, _, _ = split_url(parse_curl(command, {"TMOD_ADMIN_TOKEN": ""})["url"])
    assert (host, port) == ("localhost", 8080), command
    response = send(server, command)
    assert response.status_code == 200, f"{command}\n-> {response.status_code} {response.text[:500]}"


def test_the_pair_example_runs_on_the_quality_tier_and_the_default_tier_leaves_it_out(server):
    """MiniLM's entailment/1 is opt-in (docs/quality.md): the serve command's server does not load it,
    and the README says where the pair example runs and what it answers."""
    examples = quality_tier_examples()
    assert [parse_qs(split_url(parse_curl(c)["url"])[3])["tasks"] for c in examples] == [["entailment"]]
    assert "entailment" not in {t["task"] for t in httpx.get(server + "/v1/tasks").json()["tasks"]}


@pytest.mark.slow
def test_the_quality_tier_examples_get_the_answer_shown():
    try:
        mpnet_parts()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    url, process = start_tmod_serve(["--backbone", "mpnet", "--log-level", "warning"], env)
    try:
        for command, label in quality_tier_examples().items():
            response = send(url, command)
            assert response.status_code == 200, f"{command}\n-> {response.status_code} {response.text[:500]}"
            task = parse_qs(split_url(parse_curl(command)["url"])[3])["tasks"][0]
            assert [row[task]["label"] for row in response.json()["results"]] == [label]
    finally:
        process.terminate()
        process.wait(timeout=60)
