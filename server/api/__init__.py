"""The API layer: every protocol's routes (tmod's /v1, OIP v2 over HTTP and gRPC, KServe V1, OpenAI,
TEI, vLLM) decode and validate a request, hand its rows to the runtime and encode the answer
(`app.py` builds the server; `serving.py` is what every route shares)."""
