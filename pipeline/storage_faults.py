"""What a failed object-storage call was, and riding out the passing ones: an outage, a stalled connection, a 5xx
answer, and a 403 (a store's auth service away answers that to good credentials), are retried with capped exponential
backoff for a window of time (`run.storage_retry_s`, 300 s by default on the training path); a missing bucket or a
missing object are not (waiting changes nothing). A 403 that outlasts the window ends in one line that says it was
waited out and may be the credentials.

    from pipeline import storage_faults as faults
    faults.set_retry_window(300)                     # this process, from now on (a training driver or worker)
    faults.call(lambda: fs.get_file_info(path))      # retried while the error is transient, for the window
    with faults.retry_window_of(0):                  # this thread, for a block: fail at the first error
        ...                                          # (the up-front checks, the stop-request probe)
    faults.kind(exc)                                 # "unreachable" | "stalled" | "server" | "denied" | ...

The window is 0 unless a process sets it: a command's up-front checks (pipeline/storage.py `check`) and commands
such as `validate` fail at once with one line; `train` sets it after those checks (pipeline/train/session/train_session.py), and
hands it to its Ray Train workers and Ray Data read tasks in their arguments (a window is a setting, so it travels;
credentials never do). This module imports nothing of the project: pipeline/storage.py uses it to explain and
retry, and pipeline/train/ray_train.py's storage filesystem for Ray Train (RetryingFileSystem there) too.
"""
from __future__ import annotations

import contextlib
import errno
import re
import threading
import time
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")

DEFAULT_RETRY_S = 300.0  # run.storage_retry_s's default
BACKOFF_FIRST_S = 0.5  # the first wait after a transient failure; doubled each time ...
BACKOFF_MAX_S = 10.0  # ... up to this, so a store that comes back is used within ~10 s

# Substrings of the AWS SDK's (pyarrow's) and botocore's messages, by kind.
# A stall: connected, then nothing (curl's low-speed limit, botocore's read timeout); a connect timeout is unreachable.
_STALLED = ("Operation too slow", "transferred the last", "Read timed out", "ReadTimeoutError")
_UNREACHABLE = ("NETWORK_CONNECTION", "curlCode", "Could not resolve host", "Connection refused", "Failed to connect",
                "Couldn't connect", "Could not connect", "EndpointConnectionError", "Connection reset",
                "ConnectionResetError", "Connection aborted", "RemoteDisconnected", "Broken pipe",
                "ConnectionClosedError", "Max retries exceeded", "Connection was closed",
                "Could not connect to the endpoint URL", "timed out", "Timeout was reached", "ConnectTimeoutError")
_SERVER = ("HTTP status 500", "HTTP status 502", "HTTP status 503", "HTTP status 504", "SLOW_DOWN", "SlowDown",
           "INTERNAL_FAILURE", "InternalError", "ServiceUnavailable", "SERVICE_UNAVAILABLE", "503 Server Error",
           "500 Server Error", "502 Server Error", "504 Server Error", "too many 500 error responses",
           "too many 503 error responses")
_NO_BUCKET = ("NO_SUCH_BUCKET", "NoSuchBucket", "bucket does not exist")
_DENIED = ("ACCESS_DENIED", "AccessDenied", "INVALID_ACCESS_KEY_ID", "InvalidAccessKeyId",
           "SIGNATURE_DOES_NOT_MATCH", "SignatureDoesNotMatch", "EXPIRED_TOKEN", "ExpiredToken", "Forbidden",
           "HTTP 403", "HTTP status 403", "Permission denied", "PermissionDenied", "Unable to find credentials",
           "No credentials", "NoCredentialsError", "(403)")
# A full disk or a quota: never waited for (a store that refuses for quota may answer 403 or 5xx with these words).
FULL = re.compile(r"No space left on device|os error 28\b|Disk quota exceeded|database or disk is full|"
                  r"QuotaExceeded|XMinioStorageFull|InsufficientStorage|quota exceeded", re.IGNORECASE)
TRANSIENT = ("unreachable", "stalled", "server")

_window_s = 0.0
_local = threading.local()


