"""Object storage that misbehaves, at the storage layer: the session's SeaweedFS behind the fault proxy
(tests/conftest.py `through_proxy`, bench/fault_proxy.py), in this process. An outage and 5xx answers are ridden out
within the retry window and end in one line naming the endpoint and the object after it; so is a 403 (one past the
window says it may be the credentials; without a window it is refused at once); a stall is named as a stall with its
timeout; rank 0's progress record is written in the background; deleting what is gone is no error; Ray's own storage calls
ride out an outage through the retrying filesystem. (Training and prepare under faults: test_storage_faults_train.py.)
"""
from __future__ import annotations

import re
import threading

import pytest

from pipeline import storage
from pipeline import storage_faults as faults
from pipeline.storage import StorageError

pytestmark = pytest.mark.system


@pytest.fixture
def obj(s3_bucket, through_proxy, request) -> str:
    location = f"{s3_bucket}/faults/{request.node.name}/obj.bin"
    storage.write_bytes(location, b"payload")
    return location


def test_an_outage_within_the_window_is_ridden_out(obj, through_proxy):
    through_proxy.down(2)  # the proxy's listening socket comes back after 2 s
    with faults.retry_window_of(60):
        assert storage.read_bytes(obj) == b"payload"
        storage.write_bytes(obj, b"after")  # a write made while it was down is whole once it is back
    assert storage.read_bytes(obj) == b"after"
    assert not through_proxy.is_down()


def test_an_outage_past_the_window_is_one_line_naming_endpoint_and_object(obj, through_proxy):
    through_proxy.down()
    with faults.retry_window_of(1.2), pytest.raises(StorageError) as err:
        storage.read_bytes(obj)
    msg = str(err.value)
    assert msg.startswith(f"cannot reach endpoint {through_proxy.endpoint} for {obj} (NETWORK_CONNECTION)"), msg
    assert re.search(r"; retried for \d+ s \(run.storage_retry_s\); is it running", msg) and "\n" not in msg, msg


def test_server_errors_are_retried_and_denied_access_without_a_window_is_not(obj, through_proxy):
    through_proxy.refuse(status=503, count=5)  # more than the S3 client's own three tries
    with faults.retry_window_of(60):
        assert storage.read_bytes(obj) == b"payload"
    assert through_proxy.count() > 5  # the five 503s, then the answers

    through_proxy.clear()
    through_proxy.reset_log()
    through_proxy.deny()
    with faults.retry_window_of(0), pytest.raises(StorageError) as err:
        storage.exists(obj)  # a command's up-front checks: at once, one request, the fix named
    assert str(err.value).startswith(f"access to {obj} was denied (ACCESS_DENIED); give credentials"), err.value
    assert through_proxy.count() == 1


def test_a_403_is_waited_out_within_the_window_and_past_it_says_so(obj, through_proxy):
    """A store whose auth is away answers 403 to good credentials for a while: within run.storage_retry_s that is
    ridden out as an outage is; a 403 that outlasts it ends in one line saying it was waited out and may be the
    credentials."""
    through_proxy.deny(seconds=2)
    with faults.retry_window_of(60):
        assert storage.read_bytes(obj) == b"payload"
    through_proxy.clear()
    through_proxy.deny()
    with faults.retry_window_of(2), pytest.raises(StorageError) as err:
        storage.exists(obj)
    msg = str(err.value)
    assert re.match(rf"access to {re.escape(obj)} was denied \(ACCESS_DENIED\): endpoint "
                    rf"{re.escape(through_proxy.endpoint)} answered 403 for \d+ s \(run.storage_retry_s\), waited "
                    rf"out in case the store was away; it may be the credentials: give credentials", msg), msg
    waited = re.search(r"answered 403 for (\d+) s", msg)
    assert int(waited.group(1)) >= 2, msg  # the whole window (2 s) waited out; a loaded machine only adds to it
    assert "\n" not in msg


