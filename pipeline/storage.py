"""Where data and results live: a local path or a URI (s3://, gs://, hdfs://, file://, or any fsspec protocol),
opened through pyarrow filesystems, the way Ray Data's readers and Ray Train's storage open them.

    from pipeline import storage
    storage.read_bytes("s3://bucket/longtrain/datasets/ab12cd34/manifest.json")
    storage.join(storage.storage_root(cfg), "datasets")       # s3://bucket/longtrain/datasets, or /abs/runs/datasets
    storage.check("s3://bucket/longtrain", what="run.storage", write=True)   # one line when it cannot be used

Filesystems: pyarrow's own for s3:// (S3FileSystem), gs:// (GcsFileSystem), hdfs:// and file://, and fsspec
for any other protocol it knows (wrapped in pyarrow's PyFileSystem). Credentials come from where the AWS and
Google SDKs look, never from the config: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN),
AWS_PROFILE and ~/.aws, or the node's instance role; GOOGLE_APPLICATION_CREDENTIALS or the metadata server.
An S3-compatible store (MinIO, SeaweedFS, Cloudflare R2, GCS's S3 API) is named by the AWS SDKs' own endpoint
setting, AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (e.g. http://minio:9000), or the profile's `endpoint_url` in
~/.aws/config, all of which boto3 (MLflow's artifacts) reads too. Every process resolves its own filesystem from
its own environment: only locations travel between processes, never credentials.

A bare path names this machine's disk; a URI names storage that every node of a cluster can open (a shared
filesystem mounted at the same path everywhere is file:///that/path). So a Ray worker on another node is never
handed a bare path (pipeline/ray_runtime.py `require_shared` refuses that before any worker starts). This
module needs only pyarrow (fsspec for other protocols): the Ray-free engine reads URIs too.

Every storage failure becomes a StorageError, one line naming the endpoint, the object and the fix (endpoint
unreachable, stalled, bucket missing, access denied, ...). One that may pass (the endpoint refuses connections, stalls,
answers 5xx or 403) is first retried with capped exponential backoff for the process's retry window
(pipeline/storage_faults.py: 0 unless set; `train` sets run.storage_retry_s after its up-front checks, which always
fail at once). Deleting what is already gone is not an error.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import pyarrow.fs as pafs

from pipeline import storage_faults as faults

if TYPE_CHECKING:
    from pipeline.config import Config

STORAGE_ENV = "LONGTRAIN_STORAGE"  # the bucket (or directory) of run.storage when the config leaves it empty
ENDPOINT_ENVS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")  # the AWS SDKs' endpoint settings, most specific first
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]+)://")
_CREDENTIAL_ENVS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")
_PYARROW_SCHEMES = ("s3", "gs", "gcs", "hdfs", "viewfs", "file")
CONNECT_TIMEOUT_S = 5.0  # an endpoint that does not answer fails in seconds, not after minutes of retries


class StorageError(RuntimeError):
    """A location cannot be used (unreachable endpoint, missing bucket, denied access, ...); one line naming
    the location and the fix."""

    no_retry = True  # raised once the retry window is spent (or was 0): callers above never retry it again


# ------------------------------------------------------------------------------------------ locations
def scheme(location: str | os.PathLike) -> str:
    """The URI scheme ("s3", "gs", ...), or "" for a bare path."""
    m = _SCHEME.match(str(location))
    return m.group(1).lower() if m else ""


def is_uri(location: str | os.PathLike) -> bool:
    """True for scheme://... (file:// included); False for a bare path on this machine."""
    return bool(scheme(location))


def is_local(location: str | os.PathLike) -> bool:
    """On this machine's filesystem: a bare path or a file:// URI."""
    return scheme(location) in ("", "file")


def absolute(location: str | os.PathLike) -> str:
    """A URI unchanged (without a trailing slash); a bare path made absolute (~ expanded)."""
    text = str(location)
    if is_uri(text):
        return text.rstrip("/") if not text.endswith("://") else text
    return str(Path(text).expanduser().resolve())


def join(base: str | os.PathLike, *parts: str) -> str:
    """base/part/...: '/'-joined for a URI, os.path-joined for a bare path."""
    base = str(base)
    if is_uri(base):
        return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts if p)])
    return str(Path(base, *parts))


def basename(location: str | os.PathLike) -> str:
    return str(location).rstrip("/").rsplit("/", 1)[-1]


