"""From a labelled file to a served task in one step: `tmod-train layermix --load-into URL` against a
real tmod-serve on loopback (tiny random backbone with the MiniLM tokenizer, real SST-2 rows); the
new task is answered beside `ner` and `sentiment` in one request, and its "none of these"
threshold (manifest decoding.threshold, or the request's threshold) answers label null. A wrong
--store or token is one line before training; a load the server refuses keeps the module and report."""
from __future__ import annotations

import json
import os
import shlex
import subprocess

import httpx
import pytest

from training.cli import main
from training.data.files import default_data_dir
from training.data.presets import PRESETS, preset_spec
from tests.helpers import populate_store, start_tmod_serve

TOKEN = "own-task-token"


@pytest.fixture(scope="module")
def server(tmp_path_factory, train_backbone_dir, train_backbone):
    store = populate_store(tmp_path_factory.mktemp("store"), train_backbone)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMOD_ADMIN_TOKEN": TOKEN}
    url, process = start_tmod_serve(["--backbone", str(train_backbone_dir), "--store", str(store.root)], env)
    yield url, store
    process.kill()
    process.wait(timeout=30)


def test_load_into_serves_the_new_task_beside_the_shipped_ones(server, train_backbone_dir, tmp_path, monkeypatch,
                                                              capsys):
    if not preset_spec(PRESETS["sst2"], "validation").path.is_file():
        pytest.skip(f"shared data not found at {default_data_dir()}")
    url, store = server
    monkeypatch.setenv("TMOD_ADMIN_TOKEN", TOKEN)
    argv = ["layermix", "--dataset", "sst2", "--task", "mood", "--max-train", "96", "--max-validation", "48",
            "--epochs", "1", "--batch-size", "16", "--backbone", str(train_backbone_dir), "--store", str(store.root),
            "--run-dir", str(tmp_path / "run"), "--threads", "1", "--none-below", "0.6", "--load-into", url]
    assert main(argv) == 0
    printed = capsys.readouterr()
    summary = json.loads(printed.out)
    assert summary["loaded_into"] == url and "tasks=mood," in summary["query"]
    assert {"majority", "tfidf_logreg", "margin_over_majority"} <= set(summary["baselines"])
    verdict = summary["baselines"]["verdict"]  # one line on the head against both baselines, where users read
    assert f"against simple baselines: {verdict}" in printed.err
    assert f"- against simple baselines: {verdict}" in (tmp_path / "run" / "report" / "report.md").read_text()

    text = "a gorgeous , witty , seductive movie ."
    response = httpx.post(url + "/v1/infer", params={"tasks": "mood,ner,sentiment"}, json={"inputs": [text]}, timeout=60)
    assert response.status_code == 200, response.text
    result = response.json()["results"][0]
    assert set(result) == {"mood", "ner", "sentiment"}
    mood = result["mood"]
    assert set(mood["scores"]) == {"negative", "positive"}
    # the manifest's threshold (0.6) decides "none of these": an untrained-ish head is unsure
    best = max(mood["scores"].values())
    assert mood["label"] == (max(mood["scores"], key=mood["scores"].get) if best >= 0.6 else None)
    answer = httpx.get(url + "/v1/tasks/mood", timeout=10)
    described = answer.json()["manifest"]
    assert described["decoding"]["threshold"] == 0.6 and described["metrics"]["split"] == "validation"
    # one epoch, and a threshold of the user's (0.6): validation chose neither
    assert described["metrics"]["role"] == "chose nothing (the run kept its last epoch)"
    # the training record (its command, the store's and run's paths, the URL it was loaded into) is the
    # operator's, in the store, not every client's
    assert "training" not in described and str(store.root) not in answer.text and str(tmp_path) not in answer.text
    assert json.loads((store.root / "mood" / "1" / "manifest.json").read_text())["training"]["command"]
    # per request: a threshold over every probability answers none, one under every probability answers the best
    for threshold, expect_none in ((1.0, best < 1.0), (0.0, False)):
        answer = httpx.post(url + "/v1/infer", params={"tasks": "mood"},
                            json={"inputs": [text], "threshold": threshold}, timeout=60).json()["results"][0]["mood"]
        assert (answer["label"] is None) == expect_none, answer


def sst2_args(tmp_path, backbone_dir, store_root, url, task):
    if not preset_spec(PRESETS["sst2"], "validation").path.is_file():
        pytest.skip(f"shared data not found at {default_data_dir()}")
    return ["layermix", "--dataset", "sst2", "--task", task, "--max-train", "64", "--max-validation", "32",
            "--epochs", "1", "--batch-size", "16", "--backbone", str(backbone_dir), "--store", str(store_root),
            "--run-dir", str(tmp_path / "run"), "--threads", "1", "--load-into", url]


