"""A full disk, injected (ENOSPC raised where the write happens): each writer ends in pipeline/disk_space.py's one line
naming the path, the bytes and the fix, and loses nothing: no partial file or checkpoint counted, the record as it was.
The real thing, a tmpfs that fills, is tests/pipeline/test_full_disk.py (system tier, root)."""
from __future__ import annotations

import errno
from collections import namedtuple

import pytest
import torch

from pipeline import disk_space, storage
from pipeline.disk_space import DiskFullError, is_disk_full, one_line_when_full
from pipeline.train.checkpoints.state import checkpoint_bytes
from pipeline.train.checkpoints.local_dir import LocalCheckpoints
from pipeline.train.session.run_dir import read_run_file, latest_of_run, write_run_file
from tests.pipeline.train.test_engine import VOCAB, make_cfg

ENOSPC = OSError(errno.ENOSPC, "No space left on device")
Usage = namedtuple("Usage", "total used free")


def test_which_errors_mean_a_full_disk():
    assert is_disk_full(ENOSPC) and is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_disk_full(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"))
    assert is_disk_full(Exception("(sqlite3.OperationalError) database or disk is full"))
    assert is_disk_full(OSError("AWS Error UNKNOWN (HTTP status 403) during PutObject operation: QuotaExceeded"))
    wrapped = RuntimeError("the upload failed")
    wrapped.__context__ = ENOSPC  # raised `from None` still carries it
    assert is_disk_full(wrapped)
    assert not is_disk_full(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 825984"))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied")) and not is_disk_full(None)


def test_an_error_that_hides_its_cause_counts_as_full_when_the_disk_had_less_than_the_write_needed(tmp_path,
                                                                                                monkeypatch):
    """torch.save's zip writer says only "unexpected pos" when a write came up short."""
    free = [100]
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda p: Usage(1000, 1000 - free[0], free[0]))
    with pytest.raises(DiskFullError) as caught:
        with one_line_when_full(tmp_path / "ckpt", "checkpoint", disk_space.CHECKPOINT_FIX, needed=300):
            raise RuntimeError("unexpected pos 825984 vs 825876")
    assert str(caught.value).startswith("no space left on ") and f"checkpoint {tmp_path / 'ckpt'} (needs ~0.3 KiB, " \
        "0.1 KiB free" in str(caught.value)
    free[0] = 10_000  # room enough: the same error is a bug, and passes unchanged
    with pytest.raises(RuntimeError, match="unexpected pos"):
        with one_line_when_full(tmp_path / "ckpt", "checkpoint", disk_space.CHECKPOINT_FIX, needed=300):
            raise RuntimeError("unexpected pos 825984 vs 825876")


def test_the_line_names_the_mount_the_bytes_and_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda p: Usage(7 << 20, 6 << 20, 561_152))
    line = str(disk_space.disk_full_error(tmp_path / "runs" / "r" / "step_000012", "checkpoint",
                                          disk_space.CHECKPOINT_FIX, needed=1_740_544))
    assert line == (f"no space left on {disk_space._mount_of(tmp_path)} for checkpoint {tmp_path}/runs/r/step_000012 "
                    f"(needs ~1.7 MiB, 548.0 KiB free of 7.0 MiB); free space there, or point run.root (or "
                    f"ray.storage_path) at a larger disk, or lower train.keep_checkpoints; then continue with --resume")
    s3 = str(disk_space.disk_full_error("s3://b/run/ray/phase0/checkpoint_x", "checkpoint", disk_space.CHECKPOINT_FIX,
                                        exc=OSError("AWS Error UNKNOWN (HTTP status 403): QuotaExceeded")))
    assert s3.startswith("the store at s3://b/run/ray/phase0/checkpoint_x refused checkpoint for lack of space or "
                         "quota (QuotaExceeded); free space there or raise its quota, or point run.root")