# ------------------------------------------------------------------------------------------ filesystems
def resolve(location: str | os.PathLike) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path inside it) for a location; filesystems are cached per process."""
    text = str(location)
    sch = scheme(text)
    if sch == "":
        return _local(), absolute(text)
    rest = text[len(sch) + 3:]
    if sch == "file":
        return _local(), "/" + rest.lstrip("/")
    if sch == "s3":
        bucket = rest.split("/", 1)[0]
        env = (endpoint(), *(os.environ.get(k, "") for k in ("AWS_REGION", "AWS_DEFAULT_REGION")))
        # A filesystem per set of credentials too (it resolves them when it is made): a changed key is used.
        creds = hashlib.sha256("\0".join(os.environ.get(k, "") for k in _CREDENTIAL_ENVS).encode()).hexdigest()
        return _s3(bucket, env, creds), rest.rstrip("/")
    try:
        if sch in ("gs", "gcs"):  # one filesystem for every bucket, paths as with S3: bucket/key
            return _from_uri(f"{sch}://{rest.split('/', 1)[0]}"), rest.rstrip("/")
        if sch in _PYARROW_SCHEMES:
            fs, path = pafs.FileSystem.from_uri(text)
            return fs, path.rstrip("/")
        return _fsspec(sch, text)
    except (OSError, ValueError, ImportError) as exc:
        raise StorageError(f"cannot open {text}: {first_line(exc)}; check the URI (s3://, gs://, hdfs://, file:// "
                           f"or an fsspec protocol whose package is installed)") from None


@functools.lru_cache(maxsize=1)
def _local() -> pafs.FileSystem:
    return pafs.LocalFileSystem()


@functools.lru_cache(maxsize=32)
def _s3(bucket: str, env: tuple[str, ...], creds: str) -> pafs.FileSystem:
    """S3FileSystem for a bucket: the endpoint of `endpoint()` (its http:// or https:// decides the scheme), the
    region of AWS_REGION / AWS_DEFAULT_REGION, else the bucket's own (AWS only), and credentials from the SDK's
    default chain (environment, profile, instance role). `env` (endpoint, the two region settings) and a hash of
    the credential settings key the cache."""
    endpoint, region = env[0], env[1] or env[2]
    # allow_delayed_open: a file opened for writing that stays under a part (~10 MB) at close goes up in one
    # PutObject instead of a multipart upload's three requests (create, part, complete): a checkpoint's meta.json,
    # a small model's files, progress.json, Ray Train's record. At +50 ms per request that was ~0.4 s of every
    # checkpoint of a small model (docs/cluster.md). A failure to open is then reported at the first write or at
    # close, with the same error.
    kw: dict = {"connect_timeout": CONNECT_TIMEOUT_S, "allow_delayed_open": True}
    if endpoint:
        kw["endpoint_override"] = endpoint
        kw["region"] = region or "us-east-1"  # S3-compatible stores accept any region; the SDK needs one
    elif region:
        kw["region"] = region
    else:
        with contextlib.suppress(OSError):  # an anonymous HEAD on AWS; a missing bucket is reported by check()
            kw["region"] = pafs.resolve_s3_region(bucket)
    return pafs.S3FileSystem(**kw)


@functools.lru_cache(maxsize=32)
def _from_uri(uri: str) -> pafs.FileSystem:
    return pafs.FileSystem.from_uri(uri)[0]


def _fsspec(sch: str, text: str) -> tuple[pafs.FileSystem, str]:
    import fsspec.core

    fs, path = fsspec.core.url_to_fs(text)
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path.rstrip("/")


def endpoint() -> str:
    """The S3 endpoint this process uses ("" = AWS's own), looked up as the AWS SDKs do: AWS_ENDPOINT_URL_S3,
    AWS_ENDPOINT_URL, then the profile's `endpoint_url` in ~/.aws/config (its `services` section's s3 entry
    first), unless AWS_IGNORE_CONFIGURED_ENDPOINT_URLS is true."""
    from_env = next((os.environ[k] for k in ENDPOINT_ENVS if os.environ.get(k)), "")
    if from_env:
        return from_env
    keys = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_CONFIG_FILE", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS")
    config = os.path.expanduser(os.environ.get("AWS_CONFIG_FILE") or "~/.aws/config")
    with contextlib.suppress(OSError):
        return _configured_endpoint(tuple(os.environ.get(k, "") for k in keys), os.stat(config).st_mtime_ns)
    return ""


@functools.lru_cache(maxsize=8)
def _configured_endpoint(env: tuple[str, ...], mtime: int) -> str:
    """The endpoint_url that ~/.aws/config gives S3 for the profile ("" if none); `env` and the file's mtime key
    the cache. A profile that does not exist gives "": the credentials lookup reports it."""
    try:
        import botocore.exceptions
        import botocore.session
        from botocore.configprovider import ConfiguredEndpointProvider
    except ImportError:  # boto3 is a dependency; without it only the environment variables count
        return ""
    try:
        session = botocore.session.Session()
        if str(session.get_config_variable("ignore_configured_endpoint_urls")).lower() == "true":
            return ""
        found = ConfiguredEndpointProvider(full_config=session.full_config, scoped_config=session.get_scoped_config(),
                                           client_name="s3").provide()
    except botocore.exceptions.BotoCoreError:
        return ""
    return found or ""


def location_of(fs: pafs.FileSystem, path: str, like: str) -> str:
    """The location (URI or bare path) of `path` inside `fs`, for a filesystem resolved from `like`."""
    sch = scheme(like)
    if sch in ("", "file") or isinstance(fs, pafs.LocalFileSystem):
        return path
    return f"{sch}://{path.lstrip('/')}"


def ray_storage_args(location: str, retry_s: float = 0.0) -> dict:
    """storage_path and storage_filesystem for a Ray Train or Tune RunConfig: Ray opens `location` with the same
    filesystem as everything here (endpoint, region), not one it builds from the URI itself; with `retry_s`, one that
    rides out transient failures that long (pipeline/storage_faults.py retrying_filesystem)."""
    fs, path = resolve(location)
    if is_local(location):
        return {"storage_path": path, "storage_filesystem": None}
    return {"storage_path": path, "storage_filesystem": faults.retrying_filesystem(fs, retry_s) if retry_s else fs}


# ------------------------------------------------------------------------------------------ errors
def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def explain(exc: BaseException, location: str, what: str = "") -> StorageError:
    """A StorageError naming the endpoint, the object, what went wrong and the fix, for an error a storage call
    raised (after its retries, when it was retried: `retried` on the error says how long)."""
    msg = str(exc)
    code = re.search(r"AWS Error ([A-Z_]+)", msg)
    detail = code.group(1) if code else first_line(exc)[:160]
    named = f"{what} {location}" if what else location
    sch = scheme(location)
    where = f"endpoint {endpoint()}" if sch == "s3" and endpoint() else "the object store"
    retried = getattr(exc, "retried", None)
    waited = f"; retried for {retried[1]:.0f} s (run.storage_retry_s)" if retried else ""
    found = faults.kind(exc)
    if found == "full":  # the writers that know what they write say more (pipeline/disk_space.py one_line_when_full)
        return StorageError(f"no room for {named} ({detail}); free space there or point the setting that names it at "
                            f"a larger disk")
    if found == "stalled":
        limit = faults.stall_seconds(exc)
        timeout = (f"no byte for {limit:g} s, the S3 client's stall timeout" if limit is not None
                   else "the client's request timeout")
        return StorageError(f"{where} stalled on {named} ({timeout}; {detail}){waited}: the connection was open but "
                            f"nothing came back; check the object store's health and load")
    if found in ("unreachable", "server"):
        fix = ("set AWS_ENDPOINT_URL (or endpoint_url in ~/.aws/config) to the S3-compatible server's URL "
               "(http://host:port)" if sch == "s3" else "check the network")
        if found == "server":
            return StorageError(f"{where} failed on {named} with a server error ({detail}){waited}; check the "
                                f"object store's health, its free space and the bucket's quota (SeaweedFS, for one, "
                                f"refuses writes over quota with a bare 500)")
        return StorageError(f"cannot reach {where} for {named} ({detail}){waited}; is it running and reachable from "
                            f"this machine? {fix}")
    if found == "no_bucket":
        return StorageError(f"the bucket of {named} does not exist ({detail}); create it (e.g. `aws s3 mb "
                            f"{sch}://{bucket_of(location)}`) or fix the URI")
    if found == "denied":
        creds = ("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or the node's instance role" if sch == "s3"
                 else "GOOGLE_APPLICATION_CREDENTIALS or the node's service account" if sch in ("gs", "gcs")
                 else "the permissions of the path")
        if retried:  # waited out as a possible outage (pipeline/storage_faults.py may_pass), and it persisted
            return StorageError(f"access to {named} was denied ({detail}): {where} answered 403 for "
                                f"{retried[1]:.0f} s (run.storage_retry_s), waited out in case the store was away; "
                                f"it may be the credentials: give credentials that may read and write it: {creds}")
        return StorageError(f"access to {named} was denied ({detail}); give credentials that may read and write it: "
                            f"{creds}")
    return StorageError(f"cannot use {named}: {first_line(exc)}")


def storage_error_in(exc: BaseException | None) -> StorageError | None:
    """The StorageError that `exc` is or carries (its __cause__ / __context__ chain, Ray's `cause`), else None. One
    raised in another process reaches here without its chain (an exception is pickled without __cause__): a Ray
    Data read task's arrives as RayTaskError(UserCodeException) whose text holds the task's traceback, so the last
    "StorageError: ..." line of the text is taken then."""
    stack, seen, texts = [exc], set(), []
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, StorageError):
            return e
        texts.append(str(e))
        stack += [e.__cause__, e.__context__, getattr(e, "cause", None)]
    for text in texts:
        lines = re.findall(r"\bStorageError: ([^\n]+)", text)
        if lines:
            return StorageError(lines[-1].strip())
    return None


def bucket_of(location: str) -> str:
    return str(location)[len(scheme(location)) + 3:].split("/", 1)[0] if is_uri(location) else ""


@contextlib.contextmanager
def explained(location: str, what: str = "") -> Iterator[None]:
    """Turn any OSError other than a missing file into a StorageError (FileNotFoundError passes: callers say
    what a missing file means)."""
    try:
        yield
    except FileNotFoundError:
        raise
    except StorageError:
        raise
    except (OSError, ValueError) as exc:
        if isinstance(exc, ValueError) and "AWS Error" not in str(exc):
            raise
        raise explain(exc, location, what) from None


def _io(location: str, fn, what: str = ""):
    """fn() (a call on the filesystem of `location`), retried while it fails transiently within this thread's
    retry window (pipeline/storage_faults.py), then explained like `explained` does."""
    with explained(location, what):
        return faults.call(fn)


def check_bucket(location: str, *, what: str) -> None:
    """On S3, StorageError when the location's bucket is missing, denied or unreachable (a missing bucket
    otherwise reads as "no such file"); nothing for other storage."""
    if scheme(location) != "s3":
        return
    fs, _ = resolve(location)
    with explained(location, what):  # no retries: this is the up-front check, one line at once
        missing = fs.get_file_info(bucket_of(location)).type == pafs.FileType.NotFound
    if missing:
        raise StorageError(f"the bucket of {what} {location} does not exist; create it (e.g. `aws s3 mb "
                           f"s3://{bucket_of(location)}`) or fix the URI")


def check(location: str, *, what: str, write: bool = False) -> None:
    """Fail fast, with one line, when `location` cannot be used: the endpoint, the bucket, the credentials
    (a read of it, and with write=True a probe object written and deleted). A missing prefix is fine."""
    check_bucket(location, what=what)
    fs, path = resolve(location)
    with explained(location, what):
        kind = fs.get_file_info(path).type
        if kind == pafs.FileType.File:
            raise StorageError(f"{what} {location} is a file; it must name a directory or prefix")
        if write:
            probe = f"{path}/.write-probe-{uuid.uuid4().hex[:12]}"
            if isinstance(fs, pafs.LocalFileSystem):
                fs.create_dir(path, recursive=True)
            with fs.open_output_stream(probe, compression=None) as out:
                out.write(b"")
            with contextlib.suppress(FileNotFoundError):
                fs.delete_file(probe)


# ------------------------------------------------------------------------------------------ operations
def info(location: str) -> pafs.FileInfo:
    fs, path = resolve(location)
    return _io(location, lambda: fs.get_file_info(path))


def exists(location: str) -> bool:
    return info(location).type != pafs.FileType.NotFound


def is_file(location: str) -> bool:
    return info(location).type == pafs.FileType.File


def read_bytes(location: str | os.PathLike) -> bytes:
    """The whole object; FileNotFoundError when there is none."""
    location = str(location)
    fs, path = resolve(location)

    def read() -> bytes:
        with fs.open_input_stream(path, compression=None) as f:  # the object's bytes (pyarrow would gunzip a .gz)
            return f.read()

    return _io(location, read)


def read_text(location: str | os.PathLike) -> str:
    return read_bytes(location).decode("utf-8")


def write_bytes(location: str | os.PathLike, data: bytes) -> None:
    """Write a whole object, atomically for readers: on object storage one PUT (readers see all of it or the
    previous version); on a local disk a temp file renamed over the name."""
    location = str(location)
    fs, path = resolve(location)
    if not isinstance(fs, pafs.LocalFileSystem):
        def put() -> None:
            with fs.open_output_stream(path, compression=None) as out:  # as given (pyarrow would gzip a .gz)
                out.write(data)

        _io(location, put)  # a retry writes the whole object again: readers never see part of it
        return
    with explained(location):
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}")
        with _removed_on_failure(tmp):  # a full disk leaves no partial temp file behind
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)


@contextlib.contextmanager
def _removed_on_failure(tmp: Path) -> Iterator[None]:
    """The block writes `tmp`; when it fails, `tmp` is removed (on a full disk a partial temp file keeps the space)."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def upload_file(local: str | os.PathLike, location: str) -> None:
    """Copy a local file to `location` in one piece, streamed (no whole-file read into memory): on object storage
    the object appears only when all of it is written, and a failed try is retried whole (within the retry
    window); on a local disk a temp file renamed over the name."""
    local = Path(local)
    fs, path = resolve(location)
    if isinstance(fs, pafs.LocalFileSystem):
        with explained(location):
            target = Path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}")
            with _removed_on_failure(tmp):
                shutil.copyfile(local, tmp)
                os.replace(tmp, target)
        return

    def put() -> None:
        with open(local, "rb") as src, fs.open_output_stream(path, compression=None) as out:
            for chunk in iter(lambda: src.read(8 << 20), b""):
                out.write(chunk)

    _io(location, put)


