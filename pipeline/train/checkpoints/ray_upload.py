"""Ray Train's side of checkpoints: a checkpoint is uploaded and verified by the project's storage layer before Ray
registers it, a restore skips a registered checkpoint that is not complete, `--checkpoint PATH` resumes from a chosen
one, and the folders Ray never registered are removed. The what-is-complete logic is in
pipeline/train/checkpoints/index.py; this module hands it Ray's names and record. Imported inside Ray Train's workers
(ray itself is imported in the functions: pipeline/train/ray_train.py stays light for Ray's controller).

    uploads = CheckpointUploads(ray_storage, cfg.ray.checkpoint_upload, rank)
    uploads.report(metrics, save=lambda d: engine.save(d))   # every worker, at every checkpoint (save: None where
    uploads.finish()                                         # the worker attaches nothing), then once at the end
    meta = load_restored(engine, ray.train.get_checkpoint(), ray_storage)

Uploads with ray.checkpoint_upload=async (sync, the default, makes the step wait: docs/cluster.md says why) run in Ray Train's own background thread
(`ray.train.report(..., checkpoint_upload_mode=CheckpointUploadMode.ASYNC)`): the steps after a checkpoint train while
it uploads. Ray Train 2.60 runs them one at a time in a single thread per worker, calls the upload fn there, deletes
the local copy only after the upload fn returned (delete_local_checkpoint_after_upload), and hands the reports to its
controller in the order they were made (a report waits for every earlier one); an upload fn that raises ends the
attempt (the error reaches the controller as the training function's), and the end of the training function waits
for the uploads in flight. On top of that, CheckpointUploads keeps at most one upload in flight per worker (the next
checkpoint waits for the previous one: one local copy waiting, and an upload that failed is known at the next
checkpoint at the latest), and prunes (prune_unregistered) only once the previous checkpoint is registered.

With sync, rank 0 waits after the upload for Ray to register the checkpoint (Ray's controller does it at its next
poll of the workers, every 2 s by default, then writes its record and removes the checkpoints beyond
train.keep_checkpoints: ~1.5 s, and 10 storage requests), so every checkpoint is registered before the next step
trains. With async nothing on the training thread waits for that. Either way the pruning (a listing, the removals)
runs in a thread of rank 0's own, one checkpoint's turn after another; finish() waits for it.
"""
from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from pipeline import storage_faults as faults
from pipeline.console import worker_print
from pipeline.storage import StorageError, is_local, location_of


def load_restored(engine, restored, ray_storage: str) -> dict[str, Any]:
    """Ray Train's checkpoint into the engine. A checkpoint Ray registered that is not complete (a file lost in
    storage, or registered by a version that did not verify its uploads) is skipped for the newest complete one
    in the run's folder, said in one line (pipeline/train/checkpoints/index.py latest_complete). On object storage a
    sharded (FSDP) checkpoint is read in place: each worker fetches only the byte ranges of its own shards, so no
    node downloads the whole model and optimizer. A full checkpoint, which every worker needs whole, comes through
    Ray's as_directory (one download per node, shared by its workers)."""
    from pipeline.train.checkpoints.broken import diagnosed
    from pipeline.train.checkpoints.state import CheckpointError
    from pipeline.train.checkpoints.index import latest_complete, run_folder, skipped_line

    location = location_of(restored.filesystem, restored.path, ray_storage)
    chosen, skipped = latest_complete(run_folder(location), preferred=location)
    if chosen is None:
        raise CheckpointError(f"resume: {skipped}, and {run_folder(location)} holds no complete checkpoint; start the "
                              f"run anew (another --run.name) or pass a complete one with --checkpoint")
    if skipped and engine.rank == 0:
        worker_print(skipped_line(skipped, chosen))
    with diagnosed(chosen):  # complete by its listing, yet it may not load: one line offering the previous
        return _load_location(engine, chosen, via=restored if chosen == location else None)


def _load_location(engine, location: str, via=None) -> dict[str, Any]:
    """A checkpoint at `location` into the engine (as load_restored says); `via`: Ray's Checkpoint
    for it, whose as_directory shares one download per node."""
    from pipeline.train.checkpoints.state import SHARDED, read_checkpoint_meta

    if not is_local(location):
        meta = read_checkpoint_meta(location)
        if meta["layout"] == SHARDED:
            meta = engine.load(location, meta=meta)
            if engine.rank == 0:
                worker_print(f"resume: read {meta['read_bytes'] / 2**20:,.1f} MiB of the checkpoint's "
                             f"{meta['shard_bytes'] / 2**20:,.1f} MiB of shards from {location} (this worker's part)")
            return meta
    if via is None:
        return engine.load(location)
    with via.as_directory() as d:  # Ray's download, through the storage filesystem that retries (storage_faults.py)
        return engine.load(d)


def load_chosen(engine, location: str) -> dict[str, Any]:
    """`--checkpoint PATH` on a resume: that checkpoint, which must be complete (the user chose it: no other is
    taken in its place)."""
    from pipeline.train.checkpoints.broken import BrokenCheckpoint, diagnosed, previous_complete
    from pipeline.train.checkpoints.index import incomplete, step_of

    problem = incomplete(location)
    if problem is not None:
        raise BrokenCheckpoint(location, problem, *previous_complete(location))
    if engine.rank == 0:
        worker_print(f"resume: from {location} (step {step_of(location)}), as --checkpoint asks")
    with diagnosed(location):
        return _load_location(engine, location)


