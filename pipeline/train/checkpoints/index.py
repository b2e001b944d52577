"""A run's checkpoints in storage: what a complete checkpoint holds, which of a run's checkpoints are complete, the
latest complete one, publishing a checkpoint so that it is complete before anything registers it, and removing the
folders nothing registered. The one place that answers "is this checkpoint whole?" and "which is the latest complete
checkpoint?" (`latest_complete`) for training, resume and the commands that read checkpoints (validate, eval,
generate and export take a run's latest through pipeline/train/session/run_dir.py `latest_of_run`, which finds the
run's folder of checkpoints and asks `latest_complete`).

    record = file_record(local_dir)                   # {"model.safetensors": {"bytes": n, "sha256": hex}, ...}
    problem = incomplete("s3://b/run/ray/phase0/checkpoint_2026-01-02_03-04-05.678901")   # None, or one line
    for c in list_checkpoints("s3://b/run/ray/phase0"): ...   # newest first: Found(location, name, problem)
    location, note = latest_complete("s3://b/run/ray/phase0")   # the latest complete one, and what was skipped
    publish(local_dir, location, window_s=300)        # upload, verify every file by listing, retry; or StorageError
    prune("s3://b/run/ray/phase0", keep={...}, older_than="checkpoint_...")   # unregistered and incomplete folders

Complete means: meta.json is there and parses, and every file its `files` record names (each file's size in bytes
and sha256, written by pipeline/train/checkpoints/state.py at save time) is there with that size, as one listing of the
checkpoint's prefix shows (one LIST request, no download). `incomplete(..., content=True)` also reads every file
back and compares its sha256. A checkpoint written before the record existed (no `files` in meta.json) is checked
for the files of its layout by name. meta.json is written last when a checkpoint is published, so a folder with a
meta.json whose files are all there was published whole.

Where a run's checkpoints are: Ray Train's experiment folders (<ray storage>/phase<i>/checkpoint_<time>, names
that sort by time) and a Ray-free run's <run>/checkpoints/phase<i>/step_<step>. Nothing here imports Ray: the
Ray Train glue (pipeline/train/ray_train.py) hands Ray's names and record in.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from pyarrow.fs import FileType

from pipeline import storage_faults as faults
from pipeline.disk_space import DiskFullError
from pipeline.storage import (StorageError, basename, delete, join, listdir, read_text, resolve, sha256,
                              upload_file)

META_FILE = "meta.json"
CHECKPOINT_PREFIXES = ("checkpoint_", "step_")  # Ray Train's folders, a Ray-free run's folders
FULL_LAYOUT_FILES = ("model.safetensors", "train_state.pt")  # what a full checkpoint without a `files` record needs
SHARDED_METADATA = "sharded/.metadata"  # what a sharded one without a record needs at least (its DCP index)
PUBLISH_THREADS = 8  # files of one checkpoint uploaded at once (publish); each streams in 8 MB chunks


# ------------------------------------------------------------------------------------------ the record
def file_record(directory: str | os.PathLike, names: Iterable[str] | None = None) -> dict[str, dict[str, Any]]:
    """{relative name: {"bytes": size, "sha256": hex digest}} of the files under a local `directory` (or only
    `names`), meta.json left out: what meta.json's `files` says a complete checkpoint holds."""
    root = Path(directory)
    if names is None:
        names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    out = {}
    for name in names:
        if name == META_FILE:
            continue
        path = root / name
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        out[name] = {"bytes": path.stat().st_size, "sha256": h.hexdigest()}
    return out


def _listed(location: str) -> dict[str, int]:
    """{relative name: size} of every file under `location` (one recursive listing)."""
    _, base = resolve(location)
    return {f.path[len(base) + 1:]: f.size for f in listdir(location, recursive=True) if f.type == FileType.File}


def read_meta(location: str) -> dict[str, Any] | None:
    """meta.json of a checkpoint, None when it has none; StorageError when storage fails (never "no meta.json"
    for an outage); ValueError for one that does not parse."""
    try:
        return json.loads(read_text(join(location, META_FILE)))
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