# ------------------------------------------------------------------------------------------ classifying
def kind(exc: BaseException | str) -> str:
    """"full" (no space or quota left), "denied", "no_bucket", "stalled", "unreachable", "server" (a 5xx answer) or ""
    (anything else: a missing object, a bad request, corrupt data, a bug) for an error a storage client raised, from
    its message."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "full"
    if isinstance(exc, PermissionError):
        return "denied"
    if isinstance(exc, (ConnectionError, TimeoutError)) and not isinstance(exc, PermissionError):
        return "stalled" if isinstance(exc, TimeoutError) else "unreachable"
    msg = str(exc) if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    if FULL.search(msg):
        return "full"
    for name, marks in (("denied", _DENIED), ("no_bucket", _NO_BUCKET), ("stalled", _STALLED),
                        ("unreachable", _UNREACHABLE), ("server", _SERVER)):
        if any(m in msg for m in marks):
            return name
    return ""


def may_pass(exc: BaseException) -> bool:
    """Worth waiting for, by kind: the endpoint did not answer, stalled, or answered with a server error, or the
    store denied access. A 403 is waited out too: a store whose auth service (or the node's credential source) is
    away answers 403 to good credentials for a while, and a run that gives up at once spends its restarts inside
    that while; one that persists past the window still ends in one line that says it may be the credentials. A
    local PermissionError (a file's own permissions) does not pass by waiting."""
    found = kind(exc)
    return found in TRANSIENT or (found == "denied" and not isinstance(exc, PermissionError))


def transient(exc: BaseException) -> bool:
    """Worth waiting for (may_pass), and no retry window was spent on it already (pipeline/storage.py's
    StorageError says it was)."""
    return not getattr(exc, "no_retry", False) and may_pass(exc)


def stall_seconds(exc: BaseException | str) -> float | None:
    """The S3 client's stall timeout named in its message ("...transferred the last 3 seconds"), if any."""
    m = re.search(r"the last (\d+) seconds?", str(exc))
    return float(m.group(1)) if m else None


# ------------------------------------------------------------------------------------------ the window
def set_retry_window(seconds: float) -> float:
    """How long this process retries transient storage failures (0 = not at all); returns the previous window."""
    global _window_s
    before, _window_s = _window_s, max(0.0, float(seconds))
    return before


def retry_window() -> float:
    """This thread's window: a retry_window_of block's, else the process's."""
    override = getattr(_local, "window_s", None)
    return _window_s if override is None else override


@contextlib.contextmanager
def retry_window_of(seconds: float) -> Iterator[None]:
    """This thread retries for `seconds` inside the block (0: fail at the first error)."""
    before = getattr(_local, "window_s", None)
    _local.window_s = max(0.0, float(seconds))
    try:
        yield
    finally:
        _local.window_s = before


def backoff(attempt: int) -> float:
    """Seconds to wait before retry number `attempt` (1, 2, ...): 0.5, 1, 2, 4, 8, 10, 10, ..."""
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (attempt - 1))


def call(fn: Callable[[], T], *, window_s: float | None = None, retry_if: Callable[[BaseException], bool] = transient,
         on_retry: Callable[[BaseException, int, float], None] | None = None) -> T:
    """fn(), called again after a failure `retry_if` accepts (transient ones), with capped exponential backoff,
    until it succeeds or `window_s` (default: this thread's window) has passed since the first failure. The last
    error is raised as it was, with `retried` = (attempts, seconds spent) set on it when there was more than one
    attempt, so the message can say how long the store was waited for. `on_retry(error, attempt, delay)` is
    called before each wait."""
    window = retry_window() if window_s is None else window_s
    started, attempt = None, 0
    while True:
        try:
            return fn()
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)) or not retry_if(exc):
                raise
            now = time.monotonic()
            started = now if started is None else started
            attempt += 1
            # The last wait is cut to what is left of the window, so the last try comes at its end: the store is
            # given the whole window, and "retried for N s" names it (with whole backoff steps a 15 s window gave
            # up after 7.5 s or 10 s).
            left = window - (now - started)
            if left <= 0 or window <= 0:
                if attempt > 1:
                    with contextlib.suppress(AttributeError, TypeError):
                        exc.retried = (attempt, now - started)
                raise
            delay = min(backoff(attempt), left)
            if on_retry is not None:
                on_retry(exc, attempt, delay)
            time.sleep(delay)