def error_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()  # training's progress lines, then the error
    last = err.splitlines()[-1]
    assert last.startswith("tmod-train layermix: error: ") and "Traceback" not in err, err
    return last


def test_load_into_refuses_another_store_or_a_wrong_token_before_training(server, train_backbone_dir, tmp_path,
                                                                         monkeypatch, capsys):
    url, store = server
    monkeypatch.setenv("TMOD_ADMIN_TOKEN", TOKEN)
    elsewhere = tmp_path / "my-store"
    elsewhere.mkdir()
    line = error_line(capsys, sst2_args(tmp_path, train_backbone_dir, elsewhere, url, "elsewhere"))
    assert f"reads its modules from {store.root.resolve()}, not from --store {elsewhere}" in line
    monkeypatch.setenv("TMOD_ADMIN_TOKEN", "not-" + TOKEN)
    line = error_line(capsys, sst2_args(tmp_path, train_backbone_dir, store.root, url, "wrong-token"))
    assert "refused the admin token in $TMOD_ADMIN_TOKEN" in line
    # refused before training: no module written, no run folder
    assert not (elsewhere / "elsewhere").exists() and not (store.root / "wrong-token").exists()
    assert not (tmp_path / "run").exists()


def test_a_head_for_another_backbone_is_refused_before_training(server, tiny_backbone_dir, train_backbone,
                                                                 tmp_path, monkeypatch, capsys):
    url, store = server
    monkeypatch.setenv("TMOD_ADMIN_TOKEN", TOKEN)
    line = error_line(capsys, sst2_args(tmp_path, tiny_backbone_dir, store.root, url, "foreign"))
    assert (f"that server runs {train_backbone.name} ({train_backbone.fingerprint.short}) and loads modules of "
            f"['{train_backbone.name}'] only") in line and "give --backbone the server's" in line
    assert not (store.root / "foreign").exists() and not (tmp_path / "run").exists()  # nothing trained


def test_a_refused_load_keeps_the_trained_module_and_its_report(server, tiny_backbone_dir, tmp_path, monkeypatch,
                                                                 capsys):
    url, store = server
    monkeypatch.setenv("TMOD_ADMIN_TOKEN", TOKEN)
    # trained on another backbone than the server's (and no bridge there), the check above left out: the
    # server itself refuses to load it, after training
    monkeypatch.setattr("training.serving.check_backbone", lambda *args: None)
    line = error_line(capsys, sst2_args(tmp_path, tiny_backbone_dir, store.root, url, "foreign"))
    assert "the server did not load foreign/1 (409)" in line and "the module is saved in" in line
    assert (store.root / "foreign" / "1" / "manifest.json").is_file()
    report = tmp_path / "run" / "report"
    assert f"its report in {report}" in line
    assert "## Serve it, then query it" in (report / "report.md").read_text()  # not "loaded into"
    assert "foreign" not in httpx.get(url + "/v1/tasks", timeout=30).json()["tasks"]


def test_the_printed_request_sends_the_key_a_keyed_server_asks_for(tmp_path, train_backbone_dir, train_backbone,
                                                                   monkeypatch, capsys):
    """A server started with --api-key answers inference only with the key: the curl command that
    `--load-into` prints reads it from $TMOD_API_KEY, and run as printed it is answered."""
    store = populate_store(tmp_path / "store", train_backbone)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMOD_ADMIN_TOKEN": TOKEN, "TMOD_API_KEY": "inference-key"}
    url, process = start_tmod_serve(["--backbone", str(train_backbone_dir), "--store", str(store.root)], env)
    try:
        monkeypatch.setenv("TMOD_ADMIN_TOKEN", TOKEN)
        assert main(sst2_args(tmp_path, train_backbone_dir, store.root, url, "keyed")) == 0
        query = json.loads(capsys.readouterr().out)["query"]
        assert '-H "authorization: Bearer $TMOD_API_KEY"' in query
        for key, status in (("inference-key", 200), ("", 401)):
            answer = subprocess.run(["bash", "-c", query + " -w '\\n%{http_code}'"], capture_output=True, text=True,
                                    timeout=60, env={**os.environ, "TMOD_API_KEY": key})
            body, code = answer.stdout.rsplit("\n", 1)
            assert int(code) == status, answer.stdout
            if status == 200:
                assert "keyed" in json.loads(body)["results"][0]
    finally:
        process.kill()
        process.wait(timeout=30)


