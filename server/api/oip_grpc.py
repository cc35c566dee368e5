"""Open Inference Protocol v2 over gRPC (`--grpc-port`): what KServe's `InferenceGRPCClient` and
`tritonclient.grpc` speak, on its own port beside HTTP (Triton's 8001, KServe's 8081).

Served: ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelInfer, and Triton's
ModelConfig and RepositoryIndex (HTTP's `GET .../config` and `POST /v2/repository/index`) of
`inference.GRPCInferenceService` (server/api/oip_v2.proto); Triton's other RPCs (statistics, repository
load and unload, shared memory, streaming, trace and log settings) are answered UNIMPLEMENTED with
what to do instead (`REFUSED_RPCS`), any other name by gRPC itself. Beside
it, gRPC's standard health service (`Health`, below). A ModelInferRequest is read as its HTTP twin
(server/api/oip.py `read_request`: the same inputs, parameters, outputs and checks) and answered through
the same path, so a text gets the same answer on both transports; the outputs travel as
`raw_output_contents`, as Triton sends them.

Refusals carry a gRPC status and the message HTTP would give: 400/413/422 INVALID_ARGUMENT, 401
UNAUTHENTICATED, 404 NOT_FOUND, 429 RESOURCE_EXHAUSTED, 501 UNIMPLEMENTED, 503 UNAVAILABLE (a passed
deadline DEADLINE_EXCEEDED), anything else INTERNAL. With an API key (`--api-key`) every RPC but
ServerLive and ServerReady needs metadata `authorization: Bearer <key>` (tritonclient's `headers=`).
Messages over `--max-body-bytes` are refused by gRPC (RESOURCE_EXHAUSTED).

The message classes come from the compiled .proto (server/api/oip_v2_descriptor.py) in a descriptor pool
of their own: KServe's and Triton's client packages register the same names in protobuf's default
pool, and a process may hold either beside tmod.
"""
from __future__ import annotations

import asyncio
import functools
import logging

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from google.protobuf.message import DecodeError
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from server.api import oip
from server.api.admin import repository_index
from server.api.oip_v2_descriptor import FILE
from server.api.serving import Serving
from server.errors import ApiError, count_error
from server.logs import request_id, request_id_for
from server.ports import address

log = logging.getLogger("tmod")

SERVICE = "inference.GRPCInferenceService"
_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(descriptor_pb2.FileDescriptorProto.FromString(FILE))


def message(name: str):
    """The class of the protocol's message `name` (e.g. "ModelInferRequest")."""
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"inference.{name}"))


STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
          404: grpc.StatusCode.NOT_FOUND, 409: grpc.StatusCode.FAILED_PRECONDITION,
          413: grpc.StatusCode.INVALID_ARGUMENT, 422: grpc.StatusCode.INVALID_ARGUMENT,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 499: grpc.StatusCode.CANCELLED,
          501: grpc.StatusCode.UNIMPLEMENTED, 503: grpc.StatusCode.UNAVAILABLE}
OPEN_RPCS = frozenset({"ServerLive", "ServerReady"})  # probes: no key, as HTTP's health routes
# Triton's other RPCs, answered UNIMPLEMENTED with what to do instead (not gRPC's bare "Method not found!")
SHARED_MEMORY = "shared memory is not served: send the inputs in the request (raw_input_contents)"
REFUSED_RPCS = {
    "ModelStatistics": oip.STATISTICS_REFUSED,
    "RepositoryModelLoad": "repository load is served over HTTP, with the admin token: POST "
                           "/v2/repository/models/<task>/load on the HTTP port (tritonclient.http's load_model)",
    "RepositoryModelUnload": "repository unload is served over HTTP, with the admin token: POST "
                             "/v2/repository/models/<task>/unload on the HTTP port (tritonclient.http's unload_model)",
    **{f"{kind}SharedMemory{verb}": SHARED_MEMORY for kind in ("System", "Cuda")
       for verb in ("Status", "Register", "Unregister")},
    "TraceSetting": "trace settings are not served",
    "LogSettings": "log settings are not served: tmod-serve's --log-level sets the log at start",
}
STREAM_REFUSED = "streaming inference is not served: call ModelInfer, one request and one response"


def parameter_values(parameters) -> dict:
    """A map of InferParameter -> {name: its value} (bool, int, str or float, as JSON would give it)."""
    values = {}
    for name, parameter in parameters.items():
        kind = parameter.WhichOneof("parameter_choice")
        if kind is not None:
            values[name] = getattr(parameter, kind)
    return values


