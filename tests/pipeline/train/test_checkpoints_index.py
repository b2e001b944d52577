"""pipeline/train/checkpoints/index.py against the session's SeaweedFS behind the fault proxy: a checkpoint is
published whole or not at all (a refused "complete multipart upload" of model.safetensors, the silent loss of the
issue, is retried and verified; one that never completes names the file and leaves no meta.json), a resume skips an
incomplete checkpoint for the newest complete one, cleanup removes what nothing registered, and a storage failure
while reading a checkpoint is never "not a checkpoint"."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from pipeline import storage
from pipeline import storage_faults as faults
from pipeline.config import load_config
from pipeline.storage import StorageError
from pipeline.train.checkpoints.state import CheckpointError, read_checkpoint_meta
from pipeline.train.checkpoints.index import (incomplete, latest_complete, list_checkpoints, prune, publish,
                                              skipped_line)
from pipeline.train.engine import Engine

# the request that completes model.safetensors's upload: its one PutObject (a file under one part, as here), or the
# "complete multipart upload" of a larger one
REFUSE_MODEL_COMPLETION = r"^(PUT \S*/model\.safetensors |POST \S*/model\.safetensors\?uploadId=)"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two checkpoints of a nano engine on local disk (steps 0 and 1), as a Ray Train worker writes them."""
    cfg = load_config("cpu", {"model.tier": "nano", "data.seq_len": 32, "data.vocab_size": 256,
                              "train.batch_size": 2, "model.compile": "off"})
    engine = Engine(cfg, 96, torch.device("cpu"))
    root = tmp_path_factory.mktemp("ckpts")
    first = engine.save(root / "a")
    engine.step = 1
    second = engine.save(root / "b")
    return first, second


def test_meta_json_records_every_file_with_its_size_and_sha256(saved):
    meta = json.loads((saved[0] / "meta.json").read_text())
    assert set(meta["files"]) == {"model.safetensors", "train_state.pt"}
    size = (saved[0] / "model.safetensors").stat().st_size
    assert meta["files"]["model.safetensors"]["bytes"] == size and len(meta["files"]["train_state.pt"]["sha256"]) == 64


@pytest.mark.system
def test_a_refused_upload_completion_is_retried_and_the_checkpoint_verified(saved, s3_bucket, through_proxy):
    location = f"{s3_bucket}/ckpt-index/refused/checkpoint_2026-01-01_00-00-00.000001"
    through_proxy.refuse(REFUSE_MODEL_COMPLETION, count=4)  # more than the S3 client's own three tries
    publish(saved[0], location, window_s=60)
    assert len(through_proxy.requests(REFUSE_MODEL_COMPLETION)) >= 5  # four refused, then it went through
    assert [r.fault for r in through_proxy.requests(REFUSE_MODEL_COMPLETION)][:4] == ["refuse"] * 4
    assert incomplete(location) is None and incomplete(location, content=True) is None


@pytest.mark.system
def test_a_checkpoint_s_files_go_up_at_once_each_small_one_in_a_single_request(saved, s3_bucket, through_proxy):
    """publish uploads a checkpoint's files side by side (one round trip to the store per checkpoint, not one per
    file), and a file under one part goes up in one PutObject (pipeline/storage.py: allow_delayed_open), not a
    multipart upload's three requests."""
    location = f"{s3_bucket}/ckpt-index/at-once/checkpoint_2026-01-01_00-00-00.000001"
    through_proxy.stall(r"^PUT \S*/model\.safetensors ", seconds=3)  # held, then closed: the client sends it again
    publish(saved[0], location, window_s=60)
    writes = [r for r in through_proxy.requests(r"^(PUT|POST) ") if "/ckpt-index/at-once/" in r.line]
    model = [r for r in writes if "/model.safetensors" in r.line]
    state = [r for r in writes if "/train_state.pt" in r.line]
    assert model[0].fault == "stall" and model[-1].fault == "", writes
    assert [r.line.split()[0] for r in state] == ["PUT"] and "?" not in state[0].line, writes  # one PutObject
    assert state[0].time < model[-1].time, writes  # sent while model.safetensors' upload was held
    assert incomplete(location, content=True) is None


