"""KServe: deploy/kserve proven offline, and the client KServe users call tmod with.

- Every kustomization under deploy/kserve is rendered by the real kustomize (inside kubectl) and every
  InferenceService is validated against KServe's own CRD schema (vendored in deploy/kserve/crd, see
  SOURCE.md there), with unknown fields refused wherever the schema lists the fields of an object, as
  the API server's strict field validation refuses them; its metadata, and every other object, against
  the Kubernetes schemas as in tests/test_deploy.py. Misspelt copies must fail.
- The manifests agree with the server and with deploy/k8s: probes on the app's OIP v2 health routes,
  PROTOCOL=v2, the store where KServe mounts it, the same settings, resources, security and autoscaling
  as the plain Deployment and its HPA.
- The `kserve` package's InferenceRESTClient (protocol v2) drives a real `tmod-serve` started with the
  environment the cpu overlay gives the predictor, on the real default backbone and the shipped modules:
  server and model readiness, a sequence, a token and a pair task, JSON and binary tensors.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import io
import re
import gzip
import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import jsonschema
import kubernetes_validate
import numpy as np
import pytest
import yaml
from kserve.inference_client import InferenceRESTClient, RESTConfig
from kserve.protocol.infer_type import InferInput, InferRequest, RequestedOutput

from modules_store import DEFAULT_STORE
from server.config import Settings
from tests.helpers import start_tmod_serve
from tests.test_deploy import (DEPLOY, K8S, SETTINGS_ENV, app_routes, container, container_env, cpu_cores, kubectl, one,
                               render as render_k8s, validate as validate_k8s)

KSERVE = Path(__file__).resolve().parents[1] / "deploy" / "kserve"
SCHEMA = KSERVE / "crd" / "inferenceservice-v1beta1.schema.json.gz"
EXPECTED_KUSTOMIZATIONS = {"base", "overlays/cpu", "overlays/gpu"}
MODEL_MOUNT = "/mnt/models"  # where KServe's storage initializer puts storageUri for the predictor


# ---- rendering and the schema -------------------------------------------------------------------
def kustomization_dirs(root: Path = KSERVE) -> list[str]:
    return sorted(str(p.parent.relative_to(root)) for p in root.rglob("kustomization.yaml"))


def render_dir(path: Path) -> list[dict]:
    result = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"kustomize {path} failed:\n{result.stderr}"
    return [d for d in yaml.safe_load_all(result.stdout) if d]


_rendered: dict[str, list[dict]] = {}


def render(rel: str) -> list[dict]:
    """deploy/kserve/<rel> rendered (once per session; callers get their own copy to change)."""
    if rel not in _rendered:
        _rendered[rel] = render_dir(KSERVE / rel)
    return copy.deepcopy(_rendered[rel])


def strict(schema: dict) -> dict:
    """The CRD schema with unknown fields refused: `additionalProperties: false` on every object that
    lists its properties, unless it preserves unknown fields or is a map (has additionalProperties)."""
    out = {}
    for key, value in schema.items():
        if key == "properties":
            out[key] = {name: strict(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = strict(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [strict(sub) for sub in value]
        else:
            out[key] = value
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


_validator: list[jsonschema.Draft4Validator] = []


def isvc_validator() -> jsonschema.Draft4Validator:
    if not _validator:
        schema = strict(json.loads(gzip.decompress(SCHEMA.read_bytes())))
        jsonschema.Draft4Validator.check_schema(schema)
        _validator.append(jsonschema.Draft4Validator(schema))
    return _validator[0]


def validate(obj: dict) -> None:
    if obj["kind"] != "InferenceService":
        validate_k8s(obj)
        return
    assert obj["apiVersion"] == "serving.kserve.io/v1beta1"
    errors = sorted(isvc_validator().iter_errors(obj), key=lambda e: list(e.absolute_path))
    if errors:
        raise jsonschema.ValidationError("; ".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                                                  for e in errors))
    # the CRD leaves metadata to the API server's ObjectMeta: check it as the metadata of a core object
    validate_k8s({"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]})


def isvc(objects: list[dict]) -> dict:
    return one(objects, "InferenceService")


def predictor(objects: list[dict]) -> dict:
    return isvc(objects)["spec"]["predictor"]


def predictor_container(objects: list[dict]) -> dict:
    (c,) = predictor(objects)["containers"]
    return c


def predictor_env(objects: list[dict]) -> dict[str, str]:
    return container_env(objects, predictor_container(objects))


def test_every_expected_kustomization_exists():
    assert EXPECTED_KUSTOMIZATIONS <= set(kustomization_dirs())


def test_the_vendored_schema_is_the_crds_and_noted():
    schema = json.loads(gzip.decompress(SCHEMA.read_bytes()))
    assert set(schema["properties"]) >= {"apiVersion", "kind", "metadata", "spec", "status"}
    assert "predictor" in schema["properties"]["spec"]["properties"]
    source = (SCHEMA.parent / "SOURCE.md").read_text()
    assert "config/crd/full/serving.kserve.io_inferenceservices.yaml" in source
    assert any(len(word.strip("`")) == 40 for word in source.split())  # the commit
    assert "Apache License" in (SCHEMA.parent / "LICENSE").read_text()


@pytest.mark.parametrize("rel", sorted(EXPECTED_KUSTOMIZATIONS))
def test_kustomization_renders_and_every_object_passes_the_schemas(rel):
    objects = render(rel)
    assert [o["kind"] for o in objects].count("InferenceService") == 1
    for obj in objects:
        validate(obj)


MISSPELT = [  # (what is in deploy/kserve/base/inferenceservice.yaml, a misspelling of it)
    ("    minReplicas: 2", "    minReplica: 2"),
    ("            path: /v2/health/ready", "            paht: /v2/health/ready"),
    ("    deploymentStrategy:", "    deploymentStrategey:"),
    ("          requests:\n            cpu:", "          request:\n            cpu:"),
    ("  predictor:", "  predicter:"),
    ("  annotations:", "  anotations:"),  # metadata: checked against ObjectMeta
]


@pytest.mark.parametrize("right, wrong", MISSPELT, ids=[w.split(":")[0].strip() for _, w in MISSPELT])
def test_a_misspelt_manifest_fails(tmp_path, right, wrong):
    copied = tmp_path / "kserve"
    shutil.copytree(KSERVE, copied)
    manifest = copied / "base" / "inferenceservice.yaml"
    text = manifest.read_text()
    assert right in text
    manifest.write_text(text.replace(right, wrong, 1))
    service = isvc(render_dir(copied / "overlays" / "cpu"))
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate(service)


def test_wrong_types_and_values_fail():
    cases = [("minReplicas", "two"), ("maxReplicas", 2.5), ("containers", {"name": "kserve-container"})]
    for field, value in cases:
        service = isvc(render("overlays/cpu"))
        service["spec"]["predictor"][field] = value
        with pytest.raises(jsonschema.ValidationError, match=field):
            validate(service)
    service = isvc(render("overlays/cpu"))
    service["spec"]["predictor"]["autoScaling"]["metrics"][0]["resource"]["target"]["type"] = "Utilisation"
    with pytest.raises(jsonschema.ValidationError, match="Utilisation"):
        validate(service)


# ---- the manifests agree with the server, with KServe and with deploy/k8s ---------------------------
def env_file(path: Path) -> dict[str, str]:
    lines = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


def test_settings_are_the_plain_deployments_but_for_the_store():
    kserve_env = env_file(KSERVE / "base" / "tmod.env")
    k8s_env = env_file(K8S / "base" / "tmod.env")
    assert kserve_env["TMOD_STORE"] == MODEL_MOUNT
    assert {k: v for k, v in kserve_env.items() if k != "TMOD_STORE"} == \
           {k: v for k, v in k8s_env.items() if k != "TMOD_STORE"}
    assert env_file(KSERVE / "base" / "admin-token.env") == env_file(K8S / "base" / "admin-token.env") == \
           {"TMOD_ADMIN_TOKEN": ""}


@pytest.mark.parametrize("flavour", ["cpu", "gpu"])
def test_predictor_is_what_kserve_and_the_server_need(flavour, monkeypatch):
    objects = render(f"overlays/{flavour}")
    service = isvc(objects)
    annotations = service["metadata"]["annotations"]
    assert annotations["serving.kserve.io/deploymentMode"] in ("Standard", "RawDeployment")  # no Knative
    assert annotations["serving.kserve.io/autoscalerClass"] == "hpa"
    assert annotations["storage.kserve.io/readonly"] == "true"
    c = predictor_container(objects)
    env = predictor_env(objects)
    # KServe: the container its storage initializer serves, protocol v2, a store URI
    assert c["name"] == "kserve-container"
    assert env["PROTOCOL"] == "v2"
    assert env["STORAGE_URI"].startswith("pvc://")
    claim = env["STORAGE_URI"].removeprefix("pvc://").split("/")[0]
    assert one(objects, "PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadOnlyMany"]
    # the server: every TMOD_* a setting that parses; the store where KServe mounts it; the port KServe targets
    names = {n for n in env if n.startswith("TMOD_")}
    assert names <= SETTINGS_ENV, sorted(names - SETTINGS_ENV)
    for name in list(os.environ):
        if name.startswith("TMOD_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert str(settings.store) == MODEL_MOUNT and settings.admin_token == ""
    assert c["ports"][0]["containerPort"] == settings.port
    # probes: HTTP on the app's OIP v2 health routes (KServe alone would add a TCP probe only)
    routes = app_routes()
    probes = {kind: c[kind]["httpGet"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes["readinessProbe"]["path"] == probes["startupProbe"]["path"] == "/v2/health/ready"
    assert probes["livenessProbe"]["path"] == "/v2/health/live"
    for probe in probes.values():
        assert "GET" in routes[probe["path"]] and probe["port"] == settings.port
    # threads (+ a core per HTTP worker) = the CPU request, as in deploy/k8s
    workers = settings.workers if settings.workers > 1 else 0
    assert settings.threads + workers == cpu_cores(c["resources"]["requests"]["cpu"])
    # a writable /tmp for every cache, the root filesystem read-only
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/tmp"}
    assert all(env[name].startswith("/tmp") for name in ("HOME", "HF_HOME", "XDG_CACHE_HOME"))
    assert env["HF_HUB_OFFLINE"] == "1"


@pytest.mark.parametrize("flavour", ["cpu", "gpu"])
def test_predictor_matches_the_plain_deployment(flavour):
    """Same image, settings (but the store), resources, probes' timing, security and autoscaling as the
    deploy/k8s overlay of the same flavour: one sizing, two ways to run it."""
    objects, k8s = render(f"overlays/{flavour}"), render_k8s(f"overlays/{flavour}")
    p, c = predictor(objects), predictor_container(objects)
    deployment, k8s_c = one(k8s, "Deployment"), container(k8s)
    pod = deployment["spec"]["template"]["spec"]
    assert c["image"] == k8s_c["image"]
    env, k8s_env = predictor_env(objects), container_env(k8s)
    plain = {"PROTOCOL", "STORAGE_URI", "TMOD_STORE"}  # what KServe adds or moves
    assert {k: v for k, v in env.items() if k not in plain} == {k: v for k, v in k8s_env.items() if k not in plain}
    assert c["resources"] == k8s_c["resources"]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        timing = lambda probe: {k: v for k, v in probe.items() if k != "httpGet"}  # noqa: E731
        assert timing(c[kind]) == timing(k8s_c[kind]), kind
    assert c["securityContext"] == k8s_c["securityContext"] and c["lifecycle"] == k8s_c["lifecycle"]
    for field in ("securityContext", "terminationGracePeriodSeconds", "automountServiceAccountToken",
                  "nodeSelector", "tolerations"):
        assert p.get(field) == pod.get(field), field
    assert p["deploymentStrategy"] == deployment["spec"]["strategy"]
    # KServe's HPA (Standard mode): the replica range and the CPU target of the plain HPA
    hpa = one(k8s, "HorizontalPodAutoscaler")["spec"]
    assert (p["minReplicas"], p["maxReplicas"]) == (hpa["minReplicas"], hpa["maxReplicas"])
    assert p["autoScaling"]["metrics"] == hpa["metrics"]
    # the plain HPA's only behaviour setting is the Kubernetes default, which KServe's HPA keeps
    assert hpa["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 300}}
    # the disruption budget: the plain one's, on the pods KServe makes (it labels them with the
    # InferenceService's name and adds the predictor's labels)
    budget = one(objects, "PodDisruptionBudget")
    pod_labels = {**p["labels"], "serving.kserve.io/inferenceservice": isvc(objects)["metadata"]["name"]}
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert budget["spec"]["maxUnavailable"] == one(k8s, "PodDisruptionBudget")["spec"]["maxUnavailable"]
    # and the plain Deployment's Services and budget do not select them (both can share a namespace)
    for selector in [s["spec"]["selector"] for s in k8s if s["kind"] == "Service"] + \
            [one(k8s, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"]]:
        assert not selector.items() <= pod_labels.items()


# ---- the kserve client against a real tmod-serve ---------------------------------------------------
TEXTS = ["Angela Merkel visited the Siemens plant in Munich.", "What a wonderful, warm film."]
PAIR = (["A man is playing a guitar on stage."], ["A man is playing an instrument."])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The real tmod-serve under the cpu overlay's predictor environment, on the real default backbone
    and the shipped modules. Changed: loopback, a free port, the store at its place in this checkout
    (it stands for /mnt/models) and /tmp moved into the test's folder; the tasks named, since the pair
    task (MiniLM's entailment) is opt-in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMOD_")}
    env.update(predictor_env(render("overlays/cpu")))
    writable = tmp_path_factory.mktemp("tmp")
    env.update({"TMOD_HOST": "127.0.0.1", "TMOD_STORE": str(DEFAULT_STORE), "TMOD_TASKS": "sentiment,ner,entailment",
                **{name: str(writable / Path(env[name]).relative_to("/tmp"))
                   for name in ("HOME", "HF_HOME", "XDG_CACHE_HOME")}})
    url, process = start_tmod_serve([], env)
    yield url
    process.terminate()
    process.wait(timeout=60)


def call(coroutine_fn):
    """Run one coroutine with a fresh v2 client (the client is asynchronous)."""
    async def run():
        async with InferenceRESTClient(RESTConfig(protocol="v2", timeout=60)) as client:
            return await coroutine_fn(client)
    return asyncio.run(run())


def text_input(name: str, values: list[str], binary: bool):
    tensor = InferInput(name, [len(values)], "BYTES")
    tensor.set_data_from_numpy(np.array([v.encode() for v in values], dtype=np.object_), binary_data=binary)
    return tensor


def infer(url: str, task: str, inputs: dict[str, list[str]], binary: bool, outputs: list[str] | None = None,
          headers: dict | None = None):
    request = InferRequest(
        task, [text_input(name, values, binary) for name, values in inputs.items()],
        request_outputs=[RequestedOutput(name, {"binary_data": binary}) for name in outputs or []],
        parameters={"binary_data_output": binary} if binary and not outputs else None)
    response_headers: dict[str, str] = {}
    response = call(lambda client: client.infer(url, request, model_name=task, headers=headers,
                                                response_headers=response_headers))
    # binary both ways (the binary data extension) or JSON both ways, as asked
    assert ("inference-header-content-length" in response_headers) == binary
    return response


def v1(url: str, task: str, inputs: list) -> list[dict]:
    response = httpx.post(url + "/v1/infer", params={"tasks": task}, json={"inputs": inputs}, timeout=60)
    assert response.status_code == 200, response.text
    return [r[task] for r in response.json()["results"]]


def strings(output) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else v for v in output.as_numpy().reshape(-1).tolist()]


def test_server_and_model_readiness(served):
    assert call(lambda client: client.is_server_live(served)) is True
    assert call(lambda client: client.is_server_ready(served)) is True
    for task in ("sentiment", "ner", "entailment"):
        assert call(lambda client: client.is_model_ready(served, task)) is True
    assert call(lambda client: client.is_model_ready(served, "telepathy")) is False


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_sequence_task(served, binary):
    labels = httpx.get(served + "/v2/models/sentiment", timeout=10).json()["parameters"]["labels"]
    response = infer(served, "sentiment", {"text": TEXTS}, binary, outputs=["label", "scores"])
    assert response.model_name == "sentiment"
    expected = v1(served, "sentiment", TEXTS)
    by_name = {o.name: o for o in response.outputs}
    assert strings(by_name["label"]) == [e["label"] for e in expected]
    scores = by_name["scores"].as_numpy()
    assert scores.shape == (len(TEXTS), len(labels))
    for row, e in zip(scores, expected):
        assert row.tolist() == pytest.approx([e["scores"][label] for label in labels], abs=1e-5)
    assert strings(by_name["label"])[1] == "positive"  # a shipped module on the real backbone


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_token_task(served, binary):
    response = infer(served, "ner", {"text": TEXTS}, binary)  # no outputs named: every output
    (output,) = response.outputs
    assert output.name == "entities" and output.datatype == "BYTES"
    entities = [json.loads(item) for item in strings(output)]
    expected = v1(served, "ner", TEXTS)
    spans = lambda rows: [[(e["text"], e["label"], e["start"], e["end"]) for e in row] for row in rows]  # noqa: E731
    assert spans(entities) == spans([e["entities"] for e in expected])
    assert {(e["text"], e["label"]) for e in entities[0]} >= {("Angela Merkel", "PER"), ("Munich", "LOC")}


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_pair_task(served, binary):
    texts, pairs = PAIR
    response = infer(served, "entailment", {"text": texts, "text_pair": pairs}, binary, outputs=["label", "score"])
    expected = v1(served, "entailment", [{"text": t, "text_pair": p} for t, p in zip(texts, pairs)])
    by_name = {o.name: o for o in response.outputs}
    assert strings(by_name["label"]) == [e["label"] for e in expected]
    assert by_name["score"].as_numpy().tolist() == pytest.approx([e["score"] for e in expected], abs=1e-5)
    with pytest.raises(httpx.HTTPStatusError, match=r"on /v2: a text_pair input, BYTES \[N\] beside text") as refused:
        infer(served, "entailment", {"text": texts}, binary)  # the pair left out: what to send, in this protocol's words
    assert refused.value.response.status_code == 422


def test_through_kserves_host_routing_and_errors(served):
    """KServe's ingress routes on the Host header (<name>-predictor.<namespace>.<domain>); the server
    answers whatever Host it is given. Errors reach the client as HTTP errors with tmod's message."""
    host = {"Host": "tmod-predictor.tmod.example.com"}
    response = infer(served, "sentiment", {"text": TEXTS[:1]}, False, outputs=["label"], headers=host)
    assert strings(response.outputs[0]) == [v1(served, "sentiment", TEXTS[:1])[0]["label"]]
    with pytest.raises(httpx.HTTPStatusError, match="no model 'telepathy'"):
        infer(served, "telepathy", {"text": ["x"]}, False)
    with pytest.raises(httpx.HTTPStatusError, match="text_pair"):
        infer(served, "sentiment", {"text": ["a", "b"], "text_pair": ["c"]}, True)


