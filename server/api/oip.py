"""Open Inference Protocol v2 (KServe / Triton REST) for each task, with the binary data extension:
its routes (`oip_routes`; Triton's repository routes are server/api/admin.py's) and how they read and
answer; its gRPC twin (server/api/oip_grpc.py) reads and answers through the same functions.

Inputs: a BYTES tensor `text` of shape [N] (and optionally `text_pair`, as many texts); another shape
(e.g. tritonclient's [1, N]) is read as its texts in row-major order, and every output then leads
with that shape instead of [N]. Outputs per
task type: sequence tasks `label` (BYTES [N]), `score` (FP32 [N]), `scores` (FP32 [N, C], columns in
the order of the model's `labels` parameter); token tasks `entities` (BYTES [N], each a JSON list
of {text, label, start, end, score}; with aggregation "none" the list of word pieces); multi-label
tasks `labels` (BYTES [N], each a JSON list of the labels at or over their threshold) and `scores`;
regression `value` (FP32 [N]); embeddings `embedding` (FP32 [N, D]).

Request parameters: `truncate`, `window`, `stride` and the answer controls of /v1/infer (`top_k`,
`raw_scores`, `threshold`, `aggregation`, `truncation_direction`; server/api/schemas.py AnswerControls);
one spelt near these (`topk`) is refused, any other let pass (another server's: Triton's `priority`). The
classification extension (as Triton defines it): an output requested with the parameter
`"classification": k` (tritonclient's `class_count`) comes back as BYTES [N, k] strings
"score:index:label", best first; only `scores` can be asked for so. `top_k` asks it of `scores`
for every request that does not name its outputs.

The binary data extension (what `tritonclient` uses by default): the body is a JSON header of
`Inference-Header-Content-Length` bytes followed by raw tensors; BYTES elements are each a 4-byte
little-endian length and the bytes.
"""
from __future__ import annotations

import json
import math
import re
import struct
from typing import Any

import msgspec
import numpy as np

from modules_store import TaskType

from server import windows
from server.api.schemas import AnswerControls
from server.api.serving import Serving
from server.errors import ApiError, clip, clip_list, did_you_mean
from server.heads.embedding import vector_size
from server.modules import LoadedModule, compares_pairs

HEADER = "inference-header-content-length"
INPUTS = ("text", "text_pair")
DIGITS = re.compile(r"[0-9]{1,18}")  # not str.isdigit(): it is true for '²', which int() refuses
MAX_DATA_DEPTH = 32  # nesting of a tensor's "data" (row-major lists); deeper is refused, never recursed into


def model_metadata(module: LoadedModule) -> dict[str, Any]:
    return {
        "name": module.task,
        "versions": [module.version],
        "platform": f"tmod-{module.manifest.kind}",
        "inputs": input_specs(module),
        "outputs": output_specs(module),
        "parameters": {"labels": module.manifest.labels, "task_type": module.manifest.task_type.value},
    }


TRITON_TYPES = {"BYTES": "TYPE_STRING", "FP32": "TYPE_FP32"}
# Triton's statistics extension is not served (its counts are per model and per batch, and one pass
# serves every task): what HTTP's and gRPC's refusals say instead
STATISTICS_REFUSED = ("Triton's statistics extension is not served (GET /v2 lists the extensions that are): "
                      "requests per task, phase latencies and batch sizes are Prometheus metrics at GET /metrics "
                      "(tmod_task_requests_total, tmod_request_duration_seconds, tmod_batch_size)")


