"""The embedding head (server/heads/embedding/) and its three protocols (server/api/embeddings.py,
OIP): equal to sentence-transformers' own `encode` on the same model folder, through the real
clients (`openai`, `huggingface_hub.InferenceClient`) against a real `tmod-serve`."""
from __future__ import annotations

import base64
import functools
import json
import os
import random

import httpx
import numpy as np
import pytest
import torch

from modules_store import DEFAULT_STORE, ModuleStore, TaskType
from server.api.app import create_app
from server.backbone import default_backbone_path
from server.config import Settings
from server.engine import Engine
from server.heads.embedding import EmbeddingHead, sentence_transformers_settings
from server.heads.pooling import pool_modes
from server.modules import load_module, save_module
from tests.helpers import LiveServer, populate_store, start_tmod_serve
from training.data.presets import PRESETS, preset_spec
from training.embedding import compare, embed

SERVE_ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def sst2_validation() -> list[str]:
    return preset_spec(PRESETS["sst2"], "validation").read().texts()


def varied_texts(tokenizer, ordinary: int = 230) -> list[str]:
    """70 awkward texts first: short ones, non-ASCII ones (accents, CJK, Cyrillic, Arabic, emoji) and
    texts of 240..256 word pieces (the model's trained length); then `ordinary` SST-2 sentences (300
    texts in all by default)."""
    rng = random.Random(27)
    sentences = sst2_validation()
    short = ["a", "ok", "?", "Hi!", "no way", "42", "The end.", "9:30 am", "x" * 30, "Über"]
    foreign = ["Crème brûlée à la française, très délicieux.", "東京は日本の首都です。", "Москва — столица России.",
               "مرحبا بالعالم", "Ich möchte ein Bier, bitte!", "😀 great film 🎬🍿", "naïve café jalapeño",
               "Ελληνικά γράμματα", "한국어 문장입니다", "emoji only 🙂🙃"]
    texts = short + foreign + [f"{rng.choice(foreign)} {s}" for s in rng.sample(sentences, 20)]
    long_texts = []
    while len(long_texts) < 30:
        text = ""
        while len(tokenizer(text + " x")["input_ids"]) < 240:
            text = (text + " " + rng.choice(sentences)).strip()
        pieces = tokenizer(text, add_special_tokens=False)["input_ids"][:rng.randint(238, 254)]
        long_texts.append(tokenizer.decode(pieces))
    texts += long_texts
    return texts + rng.sample(sentences, ordinary)


@functools.cache
def sentence_transformer(folder=None):
    """sentence-transformers' own model of a backbone folder (default MiniLM), loaded once per run."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder or default_backbone_path()), device="cpu")


def reference(texts: list[str], normalize: bool = True, folder=None, pooled_only: bool = False) -> np.ndarray:
    """sentence-transformers' vectors; `pooled_only`: its pipeline without the Normalize module (the
    vector TEI's normalize=false gives: TEI does not run that module, its `normalize` replaces it)."""
    from sentence_transformers import SentenceTransformer

    model = sentence_transformer(folder)
    if pooled_only:
        model = SentenceTransformer(modules=[model[0], model[1]], device="cpu")
    return model.encode(texts, batch_size=32, normalize_embeddings=normalize, convert_to_numpy=True)


def assert_equal_vectors(ours: np.ndarray, theirs: np.ndarray, min_cosine: float, max_diff: float | None) -> None:
    scores = compare(ours, theirs)
    assert scores["min_cosine"] >= min_cosine, scores
    if max_diff is not None:
        assert scores["max_abs_diff"] <= max_diff, scores


# ---- the head, unit by unit ---------------------------------------------------------------------------
@pytest.mark.parametrize("modes", [["mean"], ["cls"], ["max"], ["cls", "max", "mean"], ["max", "mean"]])
def test_pooling_equals_sentence_transformers_pooling(modes):
    from sentence_transformers.sentence_transformer.modules import Pooling

    torch.manual_seed(0)
    hidden = torch.randn(5, 9, 16)
    mask = torch.ones(5, 9, dtype=torch.long)
    for row, length in enumerate([9, 1, 4, 7, 2]):
        mask[row, length:] = 0
    theirs = Pooling(16, pooling_mode=modes)
    expected = theirs({"token_embeddings": hidden.clone(), "attention_mask": mask})["sentence_embedding"]
    assert torch.allclose(pool_modes(hidden, mask, modes), expected, atol=1e-6)


def test_settings_from_sentence_transformers_config_and_default(tmp_path):
    settings = sentence_transformers_settings(default_backbone_path(), "all-MiniLM-L6-v2")
    assert (settings["pooling"], settings["normalize"], settings["max_tokens"]) == (["mean"], True, 256)
    assert "sentence-transformers configuration of all-MiniLM-L6-v2" in settings["settings_from"]
    bare = sentence_transformers_settings(tmp_path)  # no modules.json: the stated default
    assert (bare["pooling"], bare["normalize"], bare["max_tokens"]) == (["mean"], True, None)
    assert bare["settings_from"].startswith("default")
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ValueError, match="Dense"):
        sentence_transformers_settings(tmp_path)