def test_the_retry_line_names_the_whole_window(obj, through_proxy):
    """With whole backoff steps (0.5, 1, 2 s ...) a 3 s window gave up after 1.5 s and said "retried for 2 s" (a
    15 s window: 7.5 s or 10 s); the last wait is cut to the window's end, so the store gets all of it."""
    through_proxy.down()
    with faults.retry_window_of(3), pytest.raises(StorageError) as err:
        storage.read_bytes(obj)
    waited = re.search(r"; retried for (\d+) s \(run.storage_retry_s\)", str(err.value))
    assert waited and int(waited.group(1)) >= 3, err.value  # from the first failure to the last try's end


def test_a_stall_is_named_as_a_stall_with_its_timeout(obj, through_proxy):
    """The STOP request probe of the issue: a stalled endpoint was reported as unreachable."""
    through_proxy.stall()
    with faults.retry_window_of(0), pytest.raises(StorageError) as err:
        storage.exists(obj)
    msg = str(err.value)
    assert msg.startswith(f"endpoint {through_proxy.endpoint} stalled on {obj} (no byte for 3 s, the S3 client's "
                          f"stall timeout"), msg
    assert "cannot reach" not in msg


def test_deleting_what_is_gone_is_not_an_error(s3_bucket, through_proxy):
    base = f"{s3_bucket}/faults/delete"
    for i in range(3):
        storage.write_bytes(f"{base}/build-1/sub/f{i}", b"x")
    for i in range(3):  # objects removed one by one: SeaweedFS still lists an empty folder entry ...
        storage.delete(f"{base}/build-1/sub/f{i}")
    assert [f.type.name for f in storage.listdir(base)] == ["Directory"]
    storage.delete(f"{base}/build-1")  # ... which is deleted, and then it is gone
    storage.delete(f"{base}/build-1")
    storage.delete(f"{base}/never-there")
    storage.delete(f"{base}/never-there.txt")
    assert storage.listdir(base) == []


