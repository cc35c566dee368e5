"""From a trained module to a served one: `--load-into URL` hot-loads it into a running tmod-serve
through the admin API (the token the server's admin routes expect, from $TMOD_ADMIN_TOKEN), and the
request that queries the new task beside the ones already served."""
from __future__ import annotations

import json
import os
import shlex
import sys
import urllib.error
import urllib.request
from pathlib import Path

from modules_store import ArtifactError, ModuleStore
from server.backbone.sources import named_for
from server.modules import servable_version, servable_versions
from training.data.files import UsageError

TOKEN_VARIABLE = "TMOD_ADMIN_TOKEN"  # what tmod-serve reads its admin token from
TIMEOUT_S = 30
EXAMPLE_CHARS = 200  # longest text an example request shows


def _call(url: str, method: str = "GET", body: dict | None = None, token: str | None = None) -> dict:
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    with urllib.request.urlopen(urllib.request.Request(url, data, headers, method=method), timeout=TIMEOUT_S) as reply:
        return json.loads(reply.read() or b"{}")


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        return json.loads(exc.read())["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {exc.code}"


def check_server(url: str, store: str | None) -> dict:
    """Before any training: a tmod-serve answers at `url`, takes the token in $TMOD_ADMIN_TOKEN and
    allows module changes, and reads its modules from `store` (where this server's machine shares the
    folder). Returns GET /admin/modules' answer: {"store", "backbone", "tasks": {task: version}, "modules_of"}."""
    token = os.environ.get(TOKEN_VARIABLE)
    if not token:
        raise UsageError(f"--load-into needs the server's admin token in ${TOKEN_VARIABLE}")
    if not store:
        raise UsageError("--load-into needs --store: the module store the server reads (its --store / TMOD_STORE)")
    try:
        listing = _call(url.rstrip("/") + "/admin/modules", token=token)
        served = Path(listing["store"])
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise UsageError(f"--load-into {url}: the server refused the admin token in ${TOKEN_VARIABLE} "
                             "(use the one it was started with)") from None
        raise UsageError(f"--load-into {url}: GET /admin/modules answered {exc.code}: {_error_message(exc)}") from None
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--load-into {url}: no tmod-serve answers there ({getattr(exc, 'reason', exc)})") from None
    # A server on another machine may mount the store elsewhere; where its folder is here too, it must be --store.
    if served.is_dir() and not (Path(store).is_dir() and served.samefile(store)):
        raise UsageError(f"--load-into {url}: that server reads its modules from {served}, not from --store {store}; "
                         f"train with --store {served}")
    return listing


def check_backbone(url: str, server: dict, backbone) -> None:
    """Before training, once the backbone is loaded: the server can load a module trained on it (its own
    backbone, or one a loaded bridge leads to), else the whole run would end in a refused load."""
    if backbone.fingerprint.short not in server["modules_of"]:
        served = server["backbone"]
        raise UsageError(f"--load-into {url}: that server runs {served['backbone']} ({served['fingerprint']}) and "
                         f"loads modules of {sorted(server['modules_of'].values())} only; this head would be "
                         f"trained on {backbone.name} ({backbone.fingerprint.short}): give --backbone the server's")


def load_into(url: str, task: str, version: str) -> dict:
    """POST /admin/modules/TASK/load {"version": VERSION}; a refusal is one line naming the reason."""
    try:
        return _call(f"{url.rstrip('/')}/admin/modules/{task}/load", "POST", {"version": version},
                     os.environ.get(TOKEN_VARIABLE))
    except urllib.error.HTTPError as exc:
        raise UsageError(f"--load-into {url}: the server did not load {task}/{version} ({exc.code}): "
                         f"{_error_message(exc)}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise UsageError(f"--load-into {url}: {getattr(exc, 'reason', exc)}") from None


def say_if_bridged(url: str, server: dict, task: str, version: str, store: str, backbone) -> None:
    """A server on another backbone serves the module through a bridge: the numbers measured here are
    the module on its own backbone, not as that server answers; said, with the command that measures that."""
    theirs = server.get("backbone") or {}
    if theirs.get("fingerprint") in (None, backbone.fingerprint.short):
        return
    print(f"{url} runs on {theirs.get('backbone')}: it serves {task}/{version} through a bridge to {backbone.name}, "
          f"and the numbers above are the module's on {backbone.name} itself; `tmod-train eval --task {task} "
          f"--version {version} --store {store} --backbone {named_for(theirs.get('backbone')) or 'ITS_BACKBONE'} "
          "--bridges ITS_BRIDGE_STORE --file ...` scores it as that server answers", file=sys.stderr)


def say_which_version_serves(store: ModuleStore, task: str, version: str, backbone) -> None:
    """A tmod-serve started on `store` serves the latest version of `task` on this backbone. Where that is
    not the one just saved (a named version, `mtb-1`, sorts after every number), said, with the pin that
    serves this one; where it is, and replaces an earlier version (a head trained on one's own file under
    the shipped `sentiment`), said too, with its labels where they differ: found out after a restart,
    it changes every client's answers."""
    try:
        versions = servable_versions(store, task, backbone)
    except ArtifactError:
        return
    if versions[0] != version:
        print(f"a tmod-serve started on {store.root} serves {task}/{versions[0]}, not this {task}/{version}: the "
              f"latest version on {backbone.name} is the highest number, then named ones alphabetically; name "
              f"{task}/{version} in its --tasks (TMOD_TASKS) to serve this one, or load it through POST "
              f"/admin/modules/{task}/load", file=sys.stderr)
    elif len(versions) > 1:
        before = versions[1]
        print(f"{task}/{version} replaces {task}/{before}: a tmod-serve started on {store.root} answers {task} with "
              f"this head{other_labels(store, task, version, before)}; --tasks {task}/{before} (TMOD_TASKS) keeps "
              f"serving {task}/{before}", file=sys.stderr)


def say_if_replaced_live(url: str, store: ModuleStore, task: str, version: str, previous: str | None) -> None:
    """--load-into put `version` in place of the version the server answered `task` with: said, with the
    labels where they differ and the request that loads the earlier one back."""
    if previous and previous != version:
        print(f"{url} answered {task} with {task}/{previous} until now, and with this {task}/{version} from now on"
              f"{other_labels(store, task, version, previous)}; POST /admin/modules/{task}/load "
              f"{{\"version\": \"{previous}\"}} loads {task}/{previous} back", file=sys.stderr)


def other_labels(store: ModuleStore, task: str, version: str, before: str) -> str:
    """' (its labels ...; TASK/BEFORE's ...)' where the two versions answer with other labels (every client
    reading them is affected), else ''."""
    try:
        labels, earlier = store.read_manifest(task, version).labels, store.read_manifest(task, before).labels
    except ArtifactError:
        return ""
    return f" (its labels {', '.join(labels)}; {task}/{before}'s {', '.join(earlier)})" if labels != earlier else ""


def served_at_start(store: ModuleStore, backbone) -> list[str]:
    """The tasks a tmod-serve started on `store` and `backbone` answers without --tasks: those with a
    module for this backbone whose newest is not opt-in (bridges aside: training does not know them)."""
    served = []
    for task in store.tasks():
        try:
            manifest = store.read_manifest(task, servable_version(store, task, backbone))
        except ArtifactError:
            continue
        if not manifest.opt_in:
            served.append(task)
    return served


def serve_command(store: ModuleStore, backbone: str | None) -> str:
    """The tmod-serve command that serves `store` (the new module among its tasks) on the run's
    `--backbone` (left out for the default one, as tmod-serve's own default is it)."""
    words = ["tmod-serve", "--store", str(store.root)]
    if backbone and backbone != "minilm":
        words += ["--backbone", backbone]
    return shlex.join(words)


def embeddings_request(url: str, task: str, text: str) -> str:
    """A curl command asking the embedding task `task` for one text's vector (OpenAI's embeddings shape)."""
    body = json.dumps({"model": task, "input": [text]}, ensure_ascii=False)
    return (f"curl -s -X POST {shlex.quote(url.rstrip('/') + '/v1/embeddings')} "
            f"-H 'content-type: application/json' -d {shlex.quote(body)}")


def bridge_serving(source: str, bridge_store: Path, target: str) -> str:
    """The closing paragraph of a bridge's report: the tmod-serve command that serves through it, and the
    eval command that scores a module through it, as served."""
    return (f"Served by `tmod-serve --backbone {source} --bridges {bridge_store}`: `/v1/tasks` names the bridge each "
            "foreign module goes through (`served_through`; docs/serving.md says which serves when several could). "
            f"`tmod-train eval --task TASK --version VERSION --backbone {source} --bridges {bridge_store}` scores "
            f"a module of {target} through it as served, beside the majority answer.")


def example_text(text: str, most: int = EXAMPLE_CHARS) -> str:
    """A validation text as an example request shows it: a long document cut after its last whole
    word within `most` characters, so that the command stays one a person reads and copies."""
    cut = text[:most]
    return text if len(text) <= most else cut.rsplit(" ", 1)[0] if " " in cut.strip() else cut


def example_request(url: str, task: str, others: list[str], text: str, text_pair: str | None = None,
                    api_key: bool = False) -> str:
    """A curl command asking the new task and `others` (the served ones) in one request; with the key
    the server asks for (`api_key`) read from $TMOD_API_KEY where it runs."""
    names = [task, *sorted(t for t in others if t not in (task, "embedding"))]
    text, text_pair = example_text(text), text_pair and example_text(text_pair)
    item = {"text": text, "text_pair": text_pair} if text_pair else text
    body = json.dumps({"inputs": [item]}, ensure_ascii=False)
    return (f"curl -s -X POST {shlex.quote(url.rstrip('/') + '/v1/infer?tasks=' + ','.join(names))} "
            + ('-H "authorization: Bearer $TMOD_API_KEY" ' if api_key else "")
            + f"-H 'content-type: application/json' -d {shlex.quote(body)}")