def test_artifact_without_weights_saves_loads_and_is_checked(tmp_path, tiny_backbone, tiny_backbone_dir):
    store = ModuleStore(tmp_path)
    head = EmbeddingHead.from_backbone(tiny_backbone, tiny_backbone_dir)
    folder = save_module(store, "embedding", "1", head, tiny_backbone)
    manifest = store.read_manifest("embedding", "1")
    assert manifest.task_type == TaskType.embedding and manifest.labels == []
    assert manifest.layers == [tiny_backbone.num_layers]
    assert manifest.config["settings_from"].startswith("default") and manifest.config["normalize"]
    assert manifest.backbone == tiny_backbone.fingerprint
    module = load_module(store, "embedding", "1", tiny_backbone)
    assert module.head.state_dict() == {}
    (folder / "weights.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")  # not what the manifest hashed
    with pytest.raises(Exception, match="checksum"):
        load_module(store, "embedding", "1", tiny_backbone)


def test_embedding_command_numbers_its_versions_and_refuses_one_that_exists_in_a_line(tmp_path, tiny_backbone_dir,
                                                                                      capsys):
    """A second `tmod-train embedding` into a store is embedding/2 (it ended in a traceback: version 1
    existed); a named version that exists is one line before the backbone loads."""
    from training.cli import main

    argv = ["embedding", "--backbone", str(tiny_backbone_dir), "--store", str(tmp_path), "--check", "0"]
    assert main(argv) == 0 and main(argv) == 0
    assert ModuleStore(tmp_path).versions("embedding") == ["1", "2"]
    capsys.readouterr()
    assert main([*argv, "--version", "2"]) == 2
    err = capsys.readouterr().err
    assert err == (f"tmod-train embedding: error: embedding/2 already exists in {tmp_path}; pick another --version "
                   "(the next free number: --version 3, or leave --version out) or --overwrite\n")


def test_an_embedding_task_name_no_store_takes_is_stored_as_the_name_it_becomes(tmp_path, tiny_backbone_dir, capsys):
    """`tmod-train embedding --task '../My Vectors'` was refused (exit 1) where layermix's, mtb's and lora-mtb's
    --task is stored under the name it becomes, said; now the same."""
    from training.cli import main

    store = tmp_path / "store"
    assert main(["embedding", "--backbone", str(tiny_backbone_dir), "--task", "../My Vectors", "--store", str(store),
                 "--check", "0"]) == 0
    assert ("--task '../My Vectors' is stored and served as 'my-vectors' (task names are a-z, 0-9, '_' and '-')"
            in capsys.readouterr().err)
    assert [p.name for p in tmp_path.iterdir()] == ["store"]
    assert (store / "my-vectors" / "1" / "manifest.json").is_file()


def test_embedding_command_says_how_to_serve_and_ask(tiny_backbone_dir, tmp_path, capsys):
    """Like a trained head's run, the embedding command ends with the tmod-serve command and a request
    for the new task (it ended with the manifest only), and a second version says what it replaces."""
    import json
    import shlex

    from training.cli import main

    store = tmp_path / "store"
    for _ in range(2):
        assert main(["embedding", "--backbone", str(tiny_backbone_dir), "--store", str(store), "--check", "0"]) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out[out.rindex('{\n  "artifact"'):])
    assert summary["serve"] == shlex.join(["tmod-serve", "--store", str(store), "--backbone", str(tiny_backbone_dir)])
    words = shlex.split(summary["query"])
    assert words[words.index("-X") + 2] == "http://127.0.0.1:8080/v1/embeddings"
    assert json.loads(words[words.index("-d") + 1])["model"] == "embedding"
    assert f"embedding/2 replaces embedding/1: a tmod-serve started on {store}" in err


def test_grouped_embedding_heads_equal_each_alone(tiny_backbone):
    """Two embedding heads in one plan run as one EmbeddingGroup; each answer equals its head alone."""
    from server.modules import LoadedModule

    heads = {"plain": EmbeddingHead.from_backbone(tiny_backbone, None),
             "maxcls": EmbeddingHead.from_backbone(tiny_backbone, None, pooling=["cls", "max"], normalize=False),
             "shallow": EmbeddingHead.from_backbone(tiny_backbone, None, source_layer=1)}
    modules = {task: LoadedModule(task, "1", None, head.eval()) for task, head in heads.items()}
    engine = Engine(tiny_backbone)
    plan = engine.plan(modules)
    assert [sorted(g.tasks) for g in plan.groups] == [sorted(heads)]
    batch = tiny_backbone.tokenize(["A fine film.", "Peter flew to Brussels on Monday with his sister."])
    together = engine.logits(batch, modules)
    for task, module in modules.items():
        alone = Engine(tiny_backbone).logits(batch, {task: module})[task]
        assert torch.equal(together[task], alone)
    assert together["maxcls"].shape == (2, 2 * tiny_backbone.hidden_size + 1)


def test_left_truncation_keeps_the_end(minilm):
    text = " ".join(f"word{i}" for i in range(300))
    right, left = minilm.encode([text], None, True, 32)[0], minilm.encode([text], None, "left", 32)[0]
    assert len(right) == len(left) == 32 and right.truncated and left.truncated
    assert left.ids[0] == right.ids[0] and left.ids[-1] == right.ids[-1]  # [CLS] ... [SEP] both
    full = minilm.tokenizer(text)["input_ids"]
    assert left.ids[1:-1] == full[-31:-1] and left.offsets[-2][1] == len(text)


# ---- a real tmod-serve on MiniLM in fp32 -----------------------------------------------------------------
@pytest.fixture(scope="module")
def served():
    url, process = start_tmod_serve(["--tasks", "embedding,sentiment,ner", "--precision", "fp32",
                                     "--log-level", "warning"], SERVE_ENV)
    yield url
    process.kill()
    process.wait()


@pytest.fixture(scope="module")
def texts(minilm):
    """The fast tier's 96: the 70 awkward texts and 26 ordinary ones (all 300: the slow test)."""
    return varied_texts(minilm.tokenizer, ordinary=26)