def file_problems(location: str, meta: dict[str, Any], content: bool = False,
                  skip: Iterable[str] = ()) -> Iterator[str]:
    """One line for every file meta.json says the checkpoint at `location` holds that is not there, not its recorded
    size, or (content=True) not its recorded sha256; `skip`: names not checked (train_state.pt for a reader of the
    weights alone)."""
    listed = _listed(location)
    record = meta.get("files")
    if not record:  # written before the record: the layout's files by name
        needed = [SHARDED_METADATA] if meta.get("layout") == "sharded" else list(FULL_LAYOUT_FILES)
        yield from (f"checkpoint {location} lacks {n}" for n in needed if n not in listed and n not in skip)
        return
    for name, want in sorted(record.items()):
        if name in skip:
            continue
        if name not in listed:
            yield f"checkpoint {location} lacks {name}"
        elif listed[name] != want["bytes"]:
            yield f"checkpoint {location} holds {listed[name]:,} bytes of {name}, meta.json says {want['bytes']:,}"
        elif content and sha256(join(location, name)) != want["sha256"]:
            yield f"checkpoint {location}: {name} does not match the sha256 meta.json records"


def missing_files(location: str, meta: dict[str, Any], content: bool = False, skip: Iterable[str] = ()) -> str | None:
    """None when every file meta.json says the checkpoint at `location` holds is there (with its recorded size;
    and sha256 with content=True), `skip` left out; else one line naming the first that is not."""
    return next(file_problems(location, meta, content, skip), None)


def incomplete(location: str, content: bool = False) -> str | None:
    """None when the checkpoint at `location` is complete (module docstring), else one line saying what is
    missing. StorageError when storage cannot be read (after the retry window): a storage failure is never
    reported as an incomplete checkpoint."""
    try:
        meta = read_meta(location)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return f"checkpoint {location} has a corrupt meta.json ({exc})"
    if meta is None:
        return f"checkpoint {location} has no meta.json"
    return missing_files(location, meta, content)


# ------------------------------------------------------------------------------------------ a run's checkpoints
@dataclass
class Found:
    location: str
    name: str
    problem: str | None = None  # None: complete

    @property
    def complete(self) -> bool:
        return self.problem is None


def checkpoint_names(directory: str) -> list[str]:
    """Names of the checkpoint folders directly under `directory`, newest first (Ray Train's names carry the
    time, a Ray-free run's the step: both sort)."""
    found = [basename(f.path) for f in listdir(directory) if f.type == FileType.Directory]
    return sorted((n for n in found if n.startswith(CHECKPOINT_PREFIXES)), reverse=True)


def list_checkpoints(directory: str) -> list[Found]:
    """Every checkpoint folder under `directory` (a run's Ray Train experiment folder, or a Ray-free run's
    checkpoints/phase<i>), newest first, each with what it lacks (None when complete)."""
    return [Found(join(directory, n), n, incomplete(join(directory, n))) for n in checkpoint_names(directory)]


def _newest_complete(directory: str, skip: Iterable[str] = ()) -> Found | None:
    """The newest complete checkpoint under `directory` (folders named in `skip` left out), checking from the
    newest down until one is complete; None when there is none."""
    skipped = {basename(s) for s in skip}
    for name in checkpoint_names(directory):
        if name in skipped:
            continue
        location = join(directory, name)
        if incomplete(location) is None:
            return Found(location, name)
    return None


def latest_complete(directory: str, preferred: str | None = None) -> tuple[str | None, str | None]:
    """(the latest complete checkpoint in `directory` (a run's folder of them), the one a resume loads; what was
    wrong with a newer one it skipped, or None): `preferred` (the latest in Ray Train's record) when it is complete,
    else the newest complete checkpoint there. (None, what is wrong) when there is none to resume from, (None, None)
    when the folder holds none at all. The project's one answer to "which is the latest complete checkpoint?";
    `skipped_line` says what a resume skipped."""
    problem = incomplete(preferred) if preferred is not None else None
    if preferred is not None and problem is None:
        return preferred, None
    found = _newest_complete(directory, skip=[preferred] if preferred else [])
    if problem is None:  # no record: the newest folder, unless it is incomplete
        newer = [n for n in checkpoint_names(directory) if found is None or n > found.name]
        problem = incomplete(join(directory, newer[0])) if newer else None
    return (None if found is None else found.location), problem