def test_the_clients_default_v1_protocol(served):
    """KServe's V1 data plane, as the kserve client speaks it with its default RESTConfig (protocol
    "v1"): liveness at /, predictions at :predict, each task's answer as /v1/infer gives it; its
    mistakes answered with what to send, in KServe's error shape."""
    async def run(work):
        async with InferenceRESTClient(RESTConfig(timeout=60)) as client:
            assert client._config.protocol == "v1"  # what a user who names no protocol gets
            return await work(client)

    assert asyncio.run(run(lambda client: client.is_server_live(served))) is True
    # V1's model readiness path is OpenAI's model object (an embedding model's): a task's 404 says where
    # KServe's readiness is (V2's), which a v2 client asks (test_server_and_model_readiness)
    with pytest.raises(httpx.HTTPStatusError, match=r"'ner' is a task: .* GET /v2/models/ner/ready"):
        asyncio.run(run(lambda client: client.is_model_ready(served, "ner")))
    for task, instances in (("sentiment", TEXTS), ("ner", TEXTS),
                            ("entailment", [{"text": t, "text_pair": p} for t, p in zip(*PAIR)])):
        answer = asyncio.run(run(lambda client: client.infer(served, {"instances": instances}, model_name=task)))
        assert answer == {"predictions": v1(served, task, instances)}
    kserves_other_name = httpx.post(served + "/v1/models/sentiment:predict", json={"inputs": TEXTS, "top_k": 1})
    assert [list(p["scores"]) for p in kserves_other_name.json()["predictions"]] == [["positive"]] * 2
    refusals = [  # (task, body, status, what the message says)
        ("sentiment", {"instances": "What a film."}, 400, 'send a list, even of one text: {"instances": ["..."]}'),
        ("sentiment", {"instance": ["What a film."]}, 400, "did you mean 'instances'"),
        ("sentiment", {}, 400, 'send the texts as "instances" (or "inputs")'),
        ("sentiment", {"instances": ["a"], "inputs": ["b"]}, 400, "one of the two"),
        ("entailment", {"instances": TEXTS}, 422, "text_pair"),
        ("ner", {"instances": [{"text": "a"}]}, 400, 'a text alone is a string, "instances": ["..."]; an object is '
                                                      'a pair'),
        ("ner", {"inputs": [{"text": "a"}]}, 400, 'a text alone is a string, "inputs": ["..."]'),
        ("telepathy", {"instances": ["a"]}, 404, "no model 'telepathy'"),
        ("ner", {"instances": [""]}, 422, "input 0 is empty"),
    ]
    for task, body, status, said in refusals:
        refused = httpx.post(f"{served}/v1/models/{task}:predict", json=body, timeout=60)
        assert refused.status_code == status and said in refused.json()["error"], (body, refused.text)
    explain = httpx.post(served + "/v1/models/ner:explain", json={"instances": TEXTS})
    assert explain.status_code == 501 and ":predict" in explain.json()["error"]
    assert httpx.get(served + "/v1/models/ner:predict").status_code == 405