def written_by(restored, lc: dict[str, Any]) -> bool:
    """Whether Ray's latest checkpoint was reported by this fit (a restart within it) rather than by an earlier run
    of the same name: meta.json's fit_id."""
    from pipeline.train.checkpoints.index import read_meta

    meta = read_meta(location_of(restored.filesystem, restored.path, lc["ray_storage"]))
    return bool(meta) and meta.get("fit_id") == lc.get("fit_id")


def wait_for_storage(run_store: str, window_s: float, rank: int) -> None:
    """Return once the run's storage answers (a listing of it), waiting up to `window_s` with backoff; rank 0 says
    once that it waits. A 403 is waited for as an outage is (pipeline/storage_faults.py may_pass). StorageError when
    it does not answer in time, saying how long it was waited for."""
    import pyarrow.fs as pafs

    from pipeline.storage import explained, resolve

    def note(exc: BaseException, waited: float) -> None:
        if rank == 0:
            found = faults.kind(exc) or "error"
            what = ("answers 403 access denied (a store's auth away, or the credentials)" if found == "denied"
                    else f"does not answer ({found})")
            worker_print(f"storage: {run_store} {what}; waiting up to {window_s:.0f} s (run.storage_retry_s) "
                         f"before resuming")

    fs, path = resolve(run_store)
    # The raw call is retried and explained once, so the line names the time waited (listdir explains each try).
    with explained(run_store, "run.storage"):
        faults.wait_until(lambda: fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)), window_s,
                          on_wait=note)


def publish_for_ray(ray_storage: str, published: dict[str, str]):
    """Ray Train's checkpoint_upload_fn: the worker's checkpoint files uploaded by pipeline/train/checkpoints/index.py
    `publish` (the project's storage layer, which raises, then a listing that verifies every file's name and size,
    retried with backoff for run.storage_retry_s) into the folder Ray names; only then is it handed back for Ray to
    register. Ray's own upload (pyarrow copy_files) could return normally with a file missing, and register the
    checkpoint anyway. Under FSDP every worker publishes its own shards into the same folder; Ray registers the
    checkpoint once every worker's upload returned. `published["location"]` is set to where it went."""

    def upload(checkpoint, name: str):
        import ray.train

        from pipeline.train.checkpoints.index import publish

        from pipeline.disk_space import CHECKPOINT_FIX, DiskFullError, one_line_when_full
        from pipeline.storage import delete

        storage = ray.train.get_context().get_storage()
        path = storage.build_checkpoint_path_from_name(name)
        location = location_of(storage.storage_filesystem, path, ray_storage)
        try:
            with one_line_when_full(location, "checkpoint", CHECKPOINT_FIX):  # a full disk or quota: that line
                publish(checkpoint.path, location)
        except DiskFullError:  # what was written of it holds space the user is about to free: removed (best effort)
            with faults.retry_window_of(0), contextlib.suppress(Exception):
                delete(location)
            raise
        published["location"] = location
        return ray.train.Checkpoint(path=path, filesystem=storage.storage_filesystem)

    return upload


def registered_names() -> set[str] | None:
    """The checkpoint folder names Ray's record holds once it has registered every report this worker made so far
    (Ray Train's COMMITTED read), or None when no record came in time (a controller busy elsewhere)."""
    import ray.train

    try:
        kept = ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED,
                                                      timeout_s=60)
    except Exception:  # noqa: BLE001 -- no record now: the next checkpoint prunes
        return None
    return {c.checkpoint.path.rstrip("/").rsplit("/", 1)[-1] for c in kept}


def prune_unregistered(location: str, names: set[str] | None = None) -> None:
    """Rank 0, after the checkpoint at `location` was registered: remove the run's checkpoint folders older than it
    that Ray's record (`names`, else read now: registered_names) does not hold (uploaded but never registered, or
    incomplete); Ray removes the registered ones beyond train.keep_checkpoints itself. Best effort: what fails now is
    removed at a later checkpoint."""
    from pipeline.train.checkpoints.index import prune, run_folder

    names = registered_names() if names is None else names
    if names is None:
        return
    with faults.retry_window_of(0):
        try:
            prune(run_folder(location), names, older_than=location.rstrip("/").rsplit("/", 1)[-1])
        except StorageError:
            pass



class CheckpointUploadError(RuntimeError):
    """A checkpoint's upload failed with an error that is not the store's (the store's is a StorageError)."""