def skipped_line(problem: str, location: str) -> str:
    """The one line a resume prints when `latest_complete` skipped a newer checkpoint for the one at `location`."""
    return (f"resume: {problem}; resuming from {location} (step {step_of(location)}), the newest complete checkpoint "
            f"of the run")


def step_of(location: str) -> int | None:
    meta = read_meta(location)
    return None if meta is None else meta.get("counters", {}).get("step")


# ------------------------------------------------------------------------------------------ publishing
def publish(local_dir: str | os.PathLike, location: str, window_s: float | None = None) -> None:
    """Upload the checkpoint files of a local directory to `location` with the project's storage layer (which
    raises on any failed write, unlike a bulk copy that can end normally with a file missing), then list
    `location` and compare every file's name and size with what was written; files that did not arrive whole are
    uploaded again, with capped exponential backoff, for `window_s` (default: this process's retry window). meta.json
    goes last, after the others are verified, so a folder with a meta.json was published whole. Raises StorageError
    naming the file that could not be published: nothing may register the checkpoint then."""
    local = Path(local_dir)
    names = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    sizes = {n: (local / n).stat().st_size for n in names}
    window = faults.retry_window() if window_s is None else window_s
    deadline = time.monotonic() + window

    def failed(name: str, why: str) -> StorageError:
        return StorageError(f"checkpoint file {name} could not be published to {location} ({why}); the checkpoint "
                            f"is not registered")

    def put_one(name: str) -> StorageError | None:
        try:  # the retry window is per thread: each upload's thread gets what is left of it
            with faults.retry_window_of(max(0.0, deadline - time.monotonic())):
                upload_file(local / name, join(location, name))
        except StorageError as exc:
            return exc
        return None

    def put(batch: list[str]) -> dict[str, int]:
        # the files at once (a model's, the optimizer's, every FSDP shard): one round trip to the store per
        # checkpoint rather than one per file
        if len(batch) > 1:
            with ThreadPoolExecutor(max_workers=min(PUBLISH_THREADS, len(batch)),
                                    thread_name_prefix="checkpoint-publish") as pool:
                errors = list(pool.map(put_one, batch))
        else:
            errors = [put_one(name) for name in batch]
        for name, error in zip(batch, errors):
            if isinstance(error, DiskFullError):  # its own line: where, how much, what to do
                raise error
            if error is not None:
                raise failed(name, str(error))
        with faults.retry_window_of(max(0.0, deadline - time.monotonic())):
            return _listed(location)

    todo, attempt = [n for n in names if n != META_FILE], 0
    while todo:
        listed = put(todo)
        todo = [n for n in todo if listed.get(n) != sizes[n]]
        if not todo:
            break
        attempt += 1
        delay = faults.backoff(attempt)
        if time.monotonic() + delay > deadline:
            name = todo[0]
            found = "missing" if name not in listed else f"{listed[name]:,} of {sizes[name]:,} bytes"
            raise failed(name, f"{found} after every upload returned, for {window:.0f} s (run.storage_retry_s)")
        time.sleep(delay)
    if META_FILE in sizes and put([META_FILE]).get(META_FILE) != sizes[META_FILE]:
        raise failed(META_FILE, "not there whole after its upload returned")


# ------------------------------------------------------------------------------------------ cleaning up
def prune(directory: str, keep: Iterable[str], older_than: str) -> list[str]:
    """Remove the checkpoint folders under `directory` that are older than `older_than` (a folder name: the newer
    complete checkpoint just registered) and not in `keep` (the names the run's record holds): folders that were
    uploaded but never registered (a failed verification, an attempt that died mid-upload) and incomplete ones.
    Best effort (a failure is left for the next checkpoint's turn); returns the names removed."""
    kept = {basename(k) for k in keep} | {basename(older_than)}
    removed = []
    for name in checkpoint_names(directory):
        if name in kept or name >= basename(older_than):
            continue
        try:
            delete(join(directory, name))
            removed.append(name)
        except StorageError:
            break
    return removed


def run_folder(location: str) -> str:
    """The folder a checkpoint location sits in (the run's experiment folder)."""
    return location.rstrip("/").rsplit("/", 1)[0] if "://" in location else str(Path(location).parent)
