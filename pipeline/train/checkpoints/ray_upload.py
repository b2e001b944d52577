"""Ray Train's side of checkpoints: a checkpoint is uploaded and verified by the project's storage layer before Ray
registers it, a restore skips a registered checkpoint that is not complete, `--checkpoint PATH` resumes from a chosen
one, and the folders Ray never registered are removed. The what-is-complete logic is in
pipeline/train/checkpoints/index.py; this module hands it Ray's names and record. Imported inside Ray Train's workers
(ray itself is imported in the functions: pipeline/train/ray_train.py stays light for Ray's controller).

    report(metrics, checkpoint=Checkpoint.from_directory(d), checkpoint_upload_fn=publish_for_ray(storage, out))
    meta = load_restored(engine, ray.train.get_checkpoint(), ray_storage)
    prune_unregistered(out["location"])
"""
from __future__ import annotations

from typing import Any

from pipeline import storage_faults as faults
from pipeline.console import worker_print
from pipeline.storage import StorageError, is_local, location_of


def load_restored(engine, restored, ray_storage: str) -> dict[str, Any]:
    """Ray Train's checkpoint into the engine. A checkpoint Ray registered that is not complete (a file lost in
    storage, or registered by a version that did not verify its uploads) is skipped for the newest complete one
    in the run's folder, said in one line (pipeline/train/checkpoints/index.py resume_point). On object storage a
    sharded (FSDP) checkpoint is read in place: each worker fetches only the byte ranges of its own shards, so no
    node downloads the whole model and optimizer. A full checkpoint, which every worker needs whole, comes through
    Ray's as_directory (one download per node, shared by its workers)."""
    from pipeline.train.checkpoints.broken import diagnosed
    from pipeline.train.checkpoints.state import CheckpointError
    from pipeline.train.checkpoints.index import resume_point, run_folder

    location = location_of(restored.filesystem, restored.path, ray_storage)
    chosen, note = resume_point(run_folder(location), preferred=location)
    if chosen is None:
        raise CheckpointError(f"resume: {note}, and {run_folder(location)} holds no complete checkpoint; start the "
                              f"run anew (another --run.name) or pass a complete one with --checkpoint")
    if note and engine.rank == 0:
        worker_print(note)
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

        storage = ray.train.get_context().get_storage()
        path = storage.build_checkpoint_path_from_name(name)
        location = location_of(storage.storage_filesystem, path, ray_storage)
        publish(checkpoint.path, location)
        published["location"] = location
        return ray.train.Checkpoint(path=path, filesystem=storage.storage_filesystem)

    return upload


def prune_unregistered(location: str) -> None:
    """Rank 0, after a checkpoint was registered: remove the run's checkpoint folders older than it that Ray's record
    does not hold (uploaded but never registered, or incomplete); Ray removes the registered ones beyond
    train.keep_checkpoints itself. Best effort: what fails now is removed at a later checkpoint."""
    import ray.train

    from pipeline.train.checkpoints.index import prune, run_folder

    try:
        kept = ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED,
                                                      timeout_s=60)
    except Exception:  # noqa: BLE001 -- no record now (a controller busy elsewhere): the next checkpoint prunes
        return
    names = {c.checkpoint.path.rstrip("/").rsplit("/", 1)[-1] for c in kept}
    with faults.retry_window_of(0):
        try:
            prune(run_folder(location), names, older_than=location.rstrip("/").rsplit("/", 1)[-1])
        except StorageError:
            pass