def test_a_server_on_another_backbone_is_said_to_answer_through_a_bridge(tiny_backbone, train_backbone, capsys):
    """A head trained on one backbone and loaded into a server on another (through its bridge) was
    reported with its own backbone's numbers alone, as if the server answered so."""
    from training.serving import say_if_bridged

    theirs = {"backbone": {"backbone": tiny_backbone.name, "fingerprint": tiny_backbone.fingerprint.short}}
    say_if_bridged("http://h:1", theirs, "mine", "2", "/s", tiny_backbone)  # its own backbone: nothing to say
    assert capsys.readouterr().err == ""
    say_if_bridged("http://h:1", theirs, "mine", "2", "/s", train_backbone)
    assert capsys.readouterr().err == (
        f"http://h:1 runs on {tiny_backbone.name}: it serves mine/2 through a bridge to {train_backbone.name}, and the "
        f"numbers above are the module's on {train_backbone.name} itself; `tmod-train eval --task mine --version 2 "
        "--store /s --backbone ITS_BACKBONE --bridges ITS_BRIDGE_STORE --file ...` scores it as that server answers\n")


def test_a_saved_version_a_new_server_would_not_serve_is_said(train_backbone_dir, tmp_path, capsys):
    """A named version sorts after every number: a numbered run saved beside `wide-1` is not what a
    tmod-serve started on the store serves, and the run says so with the pin that serves it."""
    store = tmp_path / "store"
    argv = sst2_args(tmp_path, train_backbone_dir, store, "-", "mood")[:-2]  # no --load-into
    assert main([*argv, "--version", "wide-1"]) == 0
    assert "a tmod-serve started on" not in capsys.readouterr().err  # the one it serves
    assert main([*argv, "--run-dir", str(tmp_path / "run-2")]) == 0  # numbered: mood/1
    said = capsys.readouterr().err.splitlines()[-1]
    assert said.startswith(f"a tmod-serve started on {store} serves mood/wide-1, not this mood/1: the latest version")
    assert said.endswith("name mood/1 in its --tasks (TMOD_TASKS) to serve this one, or load it through "
                         "POST /admin/modules/mood/load")