@pytest.fixture(scope="module")
def reference_vectors(texts):
    return reference(texts)


def openai_client(url):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def openai_vectors(client, texts, **options) -> np.ndarray:
    out = []
    for start in range(0, len(texts), 32):
        response = client.embeddings.create(model="embedding", input=texts[start:start + 32], **options)
        assert [d.index for d in response.data] == list(range(len(response.data)))
        # asked for base64, the client hands the text back as it came
        out += [np.frombuffer(base64.b64decode(d.embedding), "<f4") if isinstance(d.embedding, str) else d.embedding
                for d in response.data]
    return np.array(out, dtype=np.float32)


def test_openai_client_vectors_equal_sentence_transformers_fp32(served, texts, reference_vectors):
    """The fast tier's 96 texts (every awkward kind); the slow test below checks all 300 the same way.
    Either fails on a vector off sentence-transformers' by more than the tolerance."""
    client = openai_client(served)
    float_vectors = openai_vectors(client, texts, encoding_format="float")
    assert len(texts) == 96 and float_vectors.shape == (96, 384)
    assert_equal_vectors(float_vectors, reference_vectors, 0.99999, 1e-5)
    base64_vectors = openai_vectors(client, texts[:64], encoding_format="base64")
    assert np.array_equal(base64_vectors, float_vectors[:64])  # base64 is float32 exactly
    decoded_by_client = openai_vectors(client, texts[:32])  # unasked, the client asks for base64 and decodes it
    assert np.array_equal(decoded_by_client, float_vectors[:32])
    response = client.embeddings.create(model="all-MiniLM-L6-v2", input="A fine film.")  # the backbone's name
    tokens = len(served_tokens("A fine film."))
    assert (response.model, response.usage.prompt_tokens, response.usage.total_tokens) == ("all-MiniLM-L6-v2", tokens, tokens)


@pytest.mark.slow
def test_openai_client_vectors_equal_sentence_transformers_fp32_on_300_texts(served, minilm):
    """The fast test's check on all 300 varied texts (230 ordinary SST-2 sentences where it has 26)."""
    texts = varied_texts(minilm.tokenizer)
    vectors = openai_vectors(openai_client(served), texts, encoding_format="float")
    assert vectors.shape == (300, 384)
    assert_equal_vectors(vectors, reference(texts), 0.99999, 1e-5)


def served_tokens(text):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_backbone_path())(text)["input_ids"]