# ---- deploy/README.md's KServe examples, as written ----------------------------------------------------
def readme_kserve_block(language: str) -> str:
    section = (DEPLOY / "README.md").read_text().split("\n## KServe\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(rf"```{language}\n(.*?)```", section, re.S)
    return block


def test_readme_store_patch_sets_the_storage_uri(tmp_path):
    overlay = tmp_path / "my-overlay"
    overlay.mkdir()
    patch = yaml.safe_load(readme_kserve_block("yaml"))
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(KSERVE / "overlays" / "cpu", overlay)], **patch}))
    objects = render_dir(overlay)
    validate(isvc(objects))
    uri = json.dumps(patch).split("s3://", 1)[1].split('"', 1)[0]
    assert predictor_env(objects)["STORAGE_URI"] == "s3://" + uri


def test_readme_python_client_example_runs(served):
    """The README's client example, run as written against the real server (the ingress stands here)."""
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(readme_kserve_block("python"), {"INGRESS": served.removeprefix("http://"),  # noqa: S102
                                            "HOST": "tmod-tmod.example.com"})
    assert "'label': ['positive']" in output.getvalue(), output.getvalue()


def test_readme_curl_example_body_is_answered(served):
    calls = [b for b in re.findall(r"```bash\n(.*?)```", (DEPLOY / "README.md").read_text(), re.S) if "$HOST" in b]
    (block,) = calls
    path = re.search(r"/v2/models/\w+/infer", block).group(0)
    body = re.search(r"-d '(.*?)'", block, re.S).group(1)
    response = httpx.post(served + path, content=body, timeout=60,
                          headers={"Host": "tmod-tmod.example.com", "content-type": "application/json"})
    assert response.status_code == 200, response.text
    assert [o["name"] for o in response.json()["outputs"]] == ["label", "score", "scores"]
    assert httpx.get(served + re.search(r"/v2/models/\w+/ready", block).group(0), timeout=10).status_code == 200
