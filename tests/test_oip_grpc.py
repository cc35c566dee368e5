"""The Open Inference Protocol v2 over gRPC (`--grpc-port`, server/api/oip_grpc.py) on a real `tmod-serve`,
through the clients that speak it: `tritonclient.grpc` and KServe's `InferenceGRPCClient`. Every
answer is compared with the same request's answer over HTTP.

The clients run in processes of their own (`in_a_fresh_process`): each registers the protocol's
protobuf names in protobuf's default pool, which takes one set of them per process, and other test
files that share this process import `kserve`."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import traceback
from concurrent.futures import ProcessPoolExecutor

import grpc
import httpx
import numpy as np
import pytest

from bench.live_server import free_port, wait_until
from tests.helpers import metric_sample, start_tmod_serve, with_a_pair_task

KEY = "grpc-test-key"
TEXTS = ["Angela Merkel visited Munich.", "A wonderful, moving film.", "bad"]


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_store, tiny_backbone):
    return with_a_pair_task(tmp_path_factory.mktemp("grpc") / "store", tiny_store, tiny_backbone)


def serve(store, backbone_dir, *extra):
    """(HTTP url, gRPC address, process) of a tmod-serve with --grpc-port and an API key."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMOD_API_KEY": KEY}
    url, process = start_tmod_serve(["--backbone", str(backbone_dir), "--store", str(store), "--grpc-port", str(port),
                                     "--head-precision", "fp32", "--max-body-bytes", "100000", *extra], env)
    return url, f"127.0.0.1:{port}", process


@pytest.fixture(scope="module")
def server(store, tiny_backbone_dir):
    url, address, process = serve(store, tiny_backbone_dir)
    yield url, address
    process.kill()
    process.wait()


@pytest.fixture(scope="module")
def in_a_fresh_process():
    """run(function, *args): `function` (of this module) called in a spawned process, its result or
    its exception (an assertion's message included) brought back."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield lambda function, *args: pool.submit(reporting, function, *args)


def reporting(function, *args):
    """`function(*args)`, its exception raised as an AssertionError of its traceback's text: a tritonclient
    exception does not unpickle in this process, which then breaks the pool for every later test."""
    try:
        return function(*args)
    except BaseException:
        raise AssertionError(traceback.format_exc()) from None


def triton_client(address):
    import tritonclient.grpc as triton_grpc

    return triton_grpc.InferenceServerClient(address)


AUTH = {"authorization": f"Bearer {KEY}"}


def texts_input(name, texts, shape=None):
    import tritonclient.grpc as triton_grpc

    tensor = triton_grpc.InferInput(name, shape or [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object).reshape(shape or [len(texts)]))
    return tensor


def over_http(server, task, inputs, parameters=None, outputs=None):
    """The same request over HTTP (JSON): {output name: numpy array}."""
    body = {"inputs": [{"name": name, "datatype": "BYTES", "shape": [len(texts)], "data": texts}
                       for name, texts in inputs.items()], "parameters": parameters or {}}
    if outputs:
        body["outputs"] = outputs
    answer = httpx.post(f"{server[0]}/v2/models/{task}/infer", json=body, headers=AUTH, timeout=60)
    assert answer.status_code == 200, answer.text
    return {o["name"]: np.array(o["data"], dtype=object if o["datatype"] == "BYTES" else np.float32).reshape(o["shape"])
            for o in answer.json()["outputs"]}


def test_the_compiled_descriptor_is_the_proto_and_the_protocols_numbers(in_a_fresh_process):
    """server/api/oip_v2_descriptor.py is protoc's reading of server/api/oip_v2.proto, and every message and
    field it declares has the number Triton's client gives it (the wire format is the numbers)."""
    in_a_fresh_process(descriptor_matches_the_proto_and_triton).result(timeout=300)


