"""`tmod-serve --workers N`: N HTTP worker processes feed one engine process that owns the device.

The split is vLLM's (API server / engine core). Each worker runs the whole HTTP app (`server/api/app.py`:
validation, tokenization, decode) over a `RemoteRuntime`; the engine process (the one `tmod-serve`
started) runs the `Runtime` (backbone, modules, batcher, model runner) and an `EngineService` that
takes every worker's requests, so one batch forms across workers. The workers share one listening
socket (the kernel hands each connection to one of them); the engine process starts another worker
when one dies, and on SIGTERM stops the listener taking connections, lets the workers accept what is
already queued, stops them (each finishes its requests) and then drains its queue and exits
(`stop_taking_connections`).

Measured why (bench/bench_frontend.py): one process spends ~1 ms of CPU per 1-input request on HTTP,
JSON, tokenization and decode, which caps it near 1,000 requests/s whatever the device computes.

- `frames.py`: what crosses between a worker and the engine, one binary frame per event-loop
  iteration each way (requests, answers, rare pickled control messages).
- `engine_service.py`: the engine's side (`EngineService`, one `Peer` per worker).
- `remote_runtime.py`: a worker's side (`RemoteRuntime`, `run_worker`).
- `processes.py`: the process `tmod-serve` starts (`serve`, `serve_engines`, `WorkerPool`, the drain).

Backpressure and cancellation: a worker keeps at most `in_flight_limit` requests in the engine and
answers 429 beyond that (the engine refuses the same way a worker that sends more); a request whose
client left (asked once it has waited `DISCONNECT_CHECK_AFTER`, then every `WATCH_EVERY`) is
cancelled in the engine, so a batch that has not started yet drops it (no device work). A deadline
travels with the request and the engine's batcher drops a request past it before compute. The
engine says it is alive to each worker every `HEARTBEAT_S`; a worker that hears nothing for
`ENGINE_SILENT_S` answers 503 `engine_unresponsive`, health routes included, until it hears it again.
A module change (/admin) is made in the engine and sent to every worker; a request a worker sent before
it heard of it is answered by the set the change replaced (`REPLACED_SET_KEPT_S`).
"""
