"""Builds of a dataset directory, safe on object storage (no rename, no lock) as on a local disk.

Every prepare attempt writes into a build directory of its own, and the manifest, written last in one piece,
names only that build's files:

    <dataset>/manifest.json              the dataset: names build-<id>/train-00000.parquet, build-<id>/tokenizer.model
    <dataset>/build-<id>/                one attempt's tokenizer.model, train-*.parquet, val-*.parquet, _parts/
    <dataset>/build-<id>.lease           who writes that build (host, pid), rewritten every LEASE_REFRESH_S while it
                                         runs; `finished` once its manifest is written

So a dataset becomes visible only when its manifest is written; a prepare killed midway leaves no manifest
(the rerun is a new build); two prepares of the same dataset at once each write their own files, and whichever
manifest lands last names a complete build: neither can leave a manifest pointing at the other's half-written or
deleted files. Readers trust only the manifest (and validate checks every file's sha256 against it).

Cleanup (`remove_stale`, before a build and after its manifest) removes a build directory the manifest does
not name (the manifest is read after the listing), when its lease says it is not being written any more: its
owner is gone (same machine and the process is dead, or no refresh for LEASE_TTL_S), or it finished another
dataset (settings changed in place), or it finished this one more than LEASE_TTL_S ago (a prepare that lost a
race to write the manifest). Never a build the manifest names, never one a live prepare is writing.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from pipeline import storage_faults as faults
from pipeline.data.shards import MANIFEST_FILE, DatasetError, Manifest, load_manifest
from pipeline.storage import basename, delete, join, listdir, read_bytes, resolve, write_bytes

BUILD_PREFIX = "build-"
LEASE_SUFFIX = ".lease"
LEASE_REFRESH_S = 30.0
LEASE_TTL_S = 600.0
# Files of the layout before build directories (and of interrupted writes): removed when no manifest names them.
_OLD_PATTERNS = ("train-", "val-", "tokenizer.model", "_parts", ".hold-", ".write-probe-", ".manifest.json.tmp")


def machine_id() -> str:
    """This machine and PID namespace: a lease with the same id names a process `os.kill(pid, 0)` can see."""
    boot = ""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        pass
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    return f"{socket.gethostname()}/{boot}/{pidns}"


def _process_start(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


class Build:
    """One prepare attempt's build directory and its lease (written before anything else of the build, then
    refreshed by a daemon thread until `finish` or `stop`)."""

    def __init__(self, dataset: str, key: str):
        self.dataset, self.key = dataset, key
        self.name = f"{BUILD_PREFIX}{time.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:8]}"
        self.dir = join(dataset, self.name)
        self.lease = join(dataset, self.name + LEASE_SUFFIX)
        self._stop = threading.Event()
        self._write_lease("running")
        self._thread = threading.Thread(target=self._refresh, name="dataset-build-lease", daemon=True)
        self._thread.start()

    def _write_lease(self, state: str) -> None:
        pid = os.getpid()
        write_bytes(self.lease, json.dumps({"build": self.name, "key": self.key, "state": state, "time": time.time(),
                                            "machine": machine_id(), "pid": pid,
                                            "pid_start": _process_start(pid)}).encode())

    def _refresh(self) -> None:
        while not self._stop.wait(LEASE_REFRESH_S):
            try:
                self._write_lease("running")
            except Exception:  # noqa: BLE001 -- a missed refresh is retried; the TTL is 20 refreshes long
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def verify(self, manifest: Manifest) -> None:
        """DatasetError unless every file the manifest names is in this build (another prepare's cleanup would
        have had to judge this build dead: say so rather than publish a manifest naming missing files)."""
        _, base = resolve(self.dataset)
        present = {f.path[len(base) + 1:] for f in listdir(self.dir, recursive=True)}
        wanted = [s.file for lst in manifest.shards.values() for s in lst] + [manifest.tokenizer_file]
        lost = [f for f in wanted if f not in present]
        if lost:
            raise DatasetError(f"build {self.dir} lost {len(lost)} of its files (e.g. {lost[0]}) while it ran: another "
                               "prepare judged it dead (was this process paused longer than "
                               f"{LEASE_TTL_S:.0f} s?); run prepare again")

    def finish(self) -> None:
        """The manifest names this build now: mark the lease finished (it stays, for cleanup's grace period)."""
        self.stop()
        self._write_lease("finished")

    def abandon(self) -> None:
        """Remove this build (it failed, or another prepare's manifest won); best effort."""
        self.stop()
        try:
            with faults.retry_window_of(0):  # no waiting for a store that is away: a later cleanup removes it
                delete(self.dir)
                delete(self.lease)
        except Exception:  # noqa: BLE001 -- what is left is removed by a later cleanup (owner gone)
            pass


def _lease(dataset: str, name: str) -> dict[str, Any] | None:
    try:
        return json.loads(read_bytes(join(dataset, name + LEASE_SUFFIX)))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def _writer_gone(lease: dict[str, Any], now: float) -> bool:
    if now - float(lease.get("time", 0)) > LEASE_TTL_S:
        return True
    if lease.get("machine") != machine_id():
        return False  # another machine: only the TTL can tell
    start = _process_start(int(lease.get("pid", -1)))
    return start is None or lease.get("pid_start") is None or abs(start - float(lease["pid_start"])) > 1.0


def removable(lease: dict[str, Any] | None, key: str | None, now: float) -> bool:
    """Whether a build the manifest does not name may be removed (see the module docstring)."""
    if lease is None:
        return True  # the lease is written before the build's first file and removed after its last
    if lease.get("state") == "finished":
        return lease.get("key") != key or now - float(lease.get("time", 0)) > LEASE_TTL_S
    return _writer_gone(lease, now)


def remove_stale(dataset: str) -> list[str]:
    """Remove builds and leftover files no manifest names and no live prepare writes; returns their names."""
    entries = [basename(e.path) for e in listdir(dataset)]
    try:  # read after listing: a build that got its manifest before the listing is seen as named here
        manifest = load_manifest(dataset)
        named = {f.split("/", 1)[0] for f in [manifest.tokenizer_file]
                 + [s.file for lst in manifest.shards.values() for s in lst]}
        key = manifest.settings_hash
    except DatasetError:
        named, key = set(), None
    now, removed = time.time(), []
    builds = {e for e in entries if e.startswith(BUILD_PREFIX) and not e.endswith(LEASE_SUFFIX)}
    builds |= {e[:-len(LEASE_SUFFIX)] for e in entries if e.startswith(BUILD_PREFIX) and e.endswith(LEASE_SUFFIX)}
    for name in sorted(builds - named):
        if removable(_lease(dataset, name), key, now):
            delete(join(dataset, name))  # the files first, the lease last: a half-removed build has no lease left
            delete(join(dataset, name + LEASE_SUFFIX))
            removed.append(name)
    for name in entries:
        if name not in named and name != MANIFEST_FILE and name.startswith(_OLD_PATTERNS):
            delete(join(dataset, name))
            removed.append(name)
    return removed
