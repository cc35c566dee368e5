"""Where a training run writes, for heads, bridges and alignments alike: the version it takes in
its store, its run folder, and the checks made before any work (a refused run leaves no trace)."""
from __future__ import annotations

import itertools
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from safetensors import SafetensorError
from tqdm.auto import tqdm

from modules_store import ArtifactError, ModuleStore
from server.bridges import bridge_version_on
from training.data.files import UsageError


def cannot_make(folder: Path) -> str | None:
    """Why `folder` could not be made and written, or None; nothing is left made."""
    existing = folder
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    try:  # what the permission bits do not tell (root, who passes them, on /proc or a full disk): a folder made
        os.rmdir(tempfile.mkdtemp(prefix=".tmod-write-check-", dir=existing))
    except OSError as exc:
        return f"a folder cannot be made in {existing} ({exc.strerror or exc})"
    return None


def stored_name(given: str | None, default: str, option: str, kind: str, served: bool = False) -> str:
    """The name a run stores under: `given` (else `default`) in a-z, 0-9, '_' and '-' (a folder's and a
    URL's name), said where the user's differs rather than found out from the store."""
    name = re.sub(r"[^a-z0-9_\-]+", "-", (given or default).lower()).strip("-_")[:64] or kind
    if given and name != given:
        print(f"{option} {given!r} is stored{' and served' if served else ''} as {name!r} ({kind} names are a-z, "
              "0-9, '_' and '-')", file=sys.stderr)
    return name


def check_outputs(store: ModuleStore, name: str, version: str, overwrite: bool, folders, *, what: str = "",
                  fix: str = "give --run-dir in a folder you can write", task_type=None) -> None:
    """Refuse, before the work, a version that exists (without --overwrite), a folder that cannot be made
    (found after the training, either lost its result) and, given the module's `task_type`, a version of
    another kind than the task's latest (a classifier saved as `embedding` answered /v1/embeddings'
    clients with labels from then on)."""
    if store.path(name, version).exists() and not overwrite:
        raise UsageError(f"{what}{name}/{version} already exists in {store.root}; pick another --version (the next "
                         f"free number: --version {store.next_version(name)}, or leave --version out) or --overwrite")
    if task_type is not None and (earlier := latest_manifest(store, name)) and earlier.task_type != task_type:
        raise UsageError(f"--task {name}: {name}/{earlier.version} in {store.root} is {in_words(earlier.task_type)} "
                         f"module, this one would be {in_words(task_type)}: every client of {name} would get answers "
                         "of another shape; pick another --task")
    for folder in folders:
        if problem := cannot_make(Path(folder)):
            raise UsageError(f"cannot make {folder}: {problem}; {fix}")


def in_words(task_type) -> str:
    """A task type in a sentence: 'a sequence classification', 'an embedding'."""
    words = task_type.value.replace("_", " ")
    return f"{'an' if words[0] in 'aeiou' else 'a'} {words}"


def latest_manifest(store: ModuleStore, name: str):
    """The manifest of `name`'s latest version in `store`, or None (no version, or one that cannot be read:
    loading it says why)."""
    try:
        return store.read_manifest(name)  # "not_found" where there is no version
    except ArtifactError:
        return None


def new_run_dir(path: Path) -> Path:
    """`path`, made now, or `path-2`, `path-3`, ... where a run started in the same second (a sweep
    launched at once) made it first: each run's report and store its own."""
    for n in itertools.count(1):
        claimed = path if n == 1 else path.with_name(f"{path.name}-{n}")
        try:
            claimed.mkdir(parents=True)
            return claimed
        except FileExistsError:
            continue