def wait_until(probe: Callable[[], object], window_s: float, *,
               on_wait: Callable[[BaseException, float], None] | None = None) -> None:
    """Call probe() (one storage call that does not retry itself: pipeline/storage.py's StorageError counts, by
    what it says) until it does not fail transiently or `window_s` has passed (then its error goes up); on_wait(error,
    0.0) is called once, at the first failure."""
    told = []

    def note(exc: BaseException, attempt: int, delay: float) -> None:
        if not told and on_wait is not None:
            on_wait(exc, 0.0)
            told.append(True)

    call(probe, window_s=window_s, on_retry=note, retry_if=may_pass)


# ------------------------------------------------------------------------------------------ a filesystem for Ray
def retrying_filesystem(fs, window_s: float):
    """`fs` (a pyarrow filesystem) whose every call rides out transient failures for `window_s`, for the storage
    Ray Train and Tune use themselves: the controller's checkpoint-manager snapshot, each worker's storage check at
    start (so a restarted worker group waits for the store instead of failing at once and spending an attempt),
    restores, deletions of old checkpoints. Picklable (Ray ships it to its workers): a pyarrow PyFileSystem over
    RetryingHandler."""
    import pyarrow.fs as pafs

    return pafs.PyFileSystem(RetryingHandler(fs, window_s))


def _handler_base():
    import pyarrow.fs as pafs

    return pafs.FileSystemHandler


class RetryingHandler(_handler_base()):
    """pyarrow FileSystemHandler delegating to `fs`, each call through `call` with `window_s`. A written object is
    buffered (memory, then a temporary file past 64 MiB) and uploaded whole when closed, so a failed upload is
    retried from the start: readers see all of it or nothing, as with one PUT."""

    def __init__(self, fs, window_s: float):
        self.fs, self.window_s = fs, float(window_s)

    def __eq__(self, other) -> bool:
        return isinstance(other, RetryingHandler) and self.fs.equals(other.fs) and self.window_s == other.window_s

    def __ne__(self, other) -> bool:
        return not self == other

    def _call(self, fn):
        return call(fn, window_s=self.window_s)

    def get_type_name(self) -> str:
        return f"retrying-{self.fs.type_name}"

    def normalize_path(self, path):
        return self.fs.normalize_path(path)

    def get_file_info(self, paths):
        return self._call(lambda: self.fs.get_file_info(paths))

    def get_file_info_selector(self, selector):
        return self._call(lambda: self.fs.get_file_info(selector))

    def create_dir(self, path, recursive):
        return self._call(lambda: self.fs.create_dir(path, recursive=recursive))

    def delete_dir(self, path):
        return self._call(lambda: self.fs.delete_dir(path))

    def delete_dir_contents(self, path, missing_dir_ok=False):
        return self._call(lambda: self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok))

    def delete_root_dir_contents(self):
        return self._call(lambda: self.fs.delete_dir_contents("/", accept_root_dir=True))

    def delete_file(self, path):
        return self._call(lambda: self.fs.delete_file(path))

    def move(self, src, dest):
        return self._call(lambda: self.fs.move(src, dest))

    def copy_file(self, src, dest):
        return self._call(lambda: self.fs.copy_file(src, dest))

    def open_input_stream(self, path):
        return self._call(lambda: self.fs.open_input_stream(path))

    def open_input_file(self, path):
        return self._call(lambda: self.fs.open_input_file(path))

    def open_output_stream(self, path, metadata):
        import pyarrow as pa

        return pa.PythonFile(_BufferedUpload(self, path, metadata), mode="w")

    def open_append_stream(self, path, metadata):
        return self._call(lambda: self.fs.open_append_stream(path, metadata=metadata))


class _BufferedUpload:
    """The file object RetryingHandler.open_output_stream hands out: written into a spooled buffer, uploaded in
    one piece (retried) at close."""

    def __init__(self, handler: RetryingHandler, path: str, metadata):
        import tempfile

        self.handler, self.path, self.metadata = handler, path, metadata
        self.buffer = tempfile.SpooledTemporaryFile(max_size=64 << 20)
        self.closed = False

    def write(self, data) -> int:
        return self.buffer.write(data)

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.buffer.tell()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True

        def upload() -> None:
            self.buffer.seek(0)
            with self.handler.fs.open_output_stream(self.path, metadata=self.metadata) as out:
                for chunk in iter(lambda: self.buffer.read(8 << 20), b""):
                    out.write(chunk)

        try:
            self.handler._call(upload)
        finally:
            self.buffer.close()
