"""Shared test helpers: tiny random backbones and random-weight modules, real files on disk."""
from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import torch
import uvicorn
from transformers import (AutoTokenizer, BertConfig, BertModel, DistilBertConfig, DistilBertModel, LlamaConfig, LlamaModel,
                          MPNetConfig, MPNetModel, RobertaConfig, RobertaModel)

from bench.live_server import free_port
from modules_store import ModuleStore
from server.backbone import Backbone, default_backbone_path
from server.heads.layermix import LayerMixConfig, LayerMixHead
from server.modules import save_module
from server.ports import http_url

NER_LABELS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]


def make_tiny_backbone_dir(root: Path, family: str = "bert", layers: int = 3, seed: int = 0) -> Path:
    """A randomly initialised encoder (or Llama-style decoder: family "llama") with the real MiniLM
    tokenizer (family "mpnet": an MPNet tokenizer over the same vocabulary), saved like a hub checkout."""
    tokenizer = AutoTokenizer.from_pretrained(default_backbone_path(), local_files_only=True)
    vocab = len(tokenizer)
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, max_position_embeddings=128)
    if family == "bert":
        model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                                     intermediate_size=64, architectures=["BertModel"], **common))
    elif family == "roberta":
        model = RobertaModel(RobertaConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                                           intermediate_size=64, pad_token_id=tokenizer.pad_token_id,
                                           architectures=["RobertaModel"], **common))
    elif family == "distilbert":
        model = DistilBertModel(DistilBertConfig(dim=32, n_layers=layers, n_heads=2, hidden_dim=64,
                                                 architectures=["DistilBertModel"], **common))
    elif family == "mpnet":
        tokenizer = mpnet_style_tokenizer(root)
        model = MPNetModel(MPNetConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=layers,
                                       num_attention_heads=2, intermediate_size=64, max_position_embeddings=130,
                                       architectures=["MPNetModel"]))
    elif family == "llama":
        model = LlamaModel(LlamaConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                                       num_key_value_heads=1, intermediate_size=64, pad_token_id=tokenizer.pad_token_id,
                                       architectures=["LlamaModel"], **common))
    else:
        raise ValueError(family)
    path = root / f"tiny-{family}"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def mpnet_style_tokenizer(root: Path):
    """A fast tokenizer laid out as all-mpnet-base-v2's (<s>=0, <pad>=1, </s>=2, <unk>=3, pairs as
    `<s> A </s></s> B </s>`, no token types) over MiniLM's lower-casing WordPiece vocabulary."""
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads((Path(default_backbone_path()) / "tokenizer.json").read_text(encoding="utf-8"))
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    words = [w for w, _ in sorted(spec["model"]["vocab"].items(), key=lambda item: item[1]) if not w.startswith("[")]
    vocab = {w: i for i, w in enumerate(specials + words + ["<mask>"])}
    spec["model"].update(vocab=vocab, unk_token="<unk>")
    spec["added_tokens"] = [{"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for t in specials + ["<mask>"]]
    spec["post_processor"] = {"type": "RobertaProcessing", "sep": ["</s>", 2], "cls": ["<s>", 0],
                              "trim_offsets": True, "add_prefix_space": False}
    spec["padding"] = spec["truncation"] = None
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token="<s>",
                                   eos_token="</s>", sep_token="</s>", cls_token="<s>", pad_token="<pad>",
                                   unk_token="<unk>", mask_token="<mask>", model_max_length=128)


def random_head(backbone: Backbone, task_type: str, labels: list[str], seed: int, **config) -> LayerMixHead:
    torch.manual_seed(seed)
    layers = config.pop("layers", list(range(backbone.num_layers + 1)))
    head = LayerMixHead(
        LayerMixConfig(task_type=task_type, num_labels=len(labels), hidden_size=backbone.hidden_size,
                       layers=layers, **{"project_dim": 16, "attention_heads": 2, "ffn_dim": 32, **config}),
        labels,
    )
    with torch.no_grad():  # spread the layer logits so the mix is not uniform
        head.layer_logits.copy_(torch.randn(len(layers)) * 0.05)
    return head.eval()


def populate_store(store_dir: Path, backbone: Backbone) -> ModuleStore:
    """sentiment (sequence), ner (token, BIO) and acceptability (reads only shallow layers)."""
    store = ModuleStore(store_dir)
    save_module(store, "sentiment", "1", random_head(backbone, "sequence_classification", ["negative", "positive"], 1), backbone)
    save_module(store, "ner", "1", random_head(backbone, "token_classification", NER_LABELS, 2, casing=True), backbone)
    save_module(store, "acceptability", "1", random_head(
        backbone, "sequence_classification", ["unacceptable", "acceptable"], 3, layers=[0, 1]), backbone)
    return store


def with_a_pair_task(root: Path, store: ModuleStore, backbone: Backbone) -> Path:
    """A copy of `store` at `root`, and a pair task (`pairs`: a text with a text pair)."""
    shutil.copytree(store.root, root)
    save_module(ModuleStore(root), "pairs", "1", random_head(
        backbone, "sequence_classification", ["no", "yes"], 7, pooling="pair"), backbone)
    return root


def metric_sample(metrics_text: str, sample: str) -> float:
    """The value of one sample in a Prometheus text page, e.g. `tmod_requests_total{outcome="success"}`; 0 if absent."""
    for line in metrics_text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class LiveServer:
    """A real uvicorn server on loopback, in a thread, for API tests."""

    def __init__(self, app, ready_timeout: float = 120.0, ready_when=lambda response: response.status_code == 200):
        """`ready_when(GET /readyz's response)`: started (default: ready to serve)."""
        self.port = free_port()
        self.ready_when = ready_when
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.ready_timeout = ready_timeout

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            try:
                if self.ready_when(httpx.get(self.url + "/readyz", timeout=2)):
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.__exit__()
        raise RuntimeError("server did not become ready")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)


def served_answer(app, texts: list[str]) -> dict:
    """`app` served on loopback (LiveServer) for one POST /v1/infer of `texts`: the answer's JSON.
    The app's runtime stays readable afterwards (`app.state.runtime`)."""
    with LiveServer(app) as server:
        response = httpx.post(server.url + "/v1/infer", json={"inputs": texts}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def start_tmod_serve(args: list[str], env: dict, ready_timeout: float = 180.0, output=None, port: int | None = None,
                     host: str = "127.0.0.1", new_session: bool = False):
    """The real `tmod-serve` process on a free port (or `port`) of `host` (default the IPv4 loopback), waited
    for until /readyz answers 200. Returns (url, process); the caller stops it. Fails the test with its
    output if it never gets ready. `output`: a file for its log (default a pipe, which a server that logs
    much while nobody reads it fills, and then waits on). `new_session`: in a process group of its own,
    for a test that signals the whole group (as a terminal or systemd does)."""
    import subprocess
    import sys

    import pytest

    port = port or free_port()
    process = subprocess.Popen([sys.executable, "-m", "server.cli", "--host", host, "--port", str(port), *args],
                               env=env, stdout=output or subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=new_session)
    url = http_url(host, port)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return url, process
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    pytest.fail(f"tmod-serve {' '.join(args)} did not become ready:\n{process.communicate()[0]}")