def test_openai_errors_in_openai_shape(served):
    import openai

    client = openai_client(served)
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="embedding", input="A fine film.", dimensions=128)
    assert "not trained to be shortened" in refused.value.message
    assert refused.value.body["param"] == "dimensions" and refused.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="sentiment", input="A fine film.")
    raw = httpx.post(served + "/v1/embeddings", json={"model": "embedding", "input": 5})
    assert raw.status_code == 400 and set(raw.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as refused:  # tiktoken ids, as LangChain's OpenAIEmbeddings sends
        client.embeddings.create(model="embedding", input=[[32, 7060, 4632, 13]])
    assert "check_embedding_ctx_length=False" in refused.value.message and refused.value.body["param"] == "input"
    for bad in ["", "   ", "a\x00b"]:  # as /v1/infer answers them
        assert httpx.post(served + "/v1/embeddings", json={"model": "embedding", "input": bad}).status_code == 422
    with pytest.raises(openai.APIStatusError) as refused:  # OpenAI takes 2048 a request; LangChain sends 1000
        client.embeddings.create(model="embedding", input=[f"document {i}" for i in range(65)])
    assert refused.value.status_code == 413 and refused.value.body["code"] == "too_many_inputs"
    assert "65 inputs; at most 64 per request on this server (its --max-inputs)" in refused.value.message
    assert "chunk_size" in refused.value.message
    # the two embedding APIs' one-letter difference, each way: was only "unknown field"
    raw = httpx.post(served + "/v1/embeddings", json={"model": "embedding", "inputs": ["A fine film."]})
    assert raw.json()["error"]["message"] == ("request is malformed: body: Object contains unknown field `inputs` "
                                              "(OpenAI's /v1/embeddings reads `input`; `inputs` is TEI's /embed)")
    raw = httpx.post(served + "/embed", json={"input": ["A fine film."]})
    assert raw.json()["error"] == ("request is malformed: body: Object contains unknown field `input` (TEI's /embed "
                                   "reads `inputs`; `input` is OpenAI's /v1/embeddings)")


def test_infer_route_gives_the_same_vector_beside_other_tasks(served, texts):
    sample = texts[:8] + texts[40:44]
    together = httpx.post(served + "/v1/infer", params={"tasks": "embedding,ner,sentiment"},
                          json={"inputs": sample}, timeout=60).json()
    alone = httpx.post(served + "/v1/infer", params={"tasks": "sentiment,ner"}, json={"inputs": sample}, timeout=60).json()
    vectors = openai_vectors(openai_client(served), sample)
    for row, other, vector in zip(together["results"], alone["results"], vectors):
        assert set(row) == {"embedding", "ner", "sentiment"}
        assert np.abs(np.array(row["embedding"]["embedding"]) - vector).max() <= 1e-6
        assert row["sentiment"]["label"] == other["sentiment"]["label"]
        assert [e["label"] for e in row["ner"]["entities"]] == [e["label"] for e in other["ner"]["entities"]]
    pairs = httpx.post(served + "/v1/infer", params={"tasks": "embedding"},
                       json={"inputs": [{"text": "a", "text_pair": "b"}]})
    assert pairs.status_code == 422 and pairs.json()["error"]["type"] == "single_text_task"
    tasks = {t["task"]: t for t in httpx.get(served + "/v1/tasks").json()["tasks"]}
    assert tasks["embedding"]["task_type"] == "embedding" and tasks["embedding"]["parameters"] == 0


def test_tei_route_with_huggingface_inference_client(served, texts, reference_vectors, monkeypatch):
    import huggingface_hub
    from huggingface_hub import InferenceClient

    # HF_HUB_OFFLINE (set for every test) blocks the client's calls even to loopback; this one is local
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    client = InferenceClient(model=served + "/embed")
    one = client.feature_extraction(texts[12])
    assert one.shape == (1, 384) and one.dtype == np.float32
    assert_equal_vectors(one, reference_vectors[12:13], 0.99999, 1e-5)
    several = client.feature_extraction(texts[:16])
    assert_equal_vectors(several, reference_vectors[:16], 0.99999, 1e-5)
    raw = client.feature_extraction(texts[:16], normalize=False)
    assert_equal_vectors(raw, reference(texts[:16], normalize=False, pooled_only=True), 0.99999, 1e-5)
    assert np.abs(np.linalg.norm(raw, axis=1) - 1).min() > 0.1  # really not unit length
    long = " ".join(f"w{i}" for i in range(500))
    right = client.feature_extraction(long, truncate=True)  # what sentence-transformers does past 256 pieces
    assert_equal_vectors(right, reference([long]), 0.99999, 1e-5)
    left = client.feature_extraction(long, truncate=True, truncation_direction="left")
    model = sentence_transformer()
    ids = model.tokenizer(long)["input_ids"]
    tail = torch.tensor([ids[:1] + ids[-255:]])  # [CLS], the last 254 pieces, [SEP]
    with torch.inference_mode():
        expected = model({"input_ids": tail, "attention_mask": torch.ones_like(tail),
                          "token_type_ids": torch.zeros_like(tail)})["sentence_embedding"].numpy()
    assert_equal_vectors(left, expected, 0.99999, 1e-5)


def test_the_inference_client_given_the_servers_url_as_with_tei(served, texts, reference_vectors, monkeypatch):
    """TEI's root: InferenceClient(model=<server URL>) posts to "/" (TEI's embed there) and health_check
    reads /health; both answered as TEI does, errors in TEI's shape."""
    import huggingface_hub
    from huggingface_hub import InferenceClient

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # (set for every test) this one is local
    client = InferenceClient(model=served)
    assert_equal_vectors(client.feature_extraction(texts[:4]), reference_vectors[:4], 0.99999, 1e-5)
    assert InferenceClient(model=served, provider="hf-inference").health_check() is True
    health = httpx.get(served + "/health")
    assert health.status_code == 200 and health.content == b""
    refused = httpx.post(served + "/", json={"inputs": ""})
    assert refused.status_code == 422 and set(refused.json()) == {"error", "error_type"}
    root = httpx.get(served + "/")  # GET on TEI's root is its health route (and KServe V1's liveness: its body)
    assert root.status_code == 200 and root.json() == {"status": "alive"}
    info = InferenceClient(model=served, provider="hf-inference").get_endpoint_info()  # GET /info
    assert info["model_id"] == "all-MiniLM-L6-v2" and info["model_dtype"] == "float32"
    assert info["model_type"] == {"embedding": {"pooling": "mean"}} and info["max_input_length"] == 256
    assert info["max_client_batch_size"] == 64 and info["max_batch_tokens"] == 16384 and info["auto_truncate"] is False


def test_sentence_similarity_as_teis_similarity_route_answers_it(served, texts, reference_vectors, monkeypatch):
    """TEI's /similarity, and its root given `{"inputs": {"source_sentence", "sentences"}}` (where
    `InferenceClient(model=<server URL>).sentence_similarity` posts, refused before as a malformed embed
    request): each sentence's cosine similarity to the source, as sentence-transformers' vectors give it."""
    import huggingface_hub
    from huggingface_hub import InferenceClient

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # (set for every test) this one is local
    expected = reference_vectors[1:6] @ reference_vectors[0]
    for url in (served, served + "/similarity"):
        assert InferenceClient(model=url).sentence_similarity(texts[0], texts[1:6]) == \
            pytest.approx(expected.tolist(), abs=1e-5)
    assert InferenceClient(model=served).sentence_similarity(texts[7], [texts[7]]) == pytest.approx([1.0], abs=1e-5)
    long = " ".join(f"w{i}" for i in range(500))
    cut = httpx.post(served + "/similarity", json={"inputs": {"source_sentence": long, "sentences": [texts[0]]},
                                                    "parameters": {"truncate": True}})
    assert cut.json() == pytest.approx((reference([long]) @ reference_vectors[0]).tolist(), abs=1e-5)

    def refused(path, body, said):
        answer = httpx.post(served + path, json=body)
        assert answer.status_code == 422 and set(answer.json()) == {"error", "error_type"}, answer.text
        assert said in answer.json()["error"], answer.text

    refused("/", {"inputs": {"source_sentence": "a"}}, "inputs: Object missing required field `sentences`")
    refused("/similarity", {"inputs": {"source_sentence": "a", "sentences": []}}, "inputs.sentences")
    refused("/similarity", {"inputs": "a"}, "inputs: Expected `object`, got `str`")
    refused("/", {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "parameters": {"prompt_name": "query"}},
            "prompt_name 'query': no prompts are configured")
    refused("/", {"inputs": 5}, "inputs: Expected `str | array`, got `int`")  # not an object: /embed's reading
    refused("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b", " "]}},
            "inputs.sentences[1] is empty or only whitespace")  # its name in the request, not "input 2"
    too_many = httpx.post(served + "/similarity", json={"inputs": {"source_sentence": "a", "sentences": ["b"] * 64}})
    assert too_many.status_code == 413 and "65 texts (inputs.source_sentence to inputs.sentences[63], counted " \
        "together); at most 64" in too_many.json()["error"], too_many.text