def test_a_write_that_fills_the_disk_leaves_no_temp_file_and_the_old_content(tmp_path, monkeypatch):
    target = tmp_path / "manifest.json"
    target.write_text("old")

    def no_room(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage.os, "fsync", no_room)
    with pytest.raises(storage.StorageError, match=f"no room for {target} .*No space left on device"):
        storage.write_bytes(str(target), b"new")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]


def test_run_json_that_cannot_be_written_stays_as_it_was(tmp_path, monkeypatch):
    write_run_file(tmp_path, {"status": "running", "phase": 0})

    def no_room(self, text, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("pathlib.Path.write_text", no_room)
    with pytest.raises(DiskFullError, match=r"for the run's record .*run\.json .*point run\.root at a larger disk"):
        write_run_file(tmp_path, {"status": "failed", "phase": 0})
    monkeypatch.undo()
    assert read_run_file(tmp_path) == {"status": "running", "phase": 0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


@pytest.fixture
def engine():
    from pipeline.train.engine import Engine

    return Engine(make_cfg(), VOCAB, torch.device("cpu"))


def test_a_checkpoint_that_fills_the_disk_is_never_counted_and_the_earlier_ones_stay(engine, tmp_path, monkeypatch):
    """The third checkpoint's weights fill the disk halfway through: one line naming it, its temporary folder gone,
    the two before it whole and still the newest complete (what --resume and validate RUN take)."""
    import safetensors.torch

    ckpts = LocalCheckpoints(tmp_path / "checkpoints" / "phase0", keep=2)
    for step in (4, 8):
        engine.step = step
        ckpts.save(engine)
    real = safetensors.torch.save_model

    def half_then_full(model, filename, *a, **k):
        real(model, filename, *a, **k)
        with open(filename, "r+b") as f:  # what a short write leaves
            f.truncate(100)
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_model", half_then_full)
    engine.step = 12
    with pytest.raises(DiskFullError) as caught:
        ckpts.save(engine)
    line = str(caught.value)
    assert line.startswith("no space left on ") and "for checkpoint " + str(ckpts.directory / "step_000012") in line
    assert f"needs ~{disk_space.size_text(checkpoint_bytes(engine.cfg, VOCAB))}" in line
    assert "lower train.keep_checkpoints; then continue with --resume" in line and "\n" not in line
    assert sorted(p.name for p in ckpts.directory.iterdir()) == ["step_000004", "step_000008"]
    write_run_file(tmp_path, {"phase": 0, "no_ray": True, "config": engine.cfg.flat(), "status": "failed"})
    assert latest_of_run(tmp_path)[0] == str(ckpts.directory / "step_000008")


def test_the_run_s_latest_checkpoint_is_its_newest_complete_one_not_only_what_run_json_records(engine, tmp_path):
    """A run killed mid-phase has checkpoints run.json does not name (it records one when a phase ends); a newer
    folder that lacks a file is skipped; a run with none in its phase yet falls back to run.json's."""
    ckpts = LocalCheckpoints(tmp_path / "checkpoints" / "phase1", keep=3)
    write_run_file(tmp_path, {"phase": 1, "no_ray": True, "config": engine.cfg.flat(), "checkpoint": "phase0-end"})
    assert latest_of_run(tmp_path)[0] == "phase0-end"
    for step in (10, 20, 30):
        engine.step = step
        ckpts.save(engine)
    (ckpts.directory / "step_000030" / "train_state.pt").unlink()
    assert latest_of_run(tmp_path)[0] == str(ckpts.directory / "step_000020")


def test_checkpoint_bytes_is_what_the_tier_writes(engine, tmp_path):
    """The estimate the warning and the line use, against a real checkpoint of the same model after a step (AdamW's
    moments exist from the first): within 5 %, never under."""
    from tests.pipeline.train.test_engine import batches

    engine.train_step([next(iter(batches(engine.cfg)(0, 0)))])
    saved = LocalCheckpoints(tmp_path, keep=1).save(engine)
    written = sum(p.stat().st_size for p in saved.iterdir())
    assert written <= checkpoint_bytes(engine.cfg, VOCAB) <= 1.05 * written


def test_a_run_whose_disk_cannot_hold_its_checkpoints_is_warned_before_its_first_step(engine, tmp_path, monkeypatch,
                                                                                     capsys):
    from pipeline.train.checkpoints.state import warn_if_no_room_for_checkpoints

    each = checkpoint_bytes(engine.cfg, VOCAB)
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda p: Usage(10 * each, 8 * each, 2 * each))
    line = warn_if_no_room_for_checkpoints(engine.cfg, VOCAB, str(tmp_path / "ckpts"))
    assert capsys.readouterr().out == line + "\n"
    assert line.startswith("warning: ") and "2 checkpoint(s) kept (train.keep_checkpoints) and the one being " \
        "written need room for 3 of" in line and f"at {tmp_path / 'ckpts'}" in line
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda p: Usage(10 * each, 7 * each, 3 * each))
    assert warn_if_no_room_for_checkpoints(engine.cfg, VOCAB, str(tmp_path / "ckpts")) is None
    assert warn_if_no_room_for_checkpoints(engine.cfg, VOCAB, "s3://bucket/run/ray") is None  # no free figure