def write_text(location: str | os.PathLike, text: str) -> None:
    write_bytes(location, text.encode("utf-8"))


def open_input(location: str):
    """A random-access pyarrow NativeFile (ranged reads on object storage)."""
    fs, path = resolve(location)
    return _io(location, lambda: fs.open_input_file(path))


def open_output(location: str):
    """A pyarrow output stream; on object storage the object appears when it is closed."""
    fs, path = resolve(location)
    with explained(location):
        if isinstance(fs, pafs.LocalFileSystem):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        return fs.open_output_stream(path, compression=None)


def makedirs(location: str) -> None:
    """A directory on a local disk; nothing on object storage (prefixes need no creating)."""
    if is_local(location):
        fs, path = resolve(location)
        fs.create_dir(path, recursive=True)


def listdir(location: str, recursive: bool = False) -> list[pafs.FileInfo]:
    """Entries under a directory or prefix ([] when there is none); FileInfo.path is inside the filesystem."""
    fs, path = resolve(location)
    return _io(location, lambda: fs.get_file_info(pafs.FileSelector(path, recursive=recursive, allow_not_found=True)))


def delete(location: str) -> None:
    """Delete a file or a whole directory/prefix; nothing when it is not there, or is gone by the time it is
    deleted (a listing may still show a prefix whose objects were just removed: SeaweedFS keeps an empty folder
    entry after a large delete, and another process may be deleting the same thing)."""
    fs, path = resolve(location)

    def remove() -> None:
        try:
            kind = fs.get_file_info(path).type
            if kind == pafs.FileType.Directory:
                fs.delete_dir(path)
            elif kind == pafs.FileType.File:
                fs.delete_file(path)
        except FileNotFoundError:
            pass

    _io(location, remove)