def test_the_printed_serve_command_and_query_work_as_printed(train_backbone_dir, tmp_path, capsys):
    """Without --load-into the run said only the request to send 'once a tmod-serve with this store runs':
    now also the tmod-serve command that serves its store (on its backbone), and both work as printed."""
    if not preset_spec(PRESETS["sst2"], "validation").path.is_file():
        pytest.skip(f"shared data not found at {default_data_dir()}")
    run = tmp_path / "run"
    argv = ["layermix", "--dataset", "sst2", "--task", "mood", "--max-train", "96", "--max-validation", "48",
            "--epochs", "1", "--batch-size", "16", "--backbone", str(train_backbone_dir), "--run-dir", str(run),
            "--threads", "1"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["serve"] == shlex.join(["tmod-serve", "--store", str(run / "store"), "--backbone",
                                           str(train_backbone_dir)])
    assert f"    {summary['serve']}\n\n    {summary['query']}" in (run / "report" / "report.md").read_text()
    # margins as a person reads them: no float difference's tail (0.07000000000000006)
    margins = [v for k, v in summary["baselines"].items()
               if k.startswith("margin_over_") and not k.endswith("_interval")]
    intervals = [end for k, v in summary["baselines"].items() if k.endswith("_interval") for end in v]
    assert len(margins) == 2 and len(intervals) == 4 and all(v == round(v, 6) for v in margins + intervals)

    command = shlex.split(summary["serve"])
    assert command[0] == "tmod-serve"
    url, process = start_tmod_serve(command[1:], {**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        query = summary["query"].replace("http://127.0.0.1:8080", url)
        answer = subprocess.run(["bash", "-c", query + " -w '\\n%{http_code}'"], capture_output=True, text=True,
                                timeout=60)
        body, code = answer.stdout.rsplit("\n", 1)
        assert code == "200", answer.stdout
        assert set(json.loads(body)["results"][0]) == {"mood"}
    finally:
        process.kill()
        process.wait(timeout=30)


def test_a_version_that_replaces_the_served_one_is_said_with_its_labels(server, train_backbone_dir, tmp_path,
                                                                         monkeypatch, capsys):
    """A head trained on one's own file under a task the server answers (the store's `sentiment`) and
    loaded with --load-into replaced, unsaid, what every client got for it, other labels and all, now and
    after a restart: both said, with the request that loads the earlier one back (it does) and the pin
    that keeps it across a restart."""
    url, store = server
    monkeypatch.setenv("TMOD_ADMIN_TOKEN", TOKEN)
    own = tmp_path / "own.csv"
    own.write_text("text,label\n" + "".join(f"the service was {w} {i},{y}\n" for i in range(20)
                                           for w, y in (("great", "good"), ("awful", "bad"))))
    assert main(["layermix", "--train", str(own), "--split", "0.25", "--task", "sentiment", "--epochs", "1",
                 "--backbone", str(train_backbone_dir), "--store", str(store.root), "--run-dir", str(tmp_path / "run"),
                 "--threads", "1", "--no-progress", "--load-into", url]) == 0
    err = capsys.readouterr().err
    labels = "(its labels bad, good; sentiment/1's negative, positive)"
    assert (f"sentiment/2 replaces sentiment/1: a tmod-serve started on {store.root} answers sentiment with this head "
            f"{labels}; --tasks sentiment/1 (TMOD_TASKS) keeps serving sentiment/1") in err
    assert (f"{url} answered sentiment with sentiment/1 until now, and with this sentiment/2 from now on {labels}; "
            'POST /admin/modules/sentiment/load {"version": "1"} loads sentiment/1 back') in err

    def answered_labels() -> set:
        answer = httpx.post(url + "/v1/infer", params={"tasks": "sentiment"}, json={"inputs": ["fine"]}, timeout=60)
        return set(answer.json()["results"][0]["sentiment"]["scores"])

    assert answered_labels() == {"bad", "good"}
    back = httpx.post(url + "/admin/modules/sentiment/load", json={"version": "1"},
                      headers={"authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert back.status_code == 200, back.text
    assert answered_labels() == {"negative", "positive"}


def test_the_printed_request_shows_a_long_document_cut_to_a_readable_example():
    """A task trained on long documents printed (and wrote into report.md) a curl command holding the
    whole first validation document, 3,000 characters of it on one line: the example shows its start,
    cut after a whole word, as pair texts are."""
    from training.serving import EXAMPLE_CHARS, example_request

    document = " ".join(f"word{i}" for i in range(600))
    body = json.loads(shlex.split(example_request("http://h:1", "long", ["ner"], document))[-1])
    text = body["inputs"][0]
    assert document.startswith(text + " ") and len(text) <= EXAMPLE_CHARS and text.split()[-1].startswith("word")
    body = json.loads(shlex.split(example_request("http://h:1", "pairs", [], document, "short one"))[-1])
    assert document.startswith(body["inputs"][0]["text"] + " ") and body["inputs"][0]["text_pair"] == "short one"
    short = json.loads(shlex.split(example_request("http://h:1", "mood", [], "it 's a charming journey ."))[-1])
    assert short["inputs"] == ["it 's a charming journey ."]  # a sentence is shown whole


def test_a_long_text_is_scored_as_the_server_answers_it(tmp_path, train_backbone_dir, train_backbone):
    """Training's validation and test numbers and `tmod-train eval` scored a sequence task's long text
    on its first 512 word pieces (the tiny backbone's first 128), while the server reads it in
    overlapping windows and combines their logits: on 400 documents of SST-2 sentences a head scored
    0.755 where a real tmod-serve answered 0.750. Now each text is scored as the server answers it:
    the probabilities scoring keeps are the ones a real tmod-serve answers, long texts and short."""
    from modules_store import ModuleStore
    from server.modules import load_module
    from training.evaluate import score_module
    from training.settings import TrainSettings
    from training.splits import resolve_data
    from training.states import Split
    from training.trainer import train

    limit = train_backbone.text.max_tokens
    words = ("good fun ", "dull mess ")  # a long text's first window reads otherwise than its others
    texts = [(words[i % 2] * (limit // 2) + words[1 - i % 2] * limit if i % 3 == 0 else words[1 - i % 2] * 3)
             + f"take {i}" for i in range(24)]
    path = tmp_path / "long.tsv"
    path.write_text("sentence\tlabel\n" + "".join(f"{t}\t{'a' if i % 2 else 'b'}\n" for i, t in enumerate(texts)))
    store = tmp_path / "store"
    settings = TrainSettings(train=str(path), validation=str(path), text_column="sentence", label_column="label",
                             backbone=str(train_backbone_dir), task="long", store=str(store),
                             run_dir=str(tmp_path / "run"), project_dim=16, epochs=2, progress=False)
    result = train(settings, backbone=train_backbone)
    assert result.training["data"]["validation_examples_cut"] == 8

    module = load_module(ModuleStore(store), "long", None, train_backbone)
    split = Split(resolve_data(settings).validation, module.head.labels, train_backbone)  # as training read it
    scored: list = []
    score_module(split, module, progress=False, probabilities=scored)
    # served at the precision scored at (fp32; auto is bf16 on a CPU with native bfloat16, 2.6e-4 apart here)
    url, process = start_tmod_serve(["--backbone", str(train_backbone_dir), "--store", str(store), "--tasks", "long",
                                     "--precision", "fp32"], {**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        answer = httpx.post(url + "/v1/infer?tasks=long", json={"inputs": texts}, timeout=120).json()
    finally:
        process.kill()
        process.wait(timeout=30)
    assert answer["windows"].count(1) == 16 and min(w for w in answer["windows"] if w > 1) >= 2
    served = [[row["long"]["scores"][label] for label in module.head.labels] for row in answer["results"]]
    assert max(abs(a - b) for s, v in zip(scored, served) for a, b in zip(s, v)) < 1e-4
