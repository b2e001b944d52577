"""Running out of space: a full disk (or a store that refuses for quota) said in one line that names the path, the
bytes needed and free, and what to do; and the room a run's checkpoints need, checked before its first step.

    with one_line_when_full(path, what="checkpoint", needed=n, fix=CHECKPOINT_FIX):   # writes that may fill the disk
        save(...)
    warn_if_no_room(location, each=ckpt_bytes, count=keep + 1, what="checkpoints", fix=CHECKPOINT_FIX)

A write that fails for lack of space leaves nothing counted as written (each writer removes its partial file or
folder: run.json, checkpoints, shards and exports are written to a temporary name and renamed), and the error
raised here is a StorageError: the CLI prints it as `error: <line>` and exits 2, and Ray Train does not retry it
(pipeline/train/distributed/failure_policy.py: another attempt would fill the disk again at the same place).

Which errors mean "full": an OSError with errno ENOSPC or EDQUOT anywhere in the exception's chain, or their text as
libraries that do not keep the errno put it (safetensors' "No space left on device (os error 28)", SQLite's
"database or disk is full", an S3 store's QuotaExceeded); and, for a writer that hides the cause (torch.save's zip
writer raises "unexpected pos" when a write came up short), a failure while the disk had less free space than the
write needed (`needed`).
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Iterator

from pipeline.console import size_text
from pipeline.ray_runtime import exception_chain
from pipeline.storage import StorageError, is_local, resolve
from pipeline.storage_faults import FULL

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)

# What to do besides freeing space, per kind of write (the settings that put it elsewhere or make it smaller), and
# what then continues it.
CHECKPOINT_FIX = ("point run.root (or ray.storage_path) at a larger disk, or lower train.keep_checkpoints",
                  "then continue with --resume")
DATASET_FIX = ("point data.dataset_store (or run.storage) at a larger disk", "then run it again")
RUN_RECORD_FIX = ("point run.root at a larger disk", "then continue with --resume")
TRACKING_FIX = ("point tracking.tracking_uri (or run.root) at a larger disk", "then continue with --resume")
EXPORT_FIX = ("pass --out a folder on a larger disk", "then export again")
SCRATCH_FIX = ("set TMPDIR on each node to a folder on a larger disk (a Ray Train worker writes each checkpoint there "
               "before it uploads it)", "then continue with --resume")


class DiskFullError(StorageError):
    """A write failed for lack of space (or quota); one line naming the path, the bytes and the fix."""

    repeats_on_retry = True  # Ray Train: another attempt would fill the disk again (failure_policy.py)


def _chain_text(exc: BaseException | None) -> str:
    return "\n".join(str(e) for e in exception_chain(exc))


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether `exc` (or anything in its chain) says the disk or the quota is full."""
    return any(isinstance(e, DiskFullError) or (isinstance(e, OSError) and e.errno in _FULL_ERRNOS)
               or FULL.search(str(e)) for e in exception_chain(exc))


def _existing(path: Path) -> Path:
    """`path`, or its nearest parent that exists (a folder about to be created)."""
    for place in (path, *path.parents):
        if place.exists():
            return place
    return path


def free_bytes(location: str | os.PathLike) -> int | None:
    """Bytes free for this process on the filesystem of a local `location` (its nearest existing parent), None on
    object storage (no such figure) or when it cannot be read."""
    if not is_local(location):
        return None
    try:
        return shutil.disk_usage(_existing(Path(resolve(location)[1]))).free
    except OSError:
        return None


def _mount_of(path: Path) -> Path:
    path = _existing(path).resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def disk_full_error(location: str | os.PathLike, what: str, fix: tuple[str, str], needed: int | None = None,
                    exc: BaseException | None = None) -> DiskFullError:
    """The one line: where, what needed how much of how much free, and what to do (`fix`: one of the *_FIX pairs
    above, what else to do and what then)."""
    location = str(location)
    elsewhere, then = fix
    if not is_local(location):
        found = FULL.search(_chain_text(exc))
        why = f" ({found.group(0)})" if found else ""
        return DiskFullError(f"the store at {location} refused {what} for lack of space or quota{why}; free space "
                             f"there or raise its quota, or {elsewhere}; {then}")
    path = Path(resolve(location)[1])
    try:
        usage = shutil.disk_usage(_existing(path))
        room = f"{size_text(usage.free)} free of {size_text(usage.total)}"
    except OSError:
        room = "free space unknown"
    need = f"needs ~{size_text(needed)}, " if needed else ""
    return DiskFullError(f"no space left on {_mount_of(path)} for {what} {path} ({need}{room}); free space there, or "
                         f"{elsewhere}; {then}")


@contextlib.contextmanager
def one_line_when_full(location: str | os.PathLike, what: str, fix: tuple[str, str],
                       needed: int | None = None) -> Iterator[None]:
    """Run the block; an error in it that is a full disk (is_disk_full, or any error while the disk had less free
    than `needed` bytes when the block began) becomes DiskFullError, from None: no traceback. Any other error passes
    unchanged. The block removes what it wrote partly itself (see the module docstring)."""
    before = free_bytes(location) if needed else None
    try:
        yield
    except BaseException as exc:  # a DiskFullError from below too: this caller says better what it wrote
        short = needed is not None and before is not None and before < needed and not isinstance(
            exc, (KeyboardInterrupt, SystemExit))
        if is_disk_full(exc) or short:
            raise disk_full_error(location, what, fix, needed, exc) from None
        raise


def warn_if_no_room(location: str | os.PathLike, each: int, count: int, what: str,
                    fix: tuple[str, str]) -> str | None:
    """Print (and return) one `warning:` line when the filesystem of a local `location` has less free than `count`
    writes of `each` bytes: a run that would fill its disk at its third checkpoint says so before its first step.
    Nothing on object storage (no free figure) or when there is room."""
    free = free_bytes(location)
    if free is None or free >= each * count:
        return None
    path = Path(resolve(str(location))[1])
    line = (f"warning: {_mount_of(path)} has {size_text(free)} free, and {what} need room for {count} of "
            f"~{size_text(each)} ({size_text(each * count)}) at {path}: the run would stop when they fill it; free "
            f"space there, or {fix[0]}")
    print(line, flush=True)
    return line