def sha256(location: str | os.PathLike) -> str:
    fs, path = resolve(str(location))

    def digest() -> str:
        h = hashlib.sha256()
        with fs.open_input_stream(path, compression=None) as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()

    return _io(str(location), digest)


def glob(pattern: str) -> list[str]:
    """Locations of the files matching a glob (`*`, `?`, `[...]` within a path component, `**` across them),
    sorted. For a bare path this is Python's glob; for a URI a listing below the last wildcard-free prefix."""
    import glob as pyglob

    if not is_uri(pattern):
        return sorted(pyglob.glob(str(Path(pattern).expanduser()), recursive=True))
    fs, path = resolve(pattern)
    parts = path.split("/")
    fixed = next((i for i, p in enumerate(parts) if any(c in p for c in "*?[")), len(parts))
    regex = _glob_regex(parts)
    found = _io(pattern, lambda: fs.get_file_info(pafs.FileSelector("/".join(parts[:fixed]), recursive=True,
                                                                    allow_not_found=True)))
    return sorted(location_of(fs, f.path, pattern) for f in found
                  if f.type == pafs.FileType.File and regex.fullmatch(f.path))


def _glob_regex(parts: list[str]) -> re.Pattern:
    """A regex for '/'-separated glob components: `**` spans any number of them, `*`, `?` and `[...]` one."""
    out = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            out.append(".*" if last else "(?:[^/]+/)*")
            continue
        j, comp = 0, ""
        while j < len(part):
            c = part[j]
            if c == "*":
                comp += "[^/]*"
            elif c == "?":
                comp += "[^/]"
            elif c == "[" and "]" in part[j + 1:]:
                k = part.index("]", j + 1)
                body = part[j + 1:k]
                comp += "[" + ("^" + body[1:] if body.startswith("!") else body) + "]"
                j = k
            else:
                comp += re.escape(c)
            j += 1
        out.append(comp + ("" if last else "/"))
    return re.compile("".join(out))


