"""Object storage that misbehaves, at the storage layer: the session's SeaweedFS behind the fault proxy
(tests/conftest.py `through_proxy`, bench/fault_proxy.py), in this process. An outage and 5xx answers are ridden out
within the retry window and end in one line naming the endpoint and the object after it; a stall is named as a stall
with its timeout; refused credentials are not retried; deleting what is gone is no error; Ray's own storage calls
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


def test_server_errors_are_retried_and_denied_access_is_not(obj, through_proxy):
    through_proxy.refuse(status=503, count=5)  # more than the S3 client's own three tries
    with faults.retry_window_of(60):
        assert storage.read_bytes(obj) == b"payload"
    assert through_proxy.count() > 5  # the five 503s, then the answers

    through_proxy.clear()
    through_proxy.reset_log()
    through_proxy.deny()
    with faults.retry_window_of(60), pytest.raises(StorageError) as err:
        storage.exists(obj)  # waiting would not help: at once, one request
    assert str(err.value).startswith(f"access to {obj} was denied (ACCESS_DENIED)"), err.value
    assert through_proxy.count() == 1


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


def test_a_restarted_worker_waits_for_the_store_and_not_for_refused_credentials(obj, through_proxy, capfd):
    """pipeline/train/ray_checkpoints.py wait_for_storage, what a Ray Train worker does first: it returns once the
    store answers again, saying once that it waits; denied access ends it at once."""
    from pipeline.train.ray_checkpoints import wait_for_storage

    run_store = obj.rsplit("/", 1)[0]
    through_proxy.down(5)  # longer than the S3 client's own retries, so the first listing fails
    wait_for_storage(run_store, 60, rank=0)
    assert capfd.readouterr().out.startswith(f"storage: {run_store} does not answer (unreachable); waiting up to "
                                             f"60 s (run.storage_retry_s) before resuming")
    through_proxy.reset_log()
    through_proxy.deny()
    with pytest.raises(StorageError, match="was denied"):
        wait_for_storage(run_store, 60, rank=0)
    assert through_proxy.count() == 1  # one listing, not retried