def descriptor_matches_the_proto_and_triton():
    from google.protobuf import descriptor_pb2
    from tritonclient.grpc import service_pb2

    from server.api import oip_grpc
    from server.api.oip_v2_descriptor import FILE

    out = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", "server/api",
                          "--descriptor_set_out=/dev/stdout", "server/api/oip_v2.proto"],
                         capture_output=True, check=True).stdout
    assert descriptor_pb2.FileDescriptorSet.FromString(out).file[0].SerializeToString() == FILE

    def fields(descriptor):
        found = {f.name: (f.number, f.type, f.is_repeated) for f in descriptor.fields}
        for nested in descriptor.nested_types:
            found.update({f"{nested.name}.{k}": v for k, v in fields(nested).items()})
        return found

    from tritonclient.grpc import model_config_pb2

    triton = model_config_pb2.DESCRIPTOR.pool  # protobuf's default pool: Triton's service and model configuration
    ours = oip_grpc._POOL.FindFileByName("oip_v2.proto")
    for name, descriptor in ours.message_types_by_name.items():
        theirs = fields(triton.FindMessageTypeByName(f"inference.{name}"))
        assert fields(descriptor).items() <= theirs.items(), name
    for name, enum in ours.enum_types_by_name.items():
        theirs = {v.name: v.number for v in triton.FindEnumTypeByName(f"inference.{name}").values}
        assert {v.name: v.number for v in enum.values}.items() <= theirs.items(), name
    methods = {m.name: (m.input_type.name, m.output_type.name) for m in ours.services_by_name["GRPCInferenceService"].methods}
    triton_methods = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods_by_name
    assert all((triton_methods[n].input_type.name, triton_methods[n].output_type.name) == io for n, io in methods.items())


@pytest.mark.smoke
def test_tritonclient_grpc_gets_what_http_answers(server, in_a_fresh_process):
    in_a_fresh_process(tritonclient_gets_what_http_answers, server).result(timeout=300)