def download(location: str, dest: str | os.PathLike) -> Path:
    """Copy a file or a directory tree to a local path; returns it."""
    dest = Path(dest)
    fs, path = resolve(location)

    def copy() -> None:  # a retry copies everything again, over what a failed try left
        kind = fs.get_file_info(path).type
        if kind == pafs.FileType.NotFound:
            raise FileNotFoundError(f"{location} does not exist")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if kind == pafs.FileType.File:
            pafs.copy_files(path, str(dest), source_filesystem=fs, destination_filesystem=_local())
        else:
            dest.mkdir(parents=True, exist_ok=True)
            pafs.copy_files(path, str(dest), source_filesystem=fs, destination_filesystem=_local(),
                            use_threads=True)

    _io(location, copy)
    return dest


def native(location: str | os.PathLike) -> Path | str:
    """A Path for a bare local path, the URI string otherwise (what functions here return to callers)."""
    return str(location) if is_uri(location) else Path(location)


@contextlib.contextmanager
def local_copy(location: str | os.PathLike) -> Iterator[Path]:
    """A local path holding `location`: the path itself when it is on this machine, else a temporary copy
    (a checkpoint in Ray Train's storage on S3, say), removed afterwards."""
    location = str(location)
    if is_local(location):
        yield Path(resolve(location)[1])
        return
    tmp = Path(tempfile.mkdtemp(prefix="longtrain-"))
    try:
        yield download(location, tmp / basename(location))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------ the config's places