def test_two_deletes_of_one_prefix_at_once_both_succeed(s3_bucket, through_proxy):
    """Cleanup racing cleanup (two prepares, or a listing that still shows what another delete removed): the loser
    finds nothing left, which is what it wanted."""
    base = f"{s3_bucket}/faults/race"
    for i in range(40):
        storage.write_bytes(f"{base}/build-2/part-{i}", b"x")
    errors = []

    def remove() -> None:
        try:
            storage.delete(f"{base}/build-2")
        except Exception as exc:  # noqa: BLE001 -- collected and asserted on below
            errors.append(exc)

    threads = [threading.Thread(target=remove) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and not storage.exists(f"{base}/build-2")


def test_rays_storage_calls_ride_out_an_outage_through_the_retrying_filesystem(s3_bucket, through_proxy):
    """What Ray Train and Tune do with their storage_filesystem (a snapshot written, a storage check at a worker's
    start, a file read back): through pipeline/storage_faults.py's retrying filesystem they wait for the store."""
    import pickle

    args = storage.ray_storage_args(f"{s3_bucket}/faults/ray", retry_s=60)
    fs = pickle.loads(pickle.dumps(args["storage_filesystem"]))  # as Ray ships it to its controller and workers
    path = f"{args['storage_path']}/checkpoint_manager_snapshot.json"
    through_proxy.down(2)
    with fs.open_output_stream(path) as out:
        out.write(b'{"checkpoints": []}')
    assert fs.open_input_stream(path).read() == b'{"checkpoints": []}'
    through_proxy.down()
    fast = storage.ray_storage_args(f"{s3_bucket}/faults/ray", retry_s=0.6)["storage_filesystem"]
    with pytest.raises(OSError, match="NETWORK_CONNECTION"):
        fast.get_file_info(path)


def test_a_restarted_worker_waits_for_the_store_and_for_a_403(obj, through_proxy, capfd):
    """pipeline/train/checkpoints/ray_upload.py wait_for_storage, what a Ray Train worker does first: it returns once the
    store answers again, saying once that it waits, for an outage and for a 403 alike (a restart inside a 403 window
    waits instead of spending the next attempt); a 403 past the window is one line that says it was waited out."""
    from pipeline.train.checkpoints.ray_upload import wait_for_storage

    run_store = obj.rsplit("/", 1)[0]
    through_proxy.down(5)  # longer than the S3 client's own retries, so the first listing fails
    wait_for_storage(run_store, 60, rank=0)
    assert capfd.readouterr().out.startswith(f"storage: {run_store} does not answer (unreachable); waiting up to "
                                             f"60 s (run.storage_retry_s) before resuming")
    through_proxy.deny(seconds=3)
    wait_for_storage(run_store, 60, rank=0)
    assert capfd.readouterr().out.startswith(f"storage: {run_store} answers 403 access denied (a store's auth away, "
                                             f"or the credentials); waiting up to 60 s (run.storage_retry_s)")
    through_proxy.clear()
    through_proxy.deny()
    with pytest.raises(StorageError) as err:
        wait_for_storage(run_store, 2, rank=0)
    waited = re.match(rf"access to run.storage {re.escape(run_store)} was denied \(ACCESS_DENIED\): .* answered 403 "
                      rf"for (\d+) s \(run.storage_retry_s\).* it may be the credentials", str(err.value))
    assert waited and int(waited.group(1)) >= 2, err.value  # the whole window; a loaded machine only adds to it


def test_the_progress_record_is_written_in_the_background_newest_only(s3_bucket, through_proxy):
    """Rank 0's <run>/progress.json at every log step (pipeline/train/distributed/elastic.py ResumeReport): a log step does not
    wait for the store (with +50 ms per request the synchronous 3-request upload cost 2.6x the training time), and a
    slow store gets the newest record, not a backlog of stale ones. The store holds the record's uploads (a stall,
    no answer until cleared) while every log step after the first returns: a step that waited for it would never
    return, and the thread it runs in says so instead of hanging the test."""
    import json
    import time
    from types import SimpleNamespace

    from pipeline.train.distributed.elastic import ResumeReport

    run_store = f"{s3_bucket}/faults/progress"
    held = through_proxy.stall(r" \S*/progress\.json")
    report = ResumeReport(run_store, phase=0)
    outs = []

    def log_steps(steps) -> None:
        for step in steps:
            outs.append(report.logged(SimpleNamespace(step=step, world_size=1), {"train/loss": 1.0}))

    def returns(steps) -> bool:
        thread = threading.Thread(target=log_steps, args=(steps,), daemon=True)
        thread.start()
        thread.join(120)  # a bound on a hang only: each call returns at once
        return not thread.is_alive()

    assert returns([2]), "a log step waited for the store"
    deadline = time.monotonic() + 120
    while not held.hits:  # step 2's record on its way: the store holds it
        assert time.monotonic() < deadline, "the progress record was never uploaded"
        time.sleep(0.05)
    assert returns(range(4, 22, 2)), "a log step waited for the store, which held the upload of step 2's record"
    assert len(outs) == 10 and all(o["train/loss"] == 1.0 and o["train/world_size"] == 1.0 for o in outs)
    through_proxy.clear()  # the store answers again
    report.flush(60)
    record = json.loads(storage.read_text(f"{run_store}/progress.json"))
    assert record["step"] == 20 and record["world_size"] == 1 and record["phase"] == 0
    # the uploads the store let through: step 2's (retried on a new connection, if the client still tried), then
    # the newest; never the eight records in between
    uploads = [r for r in through_proxy.requests(r"^(POST \S*/progress\.json\?uploads|PUT \S*/progress\.json )")
               if not r.fault]
    assert 1 <= len(uploads) <= 2, through_proxy.requests("progress")