def test_vllms_score_and_rerank_answer_the_embeddings_cosine_similarity(served, texts, reference_vectors):
    """vLLM's /score (and /v1/score) and /rerank (and /v1/rerank, Jina's path, and /v2/rerank, Cohere's)
    with an embedding model, as vLLM answers them for one: each pair's cosine similarity as
    sentence-transformers' vectors give it, the rerank best first and cut to top_n; refusals in OpenAI's
    shape, as vLLM's."""
    to_first = reference_vectors[1:6] @ reference_vectors[0]
    for path in ("/score", "/v1/score"):
        answer = httpx.post(served + path, json={"model": "embedding", "text_1": texts[0], "text_2": texts[1:6]}).json()
        assert answer["object"] == "list" and answer["id"].startswith("score-") and answer["model"] == "embedding"
        assert [(d["index"], d["object"]) for d in answer["data"]] == [(i, "score") for i in range(5)]
        assert [d["score"] for d in answer["data"]] == pytest.approx(to_first.tolist(), abs=1e-5)
        assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > 0
    pairwise = (reference_vectors[0:3] * reference_vectors[3:6]).sum(axis=1).tolist()
    for first, second in (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2")):
        answer = httpx.post(served + "/score", json={first: texts[0:3], second: texts[3:6]}).json()
        assert [d["score"] for d in answer["data"]] == pytest.approx(pairwise, abs=1e-5), (first, second)
    best_first = np.argsort(-to_first)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        answer = httpx.post(served + path, json={"model": "embedding", "query": texts[0], "documents": texts[1:6],
                                                 "top_n": 3}).json()
        assert answer["id"].startswith("rerank-") and answer["model"] == "embedding", answer
        assert [r["index"] for r in answer["results"]] == best_first[:3].tolist()
        assert [r["relevance_score"] for r in answer["results"]] == pytest.approx(to_first[best_first[:3]].tolist(),
                                                                                  abs=1e-5)
        assert [r["document"]["text"] for r in answer["results"]] == [texts[1 + i] for i in best_first[:3]]
    every = httpx.post(served + "/rerank", json={"query": texts[0], "documents": texts[1:6],
                                                 "return_documents": False}).json()["results"]
    assert [r["index"] for r in every] == best_first.tolist() and not any("document" in r for r in every)

    def refused(path, body, status, said):
        answer = httpx.post(served + path, json=body)
        assert answer.status_code == status and set(answer.json()["error"]) == {"message", "type", "param", "code"}, \
            answer.text
        assert said in answer.json()["error"]["message"], answer.text

    refused("/score", {"text_1": "a"}, 400, "send the two sides under one pair of names")
    refused("/score", {"text_1": "a", "documents": ["b"]}, 400, "(got documents, text_1)")
    refused("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, 400, "2 texts to compare with 3")
    refused("/score", {"text_1": "a", "text_2": "b", "model": "ner"}, 404, "no embedding model 'ner'")
    refused("/v2/rerank", {"query": "a", "documents": []}, 400, "documents: Expected `array` of length >= 1")
    refused("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, 400, "top_n")
    # a text refused by its name in the request, not by its place among all the texts read
    refused("/rerank", {"query": "a", "documents": ["b", " "]}, 422, "documents[1] is empty or only whitespace")
    refused("/score", {"text_1": ["a", "b"], "text_2": ["c", "d\x00"]}, 422, "text_2[1] has control character")
    refused("/score", {"queries": " ", "items": ["c"]}, 422, "queries is empty")
    refused("/rerank", {"query": "a", "documents": ["b"] * 64}, 413, "65 texts (query to documents[63], counted "
                                                                      "together); at most 64")
    assert httpx.get(served + "/rerank").status_code == 405


def test_teis_rerank_body_on_rerank_is_answered_in_teis_shape(served, texts, reference_vectors):
    """/rerank is TEI's path too: a body with `texts` (what Haystack's and LlamaIndex's TEI rankers post,
    refused before as an unknown field of vLLM's body) is answered as TEI does, `[{index, score, text}]`
    best first, each score the texts' embeddings' cosine similarity; its refusals in TEI's shape (422
    for a malformed body), while a body with `documents` stays vLLM's."""
    to_first = reference_vectors[1:6] @ reference_vectors[0]
    best_first = np.argsort(-to_first)
    answer = httpx.post(served + "/rerank", json={"query": texts[0], "texts": texts[1:6]})
    assert answer.status_code == 200, answer.text
    assert [r["index"] for r in answer.json()] == best_first.tolist() and all(set(r) == {"index", "score"}
                                                                             for r in answer.json())
    assert [r["score"] for r in answer.json()] == pytest.approx(to_first[best_first].tolist(), abs=1e-5)
    with_text = httpx.post(served + "/rerank", json={"query": texts[0], "texts": texts[1:3], "return_text": True,
                                                     "raw_scores": True, "truncate": None,
                                                     "truncation_direction": "Left"}).json()
    assert sorted((r["index"], r["text"]) for r in with_text) == [(0, texts[1]), (1, texts[2])]
    long = " ".join(f"w{i}" for i in range(500))
    cut = httpx.post(served + "/rerank", json={"query": texts[0], "texts": [long], "truncate": True}).json()
    assert cut[0]["score"] == pytest.approx(float(reference([long])[0] @ reference_vectors[0]), abs=1e-5)

    def refused(body, status, said):
        answer = httpx.post(served + "/rerank", json=body)
        assert answer.status_code == status and set(answer.json()) == {"error", "error_type"}, answer.text
        assert said in answer.json()["error"], answer.text

    refused({"query": "a", "texts": []}, 422, "texts: Expected `array` of length >= 1")
    refused({"query": "a", "texts": ["b", " "]}, 422, "texts[1] is empty or only whitespace")
    refused({"query": "a", "texts": ["b"], "top_n": 1}, 422, "unknown field `top_n`")
    refused({"query": "a", "texts": ["b"] * 64}, 413, "65 texts (query to texts[63], counted together); at most 64")
    vllm = httpx.post(served + "/rerank", json={"query": "a", "texts": ["b"], "documents": ["c"]})
    assert vllm.status_code == 400 and "unknown field `texts`" in vllm.json()["error"]["message"], vllm.text


def test_vllms_tokenize_and_detokenize_and_teis_decode_use_the_backbones_tokenizer(served, texts):
    """vLLM's /tokenize (a body with `prompt` on TEI's /tokenize path, refused before as an unknown
    field) and /detokenize, and TEI's /decode: the ids and text the backbone's own tokenizer gives;
    refusals in each protocol's shape (vLLM's OpenAI's, TEI's its own)."""
    tokenizer = sentence_transformer().tokenizer
    for text in texts[:5]:
        answer = httpx.post(served + "/tokenize", json={"prompt": text, "model": "all-MiniLM-L6-v2"}).json()
        assert answer["tokens"] == tokenizer(text)["input_ids"] and answer["count"] == len(answer["tokens"])
        assert answer["max_model_len"] == 512 and answer["token_strs"] is None
        bare = httpx.post(served + "/tokenize", json={"prompt": text, "add_special_tokens": False,
                                                      "return_token_strs": True}).json()
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert bare["tokens"] == ids and bare["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
        back = httpx.post(served + "/detokenize", json={"tokens": answer["tokens"]}).json()
        assert back == {"prompt": tokenizer.decode(answer["tokens"])}
    empty = httpx.post(served + "/tokenize", json={"prompt": ""}).json()
    assert empty["tokens"] == tokenizer("")["input_ids"]
    ids = [tokenizer(text)["input_ids"] for text in texts[:3]]
    assert httpx.post(served + "/decode", json={"ids": ids}).json() == tokenizer.batch_decode(ids, skip_special_tokens=True)
    assert httpx.post(served + "/decode", json={"ids": ids[0], "skip_special_tokens": False}).json() == \
        [tokenizer.decode(ids[0])]
    assert httpx.post(served + "/tokenize", json={"inputs": texts[0]}).json()[0][1]["start"] == 0  # TEI's, as before

    def refused(path, body, status, said, shape):
        answer = httpx.post(served + path, json=body)
        error = answer.json()["error"]
        message = error["message"] if shape == "openai" else error
        assert answer.status_code == status and said in message, answer.text
        assert set(error) == {"message", "type", "param", "code"} if shape == "openai" else \
            set(answer.json()) == {"error", "error_type"}

    refused("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}, 400, "send `prompt`", "openai")
    refused("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "no model 'gpt-4'", "openai")
    refused("/tokenize", {"prompt": "a\x00b"}, 422, "prompt has control character", "openai")
    refused("/detokenize", {"tokens": [101, 30522]}, 400, "tokens: id 30522 is not in the vocabulary", "openai")
    refused("/decode", {"ids": [[101], [-1]]}, 422, "ids[1]: id -1 is not in the vocabulary", "tei")
    refused("/decode", {"ids": [[101], 5]}, 422, "not both mixed", "tei")
    refused("/decode", {"ids": [[1] * 100_001]}, 413, "100001 ids; at most 100000", "tei")  # --max-tokenize-chars


def test_a_long_text_is_embedded_as_its_windows_pooled_vectors_averaged_by_tokens(served):
    """Past the trained length (256 pieces) a text is read in windows (server/windows.py): by hand,
    each window's pooled vector from the reference library, averaged weighted by the text's pieces
    in it, then normalised."""
    long = " ".join(f"w{i}" for i in range(500))
    described = httpx.post(served + "/v1/tokenize", json={"inputs": [long]}).json()["results"][0]
    pieces = [p for p in described["tokens"] if not p["special"]]
    assert len(described["windows"]) > 1
    model = sentence_transformer()
    cls, sep = model.tokenizer.cls_token_id, model.tokenizer.sep_token_id
    pooled, weights = [], []
    for window in described["windows"]:
        ids = [p["id"] for p in pieces if p["start"] >= window["start"] and p["end"] <= window["end"]]
        row = torch.tensor([[cls, *ids, sep]])
        with torch.inference_mode():
            features = model[1](model[0]({"input_ids": row, "attention_mask": torch.ones_like(row),
                                          "token_type_ids": torch.zeros_like(row)}))
        pooled.append(features["sentence_embedding"][0].double().numpy())
        weights.append(len(ids))
    mean = np.average(np.stack(pooled), axis=0, weights=weights)
    expected = (mean / np.linalg.norm(mean)).astype(np.float32)[None]
    answer = httpx.post(served + "/v1/embeddings", json={"model": "embedding", "input": [long]}, timeout=60).json()
    assert_equal_vectors(np.array([answer["data"][0]["embedding"]], dtype=np.float32), expected, 0.99999, 1e-5)
    infer = httpx.post(served + "/v1/infer", params={"tasks": "embedding"}, json={"inputs": [long]}, timeout=60).json()
    assert infer["windows"] == [len(described["windows"])]
    assert np.abs(np.array(infer["results"][0]["embedding"]["embedding"]) - expected[0]).max() <= 1e-5


def test_oip_embedding_model_answers_fp32_n_by_d(served, texts, reference_vectors):
    meta = httpx.get(served + "/v2/models/embedding").json()
    assert meta["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}]
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [3], "data": texts[:3]}]}
    answer = httpx.post(served + "/v2/models/embedding/infer", json=body).json()
    (output,) = answer["outputs"]
    assert (output["datatype"], output["shape"]) == ("FP32", [3, 384])
    assert_equal_vectors(np.array(output["data"], dtype=np.float32).reshape(3, 384), reference_vectors[:3], 0.99999, 1e-5)


@pytest.mark.slow
def test_nearest_neighbours_on_sst2_validation_agree_with_reference(served):
    """Each SST-2 validation sentence's nearest neighbour by tmod's vectors is the one by
    sentence-transformers' vectors for >= 99.9% of the 872 sentences."""
    sentences = sst2_validation()
    ours = openai_vectors(openai_client(served), sentences)
    agreement = compare(ours, reference(sentences))["nearest_neighbour_agreement"]
    assert len(sentences) == 872 and agreement >= 0.999


def test_bf16_vectors_within_cosine_0_999(texts, reference_vectors):
    """The app `tmod-serve --tasks embedding --precision bf16` serves (the shipped store, its own
    MiniLM), served from this process: the precision is the runtime's, no process start needed."""
    with LiveServer(create_app(Settings(tasks="embedding", precision="bf16"))) as server:
        ours = openai_vectors(openai_client(server.url), texts[:64])
    assert_equal_vectors(ours, reference_vectors[:64], 0.999, None)


# ---- hot loading and worker processes (tiny backbone) ----------------------------------------------------
def test_openai_client_lists_and_retrieves_the_embedding_models(served):
    """`client.models.list()` names what `model` takes; each listed name embeds; others 404 in OpenAI's shape."""
    import openai

    client = openai_client(served)
    listed = client.models.list()
    assert [m.id for m in listed.data] == ["embedding", "all-MiniLM-L6-v2"]  # sentiment and ner are no embedding
    assert {(m.object, m.owned_by) for m in listed.data} == {("model", "tmod")}
    assert len({m.created for m in listed.data}) == 1 and listed.data[0].created > 1_700_000_000
    for name in [m.id for m in listed.data] + ["sentence-transformers/all-MiniLM-L6-v2"]:
        assert client.models.retrieve(name).id == name
        assert len(client.embeddings.create(model=name, input="A fine film.").data[0].embedding) == 384
    for name in ["sentiment", "nope"]:
        with pytest.raises(openai.NotFoundError) as refused:
            client.models.retrieve(name)
        assert refused.value.body["code"] == "model_not_found" and "embedding tasks loaded: ['embedding']" in \
            refused.value.body["message"]


def test_hot_loaded_embedding_with_two_workers_equals_in_process(tmp_path, tiny_backbone, tiny_backbone_dir):
    store = populate_store(tmp_path / "store", tiny_backbone)
    save_module(store, "embedding", "1", EmbeddingHead.from_backbone(tiny_backbone, tiny_backbone_dir), tiny_backbone)
    env = {**SERVE_ENV, "TMOD_ADMIN_TOKEN": "secret"}
    url, process = start_tmod_serve(["--workers", "2", "--backbone", str(tiny_backbone_dir), "--store",
                                     str(store.root), "--tasks", "sentiment", "--precision", "fp32"], env)
    try:
        sample = ["A fine film.", "Peter flew to Brussels.", "Über 😀"]
        missing = httpx.post(url + "/v1/embeddings", json={"model": "embedding", "input": sample})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert httpx.get(url + "/v1/models").json() == {"object": "list", "data": []}
        loaded = httpx.post(url + "/admin/modules/embedding/load", headers={"authorization": "Bearer secret"})
        assert loaded.status_code == 200, loaded.text
        for _ in range(4):  # either worker lists the module loaded in the engine
            assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]][0] == "embedding"
        assert "embedding" in {t["task"] for t in httpx.get(url + "/v1/tasks").json()["tasks"]}
        served = [httpx.post(url + "/v1/embeddings", json={"model": "embedding", "input": sample}).json()
                  for _ in range(4)]  # answered by either worker
    finally:
        process.terminate()
        process.wait(timeout=60)
    module = load_module(store, "embedding", "1", tiny_backbone)
    expected = embed(Engine(tiny_backbone), module, sample)
    for answer in served:
        vectors = np.array([d["embedding"] for d in answer["data"]], dtype=np.float32)
        assert np.abs(vectors - expected).max() <= 1e-6
    assert np.allclose(np.linalg.norm(expected, axis=1), 1.0, atol=1e-6)  # the default: normalised


def test_shipped_modules_record_their_reference_check():
    store = ModuleStore(DEFAULT_STORE)
    for version, name in (("1", "all-MiniLM-L6-v2"), ("mpnet-1", "all-mpnet-base-v2")):
        manifest = store.read_manifest("embedding", version)
        assert manifest.backbone.name == name and manifest.kind == "embedding"
        check = manifest.metrics["reference_check"]
        assert check["nearest_neighbour_agreement"] >= 0.999 and check["min_cosine"] >= 0.99999


@pytest.mark.slow
def test_mpnet_vectors_equal_sentence_transformers_fp32(tmp_path):
    from server.backbone.sources import resolve_backbone

    folder, _ = resolve_backbone("mpnet")
    texts = varied_texts(__import__("transformers").AutoTokenizer.from_pretrained(folder))
    url, process = start_tmod_serve(["--backbone", "mpnet", "--tasks", "embedding", "--precision", "fp32",
                                     "--log-level", "warning"], SERVE_ENV, ready_timeout=600)
    try:
        ours = openai_vectors(openai_client(url), texts)
    finally:
        process.kill()
        process.wait()
    assert ours.shape == (300, 768)
    assert_equal_vectors(ours, reference(texts, folder=folder), 0.99999, 1e-5)


def test_an_openai_client_whose_base_url_lacks_v1_is_told(served):
    """OpenAI's client given the server's URL without /v1 posts to /embeddings: the 404 says where the
    route is and what base_url wants (it was a bare 'Not Found'); a near miss of any route is named too."""
    import openai

    client = openai.OpenAI(base_url=served, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError, match=r"did you mean /v1/embeddings\? an OpenAI client's base_url ends "
                                                   r"with /v1"):
        client.embeddings.create(model="embedding", input="A fine film.")
    near = httpx.post(served + "/v1/infr", json={"inputs": ["a"]})
    assert near.status_code == 404 and near.json()["error"]["message"] == "no route '/v1/infr' (did you mean /v1/infer?)"
    assert httpx.get(served + "/nothing/here").json()["error"]["message"] == "no route '/nothing/here'"


def test_a_peer_route_tmod_does_not_serve_says_what_answers_instead(served):
    """A client moving from TEI or vLLM to tmod that calls a route of theirs tmod lacks is told so, and
    what answers instead, in that peer's error shape (it was tmod's bare 'no route')."""
    import openai

    client = openai.OpenAI(base_url=served + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError, match=r"no route '/v1/chat/completions': tmod generates no text"):
        client.chat.completions.create(model="embedding", messages=[{"role": "user", "content": "hi"}])
    tei = httpx.post(served + "/embed_all", json={"inputs": "A fine film."})
    assert tei.status_code == 404 and tei.json()["error"] == (
        "no route '/embed_all': Text Embeddings Inference's per-token embeddings are not served: /embed answers one "
        "pooled vector a text")
    vllm = httpx.post(served + "/pooling", json={"model": "embedding", "input": "A fine film."})
    assert vllm.status_code == 404 and vllm.json()["error"]["message"].startswith(
        "no route '/pooling': vLLM's pooling API is not served: /v1/embeddings (or /embed) answers pooled vectors")


def test_a_query_parameter_a_route_does_not_read_is_refused_not_ignored(served):
    """An option sent in the query instead of the body was ignored: `/embed?normalize=false` answered
    normalized vectors, `/v1/embeddings?dimensions=3` all 384 of them. Each inference and tokenize route refuses
    what it does not read, in its protocol's shape; `?tasks=` where a route reads it still works."""
    def refused(path: str, body: dict, shape: str) -> str:
        response = httpx.post(served + path, json=body)
        assert response.status_code == 400, (path, response.text)
        error = response.json()
        message = {"tei": lambda: error["error"], "openai": lambda: error["error"]["message"],
                   "oip": lambda: error["error"], "tmod": lambda: error["error"]["message"]}[shape]()
        return message

    assert refused("/embed?normalize=false", {"inputs": "a"}, "tei") == (
        "unknown query parameter(s) ['normalize']: /embed takes no query parameters (what it reads goes in the "
        "JSON body)")
    assert "['dimensions']: /v1/embeddings takes no query parameters" in refused(
        "/v1/embeddings?dimensions=3", {"input": "a", "model": "embedding"}, "openai")
    assert "['top_n']: /rerank takes no" in refused("/rerank?top_n=1", {"query": "a", "documents": ["b"]}, "openai")
    oip = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["a"]}]}
    assert "['binary_data']: /v2/models/sentiment/infer takes no" in refused(
        "/v2/models/sentiment/infer?binary_data=true", oip, "oip")
    assert "['task'] (did you mean 'tasks' for 'task'?): /predict takes only ?tasks=" in refused(
        "/predict?task=sentiment", {"inputs": "a"}, "tei")
    assert "['add_special_tokens']: /tokenize takes no" in refused("/tokenize?add_special_tokens=false",
                                                                   {"inputs": "a"}, "tei")
    # TEI's root reads ?tasks= for a body of /predict's only: with an embedding's body it would be ignored
    assert refused("/?tasks=sentiment", {"inputs": "a"}, "tei") == (
        "?tasks= names the task of a body of /predict's (Hugging Face's `parameters` beside a text); this body is "
        "/embed's, which reads no tasks")
    # what the routes do read
    assert httpx.post(served + "/predict?tasks=sentiment", json={"inputs": "a"}).status_code == 200
    assert httpx.post(served + "/?tasks=sentiment", json={"inputs": "a", "parameters": {}}).status_code == 200
    assert httpx.post(served + "/v1/infer?tasks=ner", json={"inputs": ["a"]}).status_code == 200
    assert httpx.post(served + "/embed", json={"inputs": "a"}).status_code == 200