def storage_root(cfg: "Config") -> str:
    """run.storage, else $LONGTRAIN_STORAGE, else run.root: the one setting under which datasets, Ray Train
    checkpoints and MLflow artifacts go (each overridable: data.dataset_store, ray.storage_path,
    tracking.artifact_location)."""
    return absolute(cfg.run.storage or os.environ.get(STORAGE_ENV, "").strip() or cfg.run.root)


def dataset_store(cfg: "Config") -> str:
    """Where prepared datasets are cached by content hash: data.dataset_store, else <storage root>/datasets."""
    return absolute(cfg.data.dataset_store) if cfg.data.dataset_store else join(storage_root(cfg), "datasets")


def run_storage(cfg: "Config", run_dir: str | os.PathLike) -> str:
    """Where a run's workers write what the driver reads back (the stop request, the data audit) and, by
    default, Ray Train's checkpoints: the run directory itself, or with a URI storage root the same place
    under it (<root>/<run name>, <root>/tune/<sweep>/trials/<trial> for a directory below run.root)."""
    root = storage_root(cfg)
    if not is_uri(root):
        return absolute(run_dir)
    run_dir, runs = Path(absolute(run_dir)), Path(absolute(cfg.run.root))
    rel = run_dir.relative_to(runs).as_posix() if run_dir.is_relative_to(runs) else run_dir.name
    return join(root, rel)


def ray_storage(cfg: "Config", run_dir: str | os.PathLike) -> str:
    """Ray Train's storage_path: ray.storage_path, else <run storage>/ray."""
    return absolute(cfg.ray.storage_path) if cfg.ray.storage_path else join(run_storage(cfg, run_dir), "ray")


def artifact_location(cfg: "Config") -> str:
    """Artifacts of an MLflow experiment this project creates: tracking.artifact_location, else
    <storage root>/mlartifacts when the root is a URI, else "" (the local store's own, beside its database)."""
    if cfg.tracking.artifact_location:
        return absolute(cfg.tracking.artifact_location)
    root = storage_root(cfg)
    return join(root, "mlartifacts") if is_uri(root) else ""


def pin(cfg: "Config") -> "Config":
    """cfg with run.storage set from $LONGTRAIN_STORAGE and made absolute, for the config a run records and ships
    to its workers (which may run elsewhere, without this environment)."""
    root = cfg.run.storage or os.environ.get(STORAGE_ENV, "").strip()
    return cfg.replace({"run.storage": absolute(root)}) if root else cfg