def as_oip_request(request) -> tuple[dict, bytes]:
    """A ModelInferRequest as the HTTP protocol's JSON header and binary part (raw contents become
    tensors of the binary data extension), for `oip.read_request` to check and read."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise ApiError(400, "invalid_request", f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} "
                                               "inputs: one per input, or none (then each input's contents)")
    inputs = []
    for i, tensor in enumerate(request.inputs):
        entry = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape),
                 "parameters": parameter_values(tensor.parameters)}
        if raw:
            entry["parameters"]["binary_data_size"] = len(raw[i])
        else:
            entry["data"] = list(tensor.contents.bytes_contents)
        inputs.append(entry)
    header = {"inputs": inputs, "parameters": parameter_values(request.parameters)}
    if request.id:
        header["id"] = request.id
    if request.outputs:
        header["outputs"] = [{"name": o.name, "parameters": parameter_values(o.parameters)} for o in request.outputs]
    return header, b"".join(raw)


class GrpcCall:
    """What the inference path reads of a request besides its content: whether its client left."""

    __slots__ = ("context",)

    def __init__(self, context):
        self.context = context

    async def is_disconnected(self) -> bool:
        return self.context.cancelled()


def service(app, serving: Serving, oip_answer, authorized):
    """The generic handler of `inference.GRPCInferenceService` over the app's own OIP functions: the
    app's `serving` (server/api/serving.py), `oip_answer(module, read, call)` to answer a read request
    (server/api/oip.py `oip_routes`), `authorized(headers)` to check the API key."""
    require_ready, require_serving, oip_module = serving.require_ready, serving.require_serving, serving.module

    methods = _POOL.FindServiceByName(SERVICE).methods_by_name

    def rpc(name, answer, inference=False):
        """The handler of RPC `name` (its message types the .proto's): `answer(request, context)`, guarded."""
        request_type = methods[name].input_type.name
        parse = message(request_type).FromString

        async def handle(body: bytes, context):
            metadata = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in context.invocation_metadata()
                        if isinstance(v, str)]
            rid = request_id_for(metadata)  # as HTTP's: the client's x-request-id, else its traceparent's trace id
            request_id.set(rid)  # this call's own context: its log lines carry it
            context.set_trailing_metadata((("x-request-id", rid),))
            try:
                if name not in OPEN_RPCS and not authorized(metadata):
                    raise ApiError(401, "unauthorized", "this server needs metadata 'authorization: Bearer <API key>'")
                try:  # here, not by gRPC: its own refusal of a malformed message is UNKNOWN, and logged as an error
                    request = parse(body)
                except DecodeError:
                    raise ApiError(400, "invalid_request", f"the message is not a protobuf {request_type}") from None
                return await answer(request, context)
            except ApiError as exc:
                count_error(app, exc.type, inference)
                code = grpc.StatusCode.DEADLINE_EXCEEDED if exc.type == "deadline_exceeded" else \
                    STATUS.get(exc.status, grpc.StatusCode.INTERNAL)
                await context.abort(code, exc.message)
            except Exception as exc:  # noqa: BLE001 - answered INTERNAL, its traceback logged, as HTTP's 500
                log.error("unhandled error on gRPC %s", name, exc_info=exc)
                count_error(app, "internal_error", inference)
                await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {str(exc)[:200]}")

        return grpc.unary_unary_rpc_method_handler(
            handle, response_serializer=message(methods[name].output_type.name).SerializeToString)

    async def server_live(request, context):
        return message("ServerLiveResponse")(live=True)

    async def server_ready(request, context):
        try:
            require_serving()
        except ApiError:
            return message("ServerReadyResponse")(ready=False)
        return message("ServerReadyResponse")(ready=True)

    async def model_ready(request, context):
        require_ready()
        try:
            oip_module(request.name, request.version or None)
        except ApiError:
            return message("ModelReadyResponse")(ready=False)
        return message("ModelReadyResponse")(ready=True)

    async def server_metadata(request, context):
        return message("ServerMetadataResponse")(
            name="tmod", version=app.version, extensions=["binary_tensor_data", "classification", "model_configuration"])

    async def model_metadata(request, context):
        require_ready()
        found = oip.model_metadata(oip_module(request.name, request.version or None))
        answer = message("ModelMetadataResponse")(name=found["name"], versions=found["versions"],
                                                  platform=found["platform"])
        for field in ("inputs", "outputs"):
            for tensor in found[field]:
                getattr(answer, field).add(name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"])
        return answer

    async def model_config(request, context):
        require_ready()
        config = oip.model_config(oip_module(request.name, request.version or None))
        if not all(v.isdigit() for v in config["version_policy"]["specific"]["versions"]):
            del config["version_policy"]  # Triton's versions are numbers: "mpnet-2" has no place there
        return message("ModelConfigResponse")(config=json_format.ParseDict(config, message("ModelConfig")()))

    async def repository_index_rpc(request, context):
        require_ready()
        answer = message("RepositoryIndexResponse")()
        for model in repository_index(serving, request.ready):
            answer.models.add(**model)
        return answer

    async def model_infer(request, context):
        require_ready()
        module = oip_module(request.model_name, request.model_version or None)
        read = oip.read_request(*as_oip_request(request))
        module, tensors, _ = await oip_answer(module, read, GrpcCall(context))
        answer = message("ModelInferResponse")(model_name=module.task, model_version=module.version,
                                               id=read[0].get("id", ""))
        for name, datatype, array, _ in tensors:
            answer.outputs.add(name=name, datatype=datatype, shape=array.shape)
            answer.raw_output_contents.append(oip.tensor_bytes(datatype, array))
        return answer

    answers = {"ServerLive": server_live, "ServerReady": server_ready, "ModelReady": model_ready,
               "ServerMetadata": server_metadata, "ModelMetadata": model_metadata, "ModelInfer": model_infer,
               "ModelConfig": model_config, "RepositoryIndex": repository_index_rpc}
    async def refuse(request, context, message):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, message)

    async def refuse_stream(requests, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, STREAM_REFUSED)

    refused = {name: grpc.unary_unary_rpc_method_handler(functools.partial(refuse, message=message))
               for name, message in REFUSED_RPCS.items()}  # their requests are never read: bytes as they came
    return grpc.method_handlers_generic_handler(SERVICE, {
        **{name: rpc(name, answer, inference=name == "ModelInfer") for name, answer in answers.items()}, **refused,
        "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(refuse_stream)})


class Health(health_pb2_grpc.HealthServicer):
    """gRPC's standard health service, `grpc.health.v1.Health` (Kubernetes' gRPC probes, Envoy's and
    gRPC clients' health checks; its messages and registration from grpcio-health-checking): the whole
    server ("") and `inference.GRPCInferenceService` are SERVING while the server can infer (as ServerReady
    and /v2/health/ready), else NOT_SERVING: loading, every module unloaded, stopping. No API key, as the
    probes. Each call reads the state itself: the package's own servicer keeps one shared wait per service,
    which the first Watch to leave takes from the others (they then hear of no change)."""

    SERVICES = (health.OVERALL_HEALTH, SERVICE)

    def __init__(self, require_serving, every_s: float = 1.0):
        self.require_serving = require_serving
        self.every_s = every_s  # how often a Watch looks again (readiness has no event of its own)
        self.stopping = False

    def status(self, service: str):
        if service not in self.SERVICES:
            return None
        if self.stopping:
            return health_pb2.HealthCheckResponse.NOT_SERVING
        try:
            self.require_serving()
        except ApiError:
            return health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse.SERVING

    async def Check(self, request, context):
        status = self.status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no service {request.service!r}: "
                                f"this server reports {list(self.SERVICES)}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request, context):
        """Each change of the status, the first at once; an unknown service is SERVICE_UNKNOWN (the
        protocol's answer, a name that may yet appear). Once the server stops: NOT_SERVING, and the stream
        ends, so that an open watch does not hold the stop for its whole grace."""
        last = None
        while True:
            status = self.status(request.service)
            if status is None:
                status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if self.stopping:
                return
            await asyncio.sleep(self.every_s)


async def start(handler, health_service: Health, host: str, port: int, max_message_bytes: int) -> aio.Server:
    """A gRPC server with `handler` and the health service listening on host:port (SO_REUSEPORT, gRPC's
    default on Linux, lets every HTTP worker process listen on the one port)."""
    server = aio.server(options=[("grpc.max_receive_message_length", max_message_bytes),
                                 ("grpc.max_send_message_length", -1)])
    server.add_generic_rpc_handlers((handler,))
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    if server.add_insecure_port(address(host, port)) == 0:
        raise RuntimeError(f"gRPC cannot listen on {host}:{port} (--host / --grpc-port)")
    await server.start()
    return server