class CheckpointUploads:
    """One Ray Train worker's checkpoint reports, uploaded by publish_for_ray (verified, then registered) either in
    Ray Train's background upload thread while training goes on (mode "async") or inside the report ("sync"): the
    module docstring says what each guarantees. A checkpoint is written into this worker's scratch folder under the
    node's temp directory and removed once uploaded (by Ray after an upload, by the upload fn after a failed one);
    finish() waits for the last upload and removes the folder."""

    def __init__(self, ray_storage: str, mode: str, rank: int) -> None:
        self.ray_storage, self.asynchronous, self.rank = ray_storage, mode == "async", rank
        self._scratch: Path | None = None
        self._count = 0
        self._in_flight: tuple[threading.Event, dict[str, Any]] | None = None
        # rank 0: reads Ray's record once it registered a checkpoint, then prunes; off the training thread
        self._pruner: ThreadPoolExecutor | None = None
        if self.asynchronous:
            _quiet_async_upload_traceback()

    def report(self, metrics: dict[str, Any], save: Callable[[Path], Path] | None, validation: bool = False) -> None:
        """ray.train.report of `metrics` (every worker calls it at every checkpoint: Ray Train synchronises on it)
        with the checkpoint `save(directory)` writes, or none when `save` is None. Waits first for this worker's
        previous upload (raising its error). `validation`: Ray Train's validation hook scores the checkpoint (the
        downstream tasks, pipeline/train/task_scoring.py)."""
        import ray.train

        self.settle()
        if save is None:
            ray.train.report(metrics)
            return
        from pipeline.disk_space import SCRATCH_FIX, one_line_when_full

        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="longtrain-checkpoints-"))
        self._count += 1
        with one_line_when_full(self._scratch, "the checkpoint's local copy (written before its upload)",
                                SCRATCH_FIX):
            local = save(self._scratch / f"checkpoint-{self._count}")
        done, outcome = threading.Event(), {}
        upload = publish_for_ray(self.ray_storage, outcome)

        def upload_or_clean_up(checkpoint, name: str):
            # Ray Train's upload thread (async) or the training thread (sync)
            try:
                try:
                    persisted = upload(checkpoint, name)
                except BaseException as exc:
                    outcome["error"] = exc
                    shutil.rmtree(local, ignore_errors=True)  # Ray deletes the local copy only after an upload
                    if isinstance(exc, StorageError):  # its one line (and kind); the upload's frames say no more
                        raise type(exc)(str(exc)) from None
                    raise
                return persisted
            finally:
                done.set()

        mode = ray.train.CheckpointUploadMode.ASYNC if self.asynchronous else ray.train.CheckpointUploadMode.SYNC
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(local)),
                         checkpoint_upload_mode=mode, delete_local_checkpoint_after_upload=True,
                         checkpoint_upload_fn=upload_or_clean_up, validation=validation)
        # Ray calls the upload fn for every report it does not skip, and it skips one only when it replaces a
        # replica group (its fault-tolerant replica groups, which this project does not use).
        self._in_flight = (done, outcome)
        if not self.asynchronous:
            self.settle()

    def settle(self) -> None:
        """Wait for this worker's upload in flight, if any; raise its error (the attempt ends: Ray Train restarts
        from the last registered checkpoint). Rank 0 then waits for Ray to register it (sync) and hands the pruning to
        its pruning thread, which waits for the registration itself under async."""
        if self._in_flight is None:
            return
        done, outcome = self._in_flight
        done.wait()  # bounded by the upload's own retry window (run.storage_retry_s), as a synchronous one is
        self._in_flight = None
        exc = outcome.get("error")
        if isinstance(exc, StorageError):  # its kind kept: a full disk is not retried (failure_policy.py)
            raise type(exc)(str(exc)) from None
        if exc is not None:
            raise CheckpointUploadError(f"the checkpoint upload failed: {type(exc).__name__}: {exc}") from None
        if self.rank == 0:
            if self._pruner is None:
                self._pruner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-prune")
            # In the pruning thread, the folders older than this one that Ray's record does not hold are removed
            # (best effort: what fails is left for the next checkpoint's turn).
            if self.asynchronous:  # that thread waits for Ray to register this checkpoint
                self._pruner.submit(prune_unregistered, outcome["location"])
            elif (names := registered_names()) is not None:  # the step waits: registered before the next step
                self._pruner.submit(prune_unregistered, outcome["location"], names)

    def finish(self) -> None:
        """After training (its end, a stop, a preemption): the last upload complete and registered, the folders
        Ray does not hold pruned, this worker's scratch folder removed."""
        self.settle()
        if self._pruner is not None:  # bounded: registered_names' timeout, and a prune that tries once
            self._pruner.shutdown(wait=True)
            self._pruner = None
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None


def _quiet_async_upload_traceback() -> None:
    """In a Ray Train worker: Ray Train logs an upload fn's error twice, first from its upload thread (`checkpoint
    upload failed in the background thread`, with a traceback), then as the error of the training function, which
    the console already turns into one line for a storage error (pipeline/console.py `storage: … (this attempt
    ends)`). The console drops the first when the error is the store's; Ray's log files keep it."""
    import logging

    for handler in logging.getLogger().handlers:
        if "File" not in type(handler).__name__ and not any(isinstance(f, _DropAsyncStorageFailure)
                                                             for f in handler.filters):
            handler.addFilter(_DropAsyncStorageFailure())


class _DropAsyncStorageFailure:
    def filter(self, record) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], StorageError)
                    and "upload failed in the background thread" in str(record.msg))