def tritonclient_gets_what_http_answers(server):
    triton = triton_client(server[1])
    assert triton.is_server_live() and triton.is_server_ready(headers=AUTH)
    assert triton.is_model_ready("ner", headers=AUTH) and not triton.is_model_ready("nope", headers=AUTH)
    meta = triton.get_server_metadata(headers=AUTH)
    assert meta.name == "tmod" and list(meta.extensions) == ["binary_tensor_data", "classification",
                                                             "model_configuration"]
    config = triton.get_model_config("pairs", headers=AUTH, as_json=True)["config"]  # what HTTP's /config says
    http_config = httpx.get(f"{server[0]}/v2/models/pairs/config", headers=AUTH).json()
    assert {k: config[k] for k in ("name", "platform", "backend", "parameters")} == \
        {k: http_config[k] for k in ("name", "platform", "backend", "parameters")}
    assert config["version_policy"] == {"specific": {"versions": ["1"]}}  # int64 in JSON: a string
    for field in ("input", "output"):
        assert [(t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in config[field]] == \
            [(t["name"], t["data_type"], t["dims"]) for t in http_config[field]]
    index = triton.get_model_repository_index(headers=AUTH, as_json=True)["models"]  # the repository index
    http_index = httpx.post(f"{server[0]}/v2/repository/index", json={}, headers=AUTH).json()
    assert [{"version": "", "reason": "", **m} for m in index] == [{"version": "", **m} for m in http_index]
    assert {m["state"] for m in index} == {"READY"}  # this store's tasks are all served
    http_meta = httpx.get(f"{server[0]}/v2/models/pairs", headers=AUTH).json()
    meta = triton.get_model_metadata("pairs", headers=AUTH)
    assert [t.name for t in meta.inputs] == [t["name"] for t in http_meta["inputs"]] == ["text", "text_pair"]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == \
        [(t["name"], t["datatype"], t["shape"]) for t in http_meta["outputs"]]

    for task in ("sentiment", "ner", "acceptability"):
        answer = triton.infer(task, [texts_input("text", TEXTS)], headers=AUTH)
        expected = over_http(server, task, {"text": TEXTS})
        assert answer.get_response().model_name == task and answer.get_response().model_version == "1"
        for name, array in expected.items():
            ours = answer.as_numpy(name)
            if array.dtype == object:
                assert [v.decode() for v in ours.reshape(-1)] == list(array.reshape(-1)), (task, name)
            else:
                np.testing.assert_allclose(ours, array, atol=1e-6)
    pairs = triton.infer("pairs", [texts_input("text", TEXTS), texts_input("text_pair", TEXTS[::-1])], headers=AUTH)
    np.testing.assert_allclose(pairs.as_numpy("scores"), over_http(
        server, "pairs", {"text": TEXTS, "text_pair": TEXTS[::-1]})["scores"], atol=1e-6)
    # tritonclient's [1, N] batch shape, Triton's classification extension and request parameters
    import tritonclient.grpc as triton_grpc

    ranked = triton.infer("sentiment", [texts_input("text", TEXTS, [1, 3])], headers=AUTH, parameters={"truncate": True},
                          outputs=[triton_grpc.InferRequestedOutput("scores", class_count=1)])
    expected = over_http(server, "sentiment", {"text": TEXTS}, {"truncate": True},
                         [{"name": "scores", "parameters": {"classification": 1}}])
    assert ranked.as_numpy("scores").shape == (1, 3, 1)
    assert [v.decode() for v in ranked.as_numpy("scores").reshape(-1)] == list(expected["scores"].reshape(-1))


KSERVE_CLIENT = """
import asyncio, json, sys
import numpy as np
from kserve import InferenceGRPCClient, InferInput, InferRequest

async def ask(address, texts, headers):
    client = InferenceGRPCClient(address, timeout=60)
    try:
        ready = await client.is_model_ready("acceptability", headers=headers)
        tensor = InferInput("text", [len(texts)], "BYTES")
        tensor.set_data_from_numpy(np.array(texts, dtype=object))
        answer = await client.infer(InferRequest("acceptability", [tensor]), headers=headers)
        return ready, {o.name: [v.decode() if isinstance(v, bytes) else v for v in o.as_numpy().reshape(-1).tolist()]
                       for o in answer.outputs}
    finally:
        await client.close()

address, texts, headers = json.loads(sys.argv[1])
print(json.dumps(asyncio.run(ask(address, texts, list(headers.items())))))
"""


def test_kserves_grpc_client_gets_what_http_answers(server):
    """In a process of its own: KServe's client and Triton's register the same protobuf names, and
    protobuf's default pool takes one of them per process."""
    run = subprocess.run([sys.executable, "-c", KSERVE_CLIENT, json.dumps([server[1], TEXTS, AUTH])],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    ready, outputs = json.loads(run.stdout)
    expected = over_http(server, "acceptability", {"text": TEXTS})
    assert ready and list(outputs) == list(expected)
    assert outputs["label"] == list(expected["label"])
    np.testing.assert_allclose(np.array(outputs["scores"]), expected["scores"].reshape(-1), atol=1e-6)


def test_refusals_carry_the_grpc_status_and_the_message_http_gives(server, in_a_fresh_process):
    in_a_fresh_process(refusals_carry_the_grpc_status_and_the_message_http_gives, server).result(timeout=300)


def refusals_carry_the_grpc_status_and_the_message_http_gives(server):
    from tritonclient.utils import InferenceServerException

    triton = triton_client(server[1])

    def refused(call, status, said):
        with pytest.raises(InferenceServerException) as caught:
            call()
        assert caught.value.status() == f"StatusCode.{status}", caught.value
        assert said in caught.value.message(), caught.value

    text = [texts_input("text", TEXTS)]
    refused(lambda: triton.infer("nope", text, headers=AUTH), "NOT_FOUND", "no model 'nope'; loaded models: ")
    refused(lambda: triton.infer("sentiment", [texts_input("txt", TEXTS)], headers=AUTH), "INVALID_ARGUMENT",
            "unknown input 'txt'")
    refused(lambda: triton.infer("sentiment", [texts_input("text", TEXTS, [1, 3]), texts_input("text_pair", TEXTS)],
                                 headers=AUTH), "INVALID_ARGUMENT", "it reads single texts, not 'text_pair'")
    refused(lambda: triton.infer("sentiment", text, headers=AUTH, parameters={"top_k": 0}), "INVALID_ARGUMENT",
            "top_k")
    refused(lambda: triton.infer("sentiment", text, headers=AUTH, parameters={"raw_score": True}), "INVALID_ARGUMENT",
            "unknown request parameter (did you mean 'raw_scores' for 'raw_score'?)")
    refused(lambda: triton.infer("sentiment", [texts_input("text", ["x"] * 65)], headers=AUTH), "INVALID_ARGUMENT",
            "65 inputs; at most 64")
    refused(lambda: triton.infer("sentiment", [texts_input("text", ["word " * 30_000])], headers=AUTH),
            "RESOURCE_EXHAUSTED", "")  # over --max-body-bytes: refused by gRPC before tmod reads it
    # Triton's RPCs tmod does not serve: UNIMPLEMENTED with what to do instead, not gRPC's "Method not found!"
    refused(lambda: triton.get_inference_statistics("sentiment", headers=AUTH), "UNIMPLEMENTED",
            "Prometheus metrics at GET /metrics")
    refused(lambda: triton.load_model("sentiment", headers=AUTH), "UNIMPLEMENTED",
            "POST /v2/repository/models/<task>/load on the HTTP port")
    refused(lambda: triton.get_system_shared_memory_status(headers=AUTH), "UNIMPLEMENTED",
            "shared memory is not served")
    refused(lambda: triton.get_log_settings(headers=AUTH), "UNIMPLEMENTED", "--log-level")

    refused(lambda: triton.get_model_config("nope", headers=AUTH), "NOT_FOUND", "no model 'nope'")
    refused(lambda: triton.infer("sentiment", text), "UNAUTHENTICATED", "authorization: Bearer <API key>")
    refused(lambda: triton.get_model_metadata("sentiment", headers={"authorization": "Bearer wrong"}),
            "UNAUTHENTICATED", "")

    import tritonclient.grpc as triton_grpc  # a hand-made request: raw contents that do not fit the inputs
    request = triton_grpc.service_pb2.ModelInferRequest(model_name="sentiment")
    request.inputs.add(name="text", datatype="BYTES", shape=[1])
    request.raw_input_contents.extend([b"\x01\x00\x00\x00a", b"\x01\x00\x00\x00b"])
    with grpc.insecure_channel(server[1]) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                    request_serializer=lambda m: m.SerializeToString(),
                                    response_deserializer=triton_grpc.service_pb2.ModelInferResponse.FromString)
        with pytest.raises(grpc.RpcError) as caught:
            infer(request, metadata=list(AUTH.items()))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "raw_input_contents has 2 entries for 1 inputs" in caught.value.details()
        request.raw_input_contents.pop()
        request.raw_input_contents[0] = b"\x09\x00\x00\x00a"  # a BYTES length past the end
        with pytest.raises(grpc.RpcError) as caught:
            infer(request, metadata=list(AUTH.items()))
        assert "BYTES element overruns the body" in caught.value.details()
        # each call's request id, as HTTP's x-request-id: the client's, else its traceparent's trace id
        trace = "4bf92f3577b34da6a3ce929d0e0e4736"
        with pytest.raises(grpc.RpcError) as caught:
            infer(request, metadata=[*AUTH.items(), ("traceparent", f"00-{trace}-00f067aa0ba902b7-01")])
        assert dict(caught.value.trailing_metadata())["x-request-id"] == trace
        typed = triton_grpc.service_pb2.ModelInferRequest(model_name="sentiment")  # texts as bytes_contents
        typed.inputs.add(name="text", datatype="BYTES", shape=[3]).contents.bytes_contents.extend(
            [t.encode() for t in TEXTS])
        answer, call = infer.with_call(typed, metadata=[*AUTH.items(), ("x-request-id", "grpc-call-1")])
        assert dict(call.trailing_metadata())["x-request-id"] == "grpc-call-1"
        label = [o.name for o in answer.outputs].index("label")
        assert triton_grpc.deserialize_bytes_tensor(answer.raw_output_contents[label]).tolist() == \
            [v.encode() for v in over_http(server, "sentiment", {"text": TEXTS})["label"]]
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")  # Triton's streaming
        with pytest.raises(grpc.RpcError) as caught:
            list(stream(iter([typed.SerializeToString()]), metadata=list(AUTH.items())))
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert caught.value.details() == "streaming inference is not served: call ModelInfer, one request and one " \
            "response"
        garbage = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # bytes as they are
        with pytest.raises(grpc.RpcError) as caught:
            garbage(b"\xff\xff\xff\xff\x0f", metadata=list(AUTH.items()))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # was UNKNOWN, and an error in the log
        assert caught.value.details() == "the message is not a protobuf ModelInferRequest"
    # and the server still answers, over both transports
    assert triton.infer("sentiment", text, headers=AUTH).as_numpy("label").shape == (3,)
    assert httpx.get(f"{server[0]}/readyz").status_code == 200


def test_every_http_worker_serves_grpc_on_the_one_port(store, tiny_backbone_dir, in_a_fresh_process):
    url, address, process = serve(store, tiny_backbone_dir, "--workers", "2")
    try:
        assert in_a_fresh_process(label_shapes, address, 6).result(timeout=300) == [(3,)] * 6
    finally:
        process.kill()
        process.wait()


def label_shapes(address, connections):
    """Each of `connections` clients (a connection each) asks for sentiment: the shape of its labels."""
    shapes = []
    for client in [triton_client(address) for _ in range(connections)]:
        shapes.append(client.infer("sentiment", [texts_input("text", TEXTS)], headers=AUTH).as_numpy("label").shape)
        client.close()
    return shapes


def test_grpcs_health_service_follows_whether_the_server_can_infer(store, tiny_backbone_dir):
    """grpc.health.v1 (Kubernetes' gRPC probes, Envoy's and gRPC clients' health checks), asked with
    grpcio-health-checking's own stub and no API key: SERVING while the server can infer, NOT_SERVING
    once every module is unloaded (Check at once, Watch's stream too, another watch having left), SERVING
    after a load; NOT_SERVING on Watch's stream when SIGTERM stops the server, and the stream ends; an
    unknown service NOT_FOUND (Watch: SERVICE_UNKNOWN)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    url, address, process = serve(store, tiny_backbone_dir, "--admin-token", "admin-test")
    admin = {"authorization": "Bearer admin-test"}
    try:
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def check(service=""):
                return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=30).status

            assert check() == check("inference.GRPCInferenceService") == serving
            with pytest.raises(grpc.RpcError) as unknown:
                check("inference.Nothing")
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=120)
            assert next(watch).status == serving
            other = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=120)  # and leaves: the
            assert next(other).status == serving  # first still hears (the package's own servicer went deaf)
            other.cancel()
            unknown_watch = health.Watch(health_pb2.HealthCheckRequest(service="inference.Nothing"), timeout=120)
            assert next(unknown_watch).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            unknown_watch.cancel()
            tasks = httpx.get(url + "/readyz").json()["tasks"]
            for task in tasks:
                assert httpx.post(f"{url}/admin/modules/{task}/unload", headers=admin).status_code == 200
            assert check() == check("inference.GRPCInferenceService") == not_serving
            assert next(watch).status == not_serving
            assert httpx.post(f"{url}/admin/modules/{tasks[0]}/load", headers=admin, timeout=60).status_code == 200
            assert check() == serving and next(watch).status == serving
            process.send_signal(signal.SIGTERM)
            assert next(watch).status == not_serving
            assert next(watch, None) is None  # the stream ends: an open watch does not hold the stop
        assert process.wait(timeout=120) in (0, -signal.SIGTERM)
    finally:
        process.kill()
        process.wait()


def test_a_grpc_port_taken_or_shared_with_http_is_said_in_one_line():
    def refused(*flags):
        run = subprocess.run([sys.executable, "-m", "server.cli", *flags], capture_output=True, text=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120)
        assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr
        return run.stderr.strip()

    port = free_port()
    assert "gRPC needs a port of its own" in refused("--port", str(port), "--grpc-port", str(port))
    with socket.create_server(("127.0.0.1", 0)) as taken:  # another server there (gRPC's own would share it)
        taken_port = taken.getsockname()[1]
        said = refused("--port", str(port), "--grpc-port", str(taken_port))
    assert said == f"tmod-serve: cannot listen on 127.0.0.1:{taken_port}: Address already in use (--host / --grpc-port)"


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sigterm_answers_the_grpc_calls_under_way(workers, in_a_fresh_process):
    """Calls in flight when SIGTERM comes are answered (the gRPC server stops with a grace period, after
    HTTP has drained); the real backbone, so that a call of four long documents lasts seconds. The
    request timeout (the grace, and the engine's wait for its workers) is long: on a CI machine busy with
    other tests the calls take several times as long (one failed there at the default 30 s)."""
    port = free_port()
    url, process = start_tmod_serve(["--grpc-port", str(port), "--workers", workers, "--tasks", "ner",
                                     "--request-timeout-s", "300", "--log-level", "warning"],
                                    {**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        calls = in_a_fresh_process(long_calls, f"127.0.0.1:{port}", 3)
        wait_until(lambda: metric_sample(httpx.get(url + "/metrics").text, "tmod_requests_in_flight") >= 3,
                   "three calls in flight")
        process.send_signal(signal.SIGTERM)
        assert calls.result(timeout=600) == [4, 4, 4]
        assert process.wait(timeout=300) in (0, -signal.SIGTERM)
    finally:
        process.kill()
        process.wait()


def long_calls(address, count):
    """`count` calls at once, each of four long documents: each one's number of answers, or its error."""
    import threading

    long = " ".join(["Angela Merkel visited Munich and spoke with the mayor about the city's plans."] * 200)
    outcomes = []

    def call():
        try:
            answer = triton_client(address).infer("ner", [texts_input("text", [long] * 4)], client_timeout=600)
            outcomes.append(len(answer.as_numpy("entities")))
        except Exception as exc:  # noqa: BLE001 - recorded, and the test says which
            outcomes.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=call) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    return outcomes