def model_config(module: LoadedModule) -> dict[str, Any]:
    """Triton's model configuration extension (`GET .../config`, tritonclient's `get_model_config`):
    the metadata's tensors as a ModelConfig. `max_batch_size` 0: the batch dimension is the tensors'
    own first one ([-1]), as the metadata declares it (tmod batches requests together itself)."""
    def tensors(specs):
        return [{"name": t["name"], "data_type": TRITON_TYPES[t["datatype"]], "dims": t["shape"]} for t in specs]

    return {"name": module.task, "platform": f"tmod-{module.manifest.kind}", "backend": "tmod",
            "version_policy": {"specific": {"versions": [module.version]}}, "max_batch_size": 0,
            "input": tensors(input_specs(module)), "output": tensors(output_specs(module)),
            "parameters": {"task_type": {"string_value": module.manifest.task_type.value},
                           "labels": {"string_value": json.dumps(module.manifest.labels)}}}


def input_specs(module: LoadedModule) -> list[dict[str, Any]]:
    """`text`; pair tasks (a text with a text pair) also `text_pair`, which they need."""
    inputs = [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    if compares_pairs(module.manifest):
        inputs.append({"name": "text_pair", "datatype": "BYTES", "shape": [-1]})
    return inputs


def output_specs(module: LoadedModule) -> list[dict[str, Any]]:
    task_type = module.manifest.task_type
    if task_type == TaskType.sequence_classification:
        return [{"name": "label", "datatype": "BYTES", "shape": [-1]},
                {"name": "score", "datatype": "FP32", "shape": [-1]},
                {"name": "scores", "datatype": "FP32", "shape": [-1, len(module.manifest.labels)]}]
    if task_type == TaskType.multi_label_classification:
        return [{"name": "labels", "datatype": "BYTES", "shape": [-1]},
                {"name": "scores", "datatype": "FP32", "shape": [-1, len(module.manifest.labels)]}]
    if task_type == TaskType.token_classification:
        return [{"name": "entities", "datatype": "BYTES", "shape": [-1]}]
    if task_type == TaskType.embedding:
        return [{"name": "embedding", "datatype": "FP32", "shape": [-1, vector_size(module.manifest.config)]}]
    return [{"name": "value", "datatype": "FP32", "shape": [-1]}]


# the request parameters tmod reads; others pass (a client's own, another server's: Triton's `priority`)
READ_PARAMETERS = frozenset({*AnswerControls.__struct_fields__, "truncate", "window", "stride", "binary_data_output"})


def answer_controls(request: dict) -> AnswerControls:
    """The request parameters that are answer controls, validated as /v1/infer validates them (422). A
    parameter that is a near miss of one tmod reads (`topk`) is refused (400): it would be ignored."""
    parameters = request.get("parameters") or {}
    unknown = sorted(name for name in parameters if name not in READ_PARAMETERS)
    if unknown and (hint := did_you_mean(unknown, READ_PARAMETERS)):
        raise ApiError(400, "invalid_request", f"unknown request parameter{hint}: the request parameters read are "
                                               f"{sorted(READ_PARAMETERS)}")
    given = {name: parameters[name] for name in AnswerControls.__struct_fields__ if name in parameters}
    try:
        return msgspec.convert(given, AnswerControls, strict=True)
    except msgspec.ValidationError as exc:
        text, _, where = str(exc).partition(" - at `$.")
        raise ApiError(422, "invalid_request",
                       f"invalid request parameter(s): {where.rstrip('`')}: {text}"[:300]) from None


def check_declared_inputs(module: LoadedModule, text_pairs: list[str] | None) -> None:
    """A model reads the inputs its metadata declares (`input_specs`): `text_pair` only for pair tasks."""
    if text_pairs is not None and not compares_pairs(module.manifest):
        raise ApiError(400, "invalid_request", f"model {module.task!r} has one input, 'text' (see GET /v2/models/"
                                               f"{module.task}): it reads single texts, not 'text_pair'")


# ---- decoding requests -----------------------------------------------------------------------
def _bytes_elements(raw: bytes, name: str) -> list[bytes]:
    items, pos = [], 0
    while pos < len(raw):
        if pos + 4 > len(raw):
            raise ApiError(400, "invalid_request", f"input {name!r}: truncated BYTES element length")
        (size,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + size > len(raw):
            raise ApiError(400, "invalid_request", f"input {name!r}: BYTES element overruns the body")
        items.append(raw[pos:pos + size])
        pos += size
    return items


def _as_text(value: Any, name: str, index: int) -> str:
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ApiError(400, "invalid_request", f"input {name!r} element {index} is not valid UTF-8") from exc
    if not isinstance(value, str):
        raise ApiError(400, "invalid_request", f"input {name!r} element {index} must be a string")
    return value


def bool_parameter(parameters: dict, name: str, default: bool = False) -> bool:
    """A boolean request parameter, strictly: JSON true or false (the string "false" is not false)."""
    value = parameters.get(name, default)
    if not isinstance(value, bool):
        raise ApiError(400, "invalid_request", f"parameter {name!r} must be true or false, not {clip(value)}")
    return value


def _parameters(owner: dict, where: str) -> dict:
    value = owner.get("parameters")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ApiError(400, "invalid_request", f"{where} 'parameters' must be an object, not {clip(value)}")
    return value


def _shape(tensor: dict, name: str) -> list[int]:
    shape = tensor.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_DATA_DEPTH or \
            not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ApiError(400, "invalid_request", f"input {name!r}: shape must be a list of non-negative integers, "
                                               f"not {clip(shape)}")
    return shape


def _flatten(data: Any, name: str) -> list:
    """A tensor's "data" in row-major order (flat or nested lists), without recursion."""
    if not isinstance(data, list):
        raise ApiError(400, "invalid_request", f"input {name!r}: 'data' must be a list")
    out, stack = [], [(iter(data), 1)]
    while stack:
        items, depth = stack[-1]
        item = next(items, stack)  # the stack itself marks the end
        if item is stack:
            stack.pop()
        elif isinstance(item, list):
            if depth >= MAX_DATA_DEPTH:
                raise ApiError(400, "invalid_request", f"input {name!r}: 'data' is nested deeper than {MAX_DATA_DEPTH}")
            stack.append((iter(item), depth + 1))
        else:
            out.append(item)
    return out


def parse_request(body: bytes, header_length: str | None) -> tuple[dict, list[str], list[str] | None, list[int]]:
    """An HTTP request's body -> (the JSON header, texts, text pairs or None, the shape of `text`)."""
    if header_length is not None:
        if not DIGITS.fullmatch(header_length) or int(header_length) > len(body):
            raise ApiError(400, "invalid_request", f"bad {HEADER} header {clip(header_length)}")
        json_part, binary = body[: int(header_length)], body[int(header_length):]
    else:
        json_part, binary = body, b""
    try:
        request = json.loads(json_part)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(422, "invalid_request", f"request is not valid JSON: {str(exc)[:200]}") from exc
    except RecursionError as exc:
        raise ApiError(400, "invalid_request", "request JSON is nested too deeply") from exc
    return read_request(request, binary)


def read_request(request: Any, binary: bytes) -> tuple[dict, list[str], list[str] | None, list[int]]:
    """A request's JSON header and its binary part (the binary data extension's tensors, or gRPC's raw
    contents) -> (the header, texts, text pairs or None, the shape of `text`): every check made here,
    before any compute, for both transports."""
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list) or not request["inputs"]:
        raise ApiError(422, "invalid_request", "request needs a non-empty 'inputs' list")
    tensors: dict[str, list[str]] = {}
    shapes: dict[str, list[int]] = {}
    offset = 0
    for tensor in request["inputs"]:
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise ApiError(422, "invalid_request", "each input needs a 'name'")
        name = tensor["name"]
        if name not in INPUTS:
            raise ApiError(400, "invalid_request", f"unknown input {clip(name)}{did_you_mean([name], INPUTS)}; inputs "
                                                   "are 'text' and, for a pair task, 'text_pair' (GET /v2/models/<task>)")
        if name in tensors:
            raise ApiError(400, "invalid_request", f"input {name!r} is given twice")
        if tensor.get("datatype") != "BYTES":
            got = f"got {clip(tensor['datatype'])}" if "datatype" in tensor else "none given"
            raise ApiError(400, "invalid_request", f"input {name!r} must have datatype BYTES ({got}; BYTES is the "
                                                   "protocol's type for strings)")
        shape = shapes[name] = _shape(tensor, name)
        size = _parameters(tensor, f"input {name!r}").get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(binary):
                raise ApiError(400, "invalid_request", f"input {name!r}: binary_data_size {clip(size)} overruns the body")
            values = _bytes_elements(binary[offset:offset + size], name)
            offset += size
        else:
            values = _flatten(tensor.get("data", []), name)
        tensors[name] = [_as_text(v, name, i) for i, v in enumerate(values)]
        if math.prod(shape) != len(tensors[name]) or not shape:
            raise ApiError(400, "invalid_request", f"input {name!r}: shape {clip(shape)} does not match "
                                                   f"{len(tensors[name])} elements")
    bool_parameter(_parameters(request, "request"), "binary_data_output")  # checked here, before any compute
    _requested_outputs(request)
    if "text" not in tensors:
        raise ApiError(400, "invalid_request", "input 'text' is required")
    pairs = tensors.get("text_pair")
    if pairs is not None and len(pairs) != len(tensors["text"]):
        raise ApiError(400, "invalid_request", "inputs 'text' and 'text_pair' must have the same length")
    return request, tensors["text"], pairs, shapes["text"]


# ---- encoding responses ----------------------------------------------------------------------
def _output_arrays(module: LoadedModule, results: list[dict]) -> dict[str, tuple[str, np.ndarray]]:
    task_type = module.manifest.task_type
    if task_type == TaskType.sequence_classification:
        labels = module.manifest.labels
        return {
            "label": ("BYTES", np.array([(r["label"] or "").encode() for r in results], dtype=object)),  # "": none
            "score": ("FP32", np.array([r["score"] for r in results], dtype=np.float32)),
            "scores": ("FP32", np.array([[r["scores"][l] for l in labels] for r in results], dtype=np.float32)),
        }
    if task_type == TaskType.multi_label_classification:
        labels = module.manifest.labels
        return {
            "labels": ("BYTES", np.array([json.dumps(r["labels"]).encode() for r in results], dtype=object)),
            "scores": ("FP32", np.array([[r["scores"][l] for l in labels] for r in results], dtype=np.float32)),
        }
    if task_type == TaskType.token_classification:
        return {"entities": ("BYTES", np.array([json.dumps(r["entities"] if "entities" in r else r["tokens"]).encode()
                                                for r in results], dtype=object))}
    if task_type == TaskType.embedding:
        return {"embedding": ("FP32", np.array([r["embedding"] for r in results], dtype=np.float32))}
    return {"value": ("FP32", np.array([r["value"] for r in results], dtype=np.float32))}


def _requested_outputs(request: dict) -> list[dict]:
    """The request's "outputs" entries, each an object with a string name (checked before compute)."""
    wanted = request.get("outputs")
    if wanted is None:
        return []
    if not isinstance(wanted, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in wanted):
        raise ApiError(400, "invalid_request", "'outputs' must be a list of objects, each with a string 'name'")
    for output in wanted:
        bool_parameter(_parameters(output, f"output {clip(output['name'])}"), "binary_data")
    return wanted


def classification(scores: np.ndarray, labels: list[str], k: int) -> np.ndarray:
    """The classification extension: (N, C) scores -> (N, min(k, C)) BYTES "score:index:label", best
    first (equal scores in label order); the score printed as Triton prints it (six decimals)."""
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.array([[f"{row[i]:f}:{i}:{labels[i]}".encode() for i in top] for row, top in zip(scores, order)],
                    dtype=object).reshape(len(scores), -1)


def _classification_count(name: str, parameters: dict, arrays: dict) -> int | None:
    k = parameters.get("classification")
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ApiError(400, "invalid_request", f"output {name!r}: classification must be a whole number >= 1, got {k!r}")
    if name != "scores" or "scores" not in arrays:
        raise ApiError(400, "invalid_request", f"output {name!r} holds no class scores: only 'scores' of a sequence or "
                                               "multi-label task takes the classification parameter")
    return k


def response_tensors(module: LoadedModule, request: dict, results: list[dict], top_k: int | None = None,
                     shape: list[int] | None = None) -> list[tuple[str, str, np.ndarray, bool]]:
    """The answer's tensors, (name, datatype, array, whether asked for as binary data), those the request
    names or else every output. Outputs asked for with `"classification": k` (or `scores` when the
    request's `top_k` is k and it names no outputs) come back in the classification extension's form.
    Each output leads with the shape of the request's `text` (default [N]): texts sent as [1, N] get
    labels [1, N], scores [1, N, C]."""
    arrays = _output_arrays(module, results)
    wanted = _requested_outputs(request)
    binary_default = bool_parameter(_parameters(request, "request"), "binary_data_output")
    if wanted:
        unknown = [o["name"] for o in wanted if o["name"] not in arrays]
        if unknown:
            raise ApiError(400, "invalid_request", f"unknown output(s) {clip_list(unknown)}; outputs are {sorted(arrays)}")
        selection = [(o["name"], bool_parameter(_parameters(o, f"output {o['name']!r}"), "binary_data", binary_default),
                      _classification_count(o["name"], _parameters(o, f"output {o['name']!r}"), arrays)
                      or (top_k if o["name"] == "scores" else None)) for o in wanted]
    else:
        selection = [(name, binary_default, top_k if name == "scores" else None) for name in arrays]
    tensors = []
    for name, binary, count in selection:
        datatype, array = arrays[name]
        if count is not None:
            datatype, array = "BYTES", classification(array, module.manifest.labels, count)
        if shape is not None:
            array = array.reshape([*shape, *array.shape[1:]])
        tensors.append((name, datatype, array, binary))
    return tensors


def tensor_bytes(datatype: str, array: np.ndarray) -> bytes:
    """A tensor as raw bytes (the binary data extension, gRPC's raw contents): BYTES elements each a
    4-byte little-endian length and the bytes, FP32 little-endian."""
    if datatype == "BYTES":
        return b"".join(struct.pack("<I", len(item)) + item for item in array.reshape(-1))
    return array.astype("<f4").tobytes()


def encode_response(module: LoadedModule, request: dict, tensors: list[tuple[str, str, np.ndarray, bool]]
                    ) -> tuple[bytes, dict[str, str]]:
    """The HTTP answer, (body, extra headers): `response_tensors` in binary where the request asked for it,
    JSON otherwise."""
    outputs, blobs = [], []
    for name, datatype, array, binary in tensors:
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if binary:
            blob = tensor_bytes(datatype, array)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            flat = array.reshape(-1).tolist()
            entry["data"] = [v.decode() for v in flat] if datatype == "BYTES" else flat
        outputs.append(entry)
    header = {"model_name": module.task, "model_version": module.version, "outputs": outputs}
    if "id" in request:
        header["id"] = request["id"]
    head = json.dumps(header).encode()
    if not blobs:
        return head, {"content-type": "application/json"}
    return head + b"".join(blobs), {"content-type": "application/octet-stream", HEADER: str(len(head))}


def oip_routes(app, serving: Serving):
    """Adds the protocol's server, health and model metadata routes to the FastAPI `app` (Triton's
    repository routes: server/api/admin.py) -> (infer, answer): `infer(body, request, task, version)`
    answers an HTTP inference request (the app's raw ASGI layer calls it); `answer(module, read, request)`
    a read one, over HTTP or gRPC."""
    require_ready, module_of = serving.require_ready, serving.module

    @app.get("/v2", tags=["oip-v2"])
    async def oip_server_metadata():
        return {"name": "tmod", "version": app.version,
                "extensions": ["binary_tensor_data", "classification", "model_configuration", "model_repository"]}

    @app.get("/v2/health/live", tags=["oip-v2"])
    async def oip_live():
        return {"live": True}

    @app.get("/v2/health/ready", tags=["oip-v2"], responses={503: {}})
    async def oip_ready():
        serving.require_serving()
        return {"ready": True}

    # before the model routes (/v2/models/stats is no model called "stats"); a refusal, not in the schema
    @app.get("/v2/models/stats", include_in_schema=False)
    @app.get("/v2/models/{task}/stats", include_in_schema=False)
    @app.get("/v2/models/{task}/versions/{version}/stats", include_in_schema=False)
    async def oip_statistics(task: str | None = None, version: str | None = None):
        """Triton's statistics extension (tritonclient's `get_inference_statistics`) is not served: its
        counts are per model and per batch, and tmod's passes serve every task at once. Said, with where
        tmod's own counts are, instead of a bare 404 (or "no model 'stats'")."""
        raise ApiError(404, "not_found", STATISTICS_REFUSED)

    @app.get("/v2/models/{task}", tags=["oip-v2"], responses={404: {}})
    @app.get("/v2/models/{task}/versions/{version}", tags=["oip-v2"], responses={404: {}})
    async def oip_model_metadata(task: str, version: str | None = None):
        require_ready()
        return model_metadata(module_of(task, version))

    @app.get("/v2/models/{task}/config", tags=["oip-v2"], responses={404: {}})
    @app.get("/v2/models/{task}/versions/{version}/config", tags=["oip-v2"], responses={404: {}})
    async def oip_model_config(task: str, version: str | None = None):
        """Triton's model configuration extension (tritonclient's `get_model_config`)."""
        require_ready()
        return model_config(module_of(task, version))

    @app.get("/v2/models/{task}/ready", tags=["oip-v2"], responses={404: {}})
    @app.get("/v2/models/{task}/versions/{version}/ready", tags=["oip-v2"], responses={404: {}})
    async def oip_model_ready(task: str, version: str | None = None):
        require_ready()
        module = module_of(task, version)
        return {"name": module.task, "version": module.version, "ready": True}

    async def answer(module: LoadedModule, read: tuple, request) -> tuple[LoadedModule, list, dict]:
        """An OIP inference request, read (`read_request`) over HTTP or gRPC, answered: (the module
        version that answered, each text's answer, the timing headers). `request`: its `is_disconnected`."""
        parsed, texts, text_pairs, shape = read
        task = module.task
        check_declared_inputs(module, text_pairs)
        serving.fit_to_inputs({task: module}, text_pairs is not None, named=True)
        parameters = parsed.get("parameters") or {}
        truncate = bool_parameter(parameters, "truncate")
        window, stride = (windows.whole_number(parameters, name) for name in ("window", "stride"))
        controls = answer_controls(parsed)
        # top_k reaches OIP clients as the classification extension on `scores`: decode every label
        decoded = msgspec.structs.replace(controls, top_k=None)
        results, job, headers = await serving.run_inference(texts, text_pairs, {task: module}, truncate, request,
                                                            window, stride, decoded)
        module = job.modules[task]  # the version that answered
        return module, response_tensors(module, parsed, [r[task] for r in results], controls.top_k, shape), headers

    async def infer(body: bytes, request, task: str, version: str | None) -> tuple[bytes, dict]:
        """Body: OIP v2 JSON, or the binary data extension (Inference-Header-Content-Length)."""
        require_ready()
        module = module_of(task, version)
        read = parse_request(body, request.header(HEADER.encode()))
        module, tensors, headers = await answer(module, read, request)
        content, extra = encode_response(module, read[0], tensors)
        return content, {**headers, **extra}

    return infer, answer