@dataclass(frozen=True)
class RunOutputs:
    """Where a run writes: its store and report folder, by default in the run's own folder
    (`runs/NAME-VERSION-TIME`), which is made only when saving and only where something goes in it."""
    run_dir: Path
    store: ModuleStore
    report_dir: Path
    claim: bool  # the run folder is the default one, and the store or the report goes in it
    made: Path | None = None  # the run folder `claimed` made

    def drop_if_empty(self) -> None:
        """The run folder this run made, removed where no file was written in it (its save failed)."""
        if self.made and not any(path.is_file() for path in self.made.rglob("*")):
            shutil.rmtree(self.made, ignore_errors=True)

    @classmethod
    def checked(cls, run_name: str, run_dir: str | None, store: ModuleStore | None, report_dir: str | None,
                name: str, version: str, overwrite: bool, *, what: str = "", fix: str,
                task_type=None) -> "RunOutputs":
        """The outputs (`run_dir` None: runs/RUN_NAME-TIME, in UTC; `store` None: the run folder's own),
        refused before the work as `check_outputs` says."""
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        folder = Path(run_dir) if run_dir else Path("runs") / f"{run_name}-{stamp}"
        outputs = cls(folder, store or ModuleStore(folder / "store"),
                      Path(report_dir) if report_dir else folder / "report",
                      claim=not run_dir and (store is None or not report_dir))
        check_outputs(outputs.store, name, version, overwrite, (outputs.store.root, outputs.report_dir), what=what,
                      fix=fix, task_type=task_type)
        return outputs

    def claimed(self) -> "RunOutputs":
        """These outputs with the run folder made now, where it is the default one: a run started in the same
        second may have taken its name (then `-2`, `-3`, ...)."""
        if not self.claim:
            return self
        folder = new_run_dir(self.run_dir)

        def moved(path: Path) -> Path:
            return folder / path.relative_to(self.run_dir) if path.is_relative_to(self.run_dir) else path

        store = self.store if moved(self.store.root) == self.store.root else \
            ModuleStore(moved(self.store.root), manifest_cls=self.store.manifest_cls)
        return RunOutputs(folder, store, moved(self.report_dir), claim=False, made=folder)


def save_as_free_version(save: Callable[[str], Path], store: ModuleStore, name: str, version: str,
                         numbered: bool, run: RunOutputs | None = None) -> tuple[Path, str]:
    """(artifact, version) of `save(version)`. Where the run numbered itself (no --version) and a run
    beside it (a sweep into one store) took that number meanwhile, the next free one, said. A write that
    fails (a full disk, a store made read-only meanwhile) is one line: the store's writes are atomic, so
    nothing half-written is left, nor the empty run folder `run` made for it."""
    while True:
        try:
            return save(version), version
        except (OSError, SafetensorError) as exc:  # safetensors' own on a write that fails
            if run is not None:
                run.drop_if_empty()
            raise UsageError(f"cannot write {name}/{version} into {store.root} "
                             f"({getattr(exc, 'strerror', None) or exc}): nothing was saved") from None
        except ArtifactError as exc:
            if not (numbered and exc.reason == "exists"):
                raise
            taken, version = version, store.next_version(name)
            print(f"{name}/{taken} was written meanwhile by another run: this one is {name}/{version}",
                  file=sys.stderr)


def say_if_bridge_outranked(store: ModuleStore, name: str, version: str) -> None:
    """tmod-serve loads the newest version of each bridge from its backbone in its --bridges store: where
    that is not the one just saved (a named version sorts after every number), said, rather than found out
    when serving."""
    source = store.read_manifest(name, version).source
    served = bridge_version_on(store, name, source).version
    if served != version:
        print(f"tmod-serve --bridges {store.root} on {source.name} loads bridge {name}/{served}, not this "
              f"{name}/{version}: it takes the newest version of each bridge from its backbone (the highest number, "
              f"then named ones alphabetically); save this one under another --name to serve it beside, or remove "
              f"{name}/{served}", file=sys.stderr)


def check_cache_dir(cache_dir: str | None) -> None:
    """A --cache-dir given where no folder can be made: refused before the work."""
    if cache_dir and (problem := cannot_make(Path(cache_dir))):
        raise UsageError(f"--cache-dir {cache_dir}: cannot make it: {problem}")


def write_cache_file(path: Path, write: Callable[[str], None]) -> bool:
    """`write(tmp)` a cache file beside `path`, then rename it to `path`: a half-written one is never
    found. One that cannot be written (no folder can be made there, a full disk) is said, not fatal: the
    run goes on, and a later run computes it again. -> whether it was written."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        write(tmp)
        os.replace(tmp, path)
        return True
    except (OSError, SafetensorError) as exc:  # safetensors' own on a write that fails (a full disk)
        tqdm.write(f"not cached: cannot write {path} ({getattr(exc, 'strerror', None) or exc}); the run goes on, "
                   "and a later one computes it again", file=sys.stderr)
        return False
    finally:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)