@pytest.mark.system
def test_a_checkpoint_that_cannot_be_completed_names_the_file_and_is_never_whole(saved, s3_bucket, through_proxy):
    location = f"{s3_bucket}/ckpt-index/never/checkpoint_2026-01-01_00-00-00.000001"
    through_proxy.refuse(REFUSE_MODEL_COMPLETION)
    with pytest.raises(StorageError) as err:
        publish(saved[0], location, window_s=2)
    msg = str(err.value)
    assert msg.startswith(f"checkpoint file model.safetensors could not be published to {location} (")
    assert msg.endswith("the checkpoint is not registered") and "\n" not in msg
    assert not storage.exists(f"{location}/meta.json")  # meta.json goes last: this folder is no checkpoint
    assert incomplete(location) == f"checkpoint {location} has no meta.json"


@pytest.mark.system
def test_resume_skips_an_incomplete_checkpoint_and_cleanup_removes_what_nothing_registered(saved, s3_bucket,
                                                                                          through_proxy):
    run = f"{s3_bucket}/ckpt-index/run/phase0"
    names = [f"checkpoint_2026-01-01_00-00-0{i}.000000" for i in range(1, 5)]
    for name in names:
        publish(saved[1] if name != names[0] else saved[0], f"{run}/{name}")
    storage.delete(f"{run}/{names[3]}/model.safetensors")  # registered, then lost its weights (the case)
    storage.delete(f"{run}/{names[2]}/meta.json")  # an upload that died before its meta.json: never registered
    found = list_checkpoints(run)
    assert [f.name for f in found] == names[::-1]
    assert [f.complete for f in found] == [False, False, True, True]
    assert found[0].problem == f"checkpoint {run}/{names[3]} lacks model.safetensors"

    chosen, skipped = latest_complete(run, preferred=f"{run}/{names[3]}")  # Ray's record names the broken one
    assert chosen == f"{run}/{names[1]}"
    assert skipped == f"checkpoint {run}/{names[3]} lacks model.safetensors"
    assert skipped_line(skipped, chosen) == (
        f"resume: checkpoint {run}/{names[3]} lacks model.safetensors; resuming from {run}/{names[1]} "
        f"(step 1), the newest complete checkpoint of the run")
    assert latest_complete(run) == (chosen, skipped)  # no record: by listing the run's checkpoints

    # Ray's record holds names[1] and names[3]; names[0] and names[2] were never registered (or were dropped)
    removed = prune(run, keep={names[1], names[3]}, older_than=names[3])
    assert sorted(removed) == [names[0], names[2]]
    assert [f.name for f in list_checkpoints(run)] == [names[3], names[1]]


@pytest.mark.system
def test_a_storage_failure_reading_a_checkpoint_says_storage_not_checkpoint(saved, s3_bucket, through_proxy,
                                                                             tmp_path):
    location = f"{s3_bucket}/ckpt-index/read/checkpoint_2026-01-01_00-00-00.000001"
    publish(saved[0], location)
    through_proxy.down()
    with faults.retry_window_of(0), pytest.raises(StorageError) as err:
        read_checkpoint_meta(location)
    assert str(err.value).startswith(f"cannot reach endpoint {through_proxy.endpoint} for {location}/meta.json")
    through_proxy.clear()
    local = shutil.copytree(saved[0], tmp_path / "c")
    (local / "train_state.pt").write_bytes(b"short")
    with pytest.raises(CheckpointError, match=r"holds 5 bytes of train_state.pt, meta.json says [\d,]+; it is "
                                              r"incomplete, use an earlier one"):
        read_checkpoint_meta(local)