def test_ray_train_does_not_retry_a_full_disk():
    from pipeline.train.distributed.failure_policy import repeats_on_retry  # imports Ray Train

    assert repeats_on_retry(DiskFullError("no space left")) and repeats_on_retry(DiskFullError)
    assert not repeats_on_retry(storage.StorageError("cannot reach the object store"))


def test_mlflow_s_store_filling_up_is_one_line_naming_it(tmp_path):
    """The tracker's writes (metrics here) through an MLflow client whose SQLite store is full."""
    from pipeline.tracking.tracker import Tracker

    class FullStore:
        def log_batch(self, *a, **k):
            raise RuntimeError("(sqlite3.OperationalError) database or disk is full")

    tracker = Tracker.__new__(Tracker)
    tracker.client, tracker._run_id = FullStore(), "r1"
    tracker.tracking_uri, tracker.nonfinite_skipped = f"sqlite:///{tmp_path}/mlflow.db", 0
    with pytest.raises(DiskFullError, match=rf"for MLflow's metrics {tmp_path}/mlflow\.db .*tracking\.tracking_uri"):
        tracker.log_metrics({"train/loss": 1.0}, step=1)


def test_mlflow_s_artifact_folder_filling_up_is_one_line_naming_it(tmp_path):
    from pipeline.tracking.tracker import Tracker

    class FullArtifacts:
        def log_text(self, *a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")

        def get_run(self, run_id):
            return namedtuple("Run", "info")(namedtuple("Info", "artifact_uri")(f"file://{tmp_path}/mlartifacts/1/r1"))

    tracker = Tracker.__new__(Tracker)
    tracker.client, tracker._run_id, tracker.storage_retry_s = FullArtifacts(), "r1", 0.0
    tracker.tracking_uri = f"sqlite:///{tmp_path}/mlflow.db"
    with pytest.raises(DiskFullError, match=rf"for MLflow's artifact samples/step_8\.txt {tmp_path}/mlartifacts/1/r1 "):
        tracker.log_text("generated text", "samples/step_8.txt")


def test_a_full_disk_under_progress_json_ends_the_run_at_its_next_log_step(tmp_path, monkeypatch):
    """progress.json is written from a background thread and is best effort (a store that is away costs the
    lost-work figures, not the run); a full disk is not passed over: the next log step raises its line."""
    from pipeline.train.distributed.elastic import ResumeReport

    def full(location, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage, "write_text", full)
    report = ResumeReport(str(tmp_path), phase=0)
    engine = namedtuple("Engine", "step world_size")(10, 1)
    report.logged(engine, {"train/loss": 1.0})
    report.flush()
    with pytest.raises(DiskFullError, match=rf"for the run's progress record {tmp_path}/progress\.json "):
        report.logged(engine._replace(step=20), {"train/loss": 1.0})
