"""The default answers of every shipped single-label task, recorded from a real tmod-serve before the
answer controls existed (issue 28), so a test can show those defaults did not change.

    python -m tests.default_answers   # re-record tests/fixtures/default_answers.json (both tiers)

Each tier's server runs in fp32 (`--precision fp32`) with one thread, so the answers do not depend on
the CPU's bfloat16 support; requests go one at a time, so every batch is the same as when recorded.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import httpx

FIXTURE = Path(__file__).parent / "fixtures" / "default_answers.json"
TIERS = {"minilm": [], "mpnet": ["--backbone", "mpnet"]}
# the shipped versions the fixture was recorded with: a newer version of a module (retrained heads)
# answers differently by design, so the test serves these from a store of their own
VERSIONS = {
    "minilm": {"sentiment": "1", "acceptability": "1", "ner": "1", "entailment": "1"},
    "mpnet": {"sentiment": "mpnet-2", "acceptability": "mpnet-1", "ner": "mpnet-1", "entailment": "mpnet-2"},
}
SHIPPED = Path(__file__).resolve().parents[1] / "modules_store"
SERVER_ARGS = ["--precision", "fp32", "--threads", "1", "--tasks", "sentiment,acceptability,ner,entailment"]
TEXTS = [
    "A gorgeous, witty, seductive movie.",
    "The plot is thin and the acting is worse than the script.",
    "Schwarzenegger flew from Kraków to Wellington with Microsoft's Satya Nadella.",
    "Him ate the apples quickly yesterday the.",
    "The European Commission said on Thursday it disagreed with German advice to consumers.",
    "Nothing about this is surprising.",
]
PAIRS = [
    {"text": "The cat sat on the mat all afternoon.", "text_pair": "A cat was on a mat."},
    {"text": "Paris is the capital of France.", "text_pair": "Berlin is the capital of France."},
    {"text": "Three people were injured in the crash on Monday.", "text_pair": "Nobody was hurt."},
]
# (path, JSON body): /v1/infer with the tasks named, and OIP v2 for one sequence and the token task
REQUESTS = [
    ("/v1/infer?tasks=sentiment,acceptability,ner", {"inputs": TEXTS}),
    ("/v1/infer?tasks=ner", {"inputs": TEXTS[2:3]}),
    ("/v1/infer?tasks=entailment", {"inputs": PAIRS}),
    ("/v2/models/sentiment/infer", {"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": TEXTS[:2]}]}),
    ("/v2/models/ner/infer", {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": TEXTS[2:3]}]}),
]


def recorded_store(tier: str, folder: Path) -> Path:
    """A store in `folder` holding just the shipped versions the fixture was recorded with (links)."""
    for task, version in VERSIONS[tier].items():
        (folder / task).mkdir(parents=True, exist_ok=True)
        (folder / task / version).symlink_to(SHIPPED / task / version, target_is_directory=True)
    return folder


def answers(url: str) -> list[dict]:
    """What the server at `url` answers to REQUESTS (the parts that are answers: results and outputs)."""
    out = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for path, body in REQUESTS:
            response = client.post(path, json=body)
            response.raise_for_status()
            data = response.json()
            out.append({"path": path, "answer": data["results"] if "results" in data else data["outputs"]})
    return out


def record() -> None:
    from tests.helpers import start_tmod_serve

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    recorded = {}
    for tier, args in TIERS.items():
        store = recorded_store(tier, Path(tempfile.mkdtemp(prefix=f"default-answers-{tier}-")))
        url, process = start_tmod_serve([*args, *SERVER_ARGS, "--store", str(store)], env)
        try:
            recorded[tier] = answers(url)
        finally:
            process.terminate()
            process.wait(timeout=60)
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(recorded, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    record()
